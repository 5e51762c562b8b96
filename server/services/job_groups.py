"""Job groups: the runs the service starts for one submission and advances by a tick, a sweep's trials
(``server/services/sweeps.py``) or a pipeline's stages (``server/services/pipelines.py``).

What both kinds share lives here: finding one group (locked for a tick or a stop) or a page of them, the ids of the
running ones, its member rows (trials, stages) in order, the run behind a member, whether the owner is an admin (the
member runs are created as the owner), and stopping a group's live runs through the normal stop path. Each kind keeps
its own spec, states and tick.
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import func
from sqlmodel import Session, SQLModel, col, select

from server.core.db import hold_write_lock
from server.models import TERMINAL, Pipeline, PipelineStage, Role, Run, RunStatus, Sweep, SweepTrial, stored_id
from server.services import runs, tokens

Group = TypeVar("Group", Sweep, Pipeline)
Member = TypeVar("Member", SweepTrial, PipelineStage)


def get(
    session: Session, model: type[Group], group_id: int, *, lock: bool, missing: type[LookupError], what: str
) -> Group:
    """The group ``group_id`` of table ``model`` (``lock``: ``SELECT ... FOR UPDATE``; SQLite, which has no row locks:
    the database's write lock, ``server.core.db.hold_write_lock``; either until the transaction ends, so that two ticks
    of one group, the submit's and beat's, run one after the other).

    Raises:
        missing: no such group (``"<what> <id> not found"``; an id outside ``1..runs.MAX_ID`` is looked up in no
            table).
    """
    if not 1 <= group_id <= runs.MAX_ID:
        raise missing(f"{what} {group_id} not found")
    stmt = select(model).where(model.id == group_id)
    if lock:
        stmt = stmt.with_for_update()
        hold_write_lock(session)
    group = session.exec(stmt).first()
    if group is None:
        raise missing(f"{what} {group_id} not found")
    return group


def members(session: Session, model: type[Member], group_id: int) -> list[Member]:
    """The member rows of group ``group_id`` (a sweep's trials, a pipeline's stages), by ``index``."""
    of_group = SweepTrial.sweep_id if model is SweepTrial else PipelineStage.pipeline_id
    stmt = select(model).where(of_group == group_id).order_by(col(model.index))
    return list(session.exec(stmt).all())


def page(session: Session, model: type[Group], *, offset: int, limit: int) -> tuple[list[Group], int]:
    """Groups of table ``model``, newest first: ``limit`` of them from ``offset``, and how many there are."""
    total = session.exec(select(func.count()).select_from(model)).one()
    rows = session.exec(select(model).order_by(col(model.id).desc()).offset(offset).limit(limit)).all()
    return list(rows), int(total)


def running_ids(session: Session, model: type[Group], running: Any) -> list[int]:
    """Ids of the groups of table ``model`` in status ``running`` (the ones a tick advances)."""
    return [i for i in session.exec(select(model.id).where(model.status == running)).all() if i is not None]


def run_of(session: Session, member: SweepTrial | PipelineStage) -> Run | None:
    """The run of a trial or stage (None: no run yet, or it was deleted)."""
    return session.get(Run, member.run_id) if member.run_id is not None else None


def owner_is_admin(session: Session, owner: str) -> bool:
    """Whether the group's owner is an admin now (the member runs are created with the owner's rights)."""
    user = tokens.user(session, owner)
    return user is not None and user.role == Role.admin


def request_stops(session: Session, live: list[Run], *, by: str) -> list[int]:
    """Ask each run of ``live`` that has not ended to stop through the normal stop path (``runs.request_stop``,
    locked; ``by`` names who); returns the ids whose ``stop_run`` task the caller enqueues once committed. A run that never launched is cancelled at once and needs none."""
    stops = []
    for run in live:
        if RunStatus(run.status) not in TERMINAL and runs.request_stop(
            session, runs.get(session, stored_id(run), lock=True), by=by
        ):
            stops.append(stored_id(run))
    return stops


def summary_fields(group: SQLModel) -> dict[str, Any]:
    """The fields every group's public view starts with: id, name, owner, status and its reason, the spec, and the
    creation and end times."""
    return {
        key: getattr(group, key)
        for key in ("id", "name", "owner", "status", "status_reason", "spec", "created_at", "finished_at")
    }
