"""The pipelines pages: ``/pipelines`` (every pipeline) and ``/pipelines/{id}`` (its stages in order, each with the
stage it starts from, its status and its run linked; refreshed as an htmx fragment, ``?part=stages``, while the
pipeline runs). Over ``server/services/pipelines.py``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse

from server.models import PipelineStatus
from server.services import pipelines
from webui.errors import HTMLErrorRoute
from webui.page import SessionDep, is_fragment, page

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)
STOP_POLLING = 286
"""htmx stops polling on this status (the pipeline is not running)."""


@router.get("/pipelines", response_class=HTMLResponse)
def pipelines_page(request: Request, db: SessionDep) -> HTMLResponse:
    p = page(request, db)
    p.need_user()
    rows, total = pipelines.list_pipelines(db, limit=200)
    return p.render("pipelines.html", pipelines=rows, total=total)


@router.get("/pipelines/{pipeline_id}", response_class=HTMLResponse)
def pipeline_page(request: Request, db: SessionDep, pipeline_id: int, part: str = "") -> Response:
    p = page(request, db)
    p.need_user()
    view = pipelines.public(db, pipelines.get(db, pipeline_id))
    if part == "stages" and is_fragment(request):
        ended = view["status"] != PipelineStatus.running
        return p.render("_pipeline_stages.html", code=STOP_POLLING if ended else 200, pipeline=view)
    return p.render("pipeline.html", pipeline=view)
