"""Celery tasks: thin shells over ``launch``, ``stop``, ``reconcile`` and ``export``, plain functions tested without Celery.

``launch(run_id)`` locks the run row and returns at once unless the run is ``queued`` with no launch recorded.
Otherwise it starts the run's supervisor (``worker.launchers.supervisor``: a detached process group that runs the local
launcher and reports status and metrics over HTTP with the run token) — or adopts the one a killed earlier
delivery already started, found by the supervisor's lock file — records its pid as the launcher handle, moves
the run to ``starting`` and commits. Enqueue a task only after the commit that created the row. When the run
directory already holds a complete checkpoint (a resumed or forked run) the supervisor starts with ``--resume``.
A delivery that comes after the supervisor of this very attempt already ended (its launch was never committed, so
the run is still ``queued``) adopts the finished run: it records the status the supervisor spooled in
``<home>/final.json`` instead of starting the run again (whose directory now exists).

``reconcile()`` runs every ``RECONCILE_INTERVAL_S`` from Celery beat (``asyncrl worker`` embeds it): a
starting/running/paused local run whose supervisor is gone gets the final status the supervisor spooled for this
attempt (it could not reach the server), or else is marked ``failed`` with the reason (``out of memory: ...`` first
when the run's cgroup saw an OOM kill); what is left of its processes is killed first. Then ``kill_leftovers`` kills
what ended runs of this worker left behind (``worker/run/cgroups.py``) and records a ``leftovers`` event with the count.
A launch makes the run's cgroup (``worker.run.cgroups.prepare``) and records a ``processes`` event naming the unit.

A launch never leaves a run ``queued`` for a disk problem: when the filesystem of the run's home has less free space
than the run obviously needs (``worker.run.rundir.space_refusal``), or preparing the home fails (a full disk, a
read-only or unwritable output folder), the run is ``failed`` with the cause and the path.

A launch that would start a run beyond ``MAX_RUNS_PER_USER`` (launched live runs of its owner) or
``MAX_RUNS_PER_WORKER`` (live local runs of this worker) leaves it ``queued`` with the reason
(``server/services/capacity.py``); ``start_waiting`` launches such runs, oldest first, when a run ends (the API
enqueues it after a final status report, ``stop`` calls it) and after every reconcile.

An *attempt* is identified by the id of the run event that last moved the run to ``queued`` (its creation, or a
resume): every delivery of one launch sees the same id, and a resume makes a new one.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from datetime import UTC
from pathlib import Path
from typing import Any

from celery import Task
from celery.signals import worker_ready
from pydantic import ValidationError
from sqlalchemy import func
from sqlmodel import Session, col, select

from server.alerts import rules, webhooks
from server.core.config import settings
from server.core.db import engine
from server.jobs.celery_app import TaskName, app, enqueue
from server.models import TERMINAL, EngineEvent, MetricPoint, Role, Run, RunEvent, RunStatus, stored_id
from server.services import capacity, exports, metrics, pipelines, runs, sweeps, tokens
from server.services.permissions import Forbidden
from worker.launchers import supervisor
from worker.launchers.reporter import row_to_event, rows_to_points
from worker.run import cgroups, inputs
from worker.run.procs import alive, give_folder, live_processes, started_at
from worker.run.run_files import RunFileRefused, copy_run_folder, open_run_file
from worker.run.rundir import (
    ENGINE_EVENTS,
    SupervisorHome,
    describe_os_error,
    read_jsonl_after,
    read_offset,
    space_refusal,
)
from worker.spec import SpecError, validate_spec

logger = logging.getLogger("asyncrl.tasks")


def launch(run_id: int) -> str:
    """Launch a queued run once; returns what happened (for logs and tests)."""
    with Session(engine) as session:
        try:
            run = runs.get(session, run_id, lock=True)
        except runs.RunNotFound:
            return f"skipped: run {run_id} does not exist"
        if run.status != RunStatus.queued or run.launcher_handle:
            return f"skipped: run {run_id} is {run.status} (handle {run.launcher_handle})"
        if run.spec.get("launcher", {}).get("kind") == "slurm":
            return _launch_slurm(session, run)
        home = Path(run.run_dir).parent
        pid = supervisor.running_pid(home)
        adopted = pid is not None
        attempt = current_attempt(session, run_id)
        if pid is None and (final := SupervisorHome(home).read_final(attempt)) is not None:
            return _adopt_finished(session, run, final)
        if pid is None and (refused := _refusal(session, run)) is not None:  # checked before anything of it starts
            return _fail_launch(session, run, refused)
        if pid is None and (full := space_refusal(home, str(run.spec["model"]["name"]))) is not None:
            return _fail_launch(session, run, full)
        if pid is None:
            if (waiting := _hold_for_slot(session, run, worker=capacity.worker_name())) is not None:
                return waiting
            resume = bool(runs.checkpoint_steps(run))
            try:  # RUN_USER / RUN_UID_BASE unusable, or another run's files it starts from cannot be copied
                user = supervisor.run_user(settings.RUN_USER, run_id=run_id, uid_base=settings.RUN_UID_BASE, home=home)
                spec = _with_inputs(session, run, home, link=user is None)
            except (ValueError, OSError) as err:
                return _fail_launch(session, run, f"launch: {_launch_error(err, home)}")
            for tries in range(1, CGROUP_TRIES + 1):
                unit, unit_line = _run_unit(run)
                try:
                    pid = supervisor.start(
                        home,
                        run_id=run_id,
                        spec=spec,
                        token=tokens.run_token(run),
                        server_url=settings.server_url(),
                        resume=resume,
                        attempt=attempt,
                        allow_env=settings.RUN_ENV_ALLOW,
                        user=user,
                        cgroup=unit,
                    )
                    break
                except (
                    ValueError,
                    OSError,
                ) as err:  # the run user cannot run this Python, the home cannot be written, or no supervisor
                    if unit is not None and not unit.exists() and tries < CGROUP_TRIES:
                        time.sleep(0.5)  # the stop of the previous attempt removed the cgroup before we joined it
                        continue
                    cgroups.end_run(unit, None, started_before=None)
                    return _fail_launch(session, run, f"launch: {_launch_error(err, home)}")
        run.launcher, run.launcher_handle, run.worker = "local", str(pid), capacity.worker_name()
        reason = "adopted the running supervisor" if adopted else "launched"
        runs.transition(session, run, RunStatus.starting, reason=reason, pid=pid, adopted=adopted)
        if not adopted:
            logger.info("run %s: its processes live in the %s", run_id, unit_line)
            runs.record_event(session, run, "processes", reason=f"processes in the {unit_line}", pid=pid)
        session.commit()
        return f"{'adopted' if adopted else 'launched'}: run {run_id} pid {pid}"


def _with_inputs(session: Session, run: Run, home: Path, *, link: bool) -> dict[str, Any]:
    """The spec ``run`` starts with: its stored spec, with the paths it names in other runs' folders replaced by the
    copies made in its ``home`` (``worker.run.inputs.copy_inputs``: a run's uid cannot enter another run's folder),
    each source's run asked again at the copy whether the owner may use its files (``runs.may_use_run_files``).

    Raises:
        InputCopyError: such a path cannot be copied, or now leads to a run the owner may not use; one line naming
            the key.
    """
    runs_root = Path(settings.ASYNCRL_OUTPUT_DIR) / "runs"
    admin = _owner_is_admin(session, run)
    return inputs.copy_inputs(
        run.spec,
        home,
        run_id=stored_id(run),
        runs_root=runs_root,
        link=link,
        may_use=lambda other: runs.may_use_run_files(session, other, owner=run.owner, admin=admin),
    )


def _owner_is_admin(session: Session, run: Run) -> bool:
    """Whether ``run``'s owner is an admin now (the launch's checks use the owner's role of today, not of submit)."""
    owner = tokens.user(session, run.owner)
    return owner is not None and owner.role == Role.admin


def _launch_error(err: Exception, home: Path) -> str:
    """One line for what stopped a launch: an ``OSError`` of the run's ``home``, a path in it or a folder above it
    (preparing it: a full disk, a read-only or unwritable output folder) by its cause and path
    (``worker.run.rundir.describe_os_error``); any other error as it is."""
    if isinstance(err, OSError) and err.filename:
        where = Path(str(err.filename))
        if where.is_relative_to(home) or home.is_relative_to(where):
            return describe_os_error(err)
    return str(err)


CGROUP_TRIES = 3
"""Starts of a supervisor whose cgroup vanished between ``prepare`` and its join: a resume launched while the stop of
the run's previous attempt (``supervisor.terminate``) is still ending it removes the cgroup of the same name."""


def _run_unit(run: Run) -> tuple[cgroups.RunCgroup | None, str]:
    """Make the local ``run``'s cgroup (``worker.run.cgroups.prepare``: ``RUN_CGROUPS``, its
    ``launcher.memory_limit_gib``); returns it (None: the supervisor's session is the unit) and the line saying so."""
    limit = (run.spec.get("launcher") or {}).get("memory_limit_gib")
    return cgroups.prepare(stored_id(run), Path(run.run_dir).parent, limit, enabled=settings.RUN_CGROUPS)


def _cgroup_of(run: Run) -> cgroups.RunCgroup | None:
    """The cgroup of a local ``run`` when it exists on this machine, else None."""
    try:
        found = cgroups.for_run(stored_id(run), Path(run.run_dir).parent)
    except cgroups.Unavailable:
        return None
    return found if found.exists() else None


def _hold_for_slot(session: Session, run: Run, *, worker: str | None) -> str | None:
    """Keep the locked queued ``run`` waiting (and commit) when a concurrency limit is reached; returns what happened,
    None when a slot is free (the caller launches; the launch lock stays held until its commit)."""
    capacity.lock_launches(session)
    reason = capacity.wait_reason(session, run, worker=worker)
    if reason is None:
        return None
    runs.hold(session, run, reason)
    session.commit()
    return f"waiting: run {run.id}: {reason}"


def start_waiting() -> list[str]:
    """Launch the runs a concurrency limit held back, oldest first (each one re-checks the limits: those still
    beyond one keep waiting), up to the first that waits for this worker's slot (no later local run would start
    here: ``capacity.wait_reason`` keeps submission order). Called when a run ends, after a launch that freed or took
    the turn of runs waiting behind it, and on every reconcile; returns what each launch did."""
    with Session(engine) as session:
        waiting = capacity.waiting_runs(session)
    done = []
    for run_id in waiting:
        done.append(launch(run_id))
        if done[-1].startswith(f"waiting: run {run_id}: {capacity.WORKER_FULL}"):
            break
    return done


def _refusal(session: Session, run: Run) -> str | None:
    """Why the stored spec may not be launched now (it no longer validates, or fails a check of submit,
    ``runs.check_allowed``: names code, an address or a path the service does not allow, a path that now leads into
    another user's run folder through a symlink swapped while the run waited, or something only an admin may use and
    the owner is not one: a spec stored before a rule, a setting or the owner's role changed), None when it may.
    Checked only before a supervisor or Slurm job is started, never against one an earlier delivery already
    started."""
    try:
        spec = validate_spec(str(run.spec.get("kind", "rl")), run.spec)
        runs.check_allowed(session, spec, owner=run.owner, admin=_owner_is_admin(session, run))
    except (SpecError, Forbidden) as err:
        return f"refused at launch: {err}"
    return None


def _fail_launch(session: Session, run: Run, reason: str) -> str:
    """Mark the locked queued ``run`` failed with ``reason`` (nothing of it was started) and commit."""
    runs.transition(session, run, RunStatus.failed, reason=reason[:2000])
    session.commit()
    return f"failed: run {run.id}: {reason}"


def current_attempt(session: Session, run_id: int) -> int | None:
    """Id of the run event that last moved the run to ``queued`` (see the module docstring), None without one."""
    return session.exec(
        select(func.max(RunEvent.id)).where(
            RunEvent.run_id == run_id, RunEvent.kind == "status", RunEvent.to_status == RunStatus.queued.value
        )
    ).one()


def _apply_final(session: Session, run: Run, final: dict[str, Any], **data: Any) -> None:
    """Move the live (or still queued) ``run`` to the spooled final status, through the states the supervisor would
    have reported on the way (``starting``, and ``running`` before ``completed``)."""
    to = RunStatus(final["status"])
    path = [RunStatus.starting] if RunStatus(run.status) == RunStatus.queued else []
    if to == RunStatus.completed and RunStatus(run.status) in (RunStatus.queued, RunStatus.starting):
        path.append(RunStatus.running)
    for step in path:
        runs.transition(session, run, step, reason="reported late by the supervisor's spool", **data)
    runs.transition(session, run, to, reason=str(final.get("reason", ""))[:2000], **data)


def _adopt_finished(session: Session, run: Run, final: dict[str, Any]) -> str:
    """The supervisor of this attempt already ended (a redelivered launch): record its spooled final status."""
    pid = int(final.get("pid") or 0)
    run.launcher, run.launcher_handle = "local", str(pid) if pid else None
    _apply_final(session, run, final, pid=pid, adopted=True)
    session.commit()
    return f"adopted finished: run {run.id} {final['status']} (supervisor {pid})"


def _launch_slurm(session: Session, run: Run) -> str:
    """Submit the locked queued run as a Slurm job (``worker.launchers.slurm``), or adopt the job an earlier delivery
    submitted (found by name and home folder); the job id is the launcher handle. When Slurm refuses the job the
    run is ``failed`` with Slurm's own message and nothing is queued."""
    from worker.launchers import slurm

    try:  # any kind: an SFT run or an eval job is the same job script, its supervisor runs the kind's launcher
        spec = validate_spec(str(run.spec.get("kind", "rl")), run.spec)
    except SpecError as err:  # stored before a rule changed: nothing can be started from it
        return _fail_launch(session, run, f"refused at launch: {err}")
    home, run_id = Path(run.run_dir).parent, stored_id(run)
    try:
        job = slurm.find(run_id, home, spec.launcher.slurm.allocation)
        adopted = job is not None
        if job is None and (refused := _refusal(session, run)) is not None:
            return _fail_launch(session, run, refused)
        if job is None:
            if (waiting := _hold_for_slot(session, run, worker=None)) is not None:
                return waiting
            if (full := space_refusal(home, spec.model.name)) is not None:
                return _fail_launch(session, run, full)
            try:  # a root worker: the run's processes run as its uid (never as root), checked before submitting
                user = supervisor.run_user(settings.RUN_USER, run_id=run_id, uid_base=settings.RUN_UID_BASE, home=home)
                if user is not None:
                    supervisor.check_run_user(user, home)
            except ValueError as err:
                return _fail_launch(session, run, f"launch: {err}")
            try:  # the files it starts from in other runs' folders: copied in, given to its uid
                if user is not None:
                    supervisor.open_slurm_home(home)
                launched = _with_inputs(session, run, home, link=user is None)
                if user is not None and (home / inputs.INPUTS_DIR).is_dir():
                    give_folder(home / inputs.INPUTS_DIR, user.uid, os.stat(home).st_gid)
                SupervisorHome(home).write_spec(launched)
            except (ValueError, OSError) as err:
                return _fail_launch(session, run, f"launch: {_launch_error(err, home)}")
            env = supervisor.run_env(run_id, tokens.run_token(run), settings.server_url(), settings.RUN_ENV_ALLOW)
            resume = bool(runs.checkpoint_steps(run))
            job = slurm.submit(spec, run_id=run_id, home=home, env=env, resume=resume, user=user)
    except (slurm.SlurmError, NotImplementedError) as err:
        runs.transition(session, run, RunStatus.failed, reason=f"slurm: {err}"[:2000], launcher="slurm")
        session.commit()
        return f"failed: run {run.id}: {err}"
    run.launcher, run.launcher_handle = "slurm", job
    reason = "adopted the Slurm job" if adopted else "submitted to Slurm"
    runs.transition(session, run, RunStatus.starting, reason=reason, job=job, adopted=adopted)
    session.commit()
    return f"{'adopted' if adopted else 'submitted'}: run {run.id} slurm job {job}"


def stop(run_id: int, grace_s: float = 30.0) -> str:
    """Terminate the run's process group (not holding the row lock meanwhile), then mark it ``cancelled``. A stop the
    hang watchdog asked with a restart (``watchdog.on_stall = "restart"``: ``runs.restart_requested``) then resumes the
    run from its newest complete checkpoint and enqueues its launch; refused (no checkpoint, the checkpoint has not
    moved since the last watchdog restart, ``runs.MAX_WATCHDOG_RESTARTS`` reached: ``runs.watchdog_restart``) it stays
    cancelled with a ``restart_failed`` event."""
    with Session(engine) as session:
        try:
            run = runs.get(session, run_id)
        except runs.RunNotFound:
            return f"skipped: run {run_id} does not exist"
        if RunStatus(run.status) in TERMINAL:
            return f"skipped: run {run_id} is {run.status}"
        handle, launcher = run.launcher_handle, run.launcher
        session.rollback()
    if handle and launcher == "slurm":
        from worker.launchers import slurm

        slurm.cancel(handle, wait_s=grace_s)
    elif handle:
        with Session(engine) as session:
            unit = _cgroup_of(runs.get(session, run_id))
        supervisor.terminate(int(handle), grace_s=grace_s, cgroup=unit)
    with Session(engine) as session:
        run = runs.get(session, run_id, lock=True)
        if run.launcher_handle != handle:  # resumed meanwhile (a new launch): that one is not ours to cancel
            return f"stopped: run {run_id} was relaunched (handle {run.launcher_handle})"
        ended = RunStatus(run.status) in TERMINAL  # the supervisor reported its own end first
        if not ended:
            runs.transition(session, run, RunStatus.cancelled, reason="stopped", pid=handle)
        restarted = runs.watchdog_restart(session, run)
        status = run.status  # read inside the session: the row is detached after it closes
        session.commit()
    if restarted is not None:
        enqueue(TaskName.launch_run, run_id)
        return f"restarted: run {run_id} from checkpoint step {restarted}"
    start_waiting()  # its slot is free
    return f"stopped: run {run_id} is {status}" if ended else f"stopped: run {run_id}"


def _last_lines(home: Path, rel: str, n: int) -> str:
    """The last ``n`` lines of ``home/rel`` read safely (``worker.run.run_files``: no link, a regular file), or ""."""
    try:
        with open_run_file(home, rel) as f:
            return "\n".join(runs.tail(f, n))
    except OSError:
        return ""


LIVE = (RunStatus.starting, RunStatus.running, RunStatus.paused)


def reconcile() -> list[int]:
    """End every starting/running/paused local run whose supervisor process is gone: with the final status the
    supervisor spooled for this attempt (``<home>/final.json``, written when it could not reach the server), else
    ``failed`` with the reason ``supervisor <pid> is gone`` and the last lines of its events and supervisor log.
    Either way the metric points of ``metrics.jsonl`` it had not forwarded are stored first.
    Idempotent (an ended run is no longer checked). Assumes the worker running it shares the machine (and /proc)
    with the supervisors, as the local launcher does. Returns the ids of the runs it failed (not those it ended
    from a spool).
    """
    with Session(engine) as session:
        candidates = [
            run_id
            for run_id in session.exec(
                select(Run.id).where(
                    col(Run.status).in_([s.value for s in LIVE]), col(Run.launcher).in_(["local", "slurm"])
                )
            ).all()
            if run_id is not None
        ]
    failed = []
    for run_id in candidates:
        with Session(engine) as session:
            run = runs.get(session, run_id, lock=True)
            if RunStatus(run.status) in LIVE and run.launcher == "slurm" and run.launcher_handle:
                if _reconcile_slurm(session, run):
                    failed.append(run_id)
                continue
            handle = run.launcher_handle or ""
            if RunStatus(run.status) not in LIVE or not handle.isdigit():
                continue
            pid, home = int(handle), Path(run.run_dir).parent
            if alive(pid) or supervisor.running_pid(home) is not None:
                continue
            unit = _cgroup_of(run)
            oom = cgroups.oom_reason(unit, "")  # read before the cgroup is removed
            killed = cgroups.end_run(unit, pid, started_before=time.time())  # the run ends: nothing of it may stay
            _record_leftovers(session, run, killed, pid, "supervisor gone")
            final = SupervisorHome(home).read_final(current_attempt(session, run_id))
            _ingest_spooled_events(session, run, home)  # e.g. the disk_full that ended it, written after the last send
            points = _ingest_spooled_metrics(session, run, home)  # what it measured but had not sent, either way
            if final is not None:  # the supervisor ended but could not tell the server: deliver what it spooled
                _apply_final(session, run, final, pid=pid, by="reconcile")
                session.commit()
                logger.info(
                    "reconcile: run %s %s from the spool %s (%d metric points it had not sent)",
                    run_id,
                    final["status"],
                    SupervisorHome(home).final,
                    points,
                )
                continue
            context = "\n".join(
                x
                for x in (
                    _last_lines(home, runs.run_file(run, "events.jsonl"), 3),
                    _last_lines(home, "supervisor.log", 5),
                )
                if x
            )
            reason = f"supervisor {pid} is gone" + (f"; last lines:\n{context}" if context else "")
            if oom:
                reason = f"{oom}; {reason}"
            runs.transition(session, run, RunStatus.failed, reason=reason[:2000], pid=pid, by="reconcile")
            session.commit()
            failed.append(run_id)
    kill_leftovers()
    return failed


LEFTOVER_SLACK_S = 1.0
"""A process counts as a leftover of an ended run when it started at most this long after the run's recorded end
(clocks of the server and the worker, rounding of start times); one started later reuses a pid of the run."""
EXIT_GRACE_S = 10.0
"""Seconds after a run's recorded end before anything of it counts as left behind: the supervisor reports the end,
then leaves its cgroup and exits by itself (a reconcile in that moment had killed a completed demo run's supervisor
and recorded it as a leftover). A later reconcile checks the run again."""


def _killed_line(n: int, why: str) -> str:
    return f"killed {n} leftover process{'es' if n != 1 else ''} of the run ({why})"


def _record_leftovers(
    session: Session, run: Run, killed: set[int], supervisor: int | None, why: str, **data: Any
) -> str | None:
    """Record the ``leftovers`` event of the processes reconcile killed for an ended run, and return its reason
    (None when nothing was killed). The run's own supervisor (``supervisor``, its session leader) is no leftover of
    it: when it was still running it is named apart (``its supervisor <pid> had not exited``), never counted."""
    if not killed:
        return None
    others = sorted(killed - {supervisor})
    line = _killed_line(len(others), why)
    if supervisor is not None and supervisor in killed:
        line = (
            f"{line}; its supervisor {supervisor} had not exited"
            if others
            else (f"killed the run's supervisor {supervisor}, which had not exited ({why})")
        )
        data["supervisor"] = supervisor
    runs.record_event(session, run, "leftovers", reason=line, pids=others, **data)
    return line


def kill_leftovers() -> dict[int, int]:
    """SIGKILL the processes that ended local runs of this worker left behind, and remove their cgroups: processes
    in a run's cgroup (``worker.run.cgroups``; any cgroup under ``asyncrl/`` named for a run of this service that has
    ended), and processes whose session id is an ended run's supervisor pid and that started before the run ended
    (a later process that reuses the pid is left alone); a run that ended less than :data:`EXIT_GRACE_S` ago is left
    to end by itself. Records a ``leftovers`` run event with the count. Returns run id -> processes killed."""
    try:
        layout = cgroups.layout()
        names = {d.name for d in (layout.roots[0] / cgroups.PARENT).glob("run-*") if d.is_dir()}
    except (cgroups.Unavailable, OSError):
        names = set()
    by_name = {int(n.split("-")[1]): n for n in names if n.count("-") == 2 and n.split("-")[1].isdigit()}
    sessions = {str(sid) for _, sid, _ in live_processes().values()}
    with Session(engine) as session:
        ended = session.exec(
            select(Run.id).where(
                col(Run.status).in_([s.value for s in TERMINAL]),
                col(Run.launcher) == "local",
                col(Run.id).in_(list(by_name))
                | (col(Run.launcher_handle).in_(sessions) & (col(Run.worker) == capacity.worker_name())),
            )
        ).all()
    done: dict[int, int] = {}
    for run_id in ended:
        if run_id is None:
            continue
        with Session(engine) as session:
            run = runs.get(session, run_id, lock=True)  # a resume (a new launch) waits until this is done
            if RunStatus(run.status) not in TERMINAL or run.finished_at is None:
                continue
            unit = _cgroup_of(run)
            handle = run.launcher_handle or ""
            sid = int(handle) if handle.isdigit() and run.worker == capacity.worker_name() else None
            ended_s = run.finished_at.replace(tzinfo=run.finished_at.tzinfo or UTC).timestamp()
            if time.time() - ended_s < EXIT_GRACE_S:
                continue  # its supervisor may still be on its way out
            ended_at = ended_s + LEFTOVER_SLACK_S
            if sid is not None and (leader := started_at(sid)) is not None and leader > ended_at:
                sid = None  # the pid leads a later session: nothing of it is the run's
            killed = cgroups.end_run(unit, sid, started_before=ended_at)
            if (line := _record_leftovers(session, run, killed, sid, "run ended", by="reconcile")) is not None:
                logger.warning("reconcile: run %s: %s: %s", run_id, line, sorted(killed))
                done[run_id] = len(killed)
            session.commit()
    return done


def _unsent_rows(run: Run, home: Path, name: str, offset_path: Path) -> list[dict[str, Any]]:
    """The complete lines of the run file ``name`` (``metrics.jsonl``, ``events.jsonl``) after the byte offset its
    supervisor had sent up to (``offset_path``), read safely (``worker.run.run_files``); [] when the file is refused (a
    link: logged)."""
    rel = runs.run_file(run, name)
    try:
        rows, _ = read_jsonl_after(
            Path(run.run_dir) / name, read_offset(offset_path), opener=lambda _: open_run_file(home, rel)
        )
    except RunFileRefused as err:
        logger.warning("run %s: unsent lines of %s not read: %s", stored_id(run), name, err)
        return []
    return rows


def _ingest_spooled_metrics(session: Session, run: Run, home: Path) -> int:
    """Store the points of ``metrics.jsonl`` the supervisor had not forwarded (after ``forwarded.offset``), as the
    metrics route would (idempotent; invalid points are skipped); returns how many were read. Not committed."""
    points = []
    for point in rows_to_points(_unsent_rows(run, home, "metrics.jsonl", SupervisorHome(home).forwarded_offset)):
        try:
            points.append(MetricPoint.model_validate(point))
        except ValidationError:
            logger.warning("reconcile: run %s: skipped an invalid metric point %s", run.id, point)
    metrics.ingest(session, run_id=stored_id(run), points=points)
    return len(points)


def _ingest_spooled_events(session: Session, run: Run, home: Path) -> int:
    """Record the engine events of ``events.jsonl`` (``disk_full``, ``truncated``, ...) the supervisor had not
    forwarded (after ``events.offset``), as the events route would (each once; invalid lines are skipped); returns how
    many were new. Not committed."""
    events = []
    for row in _unsent_rows(run, home, "events.jsonl", SupervisorHome(home).events_offset):
        if row.get("event") not in ENGINE_EVENTS:
            continue
        try:
            events.append(EngineEvent.model_validate(row_to_event(row)).model_dump())
        except (ValidationError, KeyError, TypeError, ValueError):
            logger.warning("reconcile: run %s: skipped an invalid engine event %s", run.id, str(row)[:300])
    return runs.record_engine_events(session, run, events) if events else 0


def _reconcile_slurm(session: Session, run: Run) -> bool:
    """End a live Slurm run whose job has ended or is gone (``scontrol``/``squeue``; no accounting database):
    ``cancelled`` when the job was cancelled, else ``failed`` with the job state, Slurm's reason, the nodes it lost
    (``NODE_FAIL``: ``lost node asrl-n3 (DOWN: ...)``) and the last lines of the job's log. Returns whether it ended
    the run. A worker without Slurm commands leaves it alone."""
    from worker.launchers import slurm

    try:
        job = slurm.state(run.launcher_handle or "")
    except slurm.SlurmError as err:
        logger.warning("reconcile: run %s: cannot ask Slurm (%s)", run.id, err)
        return False
    if job is not None and job.live:
        return False
    home = Path(run.run_dir).parent
    attempts = SupervisorHome(home).attempt_logs()
    context = "\n".join(
        x
        for x in (
            _last_lines(home, "supervisor.log", 5),
            _last_lines(home, str(attempts[-1].relative_to(home)), 3) if attempts else "",
        )
        if x
    )
    what = "is gone" if job is None else f"ended {job.state} (reason {job.reason}, exit code {job.exit_code})"
    try:  # a node of the job lost (Slurm ends the job NODE_FAIL): named, as the supervisor names it
        lost = slurm.lost_nodes(job.nodes) if job is not None and job.state == "NODE_FAIL" else {}
    except slurm.SlurmError as err:
        logger.warning("reconcile: run %s: cannot ask Slurm for its nodes (%s)", run.id, err)
        lost = {}
    what += "".join(f"; lost node {node} ({state})" for node, state in lost.items())
    reason = f"Slurm job {run.launcher_handle} {what}" + (f"; last lines:\n{context}" if context else "")
    to = RunStatus.cancelled if job is not None and job.state == "CANCELLED" else RunStatus.failed
    runs.transition(session, run, to, reason=reason[:2000], job=run.launcher_handle, by="reconcile")
    session.commit()
    return True


@app.task(name=TaskName.reconcile.value)
def reconcile_runs() -> list[int]:
    failed = reconcile()
    if failed:
        logger.warning("reconcile: marked runs %s failed (supervisor gone)", failed)
    for run_id, name in reconcile_exports():
        logger.warning(
            "reconcile: marked the export %s of run %s failed (its worker is gone or it timed out)", name, run_id
        )
    for result in start_waiting():
        logger.info(result)
    return failed


def _tick_each(
    kind: str, running_ids: Callable[[Session], Sequence[int]], tick: Callable[[Session, int], list[str]]
) -> list[str]:
    """Advance every running sweep or pipeline (``kind``) once with ``tick``, each in its own session; returns what
    was done, one line each. One whose tick fails is logged and tried again next time; the others still advance."""
    with Session(engine) as session:
        ids = running_ids(session)
    done = []
    for item_id in ids:
        try:
            with Session(engine) as session:
                done += [f"{kind} {item_id}: {line}" for line in tick(session, item_id)]
        except Exception:
            logger.exception("tick of %s %s failed", kind, item_id)
    return done


def tick_sweeps() -> list[str]:
    """Advance every running sweep once (``server.services.sweeps.tick``: decide its due rungs and stop the pruned
    runs, start trials up to ``max_parallel``, complete it); returns what was done."""
    return _tick_each("sweep", sweeps.running_ids, sweeps.tick)


def tick_pipelines() -> list[str]:
    """Advance every running pipeline once (``server.services.pipelines.tick``: end the current stage whose run ended,
    start the next stage's run, complete or fail the pipeline); returns what was done."""
    return _tick_each("pipeline", pipelines.running_ids, pipelines.tick)


def _logged(done: list[str]) -> list[str]:
    for line in done:
        logger.info(line)
    return done


@app.task(name=TaskName.tick_sweeps.value)
def tick_sweeps_task() -> list[str]:
    return _logged(tick_sweeps())


@app.task(name=TaskName.tick_pipelines.value)
def tick_pipelines_task() -> list[str]:
    return _logged(tick_pipelines())


@app.task(name=TaskName.start_waiting.value)
def start_waiting_runs() -> list[str]:
    """Enqueued by the API when a run ends: its slot may let a waiting run start."""
    results = start_waiting()
    for result in results:
        logger.info(result)
    return results


@worker_ready.connect
def _declare_capacity(**_: object) -> None:
    """On start, record this worker's capacity (``server.services.capacity.publish``) for the submit checks."""
    try:
        with Session(engine) as session:
            capacity.publish(session, capacity.worker_name(), cap := capacity.local())
            session.commit()
        logger.info("declared capacity of worker %s: %s", capacity.worker_name(), cap)
    except Exception:  # the worker still runs; submits are checked against the server's own machine meanwhile
        logger.exception("could not declare this worker's capacity")


@app.task(name=TaskName.launch_run.value)
def launch_run(run_id: int) -> str:
    """Launch the run; when it started or failed, runs held behind it (submitted later, their tasks came first) may
    take the slots left: ``start_waiting``."""
    result = launch(run_id)
    logger.info(result)
    if result.startswith(("launched", "submitted", "failed", "adopted")):
        for line in start_waiting():
            logger.info(line)
    return result


@app.task(name=TaskName.stop_run.value)
def stop_run(run_id: int) -> str:
    result = stop(run_id)
    logger.info(result)
    return result


def export(run_id: int, step: int, adapter_only: bool, request: int | None = None) -> str:
    """Write the export of checkpoint ``step`` of run ``run_id`` at ``<home>/exports/step_<step>[-adapter]``
    (``server.services.exports``) for the ``export_requested`` event ``request``, recording ``export_started`` and then
    ``export_done`` (the path) or ``export_failed`` (the reason); returns what happened. Idempotent: a redelivery finds
    the folder and does nothing; a delivery of a request that has ended (failed by reconcile, or a newer request made)
    does nothing; the delivery after ``EXPORT_MAX_DELIVERIES`` started ones (each killed mid-export, e.g. out of memory:
    Celery redelivers a task whose worker process died) records ``export_failed`` instead of trying again.

    The files of the checkpoint's trainer part an export reads (``worker.policy.export.SOURCE_FILES``: not the
    optimizer's ``state.pt``) are first copied (hard links where possible) through ``worker.run.run_files`` into a
    hidden folder beside the export, so nothing the run's processes made is read through a link, and the base model is
    the one of the run's stored spec, not of files in its run directory."""
    from worker.policy.export import (
        ExportError,
        ExportSource,
        adapter_folder,
        export_name,
        is_source_file,
        source_kind,
        write_export,
    )

    name = export_name(step, adapter_only)
    with Session(engine) as session:
        try:
            run = runs.get(session, run_id, lock=True)  # one delivery at a time decides about this request
        except runs.RunNotFound:
            return f"skipped: run {run_id} does not exist"
        out = exports.export_dir(run, step, adapter_only)
        if out.exists() and not out.is_symlink():
            return f"skipped: run {run_id} {out} exists"
        last = exports.newest_event(session, run, name)
        if last is None or last.kind not in ("export_requested", "export_started"):
            return f"skipped: run {run_id} the request of {name} has ended"
        if request is not None and exports.request_of(last) != request:
            return f"skipped: run {run_id} request {request} of {name} was replaced by a newer one"
        request = exports.request_of(last)
        started = exports.deliveries(session, run, request)
        if started >= settings.EXPORT_MAX_DELIVERIES:
            why = (
                f"its worker process died during each of its {started} deliveries (killed, e.g. out of memory: see "
                f"the export worker's log; EXPORT_MAX_DELIVERIES {settings.EXPORT_MAX_DELIVERIES}); not tried again"
            )
            exports.fail_stale(session, run, last, why)
            session.commit()
            return f"failed: run {run_id} export of step {step}: {why}"
        refused = _linked_export_folder(out)
        if refused is not None:  # the run's uid owns its home: it must not steer this worker's writes and deletes
            exports.fail_stale(session, run, last, refused)
            session.commit()
            return f"failed: run {run_id} export of step {step}: {refused}"
        runs.record_event(
            session,
            run,
            "export_started",
            reason=f"exporting to {out} (delivery {started + 1})",
            name=name,
            step=step,
            request=request,
            pid=os.getpid(),
            worker=capacity.worker_name(),
        )
        session.commit()
        run_dir, model, home = Path(run.run_dir), dict(run.spec["model"]), runs.run_home(run)
    for left in out.parent.glob(f".{name}.*"):  # a killed earlier delivery's staging or temporary folder
        shutil.rmtree(left, ignore_errors=True)
    staging = out.with_name(f".{name}.source-{os.getpid()}")
    try:
        open_part = runs.run_file(run, "checkpoints", f"step_{step}", "trainer")
        copy_run_folder(home, open_part, staging, keep=is_source_file)  # not state.pt (the optimizer's)
        kind = source_kind(staging)
        if kind is None:
            raise ExportError(f"checkpoint step {step} holds neither model.safetensors nor adapter/")
        path = adapter_folder(staging) if kind == "lora" else staging
        source = ExportSource(run_dir, step, kind, path, str(model["name"]), str(model.get("dtype", "float32")))
        write_export(source, out, adapter_only=adapter_only)
    except Exception as err:  # recorded as the reason; the task itself succeeds (a redelivery would fail the same)
        reason = f"export of step {step} failed: {_one_line(err)}"
        with Session(engine) as session:
            runs.record_event(
                session,
                runs.get(session, run_id),
                "export_failed",
                reason=reason,
                name=name,
                step=step,
                request=request,
            )
            session.commit()
        return f"failed: run {run_id} {reason}"
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    with Session(engine) as session:
        runs.record_event(
            session,
            runs.get(session, run_id),
            "export_done",
            reason=f"exported to {out}",
            name=name,
            step=step,
            path=str(out),
            request=request,
        )
        session.commit()
    return f"exported: run {run_id} step {step} to {out}"


def reconcile_exports() -> list[tuple[int, str]]:
    """End with ``export_failed`` every export under way (``server.services.exports.in_flight``) whose newest
    ``export_started`` was recorded by a worker process of this machine (``WORKER_NAME``) that is gone, or that is
    older than ``EXPORT_REQUEST_TIMEOUT_S``, so the step can be exported again. Returns ``(run id, export name)`` of
    those ended. (An export waiting in the queue behind others is only ended by the timeout.)"""
    ended = []
    with Session(engine) as session:
        for run, event in exports.in_flight(session):
            data = event.data or {}
            pid = data.get("pid")
            why = exports.timed_out(event)
            if (
                why is None
                and event.kind == "export_started"
                and data.get("worker") == capacity.worker_name()
                and isinstance(pid, int)
                and not alive(pid)
            ):
                why = f"its worker process {pid} is gone (killed, e.g. out of memory: see the export worker's log)"
            if why is not None:
                exports.fail_stale(session, run, event, why)
                ended.append((stored_id(run), str(data.get("name"))))
        session.commit()
    return ended


def _linked_export_folder(out: Path) -> str | None:
    """Why this worker must not write the service export ``out`` (``<run home>/exports/<name>``): the run's own uid owns
    its home, so it could make ``exports`` (or ``out``) a link pointing this worker's writes and deletes anywhere; None
    when ``exports`` is a real folder or absent (then made here) and ``out`` is no link."""
    from worker.policy.export import EXPORTS_DIR

    folder = out.parent
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        return f"{EXPORTS_DIR} in the run's home is a link or not a folder; exports are written only into a real folder"
    if out.is_symlink():
        return f"{EXPORTS_DIR}/{out.name} in the run's home is a link; exports are written only into a real folder"
    folder.mkdir(exist_ok=True)
    return None


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


@app.task(name=TaskName.export_run.value)
def export_run(run_id: int, step: int, adapter_only: int, request: int | None = None) -> str:
    result = export(run_id, step, bool(adapter_only), request)
    logger.info(result)
    return result


@app.task(name=TaskName.deliver_webhook.value, bind=True, max_retries=None)
def deliver_webhook(self: Task, delivery_id: int) -> str:
    """One attempt of a webhook delivery (``server.alerts.webhooks.attempt``); a failed one is retried with
    exponential backoff (a new message with a countdown) until ``WEBHOOK_MAX_ATTEMPTS``."""
    with Session(engine) as session:
        result, retry_in = webhooks.attempt(session, delivery_id)
    logger.info(result)
    if retry_in is not None:
        raise self.retry(countdown=retry_in)
    return result


@app.task(name=TaskName.check_stalls.value)
def check_stalls() -> list[tuple[int, int]]:
    """Fire ``stall`` alert rules of running runs and re-enqueue lost webhook deliveries (Celery beat, every
    ``ALERT_STALL_CHECK_S``)."""
    with Session(engine) as session:
        fired = rules.check_stalls(session)
        webhooks.requeue_stuck(session)
        session.commit()
    return fired
