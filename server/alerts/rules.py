"""Alert rules: storage and evaluation.

A rule applies to one run (``run_id``) or to every run (null). Metric rules are evaluated step by step on each
ingested batch (after its insert committed), status rules on every status transition (in the same transaction),
``stall`` rules by the Celery beat entry ``asyncrl.check_stalls``. ``alert_states`` holds, per (rule, run),
whether the rule holds and the newest step checked: a rule fires (an ``alert_events`` row and one webhook
delivery per matching endpoint) only when it starts holding, and records ``cleared`` when it stops.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy import func, or_
from sqlmodel import Session, col, select

from server.alerts import webhooks
from server.alerts.models import AlertEvent, AlertRuleRow, AlertState, RuleUpdate
from server.core.db import serialize
from server.models import Metric, MetricPoint, Run, RunStatus, stored_id, utcnow
from worker.spec import SpecError
from worker.tracking.alert_rules import (
    BUILTIN_RULES,
    MAX_GLOBAL_RULES_PER_USER,
    MAX_RULES_PER_RUN,
    AlertRule,
    NonFiniteRule,
    StallRule,
    StatusRule,
    ThresholdRule,
    ThroughputRule,
    default_source,
    describe,
)

RULE = TypeAdapter(AlertRule)
OPS = {">": float.__gt__, ">=": float.__ge__, "<": float.__lt__, "<=": float.__le__}


def add(session: Session, rule: Any, *, run_id: int | None, by: str, origin: str = "api") -> AlertRuleRow:
    """Store a validated rule for run ``run_id`` (None: every run). Flushes only.

    Raises:
        SpecError: the run has ``MAX_RULES_PER_RUN`` rules already, or ``by`` has ``MAX_GLOBAL_RULES_PER_USER``
            global ones (a spec's own rules are bounded by the spec: ``origin="spec"`` is not counted here).
    """
    if origin != "spec":
        _check_room(session, run_id=run_id, by=by)
    row = AlertRuleRow(run_id=run_id, kind=rule.kind, rule=rule.model_dump(mode="json"), origin=origin, created_by=by)
    session.add(row)
    session.flush()
    if run_id is not None and isinstance(rule, ThresholdRule | ThroughputRule):
        _judge_newest(session, row, rule, run_id)
    return row


def _judge_newest(session: Session, row: AlertRuleRow, rule: Any, run_id: int) -> None:
    """Judge a just added threshold/throughput rule of run ``run_id`` at the newest stored step of its series (a
    run already over the threshold fires now, not at its next point; one not over it is ``ok`` from that step on:
    :func:`on_metrics` goes on after it). Flushes only."""
    series = _series(session, run_id, rule.source, rule.metric, None, rule.window + 1)
    run = session.get(Run, run_id)
    if not series or run is None:
        return
    holding, data = _holds_at(rule, series, len(series) - 1)
    _set(
        session,
        row,
        rule,
        run,
        _states(session, run_id, [stored_id(row)])[stored_id(row)],
        holding,
        series[-1][0],
        **data,
    )
    session.flush()


def _check_room(session: Session, *, run_id: int | None, by: str) -> None:
    serialize(session, f"asyncrl:alert-rules:{run_id if run_id is not None else 'user:' + by}")  # count, then add
    where = (
        [col(AlertRuleRow.run_id) == run_id]
        if run_id is not None
        else [
            col(AlertRuleRow.run_id).is_(None),
            col(AlertRuleRow.created_by) == by,
        ]
    )
    n = int(session.exec(select(func.count()).select_from(AlertRuleRow).where(*where)).one())
    if run_id is not None and n >= MAX_RULES_PER_RUN:
        raise SpecError(f"alerts: run {run_id} has {n} alert rules, the most one run may have ({MAX_RULES_PER_RUN})")
    if run_id is None and n >= MAX_GLOBAL_RULES_PER_USER:
        raise SpecError(
            f"alerts: {by} has {n} global alert rules, the most one user may add ({MAX_GLOBAL_RULES_PER_USER})"
        )


def add_spec_rules(session: Session, run: Run) -> None:
    """Store the ``alerts`` of ``run``'s spec as rules of that run."""
    for data in run.spec.get("alerts", []):
        add(session, RULE.validate_python(data), run_id=run.id, by=run.owner, origin="spec")


def list_rules(session: Session, *, run_id: int | None = None, applying: bool = False) -> list[AlertRuleRow]:
    """Rules of one run (or the global ones when ``run_id`` is None); with ``applying``, the global ones too."""
    where = [col(AlertRuleRow.run_id) == run_id] if run_id is not None else [col(AlertRuleRow.run_id).is_(None)]
    if applying:
        where = [or_(*where, col(AlertRuleRow.run_id).is_(None))]
    return list(session.exec(select(AlertRuleRow).where(*where).order_by(col(AlertRuleRow.id))).all())


def get(session: Session, rule_id: int) -> AlertRuleRow:
    """Raises: webhooks.NotFound."""
    row = session.get(AlertRuleRow, rule_id) if 0 < rule_id < 2**31 else None
    if row is None:
        raise webhooks.NotFound(f"alert rule {rule_id} not found")
    return row


def update(session: Session, row: AlertRuleRow, body: RuleUpdate) -> AlertRuleRow:
    """Enable or disable ``row``, or replace its rule with one of the same kind (its episode state is kept: the
    next check under the new rule decides whether it still holds). Flushes only.

    Raises:
        SpecError: the new rule is of another kind (``rule.kind: …``).
    """
    if body.rule is not None:
        if body.rule.kind != row.kind:
            raise SpecError(f"rule.kind: rule {row.id} is a {row.kind} rule, got {body.rule.kind!r}")
        row.rule = body.rule.model_dump(mode="json")
    if body.enabled is not None:
        row.enabled = body.enabled
    session.add(row)
    session.flush()
    return row


def events(session: Session, *, run_id: int | None, offset: int, limit: int) -> tuple[list[AlertEvent], int]:
    """Alert events newest first (of one run, or all); returns (page, total)."""
    where = [AlertEvent.run_id == run_id] if run_id is not None else []
    total = session.exec(select(func.count()).select_from(AlertEvent).where(*where)).one()
    rows = session.exec(
        select(AlertEvent).where(*where).order_by(col(AlertEvent.id).desc()).offset(offset).limit(limit)
    ).all()
    return list(rows), int(total)


# ----------------------------------------------------------------------------- firing


def _active(session: Session, run_id: int, kinds: Sequence[str]) -> list[tuple[AlertRuleRow, Any]]:
    rows = session.exec(
        select(AlertRuleRow).where(
            col(AlertRuleRow.enabled),
            col(AlertRuleRow.kind).in_(kinds),
            or_(col(AlertRuleRow.run_id) == run_id, col(AlertRuleRow.run_id).is_(None)),
        )
    ).all()
    return [(r, RULE.validate_python(r.rule)) for r in rows]


def _states(session: Session, run_id: int, rule_ids: Sequence[int]) -> dict[int, AlertState]:
    """The (rule, run) states of ``rule_ids``, locked until the transaction ends (missing ones are added)."""
    stmt = select(AlertState).where(AlertState.run_id == run_id, col(AlertState.rule_id).in_(rule_ids))
    found = {st.rule_id: st for st in session.exec(stmt.with_for_update()).all()}
    for rule_id in set(rule_ids) - set(found):
        found[rule_id] = AlertState(rule_id=rule_id, run_id=run_id)
        session.add(found[rule_id])
    session.flush()
    return found


def _record(
    session: Session, row: AlertRuleRow, run: Run, state: str, message: str, step: int | None, **data: Any
) -> AlertEvent:
    ev = AlertEvent(
        rule_id=stored_id(row), run_id=stored_id(run), kind=row.kind, state=state, step=step, message=message, data=data
    )
    session.add(ev)
    session.flush()
    if state == "fired":
        webhooks.fan_out(session, ev, run)
    return ev


def on_engine_event(session: Session, run: Run, event: str, reason: str, data: dict[str, Any]) -> AlertEvent | None:
    """Fire the built-in rule of run event ``event`` (``worker.tracking.alert_rules.BUILTIN_RULES``), if it has one: an
    ``alert_events`` row without a rule (``kind`` the built-in's) and a delivery to every endpoint whose filter has that
    kind, through the same signed webhook path as the stored rules. Call it once per recorded event (the caller skips
    a resent one, so each event alerts once). Flushes only."""
    kind = next((k for k, ev in BUILTIN_RULES.items() if ev == event), None)
    if kind is None:
        return None
    step = data.get("step") if isinstance(data.get("step"), int) else None
    ev = AlertEvent(
        rule_id=None,
        run_id=stored_id(run),
        kind=kind,
        state="fired",
        step=step,
        message=f"{event} (built-in rule {kind}): {reason}"[:2000],
        data={"event": event, "reason": reason, **{k: v for k, v in data.items() if k != "reason"}},
    )
    session.add(ev)
    session.flush()
    webhooks.fan_out(session, ev, run)
    return ev


def _set(
    session: Session,
    row: AlertRuleRow,
    rule: Any,
    run: Run,
    state: AlertState,
    holding: bool,
    step: int | None,
    **data: Any,
) -> None:
    """Move the (rule, run) state to ``holding``; an edge records ``fired`` or ``cleared``."""
    if holding != state.holding:
        state.holding = holding
        state.episodes += int(holding)
        where = f" at step {step}" if step is not None else ""
        verb = "fired" if holding else "cleared"
        _record(session, row, run, verb, f"{describe(rule)}: {verb}{where}", step, **data)
    if step is not None:
        state.last_step = max(state.last_step, step)
    if session.is_modified(state):
        state.updated_at = utcnow()
        session.add(state)


def on_status(session: Session, run: Run, old: RunStatus | None, new: RunStatus | str, reason: str = "") -> None:
    """Fire the ``status`` rules that watch this change: a transition, ``requeued`` (a resume moves a failed or
    cancelled run back to queued; a Slurm requeue of the run's job records a ``requeued`` event), or ``stalled`` (the
    hang watchdog's event, ``runs.record_engine_events``)."""
    resumed = new == RunStatus.queued and old in (RunStatus.failed, RunStatus.cancelled)
    name = "requeued" if resumed else str(new)
    reason = reason or run.status_reason
    for row, rule in _active(session, stored_id(run), ["status"]):
        if isinstance(rule, StatusRule) and name in rule.statuses:
            message = f"{describe(rule)}: run {run.id} is {name}" + (f" ({reason[:300]})" if reason else "")
            _record(session, row, run, "fired", message, None, status=name, previous=old and old.value)


def _series(session: Session, run_id: int, source: str, name: str, upto: int | None, n: int) -> list[tuple[int, float]]:
    """The last ``n`` points (step, value) of one series at or before step ``upto`` (None: any), oldest first."""
    query = select(Metric.step, Metric.value).where(
        Metric.run_id == run_id, Metric.source == source, Metric.name == name
    )
    if upto is not None:
        query = query.where(col(Metric.step) <= upto)
    rows = session.exec(query.order_by(col(Metric.step).desc()).limit(n)).all()
    return [(int(s), float(v)) for s, v in reversed(rows)]


def _holds_at(rule: Any, points: list[tuple[int, float]], i: int) -> tuple[bool, dict[str, Any]]:
    """Whether a threshold/throughput rule holds at ``points[i]`` (a series, oldest first)."""
    step, value = points[i]
    if isinstance(rule, ThresholdRule):
        window = [v for _, v in points[max(0, i + 1 - rule.window) : i + 1]]
        ok = step >= rule.after_step and len(window) == rule.window and all(OPS[rule.op](v, rule.value) for v in window)
        return ok, {"metric": rule.metric, "value": value if math.isfinite(value) else None, "window": window[-5:]}
    before = [v for _, v in points[max(0, i - rule.window) : i] if math.isfinite(v)]
    median = statistics.median(before) if len(before) == rule.window else None
    ok = median is not None and math.isfinite(value) and value < rule.fraction * median
    return ok, {"metric": rule.metric, "value": value if math.isfinite(value) else None, "median": median}


def _watched(rule: Any) -> list[tuple[str, str]]:
    """(source, name) of the series a metric rule reads."""
    if isinstance(rule, NonFiniteRule):
        return [(default_source(m), m) for m in rule.metrics]
    return [(rule.source, rule.metric)]


def on_metrics(session: Session, run_id: int, points: Sequence[MetricPoint]) -> None:
    """Evaluate the run's metric rules at every new step of ``points`` (steps above each rule's last checked one),
    and clear a holding ``stall`` rule. Call after the points are committed; the caller commits. Costs one query
    for the rules, one for their states, and one per threshold/throughput rule whose series is in the batch."""
    if not points:
        return
    by_key: dict[tuple[str, str], dict[int, float]] = {}
    for p in points:
        by_key.setdefault((p.source, p.name), {})[p.step] = p.value
    rules = [
        (row, rule)
        for row, rule in _active(session, run_id, ["threshold", "throughput", "non_finite", "stall"])
        if isinstance(rule, StallRule) or any(k in by_key for k in _watched(rule))
    ]
    if not rules:
        return
    run = session.get(Run, run_id)
    assert run is not None
    states = _states(session, run_id, [stored_id(row) for row, _ in rules])
    for row, rule in rules:
        state = states[stored_id(row)]
        if isinstance(rule, StallRule):
            _set(session, row, rule, run, state, False, None)
        elif isinstance(rule, NonFiniteRule):
            watched = _watched(rule)
            steps = sorted({s for k in watched for s in by_key.get(k, {}) if s > state.last_step})
            for step in steps:
                values = {k[1]: by_key.get(k, {}).get(step) for k in watched}
                bad = {m: str(v) for m, v in values.items() if v is not None and not math.isfinite(v)}
                _set(session, row, rule, run, state, bool(bad), step, values=bad)
        else:
            new = sorted(s for s in by_key[(rule.source, rule.metric)] if s > state.last_step)
            if not new:
                continue
            series = _series(session, run_id, rule.source, rule.metric, new[-1], len(new) + rule.window)
            for i, (step, _value) in enumerate(series):
                if step in new:
                    holding, data = _holds_at(rule, series, i)
                    _set(session, row, rule, run, state, holding, step, **data)
    session.flush()


def check_stalls(session: Session, now: datetime | None = None) -> list[tuple[int, int]]:
    """Fire ``stall`` rules of running runs that sent no metric for the rule's ``seconds`` (measured from the
    newest point's time, or from the run's last status change if later). Returns (rule id, run id) fired."""
    now = now or utcnow()
    fired = []
    running = session.exec(select(Run).where(Run.status == RunStatus.running.value)).all()
    for run in running:
        run_id = stored_id(run)
        rules = _active(session, run_id, ["stall"])
        if not rules:
            continue
        newest = session.exec(select(func.max(Metric.time)).where(Metric.run_id == run_id)).one()
        since = max(float(newest or 0.0), run.updated_at.timestamp())
        quiet = now.timestamp() - since
        states = _states(session, run_id, [stored_id(row) for row, _ in rules])
        for row, rule in rules:
            state = states[stored_id(row)]
            if quiet > rule.seconds and not state.holding:
                fired.append((stored_id(row), run_id))
            if quiet > rule.seconds:
                _set(session, row, rule, run, state, True, None, quiet_s=round(quiet, 1))
    session.flush()
    return fired
