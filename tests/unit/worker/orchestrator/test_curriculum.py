"""Curricula (``worker/orchestrator/curriculum.py``, ``data.TaskSampler``): pass fractions, pass-rate transitions
between pools worked by hand, the sampling weights, and the state saved with a checkpoint restoring the draws
exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from worker.orchestrator.curriculum import DifficultyPool, draw_tasks, pass_fraction, pool_of, weighted_order
from worker.orchestrator.data import TaskSampler, data_order
from worker.spec import DifficultyPoolCurriculum, PoolWeights, StandardCurriculum

POOL = DifficultyPoolCurriculum()  # pass_threshold 1.0, decay 0.5, hard <= 0.25, normal <= 0.75


def test_pass_fraction_counts_scored_rollouts_only() -> None:
    # threshold 1.0: 1.0 and 1.0 pass, 0.5 does not, None is left out -> 2 / 3
    assert pass_fraction([1.0, 0.5, None, 1.0], 1.0) == pytest.approx(2 / 3)
    assert pass_fraction([1.0, 0.5, float("nan"), 1.0], 0.5) == 1.0  # 3 of 3 scored are >= 0.5
    assert pass_fraction([None, None], 1.0) is None  # nothing scored: the task's rate stays as it was


def test_task_moves_from_unseen_to_hard_to_normal_to_easy() -> None:
    pool = DifficultyPool(num_tasks=4, seed=0, lag=0)
    assert pool_of(pool.rates.get(3), 0.25, 0.75) == "unseen"
    rate_after = []
    for step, rewards in enumerate(
        [
            [0.0, 0.0, 0.3, 1.0],  # p = 1/4 -> first group sets rate = 0.25 (<= 0.25: hard)
            [1.0, 1.0, 1.0, 0.0],  # p = 3/4 -> 0.5 * 0.25 + 0.5 * 0.75 = 0.5 (normal)
            [1.0, 1.0, 1.0, 1.0],  # p = 1   -> 0.5 * 0.5 + 0.5 * 1 = 0.75 (<= 0.75: still normal)
            [1.0, 1.0, 1.0, 1.0],  # p = 1   -> 0.5 * 0.75 + 0.5 * 1 = 0.875 (easy)
            [None, None, None, None],  # nothing scored: unchanged
        ],
        start=1,
    ):
        pool.observe(step, [(3, rewards)], POOL)
        rate_after.append((pool.rates[3], pool_of(pool.rates[3], 0.25, 0.75)))
    assert rate_after == [(0.25, "hard"), (0.5, "normal"), (0.75, "normal"), (0.875, "easy"), (0.875, "easy")]
    assert pool.rates.keys() == {3}  # tasks 0..2 were never tried: unseen


def test_draw_uses_rates_through_step_minus_one_minus_lag() -> None:
    """max_async_level 1: step 3 draws from the groups of steps <= 1, step 2 from none."""
    pool = DifficultyPool(num_tasks=4, seed=0, lag=1)
    pool.draw(1, 2, POOL)
    pool.observe(1, [(0, [0.0, 0.0]), (1, [1.0, 1.0])], POOL)  # task 0: rate 0 (hard); task 1: rate 1 (easy)
    assert pool.rates == {} and list(pool.pending) == [1]  # step 1 is folded only once step 2 is observed
    pool.draw(2, 2, POOL)
    pool.draw(3, 2, POOL)
    assert pool.sizes[2] == {"unseen": 4, "hard": 0, "normal": 0, "easy": 0}
    assert pool.sizes[3] == {"unseen": 2, "hard": 1, "normal": 0, "easy": 1}
    with pytest.raises(RuntimeError, match="step 4 needs the groups of step 2"):
        pool.draw(4, 2, POOL)
    pool.observe(2, [(2, [1.0, 0.0])], POOL)  # task 2: rate 0.5 (normal); step 1 folds now
    assert pool.rates == {0: 0.0, 1: 1.0} and list(pool.pending) == [2]


def test_weighted_order_first_pick_follows_the_weights() -> None:
    # default weights of one task per pool, plus a task of weight 0:
    # P(first) = w / (1 + 0.2 + 1 + 0.2) = [1/2.4, 0.2/2.4, 1/2.4, 0.2/2.4, 0] = [0.4167, 0.0833, 0.4167, 0.0833, 0]
    weights = [1.0, 0.2, 1.0, 0.2, 0.0]
    draws = 20_000
    firsts = [0] * 5
    for i in range(draws):
        order = weighted_order(weights, random.Random(i))
        assert sorted(order) == [0, 1, 2, 3, 4] and order[-1] == 4  # a permutation; weight 0 comes last
        firsts[order[0]] += 1
    expected = [1 / 2.4, 0.2 / 2.4, 1 / 2.4, 0.2 / 2.4, 0.0]
    for got, want in zip(firsts, expected, strict=True):
        assert abs(got / draws - want) < 0.015  # binomial std at most 0.0035


def test_weighted_order_refuses_negative_weight() -> None:
    with pytest.raises(ValueError, match="weight of task 1 is negative"):
        weighted_order([1.0, -0.5], random.Random(0))


def test_draw_tasks_distinct_within_a_step_then_cycles() -> None:
    config = DifficultyPoolCurriculum(weights=PoolWeights(unseen=1.0, hard=0.0, normal=0.0, easy=0.0))
    rates = {0: 0.0, 1: 0.5}  # hard and normal: weight 0, so they come after the two unseen tasks 2 and 3
    indices, sizes = draw_tasks(rates, 4, 6, config, seed=0, step=1)
    assert sizes == {"unseen": 2, "hard": 1, "normal": 1, "easy": 0}
    assert sorted(indices[:2]) == [2, 3] and sorted(indices[:4]) == [0, 1, 2, 3]
    assert indices[4:] == indices[:2]  # 6 > 4 tasks: the order repeats
    assert draw_tasks(rates, 4, 6, config, seed=0, step=1)[0] == indices  # same seed and step: same draw
    others = {tuple(draw_tasks(rates, 4, 4, config, seed=0, step=s)[0]) for s in range(2, 12)}
    assert len(others) > 1  # another step draws another order


def _run(sampler: TaskSampler, steps: range, folder: Path | None = None, save_at: int = 0) -> list[list[int]]:
    """Take and observe ``steps`` as the orchestrator does with max_async_level 1 (the producer one step ahead):
    step n's groups get reward 1.0 for even task indices, 0.0 for odd ones, on even steps alone."""
    config = DifficultyPoolCurriculum(hard_max=0.2, normal_max=0.6)
    taken = {}
    for step in steps:
        if step not in taken:
            taken[step] = sampler.take(step, 3, 1, config)
        if step + 1 <= steps.stop - 1:
            taken[step + 1] = sampler.take(step + 1, 3, 1, config)
        rewards = [[float(i % 2 == 0)] * 2 if step % 2 == 0 else [0.5, 0.5] for i in taken[step]]
        sampler.observe(step, list(zip(taken[step], rewards, strict=True)), config)
        if folder is not None and step == save_at:
            sampler.write_state(folder, step)
    return [taken[s] for s in steps]


def test_state_round_trip_resume_draws_what_the_uninterrupted_run_drew(tmp_path: Path) -> None:
    def sampler(step: int = 0) -> TaskSampler:
        return TaskSampler.resume(
            tmp_path, step=step, num_tasks=6, seed=5, batch_size=3, curriculum=POOL, max_async_level=1
        )

    uninterrupted = _run(sampler(), range(1, 9), tmp_path, save_at=4)
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["data_cursor"] == 4 * (3 + 1)  # batch 3 + 1 spare per step
    # max_async_level 1: rates folded through step 3, step 4's pass fractions pending
    assert state["curriculum"]["folded"] == 3 and list(state["curriculum"]["pending"]) == ["4"]
    restored = sampler(4)
    assert restored.pool is not None and restored.pool.state_dict() == state["curriculum"]
    assert _run(restored, range(5, 9)) == uninterrupted[4:]
    assert len({tuple(s) for s in uninterrupted}) > 1  # the draws change as the rates do


def test_standard_curriculum_takes_the_data_order_with_spares(tmp_path: Path) -> None:
    sampler = TaskSampler.resume(tmp_path, step=0, num_tasks=8, seed=0, batch_size=2, curriculum=StandardCurriculum())
    assert sampler.pool is None
    # step 1: positions 0, 1 and spare 2; step 2: positions 3, 4 and spare 5
    assert sampler.take(1, 2, 1, StandardCurriculum()) == [data_order(p, 8, 0) for p in (0, 1, 2)]
    assert sampler.take(2, 2, 1, StandardCurriculum()) == [data_order(p, 8, 0) for p in (3, 4, 5)]
    assert sampler.observe(1, [(0, [1.0])], StandardCurriculum()) == {}


def test_difficulty_pool_needs_a_finite_taskset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="difficulty_pool needs a finite taskset"):
        TaskSampler.resume(tmp_path, step=0, num_tasks=None, seed=0, batch_size=2, curriculum=POOL)


def test_observe_returns_pool_sizes_of_the_draw(tmp_path: Path) -> None:
    sampler = TaskSampler.resume(tmp_path, step=0, num_tasks=5, seed=0, batch_size=2, curriculum=POOL)
    taken = sampler.take(1, 2, 0, POOL)
    assert sampler.observe(1, [(t, [1.0]) for t in taken], POOL) == {
        "pool_size_unseen": 5,
        "pool_size_hard": 0,
        "pool_size_normal": 0,
        "pool_size_easy": 0,
    }
    sampler.take(2, 2, 0, POOL)  # lag 0: step 2 draws from step 1's groups: two tasks passed, rate 1.0 (easy)
    assert sampler.observe(2, [], POOL)["pool_size_easy"] == 2
