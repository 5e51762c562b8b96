"""The runs list (``/runs``): every run with its status, age and newest reward, filtered by status and name; the
table refreshes as an htmx fragment."""

from __future__ import annotations

from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse

from server.models import RunStatus, stored_id
from server.services import metrics, runs
from webui.errors import HTMLErrorRoute
from webui.page import SessionDep, is_fragment, page

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)


@router.get("/runs", response_class=HTMLResponse)
def runs_page(request: Request, db: SessionDep, status: str = "", q: str = "") -> HTMLResponse:
    p = page(request, db)
    p.need_user()
    if status and status not in RunStatus.__members__:
        raise HTTPException(422, f"status: expected one of {', '.join(RunStatus)}, got {status!r}")
    rows, total = runs.list_runs(db, status=RunStatus(status) if status else None, name=q or None, limit=200)
    reward = metrics.latest(db, run_ids=[stored_id(r) for r in rows], source="orchestrator", name="reward_mean")
    query = urlencode({"status": status, "q": q})
    name = "_runs_table.html" if is_fragment(request) else "runs.html"
    return p.render(
        name, runs=rows, total=total, reward=reward, status=status, q=q, query=query, statuses=list(RunStatus)
    )
