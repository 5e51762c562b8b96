"""The batcher: staleness bound and stale policies (C12), lag histogram (C20), missing rewards (C8),
zero-advantage groups, sample layout, the fast-task bias ratios."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.orchestrator.batcher import Rollout, build_batch
from worker.orchestrator.staleness import LAG_HIST_METRICS, admitted, min_start_version, rollout_lag
from worker.spec import OrchestratorConfig


def rollout(
    reward: float | None, v_start: int = 0, n_tokens: int = 3, task: str = "t", generation_s: float | None = None
) -> Rollout:
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
        generation_s=generation_s,
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
    assert min_start_version(5, 0, 8) == 4 and min_start_version(5, 2, 8) == 2


# ----------------------------------------------------------------------------- stale policies (case C12)


def c12_group() -> list[Rollout]:
    """Case C12 at step 5 (trains v4), max_off_policy_steps 2: rewards [1, 0, 0, 1], the last rollout started under
    v1, max_off_policy_steps + 1 = 3 versions ago; the other three under v4 (lag 0)."""
    return [rollout(1.0, v_start=4), rollout(0.0, v_start=4), rollout(0.0, v_start=4), rollout(1.0, v_start=1)]


def test_c12_withhold_member_keeps_stale_reward_in_baseline() -> None:
    cfg = OrchestratorConfig(group_size=4, max_off_policy_steps=2, stale_policy="withhold_member")
    samples, metrics = build_batch(5, [c12_group()], cfg)
    # baseline = mean of all four rewards = (1 + 0 + 0 + 1) / 4 = 0.5 -> advantages 1 - 0.5, 0 - 0.5, 0 - 0.5;
    # the stale rollout (advantage 1 - 0.5 = 0.5) is not trained on
    assert [s["advantage"] for s in samples] == pytest.approx([0.5, -0.5, -0.5])
    assert [s["policy_span"] for s in samples] == [[4, 4]] * 3
    assert metrics["dropped_stale"] == 1 and metrics["dropped_stale_groups"] == 0
    assert metrics["num_samples"] == 3


def test_c12_drop_group_drops_and_counts_the_whole_group() -> None:
    fresh = [rollout(0.0, v_start=4), rollout(1.0, v_start=4)]  # a second, all-fresh group still trains
    cfg = OrchestratorConfig(group_size=4, max_off_policy_steps=2, stale_policy="drop_group")
    samples, metrics = build_batch(5, [c12_group(), fresh], cfg)
    assert [s["group"] for s in samples] == [1, 1]  # nothing of group 0
    assert [s["advantage"] for s in samples] == pytest.approx([-0.5, 0.5])  # fresh: mean 0.5
    assert metrics["dropped_stale_groups"] == 1
    assert metrics["dropped_stale"] == 4  # every rollout of the dropped group had a reward
    assert metrics["lag_hist/0"] == 2 and metrics["num_samples"] == 2


def test_drop_group_ignores_a_stale_member_without_reward() -> None:
    """A stale rollout whose reward is missing is not in the baseline, so with drop_group its group still trains."""
    group = [rollout(1.0, v_start=4), rollout(0.0, v_start=4), rollout(None, v_start=0)]  # lag 4 > 2, no reward
    cfg = OrchestratorConfig(group_size=3, max_off_policy_steps=2, stale_policy="drop_group")
    samples, metrics = build_batch(5, [group], cfg)
    assert [s["advantage"] for s in samples] == pytest.approx([0.5, -0.5])  # mean (1 + 0) / 2 = 0.5
    assert metrics["dropped_stale_groups"] == 0 and metrics["dropped_stale"] == 0 and metrics["reward_missing"] == 1


def test_stale_policy_default_and_bad_value() -> None:
    assert OrchestratorConfig().stale_policy == "withhold_member"
    with pytest.raises(ValueError, match="stale_policy"):
        OrchestratorConfig(stale_policy="drop_member")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- lag histogram (case C20)


def test_c20_lag_histogram_sums_to_trained_samples() -> None:
    # step 10 trains v9; starts 9, 8, 8, 7, 6, 4, 2, 0 -> lags 0, 1, 1, 2, 3, 5, 7, 9; max_off_policy_steps 8
    # drops lag 9; trained lags 0 | 1 1 | 2 | 3 | 5 7 -> buckets 0:1, 1:2, 2:1, 3:1, 4-7:2, 8plus:0 (sum 7)
    starts = [9, 8, 8, 7, 6, 4, 2, 0]
    group = [rollout(float(i % 2), v_start=v) for i, v in enumerate(starts)]
    samples, metrics = build_batch(10, [group], OrchestratorConfig(group_size=8, max_off_policy_steps=8))
    assert {k: metrics[k] for k in LAG_HIST_METRICS} == {
        "lag_hist/0": 1,
        "lag_hist/1": 2,
        "lag_hist/2": 1,
        "lag_hist/3": 1,
        "lag_hist/4-7": 2,
        "lag_hist/8plus": 0,
    }
    assert sum(metrics[k] for k in LAG_HIST_METRICS) == len(samples) == metrics["num_samples"] == 7
    # a wider bound trains the lag-9 rollout too: it lands in 8plus
    _, wide = build_batch(10, [group], OrchestratorConfig(group_size=8, max_off_policy_steps=100))
    assert wide["lag_hist/8plus"] == 1 and sum(wide[k] for k in LAG_HIST_METRICS) == wide["num_samples"] == 8


@settings(max_examples=200, deadline=None)
@given(
    step=st.integers(1, 30),
    max_off=st.integers(0, 10),
    policy=st.sampled_from(["withhold_member", "drop_group"]),
    groups=st.lists(
        st.lists(st.tuples(st.sampled_from([0.0, 1.0, None]), st.integers(0, 30)), min_size=1, max_size=6),
        min_size=1,
        max_size=4,
    ),
)
def test_c20_lag_histogram_always_sums_to_num_samples(
    step: int, max_off: int, policy: str, groups: list[list[tuple[float | None, int]]]
) -> None:
    built = [[rollout(r, v_start=min(v, step - 1)) for r, v in g] for g in groups]
    cfg = OrchestratorConfig(group_size=6, max_off_policy_steps=max_off, stale_policy=policy)  # type: ignore[arg-type]
    samples, metrics = build_batch(step, built, cfg)
    assert sum(metrics[k] for k in LAG_HIST_METRICS) == len(samples) == metrics["num_samples"]


# ----------------------------------------------------------------------------- bias toward fast tasks


def test_trained_ratios_show_the_bias_toward_fast_rollouts() -> None:
    # the slow, long rollout (5 s, 6 tokens) is the stale one: trained 1 s / 2 tokens each;
    # all: (1 + 1 + 1 + 5) / 4 = 2 s and (2 + 2 + 2 + 6) / 4 = 3 tokens -> ratios 1 / 2 = 0.5 and 2 / 3
    group = [
        rollout(1.0, v_start=4, n_tokens=2, generation_s=1.0),
        rollout(0.0, v_start=4, n_tokens=2, generation_s=1.0),
        rollout(0.0, v_start=4, n_tokens=2, generation_s=1.0),
        rollout(1.0, v_start=1, n_tokens=6, generation_s=5.0),
    ]
    _, metrics = build_batch(5, [group], OrchestratorConfig(group_size=4, max_off_policy_steps=2))
    assert metrics["trained_gen_time_ratio"] == pytest.approx(0.5)
    assert metrics["trained_len_ratio"] == pytest.approx(2 / 3)


def test_trained_ratios_undefined_without_trained_or_timed_rollouts() -> None:
    # nothing trained (one zero-advantage group): both NaN; trained but never timed: only the time ratio is NaN
    _, none = build_batch(1, [[rollout(0.5), rollout(0.5)]], OrchestratorConfig(group_size=2))
    assert math.isnan(none["trained_gen_time_ratio"]) and math.isnan(none["trained_len_ratio"])
    _, untimed = build_batch(1, [[rollout(0.0), rollout(1.0)]], OrchestratorConfig(group_size=2))
    assert math.isnan(untimed["trained_gen_time_ratio"]) and untimed["trained_len_ratio"] == pytest.approx(1.0)


def test_gate_rejected_groups_count_as_finished_never_as_trained() -> None:
    # kept group: two 1 s rollouts of 2 tokens, both trained; a gate rejected a group of two 4 s rollouts of 5 tokens
    # finished: (1 + 1 + 4 + 4) / 4 = 2.5 s and (2 + 2 + 5 + 5) / 4 = 3.5 tokens -> ratios 1 / 2.5 = 0.4, 2 / 3.5
    kept = [rollout(0.0, n_tokens=2, generation_s=1.0), rollout(1.0, n_tokens=2, generation_s=1.0)]
    rejected = [rollout(0.0, n_tokens=5, generation_s=4.0), rollout(1.0, n_tokens=5, generation_s=4.0)]
    samples, metrics = build_batch(1, [kept], OrchestratorConfig(group_size=2), rejected=[rejected])
    assert len(samples) == metrics["num_samples"] == 2
    assert metrics["trained_gen_time_ratio"] == pytest.approx(0.4)
    assert metrics["trained_len_ratio"] == pytest.approx(2 / 3.5)
    assert metrics["reward_mean"] == pytest.approx(0.5)  # the rejected group is in no other metric


# ----------------------------------------------------------------------------- one rule for missing rewards


def test_nan_and_inf_rewards_are_missing_everywhere() -> None:
    """None, NaN and inf are missing (``present_reward``), the same in the reward statistics, the advantages, the
    per-env metrics and the gates: rewards (1, NaN, 0, None) -> present (1, 0), mean 0.5, 2 missing, advantages
    (0.5, None, -0.5, None); a group of (NaN, inf) is all missing; the gate sees mean |A| = 0.5."""
    from worker.orchestrator.gates import group_rejects
    from worker.orchestrator.mixture import env_step_metrics
    from worker.spec import AdvantageRangeGate

    group = [rollout(1.0), rollout(float("nan")), rollout(0.0), rollout(None)]
    for r in group:
        r.env = "a"
    nan_group = [rollout(float("nan")), rollout(float("inf"))]
    for r in nan_group:
        r.env = "b"
    samples, metrics = build_batch(1, [group, nan_group], OrchestratorConfig(group_size=4))
    assert metrics["reward_mean"] == pytest.approx(0.5) and metrics["reward_std"] == pytest.approx(0.5)
    assert metrics["reward_missing"] == 4 and metrics["groups_all_missing"] == 1
    assert [r.advantage for r in group] == [pytest.approx(0.5), None, pytest.approx(-0.5), None]
    assert [r.dropped for r in group] == [None, "missing", None, "missing"] and len(samples) == 2
    per_env = env_step_metrics(1, [group, nan_group], samples, ["a", "b"])
    assert (per_env["reward_mean/a"], per_env["reward_missing/a"], per_env["groups_all_missing/a"]) == (0.5, 2, 0)
    assert math.isnan(per_env["reward_mean/b"]) and (per_env["reward_missing/b"], per_env["groups_all_missing/b"]) == (
        2,
        1,
    )
    orch = OrchestratorConfig(group_size=4)  # grpo
    gate = AdvantageRangeGate(type="advantage_range", reject_min=0.5, reject_max=0.5)
    assert group_rejects([gate], orch.advantage)(group) is True  # mean |A| over (0.5, -0.5) = 0.5
    assert group_rejects([gate], orch.advantage)(nan_group) is False  # all missing: no advantage, passes
