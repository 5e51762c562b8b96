"""The lineage page (``/runs/{id}/lineage``): the fork tree that holds a run (``server.services.lineage``), each
fork with its checkpoint step, the changes it asked for and the keys that differ from its parent's config then."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from server.services import lineage, runs
from webui.errors import HTMLErrorRoute
from webui.page import SessionDep, page

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)


@router.get("/runs/{run_id}/lineage", response_class=HTMLResponse)
def lineage_page(request: Request, db: SessionDep, run_id: int) -> HTMLResponse:
    p = page(request, db)
    p.need_user()
    run = runs.get(db, run_id)
    return p.render("lineage.html", run=run, tree=lineage.lineage(db, run_id))
