"""The staleness rule: when rollouts of a step may start, which rollouts may be trained, and what a stale one does.

Versions count trainer steps: the trainer's step n trains policy v(n-1) into v(n), and inference serves
one version at a time (``Orchestrator.policy_version``). A rollout records the span ``(v_start, v_end)`` of
versions it ran under (``Rollout.policy_span``; a weight update may land mid-rollout).

Two knobs, both from ``[orchestrator]``; with ``window = min(max_async_level, max_off_policy_steps)``:

    start gate:  rollouts of step n start once the served version >= n - 1 - window
    lag:         lag = (n - 1) - v_start            (queue time counted: v_start, not v_end)
    admission:   a rollout of step n is trained iff lag <= max_off_policy_steps

``max_async_level`` (0 = on-policy: step n's rollouts wait for v(n-1)) widens the async window and bounds
the lag of a rollout started on time. The gate never opens wider than ``max_off_policy_steps`` (case C23:
``max_off_policy_steps = 0`` with ``max_async_level = 1`` runs on-policy instead of generating whole steps
of rollouts only to drop them), so ``max_off_policy_steps`` drops only what lags further anyway: rollouts
started before a live config change lowered it, or a resumed run's. With ``max_off_policy_steps = 0`` a
trained rollout's span is ``(n - 1, n - 1)`` (case C13): ``v_end <= n - 1`` always (v(n) needs batch n), so a
rollout that a weight update reached mid-generation started under an older version and lags >= 1.

Under ``orchestrator.admission = "continuous"`` (``worker/orchestrator/admission.py``) the start gate is the same with
n the step whose batch is filling, and a finished group is admitted to step n's batch iff its oldest rollout's lag is
``<= max_off_policy_steps``; a group lagging more is dropped whole before the batcher sees it
(``admission_dropped_stale_groups``), so the table below applies to ``step`` admission only.

What happens to a stale rollout (``orchestrator.stale_policy``; ``worker.orchestrator.batcher.build_batch``):

| stale_policy      | the stale rollout | the rest of its group                                   | counted as                 |
|-------------------|-------------------|---------------------------------------------------------|----------------------------|
| ``withhold_member`` (default) | not trained | trained; its reward still counts in the group's baseline | ``dropped_stale`` += 1 |
| ``drop_group``    | not trained       | not trained (the whole group is dropped)                | ``dropped_stale_groups`` += 1, ``dropped_stale`` += each rollout with a reward |

Per step, ``lag_histogram`` counts the trained rollouts by lag in the fixed buckets of :data:`LAG_BUCKETS`
(case C20: the buckets sum to the step's trained samples).
"""

from __future__ import annotations

LAG_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("0", 0, 0),
    ("1", 1, 1),
    ("2", 2, 2),
    ("3", 3, 3),
    ("4-7", 4, 7),
    ("8plus", 8, None),
)
"""(label, lowest lag, highest lag or None: unbounded) of each policy-lag histogram bucket."""
LAG_HIST_METRICS = tuple(f"lag_hist/{label}" for label, _, _ in LAG_BUCKETS)
"""The histogram's metric names, one per bucket (``lag_hist/0`` ... ``lag_hist/8plus``)."""


def start_window(max_async_level: int, max_off_policy_steps: int) -> int:
    """How many versions behind v(n-1) rollouts of step n may start: ``min(max_async_level, max_off_policy_steps)``."""
    return min(max_async_level, max_off_policy_steps)


def min_start_version(step: int, max_async_level: int, max_off_policy_steps: int) -> int:
    """The lowest served policy version at which rollouts of trainer step ``step`` may start.

    ``step - 1 - min(max_async_level, max_off_policy_steps)``: a rollout started at or after it lags at most
    ``max_off_policy_steps``, so the batcher never drops it (case C23).
    """
    return step - 1 - start_window(max_async_level, max_off_policy_steps)


def rollout_lag(step: int, policy_span: tuple[int, int]) -> int:
    """Versions between the policy step ``step`` trains (v(step-1)) and the one the rollout started under."""
    return (step - 1) - policy_span[0]


def admitted(lag: int, max_off_policy_steps: int) -> bool:
    """True when a rollout of this lag may be trained (``lag <= max_off_policy_steps``)."""
    return lag <= max_off_policy_steps


def lag_histogram(lags: list[int]) -> dict[str, int]:
    """Counts of ``lags`` (the trained rollouts' policy lags) in each bucket of :data:`LAG_BUCKETS`.

    Returns:
        ``{"lag_hist/0": count, ..., "lag_hist/8plus": count}``: every bucket, zeros included; the counts sum to
        ``len(lags)`` (a negative lag, which no run makes, counts in bucket 0).
    """
    counts = dict.fromkeys(LAG_HIST_METRICS, 0)
    for lag in lags:
        for name, (_, low, high) in zip(LAG_HIST_METRICS, LAG_BUCKETS, strict=True):
            if (high is None or lag <= high) and (lag >= low or low == 0):
                counts[name] += 1
                break
    return counts
