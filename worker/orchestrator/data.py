"""The data order: which task a step takes, the same in every run with the same seed."""

from __future__ import annotations

import random
from functools import lru_cache


@lru_cache(maxsize=4)
def _pass_order(num_tasks: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The shuffled task order of one pass, computed once per pass (not once per position)."""
    order = list(range(num_tasks))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def data_order(position: int, num_tasks: int | None, seed: int) -> int:
    """Task index at a global position of the data order.

    Endless tasksets are read in order; a finite one is reshuffled every pass (seeded by the pass
    number), so position p lies in pass ``p // num_tasks`` and resuming at a step boundary
    continues the same pass (case C7).
    """
    if num_tasks is None:
        return position
    epoch, offset = divmod(position, num_tasks)
    return _pass_order(num_tasks, seed, epoch)[offset]
