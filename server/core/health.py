"""Whether this API process's database writes work: ``/healthz`` answers ``degraded`` (503) from a failed commit
(any ``OperationalError`` a request met: SQLite's disk full, Postgres gone) until a later commit that wrote rows
succeeds. The state is this process's own: each server process reports what it saw."""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

_lock = threading.Lock()
_failure: str | None = None


def failure() -> str | None:
    """The one-line reason of the last failed write, None while writes work."""
    return _failure


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
