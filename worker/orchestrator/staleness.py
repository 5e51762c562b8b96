"""The staleness rule: when rollouts of a step may start, and which rollouts may be trained.

Versions count trainer steps: the trainer's step n trains policy v(n-1) into v(n), and inference serves
one version at a time (``Orchestrator.policy_version``). A rollout records the span ``(v_start, v_end)`` of
versions it ran under (``Rollout.policy_span``; a weight update may land mid-rollout).

Two bounds, both from ``[orchestrator]``:

    start gate:  rollouts of step n start once the served version >= n - 1 - max_async_level
    lag:         lag = (n - 1) - v_start            (queue time counted: v_start, not v_end)
    admission:   a rollout of step n is trained iff lag <= max_off_policy_steps

``max_async_level`` (0 = on-policy: step n's rollouts wait for v(n-1)) widens the async window and bounds
the lag of a rollout started on time; ``max_off_policy_steps`` drops what lags further anyway (a rollout
queued behind others, or a resumed run). A dropped rollout is counted as ``dropped_stale``, never trained on
(``worker.orchestrator.batcher.build_batch``).
"""

from __future__ import annotations


def min_start_version(step: int, max_async_level: int) -> int:
    """The lowest served policy version at which rollouts of trainer step ``step`` may start."""
    return step - 1 - max_async_level


def rollout_lag(step: int, policy_span: tuple[int, int]) -> int:
    """Versions between the policy step ``step`` trains (v(step-1)) and the one the rollout started under."""
    return (step - 1) - policy_span[0]


def admitted(lag: int, max_off_policy_steps: int) -> bool:
    """True when a rollout of this lag may be trained (``lag <= max_off_policy_steps``)."""
    return lag <= max_off_policy_steps
