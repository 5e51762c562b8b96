"""Dashboard pages for alerts: rules (global and per run), alert events, webhook endpoints, delivery logs, replay.

``/alerts`` (``?run=<id>``: the rules that apply to that run and its events) and ``/alerts/webhooks/{id}`` (one
endpoint's delivery log). Every write is a POST form with the session's CSRF token and a write token, checked by
``server/services/permissions.py`` as the REST API's, and calls the same services (``server/alerts``); viewers and
read tokens see no forms, members see the edit forms of what they may change only.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import ValidationError
from sqlmodel import col, select
from starlette.datastructures import FormData

from server.alerts import rules, webhooks
from server.alerts.models import AlertRuleRow, AlertState, EndpointCreate, EndpointCreated, RuleIn, RuleUpdate
from server.models import stored_id
from server.services import permissions, runs
from server.services.permissions import Forbidden
from server.services.runs import RunNotFound
from server.services.tokens import Principal
from webui.errors import HTMLErrorRoute
from webui.page import FormDep, Page, SessionDep, page
from worker.spec import SpecError
from worker.tracking.alert_rules import (
    EVENT_KINDS,
    KNOWN_METRICS,
    RULE_KINDS,
    STATUS_EVENTS,
    NonFiniteRule,
    StallRule,
    StatusRule,
    ThresholdRule,
    ThroughputRule,
    describe,
)

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)
KIND_FIELDS = {
    kind: [f for f in model.model_fields if f != "kind"]
    for kind, model in (
        ("status", StatusRule),
        ("threshold", ThresholdRule),
        ("stall", StallRule),
        ("non_finite", NonFiniteRule),
        ("throughput", ThroughputRule),
    )
}
"""Each rule kind's form fields, in the schema's order."""
LIST_FIELDS = ("statuses", "metrics")
"""Fields typed as comma-separated lists in the form."""
RECENT_EVENTS = 50
RECENT_DELIVERIES = 100


def first_error(err: ValidationError) -> tuple[str, str]:
    """(field, one-line message naming it) of a pydantic error; a rule kind's tag is left out of the field path."""
    first = err.errors()[0]
    loc = [str(x) for x in first["loc"] if str(x) not in RULE_KINDS]
    field = loc[0] if loc else "kind"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "union_tag_invalid":
        msg = f"expected one of {', '.join(RULE_KINDS)}, got {first.get('ctx', {}).get('tag')!r}"
    return field, f"{'.'.join(loc) or field}: {msg}"


def rule_from_form(form: Any) -> dict[str, Any]:
    """The filled fields of the chosen kind as rule data (lists split on commas); unfilled fields take defaults."""
    kind = str(form.get("kind", ""))
    data: dict[str, Any] = {"kind": kind}
    for name in KIND_FIELDS.get(kind, []):
        value = str(form.get(name, "")).strip()
        if value:
            data[name] = [v.strip() for v in value.split(",") if v.strip()] if name in LIST_FIELDS else value
    return data


def _run_id(text: str, field: str = "run") -> int | None:
    """The run id typed in ``field`` (None when empty). Raises HTTPException(422) naming ``field``."""
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 2**31:
        raise HTTPException(422, f"{field}: expected a run id (a whole number >= 1), got {text!r}")
    return int(text)


def allowed(check: Callable[[], None]) -> bool:
    """Whether a ``permissions`` check passes (the page then shows the form it guards)."""
    try:
        check()
    except Forbidden:
        return False
    return True


def alerts_context(db: Any, run_id: int | None, user: Principal) -> dict[str, Any]:
    """Rules with their descriptions, firing runs and whether ``user`` may edit them, recent events and webhook
    endpoints (of ``run_id``'s view; URLs redacted but for their owner and admins)."""
    if run_id is not None:
        rows = rules.list_rules(db, run_id=run_id, applying=True)
    else:
        rows = list(db.exec(select(AlertRuleRow).order_by(col(AlertRuleRow.id))).all())
    firing: dict[int, list[int]] = {}
    ids = [stored_id(r) for r in rows]
    for state in db.exec(select(AlertState).where(col(AlertState.rule_id).in_(ids), col(AlertState.holding))).all():
        if run_id is None or state.run_id == run_id:
            firing.setdefault(state.rule_id, []).append(state.run_id)
    shown = [
        {
            "row": r,
            "text": describe(rules.RULE.validate_python(r.rule)),
            "firing": sorted(firing.get(stored_id(r), [])),
            "editable": allowed(partial(permissions.require_rule, db, user, r, "change it")),
        }
        for r in rows
    ]
    events, total = rules.events(db, run_id=run_id, offset=0, limit=RECENT_EVENTS)
    endpoints = webhooks.list_endpoints(db)
    return {
        "rules": shown,
        "events": events,
        "events_total": total,
        "webhooks": [
            webhooks.public_endpoint(e, read_only=not permissions.owns(user, e.created_by)) for e in endpoints
        ],
        "run_id": run_id,
        "kinds": KIND_FIELDS,
        "metrics": KNOWN_METRICS,
        "statuses": STATUS_EVENTS,
        "event_names": EVENT_KINDS,
    }


def _alerts_url(run_id: int | None, rule_id: int) -> str:
    return (f"/alerts?run={run_id}" if run_id else "/alerts") + f"#rule-{rule_id}"


def _render(p: Page, code: int = 200, **values: Any) -> HTMLResponse:
    run_id = values.pop("run_id", None)
    return p.render("alerts.html", code=code, **{**alerts_context(p.db, run_id, p.need_user()), **values})


@router.get("/alerts", response_class=HTMLResponse)
def alerts_page(request: Request, db: SessionDep, run: str = "") -> HTMLResponse:
    """Rules, alert events and webhook endpoints; ``run`` narrows rules and events to one run."""
    p = page(request, db)
    p.need_user()
    run_id = _run_id(run)
    if run_id is not None:
        runs.get(db, run_id)  # 404 for an unknown run
    return _render(p, run_id=run_id)


@router.post("/alerts/rules")
def add_rule(request: Request, db: SessionDep, form: FormDep) -> Response:
    """Add a rule from the form (``scope``: empty for every run, else a run id); errors are shown at the field."""
    p = page(request, db)
    p.form(form)
    user = p.need_user()
    data, scope = rule_from_form(form), str(form.get("scope", "")).strip()
    shown_run = _run_id(str(form.get("run", "")))
    values: dict[str, Any] = {"run_id": shown_run, "draft": dict(form)}
    try:
        run_id = _run_id(scope, "scope")
        rule = RuleIn.model_validate(data)
    except HTTPException as err:
        return _render(p, 422, field_error={"scope": str(err.detail)}, **values)
    except ValidationError as err:
        field, msg = first_error(err)
        return _render(p, 422, field_error={field: msg}, **values)
    try:
        if run_id is not None:
            permissions.require_run(user, runs.get(db, run_id), "alerts")
    except RunNotFound as err:
        return _render(p, 422, field_error={"scope": f"scope: {err}"}, **values)
    try:
        row = rules.add(db, rule.root, run_id=run_id, by=user.name)
    except SpecError as err:  # the run's or the user's cap of rules
        db.rollback()
        return _render(p, 422, error=str(err), **values)
    db.commit()
    return p.redirect(_alerts_url(shown_run, stored_id(row)))


def _update_rule(request: Request, db: Any, form: FormData, rule_id: int, change: Any) -> Response:
    """Apply ``change(form, row) -> RuleUpdate`` with the service of the API's PATCH; its error is shown on the
    page."""
    p = page(request, db)
    p.form(form)
    user = p.need_user()
    run_id = _run_id(str(form.get("run", "")))
    row = rules.get(db, rule_id)
    permissions.require_rule(db, user, row, "change it")
    try:
        rules.update(db, row, change(form, row))
    except ValidationError as err:
        return _render(p, 422, run_id=run_id, error=f"rule {rule_id}: {first_error(err)[1]}")
    except SpecError as err:
        db.rollback()
        return _render(p, 422, run_id=run_id, error=str(err))
    db.commit()
    return p.redirect(_alerts_url(run_id, rule_id))


@router.post("/alerts/rules/{rule_id}/enabled")
def set_enabled(request: Request, db: SessionDep, rule_id: int, form: FormDep) -> Response:
    """Enable (``enabled=1``) or disable (``enabled=0``) a rule."""

    def change(form: Any, _row: AlertRuleRow) -> RuleUpdate:
        return RuleUpdate.model_validate({"enabled": str(form.get("enabled", ""))})

    return _update_rule(request, db, form, rule_id, change)


@router.post("/alerts/rules/{rule_id}/threshold")
def set_threshold(request: Request, db: SessionDep, rule_id: int, form: FormDep) -> Response:
    """Replace a threshold rule's ``value`` (the rest of the rule is kept)."""

    def change(form: Any, row: AlertRuleRow) -> RuleUpdate:
        return RuleUpdate.model_validate({"rule": {**row.rule, "value": str(form.get("value", "")).strip()}})

    return _update_rule(request, db, form, rule_id, change)


@router.post("/alerts/webhooks")
def add_webhook(request: Request, db: SessionDep, form: FormDep) -> Response:
    """Add a webhook endpoint; the page shows its signing secret once."""
    p = page(request, db)
    p.form(form)
    user = p.need_user()
    draft = {
        "url": str(form.get("url", "")).strip(),
        "name": str(form.get("name", "")).strip(),
        "format": str(form.get("format", "json")),
        "events": form.getlist("events"),
    }
    try:
        body = EndpointCreate.model_validate({k: v for k, v in draft.items() if v != ""})
        row, secret = webhooks.create_endpoint(db, body, by=user.name)
    except ValidationError as err:
        return _render(p, 422, hook_error=first_error(err)[1], hook_draft=draft)
    except webhooks.UnsafeURL as err:
        db.rollback()
        return _render(p, 422, hook_error=str(err), hook_draft=draft)
    except SpecError as err:  # the user's cap of endpoints: a page message, as the rule cap
        db.rollback()
        return _render(p, 422, error=str(err), hook_draft=draft)
    db.commit()
    db.refresh(row)
    created = EndpointCreated(**webhooks.public_endpoint(row, read_only=False).model_dump(), secret=secret)
    return _render(p, 201, created=created)


@router.get("/alerts/webhooks/{endpoint_id}", response_class=HTMLResponse)
def webhook_page(request: Request, db: SessionDep, endpoint_id: int) -> HTMLResponse:
    """One endpoint's delivery log, newest first, with a Replay button per delivery."""
    p = page(request, db)
    user = p.need_user()
    row = webhooks.get_endpoint(db, endpoint_id)
    log, total = webhooks.deliveries(db, row, offset=0, limit=RECENT_DELIVERIES)
    read_only = not permissions.owns(user, row.created_by)
    return p.render(
        "alerts_webhook.html",
        can_replay=allowed(lambda: permissions.require_endpoint(user, row, "replay its deliveries")),
        endpoint=webhooks.public_endpoint(row, read_only=read_only),
        deliveries=[webhooks.public_delivery(x, read_only=read_only) for x in log],
        total=total,
    )


@router.post("/alerts/deliveries/{delivery_id}/replay")
def replay(request: Request, db: SessionDep, delivery_id: int, form: FormDep) -> Response:
    """Send a delivery again (same body and idempotency key, attempts start over)."""
    p = page(request, db)
    p.form(form)
    permissions.require_replay(db, p.need_user(), delivery_id)
    row = webhooks.replay(db, delivery_id)
    db.commit()
    return p.redirect(f"/alerts/webhooks/{row.endpoint_id}#delivery-{delivery_id}")
