"""Data order (``worker/orchestrator/data.py``): passes are permutations and resume continues the same order (C7)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.orchestrator.data import data_order

NUM_TASKS, PER_STEP, STEPS, SEED = 16, 4, 8, 0


def _step_indices(step: int, num_tasks: int | None = NUM_TASKS, seed: int = SEED) -> list[int]:
    """Task indices of 1-based ``step``, as the orchestrator computes them (positions (step-1)*size .. step*size-1)."""
    return [data_order(p, num_tasks, seed) for p in range((step - 1) * PER_STEP, step * PER_STEP)]


def test_c7_two_passes_each_cover_every_task_once() -> None:
    run = {step: _step_indices(step) for step in range(1, STEPS + 1)}
    first = [i for s in range(1, 5) for i in run[s]]
    second = [i for s in range(5, 9) for i in run[s]]
    assert sorted(first) == list(range(NUM_TASKS))
    assert sorted(second) == list(range(NUM_TASKS))
    assert first != second  # the second pass is reshuffled
    assert first != list(range(NUM_TASKS))  # and the first is shuffled at all


def test_c7_resume_at_pass_boundary_continues_second_pass() -> None:
    uninterrupted = [_step_indices(step) for step in range(5, 9)]
    # a resumed orchestrator knows only the checkpointed cursor (step 4 * 4 tasks = 16) and the seed
    cursor = 4 * PER_STEP
    resumed = [
        [data_order(p, NUM_TASKS, SEED) for p in range(cursor + k * PER_STEP, cursor + (k + 1) * PER_STEP)]
        for k in range(4)
    ]
    assert resumed == uninterrupted
    # the resumed steps are pass 2, not a repeat of pass 1
    assert [i for s in resumed for i in s] != [i for s in range(1, 5) for i in _step_indices(s)]


def test_same_seed_same_order_other_seed_differs() -> None:
    a = [data_order(p, NUM_TASKS, 7) for p in range(64)]
    assert a == [data_order(p, NUM_TASKS, 7) for p in range(64)]
    assert a != [data_order(p, NUM_TASKS, 8) for p in range(64)]


def test_endless_taskset_reads_in_order() -> None:
    assert [data_order(p, None, 0) for p in (0, 1, 5, 16, 17, 10**9)] == [0, 1, 5, 16, 17, 10**9]
    assert [data_order(p, None, 123) for p in range(10)] == list(range(10))


def test_single_task() -> None:
    assert [data_order(p, 1, 3) for p in range(5)] == [0, 0, 0, 0, 0]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(0, 1000), st.integers(0, 2**32))
def test_every_pass_is_a_permutation(num_tasks: int, epoch: int, seed: int) -> None:
    start = epoch * num_tasks
    got = [data_order(p, num_tasks, seed) for p in range(start, start + num_tasks)]
    assert sorted(got) == list(range(num_tasks))
