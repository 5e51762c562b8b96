"""Celery tasks: thin shells over ``launch``, ``stop`` and ``reconcile``, plain functions tested without Celery.

``launch(run_id)`` locks the run row and returns at once unless the run is ``queued`` with no launch recorded.
Otherwise it starts the run's supervisor (``worker.supervisor``: a detached process group that runs the local
launcher and reports status and metrics over HTTP with the run token) — or adopts the one a killed earlier
delivery already started, found by the supervisor's lock file — records its pid as the launcher handle, moves
the run to ``starting`` and commits. Enqueue a task only after the commit that created the row. When the run
directory already holds a complete checkpoint (a resumed or forked run) the supervisor starts with ``--resume``.

``reconcile()`` runs every ``RECONCILE_INTERVAL_S`` from Celery beat (``asyncrl worker`` embeds it): a
starting/running/paused local run whose supervisor is gone is marked ``failed`` with the reason.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlmodel import Session, col, select

from server.core.config import settings
from server.core.db import engine
from server.models import TERMINAL, Run, RunStatus
from server.services import runs, tokens
from worker import supervisor
from worker.celery_app import app
from worker.spec import RLSpec, validate_spec

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
        if pid is None:
            resume = bool(runs.checkpoint_steps(run))
            pid = supervisor.start(home, run_id=run_id, spec=run.spec, token=tokens.run_token(run_id),
                                   server_url=settings.server_url(), resume=resume)
        run.launcher, run.launcher_handle = "local", str(pid)
        reason = "adopted the running supervisor" if adopted else "launched"
        runs.transition(session, run, RunStatus.starting, reason=reason, pid=pid, adopted=adopted)
        session.commit()
        return f"{'adopted' if adopted else 'launched'}: run {run_id} pid {pid}"


def _launch_slurm(session: Session, run: Run) -> str:
    """Submit the locked queued run as a Slurm job (``worker.launchers.slurm``), or adopt the job an earlier delivery
    submitted (found by name and home folder); the job id is the launcher handle. When Slurm refuses the job the
    run is ``failed`` with Slurm's own message and nothing is queued."""
    from worker.launchers import slurm

    spec = validate_spec("rl", run.spec)
    assert isinstance(spec, RLSpec)
    home = Path(run.run_dir).parent
    try:
        job = slurm.find(run.id, home, spec.launcher.slurm.allocation)
        adopted = job is not None
        if job is None:
            supervisor.write_spec(home, run.spec)
            env = supervisor.run_env(run.id, tokens.run_token(run.id), settings.server_url())
            job = slurm.submit(spec, run_id=run.id, home=home, env=env, resume=bool(runs.checkpoint_steps(run)))
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
    """Terminate the run's process group (not holding the row lock meanwhile), then mark it ``cancelled``."""
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
        supervisor.terminate(int(handle), grace_s=grace_s)
    with Session(engine) as session:
        run = runs.get(session, run_id, lock=True)
        if RunStatus(run.status) in TERMINAL:  # the supervisor reported its own end first
            return f"stopped: run {run_id} is {run.status}"
        if run.launcher_handle != handle:  # resumed meanwhile (a new launch): that one is not ours to cancel
            return f"stopped: run {run_id} was relaunched (handle {run.launcher_handle})"
        runs.transition(session, run, RunStatus.cancelled, reason="stopped", pid=handle)
        session.commit()
    return f"stopped: run {run_id}"


def _last_lines(path: Path, n: int) -> str:
    try:
        return "\n".join(runs.tail(path, n))
    except OSError:
        return ""


LIVE = (RunStatus.starting, RunStatus.running, RunStatus.paused)


def reconcile() -> list[int]:
    """Mark every starting/running/paused local run whose supervisor process is gone ``failed``, with the
    reason ``supervisor <pid> is gone`` and the last lines of its events and supervisor log. Idempotent (a
    failed run is no longer checked). Assumes the worker running it shares the machine (and /proc) with the
    supervisors, as the local launcher does. Returns the ids of the runs it failed.
    """
    with Session(engine) as session:
        candidates = session.exec(select(Run.id).where(col(Run.status).in_([s.value for s in LIVE]),
                                                       col(Run.launcher).in_(["local", "slurm"]))).all()
    failed = []
    for run_id in candidates:
        with Session(engine) as session:
            run = runs.get(session, run_id, lock=True)
            if RunStatus(run.status) in LIVE and run.launcher == "slurm" and run.launcher_handle:
                if _reconcile_slurm(session, run):
                    failed.append(run_id)
                continue
            if RunStatus(run.status) not in LIVE or not (run.launcher_handle or "").isdigit():
                continue
            pid, home = int(run.launcher_handle), Path(run.run_dir).parent
            if supervisor._alive(pid) or supervisor.running_pid(home) is not None:
                continue
            context = "\n".join(x for x in (_last_lines(Path(run.run_dir) / "events.jsonl", 3),
                                             _last_lines(home / "supervisor.log", 5)) if x)
            reason = f"supervisor {pid} is gone" + (f"; last lines:\n{context}" if context else "")
            runs.transition(session, run, RunStatus.failed, reason=reason[:2000], pid=pid, by="reconcile")
            session.commit()
            failed.append(run_id)
    return failed


def _reconcile_slurm(session: Session, run: Run) -> bool:
    """End a live Slurm run whose job has ended or is gone (``scontrol``/``squeue``; no accounting database):
    ``cancelled`` when the job was cancelled, else ``failed`` with the job state, Slurm's reason and the last lines
    of the job's log. Returns whether it ended the run. A worker without Slurm commands leaves it alone."""
    from worker.launchers import slurm

    try:
        job = slurm.state(run.launcher_handle or "")
    except slurm.SlurmError as err:
        logger.warning("reconcile: run %s: cannot ask Slurm (%s)", run.id, err)
        return False
    if job is not None and job.live:
        return False
    home = Path(run.run_dir).parent
    attempts = sorted((home / "slurm").glob("attempt-*/job.log"))
    context = "\n".join(x for x in (_last_lines(home / "supervisor.log", 5),
                                    _last_lines(attempts[-1], 3) if attempts else "") if x)
    what = "is gone" if job is None else f"ended {job.state} (reason {job.reason}, exit code {job.exit_code})"
    reason = f"Slurm job {run.launcher_handle} {what}" + (f"; last lines:\n{context}" if context else "")
    to = RunStatus.cancelled if job is not None and job.state == "CANCELLED" else RunStatus.failed
    runs.transition(session, run, to, reason=reason[:2000], job=run.launcher_handle, by="reconcile")
    session.commit()
    return True


@app.task(name="asyncrl.reconcile")
def reconcile_runs() -> list[int]:
    failed = reconcile()
    if failed:
        logger.warning("reconcile: marked runs %s failed (supervisor gone)", failed)
    return failed


@app.task(name="asyncrl.launch_run")
def launch_run(run_id: int) -> str:
    result = launch(run_id)
    logger.info(result)
    return result


@app.task(name="asyncrl.stop_run")
def stop_run(run_id: int) -> str:
    result = stop(run_id)
    logger.info(result)
    return result


@app.task(name="asyncrl.deliver_webhook", bind=True, max_retries=None)
def deliver_webhook(self, delivery_id: int) -> str:  # type: ignore[no-untyped-def]
    """One attempt of a webhook delivery (``server.alerts.webhooks.attempt``); a failed one is retried with
    exponential backoff (a new message with a countdown) until ``WEBHOOK_MAX_ATTEMPTS``."""
    from server.alerts import webhooks

    with Session(engine) as session:
        result, retry_in = webhooks.attempt(session, delivery_id)
    logger.info(result)
    if retry_in is not None:
        raise self.retry(countdown=retry_in)
    return result


@app.task(name="asyncrl.check_stalls")
def check_stalls() -> list[tuple[int, int]]:
    """Fire ``stall`` alert rules of running runs and re-enqueue lost webhook deliveries (Celery beat, every
    ``ALERT_STALL_CHECK_S``)."""
    from server.alerts import rules, webhooks

    with Session(engine) as session:
        fired = rules.check_stalls(session)
        webhooks.requeue_stuck(session)
        session.commit()
    return fired


def enqueue_launch(run_id: int) -> None:
    launch_run.delay(run_id)


def enqueue_stop(run_id: int) -> None:
    stop_run.delay(run_id)
