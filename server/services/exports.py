"""Exports of a run's checkpoints as Hugging Face model directories, requested through the API or the dashboard.

The service never loads a model (the server imports no torch): it lists the complete checkpoints, checks a request
(who, which step, adapter-only only for LoRA checkpoints, not already exported or under way), records an
``export_requested`` event, commits, and enqueues the ``export_run`` Celery task (on the export queue,
``server/jobs/celery_app.py``) with the request's event id. The worker writes ``<run home>/exports/<step_N[-adapter]>/``
(``worker/policy/export.py``) and records ``export_started`` (with the request id, its pid and worker name) for each
delivery, then ``export_done`` (with the path) or ``export_failed`` (with the reason).

A request that never ends (its task lost, its worker killed) would block that export forever; it is ended with
``export_failed`` (:func:`fail_stale`) by the periodic reconcile (``server.jobs.tasks.reconcile_exports``: the worker
process of its newest ``export_started`` on that machine is gone) and by the next request of the same export once it is
older than ``EXPORT_REQUEST_TIMEOUT_S``. A delivery of a request that ended meanwhile does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC
from pathlib import Path

from sqlmodel import Session, col, select

from server.core.config import settings
from server.jobs.celery_app import TaskName, enqueue
from server.models import Run, RunEvent, stored_id, utcnow
from server.services import permissions, runs
from server.services.runs import InvalidTransition
from server.services.tokens import Principal
from worker.policy.export import EXPORTS_DIR, export_name
from worker.policy.lora_adapters import ADAPTER_DIR, ADAPTER_FILES
from worker.run.run_files import is_run_file
from worker.spec import SpecError

EXPORT_EVENTS = ("export_requested", "export_started", "export_done", "export_failed")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    kind: str
    """``full`` (model weights) or ``lora`` (a PEFT adapter)."""
    exports: list[str]
    """Paths of the finished exports of this step (merged/full and adapter-only)."""


def export_dir(run: Run, step: int, adapter_only: bool) -> Path:
    """``<run home>/exports/step_<step>[-adapter]``."""
    return runs.run_home(run) / EXPORTS_DIR / export_name(step, adapter_only)


def checkpoint_kind(run: Run, step: int) -> str:
    """``lora`` when the checkpoint's trainer part holds the adapter files (regular files, no links), else ``full``."""
    home = runs.run_home(run)
    adapter = [runs.run_file(run, "checkpoints", f"step_{step}", "trainer", ADAPTER_DIR, f) for f in ADAPTER_FILES]
    return "lora" if all(is_run_file(home, rel) for rel in adapter) else "full"


def checkpoints(run: Run) -> list[Checkpoint]:
    """The run's complete checkpoints, ascending, with their kind and finished exports.

    Raises:
        InvalidTransition: the run's checkpoints folder is a link or not a folder (``runs.checkpoint_steps``).
    """
    out = []
    for step in runs.checkpoint_steps(run):
        done = [str(export_dir(run, step, a)) for a in (False, True) if export_dir(run, step, a).is_dir()]
        out.append(Checkpoint(step=step, kind=checkpoint_kind(run, step), exports=done))
    return out


def newest_event(session: Session, run: Run, name: str) -> RunEvent | None:
    """The newest export event of the export ``name`` (``export_name``) of ``run``, None when it has none."""
    rows = session.exec(
        select(RunEvent)
        .where(RunEvent.run_id == stored_id(run), col(RunEvent.kind).in_(EXPORT_EVENTS))
        .order_by(col(RunEvent.id).desc())
    ).all()
    return next((row for row in rows if (row.data or {}).get("name") == name), None)


def in_flight(session: Session) -> list[tuple[Run, RunEvent]]:
    """Every export under way, of every run: ``(run, its newest export event)`` where that event is an
    ``export_requested`` or ``export_started`` (no ``export_done``/``export_failed`` since)."""
    rows = session.exec(
        select(RunEvent).where(col(RunEvent.kind).in_(EXPORT_EVENTS)).order_by(col(RunEvent.id).desc())
    ).all()
    newest: dict[tuple[int, str], RunEvent] = {}
    for row in rows:
        newest.setdefault((row.run_id, str((row.data or {}).get("name"))), row)
    out = []
    for (run_id, _), event in sorted(newest.items()):
        if event.kind in ("export_requested", "export_started") and (run := session.get(Run, run_id)) is not None:
            out.append((run, event))
    return out


def request_of(event: RunEvent) -> int | None:
    """The id of the ``export_requested`` event an export event belongs to (its own id for a request)."""
    if event.kind == "export_requested":
        return event.id
    request = (event.data or {}).get("request")
    return request if isinstance(request, int) else None


def deliveries(session: Session, run: Run, request: int | None) -> int:
    """How many deliveries of the export request ``request`` (an ``export_requested`` event id) started: its
    ``export_started`` events."""
    rows = session.exec(
        select(RunEvent).where(RunEvent.run_id == stored_id(run), RunEvent.kind == "export_started")
    ).all()
    return sum((row.data or {}).get("request") == request for row in rows)


def age_s(event: RunEvent) -> float:
    """Seconds since ``event`` was recorded."""
    when = event.time if event.time.tzinfo else event.time.replace(tzinfo=UTC)
    return (utcnow() - when).total_seconds()


def fail_stale(session: Session, run: Run, event: RunEvent, why: str) -> None:
    """End the export under way whose newest event is ``event`` with ``export_failed`` (reason: ``why``), so that it
    may be requested again. Flushes only."""
    data = event.data or {}
    runs.record_event(
        session,
        run,
        "export_failed",
        reason=f"export of step {data.get('step')} failed: {why}",
        name=data.get("name"),
        step=data.get("step"),
        request=request_of(event),
    )


def timed_out(event: RunEvent) -> str | None:
    """The reason to fail an export under way whose newest event is ``event``, when that is older than
    ``EXPORT_REQUEST_TIMEOUT_S``; else None."""
    limit = settings.EXPORT_REQUEST_TIMEOUT_S
    if age_s(event) <= limit:
        return None
    what = "requested" if event.kind == "export_requested" else "started"
    return (
        f"not finished {limit:.0f} s after it was {what} (EXPORT_REQUEST_TIMEOUT_S): its task was lost or its "
        f"worker is gone (is an export worker consuming queue {settings.export_queue}?)"
    )


def request_export(session: Session, run_id: int, user: Principal, *, step: int, adapter_only: bool) -> Path:
    """``user`` asks for an export of checkpoint ``step`` of run ``run_id``: checked, ``export_requested`` recorded,
    committed, then the ``export_run`` task enqueued. The one path of the API's and the dashboard's export.

    Returns:
        The folder the export will be written to.

    Raises:
        RunNotFound: no such run.
        Forbidden: not the run's owner or an admin (``permissions.require_run``).
        SpecError: ``step`` has no complete checkpoint (the complete steps listed); ``adapter_only`` on a full
            fine-tune checkpoint.
        InvalidTransition: that export already exists or is under way (an earlier request of it that is older than
            ``EXPORT_REQUEST_TIMEOUT_S`` is failed instead); the checkpoints folder is refused.
    """
    run = runs.get(session, run_id, lock=True)
    permissions.require_run(user, run, "export")
    steps = runs.checkpoint_steps(run)
    if step not in steps:
        listed = ", ".join(map(str, steps)) or "none"
        raise SpecError(f"step: run {run_id} has no complete checkpoint at step {step} (complete steps: {listed})")
    if adapter_only and checkpoint_kind(run, step) != "lora":
        raise SpecError(
            f"adapter_only: step {step} of run {run_id} is a full fine-tune (no adapter); export it with "
            "adapter_only false"
        )
    out, name = export_dir(run, step, adapter_only), export_name(step, adapter_only)
    if out.exists():
        raise InvalidTransition(f"run {run_id}: step {step} is already exported ({EXPORTS_DIR}/{name})")
    last = newest_event(session, run, name)
    if last is not None and last.kind in ("export_requested", "export_started"):
        why = timed_out(last)
        if why is None:
            raise InvalidTransition(f"run {run_id}: the export {EXPORTS_DIR}/{name} is under way")
        fail_stale(session, run, last, why)
    request = runs.record_event(
        session,
        run,
        "export_requested",
        reason=f"export of step {step}{' (adapter only)' if adapter_only else ''} requested by {user.name}",
        name=name,
        step=step,
        adapter_only=adapter_only,
    )
    session.commit()
    enqueue(TaskName.export_run, run_id, step, int(adapter_only), stored_id(request))
    return out
