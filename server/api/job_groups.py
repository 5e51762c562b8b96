"""What the ``/api/sweeps`` and ``/api/pipelines`` routes share (``server/services/job_groups.py`` is the service
side): the summary row of a group's list, a page of them, and the answer of a submission (its first tick run, then
the group as the service shows it)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any

from fastapi import Query
from pydantic import BaseModel
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from server.models import stored_id

logger = logging.getLogger("asyncrl.api")

Offset = Annotated[int, Query(ge=0)]
"""The ``offset`` query parameter of a list route (default 0)."""
Limit = Annotated[int, Query(ge=1, le=500)]
"""The ``limit`` query parameter of a list route (default 50, at most 500)."""


class GroupSummary(BaseModel):
    """One sweep or pipeline of a list (each kind subclasses it under its own name)."""

    id: int
    name: str
    owner: str
    status: str
    created_at: datetime


def page(rows: list[Any], count: int, summary: type[GroupSummary]) -> dict[str, Any]:
    """A list route's answer ``{"data": [summary rows], "count": total}`` from ``rows`` (table rows) and ``count``."""
    return {"data": [summary.model_validate(r, from_attributes=True) for r in rows], "count": count}


def submitted(
    session: Session,
    group: Any,
    tick: Callable[[Session, int], list[str]],
    get: Callable[[Session, int], Any],
    public: Callable[[Session, Any], dict[str, Any]],
) -> dict[str, Any]:
    """A group just created (flushed) by its service: commit it, run its first ``tick`` (which starts its first runs),
    and return the group as ``public`` shows it, read again with ``get``."""
    session.commit()
    group_id = stored_id(group)
    try:
        tick(session, group_id)
    except OperationalError as err:  # stored: beat's next tick starts its first runs (never a "not stored" 503)
        session.rollback()
        logger.warning("%s %s stored; its first tick is left to beat: %s", type(group).__name__, group_id, err)
    return public(session, get(session, group_id))
