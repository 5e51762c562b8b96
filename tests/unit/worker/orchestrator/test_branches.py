"""Branches of one multi-turn trace (``worker/orchestrator/branches.py``): a shared sampled prefix trains once,
branches that only extend each other are one sample, and a forked trace counts once in its group's baseline."""

from __future__ import annotations

import pytest

from worker.orchestrator.advantages import make_advantage
from worker.orchestrator.batcher import Rollout, build_batch
from worker.orchestrator.branches import merge_branches, trace_advantages
from worker.spec import GrpoAdvantage, OrchestratorConfig


def rollout(prompt: list[int], completion: list[int], mask: list[int], reward: float | None = 1.0) -> Rollout:
    return Rollout(
        task_key="t",
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=[-0.5 * m for m in mask],
        completion_text="",
        finish_reason="stop",
        reward=reward,
        advantage=None,
        policy_span=(0, 0),
        temperature=1.0,
        completion_mask=mask,
    )


def test_c22_forked_trace_advantages_half_and_shared_node_weight_once() -> None:
    # prompt 1 2 | sampled tool call 3 4 | branch a: tool result 5, answer 6 7 | branch b: tool result 8, answer 9
    a = rollout([1, 2], [3, 4, 5, 6, 7], [1, 1, 0, 1, 1])
    b = rollout([1, 2], [3, 4, 8, 9], [1, 1, 0, 1])
    merged = merge_branches([b, a], trace="T")  # longest first: a keeps the shared call, b keeps only its answer
    assert [(r.completion_ids, r.completion_mask, r.trace) for r in merged] == [
        ([3, 4, 5, 6, 7], [1, 1, 0, 1, 1], "T"),
        ([3, 4, 8, 9], [0, 0, 0, 1], "T"),
    ]
    assert [r.completion_logprobs for r in merged] == [[-0.5, -0.5, 0.0, -0.5, -0.5], [0.0, 0.0, 0.0, -0.5]]
    assert b.completion_mask == [1, 1, 0, 1] and b.completion_logprobs == [-0.5, -0.5, 0.0, -0.5]  # inputs unchanged
    group = [*merged, rollout([1, 2], [10, 11], [1, 1], reward=0.0)]
    samples, metrics = build_batch(1, [group], OrchestratorConfig(group_size=2))
    # traces' rewards [1, 0]: mean 0.5 -> +0.5 (both branches), -0.5; per branch it would be [1/3, 1/3, -2/3]
    assert [s["advantage"] for s in samples] == pytest.approx([0.5, 0.5, -0.5])
    # the call's sampled tokens 3 4 sit at positions 2, 3 of both forked samples: weight 1 each in total
    assert [samples[0]["loss_mask"][i] + samples[1]["loss_mask"][i] for i in (2, 3)] == [1, 1]
    assert metrics["num_samples"] == 3


def test_branches_that_only_extend_each_other_are_one_sample() -> None:
    short = rollout([1, 2], [3, 4], [1, 1])
    long = rollout([1, 2], [3, 4, 5, 6], [1, 1, 0, 1])
    same = rollout([1, 2], [3, 4], [1, 1])
    merged = merge_branches([short, long, same], trace="T")
    assert [(r.completion_ids, r.completion_mask) for r in merged] == [([3, 4, 5, 6], [1, 1, 0, 1])]


def test_branches_forked_before_any_sampled_token_both_train_in_full() -> None:
    a = rollout([1, 2, 3], [4, 5], [1, 1])
    b = rollout([1, 2, 7], [8], [1])  # shares only the prompt tokens 1 2
    assert [r.completion_mask for r in merge_branches([a, b], trace="T")] == [[1, 1], [1]]


def test_trace_advantages_count_each_trace_once_and_sum_its_lengths() -> None:
    # traces: T (2 branches, 3 + 1 sampled tokens, reward 1), a plain rollout (2 tokens, reward 0), U (missing)
    group = [
        rollout([1], [2, 3, 4], [1, 1, 1]),
        rollout([1], [2, 3, 4, 5], [0, 0, 0, 1]),
        rollout([1], [6, 7], [1, 1], reward=0.0),
        rollout([1], [8], [1], reward=None),
    ]
    group[0].trace = group[1].trace = "T"
    group[3].trace = "U"
    # GRPO with length_penalty 1 over the traces [T: R 1, L 4], [R 0, L 2] (U missing):
    #   mean R 0.5 -> [0.5, -0.5]; shaping (L - mean L) / max L = (4 - 3) / 4 = 0.25, (2 - 3) / 4 = -0.25
    #   advantages [0.5 - 0.25, -0.5 + 0.25] = [0.25, -0.25]
    result = trace_advantages(make_advantage(GrpoAdvantage(length_penalty=1.0)), group, [3, 1, 2, 1])
    assert result.advantages == [pytest.approx(0.25), pytest.approx(0.25), pytest.approx(-0.25), None]
    assert (result.reward_mean, result.reward_missing) == (pytest.approx(0.5), 1)


def test_rae_in_a_mixture_keeps_one_baseline_per_environment_through_build_batch() -> None:
    """Groups reach the run's advantage through ``trace_advantages``, which names each group's environment: with
    ``rae`` (decay 0.5, group_size 1) a step with a group of reward 1 from env ``a`` and one of reward 0 from ``b``
    gives b_a = 0.5 * 0 + 0.5 * 1 = 0.5 (advantage 1 - 0.5 = 0.5) and b_b = 0 (advantage 0), not one shared baseline."""
    from worker.spec import RaeAdvantage

    first, second = rollout([1], [2], [1], reward=1.0), rollout([1], [3], [1], reward=0.0)
    first.env, second.env = "a", "b"
    advantage = make_advantage(RaeAdvantage(decay=0.5), env="a")
    orch = OrchestratorConfig(group_size=1, drop_zero_advantage=False, advantage=RaeAdvantage(decay=0.5))
    build_batch(1, [[first], [second]], orch, advantage)
    assert (first.advantage, second.advantage) == (0.5, 0.0)
    assert advantage.state() == {"type": "rae", "baselines": {"a": {"": 0.5}, "b": {"": 0.0}}}


def test_c22_a_gate_judges_the_advantages_the_batch_trains() -> None:
    """The C22 group (a forked trace of reward 1, one trace of reward 0): per trace the GRPO advantages are +-0.5
    (mean |A| 0.5); per rollout they would be [1/3, 1/3, -2/3] (mean 0.444). A gate rejecting [0, 0.45] keeps it."""
    from worker.orchestrator.gates import group_rejects
    from worker.spec import AdvantageRangeGate

    a, b, c = rollout([1], [2], [1], 1.0), rollout([1], [3], [1], 1.0), rollout([1], [4], [1], 0.0)
    a.trace = b.trace = "fork"
    rejects = group_rejects([AdvantageRangeGate(reject_min=0.0, reject_max=0.45)], GrpoAdvantage())
    assert rejects([a, b, c]) is False
    assert rejects([a, rollout([1], [3], [1], 1.0), c]) is True  # three traces: mean |A| = 4/9 < 0.45
