"""The data order: which task a step takes, the same in every run with the same seed."""

from __future__ import annotations

import random


def data_order(position: int, num_tasks: int | None, seed: int) -> int:
    """Task index at a global position of the data order.

    Endless tasksets are read in order; a finite one is reshuffled every pass (seeded by the pass
    number), so position p lies in pass ``p // num_tasks`` and resuming at a step boundary
    continues the same pass (case C7).
    """
    if num_tasks is None:
        return position
    epoch, offset = divmod(position, num_tasks)
    order = list(range(num_tasks))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[offset]
