"""Alert rules (``/api/alerts/rules``, ``/api/runs/{id}/alerts/rules``), alert events, webhook endpoints
(``/api/webhooks``), their delivery logs and replays (``/api/deliveries/{id}/replay``).

Writes need a user token with write scope (``current_principal`` refuses viewers and read tokens on non-GET
requests); a run's rules are changed by its owner or an admin, a global rule or a webhook endpoint by the user that
added it or an admin (``server/services/permissions.py``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response

from server.alerts import rules, webhooks
from server.alerts.models import (
    AlertEventPublic,
    AlertRuleRow,
    DeliveryPublic,
    EndpointCreate,
    EndpointCreated,
    EndpointPublic,
    Page,
    RuleIn,
    RulePublic,
    RuleUpdate,
    WebhookEndpoint,
)
from server.api.deps import SessionDep, UserDep
from server.services import permissions, runs

router = APIRouter(tags=["alerts"])
Offset = Annotated[int, Query(ge=0)]
Limit = Annotated[int, Query(ge=1, le=1000)]


def _rule(rule_id: int, session: SessionDep, _user: UserDep) -> AlertRuleRow:
    return rules.get(session, rule_id)


def _endpoint(endpoint_id: int, session: SessionDep, _user: UserDep) -> WebhookEndpoint:
    return webhooks.get_endpoint(session, endpoint_id)


RuleDep = Annotated[AlertRuleRow, Depends(_rule)]
"""The rule of the path's ``rule_id`` (after the token check), else 404."""
EndpointDep = Annotated[WebhookEndpoint, Depends(_endpoint)]
"""The webhook endpoint of the path's ``endpoint_id`` (after the token check), else 404."""


def _add_rule(session: SessionDep, rule: Any, run_id: int | None, by: str) -> Any:
    row = rules.add(session, rule.root, run_id=run_id, by=by)
    session.commit()
    session.refresh(row)
    return row


@router.post("/alerts/rules", status_code=201, response_model=RulePublic)
def create_global_rule(session: SessionDep, user: UserDep, rule: RuleIn) -> Any:
    """A rule checked for every run."""
    return _add_rule(session, rule, None, user.name)


@router.get("/alerts/rules", response_model=Page[RulePublic])
def list_global_rules(session: SessionDep, _user: UserDep) -> Any:
    data = rules.list_rules(session)
    return {"data": data, "count": len(data)}


@router.post("/runs/{run_id}/alerts/rules", status_code=201, response_model=RulePublic)
def create_run_rule(run_id: int, session: SessionDep, user: UserDep, rule: RuleIn) -> Any:
    """A rule checked for this run only (its owner or an admin)."""
    permissions.require_run(user, runs.get(session, run_id), "alerts")
    return _add_rule(session, rule, run_id, user.name)


@router.get("/runs/{run_id}/alerts/rules", response_model=Page[RulePublic])
def list_run_rules(run_id: int, session: SessionDep, _user: UserDep) -> Any:
    """Rules checked for this run: its own (API and spec) and the global ones."""
    runs.get(session, run_id)
    data = rules.list_rules(session, run_id=run_id, applying=True)
    return {"data": data, "count": len(data)}


@router.patch("/alerts/rules/{rule_id}", response_model=RulePublic)
def update_rule(body: RuleUpdate, session: SessionDep, user: UserDep, row: RuleDep) -> Any:
    """Enable or disable a rule, or replace it with one of the same kind (its episode state is kept: the next
    check under the new rule decides whether it still holds)."""
    permissions.require_rule(session, user, row, "change it")
    rules.update(session, row, body)
    session.commit()
    session.refresh(row)
    return row


@router.delete("/alerts/rules/{rule_id}", status_code=204)
def delete_rule(session: SessionDep, user: UserDep, row: RuleDep) -> Response:
    """Delete a rule with its states and events (their deliveries too)."""
    permissions.require_rule(session, user, row, "delete it")
    session.delete(row)
    session.commit()
    return Response(status_code=204)


@router.get("/alerts/events", response_model=Page[AlertEventPublic])
def list_alert_events(
    session: SessionDep,
    _user: UserDep,
    run_id: int | None = Query(None, ge=1),
    offset: Offset = 0,
    limit: Limit = 100,
) -> Any:
    """Alert events (``fired``/``cleared``), newest first."""
    data, count = rules.events(session, run_id=run_id, offset=offset, limit=limit)
    return {"data": data, "count": count}


# ----------------------------------------------------------------------------- webhooks


@router.post(
    "/webhooks",
    status_code=201,
    response_model=EndpointCreated,
    responses={422: {"description": "invalid or refused URL (SSRF guard), unknown event"}},
)
def create_webhook(body: EndpointCreate, session: SessionDep, user: UserDep) -> Any:
    """Add an endpoint; the response holds its signing secret, which is never shown again."""
    row, secret = webhooks.create_endpoint(session, body, by=user.name)
    session.commit()
    session.refresh(row)
    return EndpointCreated(**webhooks.public_endpoint(row, read_only=False).model_dump(), secret=secret)


@router.get("/webhooks", response_model=Page[EndpointPublic])
def list_webhooks(session: SessionDep, user: UserDep) -> Any:
    """Endpoints; each URL is shown as ``scheme://host[:port]/…`` (the path may be a credential) except to the user
    that added it (with a write token) and admins."""
    data = [
        webhooks.public_endpoint(r, read_only=not permissions.owns(user, r.created_by))
        for r in webhooks.list_endpoints(session)
    ]
    return {"data": data, "count": len(data)}


@router.get("/webhooks/{endpoint_id}", response_model=EndpointPublic)
def get_webhook(user: UserDep, endpoint: EndpointDep) -> Any:
    """One endpoint; URL redacted as in the list."""
    return webhooks.public_endpoint(endpoint, read_only=not permissions.owns(user, endpoint.created_by))


@router.delete("/webhooks/{endpoint_id}", status_code=204)
def delete_webhook(session: SessionDep, user: UserDep, endpoint: EndpointDep) -> Response:
    """Delete an endpoint and its delivery log (the user that added it, or an admin)."""
    permissions.require_endpoint(user, endpoint, "delete it")
    session.delete(endpoint)
    session.commit()
    return Response(status_code=204)


@router.get("/webhooks/{endpoint_id}/deliveries", response_model=Page[DeliveryPublic])
def list_deliveries(
    session: SessionDep, user: UserDep, endpoint: EndpointDep, offset: Offset = 0, limit: Limit = 100
) -> Any:
    """The endpoint's delivery log, newest first: status, HTTP code, latency, attempts, last error (whole only to the
    user that added the endpoint and admins; others see ``HTTP <code>`` or the error's kind)."""
    rows, count = webhooks.deliveries(session, endpoint, offset=offset, limit=limit)
    read_only = not permissions.owns(user, endpoint.created_by)
    return {"data": [webhooks.public_delivery(r, read_only=read_only) for r in rows], "count": count}


@router.post(
    "/deliveries/{delivery_id}/replay",
    response_model=DeliveryPublic,
    responses={409: {"description": "the delivery is still pending (being retried)"}},
)
def replay_delivery(delivery_id: int, session: SessionDep, user: UserDep) -> Any:
    """Send a delivery again: same body and ``Idempotency-Key``, attempts start over (the user that added its
    endpoint, or an admin)."""
    permissions.require_replay(session, user, delivery_id)
    row = webhooks.replay(session, delivery_id)
    session.commit()
    session.refresh(row)
    return row
