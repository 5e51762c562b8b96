"""Data order (``worker/orchestrator/data.py``): passes are permutations, resume continues the same order (C7), a fork
with another batch_size continues after the parent's saved cursor."""

from __future__ import annotations

import json
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.envs import load_environment
from worker.orchestrator.advantages import make_advantage
from worker.orchestrator.data import TaskSampler, data_order, request_seed
from worker.orchestrator.orchestrator import Orchestrator
from worker.run.rundir import RunDir
from worker.spec import GrpoAdvantage

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


# ----------------------------------------------------------------------------- the saved cursor (fork, resume)


def _train_steps(sampler: TaskSampler, env, steps: range, batch_size: int) -> list[list[str]]:
    return [[env.task(i).key for i in sampler.take(step, batch_size)] for step in steps]


def test_fork_with_another_batch_size_continues_after_the_parents_cursor(tmp_path) -> None:
    env = load_environment("reverse_text", split="train", seed=0, num_train=10)
    parent = RunDir(tmp_path / "parent")
    sampler = TaskSampler(env.num_tasks, seed=0)
    # the parent trains 3 steps of batch_size 3 (positions 0..8 of the first pass), then checkpoints step 3
    assert _train_steps(sampler, env, range(1, 4), 3) == [
        ["train/0/7", "train/0/8", "train/0/1"],
        ["train/0/5", "train/0/3", "train/0/4"],
        ["train/0/2", "train/0/0", "train/0/9"],
    ]
    grpo = make_advantage(GrpoAdvantage())  # stateless: writes no advantage_state.json
    Orchestrator.save_state(SimpleNamespace(run=parent, sampler=sampler, advantage=grpo), 3)  # reads these only
    state = json.loads((parent.checkpoint_dir(3) / "orchestrator" / "state.json").read_text())
    assert state == {"step": 3, "data_cursor": 9, "seed": 0}
    # the fork resumes step 3 with batch_size 4: positions 9..16, i.e. the last task of the first pass
    # (train/0/6, the one the parent had not reached) then the reshuffled second pass
    fork = TaskSampler.resume(parent.checkpoint_dir(3) / "orchestrator", step=3, num_tasks=10, seed=0, batch_size=4)
    assert _train_steps(fork, env, range(4, 6), 4) == [
        ["train/0/6", "train/0/6", "train/0/8", "train/0/9"],
        ["train/0/7", "train/0/5", "train/0/3", "train/0/0"],
    ]
    # recomputed from the fork's batch_size (3 * 4 = 12) it would have skipped train/0/6 and 2 second-pass tasks


def test_resume_reads_the_cursor_and_old_checkpoints_fall_back_to_step_times_batch_size(tmp_path) -> None:
    part = tmp_path / "orchestrator"
    part.mkdir()
    assert TaskSampler.resume(part, step=4, num_tasks=16, seed=0, batch_size=4).cursor == 16  # no state.json
    (part / "state.json").write_text(json.dumps({"step": 4, "seed": 0}))  # written before the cursor was read
    assert TaskSampler.resume(part, step=4, num_tasks=16, seed=0, batch_size=4).cursor == 16
    (part / "state.json").write_text(json.dumps({"step": 4, "data_cursor": 10, "seed": 0}))
    resumed = TaskSampler.resume(part, step=4, num_tasks=16, seed=0, batch_size=4)
    assert resumed.take(5, 4) == [data_order(p, 16, 0) for p in range(10, 14)]
    assert TaskSampler.resume(part, step=0, num_tasks=16, seed=0, batch_size=4).cursor == 0  # a fresh run


def test_c7_sampler_resumed_at_pass_boundary_equals_uninterrupted_run(tmp_path) -> None:
    run = TaskSampler(NUM_TASKS, SEED)
    uninterrupted = [run.take(step, PER_STEP) for step in range(1, STEPS + 1)]
    assert uninterrupted == [_step_indices(step) for step in range(1, STEPS + 1)]
    first = TaskSampler(NUM_TASKS, SEED)
    for step in range(1, 5):
        first.take(step, PER_STEP)
    first.take(5, PER_STEP)  # the producer may run a step ahead of the checkpoint
    first.write_state(tmp_path, 4)
    resumed = TaskSampler.resume(tmp_path, step=4, num_tasks=NUM_TASKS, seed=SEED, batch_size=PER_STEP)
    assert [resumed.take(step, PER_STEP) for step in range(5, 9)] == uninterrupted[4:]


def test_request_seed_is_fixed_by_its_place_and_differs_between_places() -> None:
    assert request_seed(0, 3, 1) == request_seed(0, 3, 1)
    seeds = {request_seed(seed, step, slot) for seed in (0, 1) for step in (-1, 1, 2) for slot in range(8)}
    assert len(seeds) == 2 * 3 * 8  # no two places of two runs share a seed
    assert all(0 <= s < 2**31 for s in seeds)
