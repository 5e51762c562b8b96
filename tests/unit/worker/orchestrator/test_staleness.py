"""The staleness rule (worker/orchestrator/staleness.py): the start gate (C23), admission by span (C13), lag buckets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.orchestrator.batcher import Rollout, build_batch
from worker.orchestrator.staleness import LAG_HIST_METRICS, admitted, lag_histogram, min_start_version, rollout_lag
from worker.spec import OrchestratorConfig


def rollout(reward: float, span: tuple[int, int]) -> Rollout:
    return Rollout(
        task_key="t",
        prompt_ids=[1],
        completion_ids=[5, 6],
        completion_logprobs=[-0.1, -0.2],
        completion_text="x",
        finish_reason="stop",
        reward=reward,
        advantage=None,
        policy_span=span,
        temperature=1.0,
    )


# ----------------------------------------------------------------------------- C13: max_off_policy_steps = 0


def test_c13_zero_off_policy_steps_admits_only_spans_at_the_trained_version() -> None:
    # step 5 trains v4: only a rollout that started (and so ended: v5 does not exist yet) under v4 may be trained
    assert rollout_lag(5, (4, 4)) == 0 and admitted(0, 0)
    # a weight update landed mid-generation: started under v3, lag 4 - 3 = 1 > 0; admitted with 1 off-policy step
    assert rollout_lag(5, (3, 4)) == 1 and not admitted(1, 0) and admitted(1, 1)


def test_c13_build_batch_trains_only_start_equals_end_equals_trained_version() -> None:
    spans = [(4, 4), (3, 4), (3, 3), (4, 4), (2, 4), (4, 4)]
    group = [rollout(float(i % 2), span) for i, span in enumerate(spans)]
    samples, metrics = build_batch(5, [group], OrchestratorConfig(group_size=6, max_off_policy_steps=0))
    assert [s["policy_span"] for s in samples] == [[4, 4]] * 3
    assert metrics["dropped_stale"] == 3 and metrics["lag_hist/0"] == 3 and metrics["trained_staleness_max"] == 0


@settings(max_examples=300, deadline=None)
@given(step=st.integers(1, 50), starts=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 5)), min_size=2))
def test_c13_every_trained_span_is_the_trained_version(step: int, starts: list[tuple[int, int]]) -> None:
    spans = [(min(v, step - 1), min(v + d, step - 1)) for v, d in starts]  # v_start <= v_end <= step - 1
    group = [rollout(float(i % 2), span) for i, span in enumerate(spans)]
    samples, _ = build_batch(step, [group], OrchestratorConfig(group_size=len(group), max_off_policy_steps=0))
    assert all(s["policy_span"] == [step - 1, step - 1] for s in samples)


# ----------------------------------------------------------------------------- C23: the start gate


def test_c23_gate_is_on_policy_with_zero_off_policy_steps() -> None:
    # max_async_level 1, max_off_policy_steps 0: step 5 waits for v4 = 5 - 1 - min(1, 0), as max_async_level 0 would
    assert min_start_version(5, 1, 0) == 4 == min_start_version(5, 0, 0)
    # the tighter of the two bounds opens the gate: min(3, 2) = 2 -> v2; min(1, 8) = 1 -> v3
    assert min_start_version(5, 3, 2) == 2
    assert min_start_version(5, 1, 8) == 3


@settings(max_examples=300, deadline=None)
@given(
    step=st.integers(1, 60),
    max_async=st.integers(0, 10),
    max_off=st.integers(0, 10),
    served=st.integers(0, 60),
    updates=st.integers(0, 10),
)
def test_c23_a_rollout_started_through_the_gate_is_never_dropped(
    step: int, max_async: int, max_off: int, served: int, updates: int
) -> None:
    """Whatever version a step's rollout starts under once the gate is open (at most v(step-1), the newest the
    trainer can have made), and however many updates land mid-generation, the batcher admits it."""
    v_start = max(min_start_version(step, max_async, max_off), min(served, step - 1))
    if v_start < 0:  # a gate below v0 opens at v0
        v_start = 0
    span = (v_start, min(v_start + updates, step - 1))
    assert admitted(rollout_lag(step, span), max_off)


# ----------------------------------------------------------------------------- lag buckets


def test_lag_histogram_buckets_by_hand() -> None:
    # lags 0 0 1 2 3 4 7 8 100 -> 0:2, 1:1, 2:1, 3:1, 4-7:2, 8plus:2
    counts = lag_histogram([0, 0, 1, 2, 3, 4, 7, 8, 100])
    assert list(counts.values()) == [2, 1, 1, 1, 2, 2] and tuple(counts) == LAG_HIST_METRICS
    assert lag_histogram([]) == dict.fromkeys(LAG_HIST_METRICS, 0)


@given(st.lists(st.integers(-3, 200)))
def test_lag_histogram_sums_to_the_number_of_lags(lags: list[int]) -> None:
    assert sum(lag_histogram(lags).values()) == len(lags)
