"""The compare page (``/compare?run=1&run=2``): the chosen runs' charts overlaid and the spec keys whose values
differ."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse

from server.models import stored_id
from server.services import runs
from webui import figures
from webui.errors import HTMLErrorRoute
from webui.page import SessionDep, page
from worker.dotted_keys import flatten

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)
MAX_COMPARE_RUNS = 8
"""The most (distinct) runs one compare page overlays: each brings its metric series and flattened spec."""


@router.get("/compare", response_class=HTMLResponse)
def compare(request: Request, db: SessionDep, run: Annotated[list[int] | None, Query()] = None) -> HTMLResponse:
    """Overlaid charts of the chosen runs and a table of the spec keys whose values differ."""
    p = page(request, db)
    p.need_user()
    ids = list(dict.fromkeys(run or []))
    if len(ids) > MAX_COMPARE_RUNS:
        raise HTTPException(422, f"run: compare takes at most {MAX_COMPARE_RUNS} runs, got {len(ids)}")
    chosen = [runs.get(db, i) for i in ids]
    recent, _ = runs.list_runs(db, limit=100)
    ctx: dict[str, Any] = {"recent": recent, "chosen": chosen, "chosen_ids": {r.id for r in chosen}}
    if len(chosen) >= 2:
        labelled = [(f"#{r.id} {r.name}", figures.load_series(db, stored_id(r))) for r in chosen]
        ctx["figures_json"] = figures.figures_json(figures.compare_figures(labelled))
        ctx["charts"] = list(figures.CHARTS)
        flat = [flatten({k: v for k, v in r.spec.items() if k != "output_dir"}) for r in chosen]
        keys = sorted(set().union(*flat))
        ctx["diff"] = [
            (k, [f.get(k, "—") for f in flat])
            for k in keys
            if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1
        ]
    return p.render("compare.html", **ctx)
