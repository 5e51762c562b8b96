"""Exports of a run's checkpoints as Hugging Face model directories, requested through the API or the dashboard.

The service never loads a model (the server imports no torch): it lists the complete checkpoints, checks a request
(who, which step, adapter-only only for LoRA checkpoints, not already exported or under way), records an
``export_requested`` event, commits, and enqueues the ``export_run`` Celery task. The worker writes
``<run home>/exports/<step_N[-adapter]>/`` (``worker/export.py``) and records ``export_started``, then
``export_done`` (with the path) or ``export_failed`` (with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlmodel import Session, col, select

from server.models import Run, RunEvent, stored_id
from server.services import permissions, runs
from server.services.runs import InvalidTransition
from server.services.tokens import Principal
from worker.celery_app import TaskName, enqueue
from worker.export import export_name
from worker.lora_adapters import ADAPTER_DIR, ADAPTER_FILES
from worker.run_files import is_run_file
from worker.spec import SpecError

EXPORTS_DIR = "exports"
"""In a run's home folder (beside the run directory): one folder per export."""
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


def _in_flight(session: Session, run: Run, name: str) -> bool:
    """Whether the newest export event of ``name`` is a request or a start (no ``export_done``/``_failed`` since)."""
    rows = session.exec(
        select(RunEvent)
        .where(RunEvent.run_id == stored_id(run), col(RunEvent.kind).in_(EXPORT_EVENTS))
        .order_by(col(RunEvent.id).desc())
    ).all()
    for row in rows:
        if (row.data or {}).get("name") == name:
            return row.kind in ("export_requested", "export_started")
    return False


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
        InvalidTransition: that export already exists or is under way; the checkpoints folder is refused.
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
    if _in_flight(session, run, name):
        raise InvalidTransition(f"run {run_id}: the export {EXPORTS_DIR}/{name} is under way")
    runs.record_event(
        session,
        run,
        "export_requested",
        reason=f"export of step {step}{' (adapter only)' if adapter_only else ''} requested by {user.name}",
        name=name,
        step=step,
        adapter_only=adapter_only,
    )
    session.commit()
    enqueue(TaskName.export_run, run_id, step, int(adapter_only))
    return out
