"""Continuous admission (``orchestrator.admission = "continuous"``): a fixed number of rollout groups in flight, each
step's batch built from the groups that finished first.

Under ``step`` admission (the default) step n starts its ``batch_size`` groups together once its start gate opens
and its batch waits for the slowest of them; batches are written in step order, so a slow group holds every finished
group of its step and the server sees far fewer requests than the gate allows (``benchmarks/README.md``, session 16:
a zero-cost orchestrator at most ~1,500-1,650 rollouts/s at 4,096 in flight). Under ``continuous`` admission:

| what                  | rule                                                                                          |
|-----------------------|-----------------------------------------------------------------------------------------------|
| groups in flight      | ``N = orchestrator.groups_in_flight()`` (``inflight_groups``, default ``batch_size * (max_async_level + 1)``); a group holds its slot from its start until it finishes |
| start gate            | a group starts when a slot is free and inference serves a version ``>= min_start_version(n, ...)``, n the step whose batch is filling (``staleness.py``): no group starts further behind than under ``step`` admission |
| tasks                 | taken from the data order in chunks of ``batch_size`` once every task of the last chunk started: ``sampler.take(n, batch_size)`` keyed by the step n filling then (several chunks may share a key); a chunk's task at slot s has the global position ``p = p0 + s``, ``p0`` the tasks handed out before it (``EnvMixture.position``: the sum of the environments' cursors) |
| environment (``[[env]]``) | position p draws ``choose_env(.., CONTINUOUS_SEED, p)`` (``mixture.py``)                  |
| request seed          | the group at position p: ``request_seed(seed, CONTINUOUS_SEED, p)`` (:data:`CONTINUOUS_SEED` = -2 keeps it apart from steps' ``(n, s)`` and evals' ``(-1, v)``); a resumed run gives a position the seed and environment the uninterrupted run gave it |
| ready queue           | finished groups in finish order, each tagged with ``v_start``: the oldest ``policy_span[0]`` of its rollouts (``Rollout.policy_span``) |
| batch of step n       | the first ``batch_size`` queued groups whose lag ``(n - 1) - v_start <= max_off_policy_steps``; a queued group lagging more is dropped, never trained, and counted in step n's ``admission_dropped_stale_groups`` |
| curriculum            | ``standard`` only (the spec refuses ``difficulty_pool``); step n's taken groups are observed in batch order |
| gates                 | refused by the spec (a gate's re-sampling rounds are per step)                                |
| live config           | applied at each step boundary (when step n's batch starts filling): groups started from then on run with it, groups started before keep the spec they started with, and step n's batch is built with it |
| checkpoint of step k  | the data cursor right after the last chunk taken before step k's batch was complete (``TaskSampler.write_state``: the last take keyed <= k): the groups of those chunks still running, queued or not started then are not in the checkpoint, and a resumed run never starts their tasks again (it skips them); chunks taken later are taken again |

A group started under the gate (at most ``min(max_async_level, max_off_policy_steps)`` versions behind the step filling
then) may land in a later step's batch when others finish first, so a trained group's lag can exceed
``max_async_level`` (up to ``max_off_policy_steps``, the bound that drops it): set ``max_off_policy_steps`` to the lag
you accept. Which group lands in which batch depends on finish order, so a run under continuous admission is not repeatable the
way a ``step`` run is (each request still is: its seed is its position).

:class:`AdmissionQueue` holds the slot accounting and the ready queue, with no asyncio in it; the orchestrator's
``produce_continuous`` drives it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from worker.orchestrator.staleness import admitted

T = TypeVar("T")
"""A task: ``(env index, task index)`` in the orchestrator."""
G = TypeVar("G")
"""A finished group: its list of ``Rollout`` in the orchestrator."""

CONTINUOUS_SEED = -2
"""First part of a continuous-admission group's request seed, ``request_seed(seed, CONTINUOUS_SEED, position)``, and
of its environment draw (``mixture.choose_env``)."""


@dataclass(frozen=True)
class Start(Generic[T]):
    """A group to start: task ``task`` at global position ``position`` of the data order."""

    position: int
    task: T


@dataclass(frozen=True)
class Finished(Generic[T, G]):
    """A finished group in the ready queue: where it started, its group and the version it started under."""

    start: Start[T]
    group: G
    v_start: int


@dataclass
class Taken(Generic[T, G]):
    """Step ``step``'s batch: its groups in finish order and the stale groups dropped while it filled (finished,
    never trained: the bias metrics count them among the finished ones, case C26)."""

    step: int
    groups: list[Finished[T, G]]
    stale: list[Finished[T, G]] = field(default_factory=list)

    @property
    def dropped_stale(self) -> int:
        """Stale groups dropped while this batch filled."""
        return len(self.stale)


@dataclass
class AdmissionQueue(Generic[T, G]):
    """Slots, the tasks of taken chunks not yet started, and the ready queue of finished groups (module docstring).

    ``slots``: groups kept in flight (it may change at a step boundary: a live ``batch_size``); ``next_step``: the step
    whose batch fills next.
    """

    slots: int
    next_step: int
    running: int = 0
    todo: deque[Start[T]] = field(default_factory=deque)
    ready: deque[Finished[T, G]] = field(default_factory=deque)
    _stale: list[Finished[T, G]] = field(default_factory=list)

    def needs_chunk(self) -> bool:
        """True when every task of the chunks taken so far has started."""
        return not self.todo

    def add_chunk(self, first: int, tasks: Sequence[T]) -> None:
        """Queue the tasks of the next chunk, in order: slot s at global position ``first + s``."""
        self.todo.extend(Start(first + slot, task) for slot, task in enumerate(tasks))

    def free(self) -> int:
        """Slots free now (never negative: a live change may lower ``slots`` below the groups running)."""
        return max(0, self.slots - self.running)

    def start(self) -> Start[T] | None:
        """The next task to start, its slot taken; None when no slot is free or no task is queued."""
        if not self.free() or not self.todo:
            return None
        self.running += 1
        return self.todo.popleft()

    def finish(self, start: Start[T], group: G, v_start: int) -> None:
        """Group ``start`` finished under versions from ``v_start`` on: its slot frees, it joins the ready queue."""
        self.running -= 1
        self.ready.append(Finished(start, group, v_start))

    def take(self, step: int, batch_size: int, max_off_policy_steps: int) -> Taken[T, G] | None:
        """Step ``step``'s batch when ``batch_size`` fresh groups are ready, else None (call again when one finishes).

        Every queued group whose lag ``(step - 1) - v_start`` exceeds ``max_off_policy_steps`` is dropped now (it only
        gets staler) and returned with this step's batch (``stale``); the fresh ones keep their finish order.

        Raises:
            ValueError: ``step`` is not ``next_step`` (batches are taken in step order, each once).
        """
        if step != self.next_step:
            raise ValueError(f"continuous admission: batch of step {step} asked, step {self.next_step} fills next")
        fresh: deque[Finished[T, G]] = deque()
        for f in self.ready:
            if admitted((step - 1) - f.v_start, max_off_policy_steps):
                fresh.append(f)
            else:
                self._stale.append(f)
        self.ready = fresh
        if len(fresh) < batch_size:
            return None
        taken = Taken(step, [fresh.popleft() for _ in range(batch_size)], stale=self._stale)
        self._stale = []
        self.next_step += 1
        return taken


def group_start_version(spans: Sequence[tuple[int, int]], started_at: int) -> int:
    """``v_start`` of a finished group: the oldest ``policy_span[0]`` of its rollouts (``started_at``, the version
    served when it started, for a group without rollouts)."""
    return min((span[0] for span in spans), default=started_at)
