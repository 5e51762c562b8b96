"""The runs list (``/runs``): every run with its status, age, newest reward, duration, pace, best eval reward and a
reward sparkline, filtered by status, name, a tag and a group, with the columns the user chose
(``webui/run_columns.py``); the table refreshes as an htmx fragment."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse

from server.models import MAX_GROUP_LEN, MAX_TAG_LEN, RunStatus, check_label, stored_id, utcnow
from server.services import metrics, run_summary, runs
from webui import run_columns
from webui.errors import HTMLErrorRoute
from webui.page import SessionDep, is_fragment, page

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)


@router.get("/runs", response_class=HTMLResponse)
def runs_page(
    request: Request,
    db: SessionDep,
    status: str = "",
    q: str = "",
    tag: str = "",
    group: str = "",
    col: Annotated[list[str] | None, Query()] = None,
) -> HTMLResponse:
    """The runs table; ``tag`` (one tag, exact) and ``group`` (exact) filter as ``GET /api/runs`` does; ``col``
    (repeatable): the columns to show (``run_columns.COLUMNS`` keys; none: all)."""
    col = col or []
    p = page(request, db)
    p.need_user()
    if status and status not in RunStatus.__members__:
        raise HTTPException(422, f"status: expected one of {', '.join(RunStatus)}, got {status!r}")
    try:
        tags = [check_label(tag, "tag", MAX_TAG_LEN)] if tag.strip() else []
        group = check_label(group, "group", MAX_GROUP_LEN) if group.strip() else ""
    except ValueError as err:
        raise HTTPException(422, str(err)) from None
    cols = run_columns.chosen(col)
    rows, total = runs.list_runs(
        db, status=RunStatus(status) if status else None, name=q or None, tags=tags, group=group or None, limit=200
    )
    ids = [stored_id(r) for r in rows]
    reward = metrics.latest(db, run_ids=ids, source="orchestrator", name="reward_mean")
    summary = run_summary.summaries(db, ids)
    now = utcnow()
    durations = {stored_id(r): (r.finished_at or now) - r.started_at for r in rows if r.started_at is not None}
    query = urlencode([("status", status), ("q", q), ("tag", tag), ("group", group), *(("col", c) for c in col)])
    name = "_runs_table.html" if is_fragment(request) else "runs.html"
    return p.render(
        name,
        runs=rows,
        total=total,
        reward=reward,
        summary=summary,
        durations={k: v.total_seconds() for k, v in durations.items()},
        sparkline=run_columns.sparkline,
        spark_size=(run_columns.SPARK_W, run_columns.SPARK_H),
        cols=cols,
        col_given=col,
        columns=run_columns.COLUMNS,
        always=run_columns.ALWAYS,
        status=status,
        q=q,
        tag=tag,
        group=group,
        query=query,
        statuses=list(RunStatus),
    )
