"""Rollout ids and filters of the rollout browser (``server/services/rollouts.py``), and the record the orchestrator
writes for it (``Rollout.record``)."""

from __future__ import annotations

import pytest

from server.services.rollouts import BadRolloutId, Filters, RolloutNotFound, parse_rollout_id, rollout_id
from worker.orchestrator.batcher import Rollout


def test_a_rollout_id_names_its_run_step_and_line() -> None:
    assert rollout_id(12, 3, 5) == "12-3-5" and parse_rollout_id("12-3-5", 12) == (3, 5)
    with pytest.raises(RolloutNotFound, match=r"^rid: rollout 7-3-5 is of run 7, not of run 12$"):
        parse_rollout_id("7-3-5", 12)
    for bad in ("12-3", "12-3-x", "12--3-5", "../12-3-5", "12-3-5 ", "١٢-3-5"):
        with pytest.raises(BadRolloutId, match=r"^rid: expected <run>-<step>-<line>"):
            parse_rollout_id(bad, 12)


def test_filters_keep_the_policy_span_group_env_and_task() -> None:
    rec = {"group": 1, "env": "a", "task": "k7", "policy_span": [2, 4]}
    assert Filters().keeps(rec)
    assert [Filters(policy_version=v).keeps(rec) for v in (1, 2, 3, 4, 5)] == [False, True, True, True, False]
    assert (Filters(group=1).keeps(rec), Filters(group=0).keeps(rec)) == (True, False)
    assert (Filters(env="a").keeps(rec), Filters(env="b").keeps(rec)) == (True, False)
    assert (Filters(task="k7").keeps(rec), Filters(task="k").keeps(rec)) == (True, False)  # exact key only


def test_the_record_carries_group_tokens_logprobs_and_mask() -> None:
    r = Rollout(
        task_key="k",
        prompt_ids=[1, 2],
        completion_ids=[5, 6, 7, 8],
        completion_logprobs=[-0.5, 0.0, 0.0, -1.25],
        completion_text="x",
        finish_reason="length",
        reward=0.5,
        advantage=0.25,
        policy_span=(3, 4),
        temperature=1.0,
        completion_mask=[1, 0, 0, 1],
    )
    rec = r.record(6, 2)
    assert (rec["step"], rec["group"], rec["completion_len"], rec["dropped"]) == (6, 2, 2, None)
    assert rec["prompt_ids"] == [1, 2] and rec["completion_ids"] == [5, 6, 7, 8]
    assert rec["completion_logprobs"] == [-0.5, 0.0, 0.0, -1.25] and rec["completion_mask"] == [1, 0, 0, 1]
    assert "group" not in r.record(6)
