"""The compare page (``/compare?run=1&run=2``): the chosen runs' charts overlaid and the spec keys whose values
differ (the config in effect: live changes included), and their metrics as one CSV or Parquet download."""

from __future__ import annotations

import json
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, Response

from server.models import stored_id
from server.services import runs
from webui import figures
from webui.errors import HTMLErrorRoute
from webui.page import SessionDep, page
from webui.run_page import metric_file
from worker.dotted_keys import flatten

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)
MAX_COMPARE_RUNS = 8
"""The most (distinct) runs one compare page overlays: each brings its metric series and flattened spec."""


@router.get("/compare/metrics.{fmt}")
def download_compared(
    request: Request, db: SessionDep, fmt: str, run: Annotated[list[int] | None, Query()] = None
) -> Response:
    """The chosen runs' stored points in one CSV or Parquet file (``fmt``), as ``GET /api/metrics/export``."""
    page(request, db).need_user()
    ids = list(dict.fromkeys(run or []))
    if not ids or len(ids) > MAX_COMPARE_RUNS:
        raise HTTPException(422, f"run: compare takes 1 to {MAX_COMPARE_RUNS} runs, got {len(ids)}")
    return metric_file(db, [stored_id(runs.get(db, i)) for i in ids], fmt)


@router.get("/compare", response_class=HTMLResponse)
def compare(request: Request, db: SessionDep, run: Annotated[list[int] | None, Query()] = None) -> HTMLResponse:
    """Overlaid charts of the chosen runs and a table of the config keys whose values differ, as in effect at each
    run's end (``runs.spec_in_effect``: its spec with the live revisions its processes applied)."""
    p = page(request, db)
    p.need_user()
    ids = list(dict.fromkeys(run or []))
    if len(ids) > MAX_COMPARE_RUNS:
        raise HTTPException(422, f"run: compare takes at most {MAX_COMPARE_RUNS} runs, got {len(ids)}")
    chosen = [runs.get(db, i) for i in ids]
    recent, _ = runs.list_runs(db, limit=100)
    ctx: dict[str, Any] = {"recent": recent, "chosen": chosen, "chosen_ids": {r.id for r in chosen}}
    ctx["export_query"] = urlencode([("run", i) for i in ids])
    if len(chosen) >= 2:
        labelled = [(f"#{r.id} {r.name}", figures.load_series(db, stored_id(r))) for r in chosen]
        ctx["figures_json"] = figures.figures_json(figures.compare_figures(labelled))
        ctx["charts"] = list(figures.CHARTS)
        # the config each run trained with: live changes it took up included, one it ended before applying not
        effective = [runs.spec_in_effect(db, r) for r in chosen]
        flat = [flatten({k: v for k, v in spec.items() if k != "output_dir"}) for spec in effective]
        keys = sorted(set().union(*flat))
        ctx["diff"] = [
            (k, [f.get(k, "—") for f in flat])
            for k in keys
            if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1
        ]
    return p.render("compare.html", **ctx)
