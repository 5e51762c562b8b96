"""Run lifecycle: create, list, transition, stop.

States: ``queued → starting → running ⇄ paused → completed | failed | cancelled``. Any live state may also
end in ``failed`` or ``cancelled``. Every transition writes a ``run_events`` row with its time and reason.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from sqlalchemy import func
from sqlmodel import Session, col, select

from server.core.config import settings
from server.models import TERMINAL, Run, RunEvent, RunStatus, utcnow
from worker.spec import validate_spec

S = RunStatus
TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    S.queued: frozenset({S.starting, S.failed, S.cancelled}),
    S.starting: frozenset({S.running, S.failed, S.cancelled}),
    S.running: frozenset({S.paused, S.completed, S.failed, S.cancelled}),
    S.paused: frozenset({S.running, S.completed, S.failed, S.cancelled}),
    S.completed: frozenset(),
    S.failed: frozenset(),
    S.cancelled: frozenset(),
}


class RunNotFound(LookupError):
    pass


class InvalidTransition(ValueError):
    pass


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def create(session: Session, *, data: dict[str, Any], owner: str) -> Run:
    """Validate a raw spec mapping and add a ``queued`` run. The run directory is
    ``<ASYNCRL_OUTPUT_DIR>/runs/<id>/<name>``: ``output_dir`` of the stored spec is set to match.

    Raises:
        SpecError: the spec is invalid (one line naming the field).
    """
    kind = data.get("kind", "rl")
    spec = validate_spec(kind if isinstance(kind, str) else repr(kind), data)
    if spec.kind != "rl":
        from worker.spec import SpecError

        raise SpecError(f"kind: the service launches 'rl' runs, got {spec.kind!r}")
    run = Run(name=spec.name, kind=spec.kind, spec={}, spec_hash="", owner=owner, run_dir="")
    session.add(run)
    session.flush()  # assigns the id
    out = Path(settings.ASYNCRL_OUTPUT_DIR) / "runs" / str(run.id)
    resolved = json.loads(spec.model_copy(update={"output_dir": str(out)}).model_dump_json())
    run.spec, run.spec_hash, run.run_dir = resolved, spec_hash(resolved), str(out / spec.name)
    session.add(RunEvent(run_id=run.id, kind="status", to_status=S.queued, reason=f"submitted by {owner}"))
    session.flush()
    return run


def get(session: Session, run_id: int, *, lock: bool = False) -> Run:
    """The run, optionally locked (``SELECT … FOR UPDATE``) until the transaction ends.

    Raises:
        RunNotFound: no run with this id.
    """
    stmt = select(Run).where(Run.id == run_id)
    if lock:
        stmt = stmt.with_for_update()
    run = session.exec(stmt).first()
    if run is None:
        raise RunNotFound(f"run {run_id} not found")
    return run


def list_runs(session: Session, *, status: RunStatus | None = None, name: str | None = None,
              offset: int = 0, limit: int = 50) -> tuple[list[Run], int]:
    """Runs newest first, filtered by status and by a substring of the name; returns (page, total)."""
    where = []
    if status is not None:
        where.append(col(Run.status) == status.value)
    if name:
        where.append(col(Run.name).contains(name, autoescape=True))
    total = session.exec(select(func.count()).select_from(Run).where(*where)).one()
    rows = session.exec(select(Run).where(*where).order_by(col(Run.id).desc()).offset(offset).limit(limit)).all()
    return list(rows), int(total)


def transition(session: Session, run: Run, to: RunStatus, *, reason: str = "", **data: Any) -> bool:
    """Move ``run`` to ``to`` and record the event; a repeat of the current state is a no-op (returns False).

    Raises:
        InvalidTransition: ``to`` is not reachable from the current state.
    """
    current = RunStatus(run.status)
    if to == current:
        return False
    if to not in TRANSITIONS[current]:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "none (terminal)"
        raise InvalidTransition(f"run {run.id} is {current.value}: cannot go to {to.value} (allowed: {allowed})")
    now = utcnow()
    run.status, run.status_reason, run.updated_at = to, reason, now
    if to == S.running and run.started_at is None:
        run.started_at = now
    if to in TERMINAL:
        run.finished_at = now
    session.add(run)
    session.add(RunEvent(run_id=run.id, kind="status", from_status=current, to_status=to, reason=reason, data=data))
    session.flush()
    return True


def record_event(session: Session, run: Run, kind: str, *, reason: str = "", **data: Any) -> None:
    session.add(RunEvent(run_id=run.id, kind=kind, reason=reason, data=data))
    session.flush()


def request_stop(session: Session, run: Run, *, by: str) -> bool:
    """Stop a run: a queued one is cancelled at once (returns False); a launched one gets a
    ``stop_requested`` event and the caller enqueues ``stop_run`` after the commit (returns True).

    Raises:
        InvalidTransition: the run has already ended.
    """
    current = RunStatus(run.status)
    if current in TERMINAL:
        raise InvalidTransition(f"run {run.id} is {current.value}: only queued, starting, running or paused runs stop")
    if current == S.queued and not run.launcher_handle:
        transition(session, run, S.cancelled, reason=f"stopped by {by} before launch")
        return False
    record_event(session, run, "stop_requested", reason=f"stopped by {by}")
    return True


def events(session: Session, run_id: int, *, offset: int = 0, limit: int = 500) -> tuple[list[RunEvent], int]:
    total = session.exec(select(func.count()).select_from(RunEvent).where(RunEvent.run_id == run_id)).one()
    rows = session.exec(select(RunEvent).where(RunEvent.run_id == run_id).order_by(col(RunEvent.id))
                        .offset(offset).limit(limit)).all()
    return list(rows), int(total)
