"""``/api/runs``: submit, list, show, stop, resume, fork, delete, status reports, events and logs."""

from __future__ import annotations

import json
import logging
import tomllib
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from pydantic import BaseModel, Field

from server.api.deps import PrincipalDep, SessionDep, UserDep
from server.errors import is_json_type
from server.models import (
    TERMINAL,
    EngineEvents,
    ForkRequest,
    Role,
    RunEventsPublic,
    RunLogs,
    RunPublic,
    RunsPublic,
    RunStatus,
    StatusReport,
    stored_id,
)
from server.services import permissions, runs
from worker.celery_app import TaskName, enqueue
from worker.run_files import RunFileError, RunFileMissing
from worker.spec import parse_text

logger = logging.getLogger("asyncrl.api")
router = APIRouter(prefix="/runs", tags=["runs"])

_SPEC_EXAMPLE = {
    "name": "reverse-text-rl",
    "max_steps": 20,
    "model": {"name": "outputs/reverse-text-sft/final"},
    "orchestrator": {"batch_size": 8, "group_size": 8, "max_tokens": 48, "seq_len": 256},
    "inference": {"max_model_len": 256},
    "trainer": {"optim": {"lr": 1e-4}},
}
_SUBMIT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"type": "object"}, "example": _SPEC_EXAMPLE},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "run spec, .toml or .json"}
                    },
                }
            },
        },
    }
}


async def _spec_from_request(request: Request) -> dict[str, Any]:
    """The submitted spec, read on the event loop (``SubmittedSpec``): the route that takes it is a plain ``def``
    (run in the thread pool), since its database calls, a lock wait included, must not block the event loop."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        form = await request.form()
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise HTTPException(422, "file: upload the spec as a form field named 'file' (.toml or .json)")
        raw, filename = await upload.read(), upload.filename or "spec.toml"
        fmt: Literal["JSON", "TOML"] = "JSON" if filename.endswith(".json") else "TOML"
        try:
            data = parse_text(raw.decode(), fmt, "file")  # SpecError (nested too deep) -> 422
        except (UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
            raise HTTPException(400, f"file: {filename} is not valid {fmt}: {err}") from None
    elif is_json_type(ctype):
        raw = await request.body()
        if not raw.strip():
            raise HTTPException(400, "body: empty: send a JSON object (the run spec)")
        try:
            data = parse_text(raw, "JSON", "body")
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise HTTPException(400, f"body: not valid JSON ({err})") from None
    else:
        shown = ctype.split(";")[0].strip()
        raise HTTPException(415, f"content-type {shown!r}: send application/json or a multipart/form-data 'file'")
    if not isinstance(data, dict):
        raise HTTPException(422, f"body: expected a JSON object (the run spec), got {type(data).__name__}")
    return data


SubmittedSpec = Annotated[dict[str, Any], Depends(_spec_from_request)]


@router.post(
    "",
    status_code=201,
    response_model=RunPublic,
    openapi_extra=_SUBMIT_BODY,
    responses={
        400: {"description": "body empty or does not parse"},
        415: {"description": "not JSON or a multipart file"},
        422: {"description": "invalid spec"},
    },
)
def create_run(session: SessionDep, user: UserDep, data: SubmittedSpec) -> Any:
    """Submit a run spec (JSON body or a TOML/JSON file upload); the run is queued and launched by a worker."""
    run = runs.create(session, data=data, owner=user.name, admin=user.role == Role.admin)  # SpecError: 422
    session.commit()
    enqueue(TaskName.launch_run, stored_id(run))  # only after the commit: the worker must find the row
    return run


@router.get("", response_model=RunsPublic)
def list_runs(
    session: SessionDep,
    _user: UserDep,
    status: RunStatus | None = None,
    name: str | None = Query(None, max_length=128, description="substring of the run name"),
    offset: int = Query(0, ge=0),
    limit: int = Query(50, ge=1, le=500),
) -> Any:
    data, count = runs.list_runs(session, status=status, name=name, offset=offset, limit=limit)
    return RunsPublic(data=[RunPublic.model_validate(r) for r in data], count=count)


@router.get("/{run_id}", response_model=RunPublic)
def get_run(run_id: int, session: SessionDep, principal: PrincipalDep) -> Any:
    permissions.check_run_access(principal, run_id)
    return runs.get(session, run_id)


@router.post("/{run_id}/stop", response_model=RunPublic)
def stop_run(run_id: int, session: SessionDep, user: UserDep) -> Any:
    """Cancel a queued run at once, or ask the worker to stop a launched one (status becomes ``cancelled``)."""
    run = runs.stop_by(session, run_id, user)
    session.refresh(run)
    return run


@router.delete("/{run_id}", status_code=204, responses={409: {"description": "the run has not ended"}})
def delete_run(run_id: int, session: SessionDep, user: UserDep) -> Response:
    """Delete an ended run (its owner or an admin) with its events, metrics, config revisions and alert rules; its
    run directory stays on disk."""
    runs.delete_by(session, run_id, user)
    return Response(status_code=204)


@router.post("/{run_id}/status", response_model=RunPublic)
def report_status(run_id: int, report: StatusReport, session: SessionDep, principal: PrincipalDep) -> Any:
    """A status change reported by the run's supervisor (run token, while the run is live) or its owner or an admin.
    The run token's repeat of the final status it already reported is answered as before (nothing is written): a
    supervisor whose report was taken but whose answer was lost retries it."""
    permissions.check_run_access(principal, run_id)
    run = runs.get(session, run_id, lock=True)
    if principal.run_id is not None and report.status == run.status:
        return run
    permissions.require_run(principal, run, "status")
    runs.transition(session, run, report.status, reason=report.reason, by=principal.name)
    session.commit()
    if report.status in TERMINAL:  # its slot is free: runs waiting for one may start
        enqueue(TaskName.start_waiting)
    session.refresh(run)
    return run


class RequeueReport(BaseModel):
    """Sent by the supervisor of a requeued Slurm job when its new attempt starts."""

    restarts: int = Field(ge=1, le=10_000)
    resume_step: int | None = Field(None, ge=0, le=2**62)
    job: str = Field(min_length=1, max_length=64)


@router.post("/{run_id}/requeued", response_model=RunPublic, responses={409: {"description": "the run has ended"}})
def report_requeued(run_id: int, report: RequeueReport, session: SessionDep, principal: PrincipalDep) -> Any:
    """A requeued Slurm job of the run started again: a ``requeued`` event; metrics after the resume step go."""
    permissions.check_run_access(principal, run_id)
    run = runs.get(session, run_id, lock=True)
    permissions.require_run(principal, run, "status")
    runs.requeued(session, run, **report.model_dump())
    session.commit()
    session.refresh(run)
    return run


class EngineEventsResult(BaseModel):
    recorded: int
    """Events new to the server (one it already had is not recorded again)."""


@router.post(
    "/{run_id}/events",
    response_model=EngineEventsResult,
    responses={401: {"description": "the run has ended (run token)"}, 422: {"description": "invalid event"}},
)
def report_events(run_id: int, body: EngineEvents, session: SessionDep, principal: PrincipalDep) -> Any:
    """Events of the run's processes (``disk_full``, ``truncated``) sent by its supervisor (run token, while the run
    is live) or its owner or an admin; each is recorded once as a run event of its kind (a repeat is skipped)."""
    permissions.check_run_access(principal, run_id)
    run = runs.get(session, run_id, lock=True)
    permissions.require_run(principal, run, "status")
    recorded = runs.record_engine_events(session, run, [e.model_dump() for e in body.events])
    session.commit()
    return EngineEventsResult(recorded=recorded)


@router.get("/{run_id}/events", response_model=RunEventsPublic)
def list_events(
    run_id: int,
    session: SessionDep,
    principal: PrincipalDep,
    offset: int = Query(0, ge=0),
    limit: int = Query(500, ge=1, le=5000),
) -> Any:
    permissions.check_run_access(principal, run_id)
    runs.get(session, run_id)
    data, count = runs.events(session, run_id, offset=offset, limit=limit)
    return {"data": data, "count": count}


@router.post(
    "/{run_id}/resume",
    response_model=RunPublic,
    responses={409: {"description": "not failed/cancelled, or no complete checkpoint"}},
)
def resume_run(run_id: int, session: SessionDep, user: UserDep) -> Any:
    """Continue a failed or cancelled run from its newest complete checkpoint: same run id, run directory and
    metrics (those after the checkpoint step are dropped); the run is queued and relaunched with ``--resume``."""
    run = runs.resume_by(session, run_id, user)
    session.refresh(run)
    return run


@router.post(
    "/{run_id}/fork",
    status_code=201,
    response_model=RunPublic,
    responses={409: {"description": "no complete checkpoint"}, 422: {"description": "invalid change"}},
)
def fork_run(run_id: int, body: ForkRequest, session: SessionDep, user: UserDep) -> Any:
    """A new queued run from a checkpoint of this one (default the newest) with dotted-key spec ``changes``; it
    starts from that checkpoint's weights, optimizer and data cursor (see ``runs.fork``)."""
    parent = runs.get(session, run_id)
    permissions.require_run(user, parent, "fork")
    child = runs.fork(session, parent, body, owner=user.name, admin=user.role == Role.admin)
    session.commit()
    enqueue(TaskName.launch_run, stored_id(child))
    return child


@router.get(
    "/{run_id}/logs",
    response_model=RunLogs,
    responses={403: {"description": "the log is a link or not a file"}, 404: {"description": "no such run or log yet"}},
)
def get_logs(
    run_id: int,
    session: SessionDep,
    principal: PrincipalDep,
    process: runs.LogProcess = "trainer",
    tail: int = Query(200, ge=1, le=runs.MAX_LOG_LINES, description="last N lines"),
) -> Any:
    """The last ``tail`` lines of one process's log (read-only; user token or this run's token). The log is read
    only as a regular file inside the run's folder (``worker.run_files``): a symbolic link gets 403."""
    permissions.check_run_access(principal, run_id)
    run = runs.get(session, run_id)
    try:
        lines = runs.read_log(run, process, tail)
    except RunFileMissing:
        raise HTTPException(404, f"process: run {run_id} has no {process} log yet") from None
    except RunFileError as err:
        raise HTTPException(403, f"process: run {run_id}'s {process} log is refused: {err}") from None
    return RunLogs(
        run_id=run_id, process=process, path=str(runs.run_home(run) / runs.log_file(run, process)), lines=lines
    )


class RolloutsPublic(BaseModel):
    run_id: int
    step: int | None
    """The step shown (None: the run wrote no rollouts yet)."""
    data: list[dict[str, Any]]
    """Rollout records as the orchestrator wrote them: task, completion, reward, advantage, policy_span, ..."""
    skipped: int = 0
    """Lines read that were not a JSON object with a numeric ``advantage`` (left out of ``data``)."""


@router.get(
    "/{run_id}/rollouts",
    response_model=RolloutsPublic,
    responses={403: {"description": "the rollouts file is a link or not a file"}},
)
def get_rollouts(
    run_id: int,
    session: SessionDep,
    principal: PrincipalDep,
    step: int | None = Query(None, ge=0, le=2**62, description="default: the newest step with rollouts"),
    limit: int = Query(20, ge=1, le=1000),
) -> Any:
    """Rollout samples of one step, read from the run directory's ``rollouts/step_<n>.jsonl`` (a regular file
    inside the run's folder: a symbolic link gets 403; bad lines are skipped and counted in ``skipped``)."""
    permissions.check_run_access(principal, run_id)
    try:
        shown = runs.rollouts(runs.get(session, run_id), step=step, limit=limit)
    except RunFileError as err:
        raise HTTPException(403, f"step: run {run_id}'s rollouts are refused: {err}") from None
    return RolloutsPublic(run_id=run_id, step=shown.step, data=shown.records, skipped=shown.skipped)
