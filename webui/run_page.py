"""The run page (``/runs/{id}``): status, charts with the bottleneck verdict, events, rollouts, logs and live
config, each a fragment htmx refreshes (``?part=…``), and its complete checkpoints with the eval jobs of them and
their chart; its writes (stop, resume, fork, live config change, export, evaluate, delete, tags/notes/group), which
call the same services as the REST API and show their one-line error on the page; and its metric download (CSV,
Parquet)."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import ValidationError
from sqlmodel import Session

from server.errors import nul_error
from server.jobs.celery_app import BrokerUnavailable
from server.models import TERMINAL, ForkRequest, Role, Run, RunStatus, RunUpdate, stored_id
from server.services import config, evals, exports, metric_export, metrics, permissions, pipelines, rollouts, runs
from server.services.runs import InvalidTransition
from server.services.tokens import Principal
from webui import figures
from webui.errors import HTMLErrorRoute, error_status
from webui.page import FormDep, Page, SessionDep, page
from worker.dotted_keys import flatten, replay
from worker.live_config import LIVE_KEYS, validate_changes
from worker.run.run_files import RunFileError, RunFileMissing
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
        shown = rollouts.rollouts(run, limit=16)
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


def _checkpoints(db: Session, run: Run) -> dict[str, Any]:
    """The run's complete checkpoints (``exports.checkpoints``) and, when they cannot be listed, why (one line); the
    eval jobs of its weights by step (``evals.evals_of``) and their chart (key ``checkpoint-evals``)."""
    points = evals.evals_of(db, run)
    by_step: dict[int | None, list[Any]] = {}
    for point in points:
        by_step.setdefault(point.step, []).append(point)
    shown = {
        "evals_by_step": by_step,
        "evaluable": run.kind in runs.TRAINING_KINDS,
        "evals_json": figures.figures_json({"checkpoint-evals": figures.checkpoint_evals_figure(points)}),
    }
    try:
        return {"checkpoints": exports.checkpoints(run), "checkpoints_error": "", **shown}
    except InvalidTransition as err:
        return {"checkpoints": [], "checkpoints_error": str(err), **shown}


def _pipeline(db: Session, run: Run) -> dict[str, Any] | None:
    """The pipeline that created ``run`` (``{"id", "name", "stage"}``), None for a run of no pipeline."""
    found = pipelines.of_run(db, stored_id(run))
    if found is None:
        return None
    try:
        return {"id": found[0], "name": pipelines.get(db, found[0]).name, "stage": found[1]}
    except pipelines.PipelineNotFound:
        return None


def _has_checkpoint(run: Run) -> bool:
    """Whether the run has a complete checkpoint to resume from (one refused: no, the resume would be refused too)."""
    try:
        return bool(runs.checkpoint_steps(run))
    except InvalidTransition:
        return False


def run_context(
    db: Session, run: Run, user: Principal | None, process: str = "trainer", part: str = ""
) -> dict[str, Any]:
    """What the run page (``part`` empty) or one of its fragments shows to ``user``, computed once per request
    (``can_change``: whether it shows the write forms, ``permissions.may_change``)."""
    revisions, values = config.current(db, run)
    checkpointed = RunStatus(run.status) in runs.RESUMABLE and _has_checkpoint(run)  # resume is offered
    ctx: dict[str, Any] = {
        "run": run,
        "can_change": permissions.may_change(user, run),
        "live": RunStatus(run.status) not in TERMINAL,
        "values": values,
        "in_effect": config.in_effect(db, run),  # acknowledged revisions only: a pending one is not in effect
        "revisions": revisions,
        "revision_states": {rev.revision: config.state(rev, run) for rev in revisions},
        "live_keys": LIVE_KEYS,
        "process": process,
        "resumable": RunStatus(run.status) in runs.RESUMABLE and checkpointed,
        "no_checkpoint": RunStatus(run.status) in runs.RESUMABLE and not checkpointed,
        "charts": [*figures.CHARTS],
    }
    if part == "":
        ctx["pipeline"] = _pipeline(db, run)
    if part in ("", "status"):
        ctx["progress"] = metrics.progress(db, run)
    if part in ("", "charts"):
        marks = figures.revision_marks(revisions)
        envs = figures.env_names(run.spec)  # a mixture's charts split by environment
        series = figures.load_series(db, stored_id(run), envs=envs)
        bn = figures.bottleneck(series)
        figs = figures.run_figures(series, marks, envs)
        figs["bottleneck"] = figures.bottleneck_figure(bn, marks)
        ctx.update(figures_json=figures.figures_json(figs), bottleneck=bn)
    if part == "":
        ctx.update(_checkpoints(db, run))
    if part in ("", "events"):
        ctx["events"] = _events(db, stored_id(run))
    if part in ("", "rollouts"):
        ctx.update(_rollouts(run))
    if part in ("", "logs"):
        logs, logs_error = _logs(run, process)
        ctx.update(processes=runs.log_processes(run), logs=logs, logs_error=logs_error)
    return ctx


PARTS = {
    "status": "_run_status.html",
    "charts": "_run_charts.html",
    "events": "_run_events.html",
    "rollouts": "_run_rollouts.html",
    "logs": "_run_logs.html",
}


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, db: SessionDep, run_id: int, part: str = "", process: str | None = None) -> HTMLResponse:
    """The run page, or one live fragment of it (``part``: status, charts, events, rollouts, logs). The log panel
    shows ``process``; unset, the process a failed run's reason names (``runs.failed_process``), else the trainer (an
    eval job's: ``eval``)."""
    p = page(request, db)
    p.need_user()
    if process is not None and not runs.is_log_process(process):
        raise HTTPException(422, f"process: expected {runs.LOG_PROCESS_RULE}, got {process!r}")
    if part and part not in PARTS:
        raise HTTPException(422, f"part: expected one of {', '.join(PARTS)}, got {part!r}")
    run = runs.get(db, run_id)
    default = "eval" if run.kind == "eval" else "trainer"  # an eval job's one process
    ctx = run_context(db, run, p.user, process or runs.failed_process(run) or default, part)
    return p.render(PARTS[part] if part else "run.html", **ctx)


def _act(p: Page, run_id: int, action: Callable[[Principal], str]) -> Response:
    """Run a write ``action(user)`` (it returns the page to go to); its one-line error (409/422, 503 when the broker
    did not take a launch) is shown on the run page; a refusal (``permissions``: 403) is an error page."""
    user = p.need_user()
    try:
        target = action(user)
    except (InvalidTransition, SpecError, BrokerUnavailable) as err:
        p.db.rollback()
        return p.render(
            "run.html", code=error_status(err)[0], error=str(err), **run_context(p.db, runs.get(p.db, run_id), user)
        )
    return p.redirect(target)


@router.post("/runs/{run_id}/stop")
def stop(request: Request, db: SessionDep, run_id: int, form: FormDep) -> Response:
    p = page(request, db)
    p.form(form)
    return _act(p, run_id, lambda user: f"/runs/{runs.stop_by(db, run_id, user, via='dashboard').id}")


@router.post("/runs/{run_id}/resume")
def resume(request: Request, db: SessionDep, run_id: int, form: FormDep) -> Response:
    p = page(request, db)
    p.form(form)
    return _act(p, run_id, lambda user: f"/runs/{runs.resume_by(db, run_id, user).id}")


def _form_step(form: Any) -> int:
    """The form's checkpoint ``step``; raises SpecError (one line naming ``step``) unless it is a whole number."""
    step = str(form.get("step", "")).strip()
    if not (step.isascii() and step.isdigit()):
        raise SpecError(f"step: expected a checkpoint step (a whole number), got {step!r}")
    return int(step)


@router.post("/runs/{run_id}/export")
def export(request: Request, db: SessionDep, run_id: int, form: FormDep) -> Response:
    """Export a checkpoint (as ``POST /api/runs/{id}/exports``): ``step`` and ``adapter_only`` (a checkbox)."""
    p = page(request, db)
    p.form(form)

    def action(user: Principal) -> str:
        runs.get(db, run_id)
        step = _form_step(form)
        exports.request_export(db, run_id, user, step=step, adapter_only=form.get("adapter_only") == "1")
        return f"/runs/{run_id}"

    return _act(p, run_id, action)


@router.post("/runs/{run_id}/evaluate")
def evaluate(request: Request, db: SessionDep, run_id: int, form: FormDep) -> Response:
    """Evaluate a checkpoint in one click (as ``POST /api/runs/{id}/evals``): ``step``; back to this run's page, whose
    checkpoint row links the queued eval run."""
    p = page(request, db)
    p.form(form)

    def action(user: Principal) -> str:
        runs.get(db, run_id)
        evals.evaluate_checkpoint(db, run_id, user, step=_form_step(form))
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
        if (nul := nul_error(changes, "changes")) is not None:
            raise SpecError(nul)
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
        runs.enqueue_launch(db, stored_id(child))  # after the commit: the worker must find the queued run
        return f"/runs/{stored_id(child)}"

    return _act(p, run_id, action)


@router.post("/runs/{run_id}/annotate")
def annotate(request: Request, db: SessionDep, run_id: int, form: FormDep) -> Response:
    """Set the run's tags (comma-separated), group and notes (as ``PATCH /api/runs/{id}``); a bad value is shown on
    the run page, nothing changed."""
    p = page(request, db)
    p.form(form)

    def action(user: Principal) -> str:
        tags = [t for t in str(form.get("tags", "")).split(",") if t.strip()]
        try:
            change = RunUpdate(tags=tags, notes=str(form.get("notes", "")), group=str(form.get("group", "")))
        except ValidationError as err:
            first = err.errors()[0]
            msg = str(first["msg"]).removeprefix("Value error, ")
            raise SpecError(msg if ":" in msg else f"{'.'.join(str(x) for x in first['loc'])}: {msg}") from None
        runs.update_by(db, run_id, user, change)
        return f"/runs/{run_id}"

    return _act(p, run_id, action)


@router.get("/runs/{run_id}/metrics.{fmt}")
def download_metrics(request: Request, db: SessionDep, run_id: int, fmt: str) -> Response:
    """Every stored point of the run as a CSV or Parquet file (``fmt``), as ``GET /api/runs/{id}/metrics/export``."""
    page(request, db).need_user()
    return metric_file(db, [stored_id(runs.get(db, run_id))], fmt)


def metric_file(db: Session, run_ids: list[int], fmt: str) -> Response:
    """The download of ``metric_export.export`` of ``run_ids`` in ``fmt`` (``csv`` | ``parquet``; else 422)."""
    if fmt not in metric_export.MEDIA_TYPES:
        raise HTTPException(422, f"format: expected csv or parquet, got {fmt!r}")
    kind: metric_export.ExportFormat = "csv" if fmt == "csv" else "parquet"
    body = metric_export.export(db, run_ids=run_ids, fmt=kind)
    disposition = f'attachment; filename="{metric_export.filename(run_ids, kind)}"'
    return Response(body, media_type=metric_export.MEDIA_TYPES[kind], headers={"Content-Disposition": disposition})


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
