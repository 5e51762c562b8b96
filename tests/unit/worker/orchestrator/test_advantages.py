"""Per-group advantages: hand-computed GRPO and MaxRL values, case C8, zero-sum and zero-advantage invariants."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from worker.orchestrator.advantages import (
    ADVANTAGES,
    AdvantageResult,
    compute_advantages,
    is_zero_advantage,
)
from worker.spec import GrpoAdvantage, MaxRLAdvantage, OrchestratorConfig, SpecError, validate_spec


def score(kind, rewards, lengths, **params):
    """``compute_advantages`` with the ``[orchestrator.advantage]`` table ``{type = kind, **params}`` as the spec reads it."""
    config = OrchestratorConfig.model_validate({"advantage": {"type": kind, **params}}).advantage
    return compute_advantages(config, rewards, lengths)


def approx_list(values, abs=1e-9):
    return [None if v is None else pytest.approx(v, abs=abs) for v in values]


# ----------------------------------------------------------------------------- case C8


@pytest.mark.parametrize("kind", ["grpo", "maxrl"])
def test_c8_missing_rewards_are_excluded_and_get_no_advantage(kind):
    # rewards [0.5, None, None, 0.8, 0.6, 0.7]: mean over the 4 present = 2.6 / 4 = 0.65
    result = score(kind, [0.5, None, None, 0.8, 0.6, 0.7], [5, 5, 5, 5, 5, 5])
    assert result.reward_mean == pytest.approx(0.65)
    assert result.reward_missing == 2
    assert not result.all_missing
    assert result.advantages[1] is None and result.advantages[2] is None
    assert all(a is not None for i, a in enumerate(result.advantages) if i not in (1, 2))
    if kind == "grpo":
        # R - 0.65 = [-0.15, 0.15, -0.05, 0.05]
        assert result.advantages == approx_list([-0.15, None, None, 0.15, -0.05, 0.05])
    else:
        # (R - 0.65) / 0.65 = [-0.230769, 0.230769, -0.076923, 0.076923]
        assert result.advantages == approx_list([-0.15 / 0.65, None, None, 0.15 / 0.65, -0.05 / 0.65, 0.05 / 0.65])
        assert result.advantages[0] == pytest.approx(-0.230769, abs=1e-6)


@pytest.mark.parametrize("kind", ["grpo", "maxrl"])
def test_c8_all_missing_group_is_flagged_never_scored_zero(kind):
    result = score(kind, [None, None, float("nan")], [3, 4, 5])
    expected = AdvantageResult(advantages=[None, None, None], reward_mean=None, reward_missing=3, all_missing=True)
    assert result == expected
    assert not is_zero_advantage(result)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_counts_as_missing(bad):
    result = score("grpo", [1.0, bad, 0.0], [1, 1, 1])
    assert result.advantages == approx_list([0.5, None, -0.5])
    assert result.reward_missing == 1


# ----------------------------------------------------------------------------- grpo


def test_grpo_std_normalize_by_hand():
    # present rewards [0.5, 0.8, 0.6, 0.7], mean 0.65, centred [-0.15, 0.15, -0.05, 0.05]
    # population std = sqrt((0.0225 + 0.0225 + 0.0025 + 0.0025) / 4) = sqrt(0.0125) = 0.111803
    # advantages = centred / 0.111803 = [-1.341641, 1.341641, -0.447214, 0.447214]
    result = score("grpo", [0.5, None, None, 0.8, 0.6, 0.7], [1] * 6, std_normalize=True)
    assert result.advantages == approx_list([-1.341641, None, None, 1.341641, -0.447214, 0.447214], abs=1e-6)


def test_grpo_std_floor_bounds_the_inflation():
    # rewards [0, 0.001]: centred [-0.0005, 0.0005], std 0.0005 < floor 0.01 -> [-0.05, 0.05]
    result = score("grpo", [0.0, 0.001], [1, 1], std_normalize=True, std_floor=0.01)
    assert result.advantages == approx_list([-0.05, 0.05])


def test_grpo_length_penalty_by_hand():
    # rewards [1, 1, 0, 0] -> centred [0.5, 0.5, -0.5, -0.5]
    # lengths [10, 30, 20, 20]: mean 20, max 30; penalty 0.1 * (L - 20) / 30 = [-0.033333, 0.033333, 0, 0]
    # advantages = centred - penalty = [0.533333, 0.466667, -0.5, -0.5]   (the shorter correct answer wins)
    result = score("grpo", [1.0, 1.0, 0.0, 0.0], [10, 30, 20, 20], length_penalty=0.1)
    assert result.advantages == approx_list([0.5 + 0.1 / 3, 0.5 - 0.1 / 3, -0.5, -0.5])
    assert result.advantages[0] == pytest.approx(0.533333, abs=1e-6)
    assert math.fsum(result.advantages) == pytest.approx(0.0, abs=1e-12)


def test_length_penalty_ignores_lengths_of_missing_rollouts():
    # the None rollout's length 1000 is not part of mean/max: lengths used [10, 30], mean 20, max 30
    result = score("grpo", [1.0, None, 1.0], [10, 1000, 30], length_penalty=0.3)
    assert result.advantages == approx_list([0.1, None, -0.1])


def test_equal_rewards_give_exact_zeros():
    # 0.1 * 3 / 3 != 0.1 in floating point; the advantages must still be exactly 0
    result = score("grpo", [0.1, 0.1, 0.1], [1, 2, 3])
    assert result.advantages == [0.0, 0.0, 0.0]
    assert is_zero_advantage(result)
    assert is_zero_advantage(score("grpo", [0.1, 0.1, 0.1], [1, 2, 3], std_normalize=True))
    assert not is_zero_advantage(score("grpo", [0.1, 0.1, 0.1], [1, 2, 3], length_penalty=0.1))
    assert not is_zero_advantage(score("grpo", [0.1, 0.2], [1, 1]))


# ----------------------------------------------------------------------------- maxrl


def test_maxrl_binary_rewards_by_hand():
    # N = 8, K = 2 successes: mean 0.25; success (1 - 0.25) / 0.25 = 3, failure (0 - 0.25) / 0.25 = -1
    # = N/K - 1 and -1: the 1/p reweighting of maximum likelihood. Sum 2 * 3 - 6 = 0.
    result = score("maxrl", [1, 0, 0, 1, 0, 0, 0, 0], [1] * 8)
    assert result.advantages == approx_list([3, -1, -1, 3, -1, -1, -1, -1])
    # a lone success in 8 gets 7; with 7 successes in 8 each success gets 1/7
    assert score("maxrl", [1] + [0] * 7, [1] * 8).advantages[0] == pytest.approx(7)
    assert score("maxrl", [1] * 7 + [0], [1] * 8).advantages[0] == pytest.approx(1 / 7)


def test_maxrl_with_missing_reward_by_hand():
    # present [1, 0, 0], mean 1/3: [(1 - 1/3) * 3, -1, -1] = [2, -1, -1]
    result = score("maxrl", [1.0, None, 0.0, 0.0], [4, 4, 4, 4])
    assert result.advantages == approx_list([2.0, None, -1.0, -1.0])
    assert result.reward_mean == pytest.approx(1 / 3)


def test_maxrl_all_failures_is_zero_not_nan():
    result = score("maxrl", [0.0, 0.0, 0.0], [1, 1, 1])
    assert result.advantages == [0.0, 0.0, 0.0]
    assert is_zero_advantage(result)


def test_maxrl_rejects_negative_rewards():
    with pytest.raises(ValueError, match=r'^orchestrator\.advantage\.type: "maxrl" needs rewards >= 0, got -1\.0'):
        score("maxrl", [-1.0, 1.0], [1, 1])


# ----------------------------------------------------------------------------- registry and errors


def test_registry_and_spec_tables():
    assert set(ADVANTAGES) == {"grpo", "maxrl", "custom"}  # custom: tests/unit/worker/test_plugins.py
    spec = validate_spec("rl", {"model": {"name": "m"}})
    assert spec.orchestrator.advantage == GrpoAdvantage()  # no [orchestrator.advantage] table: GRPO
    tables = {
        "grpo": {"std_normalize": False, "std_floor": 1e-2, "length_penalty": 0.0},
        "maxrl": {"length_penalty": 0.0},
    }
    for kind in tables:
        assert score(kind, [0.0, 1.0], [1, 1], **tables[kind]).advantages[1] > 0
    config = OrchestratorConfig.model_validate({"advantage": {"type": "maxrl", "length_penalty": 0.5}}).advantage
    assert config == MaxRLAdvantage(length_penalty=0.5)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            {"type": "ppo"},
            "orchestrator.advantage.type: expected one of 'grpo', 'maxrl', 'rae', 'hierarchical_grpo', 'custom', got 'ppo'",
        ),
        ({"std_floor": 0.0}, "orchestrator.advantage.std_floor: Input should be greater than 0, got 0.0"),
        (
            {"length_penalty": -0.1},
            "orchestrator.advantage.length_penalty: Input should be greater than or equal to 0, got -0.1",
        ),
        (
            {"type": "maxrl", "length_penalty": -0.1},
            "orchestrator.advantage.length_penalty: Input should be greater than or equal to 0, got -0.1",
        ),
        (
            {"temperature": 1.0},
            "unknown key 'orchestrator.advantage.temperature' (valid keys here: length_penalty, std_floor, "
            "std_normalize, type)",
        ),
        # maxrl divides by the mean: its table has no std_normalize / std_floor
        (
            {"type": "maxrl", "std_normalize": True},
            "unknown key 'orchestrator.advantage.std_normalize' (valid keys here: length_penalty, type)",
        ),
        (
            {"type": "maxrl", "std_flor": 0.1},
            "unknown key 'orchestrator.advantage.std_flor' (valid keys here: length_penalty, type)",
        ),
        (
            {"std_flor": 0.1},
            "unknown key 'orchestrator.advantage.std_flor' (did you mean 'orchestrator.advantage.std_floor'?)",
        ),
    ],
)
def test_bad_parameters_name_the_spec_field(table, message):
    with pytest.raises(SpecError) as err:
        validate_spec("rl", {"model": {"name": "m"}, "orchestrator": {"group_size": 2, "advantage": table}})
    assert str(err.value) == message


def test_mismatched_lengths_and_empty_groups_are_errors():
    with pytest.raises(ValueError, match="2 rewards but 1 completion lengths"):
        score("grpo", [0.0, 1.0], [1])
    with pytest.raises(ValueError, match="at least one rollout"):
        score("grpo", [], [])


# ----------------------------------------------------------------------------- invariants

reward = st.one_of(st.none(), st.floats(-10, 10, allow_nan=False))
groups = st.integers(1, 16).flatmap(
    lambda n: st.tuples(st.lists(reward, min_size=n, max_size=n), st.lists(st.integers(0, 500), min_size=n, max_size=n))
)


@given(group=groups, std_normalize=st.booleans(), length_penalty=st.sampled_from([0.0, 0.05, 1.0]))
def test_grpo_advantages_sum_to_zero_and_none_follows_reward(group, std_normalize, length_penalty):
    rewards, lengths = group
    result = score("grpo", rewards, lengths, std_normalize=std_normalize, length_penalty=length_penalty)
    assert len(result.advantages) == len(rewards)
    assert [a is None for a in result.advantages] == [r is None for r in rewards]
    present = [a for a in result.advantages if a is not None]
    assert result.reward_missing == rewards.count(None)
    assert result.all_missing == (not present)
    assert math.fsum(present) == pytest.approx(0.0, abs=1e-9)
    if present:
        scored = [r for r in rewards if r is not None]
        assert result.reward_mean == pytest.approx(math.fsum(scored) / len(scored))


@given(value=st.floats(-10, 10, allow_nan=False), n=st.integers(1, 16), missing=st.integers(0, 3))
def test_grpo_equal_rewards_are_exactly_zero(value, n, missing):
    result = score("grpo", [value] * n + [None] * missing, [7] * (n + missing), std_normalize=True)
    assert is_zero_advantage(result)


@given(group=groups)
def test_maxrl_advantages_sum_to_zero(group):
    rewards, lengths = group
    rewards = [None if r is None else abs(r) for r in rewards]
    present_rewards = [r for r in rewards if r is not None]
    assume(not present_rewards or math.fsum(present_rewards) / len(present_rewards) > 1e-3)
    result = score("maxrl", rewards, lengths)
    present = [a for a in result.advantages if a is not None]
    assert math.fsum(present) == pytest.approx(0.0, abs=1e-6)
    assert [a is None for a in result.advantages] == [r is None for r in rewards]
