"""The data order: which task a step takes, the same in every run with the same seed, and the saved cursor in it."""

from __future__ import annotations

import hashlib
import json
import random
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=4)
def _pass_order(num_tasks: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The shuffled task order of one pass, computed once per pass (not once per position)."""
    order = list(range(num_tasks))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def request_seed(seed: int, *parts: int) -> int:
    """The vLLM sampling seed of one request, from the run's ``seed`` and where the request stands
    (e.g. ``(step, slot in the batch)``, ``(eval step, task index)``, then rollout and turn).

    Seeded requests make a run repeatable: vLLM draws each seeded request's samples from its own generator,
    so they do not depend on which other requests share a batch (unseeded requests share one generator and do).

    Returns:
        An integer in ``[0, 2**31)`` (vLLM accepts any int; 31 bits fit every backend's generator).
    """
    digest = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


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


STATE_FILE = "state.json"
"""The orchestrator part of a checkpoint: ``checkpoints/step_k/orchestrator/state.json``."""


class TaskSampler:
    """Hands out each step's task indices in the data order, from a cursor saved with every orchestrator checkpoint.

    The cursor is the number of tasks (groups) handed out so far, i.e. the next position of the data
    order. Step n takes positions ``[cursor, cursor + batch_size)`` with the ``batch_size`` in effect for
    it, so a run resumed or forked from step k continues right after the tasks its parent trained up to
    step k, whatever ``orchestrator.batch_size`` it runs with (a fork that changes it neither repeats nor
    skips tasks).
    """

    def __init__(self, num_tasks: int | None, seed: int, cursor: int = 0) -> None:
        self.num_tasks, self.seed, self.cursor = num_tasks, seed, cursor
        self._cursor_after: dict[int, int] = {}

    @classmethod
    def resume(cls, part_dir: Path, *, step: int, num_tasks: int | None, seed: int, batch_size: int) -> TaskSampler:
        """The sampler of a run resumed at checkpoint ``step`` (0: a fresh run), read from its orchestrator part.

        A checkpoint written before the cursor was saved (no ``data_cursor`` in ``state.json``, or no
        file) falls back to ``step * batch_size``, exact unless ``batch_size`` changed since.
        """
        state_file = part_dir / STATE_FILE
        state = json.loads(state_file.read_text()) if step > 0 and state_file.is_file() else {}
        cursor = state.get("data_cursor", step * batch_size)
        return cls(num_tasks, seed, cursor=int(cursor))

    def take(self, step: int, batch_size: int) -> list[int]:
        """The task indices of trainer step ``step`` (steps are taken in order); advances the cursor."""
        start, self.cursor = self.cursor, self.cursor + batch_size
        self._cursor_after[step] = self.cursor
        return [data_order(p, self.num_tasks, self.seed) for p in range(start, self.cursor)]

    def write_state(self, part_dir: Path, step: int) -> None:
        """Write ``state.json`` of checkpoint ``step`` into ``part_dir``: the cursor right after step ``step``'s tasks
        (the producer may already have taken later steps)."""
        cursor = self._cursor_after.pop(step)
        for done in [s for s in self._cursor_after if s < step]:
            del self._cursor_after[done]
        state = {"step": step, "data_cursor": cursor, "seed": self.seed}
        (part_dir / STATE_FILE).write_text(json.dumps(state))
