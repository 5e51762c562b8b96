"""The batcher: one step's rollout groups -> advantages -> filtered training samples + metrics.

Pure functions (no I/O), so the staleness bound and the reward/advantage bookkeeping are tested
directly (``tests/unit/worker/orchestrator/test_batcher.py``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from worker.orchestrator.advantages import Advantage, is_zero_advantage, make_advantage
from worker.orchestrator.batch import TrainSample
from worker.orchestrator.branches import trace_advantages
from worker.orchestrator.staleness import admitted, lag_histogram, rollout_lag
from worker.rewards import present_reward
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
    dropped: str | None = None
    """Why ``build_batch`` did not train it (``DROP_REASONS``); None: trained (or not batched yet)."""

    @property
    def completion_len(self) -> int:
        """Tokens the policy sampled (``packing.completion_length`` of ``loss_mask``, without building the mask)."""
        return len(self.completion_ids) if self.completion_mask is None else sum(map(bool, self.completion_mask))

    @property
    def loss_mask(self) -> list[int]:
        """The completion's loss mask (aligned with ``completion_ids``)."""
        return [1] * len(self.completion_ids) if self.completion_mask is None else self.completion_mask

    def record(self, step: int, group: int | None = None) -> dict[str, Any]:
        """The rollout's line of ``rollouts/step_<step>.jsonl`` (``worker.run.rundir``), ``group`` its group's index in
        the step. The token fields are as sampled: ``prompt_ids`` (P,), and ``completion_ids``,
        ``completion_logprobs`` (vLLM's log-probs of the sampled tokens, nats; 0.0 on environment tokens) and
        ``completion_mask`` (1: sampled by the model, 0: an environment/tool turn), all (C,); ``dropped`` says why
        the batcher did not train it (None: trained)."""
        return {
            "step": step,
            **({"group": group} if group is not None else {}),
            "task": self.task_key,
            "completion": self.completion_text,
            "reward": self.reward,
            "advantage": self.advantage,
            "policy_span": list(self.policy_span),
            "temperature": self.temperature,
            "completion_len": self.completion_len,
            "finish_reason": self.finish_reason,
            **({"role": self.role, "episode": self.episode} if self.role is not None else {}),
            **({"env": self.env} if self.env else {}),
            "generation_s": self.generation_s,
            "dropped": self.dropped,
            "prompt_ids": list(self.prompt_ids),
            "completion_ids": list(self.completion_ids),
            "completion_logprobs": list(self.completion_logprobs),
            "completion_mask": list(self.loss_mask),
        }


_RECORD_ENCODER = msgspec.json.Encoder()
_RECORD_FLOATS = ("reward", "advantage", "generation_s", "temperature")


def encode_records(records: Sequence[dict[str, Any]]) -> bytes:
    """Rollout records (``Rollout.record``) as JSON lines, one per record, each ending in a newline.

    msgspec encodes them (2,048 records of ~90 tokens: ~11 ms against ~77 ms for ``json.dumps``,
    ``benchmarks/orchestrator_scale.py``); msgspec would write a non-finite float as ``null``, so a record with one
    (a NaN reward, an infinite log-prob: their sum is not finite) is written by ``json.dumps``, which keeps ``NaN`` /
    ``Infinity`` as before.
    """
    out = []
    for rec in records:
        total = sum(rec.get("completion_logprobs") or ()) + sum(
            v for k in _RECORD_FLOATS if isinstance(v := rec.get(k), float)
        )
        out.append(_RECORD_ENCODER.encode(rec) if math.isfinite(total) else json.dumps(rec, allow_nan=True).encode())
    return b"\n".join(out) + b"\n" if out else b""


DROP_REASONS = ("missing", "zero_advantage", "stale_group", "stale", "overlong")
"""Why ``build_batch`` did not train a rollout (``Rollout.dropped``): its reward is missing (``present_reward``; its
whole group's when ``groups_all_missing``), its group had zero advantage, its group was dropped for a stale member
(``drop_group``), it is stale itself, or it is longer than ``seq_len``."""


def build_batch(
    step: int,
    groups: list[list[Rollout]],
    orch: OrchestratorConfig,
    advantage: Advantage | None = None,
    rejected: Sequence[Sequence[Rollout]] = (),
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
    Missing rewards (None, NaN, inf: ``worker.rewards.present_reward``) get no advantage and are not trained on
    (case C8); a group whose rewards are all missing is counted in ``groups_all_missing``, never scored 0. Each
    rollout's ``dropped`` says why it was not trained (``DROP_REASONS``; None: trained), and ``step_metrics`` counts
    the metrics from it, for the whole step and per environment alike.

    ``advantage`` is the run's (``make_advantage``; stateful types such as ``rae`` keep their baselines in it, so
    steps must come in order); None makes a fresh one from ``orch.advantage``.

    Args:
        rejected: the step's groups a gate rejected (``gates.fill_batch``): never trained, but finished, so they
            count in the denominators of the trained ratios.

    Returns:
        The training samples and the step's orchestrator metrics (``step_metrics``).
    """
    samples = batch_groups(step, groups, orch, advantage if advantage is not None else make_advantage(orch.advantage))
    return samples, batch_metrics(step, groups, rejected)


def batch_metrics(
    step: int, groups: Sequence[Sequence[Rollout]], rejected: Sequence[Sequence[Rollout]] = ()
) -> dict[str, Any]:
    """``build_batch``'s metrics of step ``step`` once every group is batched (``batch_groups``): ``step_metrics``
    without ``num_groups`` (logged per environment only, ``PER_ENV_METRICS``: the step's is ``batch_size``)."""
    metrics = step_metrics(step, groups, rejected)
    del metrics["num_groups"]
    return metrics


def batch_groups(
    step: int, groups: Sequence[list[Rollout]], orch: OrchestratorConfig, advantage: Advantage, first: int = 0
) -> list[TrainSample]:
    """The training samples of ``groups`` of step ``step`` (``build_batch``'s rules), the group at position i of
    ``groups`` numbered ``first + i`` in its samples' ``group``: a step's groups may be batched a slice at a time, in
    order (``advantage`` may keep state between groups), and give the samples ``build_batch`` gives for all of them.
    Sets each rollout's ``advantage`` and ``dropped``."""
    samples: list[TrainSample] = []
    for group_index, group in enumerate(groups, start=first):
        lags = [rollout_lag(step, r.policy_span) for r in group]
        lengths = [r.completion_len for r in group]
        result = trace_advantages(advantage, group, lengths)  # a forked trace counts once (C22)
        for r, a in zip(group, result.advantages, strict=True):
            r.advantage = a
            r.dropped = "missing" if a is None else None
        scored = [r for r in group if r.advantage is not None]
        if result.all_missing:
            continue
        if orch.drop_zero_advantage and is_zero_advantage(result):
            for r in scored:
                r.dropped = "zero_advantage"
            continue
        fresh = [admitted(lag, orch.max_off_policy_steps) for lag in lags]
        if orch.stale_policy == "drop_group" and not all(
            ok for r, ok in zip(group, fresh, strict=True) if r.advantage is not None
        ):
            for r in scored:
                r.dropped = "stale_group"
            continue
        for r, ok in zip(group, fresh, strict=True):
            if r.advantage is None:
                continue
            if not ok:
                r.dropped = "stale"
                continue
            if len(r.prompt_ids) + len(r.completion_ids) > orch.seq_len:
                r.dropped = "overlong"
                continue
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
    return samples


def step_metrics(
    step: int, groups: Sequence[Sequence[Rollout]], rejected: Sequence[Sequence[Rollout]] = ()
) -> dict[str, Any]:
    """The data metrics of groups scored by ``build_batch`` (each rollout's ``advantage`` and ``dropped`` set): of a
    whole step, or of one environment's groups (``mixture.env_step_metrics``), with the same definitions.

    Per rollout: ``reward_mean``/``reward_std`` over the present rewards (NaN with none), ``reward_missing`` the
    rollouts without one; ``completion_len_*``, ``truncated_fraction``, ``staleness_*`` over all rollouts;
    ``advantage_abs_mean``, ``trained_staleness_max`` and the lag histogram (``lag_hist/<bucket>``) over the trained
    ones (``num_samples``); ``dropped_stale`` the rollouts with a reward that staleness kept out (alone or with their
    group), ``dropped_overlong``. Per group: ``groups_all_missing``, ``dropped_zero_advantage_groups``,
    ``dropped_stale_groups``, ``num_groups``. The bias toward fast tasks: ``trained_ratios`` of the trained rollouts
    over all finished ones (``rejected`` included: groups a gate rejected, and those continuous admission dropped as
    stale, case C26).
    """
    rollouts = [r for g in groups for r in g]
    trained = [r for r in rollouts if r.dropped is None]
    rewards = [x for x in (present_reward(r.reward) for r in rollouts) if x is not None]
    lags = [rollout_lag(step, r.policy_span) for r in rollouts]
    trained_lags = [rollout_lag(step, r.policy_span) for r in trained]
    lens = [r.completion_len for r in rollouts]
    advantages = [abs(r.advantage) for r in trained if r.advantage is not None]

    def count(reason: str) -> int:
        return sum(r.dropped == reason for r in rollouts)

    def groups_with(reason: str) -> int:
        return sum(any(r.dropped == reason for r in g) for g in groups)

    return {
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "reward_std": statistics.pstdev(rewards) if rewards else float("nan"),
        "reward_missing": len(rollouts) - len(rewards),
        "groups_all_missing": sum(bool(g) and all(present_reward(r.reward) is None for r in g) for g in groups),
        "advantage_abs_mean": statistics.fmean(advantages) if advantages else 0.0,
        "completion_len_mean": statistics.fmean(lens) if lens else 0.0,
        "completion_len_max": max(lens, default=0),
        "truncated_fraction": sum(r.finish_reason == "length" for r in rollouts) / max(1, len(rollouts)),
        "staleness_mean": statistics.fmean(lags) if lags else 0.0,
        "staleness_max": max(lags, default=0),
        "trained_staleness_max": max(trained_lags, default=0),
        "dropped_stale": count("stale") + count("stale_group"),
        "dropped_stale_groups": groups_with("stale_group"),
        **lag_histogram(trained_lags),
        **trained_ratios(trained, [*rollouts, *(r for g in rejected for r in g)]),
        "dropped_overlong": count("overlong"),
        "dropped_zero_advantage_groups": groups_with("zero_advantage"),
        "num_groups": len(groups),
        "num_samples": len(trained),
    }


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
        return [float(r.completion_len) for r in rollouts]

    return {
        "trained_gen_time_ratio": ratio(times(trained), times(finished)),
        "trained_len_ratio": ratio(lens(trained), lens(finished)),
    }
