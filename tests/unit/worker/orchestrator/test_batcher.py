"""The batcher: staleness bound, missing rewards (C8), zero-advantage groups, sample layout."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.orchestrator.batcher import Rollout, build_batch
from worker.orchestrator.staleness import admitted, min_start_version, rollout_lag
from worker.spec import OrchestratorConfig


def rollout(reward: float | None, v_start: int = 0, n_tokens: int = 3, task: str = "t") -> Rollout:
    return Rollout(
        task_key=task,
        prompt_ids=[1, 2],
        completion_ids=list(range(10, 10 + n_tokens)),
        completion_logprobs=[-0.5] * n_tokens,
        completion_text="x",
        finish_reason="stop",
        reward=reward,
        advantage=None,
        policy_span=(v_start, v_start),
        temperature=0.7,
    )


def test_missing_rewards_case_c8() -> None:
    group = [rollout(r) for r in [0.5, None, None, 0.8, 0.6, 0.7]]
    samples, metrics = build_batch(1, [group], OrchestratorConfig(group_size=6))
    assert metrics["reward_mean"] == pytest.approx(0.65)
    assert metrics["reward_missing"] == 2
    assert len(samples) == 4  # the two None rollouts are not trained on
    assert sorted(s["advantage"] for s in samples) == pytest.approx([-0.15, -0.05, 0.05, 0.15])
    assert group[1].advantage is None and group[2].advantage is None


def test_all_missing_group_is_flagged_not_scored_zero() -> None:
    good = [rollout(r) for r in [0.0, 1.0]]
    bad = [rollout(None) for _ in range(2)]
    samples, metrics = build_batch(1, [good, bad], OrchestratorConfig(group_size=2))
    assert metrics["groups_all_missing"] == 1
    assert metrics["reward_mean"] == pytest.approx(0.5)  # the None group adds no zeros
    assert len(samples) == 2


def test_zero_advantage_group_dropped() -> None:
    samples, metrics = build_batch(1, [[rollout(0.5) for _ in range(4)]], OrchestratorConfig(group_size=4))
    assert samples == [] and metrics["dropped_zero_advantage_groups"] == 1


def test_rollout_longer_than_seq_len_dropped_and_counted() -> None:
    """A (multi-turn) rollout of prompt + completion > seq_len is not trained on; its group's others are."""
    group = [rollout(0.0, n_tokens=6), rollout(1.0, n_tokens=7), rollout(0.5, n_tokens=5)]  # 8, 9 and 7 tokens
    samples, metrics = build_batch(1, [group], OrchestratorConfig(group_size=3, seq_len=8))
    assert metrics["dropped_overlong"] == 1
    assert [len(s["input_ids"]) for s in samples] == [8, 7]
    assert [s["advantage"] for s in samples] == pytest.approx([-0.5, 0.0])  # advantages over the whole group


def test_sample_layout_aligned_with_input_ids() -> None:
    samples, _ = build_batch(3, [[rollout(0.0, v_start=2), rollout(1.0, v_start=2)]], OrchestratorConfig(group_size=2))
    s = samples[1]
    assert s["input_ids"] == [1, 2, 10, 11, 12]
    assert s["loss_mask"] == [0, 0, 1, 1, 1]
    assert s["sampling_logprobs"] == [0.0, 0.0, -0.5, -0.5, -0.5]
    assert s["advantage"] == pytest.approx(0.5) and s["temperature"] == 0.7 and s["policy_span"] == [2, 2]


@settings(max_examples=200, deadline=None)
@given(
    step=st.integers(1, 40),
    max_off=st.integers(0, 8),
    starts=st.lists(st.integers(0, 40), min_size=2, max_size=16),
)
def test_staleness_filter_never_admits_older_than_bound(step: int, max_off: int, starts: list[int]) -> None:
    starts = [min(v, step - 1) for v in starts]  # a rollout never starts under a version the trainer has not made
    group = [rollout(float(i % 2), v_start=v) for i, v in enumerate(starts)]
    cfg = OrchestratorConfig(group_size=len(group), max_off_policy_steps=max_off)
    samples, metrics = build_batch(step, [group], cfg)
    assert all((step - 1) - s["policy_span"][0] <= max_off for s in samples)
    trainable = [r for r in group if r.advantage not in (None, 0.0)]
    stale = [r for r in trainable if (step - 1) - r.policy_span[0] > max_off]
    if len({r.reward for r in group}) > 1:
        assert metrics["dropped_stale"] == sum(1 for r in group if (step - 1) - r.policy_span[0] > max_off)
        assert len(samples) + metrics["dropped_stale"] == len(group)
    assert len(stale) <= metrics["dropped_stale"]
    assert metrics["staleness_max"] == max((step - 1) - v for v in starts)


def test_staleness_rule_by_hand() -> None:
    # step 5 trains v4: a rollout started under v1 lags 3; with max_off_policy_steps 3 it is admitted, with 2 not
    assert rollout_lag(5, (1, 4)) == 3
    assert admitted(3, 3) and not admitted(3, 2)
    # max_async_level 0: step 5's rollouts wait for v4 (on-policy); level 2: they may start under v2
    assert min_start_version(5, 0) == 4 and min_start_version(5, 2) == 2
