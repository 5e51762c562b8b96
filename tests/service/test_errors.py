"""``server/errors.py``: one table maps domain errors to HTTP status; subclasses take their base's status."""

from __future__ import annotations

import pytest

from server.alerts.webhooks import NotFound, StillRetrying, UnsafeURL
from server.errors import HTTP_STATUS, http_status
from server.services.config import RevisionNotFound, RunNotLive
from server.services.rollouts import BadRolloutId, RolloutNotFound
from server.services.runs import InvalidTransition, RunNotFound
from worker.live_config import LiveConfigError
from worker.spec import SpecError


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (SpecError("x: bad"), 422),
        (LiveConfigError("x: bad"), 422),
        (UnsafeURL("url: bad"), 422),
        (RunNotFound("run 1 not found"), 404),
        (RevisionNotFound("no revision"), 404),
        (RolloutNotFound("rid: rollout 2-1-0 is of run 2, not of run 1"), 404),
        (BadRolloutId("rid: expected <run>-<step>-<line>"), 422),
        (NotFound("rule 1 not found"), 404),
        (InvalidTransition("run 1 is completed"), 409),
        (RunNotLive("run 1 is completed"), 409),
        (StillRetrying("pending"), 409),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_domain_errors_map_to_their_status(err: Exception, status: int) -> None:
    assert http_status(err) == status


def test_other_errors_have_no_status() -> None:
    assert http_status(ValueError("x")) is None and http_status(LookupError("x")) is None
    from server.jobs.celery_app import BrokerUnavailable

    # client errors, but for the broker that did not take a task: the service is unavailable, not the input bad
    assert {cls: s for cls, s in HTTP_STATUS.items() if not 400 <= s < 500} == {BrokerUnavailable: 503}
