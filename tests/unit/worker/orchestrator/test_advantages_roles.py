"""Role-aware advantages by hand: rae (SPIRAL's EMA baseline per environment and role, group_size 1, missing rewards,
decay, state round trip through the checkpoint file) and hierarchical_grpo (proposer/solver episodes, singletons,
missing rewards); their spec tables and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.orchestrator.advantages import (
    ADVANTAGES,
    ROLE_ADVANTAGES,
    STATE_FILE,
    Group,
    HierarchicalGrpo,
    RoleBaselines,
    compute_advantages,
    make_advantage,
    restore_state,
    write_state,
)
from worker.spec import (
    GrpoAdvantage,
    HierarchicalGrpoAdvantage,
    OrchestratorConfig,
    RaeAdvantage,
    SpecError,
    validate_spec,
)

P, S = "proposer", "solver"


def advantage_of(table: dict) -> object:
    return make_advantage(OrchestratorConfig.model_validate({"advantage": table}).advantage, env="self_play")


def approx_list(values, abs=1e-12):
    return [None if v is None else pytest.approx(v, abs=abs) for v in values]


def one(reward, role=None) -> Group:
    return Group([reward], [4], [role])


# ----------------------------------------------------------------------------- rae


def test_rae_group_size_1_over_three_steps_by_hand():
    rae = advantage_of({"type": "rae", "decay": 0.5})
    assert isinstance(rae, RoleBaselines)
    # b starts at 0; each rollout first updates b <- 0.5 b + 0.5 R, then A = R - b (SPIRAL Algorithm 1, lines 21-22)
    # R=1: b = 0.5*0 + 0.5*1 = 0.5,       A = 1 - 0.5     =  0.5
    # R=0: b = 0.5*0.5 + 0.5*0 = 0.25,    A = 0 - 0.25    = -0.25
    # R=1: b = 0.5*0.25 + 0.5*1 = 0.625,  A = 1 - 0.625   =  0.375
    got = [rae.score(one(r)).advantages for r in (1.0, 0.0, 1.0)]
    assert got == approx_list([[0.5], [-0.25], [0.375]])
    assert rae.state() == {"type": "rae", "baselines": {"self_play": {"": 0.625}}}


def test_rae_decay_sets_how_fast_the_baseline_follows_over_three_updates():
    # rewards 1, 1, 1 with one role
    # decay 0.9: b = 0.1, 0.19, 0.271        -> A = 0.9, 0.81, 0.729   (slow baseline: the signal fades slowly)
    # decay 0.5: b = 0.5, 0.75, 0.875        -> A = 0.5, 0.25, 0.125   (fast baseline)
    slow, fast = advantage_of({"type": "rae", "decay": 0.9}), advantage_of({"type": "rae", "decay": 0.5})
    assert [slow.score(one(1.0)).advantages[0] for _ in range(3)] == approx_list([0.9, 0.81, 0.729])
    assert [fast.score(one(1.0)).advantages[0] for _ in range(3)] == approx_list([0.5, 0.25, 0.125])
    assert slow.state()["baselines"]["self_play"][""] == pytest.approx(0.271)
    assert fast.state()["baselines"]["self_play"][""] == pytest.approx(0.875)


def test_rae_default_decay_is_spirals_095():
    rae = advantage_of({"type": "rae"})
    assert rae.config == RaeAdvantage(decay=0.95)
    # R=1 from b=0: b = 0.05, A = 0.95
    assert rae.score(one(1.0)).advantages == approx_list([0.95])


def test_rae_keeps_one_baseline_per_role_and_environment_in_group_order():
    rae = advantage_of({"type": "rae", "decay": 0.5})
    # proposer R=0: b_P = 0,                    A = 0
    # solver   R=1: b_S = 0.5,                  A = 0.5
    # solver R=0.5: b_S = 0.25 + 0.25 = 0.5,     A = 0
    result = rae.score(Group([0.0, 1.0, 0.5], [3, 3, 3], [P, S, S], [0, 0, 0]))
    assert result.advantages == approx_list([0.0, 0.5, 0.0])
    assert result.reward_mean == pytest.approx(0.5)
    # another environment starts from 0: R=1 -> b = 0.5, A = 0.5; self_play's solver baseline is untouched
    assert rae.score(Group([1.0], [3], [S], env="other")).advantages == approx_list([0.5])
    assert rae.state()["baselines"] == {"self_play": {P: 0.0, S: 0.5}, "other": {S: 0.5}}


def test_rae_missing_rewards_leave_the_baseline_and_get_no_advantage():
    rae = advantage_of({"type": "rae", "decay": 0.5})
    # only the middle reward is present: b = 0.5*0 + 0.5*1 = 0.5, A = 0.5
    result = rae.score(Group([None, 1.0, float("nan")], [2, 2, 2]))
    assert result.advantages == approx_list([None, 0.5, None])
    assert (result.reward_missing, result.all_missing) == (2, False)
    flagged = rae.score(Group([None, None], [2, 2]))
    assert flagged.all_missing and flagged.advantages == [None, None] and flagged.reward_mean is None
    assert rae.state()["baselines"]["self_play"] == {"": 0.5}  # unchanged by the all-missing group


def test_rae_state_round_trips_through_the_checkpoint_file(tmp_path: Path):
    original = advantage_of({"type": "rae", "decay": 0.5})
    original.score(Group([1.0, 0.0], [1, 1], [P, S]))  # b_P = 0.5, b_S = 0
    write_state(original, tmp_path)
    assert json.loads((tmp_path / STATE_FILE).read_text()) == {
        "type": "rae",
        "baselines": {"self_play": {P: 0.5, S: 0.0}},
    }
    resumed = advantage_of({"type": "rae", "decay": 0.5})
    restore_state(resumed, tmp_path)
    # the next rollout scores the same in both: proposer R=1, b = 0.25 + 0.5 = 0.75, A = 0.25
    assert resumed.score(one(1.0, P)).advantages == original.score(one(1.0, P)).advantages == approx_list([0.25])
    assert resumed.state() == original.state()
    fresh = advantage_of({"type": "rae", "decay": 0.5})
    restore_state(fresh, tmp_path / "no_checkpoint")  # a fresh run: no file, baselines start at 0
    assert fresh.state() == {"type": "rae", "baselines": {}}


def test_stateless_types_write_no_state_file(tmp_path: Path):
    write_state(make_advantage(GrpoAdvantage()), tmp_path)
    assert not (tmp_path / STATE_FILE).exists()


# ----------------------------------------------------------------------------- hierarchical_grpo


def hier(agents=(S,)) -> HierarchicalGrpo:
    adv = advantage_of({"type": "hierarchical_grpo", "episode_agents": list(agents)})
    assert isinstance(adv, HierarchicalGrpo)
    return adv


def test_hierarchical_one_proposer_four_solvers_by_hand():
    # solvers [1, 0.8, 0.2, 0.6]: mean 2.6 / 4 = 0.65 -> [0.35, 0.15, -0.45, -0.05]
    # the proposer is alone in its role in the group (one episode): advantage 0
    result = hier().score(Group([0.6, 1.0, 0.8, 0.2, 0.6], [5] * 5, [P, S, S, S, S], [0] * 5))
    assert result.advantages == approx_list([0.0, 0.35, 0.15, -0.45, -0.05])
    assert result.reward_mean == pytest.approx(3.2 / 5)


def test_hierarchical_two_episodes_solvers_within_proposers_across():
    # episode 0: proposer R=1 (its solvers split 2/2), solvers [1, 0, 1, 0] -> mean 0.5 -> [0.5, -0.5, 0.5, -0.5]
    # episode 1: proposer R=0 (all solvers pass),     solvers [1, 1, 1, 1] -> [0, 0, 0, 0]
    # proposers across the group: mean (1 + 0) / 2 = 0.5 -> [0.5, -0.5]
    rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    roles = [P, S, S, S, S, P, S, S, S, S]
    episodes = [0] * 5 + [1] * 5
    result = hier().score(Group(rewards, [3] * 10, roles, episodes))
    assert result.advantages == approx_list([0.5, 0.5, -0.5, 0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    # with both roles scored within their episode the proposers are singletons: 0
    both = hier((P, S)).score(Group(rewards, [3] * 10, roles, episodes))
    assert both.advantages == approx_list([0.0, 0.5, -0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0])


def test_hierarchical_singleton_group_is_zero():
    assert hier().score(Group([0.7], [4], [S], [0])).advantages == [0.0]
    assert hier().score(Group([0.7], [4])).advantages == [0.0]  # no roles: plain Dr. GRPO of one rollout


def test_hierarchical_missing_rewards():
    # solvers [1, None, 0, 0.5]: mean over the 3 present = 0.5 -> [0.5, None, -0.5, 0.0]; the proposer's reward is
    # missing: None, and it is no peer of any other rollout
    result = hier().score(Group([None, 1.0, None, 0.0, 0.5], [2] * 5, [P, S, S, S, S], [0] * 5))
    assert result.advantages == approx_list([None, 0.5, None, -0.5, 0.0])
    assert (result.reward_missing, result.all_missing, result.reward_mean) == (2, False, pytest.approx(0.5))
    flagged = hier().score(Group([None, None], [2, 2], [P, S], [0, 0]))
    assert flagged.all_missing and flagged.advantages == [None, None]


@given(
    st.lists(
        st.tuples(st.one_of(st.none(), st.floats(0, 1)), st.sampled_from([P, S]), st.integers(0, 2)),
        min_size=1,
        max_size=12,
    )
)
def test_hierarchical_peer_sets_sum_to_zero(rows):
    rewards, roles, episodes = zip(*rows, strict=True)
    result = hier().score(Group(list(rewards), [1] * len(rows), list(roles), list(episodes)))
    for key in {(ro, ep if ro == S else None) for ro, ep in zip(roles, episodes, strict=True)}:
        members = [
            a
            for a, ro, ep in zip(result.advantages, roles, episodes, strict=True)
            if a is not None and (ro, ep if ro == S else None) == key
        ]
        assert math.fsum(members) == pytest.approx(0.0, abs=1e-9)
    assert [a is None for a in result.advantages] == [r is None for r in rewards]


# ----------------------------------------------------------------------------- registry, spec, bad input


def test_registry_tables():
    assert set(ADVANTAGES) == {"grpo", "maxrl", "custom"} and set(ROLE_ADVANTAGES) == {"rae", "hierarchical_grpo"}
    spec = validate_spec(
        "rl", {"model": {"name": "m"}, "orchestrator": {"group_size": 1, "advantage": {"type": "rae"}}}
    )  # rae works with group_size 1 (GRPO needs 2)
    assert spec.orchestrator.advantage == RaeAdvantage()
    config = OrchestratorConfig.model_validate(
        {"advantage": {"type": "hierarchical_grpo", "episode_agents": ["solver"]}}
    ).advantage
    assert config == HierarchicalGrpoAdvantage(episode_agents=["solver"])
    with pytest.raises(ValueError, match="make_advantage"):
        compute_advantages(config, [1.0], [1])


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"type": "rae", "decay": 0.0}, "orchestrator.advantage.decay: Input should be greater than 0, got 0.0"),
        ({"type": "rae", "decay": 1}, "orchestrator.advantage.decay: Input should be less than 1, got 1"),
        ({"type": "rae", "decay": 1.5}, "orchestrator.advantage.decay: Input should be less than 1, got 1.5"),
        ({"type": "hierarchical_grpo"}, "orchestrator.advantage.episode_agents: Field required"),
        (
            {"type": "hierarchical_grpo", "episode_agents": []},
            "orchestrator.advantage.episode_agents: List should have at least 1 item after validation, not 0",
        ),
        (
            {"type": "rae", "episode_agents": ["solver"]},
            "unknown key 'orchestrator.advantage.episode_agents' (valid keys here: decay, type)",
        ),
    ],
)
def test_bad_parameters_name_the_spec_field(table, message):
    with pytest.raises(SpecError) as err:
        validate_spec("rl", {"model": {"name": "m"}, "orchestrator": {"group_size": 2, "advantage": table}})
    assert str(err.value) == message


def test_orchestrator_checkpoint_part_holds_the_rae_baselines(tmp_path: Path):
    from types import SimpleNamespace

    from worker.orchestrator.data import TaskSampler
    from worker.orchestrator.orchestrator import Orchestrator
    from worker.run.rundir import RunDir

    run = RunDir(tmp_path / "run")
    sampler = TaskSampler(None, seed=0)
    sampler.take(1, 2)
    rae = advantage_of({"type": "rae", "decay": 0.5})
    rae.score(Group([1.0, 0.0], [1, 1], [P, S]))  # b_P = 0.5, b_S = 0
    Orchestrator.save_state(SimpleNamespace(run=run, sampler=sampler, advantage=rae), 1)  # reads these only
    part = run.checkpoint_dir(1) / "orchestrator"
    assert json.loads((part / "state.json").read_text())["data_cursor"] == 2
    resumed = advantage_of({"type": "rae", "decay": 0.5})
    restore_state(resumed, part)  # what Orchestrator.__init__ does with the part of the step it resumes from
    assert resumed.state() == {"type": "rae", "baselines": {"self_play": {P: 0.5, S: 0.0}}}
