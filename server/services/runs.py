"""Run lifecycle: create, list, transition, stop, resume, fork, logs.

States: ``queued → starting → running ⇄ paused → completed | failed | cancelled``. Any live state may also
end in ``failed`` or ``cancelled``. A queued run held back by a concurrency limit stays ``queued`` with a
``waiting for a slot: ...`` reason and a ``waiting`` event (``hold``; ``server/services/capacity.py``). Every transition writes a ``run_events`` row with its time and reason.
``completed`` is final. ``failed`` and ``cancelled`` go back to ``queued`` only through ``resume`` (the
``RESUMABLE`` edge, never through a status report), keeping the run id, run directory and metrics.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Literal, get_args

from sqlalchemy import ColumnElement, delete, exists, func, type_coerce
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Session, col, select

from server.alerts import rules as alert_rules
from server.core.config import settings
from server.core.db import hold_write_lock, serialize
from server.jobs.celery_app import BrokerUnavailable, TaskName, enqueue
from server.models import (
    TERMINAL,
    ConfigRevision,
    ForkRequest,
    Metric,
    Run,
    RunEvent,
    RunPublic,
    RunStatus,
    RunUpdate,
    stored_id,
    utcnow,
)
from server.services import capacity, launch_checks, permissions, spec_policy
from server.services.tokens import Principal
from worker.dotted_keys import DottedKeyError, flatten, replay, with_keys
from worker.live_config import replay_in_effect
from worker.policy.export import WEIGHTS_FILE, is_source_file
from worker.policy.lora_adapters import ADAPTER_DIR, ADAPTER_FILES
from worker.run.checkpoint import PARTS as CHECKPOINT_PARTS
from worker.run.run_files import (
    RunFileError,
    RunFileMissing,
    copy_run_folder,
    is_run_file,
    list_run_folder,
    open_run_file,
)
from worker.run.rundir import COMPLETE_MARKER, RunDir, atomic_write_json
from worker.spec import EvalSpec, LoraConfig, RLSpec, SFTSpec, SpecError, validate_spec

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
MAX_ID = 2**31 - 1
"""Largest run id (a Postgres ``integer`` key)."""
RESUMABLE = frozenset({S.failed, S.cancelled})
"""States that ``resume`` (and only it) moves back to ``queued``."""
LogProcess = Literal["trainer", "orchestrator", "inference", "eval", "supervisor"]
LOG_PROCESSES: tuple[LogProcess, ...] = get_args(LogProcess)
LOG_PROCESS_RULE = (
    "'trainer', 'orchestrator', 'inference', 'inference-<i>' (replica i, 1-63, of several), 'eval' or 'supervisor'"
)
_REPLICA_LOG = re.compile(r"inference-[1-9][0-9]?")


def is_log_process(name: str) -> bool:
    """Whether ``name`` is a process with a log of its own (:data:`LOG_PROCESS_RULE`): a replica ``i > 0`` of a run
    with ``inference.replicas`` writes ``logs/inference-<i>.log`` (``worker.launchers.local.replica_name``)."""
    return name in LOG_PROCESSES or _REPLICA_LOG.fullmatch(name) is not None


def log_processes(run: Run) -> list[str]:
    """The processes of ``run`` with a log: :data:`LOG_PROCESSES`, and ``inference-1`` ... for the replicas its
    launcher starts (``inference.replicas``)."""
    if run.kind == "eval":  # an eval job: its eval process and the vLLM server it started
        return ["eval", "inference", "supervisor"]
    if run.kind == "sft":
        return ["trainer", "supervisor"]
    replicas = (run.spec.get("inference") or {}).get("replicas", 1)
    extra = [f"inference-{i}" for i in range(1, replicas)] if isinstance(replicas, int) else []
    return ["trainer", "orchestrator", "inference", *extra, "supervisor"]


def failed_process(run: Run) -> LogProcess | None:
    """The process a failed run's status reason names first, whose log says why (``trainer exited with code 1: ...``,
    ``inference exited``, ``supervisor 123 is gone``: ``worker.launchers.local``, :func:`server.jobs.tasks.reconcile`);
    None for a run that has not failed or a reason that names none of ``LOG_PROCESSES``."""
    if RunStatus(run.status) != S.failed or not run.status_reason:
        return None
    first = run.status_reason.split(maxsplit=1)[0]
    return next((p for p in LOG_PROCESSES if p == first), None)


MAX_LOG_LINES = 5000


class RunNotFound(LookupError):
    pass


class InvalidTransition(ValueError):
    pass


class QueueFull(SpecError):
    """The owner has ``MAX_QUEUED_RUNS_PER_USER`` queued runs: a run submitted now is refused; later it may not be."""


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def create(session: Session, *, data: dict[str, Any], owner: str, admin: bool = False) -> Run:
    """Validate a raw spec mapping and add a ``queued`` run for ``owner`` (``admin``: an admin's, who may use what
    ``spec_policy.check`` keeps from members). The run directory is
    ``<ASYNCRL_OUTPUT_DIR>/runs/<id>/<name>``: ``output_dir`` of the stored spec is set to match. An eval job of a
    run's weights gets a copy of them (:func:`attach_eval_source`).

    Raises:
        SpecError: ``owner`` has ``MAX_QUEUED_RUNS_PER_USER`` queued runs; the spec is invalid (one line naming the field),
            an eval job's ``model.run`` / ``model.step`` names no run's weights (:func:`resolve_eval_source`), names code or an address the service does
            not allow (``spec_policy.check``: ``CodeNotAllowed``, ``AddressNotAllowed``), or no worker can hold it (the
            key, the value and the worker's declared capacity: ``server.services.capacity.check_fits``), or the launch
            would refuse it (``server.services.launch_checks``: SFT data rows, LoRA targets, dead ``inference.urls``).
        permissions.Forbidden: a path of the spec is inside another user's run folder (:func:`check_run_files_used`).
    """
    kind = data.get("kind", "rl")
    spec = validate_spec(kind if isinstance(kind, str) else repr(kind), data)
    source = None
    if isinstance(spec, EvalSpec):  # model.run: the run's weights (checked, its base model named)
        spec, source = resolve_eval_source(session, spec, owner=owner, admin=admin)
    check_allowed(session, spec, owner=owner, admin=admin)
    capacity.check_fits(session, spec)
    launch_checks.check(spec)  # what the launch would refuse: data rows, LoRA targets, inference.urls (<= 2 s)
    serialize(session, f"asyncrl:submit:{owner}")  # count, then add
    waiting = select(func.count()).select_from(Run).where(Run.owner == owner, Run.status == S.queued)
    if (n := int(session.exec(waiting).one())) >= settings.MAX_QUEUED_RUNS_PER_USER:
        raise QueueFull(
            f"queued: {owner} has {n} runs waiting to start, the most one user may queue "
            f"({settings.MAX_QUEUED_RUNS_PER_USER}); stop or delete some first"
        )
    run = Run(name=spec.name, kind=spec.kind, spec={}, spec_hash="", owner=owner, run_dir="")
    session.add(run)
    session.flush()  # assigns the id
    out = Path(settings.ASYNCRL_OUTPUT_DIR) / "runs" / str(run.id)
    set_aside(out, f"{run.id}-found-at-create")  # left by a run of another database: never inherited
    resolved = json.loads(spec.model_copy(update={"output_dir": str(out)}).model_dump_json())
    run.spec, run.spec_hash, run.run_dir = resolved, spec_hash(resolved), str(out / spec.name)
    session.add(RunEvent(run_id=stored_id(run), kind="status", to_status=S.queued, reason=f"submitted by {owner}"))
    alert_rules.add_spec_rules(session, run)
    session.flush()
    if source is not None:
        attach_eval_source(session, run, source)  # its weights into the job's folder, an event on the source run
    return run


def check_allowed(session: Session, spec: RLSpec | SFTSpec | EvalSpec, *, owner: str, admin: bool) -> None:
    """Everything a spec of ``owner`` (``admin``: an admin's) may name: code, addresses, flags and paths
    (``spec_policy.check``) and no path inside another user's run folder (:func:`check_run_files_used`, checked
    first: the policy's "no such model folder" would tell what another user's run folder holds). The one check
    of both moments: at submit (:func:`create`; a sweep's trials and a pipeline's stages when they are created) and
    again at launch (``server.jobs.tasks.launch``), where a symlink the owner swapped while the run waited, a rule, a
    setting or the owner's role may have changed.

    Raises:
        SpecError: ``spec_policy.check``'s refusals (``CodeNotAllowed``, ``AddressNotAllowed``, ...), naming the key.
        permissions.Forbidden: a path inside another user's run folder; a Slurm allocation of a member.
    """
    check_run_files_used(session, spec, owner=owner, admin=admin)  # first: whether another's folder holds the path
    spec_policy.check(spec, admin=admin)


def check_run_files_used(session: Session, spec: RLSpec | SFTSpec | EvalSpec, *, owner: str, admin: bool) -> None:
    """Refuse a spec of ``owner`` whose ``model.name`` (or an SFT run's ``data.path`` / ``data.eval_path``) is a path
    inside another user's run folder ``<ASYNCRL_OUTPUT_DIR>/runs/<id>/``: a run's weights, checkpoints and rollouts
    are its owner's, as they are for an eval job's ``model.run`` and for exports. The path is judged with its
    symlinks resolved; an admin may use any run's files.

    Raises:
        permissions.Forbidden: the path is in a run folder of another owner, or in a folder there that is no run's.
    """
    if admin:
        return
    runs_root = os.path.realpath(Path(settings.ASYNCRL_OUTPUT_DIR) / "runs")
    paths = [("model.name", spec.model.name)]
    if isinstance(spec, SFTSpec):
        paths += [("data.path", spec.data.path), ("data.eval_path", spec.data.eval_path)]
    for key, value in paths:
        if not value:
            continue
        rel = os.path.relpath(os.path.realpath(os.path.join(os.getcwd(), value)), runs_root)
        if rel == os.curdir or rel.startswith(os.pardir):
            continue  # not inside a run folder
        folder = rel.split(os.sep)[0]
        if not (folder.isdigit() and may_use_run_files(session, int(folder), owner=owner, admin=admin)):
            raise permissions.Forbidden(
                f"{key}: {value!r} is inside the folder of run {folder}, which is not yours: only a run's owner or "
                "an admin may use its files (an eval job of its weights: model.run)"
            )


def may_use_run_files(session: Session, run_id: int, *, owner: str, admin: bool) -> bool:
    """Whether runs of ``owner`` may read run ``run_id``'s files: its owner's, or an admin's (any run's)."""
    if admin:
        return True
    run = session.get(Run, run_id) if 1 <= run_id <= MAX_ID else None
    return run is not None and run.owner == owner


def get(session: Session, run_id: int, *, lock: bool = False) -> Run:
    """The run, optionally locked (``SELECT … FOR UPDATE``; SQLite: the database's write lock,
    ``server.core.db.hold_write_lock``) until the transaction ends, so that no other writer changes it meanwhile (a
    launch that records ``starting`` after its supervisor already reported ``failed`` would undo the report).

    Raises:
        RunNotFound: no run with this id (ids outside the 32-bit key range included).
    """
    if not 1 <= run_id <= MAX_ID:
        raise RunNotFound(f"run {run_id} not found")
    stmt = select(Run).where(Run.id == run_id)
    if lock:
        stmt = stmt.with_for_update()
        hold_write_lock(session)
    run = session.exec(stmt).first()
    if run is None:
        raise RunNotFound(f"run {run_id} not found")
    return run


def has_tag(session: Session, tag: str) -> ColumnElement[bool]:
    """A WHERE clause: the run's ``tags`` list holds ``tag`` (exactly). Postgres: JSONB containment ``@>``;
    SQLite: a ``json_each`` lookup."""
    if session.get_bind().dialect.name == "postgresql":
        return type_coerce(col(Run.tags), JSONB).contains([tag])
    each = func.json_each(col(Run.tags)).table_valued("value")
    return exists(select(1).select_from(each).where(each.c.value == tag))


def list_runs(
    session: Session,
    *,
    status: RunStatus | None = None,
    name: str | None = None,
    tags: Sequence[str] = (),
    group: str | None = None,
    offset: int = 0,
    limit: int = 50,
) -> tuple[list[Run], int]:
    """Runs newest first, filtered by status, a substring of the name, tags (a run must carry every one) and
    group (exact); returns (page, total)."""
    where = []
    if status is not None:
        where.append(col(Run.status) == status.value)
    if name:
        where.append(col(Run.name).contains(name, autoescape=True))
    where.extend(has_tag(session, tag) for tag in tags)
    if group:
        where.append(col(Run.group) == group)
    total = session.exec(select(func.count()).select_from(Run).where(*where)).one()
    rows = session.exec(select(Run).where(*where).order_by(col(Run.id).desc()).offset(offset).limit(limit)).all()
    return list(rows), int(total)


STEP_SOURCES = ("trainer", "sft")
"""The metric sources whose newest step is a run's ``step``: the RL trainer's, the SFT trainer's."""


def latest_steps(session: Session, run_ids: Sequence[int]) -> dict[int, int]:
    """Run id -> the newest step its trainer reported (an RL run's ``trainer`` metrics, an SFT run's ``sft``
    metrics) for each of ``run_ids`` that has one (an eval job has none): one grouped query over the metrics'
    primary key ``(run, source, step, name)``."""
    if not run_ids:
        return {}
    stmt = (
        select(Metric.run_id, func.max(Metric.step))
        .where(col(Metric.run_id).in_(run_ids), col(Metric.source).in_(STEP_SOURCES))
        .group_by(col(Metric.run_id))
    )
    return {int(run_id): int(step) for run_id, step in session.exec(stmt).all() if step is not None}


def public(session: Session, runs: Sequence[Run]) -> list[RunPublic]:
    """``runs`` as the API shows them: the stored fields plus ``step`` (:func:`latest_steps`)."""
    steps = latest_steps(session, [stored_id(r) for r in runs])
    return [RunPublic.model_validate(r).model_copy(update={"step": steps.get(stored_id(r))}) for r in runs]


def transition(
    session: Session, run: Run, to: RunStatus, *, reason: str = "", _resume: bool = False, **data: Any
) -> bool:
    """Move ``run`` to ``to`` and record the event; a repeat of the current state is a no-op (returns False).
    ``_resume`` (used by ``resume`` only) also allows ``failed | cancelled → queued``. A run ``cancelled`` while a
    stop was asked (:func:`pending_stop`) takes that request's reason (``stopped by alice via CLI``), whoever reports
    the end (the supervisor's ``interrupted``, the stop task's ``stopped``: kept as ``reported`` in the event).

    Raises:
        InvalidTransition: ``to`` is not reachable from the current state.
    """
    current = RunStatus(run.status)
    if to == current:
        return False
    resuming = _resume and current in RESUMABLE and to == S.queued
    if to not in TRANSITIONS[current] and not resuming:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "none (terminal)"
        raise InvalidTransition(f"run {run.id} is {current.value}: cannot go to {to.value} (allowed: {allowed})")
    if to == S.cancelled and (stop := pending_stop(session, run)) is not None and stop.reason != reason:
        if reason:  # what the worker saw ("interrupted": the SIGINT of the stop) is kept in the event
            data["reported"] = reason
        reason = stop.reason  # "stopped by alice via CLI": who asked, not how the processes ended
    now = utcnow()
    run.status, run.status_reason, run.updated_at = to, reason, now
    if to == S.running and run.started_at is None:
        run.started_at = now
    if to in TERMINAL:
        run.finished_at = now
    if resuming:
        run.finished_at, run.launcher, run.launcher_handle = None, None, None
    session.add(run)
    event = RunEvent(run_id=stored_id(run), kind="status", from_status=current, to_status=to, reason=reason, data=data)
    session.add(event)
    session.flush()
    alert_rules.on_status(session, run, current, to)
    return True


def record_event(session: Session, run: Run, kind: str, *, reason: str = "", **data: Any) -> RunEvent:
    """Add a run event (flushed: its id is set) and return it."""
    event = RunEvent(run_id=stored_id(run), kind=kind, reason=reason, data=data)
    session.add(event)
    session.flush()
    if kind == "requeued":  # the run's Slurm job was requeued
        alert_rules.on_status(session, run, None, "requeued", reason)
    return event


def record_engine_events(session: Session, run: Run, events: list[dict[str, Any]]) -> int:
    """Record events of the run's processes (``{"event", "time", "reason", "process", "data"}``, kinds of
    ``worker.run.rundir.ENGINE_EVENTS``) as run events of their kind, at the time they were written, each once: one
    whose kind and time the run already has is skipped (a supervisor that resends after a restart adds nothing). A new
    one fires its built-in alert rule, if it has one (``policy_check_failed``: ``server.alerts.rules.on_engine_event``),
    and a new ``stalled`` event (the hang watchdog's, ``worker/tracking/progress.py``) fires the ``status`` alert rules
    that watch ``stalled``. Returns how many were new. Flushes only."""
    kinds = sorted({e["event"] for e in events})
    rows = session.exec(select(RunEvent).where(RunEvent.run_id == run.id, col(RunEvent.kind).in_(kinds))).all()
    seen = {(r.kind, r.data.get("time")) for r in rows}
    new = 0
    for e in events:
        if (e["event"], e["time"]) in seen:
            continue
        seen.add((e["event"], e["time"]))
        data = {**e["data"], "time": e["time"], "process": e["process"]}
        when = datetime.fromtimestamp(e["time"], UTC)
        session.add(RunEvent(run_id=stored_id(run), time=when, kind=e["event"], reason=e["reason"], data=data))
        alert_rules.on_engine_event(session, run, e["event"], e["reason"], data)  # built-in rules (C14's check)
        new += 1
        if e["event"] == "stalled":
            session.flush()
            alert_rules.on_status(session, run, None, "stalled", e["reason"])
    session.flush()
    return new


def act_on_stalls(session: Session, run: Run, events: list[dict[str, Any]]) -> bool:
    """Do what the run's stored ``watchdog.on_stall`` (``run.spec``, never the event's own data: a run-token holder
    may post a ``stalled`` event, not choose what it does) asks for the ``stalled`` events among ``events`` (just
    recorded by :func:`record_engine_events`): ``stop`` and ``restart`` request the normal stop (:func:`request_stop`,
    by ``watchdog``; ``restart`` marks the request, so that the stop task resumes the run from its newest complete
    checkpoint once it is cancelled: :func:`watchdog_restart`). Returns whether the caller must enqueue ``stop_run``
    after its commit (once per live run: a stop already requested is not asked again)."""
    on_stall = run.spec.get("watchdog", {}).get("on_stall", "event")  # a spec stored before the watchdog: "event"
    if on_stall not in ("stop", "restart"):
        return False
    since = run.updated_at  # the last transition: a stall written before it is of an earlier attempt
    stalls = [e for e in events if e["event"] == "stalled" and e["time"] >= since.timestamp()]
    if not stalls or RunStatus(run.status) in TERMINAL or RunStatus(run.status) == S.queued:
        return False
    asked = session.exec(
        select(RunEvent).where(
            RunEvent.run_id == run.id, RunEvent.kind == "stop_requested", col(RunEvent.time) >= since
        )
    ).first()
    if asked is not None:
        return False
    return request_stop(session, run, by="watchdog", restart=on_stall == "restart", why=stalls[-1]["reason"])


def restart_requested(session: Session, run: Run) -> bool:
    """Whether the newest ``stop_requested`` event of ``run`` is the watchdog's asking for a restart
    (``watchdog.on_stall = "restart"``, :func:`act_on_stalls`)."""
    event = session.exec(
        select(RunEvent)
        .where(RunEvent.run_id == run.id, RunEvent.kind == "stop_requested")
        .order_by(col(RunEvent.id).desc())
    ).first()
    return event is not None and bool(event.data.get("restart"))


MAX_WATCHDOG_RESTARTS = 3
"""Restarts the hang watchdog (``watchdog.on_stall = "restart"``) makes of one run at most; at the next stall the run
stays cancelled (a ``restart_failed`` event says why)."""


def watchdog_restart(session: Session, run: Run) -> int | None:
    """Resume the just cancelled ``run`` from its newest complete checkpoint (:func:`resume`, by ``watchdog``) when
    its stop was the watchdog's asking for a restart (:func:`restart_requested`); returns that step, or None: not
    asked, or refused, with a ``restart_failed`` event naming why. Refused when

    - the watchdog already restarted the run ``MAX_WATCHDOG_RESTARTS`` times;
    - the newest complete checkpoint is not past the step the last watchdog restart resumed from (the run stalled
      again before it saved one: a restart would resume the same state and stall again, forever);
    - :func:`resume` refuses (no complete checkpoint, its supervisor still runs).

    Flushes only; the caller commits and enqueues the launch."""
    if RunStatus(run.status) != S.cancelled or not restart_requested(session, run):
        return None
    resumed = session.exec(
        select(RunEvent).where(RunEvent.run_id == run.id, RunEvent.kind == "resumed").order_by(col(RunEvent.id))
    ).all()
    restarts = [e for e in resumed if e.data.get("by") == "watchdog"]
    steps = checkpoint_steps(run)
    if len(restarts) >= MAX_WATCHDOG_RESTARTS:
        why = f"run {run.id} was restarted by the watchdog {len(restarts)} times, the most it does per run"
    elif restarts and steps and steps[-1] <= int(restarts[-1].data.get("step", -1)):
        why = (
            f"run {run.id}: its newest checkpoint is step {steps[-1]}, as at the last watchdog restart (from step "
            f"{restarts[-1].data['step']}); restarting from it again would stall again"
        )
    else:
        try:
            return resume(session, run, by="watchdog")
        except InvalidTransition as err:
            why = str(err)
    record_event(session, run, "restart_failed", reason=f"watchdog restart: {why}")
    return None


def hold(session: Session, run: Run, reason: str) -> bool:
    """Keep a queued run waiting (a concurrency limit, ``server.services.capacity.wait_reason``): the reason becomes
    its ``status_reason`` and, when it is new, a ``waiting`` event. Returns whether the reason changed."""
    if run.status_reason == reason:
        return False
    run.status_reason, run.updated_at = reason, utcnow()
    session.add(run)
    record_event(session, run, "waiting", reason=reason)
    return True


def pending_stop(session: Session, run: Run) -> RunEvent | None:
    """The ``stop_requested`` event of ``run``'s current launch (recorded after its newest move to ``queued``: a
    launch or a resume), the newest one; None when no stop was asked since."""
    launched = session.exec(
        select(col(RunEvent.id))
        .where(RunEvent.run_id == stored_id(run), RunEvent.kind == "status", RunEvent.to_status == S.queued)
        .order_by(col(RunEvent.id).desc())
        .limit(1)
    ).first()
    query = select(RunEvent).where(RunEvent.run_id == stored_id(run), RunEvent.kind == "stop_requested")
    if launched is not None:
        query = query.where(col(RunEvent.id) > launched)
    return session.exec(query.order_by(col(RunEvent.id).desc()).limit(1)).first()


def request_stop(session: Session, run: Run, *, by: str, restart: bool = False, why: str = "") -> bool:
    """Stop a run: a queued one is cancelled at once (returns False); a launched one gets a
    ``stop_requested`` event and the caller enqueues ``stop_run`` after the commit (returns True). ``restart`` (the
    watchdog's ``on_stall = "restart"``) is recorded in the event: the stop task then resumes the run; ``why`` is
    added to the reason.

    Raises:
        InvalidTransition: the run has already ended.
    """
    current = RunStatus(run.status)
    if current in TERMINAL:
        raise InvalidTransition(f"run {run.id} is {current.value}: only queued, starting, running or paused runs stop")
    if current == S.queued and not run.launcher_handle:
        transition(session, run, S.cancelled, reason=f"stopped by {by} before launch")
        return False
    reason = f"{'restarted' if restart else 'stopped'} by {by}" + (f": {why}" if why else "")
    record_event(session, run, "stop_requested", reason=reason[:2000], **({"restart": True} if restart else {}))
    return True


DELETED_RUNS = "deleted-runs"
"""Folder of ``ASYNCRL_OUTPUT_DIR`` where a deleted run's home folder is moved (``<id>-<token_nonce>``)."""


def set_aside(home: Path, name: str) -> Path | None:
    """Move the run home folder ``home`` (if it exists) to ``<ASYNCRL_OUTPUT_DIR>/deleted-runs/<name>`` (a numbered
    suffix when taken), so no later run finds its files; returns where it went (None: there was none)."""
    if not home.exists() and not home.is_symlink():
        return None
    aside = Path(settings.ASYNCRL_OUTPUT_DIR) / DELETED_RUNS
    aside.mkdir(parents=True, exist_ok=True)
    dst, n = aside / name, 1
    while dst.exists() or dst.is_symlink():
        dst, n = aside / f"{name}.{n}", n + 1
    home.rename(dst)
    return dst


def delete_run(session: Session, run: Run) -> None:
    """Delete an ended run's row with its events, metrics, config revisions and alert rules, states and events (the
    database cascades); its home folder (run directory, logs, checkpoints) is moved to
    ``<ASYNCRL_OUTPUT_DIR>/deleted-runs/<id>-<token_nonce>`` (the user's to remove), so nothing of it is found by a
    later run. The caller commits.

    Raises:
        InvalidTransition: the run has not ended.
    """
    current = RunStatus(run.status)
    if current not in TERMINAL:
        raise InvalidTransition(
            f"run {run.id} is {current.value}: only completed, failed or cancelled runs are deleted; stop it first"
        )
    session.delete(run)
    session.flush()
    set_aside(run_home(run), f"{run.id}-{run.token_nonce}")


STOP_SURFACES = ("API", "CLI", "dashboard")
"""Where a user's stop comes from, named in its reason: ``stopped by alice via CLI``."""


def stop_by(session: Session, run_id: int, user: Principal, *, via: str = "API") -> Run:
    """``user`` stops run ``run_id`` (its owner or an admin; :func:`request_stop`) from the surface ``via`` (one of
    :data:`STOP_SURFACES`), committed; the worker is asked to stop a launched run after the commit. The one path of
    the API's, the CLI's and the dashboard's stop; the run's ``stop_requested`` event and its ``cancelled`` status
    say ``stopped by <user> via <surface>``.

    Raises:
        NotFound, Forbidden (``permissions.require_run``), InvalidTransition: the run has ended.
    """
    run = get(session, run_id, lock=True)
    permissions.require_run(user, run, "stop")
    needs_worker = request_stop(session, run, by=f"{user.name} via {via}")
    session.commit()
    if needs_worker:
        enqueue(TaskName.stop_run, run_id)
    return run


def enqueue_launch(session: Session, run_id: int) -> None:
    """Queue the launch of the committed queued run ``run_id``. When the broker does not take it, the run is marked
    ``failed`` with the broker's reason (committed; nothing would ever launch it) and the error is raised again,
    naming the run, for the surface to answer 503.

    Raises:
        BrokerUnavailable: ``<the broker> did not take the task asyncrl.launch_run: <cause>; run <id> failed``.
    """
    try:
        enqueue(TaskName.launch_run, run_id)
    except BrokerUnavailable as err:
        session.rollback()
        run = get(session, run_id, lock=True)
        if run.status == S.queued and not run.launcher_handle:
            transition(session, run, S.failed, reason=f"not launched: {err}"[:2000])
            session.commit()
        raise BrokerUnavailable(f"{err}; run {run_id} failed (not launched)") from err


def resume_by(session: Session, run_id: int, user: Principal) -> Run:
    """``user`` resumes run ``run_id`` (:func:`resume`), committed, then queues its launch (after the commit: the
    worker must find the queued run). The one path of the API's and the dashboard's resume.

    Raises:
        NotFound, Forbidden, InvalidTransition: not failed/cancelled or no complete checkpoint.
    """
    run = get(session, run_id, lock=True)
    permissions.require_run(user, run, "resume")
    resume(session, run, by=user.name)
    session.commit()
    enqueue_launch(session, run_id)
    return run


def delete_by(session: Session, run_id: int, user: Principal) -> None:
    """``user`` deletes the ended run ``run_id`` (:func:`delete_run`), committed. The one path of the API's and the
    dashboard's delete.

    Raises:
        NotFound, Forbidden, InvalidTransition: the run has not ended.
    """
    run = get(session, run_id, lock=True)
    permissions.require_run(user, run, "delete")
    delete_run(session, run)
    session.commit()


def update_by(session: Session, run_id: int, user: Principal, change: RunUpdate) -> Run:
    """``user`` (the run's owner or an admin) sets the tags, notes and/or group of run ``run_id`` (any state; the
    fields ``change`` leaves unset stay), committed. The one path of ``PATCH /api/runs/{id}`` and the dashboard.

    Raises:
        NotFound, Forbidden (``permissions.require_run``).
    """
    run = get(session, run_id, lock=True)
    permissions.require_run(user, run, "annotate")
    given = change.model_fields_set
    if "tags" in given:
        run.tags = list(change.tags or [])  # a new list: the JSON column sees the change
    if "notes" in given:
        run.notes = change.notes or ""
    if "group" in given:
        run.group = change.group
    run.updated_at = utcnow()
    session.add(run)
    session.commit()
    session.refresh(run)
    return run


def events(session: Session, run_id: int, *, offset: int = 0, limit: int = 500) -> tuple[list[RunEvent], int]:
    total = session.exec(select(func.count()).select_from(RunEvent).where(RunEvent.run_id == run_id)).one()
    rows = session.exec(
        select(RunEvent).where(RunEvent.run_id == run_id).order_by(col(RunEvent.id)).offset(offset).limit(limit)
    ).all()
    return list(rows), int(total)


# ----------------------------------------------------------------------------- resume, fork, logs


def run_home(run: Run) -> Path:
    """The run's home folder (``<ASYNCRL_OUTPUT_DIR>/runs/<id>``): every file of a run the service reads is read
    below it through ``worker.run.run_files`` (no symbolic links, regular files only)."""
    return Path(run.run_dir).parent


def run_file(run: Run, *parts: str) -> str:
    """The path of ``<run_dir>/<parts...>`` relative to the run's home (what ``worker.run.run_files`` takes and what
    error messages show)."""
    return "/".join((Path(run.run_dir).name, *parts))


_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_steps(run: Run) -> list[int]:
    """Steps with a complete checkpoint in the run's directory, ascending (read-only: nothing is removed). A
    checkpoint reached through a symbolic link, or whose markers are links, does not count.

    Raises:
        InvalidTransition: ``checkpoints`` (or the run directory) is a symbolic link or not a folder.
    """
    home, folder = run_home(run), run_file(run, "checkpoints")
    steps = []
    try:
        found = list_run_folder(home, folder)
    except RunFileError as err:
        raise InvalidTransition(f"run {run.id}: its checkpoints are refused: {err}") from None
    for name, is_folder in found.items():
        if is_folder and (m := _STEP_DIR.match(name)):
            if all(is_run_file(home, f"{folder}/{name}/{part}/{COMPLETE_MARKER}") for part in CHECKPOINT_PARTS):
                steps.append(int(m.group(1)))
    return sorted(steps)


SUPERVISOR_EXIT_WAIT_S = 10.0
"""How long a resume waits for the supervisor of a failed/cancelled run to exit: it reports its final status first,
then stops its reporter and exits (a second or two with the run's modules loaded)."""


def resume(session: Session, run: Run, *, by: str) -> int:
    """Put a failed or cancelled run back to ``queued`` to continue from its newest complete checkpoint; returns
    that step. Metrics of later steps are deleted (the resumed run measures them again, as ``--resume`` prunes
    ``metrics.jsonl``), and so are acknowledgements of live config revisions at later steps
    (:func:`forget_acks_after`). The resumed processes replay every revision of the run's ``live_config.jsonl`` at
    their first step (``worker.live_config.LiveConfig``: one sent in the run's last seconds and never applied too),
    so the run continues with its newest live values, not its spec's: the ``resumed`` event names them
    (``live_config``, ``{"dotted.key": value}`` of the keys that differ from the spec). The caller commits and then enqueues the launch, which resumes since a checkpoint exists.
    An eval job (no checkpoints) resumes at step 0 and goes on after the tasks it recorded (``worker.evaluation``).

    Raises:
        InvalidTransition: the run is not failed/cancelled, its supervisor still runs, or it has no complete
            checkpoint (the message names the checkpoints folder).
    """
    from worker.launchers.supervisor import running_pid

    current = RunStatus(run.status)
    if current not in RESUMABLE:
        raise InvalidTransition(f"run {run.id} is {current.value}: only failed or cancelled runs resume")
    home = Path(run.run_dir).parent
    deadline = time.monotonic() + SUPERVISOR_EXIT_WAIT_S  # it reported its final status and is exiting
    while (pid := running_pid(home)) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid is not None:
        raise InvalidTransition(f"run {run.id}: its supervisor (pid {pid}) is still running; wait for it to end")
    if run.kind == "eval":  # no checkpoints: it continues after the tasks it recorded (worker.evaluation.run_job)
        session.execute(delete(Metric).where(col(Metric.run_id) == run.id))  # measured again at its end
        reason = f"resumed by {by}: continues after the eval tasks it recorded"
        transition(session, run, S.queued, reason=reason, _resume=True, step=0)
        record_event(session, run, "resumed", reason=reason, step=0, by=by)
        return 0
    steps = checkpoint_steps(run)
    if not steps:
        raise InvalidTransition(f"run {run.id}: no complete checkpoint in {run_file(run, 'checkpoints')}")
    step = steps[-1]
    session.execute(delete(Metric).where(col(Metric.run_id) == run.id, col(Metric.step) > step))
    forget_acks_after(session, run, step)
    reason = f"resumed by {by} from checkpoint step {step}"
    transition(session, run, S.queued, reason=reason, _resume=True, step=step)
    revisions = config_revisions(session, run)
    live = _live_changes(run.spec, replay(run.spec, (r.changes for r in revisions)))
    record_event(session, run, "resumed", reason=reason, step=step, by=by, **({"live_config": live} if live else {}))
    return step


def config_revisions(session: Session, run: Run) -> list[ConfigRevision]:
    """Every live config revision of ``run``, oldest first (``server.services.config`` creates them)."""
    stmt = select(ConfigRevision).where(ConfigRevision.run_id == run.id).order_by(col(ConfigRevision.revision))
    return list(session.exec(stmt).all())


def forget_acks_after(session: Session, run: Run, step: int) -> None:
    """A run resumed from checkpoint ``step`` re-does the later steps: a live config revision a process acknowledged
    after ``step`` is no longer in effect from there (its process re-applies it at its first step and acknowledges
    that step, ``worker.live_config.LiveConfig``); until then it is pending, as metrics of those steps are gone."""
    rows = config_revisions(session, run)
    for row in rows:
        kept = {p: s for p, s in row.applied.items() if int(s) <= step}
        if kept != row.applied:
            row.applied = kept  # a new dict: SQLAlchemy sees the change
            session.add(row)


def requeued(session: Session, run: Run, *, restarts: int, resume_step: int | None, job: str) -> bool:
    """Slurm requeued the run's job and attempt ``restarts`` started, continuing from checkpoint ``resume_step``
    (None: from the start). Metrics of later steps are deleted (the attempt measures them again, so each step is
    stored once, from the attempt that counts) and a ``requeued`` event is recorded. A repeated report of the same
    attempt changes nothing (returns False).

    Raises:
        InvalidTransition: the run has ended (completed, failed or cancelled).
    """
    if RunStatus(run.status) in TERMINAL:
        raise InvalidTransition(f"run {run.id} is {run.status}: a requeued job of it does not continue it")
    seen = session.exec(select(RunEvent).where(RunEvent.run_id == run.id, RunEvent.kind == "requeued")).all()
    if any(e.data.get("restarts") == restarts for e in seen):
        return False
    after = -1 if resume_step is None else resume_step
    session.execute(delete(Metric).where(col(Metric.run_id) == run.id, col(Metric.step) > after))
    start = f"checkpoint step {resume_step}" if resume_step is not None else "the start (no complete checkpoint)"
    record_event(
        session,
        run,
        "requeued",
        reason=f"Slurm job {job} requeued (restart {restarts}); resuming from {start}",
        restarts=restarts,
        resume_step=resume_step,
        job=job,
    )
    return True


def apply_changes(spec: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``spec`` with ``{"dotted.key": value}`` changes set (missing tables are created).

    Raises:
        SpecError: a key is empty, names ``output_dir`` (the service sets it), or goes through a non-table value.
    """
    if "output_dir" in changes:
        raise SpecError("changes.output_dir: set by the service (<ASYNCRL_OUTPUT_DIR>/runs/<id>)")
    try:
        return with_keys(spec, changes)
    except DottedKeyError as err:
        raise SpecError(f"changes.{err.key}: {err}") from None


def spec_in_effect(session: Session, run: Run, step: int | None = None) -> dict[str, Any]:
    """``run``'s stored spec with its live config revisions applied as far as they were in effect at ``step`` (None:
    by the run's end; ``worker.live_config.replay_in_effect``): a key counts once the process that applies it
    acknowledged it at a step ``<= step``; a revision never acknowledged (sent in the run's last seconds, or after
    the checkpoint) is not part of it. An SFT run has no live config: its stored spec."""
    rows = config_revisions(session, run)
    if run.kind != "rl" or not rows:
        return dict(run.spec)
    return replay_in_effect(run.spec, ((r.changes, r.applied) for r in rows), step)


def _live_changes(spec: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """``{"dotted.key": value}`` of the keys whose value in ``now`` differs from ``spec`` (live revisions in effect)."""
    before, after = flatten(spec), flatten(now)
    return {k: v for k, v in after.items() if before.get(k, _MISSING) != v}


_MISSING = object()


def check_fork_keeps(parent: dict[str, Any], child: RLSpec) -> None:
    """A fork keeps its parent's ``trainer.lora``: the parent's checkpoint holds full weights or an adapter of that
    rank and those target modules (``worker/trainer/checkpointer.py``), which a child with another setting cannot
    load (a full fine-tune from a LoRA checkpoint, LoRA from a full one, another rank or other targets); alpha and
    dropout would change the policy the checkpoint's adapter encodes.

    A fork also keeps ``model.name``: it trains from the parent's checkpoint, whose weights (or adapter: a delta on
    its base) were trained from that model; another name would only mislabel the fork (the same architecture and
    tokenizer) or not load.

    Raises:
        SpecError: ``trainer.lora`` differs, one line naming it and both settings; ``model.name`` differs.
    """
    before = (parent.get("trainer") or {}).get("lora")
    base = (parent.get("model") or {}).get("name")
    if child.model.name != base:
        held = "adapter" if before is not None else "weights"
        raise SpecError(
            f"model.name: a fork keeps its parent's model ({base}): it starts from the checkpoint's {held}, trained "
            f"from it, not from {child.model.name}; start a new run for another model"
        )
    mine = LoraConfig.model_validate(before).model_dump() if before is not None else None
    theirs = child.trainer.lora.model_dump() if child.trainer.lora is not None else None
    if mine != theirs:
        held = "full weights (no trainer.lora)" if mine is None else f"a LoRA adapter ({_lora_text(mine)})"
        wanted = "a full fine-tune" if theirs is None else _lora_text(theirs)
        raise SpecError(
            f"trainer.lora: a fork keeps its parent's setting: the checkpoint holds {held}, the changes ask for "
            f"{wanted}; start a new run instead"
        )


def copy_probe(parent: Run, step: int, dst: RunDir) -> None:
    """Give a fork its parent's served-policy check probe (``worker/orchestrator/policy_check.py``): the probe tokens,
    the base log-probs and those of the fork step's version, so the fork checks its first load and every later version
    against the same base. Nothing when the parent has none (check off, LoRA, or no step trained yet).

    Raises:
        RunFileError: the parent's ``policy_check`` folder or a file in it is a link or a special file.
    """
    wanted = {PurePosixPath(name) for name in ("probe.json", "step_0.json", f"step_{step}.json")}
    try:
        copy_run_folder(run_home(parent), run_file(parent, "policy_check"), dst.policy_check, keep=wanted.__contains__)
    except RunFileMissing:
        shutil.rmtree(dst.policy_check, ignore_errors=True)  # made before the source was found missing


def _lora_text(lora: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {v}" for k, v in lora.items())


def fork(session: Session, parent: Run, request: ForkRequest, *, owner: str, admin: bool = False) -> Run:
    """A new queued run of ``owner`` (``admin``: see :func:`create`): the parent's config as it was in effect at the
    fork step (its spec with the live revisions its processes had taken up by then, :func:`spec_in_effect`: a
    parent switched live to lr 5e-5 at step 3 forks at step 4 with 5e-5, at step 2 with the spec's value) with
    ``request.changes`` on top (named ``request.name``, default the parent's name), starting from the parent's
    checkpoint ``request.step`` (default: the newest complete one). The checkpoint is hard-linked (or copied) into
    the child's run directory with the child's ``config.json``, so the child's launch resumes from it: weights,
    optimizer, scheduler, RNG and data cursor continue at ``step + 1`` under that spec. The child gets a ``forked``
    event (parent run id, step, changes, and ``in_effect``: the live values it inherited, when any) and the parent a
    ``fork`` event (child id). The caller commits and then enqueues the child's launch.

    Raises:
        SpecError: the parent is an SFT run (fork is for RL runs), the changes set another ``kind``, the changed
            spec is invalid (names the dotted key), changes ``trainer.lora`` (:func:`check_fork_keeps`), ``step`` has
            no complete checkpoint, or ``max_steps`` leaves nothing to train after ``step``.
        InvalidTransition: the parent has no complete checkpoint at all.
    """
    if parent.kind != "rl":
        raise SpecError(
            f"kind: fork starts an 'rl' run from an 'rl' run's checkpoint; run {parent.id} is an {parent.kind!r} run"
        )
    step, steps = request.step, checkpoint_steps(parent)
    at = step if step is not None else (steps[-1] if steps else None)  # no checkpoint: refused below
    base = spec_in_effect(session, parent, at) if at is not None else dict(parent.spec)
    data = apply_changes(base, request.changes)
    data.pop("output_dir", None)
    if request.name is not None:
        data["name"] = request.name
    if data.get("kind", "rl") != "rl":
        raise SpecError(
            f"kind: a fork of an 'rl' run is an 'rl' run; leave 'kind' out of changes, got {data['kind']!r}"
        )
    child_spec = validate_spec("rl", data)
    spec_policy.check(child_spec, admin=admin)  # a bad key, value or code: named before the copy
    check_fork_keeps(parent.spec, child_spec)
    if not steps:
        raise InvalidTransition(f"run {parent.id}: no complete checkpoint in {run_file(parent, 'checkpoints')}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise SpecError(f"step: run {parent.id} has no complete checkpoint at step {step} (complete: {steps})")
    child = create(session, data=data, owner=owner, admin=admin)
    if child.spec["max_steps"] <= step:
        raise SpecError(
            f"max_steps: {child.spec['max_steps']} leaves nothing to train after the fork step {step}; "
            "raise it in changes"
        )
    dst = RunDir(child.run_dir)
    try:  # no symbolic link or special file of the parent's folder is followed or copied (worker.run.run_files)
        copy_run_folder(run_home(parent), run_file(parent, "checkpoints", f"step_{step}"), dst.checkpoint_dir(step))
        copy_probe(parent, step, dst)
        atomic_write_json(dst.config, child.spec)
    except RunFileError as err:
        shutil.rmtree(Path(child.run_dir).parent, ignore_errors=True)
        raise InvalidTransition(f"run {parent.id}: checkpoint step {step} cannot be copied: {err}") from None
    except BaseException:
        shutil.rmtree(Path(child.run_dir).parent, ignore_errors=True)
        raise
    record_event(
        session,
        child,
        "forked",
        reason=f"forked by {owner} from run {parent.id} at checkpoint step {step}",
        parent_run_id=parent.id,
        step=step,
        changes=request.changes,
        **({"in_effect": inherited} if (inherited := _live_changes(parent.spec, base)) else {}),
    )
    record_event(
        session,
        parent,
        "fork",
        reason=f"forked by {owner} into run {child.id} at step {step}",
        child_run_id=child.id,
        step=step,
    )
    return child


# ----------------------------------------------------------------------------- eval jobs of a run's weights

TRAINING_KINDS = ("rl", "sft")
"""Kinds of run whose weights an eval job (``kind = "eval"``, ``model.run``) evaluates."""
EVAL_EVENT = "evaluation"
"""Event kind recorded on the evaluated run: ``{"eval_run_id", "step"}`` (``step`` null: final weights); read by
``server.services.evals.evals_of``."""


def _has_weights(run: Run, top: str) -> bool:
    """Whether ``<run_dir>/<top>`` holds full weights (``model.safetensors``) or a LoRA adapter (regular files)."""
    home = run_home(run)
    if is_run_file(home, run_file(run, *top.split("/"), WEIGHTS_FILE)):
        return True
    return any(
        all(is_run_file(home, run_file(run, *top.split("/"), *sub, f)) for f in ADAPTER_FILES)
        for sub in ((), (ADAPTER_DIR,))
    )


def eval_source_folder(step: int | None) -> str:
    """The folder of a run directory holding the weights of checkpoint ``step`` (its trainer part) or, for
    None, the final weights: ``checkpoints/step_<N>/trainer`` or ``final``."""
    return "final" if step is None else f"checkpoints/step_{step}/trainer"


def resolve_eval_source(session: Session, spec: EvalSpec, *, owner: str, admin: bool) -> tuple[EvalSpec, Run | None]:
    """Check the source of an eval job submitted by ``owner`` (``admin``: an admin) and return the spec with
    ``model.name`` / ``model.dtype`` set from the source run's spec (and, for its final weights, ``model.final_step``:
    its ``max_steps``, the step its metrics are stored at), and that run (None for a model path).

    Raises:
        SpecError: ``model.run`` names no run or a run that is not a training run; ``model.step`` has no complete
            checkpoint (the complete steps listed); no ``model.step`` and the run has no final weights;
            ``model.name`` given and not the source run's base model.
        Forbidden: ``owner`` is neither the source run's owner nor an admin (its weights are its owner's, as an
            export of them is).
    """
    if spec.model.run is None:
        return spec, None
    rid = spec.model.run
    try:
        source = get(session, rid)
    except RunNotFound:
        raise SpecError(f"model.run: no run {rid}; give the id of a run of this service") from None
    if source.kind not in TRAINING_KINDS:
        raise SpecError(f"model.run: run {rid} is an {source.kind!r} run; evaluate an 'rl' or 'sft' run's weights")
    if not admin and source.owner != owner:
        raise permissions.Forbidden(
            f"run {rid} belongs to {source.owner}: only its owner or an admin may evaluate its weights"
        )
    step = spec.model.step
    if step is not None:
        try:
            steps = checkpoint_steps(source)
        except InvalidTransition as err:
            raise SpecError(f"model.step: {err}") from None
        if step not in steps:
            listed = ", ".join(map(str, steps)) or "none"
            raise SpecError(f"model.step: run {rid} has no complete checkpoint at step {step} (complete: {listed})")
    elif not _has_weights(source, "final"):
        raise SpecError(
            f"model.step: run {rid} has no final weights (final/ is written when it completes); name a checkpoint step"
        )
    model = source.spec.get("model") or {}
    base, dtype = str(model.get("name", "")), str(model.get("dtype", "float32"))
    if spec.model.name and spec.model.name != base:
        raise SpecError(
            f"model.name: with model.run the base model is run {rid}'s ({base}); leave model.name out, got "
            f"{spec.model.name!r}"
        )
    final = None if step is not None else int(source.spec.get("max_steps", 0)) or None  # final/: after the last step
    resolved = spec.model.model_copy(update={"name": base, "dtype": dtype, "final_step": final})
    return spec.model_copy(update={"model": resolved}), source


def attach_eval_source(session: Session, job: Run, source: Run) -> None:
    """Copy the evaluated weights of ``source`` into the new eval job's ``<run_dir>/source/`` and record the
    ``evaluation`` event on ``source``. Flushes only.

    Raises:
        SpecError: the weights cannot be copied (a link or special file in them: ``worker.run.run_files``), as
            ``model.step``; nothing of the job's folder is left.
    """
    step = job.spec["model"]["step"]
    rel = run_file(source, *eval_source_folder(step).split("/"))
    dst = RunDir(job.run_dir).eval_source
    try:
        copy_run_folder(run_home(source), rel, dst, link=False, keep=is_source_file)
    except RunFileError as err:
        shutil.rmtree(run_home(job), ignore_errors=True)
        raise SpecError(f"model.step: the weights of run {source.id} ({rel}) cannot be copied: {err}") from None
    except BaseException:
        shutil.rmtree(run_home(job), ignore_errors=True)
        raise
    what = "final weights" if step is None else f"checkpoint step {step}"
    record_event(
        session,
        source,
        EVAL_EVENT,
        reason=f"{what} evaluated by {job.owner} in run {job.id}",
        eval_run_id=job.id,
        step=step,
    )


def log_file(run: Run, process: str) -> str:
    """The log of ``process`` relative to the run's home: ``<name>/logs/<process>.log``; the supervisor's log is
    ``supervisor.log`` beside the run directory."""
    return "supervisor.log" if process == "supervisor" else run_file(run, "logs", f"{process}.log")


def read_log(run: Run, process: str, lines: int) -> list[str]:
    """The last ``lines`` lines of ``process``'s log (``log_file``), read safely (``worker.run.run_files``).

    Raises:
        RunFileMissing: no log yet. RunFileRefused: the log or a folder on its way is a link or not a file.
    """
    with open_run_file(run_home(run), log_file(run, process)) as f:
        return tail(f, lines)


def tail(f: BinaryIO, lines: int, block: int = 65536) -> list[str]:
    """The last ``lines`` lines of the open binary file ``f`` (undecodable bytes replaced), reading backwards in
    ``block``-byte chunks so a large log is not read whole."""
    pos = f.seek(0, os.SEEK_END)
    data = b""
    while pos > 0 and data.count(b"\n") <= lines:
        size = min(block, pos)
        pos -= size
        f.seek(pos)
        data = f.read(size) + data
    return data.decode(errors="replace").splitlines()[-lines:] if lines > 0 else []
