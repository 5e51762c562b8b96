"""The rollout browser pages, over ``server/services/rollouts.py``:

- ``/runs/{id}/rollouts``: the run's rollouts by step, group, environment and policy version, with reward and
  advantage, filterable (and by task key) and paged; the table is an htmx fragment (``?part=table``).
- ``/runs/{id}/rollouts/{rid}``: one rollout's tokens: sampled tokens with their log-probs (and entropy where
  recorded), environment/tool turns marked as masked, truncation marked.
- ``/rollouts/compare?task=…&a=…&b=…``: the same task's rollouts in two runs side by side.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse

from server.services import rollouts, runs
from webui.errors import HTMLErrorRoute
from webui.page import SessionDep, is_fragment, page
from worker.run.run_files import RunFileError

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)
PAGE_SIZE = 50


def _whole(name: str, raw: str) -> int | None:
    """A form field that is empty (None) or a whole number."""
    raw = raw.strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
        raise HTTPException(422, f"{name}: expected a whole number, got {raw[:40]!r}")
    return int(raw)


@router.get("/runs/{run_id}/rollouts", response_class=HTMLResponse)
def rollouts_page(
    request: Request,
    db: SessionDep,
    run_id: int,
    step: str = "",
    group: str = "",
    env: str = Query("", max_length=200),
    policy_version: str = "",
    task: str = Query("", max_length=500),
    offset: int = Query(0, ge=0, le=2**31),
    part: str = "",
) -> HTMLResponse:
    """The run's rollouts, filtered (empty field: any) and paged ``PAGE_SIZE`` at a time."""
    p = page(request, db)
    p.need_user()
    run = runs.get(db, run_id)
    filters = rollouts.Filters(
        step=_whole("step", step),
        group=_whole("group", group),
        env=env.strip() or None,
        policy_version=_whole("policy_version", policy_version),
        task=task.strip() or None,
    )
    query = {"step": step, "group": group, "env": env, "policy_version": policy_version, "task": task}
    try:
        shown = rollouts.browse(run, filters, offset=offset, limit=PAGE_SIZE)
        refused = ""
    except RunFileError as err:
        shown, refused = rollouts.BrowsePage(total=0, offset=0, items=[], steps=[]), f"rollouts refused: {err}"
    ctx: dict[str, Any] = {
        "run": run,
        "shown": shown,
        "refused": refused,
        "filters": query,
        "query": urlencode({k: v for k, v in query.items() if v}),
        "page_size": PAGE_SIZE,
    }
    if part == "table" and is_fragment(request):
        return p.render("_rollouts_table.html", **ctx)
    return p.render("rollouts.html", **ctx)


@router.get("/runs/{run_id}/rollouts/{rid}", response_class=HTMLResponse)
def rollout_page(request: Request, db: SessionDep, run_id: int, rid: str) -> HTMLResponse:
    """One rollout's token view (404 for an id of another run, 422 for a malformed one)."""
    p = page(request, db)
    p.need_user()
    run = runs.get(db, run_id)
    try:
        view = rollouts.rollout(run, rid, tokenizer=rollouts.run_tokenizer(run))
    except RunFileError as err:
        raise HTTPException(403, f"rid: run {run_id}'s rollouts are refused: {err}") from None
    return p.render("rollout.html", run=run, view=view)


@router.get("/rollouts/compare", response_class=HTMLResponse)
def compare_page(
    request: Request,
    db: SessionDep,
    task: str = Query("", max_length=500),
    a: str = "",
    b: str = "",
) -> HTMLResponse:
    """The rollouts of task ``task`` in runs ``a`` and ``b`` side by side (a form until all three are given)."""
    p = page(request, db)
    p.need_user()
    ids = [_whole("a", a), _whole("b", b)]
    sides: list[dict[str, Any]] = []
    if task.strip() and all(i is not None for i in ids):
        for i in ids:
            assert i is not None
            run = runs.get(db, i)
            try:
                items, refused = rollouts.same_task(run, task.strip()), ""
            except RunFileError as err:
                items, refused = [], f"rollouts refused: {err}"
            sides.append({"run": run, "rows": items, "refused": refused})
    return p.render("rollouts_compare.html", task=task.strip(), a=a, b=b, sides=sides)
