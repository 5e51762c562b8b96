"""Alert rule schema (``worker/tracking/alert_rules.py``): every metric a process logs can be watched."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from worker.tracking.alert_rules import METRICS, AlertRule

RULE = TypeAdapter(AlertRule)


@pytest.mark.parametrize(("source", "metric"), [(s, m) for s, names in METRICS.items() for m in names])
def test_every_logged_metric_takes_a_threshold_rule(source: str, metric: str) -> None:
    rule = RULE.validate_python({"kind": "threshold", "metric": metric, "source": source, "op": ">", "value": 0.5})
    assert (rule.source, rule.metric) == (source, metric)


def test_c24_truncated_fraction_rule_defaults_to_the_orchestrator() -> None:
    rule = RULE.validate_python({"kind": "threshold", "metric": "truncated_fraction", "op": ">", "value": 0.5})
    assert rule.source == "orchestrator"
    inference = RULE.validate_python({"kind": "threshold", "metric": "weight_update_s", "op": ">", "value": 5})
    assert inference.source == "inference"


@pytest.mark.parametrize(
    ("metric", "hint"),
    [
        ("reward_meen/math", " (did you mean 'reward_mean/math'?)"),  # per environment: the env name kept
        ("pass_at_kk/reverse-text", " (did you mean 'pass_at_k/reverse-text'?)"),
        ("mismatch_kll", " (did you mean 'mismatch_kl'?)"),
        ("lag_hst/0", " (did you mean 'lag_hist/0'?)"),  # a logged name that holds a '/'
        ("throughput/math", ""),  # nothing close: no guess
    ],
)
def test_a_mistyped_metric_gets_a_hint_per_environment_too(metric: str, hint: str) -> None:
    with pytest.raises(ValueError) as err:
        RULE.validate_python({"kind": "threshold", "metric": metric, "op": ">", "value": 0.5})
    message = err.value.errors()[0]["msg"]  # type: ignore[attr-defined]
    assert message.startswith(f"Value error, unknown metric {metric!r}{hint}; known: loss, ")
