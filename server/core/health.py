"""What ``/healthz`` answers (:func:`report`): the database, the job broker and whether a worker answered lately.

- database: this API process's writes work. From a failed commit (any ``OperationalError`` a request met: SQLite's
  disk full, Postgres gone) until a later commit that wrote rows succeeds, it is ``degraded`` (503). The state is
  this process's own: each server process reports what it saw.
- broker: Redis or the embedded broker answers (``server/jobs/heartbeat.py``); when not, ``degraded`` (503): a
  submit would fail.
- worker: a worker on the control-plane queue beat within ``3 * WORKER_HEARTBEAT_S``; when not, ``degraded`` but
  200: this server still stores what it is sent, and queued tasks run once a worker starts (the compose stack and
  ``asyncrl demo`` start the worker after the server is healthy).

``reason`` is the first problem in that order, one line.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from server.jobs import heartbeat

_lock = threading.Lock()
_failure: str | None = None


def failure() -> str | None:
    """The one-line reason of the last failed write, None while writes work."""
    return _failure


def report(database: str) -> tuple[int, dict[str, str]]:
    """The status code and body of ``/healthz`` for a database of dialect ``database`` that just answered, e.g.
    ``(200, {"status": "ok", "database": "postgresql", "broker": "redis", "worker": "ok"})``; a ``reason`` is
    added when ``status`` is ``degraded``."""
    probe = heartbeat.probe()
    worker = {True: "ok", False: "missing", None: "unknown"}[probe.worker]
    body = {"status": "ok", "database": database, "broker": probe.broker, "worker": worker}
    if (reason := failure()) is not None:
        return 503, {**body, "status": "degraded", "reason": reason}
    if probe.broker_problem is not None:
        return 503, {**body, "status": "degraded", "reason": f"broker: {probe.broker_problem}"}
    if not probe.worker:
        return 200, {**body, "status": "degraded", "reason": f"worker: no worker answered in {heartbeat.stale_s():g} s"}
    return 200, body


def write_failed(reason: str) -> None:
    global _failure
    with _lock:
        _failure = reason


@event.listens_for(Session, "after_flush")
def _wrote(session: Session, _ctx: Any) -> None:
    session.info["wrote"] = True


@event.listens_for(Session, "after_commit")
def _committed(session: Session) -> None:
    global _failure
    if session.info.pop("wrote", False) and _failure is not None:
        with _lock:
            _failure = None


@event.listens_for(Session, "after_rollback")
def _rolled_back(session: Session) -> None:
    session.info.pop("wrote", None)
