"""The run page (``/runs/{id}``): status, charts with the bottleneck verdict, events, rollouts, logs and live
config, each a fragment htmx refreshes (``?part=…``), and its complete checkpoints; and its writes (stop, resume,
fork, live config change, export, delete), which call the same services as the REST API and show their one-line error on the page."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import ValidationError
from sqlmodel import Session

from server.models import TERMINAL, ForkRequest, Role, Run, RunStatus, stored_id
from server.services import config, exports, permissions, runs
from server.services.runs import InvalidTransition
from server.services.tokens import Principal
from webui import figures
from webui.errors import HTMLErrorRoute, error_status
from webui.page import FormDep, Page, SessionDep, page
from worker.celery_app import TaskName, enqueue
from worker.dotted_keys import flatten, replay
from worker.live_config import LIVE_KEYS, validate_changes
from worker.run_files import RunFileError, RunFileMissing
from worker.spec import SpecError, parse_override_value, parse_text

router = APIRouter(include_in_schema=False, route_class=HTMLErrorRoute)


def _events(db: Session, run_id: int, last: int = 100) -> list[Any]:
    _, total = runs.events(db, run_id, limit=1)
    rows, _ = runs.events(db, run_id, offset=max(0, total - last), limit=last)
    return rows[::-1]


def _logs(run: Run, process: str, lines: int = 40) -> tuple[list[str], str]:
    """The log's last ``lines`` lines and, when it cannot be shown, why (one line, no server path)."""
    try:
        return runs.read_log(run, process, lines), ""
    except RunFileMissing:
        return [], ""
    except RunFileError as err:
        return [], f"{process} log refused: {err}"


def _rollouts(run: Run) -> dict[str, Any]:
    try:
        shown = runs.rollouts(run, limit=16)
    except RunFileError as err:
        return {
            "rollout_step": None,
            "rollouts": [],
            "rollouts_skipped": 0,
            "rollouts_error": f"rollouts refused: {err}",
        }
    return {
        "rollout_step": shown.step,
        "rollouts": shown.records,
        "rollouts_skipped": shown.skipped,
        "rollouts_error": "",
    }


def _checkpoints(run: Run) -> dict[str, Any]:
    """The run's complete checkpoints (``exports.checkpoints``) and, when they cannot be listed, why (one line)."""
    try:
        return {"checkpoints": exports.checkpoints(run), "checkpoints_error": ""}
    except InvalidTransition as err:
        return {"checkpoints": [], "checkpoints_error": str(err)}


def run_context(
    db: Session, run: Run, user: Principal | None, process: str = "trainer", part: str = ""
) -> dict[str, Any]:
    """What the run page (``part`` empty) or one of its fragments shows to ``user``, computed once per request
    (``can_change``: whether it shows the write forms, ``permissions.may_change``)."""
    revisions, values = config.current(db, run)
    ctx: dict[str, Any] = {
        "run": run,
        "can_change": permissions.may_change(user, run),
        "live": RunStatus(run.status) not in TERMINAL,
        "values": values,
        "revisions": revisions,
        "live_keys": LIVE_KEYS,
        "process": process,
        "resumable": RunStatus(run.status) in runs.RESUMABLE,
        "charts": [*figures.CHARTS],
    }
    if part in ("", "charts"):
        marks = figures.revision_marks(revisions)
        envs = figures.env_names(run.spec)  # a mixture's charts split by environment
        series = figures.load_series(db, stored_id(run), envs=envs)
        bn = figures.bottleneck(series)
        figs = figures.run_figures(series, marks, envs)
        figs["bottleneck"] = figures.bottleneck_figure(bn, marks)
        ctx.update(figures_json=figures.figures_json(figs), bottleneck=bn)
    if part == "":
        ctx.update(_checkpoints(run))
    if part in ("", "events"):
        ctx["events"] = _events(db, stored_id(run))
    if part in ("", "rollouts"):
        ctx.update(_rollouts(run))
    if part in ("", "logs"):
        logs, logs_error = _logs(run, process)
        ctx.update(processes=runs.LOG_PROCESSES, logs=logs, logs_error=logs_error)
    return ctx


PARTS = {
    "status": "_run_status.html",
    "charts": "_run_charts.html",
    "events": "_run_events.html",
    "rollouts": "_run_rollouts.html",
    "logs": "_run_logs.html",
}


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, db: SessionDep, run_id: int, part: str = "", process: str = "trainer") -> HTMLResponse:
    """The run page, or one live fragment of it (``part``: status, charts, events, rollouts, logs)."""
    p = page(request, db)
    p.need_user()
    if process not in runs.LOG_PROCESSES:
        raise HTTPException(422, f"process: expected one of {', '.join(runs.LOG_PROCESSES)}, got {process!r}")
    if part and part not in PARTS:
        raise HTTPException(422, f"part: expected one of {', '.join(PARTS)}, got {part!r}")
    ctx = run_context(db, runs.get(db, run_id), p.user, process, part)
    return p.render(PARTS[part] if part else "run.html", **ctx)


def _act(p: Page, run_id: int, action: Callable[[Principal], str]) -> Response:
    """Run a write ``action(user)`` (it returns the page to go to); its one-line error (409/422) is shown on the
    run page; a refusal (``permissions``: 403) is an error page."""
    user = p.need_user()
    try:
        target = action(user)
    except (InvalidTransition, SpecError) as err:
        p.db.rollback()
        return p.render(
            "run.html", code=error_status(err)[0], error=str(err), **run_context(p.db, runs.get(p.db, run_id), user)
        )
    return p.redirect(target)


@router.post("/runs/{run_id}/stop")
def stop(request: Request, db: SessionDep, run_id: int, form: FormDep) -> Response:
    p = page(request, db)
    p.form(form)
    return _act(p, run_id, lambda user: f"/runs/{runs.stop_by(db, run_id, user).id}")


@router.post("/runs/{run_id}/resume")
def resume(request: Request, db: SessionDep, run_id: int, form: FormDep) -> Response:
    p = page(request, db)
    p.form(form)
    return _act(p, run_id, lambda user: f"/runs/{runs.resume_by(db, run_id, user).id}")


@router.post("/runs/{run_id}/export")
def export(request: Request, db: SessionDep, run_id: int, form: FormDep) -> Response:
    """Export a checkpoint (as ``POST /api/runs/{id}/exports``): ``step`` and ``adapter_only`` (a checkbox)."""
    p = page(request, db)
    p.form(form)

    def action(user: Principal) -> str:
        runs.get(db, run_id)
        step = str(form.get("step", "")).strip()
        if not (step.isascii() and step.isdigit()):
            raise SpecError(f"step: expected a checkpoint step (a whole number), got {step!r}")
        exports.request_export(db, run_id, user, step=int(step), adapter_only=form.get("adapter_only") == "1")
        return f"/runs/{run_id}"

    return _act(p, run_id, action)


@router.post("/runs/{run_id}/delete")
def delete(request: Request, db: SessionDep, run_id: int, form: FormDep) -> Response:
    """Delete an ended run (as ``DELETE /api/runs/{id}``) and go back to the runs list."""
    p = page(request, db)
    p.form(form)

    def action(user: Principal) -> str:
        runs.delete_by(db, run_id, user)
        return "/runs"

    return _act(p, run_id, action)


@router.post("/runs/{run_id}/fork")
def fork(request: Request, db: SessionDep, run_id: int, form: FormDep) -> Response:
    """Fork from a checkpoint; ``changes`` is TOML with dotted keys (``trainer.optim.lr = 5e-5``)."""
    p = page(request, db)
    p.form(form)

    def action(user: Principal) -> str:
        parent = runs.get(db, run_id)
        permissions.require_run(user, parent, "fork")
        try:
            changes = flatten(parse_text(str(form.get("changes", "")), "TOML", "changes"))
        except tomllib.TOMLDecodeError as err:
            raise SpecError(f"changes: not valid TOML ({err})") from None
        step, name = str(form.get("step", "")).strip(), str(form.get("name", "")).strip()
        if step and not (step.isascii() and step.isdigit()):  # "²".isdigit() is True, int("²") fails
            raise SpecError(f"step: expected a checkpoint step (a whole number), got {step!r}")
        try:
            body = ForkRequest(changes=changes, step=int(step) if step else None, name=name or None)
        except ValidationError as err:
            first = err.errors()[0]
            raise SpecError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None
        child = runs.fork(db, parent, body, owner=user.name, admin=user.role == Role.admin)
        db.commit()
        enqueue(TaskName.launch_run, stored_id(child))  # after the commit: the worker must find the queued run
        return f"/runs/{stored_id(child)}"

    return _act(p, run_id, action)


@router.post("/runs/{run_id}/config")
def change_config(request: Request, db: SessionDep, run_id: int, form: FormDep) -> Response:
    """Live config edit in two steps: the submitted values are validated and shown as a diff against the current
    values; the confirm form (``confirm=1``) applies them through the same service as ``PATCH …/config``."""
    p = page(request, db)
    p.form(form)
    user = p.need_user()
    run = runs.get(db, run_id)
    permissions.require_run(user, run, "config")
    revisions, current = config.current(db, run)
    changes = {}
    for key in LIVE_KEYS:
        raw = str(form.get(key, "")).strip()
        if raw:
            value = parse_override_value(raw)
            if value != current[key]:
                changes[key] = value
    ctx = run_context(db, run, user)
    if not changes:
        return p.render("run.html", code=422, error="config: no value differs from the current one", **ctx)
    spec = replay(run.spec, (rev.changes for rev in revisions))
    try:
        normalised = validate_changes(spec, changes)
        if form.get("confirm") == "1":
            config.create(db, run_id, normalised, by=user.name)
            db.commit()
            return p.redirect(f"/runs/{run_id}")
    except (SpecError, InvalidTransition) as err:
        db.rollback()
        key = str(err).split(":", 1)[0]
        return p.render("run.html", code=error_status(err)[0], config_error=(key, str(err)), submitted=changes, **ctx)
    diff = [(k, current[k], v) for k, v in normalised.items()]
    return p.render("run.html", diff=diff, **ctx)


# ----------------------------------------------------------------------------- compare
