"""The pipelines pages: ``/pipelines`` (every pipeline) and ``/pipelines/{id}`` (its stages in order, each with the
stage it starts from, its status and its run linked; refreshed as an htmx fragment, ``?part=stages``, while the
pipeline runs), and its Stop and Resume forms (``POST /pipelines/{id}/stop`` and ``/resume``: the same services as
``POST /api/pipelines/{id}/stop`` and ``/resume``; a refused one shows its one-line error on the page). Over
``server/services/pipelines.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse

from server.models import Pipeline, PipelineStatus
from server.services import permissions, pipelines
from server.services.runs import InvalidTransition
from server.services.tokens import Principal
from webui.errors import HTMLErrorRoute, error_status
from webui.page import FormDep, Page, SessionDep, is_fragment, page

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)
STOP_POLLING = 286
"""htmx stops polling on this status (the pipeline is not running)."""
RESUMABLE = (PipelineStatus.failed, PipelineStatus.cancelled)
"""States from which ``pipelines.resume_by`` continues a pipeline (its Resume form is shown only then)."""


@router.get("/pipelines", response_class=HTMLResponse)
def pipelines_page(request: Request, db: SessionDep) -> HTMLResponse:
    p = page(request, db)
    p.need_user()
    rows, total = pipelines.list_pipelines(db, limit=200)
    return p.render("pipelines.html", pipelines=rows, total=total)


def _context(p: Page, pipeline: Pipeline) -> dict[str, Any]:
    """What the pipeline page shows: the pipeline (``pipelines.public``) and which of its write forms (Stop: running;
    Resume: failed or cancelled) the user may use (its owner or an admin, with a write token)."""
    view = pipelines.public(p.db, pipeline)
    status = PipelineStatus(view["status"])
    mine = p.user is not None and permissions.owns(p.user, pipeline.owner)
    return {
        "pipeline": view,
        "can_stop": mine and status == PipelineStatus.running,
        "can_resume": mine and status in RESUMABLE,
    }


@router.get("/pipelines/{pipeline_id}", response_class=HTMLResponse)
def pipeline_page(request: Request, db: SessionDep, pipeline_id: int, part: str = "") -> Response:
    p = page(request, db)
    p.need_user()
    ctx = _context(p, pipelines.get(db, pipeline_id))
    if part == "stages" and is_fragment(request):
        ended = ctx["pipeline"]["status"] != PipelineStatus.running
        return p.render("_pipeline_stages.html", code=STOP_POLLING if ended else 200, **ctx)
    return p.render("pipeline.html", **ctx)


def _act(p: Page, pipeline_id: int, action: Callable[[Principal], object]) -> Response:
    """Run a write ``action(user)`` and go back to the pipeline page; its one-line error (409: the pipeline's state
    does not allow it) is shown on that page; a refusal (``permissions``: 403) is an error page."""
    user = p.need_user()
    try:
        action(user)
    except InvalidTransition as err:
        p.db.rollback()
        ctx = _context(p, pipelines.get(p.db, pipeline_id))
        return p.render("pipeline.html", code=error_status(err)[0], error=str(err), **ctx)
    return p.redirect(f"/pipelines/{pipeline_id}")


@router.post("/pipelines/{pipeline_id}/stop")
def stop(request: Request, db: SessionDep, pipeline_id: int, form: FormDep) -> Response:
    """Stop the running pipeline (as ``POST /api/pipelines/{id}/stop``)."""
    p = page(request, db)
    p.form(form)
    return _act(p, pipeline_id, lambda user: pipelines.stop_by(db, pipeline_id, user, via="dashboard"))


@router.post("/pipelines/{pipeline_id}/resume")
def resume(request: Request, db: SessionDep, pipeline_id: int, form: FormDep) -> Response:
    """Resume the failed or cancelled pipeline (as ``POST /api/pipelines/{id}/resume``)."""
    p = page(request, db)
    p.form(form)
    return _act(p, pipeline_id, lambda user: pipelines.resume_by(db, pipeline_id, user))
