"""The sweeps pages: ``/sweeps`` (every sweep) and ``/sweeps/{id}`` (its trials with their swept values, runs, status
and metric, the best so far, charts of the metric over the swept values and over steps with pruned trials marked;
refreshed as an htmx fragment, ``?part=trials``, until the sweep ends). Over ``server/services/sweeps.py``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse

from server.models import SweepStatus
from server.services import metrics, sweeps
from webui import figures
from webui.errors import HTMLErrorRoute
from webui.page import SessionDep, is_fragment, page

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)
STOP_POLLING = 286
"""htmx stops polling on this status (the sweep has ended)."""


@router.get("/sweeps", response_class=HTMLResponse)
def sweeps_page(request: Request, db: SessionDep) -> HTMLResponse:
    p = page(request, db)
    p.need_user()
    rows, total = sweeps.list_sweeps(db, limit=200)
    return p.render("sweeps.html", sweeps=rows, total=total)


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, db: SessionDep, sweep_id: int, part: str = "") -> Response:
    p = page(request, db)
    p.need_user()
    sweep = sweeps.get(db, sweep_id)
    view = sweeps.public(db, sweep)
    source, name = view["metric"].split("/", 1)
    curves = {}
    for t in view["trials"]:
        if t["run_id"] is not None:
            got = metrics.series_of(db, run_id=t["run_id"], keys=[(source, name)], max_points=figures.MAX_POINTS)
            if (source, name) in got:
                curves[t["index"]] = got[(source, name)]
    figs = figures.sweep_figures(view, curves)
    ctx: dict[str, Any] = {"sweep": view, "figures_json": figures.figures_json(figs), "chart_keys": list(figs)}
    if part == "trials" and is_fragment(request):
        ended = view["status"] != SweepStatus.running
        return p.render("_sweep_trials.html", code=STOP_POLLING if ended else 200, **ctx)
    return p.render("sweep.html", **ctx)
