"""The batcher: one step's rollout groups -> advantages -> filtered training samples + metrics.

Pure functions (no I/O), so the staleness bound and the reward/advantage bookkeeping are tested
directly (``tests/unit/worker/orchestrator/test_batcher.py``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from worker.batch import TrainSample
from worker.orchestrator.advantages import Advantage, is_zero_advantage, make_advantage
from worker.orchestrator.branches import trace_advantages
from worker.orchestrator.staleness import admitted, lag_histogram, rollout_lag
from worker.packing import completion_length
from worker.spec import OrchestratorConfig


@dataclass
class Rollout:
    task_key: str
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    completion_text: str
    finish_reason: str
    reward: float | None
    advantage: float | None
    policy_span: tuple[int, int]
    temperature: float
    completion_mask: list[int] | None = None
    """1 on model-sampled completion tokens, 0 on environment tokens (multi-turn); None: all sampled."""
    trace: str | None = None
    """The trace this rollout is a branch of (``worker/orchestrator/branches.py``); None: a trace of its own."""
    role: str | None = None
    """The role that sampled it in a multi-role task (``"proposer"``, ``"solver"``: ``worker.envs.self_play``)."""
    episode: int | None = None
    """Its episode in the group (a proposal and the solver attempts at it); None for single-role tasks."""
    env: str = ""
    """Name of the environment the group sampled (``[[env]]`` mixtures: ``worker.orchestrator.mixture``)."""
    generation_s: float | None = None
    """Seconds from the first request to the last reply (scoring not counted; a single-turn group's rollouts share
    their one request's time); None: not measured."""

    @property
    def loss_mask(self) -> list[int]:
        """The completion's loss mask (aligned with ``completion_ids``)."""
        return [1] * len(self.completion_ids) if self.completion_mask is None else self.completion_mask

    def record(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "task": self.task_key,
            "completion": self.completion_text,
            "reward": self.reward,
            "advantage": self.advantage,
            "policy_span": list(self.policy_span),
            "temperature": self.temperature,
            "completion_len": sum(self.loss_mask),
            "finish_reason": self.finish_reason,
            **({"role": self.role, "episode": self.episode} if self.role is not None else {}),
            **({"env": self.env} if self.env else {}),
            "generation_s": self.generation_s,
        }


def build_batch(
    step: int, groups: list[list[Rollout]], orch: OrchestratorConfig, advantage: Advantage | None = None
) -> tuple[list[TrainSample], dict[str, Any]]:
    """Advantages, staleness filter and zero-advantage filter for the groups of trainer step ``step``.

    Staleness (``worker.orchestrator.staleness``): a rollout's lag is ``(step - 1) - v_start``; a rollout
    with lag above ``orch.max_off_policy_steps`` is never trained on.
    ``orch.stale_policy`` says what it does to its group: ``withhold_member`` trains the others, its reward
    still in their baseline (case C12: rewards [1, 0, 0, 1], the last stale -> [0.5, -0.5, -0.5]);
    ``drop_group`` drops the group, counted in ``dropped_stale_groups``. ``dropped_stale`` counts the
    rollouts with a reward that staleness kept out. Rollouts longer than ``orch.seq_len`` tokens (prompt +
    completion; a multi-turn rollout whose last turn or tool result crossed it) are not trained on either,
    counted in ``dropped_overlong``.
    Rewards that are None get no advantage and are not trained on (case C8); a group whose rewards
    are all None is counted in ``groups_all_missing``, never scored 0.

    ``advantage`` is the run's (``make_advantage``; stateful types such as ``rae`` keep their baselines in it, so
    steps must come in order); None makes a fresh one from ``orch.advantage``.

    Returns:
        The training samples and the step's orchestrator metrics (reward, advantage, length,
        staleness and drop statistics; the lag histogram of the trained samples, ``lag_hist/<bucket>``; and the
        bias toward fast tasks: ``trained_gen_time_ratio`` and ``trained_len_ratio``, the mean generation time
        and completion length of the trained rollouts over those of all the step's rollouts, NaN with no trained
        or no timed rollout).
    """
    samples: list[TrainSample] = []
    stats: dict[str, Any] = {"rewards": [], "advantages": [], "lags": [], "lens": [], "trained_lags": []}
    trained: list[Rollout] = []
    dropped_stale_groups = 0
    dropped_stale = dropped_overlong = dropped_zero = missing = all_missing_groups = truncated = 0
    advantage = advantage if advantage is not None else make_advantage(orch.advantage)
    for group_index, group in enumerate(groups):
        lags = [rollout_lag(step, r.policy_span) for r in group]
        lengths = [completion_length(r.loss_mask) for r in group]
        result = trace_advantages(advantage, group, lengths)  # a forked trace counts once (C22)
        missing += result.reward_missing
        all_missing_groups += int(result.all_missing)
        for r, a in zip(group, result.advantages, strict=True):
            r.advantage = a
        stats["rewards"] += [r.reward for r in group if r.reward is not None]
        stats["lags"] += lags
        stats["lens"] += lengths
        truncated += sum(r.finish_reason == "length" for r in group)
        if result.all_missing:
            continue
        if orch.drop_zero_advantage and is_zero_advantage(result):
            dropped_zero += 1
            continue
        fresh = [admitted(lag, orch.max_off_policy_steps) for lag in lags]
        if orch.stale_policy == "drop_group" and not all(
            ok for r, ok in zip(group, fresh, strict=True) if r.advantage is not None
        ):
            dropped_stale_groups += 1
            dropped_stale += sum(r.advantage is not None for r in group)
            continue
        for r, lag, ok in zip(group, lags, fresh, strict=True):
            if r.advantage is None:
                continue
            if not ok:
                dropped_stale += 1
                continue
            if len(r.prompt_ids) + len(r.completion_ids) > orch.seq_len:
                dropped_overlong += 1
                continue
            stats["advantages"].append(r.advantage)
            stats["trained_lags"].append(lag)
            trained.append(r)
            samples.append(
                TrainSample(
                    input_ids=r.prompt_ids + r.completion_ids,
                    loss_mask=[0] * len(r.prompt_ids) + r.loss_mask,
                    sampling_logprobs=[0.0] * len(r.prompt_ids) + r.completion_logprobs,
                    advantage=r.advantage,
                    temperature=r.temperature,
                    policy_span=list(r.policy_span),
                    group=group_index,
                    prefix_len=len(r.prompt_ids),
                )
            )
    rewards, lags = stats["rewards"], stats["lags"]
    metrics = {
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "reward_std": statistics.pstdev(rewards) if rewards else float("nan"),
        "reward_missing": missing,
        "groups_all_missing": all_missing_groups,
        "advantage_abs_mean": statistics.fmean(abs(a) for a in stats["advantages"]) if stats["advantages"] else 0.0,
        "completion_len_mean": statistics.fmean(stats["lens"]) if stats["lens"] else 0.0,
        "completion_len_max": max(stats["lens"], default=0),
        "truncated_fraction": truncated / max(1, len(lags)),
        "staleness_mean": statistics.fmean(lags) if lags else 0.0,
        "staleness_max": max(lags, default=0),
        "trained_staleness_max": max(stats["trained_lags"], default=0),
        "dropped_stale": dropped_stale,
        "dropped_stale_groups": dropped_stale_groups,
        **lag_histogram(stats["trained_lags"]),
        **trained_ratios(trained, [r for group in groups for r in group]),
        "dropped_overlong": dropped_overlong,
        "dropped_zero_advantage_groups": dropped_zero,
        "num_samples": len(samples),
    }
    return samples, metrics


def trained_ratios(trained: list[Rollout], finished: list[Rollout]) -> dict[str, float]:
    """Whether dropping biases training toward fast tasks: trained rollouts' means over all finished rollouts'.

    ``trained_gen_time_ratio = mean(generation_s of trained) / mean(generation_s of finished)`` (rollouts with a
    measured ``generation_s`` only) and ``trained_len_ratio`` the same of completion lengths (sampled tokens).
    Below 1: the step trains on faster / shorter rollouts than it generated. NaN when a mean is undefined or 0.
    """

    def ratio(part: list[float], whole: list[float]) -> float:
        if not part or not whole or statistics.fmean(whole) == 0:
            return float("nan")
        return statistics.fmean(part) / statistics.fmean(whole)

    def times(rollouts: list[Rollout]) -> list[float]:
        return [r.generation_s for r in rollouts if r.generation_s is not None]

    def lens(rollouts: list[Rollout]) -> list[float]:
        return [float(completion_length(r.loss_mask)) for r in rollouts]

    return {
        "trained_gen_time_ratio": ratio(times(trained), times(finished)),
        "trained_len_ratio": ratio(lens(trained), lens(finished)),
    }
