"""Alert rule schema: what a run spec's ``alerts`` list and ``POST /api/alerts/rules`` accept.

Imports nothing heavy (the server and the spec validate rules with it). The known metric names live here,
once: ``METRICS`` maps each process (``source``) to every name it writes to ``metrics.jsonl``.

Kinds (``kind`` picks one; each fires once when it starts holding and again only after it cleared):

- ``status``: the run became ``failed``, ``completed``, ``cancelled``, was ``requeued`` (resumed), or ``stalled`` (the
  hang watchdog's event: no progress for ``watchdog.no_progress_s``).
- ``threshold``: ``metric <op> value`` at each of the last ``window`` steps, from ``after_step`` on
  (``mismatch_kl > 0.01`` for 3 steps; ``reward_mean < 0.2`` after step 50).
- ``stall``: a running run sent no metric for ``seconds``.
- ``non_finite``: one of ``metrics`` (default loss and reward) is NaN or infinite.
- ``throughput``: ``metric`` (default ``tokens_per_s``) fell below ``fraction`` of its median over the
  previous ``window`` steps.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from worker.dotted_keys import closest, did_you_mean
from worker.orchestrator.staleness import LAG_HIST_METRICS
from worker.tracking.system_metrics import GPU_METRICS, PROCESS_METRICS

Source = Literal["trainer", "orchestrator", "eval", "inference", "vllm"]
"""A process that reports metrics to ``metrics.jsonl`` (``vllm``: the inference servers' own metrics, which the
orchestrator samples: ``worker/inference/server_metrics.py``)."""

METRICS: dict[Source, tuple[str, ...]] = {
    "trainer": (
        "loss",
        "entropy",
        "mismatch_kl",
        "mismatch_kl_on_policy",
        "masked_fraction",
        "is_ratio",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "step_time_s",
        "wait_for_batch_s",
        "num_samples",
        "num_loss_tokens",
        "policy_version",
        "kl",
        "masked_low",
        "masked_high",
        "mfu",
        "peak_memory_gib",
        "trainer_ranks",
        *PROCESS_METRICS,
        *GPU_METRICS,
    ),
    "orchestrator": (
        "reward_mean",
        "reward_std",
        "reward_missing",
        "advantage_abs_mean",
        "completion_len_mean",
        "completion_len_max",
        "staleness_mean",
        "staleness_max",
        "trained_staleness_max",
        "dropped_stale",
        "dropped_overlong",
        "dropped_zero_advantage_groups",
        "wait_for_policy_s",
        "rollout_tokens",
        "policy_version",
        "temperature",
        "truncated_fraction",
        "num_samples",
        "groups_all_missing",
        "generation_s",
        "batch_wait_s",
        "rollout_tokens_per_s",
        "pool_size_unseen",
        "pool_size_hard",
        "pool_size_normal",
        "pool_size_easy",
        "gate_rejected_groups",
        "gate_resampled_groups",
        "gate_unfilled_groups",
        "dropped_stale_groups",
        "admission_dropped_stale_groups",
        "trained_gen_time_ratio",
        "trained_len_ratio",
        *LAG_HIST_METRICS,
        *PROCESS_METRICS,
    ),
    "eval": ("reward_mean", "pass_at_k", "k", "n", "num_examples", "completion_len_mean", "reward_missing"),
    "inference": (
        "weight_update_s",
        "weight_update_pause_s",
        "weight_update_load_s",
        "weight_update_reset_s",
        "weight_update_resume_s",
        "weight_update_worker_s",
        "policy_check_max_abs_diff",
        "policy_moved_from_base",
        "policy_check_tolerance",
        "policy_check_base_max_abs_diff",
        "replicas_healthy",
        "policy_check_replica_max_abs_diff",
    ),
    "vllm": ("kv_cache_usage", "requests_running", "requests_waiting", "preemptions", "prefix_cache_hit_rate"),
}
"""Process -> every metric name it writes to an RL run's ``metrics.jsonl`` (some only on some machines: ``mfu``,
``peak_memory_gib`` and the trainer's ``system/gpu_*``, ``worker/tracking/system_metrics.py``), so every logged metric
can be used in an alert rule. ``tests/e2e/test_rl.py`` fails on a logged name missing here."""
PER_ENV_METRICS: dict[Source, tuple[str, ...]] = {
    "trainer": ("mismatch_kl",),
    "orchestrator": (
        "reward_mean",
        "reward_std",
        "reward_missing",
        "groups_all_missing",
        "advantage_abs_mean",
        "completion_len_mean",
        "completion_len_max",
        "truncated_fraction",
        "staleness_mean",
        "staleness_max",
        "trained_staleness_max",
        "dropped_stale",
        "dropped_stale_groups",
        "dropped_overlong",
        "dropped_zero_advantage_groups",
        "num_groups",
        "num_samples",
        "pool_size_unseen",
        "pool_size_hard",
        "pool_size_normal",
        "pool_size_easy",
    ),
    "eval": ("reward_mean", "pass_at_k", "num_examples", "completion_len_mean", "reward_missing"),
}
"""Process -> the metrics a run of several environments (``[[env]]``) also logs per environment, as
``<metric>/<env name>`` (``worker/orchestrator/mixture.py``); ``num_groups`` is logged only so; ``pool_size_*`` (as
the step's) only with ``curriculum.type = "difficulty_pool"``."""
PER_REPLICA_METRICS: dict[Source, tuple[str, ...]] = {
    "inference": (
        "requests_in_flight",
        "rollout_groups",
        "tokens_per_s",
        "weight_update_s",
        "policy_check_max_abs_diff",
    ),
    "vllm": ("kv_cache_usage", "requests_running", "requests_waiting", "preemptions"),
}
"""Process -> the metrics a run of several inference replicas (``inference.replicas`` or ``inference.urls``) logs per
replica, as ``<metric>/r<index>`` (``worker/inference/pool.py``, ``worker/inference/server_metrics.py``);
``replicas_healthy`` and ``policy_check_replica_max_abs_diff`` (max over probe tokens of |replica i - replica 0|) only
with replicas."""
KNOWN_METRICS = tuple(dict.fromkeys(n for names in METRICS.values() for n in names))
STATUS_EVENTS = ("failed", "completed", "cancelled", "requeued", "stalled")
MAX_RULES_PER_RUN = 100
"""Alert rules of one run at most (its spec's ``alerts`` and those added through the API): each metrics upload
checks every rule of its run, and 10,000 rules made an upload take seconds."""
MAX_GLOBAL_RULES_PER_USER = 100
"""Rules for every run (``POST /api/alerts/rules``) one user may add: they are checked for every run's uploads."""
RULE_KINDS = ("status", "threshold", "stall", "non_finite", "throughput")
"""The kinds of the rules users add."""
BUILTIN_RULES = {"policy_check": "policy_check_failed"}
"""Built-in rules: alert kind -> the run event (``worker.run.rundir.ENGINE_EVENTS``) that fires it, for every run. Not
stored rows (no rule id; nothing to add, so they never count toward ``MAX_RULES_PER_RUN``): ``policy_check`` fires once
per ``policy_check_failed`` event the server records (the served-policy check, case C14; also with ``on_fail =
"warn"``), its message the check's reason (``server.alerts.rules.on_engine_event``)."""
EVENT_KINDS = (*RULE_KINDS, *BUILTIN_RULES)
"""The event names a webhook endpoint filters on (default: all)."""


def reports(source: Source, metric: str) -> bool:
    """True when process ``source`` logs ``metric``: a name of ``METRICS`` (some hold a ``/``: ``lag_hist/0``), or
    ``<name>/<env>`` of ``PER_ENV_METRICS`` (any env name: the run's spec names them), or ``<name>/r<i>`` of
    ``PER_REPLICA_METRICS``."""
    if metric in METRICS[source]:
        return True
    base, sep, env = metric.partition("/")
    if sep and env[:1] == "r" and env[1:].isdigit() and base in PER_REPLICA_METRICS.get(source, ()):
        return True
    if sep:
        return bool(env) and "/" not in env and base in PER_ENV_METRICS.get(source, ())
    return False


def default_source(metric: str) -> Source:
    """The first process (trainer, orchestrator, eval) that reports ``metric``."""
    return next(src for src in METRICS if reports(src, metric))


PER_ENV_NAMES = tuple(dict.fromkeys(n for names in PER_ENV_METRICS.values() for n in names))


def metric_hint(name: str) -> str:
    """`` (did you mean 'x'?)`` for a mistyped metric name, or ``""``: a name of ``KNOWN_METRICS``, or for
    ``<metric>/<env>`` the closest per-environment metric with the same env name."""
    base, sep, env = name.partition("/")
    if sep and env and "/" not in env and (close := closest(base, PER_ENV_NAMES)) is not None:
        return f" (did you mean '{close}/{env}'?)"
    return did_you_mean(name, KNOWN_METRICS)


def _check_metric(name: str) -> str:
    if not any(reports(src, name) for src in METRICS):
        raise ValueError(
            f"unknown metric {name!r}{metric_hint(name)}; known: {', '.join(KNOWN_METRICS)}; "
            f"per environment as <metric>/<env name>: {', '.join(PER_ENV_NAMES)}"
        )
    return name


class _Rule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field("", max_length=128)
    """A label for messages; default: a description of the rule."""


class _MetricRule(_Rule):
    metric: str
    source: Source | None = None
    """Process whose series is watched; default the first that reports ``metric``."""

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        return _check_metric(v)

    @model_validator(mode="after")
    def _source(self) -> _MetricRule:
        if self.source is None:
            self.source = default_source(self.metric)
        elif not reports(self.source, self.metric):
            raise ValueError(f"source: {self.source} does not report {self.metric!r}")
        return self


class StatusRule(_Rule):
    kind: Literal["status"]
    statuses: list[Literal["failed", "completed", "cancelled", "requeued", "stalled"]] = Field(["failed"], min_length=1)
    """``stalled``: the hang watchdog found the run without progress (``worker/tracking/progress.py``; the message names
    the stalled component)."""


class ThresholdRule(_MetricRule):
    kind: Literal["threshold"]
    op: Literal[">", ">=", "<", "<="]
    value: float = Field(allow_inf_nan=False)
    """The threshold: any finite number (metrics have no common scale)."""
    window: int = Field(1, ge=1, le=10_000)
    """Consecutive steps the comparison must hold."""
    after_step: int = Field(0, ge=0, le=1_000_000)
    """Steps before this one are not checked (at most 1,000,000, the largest ``max_steps``)."""


class StallRule(_Rule):
    kind: Literal["stall"]
    seconds: float = Field(gt=0, le=7 * 24 * 3600)
    """A running run with no metric for this long (the newest point's time, or the last status change)."""


class NonFiniteRule(_Rule):
    kind: Literal["non_finite"]
    metrics: list[str] = Field(["loss", "reward_mean"], min_length=1)

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, v: list[str]) -> list[str]:
        return [_check_metric(n) for n in v]


class ThroughputRule(_MetricRule):
    kind: Literal["throughput"]
    metric: str = "tokens_per_s"
    fraction: float = Field(0.5, gt=0, lt=1)
    window: int = Field(20, ge=2, le=10_000)
    """Steps before the current one whose median is the reference."""


AlertRule = Annotated[
    StatusRule | ThresholdRule | StallRule | NonFiniteRule | ThroughputRule, Field(discriminator="kind")
]


def describe(rule: Any) -> str:
    """One line saying what ``rule`` (a validated rule) watches, for messages."""
    if rule.name:
        return str(rule.name)
    if isinstance(rule, StatusRule):
        return f"run status {' or '.join(rule.statuses)}"
    if isinstance(rule, ThresholdRule):
        steps = f" for {rule.window} steps" if rule.window > 1 else ""
        after = f" after step {rule.after_step}" if rule.after_step else ""
        return f"{rule.source}/{rule.metric} {rule.op} {rule.value:g}{steps}{after}"
    if isinstance(rule, StallRule):
        return f"no metrics for {rule.seconds:g} s"
    if isinstance(rule, NonFiniteRule):
        return f"non-finite {' or '.join(rule.metrics)}"
    return f"{rule.source}/{rule.metric} below {rule.fraction:g} x its median of {rule.window} steps"
