"""The data order: which task a step takes, the same in every run with the same seed, and the saved cursor in it."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from worker.orchestrator.curriculum import POOLS, DifficultyPool
from worker.spec import CurriculumConfig, DifficultyPoolCurriculum


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
    skips tasks). A step that reserves spare tasks for its gates (``spares``) takes them right after its own;
    those it does not use are skipped.

    With ``curriculum.type = "difficulty_pool"`` the step's tasks are drawn by ``pool``
    (``worker/orchestrator/curriculum.py``) instead; the cursor still counts the tasks handed out, and the pool's
    state is saved next to it.
    """

    def __init__(self, num_tasks: int | None, seed: int, cursor: int = 0, pool: DifficultyPool | None = None) -> None:
        self.num_tasks, self.seed, self.cursor, self.pool = num_tasks, seed, cursor, pool
        self._cursor_after: dict[int, int] = {}

    @classmethod
    def resume(
        cls,
        part_dir: Path,
        *,
        step: int,
        num_tasks: int | None,
        seed: int,
        batch_size: int,
        curriculum: CurriculumConfig | None = None,
        max_async_level: int = 0,
    ) -> TaskSampler:
        """The sampler of a run resumed at checkpoint ``step`` (0: a fresh run), read from its orchestrator part.

        A checkpoint written before the cursor was saved (no ``data_cursor`` in ``state.json``, or no
        file) falls back to ``step * batch_size``, exact unless ``batch_size`` changed since. A
        ``difficulty_pool`` curriculum restores its pass rates from the part (``curriculum``; every task unseen
        when the part has none).

        Raises:
            ValueError: ``difficulty_pool`` with an endless taskset (``num_tasks`` None).
        """
        state_file = part_dir / STATE_FILE
        state = json.loads(state_file.read_text()) if step > 0 and state_file.is_file() else {}
        cursor = state.get("data_cursor", step * batch_size)
        pool = None
        if isinstance(curriculum, DifficultyPoolCurriculum):
            if num_tasks is None:
                raise ValueError(
                    "orchestrator.curriculum.type: difficulty_pool needs a finite taskset, and this one yields train "
                    "tasks forever (set its size, e.g. env.args.num_train)"
                )
            pool = DifficultyPool.from_state(
                state.get("curriculum"), num_tasks=num_tasks, seed=seed, lag=max_async_level, step=step
            )
        return cls(num_tasks, seed, cursor=int(cursor), pool=pool)

    def take(
        self, step: int, batch_size: int, spares: int = 0, curriculum: CurriculumConfig | None = None
    ) -> list[int]:
        """The task indices of trainer step ``step`` (steps are taken in order), then its ``spares`` spare tasks;
        advances the cursor by both. ``curriculum``: the step's ``[orchestrator.curriculum]`` (its weights may have
        changed live)."""
        start, self.cursor = self.cursor, self.cursor + batch_size + spares
        self._cursor_after[step] = self.cursor
        if self.pool is not None and isinstance(curriculum, DifficultyPoolCurriculum):
            return self.pool.draw(step, batch_size + spares, curriculum)
        return [data_order(p, self.num_tasks, self.seed) for p in range(start, self.cursor)]

    def observe(
        self, step: int, groups: Sequence[tuple[int, Sequence[float | None]]], curriculum: CurriculumConfig
    ) -> dict[str, Any]:
        """Feed step ``step``'s scored groups ``(task index, rewards)`` (every group started, rejected ones too) to
        the curriculum, in step order.

        Returns:
            The step's curriculum metrics: ``pool_size_<pool>`` (tasks in each pool when its tasks were drawn);
            empty for the standard curriculum.
        """
        if self.pool is None or not isinstance(curriculum, DifficultyPoolCurriculum):
            return {}
        self.pool.observe(step, groups, curriculum)
        sizes = self.pool.sizes.pop(step, None)
        return {f"pool_size_{p}": sizes[p] for p in POOLS} if sizes is not None else {}

    def write_state(self, part_dir: Path, step: int) -> None:
        """Write ``state.json`` of checkpoint ``step`` into ``part_dir``: the cursor right after step ``step``'s tasks
        (the producer may already have taken later steps) and the curriculum's state after step ``step``.

        The cursor is the one after the last ``take`` keyed ``<= step``: step ``step``'s own, or under continuous
        admission (chunks keyed by the step filling when they were taken: ``worker/orchestrator/admission.py``) the
        last chunk taken before step ``step``'s batch was complete; that take's cursor stays for a later checkpoint.
        """
        key = max(s for s in self._cursor_after if s <= step)
        cursor = self._cursor_after[key]
        for done in [s for s in self._cursor_after if s < key]:
            del self._cursor_after[done]
        state: dict[str, Any] = {"step": step, "data_cursor": cursor, "seed": self.seed}
        if self.pool is not None:
            state["curriculum"] = self.pool.state_dict()
        (part_dir / STATE_FILE).write_text(json.dumps(state))
