"""The orchestrator process's cyclic garbage collector: when it may stop the event loop, and for how long.

CPython's collector stops the whole process while it scans, and a full (generation 2) collection scans every container
alive, visiting each element of each list. In the orchestrator at 4,096 rollouts in flight that is ~64,000 containers
(token-id and log-prob lists of the rollouts in flight and of the step's batch, ~20,000 of them lists), and a full
collection took 34-94 ms, triggered by the allocation rate a few times a step; before the process's start-up heap
(imports, tokenizer) was set aside it took ~0.4 s (``benchmarks/orchestrator_scale.py``, ``gc_ms_by_generation``).
The rollouts die by reference counting, not cycles, so nearly all of that scanning finds nothing.

| when                         | what                                                                                |
|------------------------------|-------------------------------------------------------------------------------------|
| once, before the event loop  | :func:`settle`: collect, ``gc.freeze`` the start-up heap (never scanned again), and no automatic full collection (generation 2's threshold out of reach) |
| after every step's batch     | :func:`after_step`: a full collection every ``FULL_COLLECTION_EVERY`` steps, so cyclic garbage (an exception's traceback, say) lives at most that long |
| always                       | generations 0 and 1 as CPython sets them (0.1-17 ms each at 4,096 in flight)         |
"""

from __future__ import annotations

import gc

FULL_COLLECTION_EVERY = 50
"""Steps between two full collections of what the run made (:func:`after_step`)."""
NO_AUTOMATIC_FULL = 1 << 30
"""Generation 2's threshold under :func:`settle`: generation-1 collections before an automatic full one (never)."""


def settle() -> None:
    """Collect, move every object alive now out of the collector's reach (``gc.freeze``), and leave full collections
    to :func:`after_step`. Call once per process, before its event loop starts (a process that also runs other work,
    such as a test session, should not call it)."""
    gc.collect()
    gc.freeze()
    first, second, _ = gc.get_threshold()
    gc.set_threshold(first, second, NO_AUTOMATIC_FULL)


def after_step(step: int, every: int | None = None) -> bool:
    """A full collection of the objects made since :func:`settle` when ``step`` is a multiple of ``every`` (None:
    ``FULL_COLLECTION_EVERY``, read at the call).

    Returns:
        True when it collected.
    """
    if step % (every or FULL_COLLECTION_EVERY):
        return False
    gc.collect()
    return True
