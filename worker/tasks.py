"""Celery tasks: thin shells over ``launch`` and ``stop``, which are plain functions tested without Celery.

``launch(run_id)`` locks the run row and returns at once unless the run is ``queued`` with no launch recorded.
Otherwise it starts the run's supervisor (``worker.supervisor``: a detached process group that runs the local
launcher and reports status and metrics over HTTP with the run token) — or adopts the one a killed earlier
delivery already started, found by the supervisor's lock file — records its pid as the launcher handle, moves
the run to ``starting`` and commits. Enqueue a task only after the commit that created the row.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlmodel import Session

from server.core.config import settings
from server.core.db import engine
from server.models import TERMINAL, RunStatus
from server.services import runs, tokens
from worker import supervisor
from worker.celery_app import app

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
        home = Path(run.run_dir).parent
        pid = supervisor.running_pid(home)
        adopted = pid is not None
        if pid is None:
            pid = supervisor.start(home, run_id=run_id, spec=run.spec, token=tokens.run_token(run_id),
                                   server_url=settings.ASYNCRL_SERVER_URL)
        run.launcher, run.launcher_handle = "local", str(pid)
        reason = "adopted the running supervisor" if adopted else "launched"
        runs.transition(session, run, RunStatus.starting, reason=reason, pid=pid, adopted=adopted)
        session.commit()
        return f"{'adopted' if adopted else 'launched'}: run {run_id} pid {pid}"


def stop(run_id: int, grace_s: float = 30.0) -> str:
    """Terminate the run's process group (not holding the row lock meanwhile), then mark it ``cancelled``."""
    with Session(engine) as session:
        try:
            run = runs.get(session, run_id)
        except runs.RunNotFound:
            return f"skipped: run {run_id} does not exist"
        if RunStatus(run.status) in TERMINAL:
            return f"skipped: run {run_id} is {run.status}"
        handle = run.launcher_handle
        session.rollback()
    if handle:
        supervisor.terminate(int(handle), grace_s=grace_s)
    with Session(engine) as session:
        run = runs.get(session, run_id, lock=True)
        if RunStatus(run.status) in TERMINAL:  # the supervisor reported its own end first
            return f"stopped: run {run_id} is {run.status}"
        runs.transition(session, run, RunStatus.cancelled, reason="stopped", pid=handle)
        session.commit()
    return f"stopped: run {run_id}"


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


def enqueue_launch(run_id: int) -> None:
    launch_run.delay(run_id)


def enqueue_stop(run_id: int) -> None:
    stop_run.delay(run_id)
