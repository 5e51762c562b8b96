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
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Literal, get_args

from sqlalchemy import delete, func
from sqlmodel import Session, col, select

from server.alerts import rules as alert_rules
from server.core.config import settings
from server.core.db import hold_write_lock, serialize
from server.models import TERMINAL, ForkRequest, Metric, Run, RunEvent, RunStatus, stored_id, utcnow
from server.services import capacity, permissions, spec_policy
from server.services.tokens import Principal
from worker.celery_app import TaskName, enqueue
from worker.checkpoint import PARTS as CHECKPOINT_PARTS
from worker.dotted_keys import DottedKeyError, with_keys
from worker.run_files import RunFileError, RunFileMissing, copy_run_folder, is_run_file, list_run_folder, open_run_file
from worker.rundir import COMPLETE_MARKER, RunDir, atomic_write_json
from worker.spec import LoraConfig, RLSpec, SpecError, validate_spec

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
LogProcess = Literal["trainer", "orchestrator", "inference", "supervisor"]
LOG_PROCESSES: tuple[LogProcess, ...] = get_args(LogProcess)
MAX_LOG_LINES = 5000


class RunNotFound(LookupError):
    pass


class InvalidTransition(ValueError):
    pass


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def create(session: Session, *, data: dict[str, Any], owner: str, admin: bool = False) -> Run:
    """Validate a raw spec mapping and add a ``queued`` run for ``owner`` (``admin``: an admin's, who may use what
    ``spec_policy.check`` keeps from members). The run directory is
    ``<ASYNCRL_OUTPUT_DIR>/runs/<id>/<name>``: ``output_dir`` of the stored spec is set to match.

    Raises:
        SpecError: ``owner`` has ``MAX_QUEUED_RUNS_PER_USER`` queued runs; the spec is invalid (one line naming the field), names code or an address the service does
            not allow (``spec_policy.check``: ``CodeNotAllowed``, ``AddressNotAllowed``), or no worker can hold it (the
            key, the value and the worker's declared capacity: ``server.services.capacity.check_fits``).
    """
    kind = data.get("kind", "rl")
    spec = validate_spec(kind if isinstance(kind, str) else repr(kind), data)
    if spec.kind != "rl":
        raise SpecError(f"kind: the service launches 'rl' runs, got {spec.kind!r}")
    spec_policy.check(spec, admin=admin)
    capacity.check_fits(session, spec)
    serialize(session, f"asyncrl:submit:{owner}")  # count, then add
    waiting = select(func.count()).select_from(Run).where(Run.owner == owner, Run.status == S.queued)
    if (n := int(session.exec(waiting).one())) >= settings.MAX_QUEUED_RUNS_PER_USER:
        raise SpecError(
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
    return run


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


def list_runs(
    session: Session, *, status: RunStatus | None = None, name: str | None = None, offset: int = 0, limit: int = 50
) -> tuple[list[Run], int]:
    """Runs newest first, filtered by status and by a substring of the name; returns (page, total)."""
    where = []
    if status is not None:
        where.append(col(Run.status) == status.value)
    if name:
        where.append(col(Run.name).contains(name, autoescape=True))
    total = session.exec(select(func.count()).select_from(Run).where(*where)).one()
    rows = session.exec(select(Run).where(*where).order_by(col(Run.id).desc()).offset(offset).limit(limit)).all()
    return list(rows), int(total)


def transition(
    session: Session, run: Run, to: RunStatus, *, reason: str = "", _resume: bool = False, **data: Any
) -> bool:
    """Move ``run`` to ``to`` and record the event; a repeat of the current state is a no-op (returns False).
    ``_resume`` (used by ``resume`` only) also allows ``failed | cancelled → queued``.

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
    ``worker.rundir.ENGINE_EVENTS``) as run events of their kind, at the time they were written, each once: one
    whose kind and time the run already has is skipped (a supervisor that resends after a restart adds nothing).
    Returns how many were new. Flushes only."""
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
        new += 1
    session.flush()
    return new


def hold(session: Session, run: Run, reason: str) -> bool:
    """Keep a queued run waiting (a concurrency limit, ``server.services.capacity.wait_reason``): the reason becomes
    its ``status_reason`` and, when it is new, a ``waiting`` event. Returns whether the reason changed."""
    if run.status_reason == reason:
        return False
    run.status_reason, run.updated_at = reason, utcnow()
    session.add(run)
    record_event(session, run, "waiting", reason=reason)
    return True


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


def stop_by(session: Session, run_id: int, user: Principal) -> Run:
    """``user`` stops run ``run_id`` (its owner or an admin; :func:`request_stop`), committed; the worker is asked to
    stop a launched run after the commit. The one path of the API's and the dashboard's stop.

    Raises:
        NotFound, Forbidden (``permissions.require_run``), InvalidTransition: the run has ended.
    """
    run = get(session, run_id, lock=True)
    permissions.require_run(user, run, "stop")
    needs_worker = request_stop(session, run, by=user.name)
    session.commit()
    if needs_worker:
        enqueue(TaskName.stop_run, run_id)
    return run


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
    enqueue(TaskName.launch_run, run_id)
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


def events(session: Session, run_id: int, *, offset: int = 0, limit: int = 500) -> tuple[list[RunEvent], int]:
    total = session.exec(select(func.count()).select_from(RunEvent).where(RunEvent.run_id == run_id)).one()
    rows = session.exec(
        select(RunEvent).where(RunEvent.run_id == run_id).order_by(col(RunEvent.id)).offset(offset).limit(limit)
    ).all()
    return list(rows), int(total)


# ----------------------------------------------------------------------------- resume, fork, logs


def run_home(run: Run) -> Path:
    """The run's home folder (``<ASYNCRL_OUTPUT_DIR>/runs/<id>``): every file of a run the service reads is read
    below it through ``worker.run_files`` (no symbolic links, regular files only)."""
    return Path(run.run_dir).parent


def run_file(run: Run, *parts: str) -> str:
    """The path of ``<run_dir>/<parts...>`` relative to the run's home (what ``worker.run_files`` takes and what
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
    ``metrics.jsonl``). The caller commits and then enqueues the launch, which resumes since a checkpoint exists.

    Raises:
        InvalidTransition: the run is not failed/cancelled, its supervisor still runs, or it has no complete
            checkpoint (the message names the checkpoints folder).
    """
    from worker.supervisor import running_pid

    current = RunStatus(run.status)
    if current not in RESUMABLE:
        raise InvalidTransition(f"run {run.id} is {current.value}: only failed or cancelled runs resume")
    home = Path(run.run_dir).parent
    deadline = time.monotonic() + SUPERVISOR_EXIT_WAIT_S  # it reported its final status and is exiting
    while (pid := running_pid(home)) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid is not None:
        raise InvalidTransition(f"run {run.id}: its supervisor (pid {pid}) is still running; wait for it to end")
    steps = checkpoint_steps(run)
    if not steps:
        raise InvalidTransition(f"run {run.id}: no complete checkpoint in {run_file(run, 'checkpoints')}")
    step = steps[-1]
    session.execute(delete(Metric).where(col(Metric.run_id) == run.id, col(Metric.step) > step))
    reason = f"resumed by {by} from checkpoint step {step}"
    transition(session, run, S.queued, reason=reason, _resume=True, step=step)
    record_event(session, run, "resumed", reason=reason, step=step, by=by)
    return step


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


def check_fork_lora(parent: dict[str, Any], child: RLSpec) -> None:
    """A fork keeps its parent's ``trainer.lora``: the parent's checkpoint holds full weights or an adapter of that
    rank and those target modules (``worker/trainer/checkpointer.py``), which a child with another setting cannot
    load (a full fine-tune from a LoRA checkpoint, LoRA from a full one, another rank or other targets); alpha and
    dropout would change the policy the checkpoint's adapter encodes.

    A LoRA fork also keeps ``model.name``: the adapter is a delta on the base it was trained on.

    Raises:
        SpecError: ``trainer.lora`` differs, one line naming it and both settings; ``model.name`` differs in a fork
            of a LoRA run.
    """
    before = (parent.get("trainer") or {}).get("lora")
    base = (parent.get("model") or {}).get("name")
    if before is not None and child.model.name != base:  # the adapter is a delta on its base: only on that one
        raise SpecError(
            f"model.name: a fork of a LoRA run keeps its base model ({base}): the checkpoint's adapter was trained on "
            f"it, not on {child.model.name}"
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
    """Give a fork its parent's served-policy check probe (``worker/policy_check.py``): the probe tokens, the base
    log-probs and those of the fork step's version, so the fork checks its first load and every later version against
    the same base. Nothing when the parent has none (check off, LoRA, or no step trained yet).

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
    """A new queued run of ``owner`` (``admin``: see :func:`create`): the parent's spec with ``request.changes``
    (named ``request.name``, default the parent's name), starting from the parent's checkpoint ``request.step``
    (default: the newest complete one). The checkpoint is hard-linked (or copied) into the child's run
    directory with the child's ``config.json``, so the child's launch resumes from it: weights, optimizer,
    scheduler, RNG and data cursor continue at ``step + 1`` under the changed spec. The child gets a ``forked``
    event (parent run id, step, changes) and the parent a ``fork`` event (child id). The caller commits and then
    enqueues the child's launch.

    Raises:
        SpecError: the changed spec is invalid (names the dotted key), changes ``trainer.lora``
            (:func:`check_fork_lora`), ``step`` has no complete checkpoint, or ``max_steps`` leaves nothing to train
            after ``step``.
        InvalidTransition: the parent has no complete checkpoint at all.
    """
    data, step = apply_changes(parent.spec, request.changes), request.step
    data.pop("output_dir", None)
    if request.name is not None:
        data["name"] = request.name
    child_spec = validate_spec("rl", data)
    spec_policy.check(child_spec, admin=admin)  # a bad key, value or code: named before the copy
    check_fork_lora(parent.spec, child_spec)
    steps = checkpoint_steps(parent)
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
    try:  # no symbolic link or special file of the parent's folder is followed or copied (worker.run_files)
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


def log_file(run: Run, process: str) -> str:
    """The log of ``process`` relative to the run's home: ``<name>/logs/<process>.log``; the supervisor's log is
    ``supervisor.log`` beside the run directory."""
    return "supervisor.log" if process == "supervisor" else run_file(run, "logs", f"{process}.log")


def read_log(run: Run, process: str, lines: int) -> list[str]:
    """The last ``lines`` lines of ``process``'s log (``log_file``), read safely (``worker.run_files``).

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


_ROLLOUT_FILE = re.compile(r"^step_(\d+)\.jsonl$")
MAX_ROLLOUT_BYTES = 64 << 20
"""The most of one ``rollouts/step_<n>.jsonl`` file read for a page or an answer."""


def rollout_steps(run: Run) -> list[int]:
    """Steps with a ``rollouts/step_<n>.jsonl`` regular file in the run directory, ascending.

    Raises:
        RunFileRefused: ``rollouts`` (or the run directory) is a symbolic link or not a folder.
    """
    found = list_run_folder(run_home(run), run_file(run, "rollouts"))
    return sorted(int(m.group(1)) for name, d in found.items() if not d and (m := _ROLLOUT_FILE.match(name)))


ROLLOUT_FIELDS = ("advantage",)
"""Keys every shown rollout record has (the run page and the API read them)."""


@dataclass(frozen=True)
class Rollouts:
    step: int | None
    """The step shown (None: the run wrote no rollouts yet)."""
    records: list[dict[str, Any]]
    skipped: int
    """Lines of the file (among those read) that were not a JSON object with the ``ROLLOUT_FIELDS``."""


def rollouts(run: Run, *, step: int | None = None, limit: int = 20) -> Rollouts:
    """The first ``limit`` rollout records of ``step`` (default: the newest step with rollouts) as the orchestrator
    wrote them (task, completion, reward, advantage, policy_span, ...). A line that is not a JSON object with a
    numeric ``advantage`` is skipped and counted (a torn last line included). No file: no records.

    Raises:
        RunFileRefused: the file or a folder on its way is a symbolic link or not a regular file.
    """
    if step is None:
        steps = rollout_steps(run)
        if not steps:
            return Rollouts(None, [], 0)
        step = steps[-1]
    records: list[dict[str, Any]] = []
    skipped = 0
    try:
        f = open_run_file(run_home(run), run_file(run, "rollouts", f"step_{step}.jsonl"))
    except RunFileMissing:
        return Rollouts(step, [], 0)
    with f:
        for line in f.read(MAX_ROLLOUT_BYTES).splitlines():
            if len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:  # not JSON, or not UTF-8
                rec = None
            ok = isinstance(rec, dict) and all(
                isinstance(rec.get(k), int | float) and not isinstance(rec.get(k), bool) for k in ROLLOUT_FIELDS
            )
            if ok:
                records.append(rec)
            else:
                skipped += 1
    return Rollouts(step, records, skipped)
