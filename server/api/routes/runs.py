"""``/api/runs``: submit, list, show, stop, resume, fork, lineage, delete, status reports, events and logs."""

from __future__ import annotations

import json
import logging
import tomllib
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.deps import PrincipalDep, SessionDep, SurfaceDep, UserDep
from server.api.responses import spec_body
from server.errors import is_json_type, nul_error, spec_too_large
from server.jobs.celery_app import TaskName, enqueue
from server.models import (
    MAX_GROUP_LEN,
    MAX_TAG_LEN,
    MAX_TAGS,
    TERMINAL,
    EngineEvents,
    ForkRequest,
    Role,
    RunEventsPublic,
    RunLogs,
    RunPublic,
    RunsPublic,
    RunStatus,
    RunUpdate,
    StatusReport,
    check_label,
    stored_id,
)
from server.services import lineage, permissions, rollouts, runs, spec_policy
from worker.run.run_files import RunFileError, RunFileMissing
from worker.spec import parse_text
from worker.spec.loading import MAX_SPEC_BYTES

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
_SUBMIT_BODY = spec_body(_SPEC_EXAMPLE, "run spec, .toml or .json")


async def _spec_from_request(request: Request) -> dict[str, Any]:
    """The submitted spec, read on the event loop (``SubmittedSpec``): the route that takes it is a plain ``def``
    (run in the thread pool), since its database calls, a lock wait included, must not block the event loop."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        try:  # starlette's multipart parser answers 400 "Missing boundary in multipart." and the like
            form = await request.form()
        except StarletteHTTPException as err:
            raise HTTPException(err.status_code, f"file: not a readable multipart upload ({err.detail})") from None
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise HTTPException(422, "file: upload the spec as a form field named 'file' (.toml or .json)")
        raw, filename = await upload.read(MAX_SPEC_BYTES + 1), upload.filename or "spec.toml"
        if len(raw) > MAX_SPEC_BYTES:
            raise HTTPException(413, spec_too_large("file"))
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
    if (nul := nul_error(data)) is not None:  # a TOML upload's "\u0000" (a JSON body's is refused before)
        raise HTTPException(422, nul)
    return data


def check_query_label(value: str, field: str, max_len: int = MAX_TAG_LEN) -> str:
    """``models.check_label`` for a tag or group given as a query parameter; its ValueError is a 422 naming
    ``field``."""
    try:
        return check_label(value, field, max_len)
    except ValueError as err:
        raise HTTPException(422, str(err)) from None


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
    spec_policy.check_submitted(data)  # SpecError: 422 (output_dir: the service chooses it)
    run = runs.create(session, data=data, owner=user.name, admin=user.role == Role.admin)  # SpecError: 422
    session.commit()
    runs.enqueue_launch(session, stored_id(run))  # after the commit (the worker must find the row); 503 if not taken
    return run


@router.get("", response_model=RunsPublic)
def list_runs(
    session: SessionDep,
    _user: UserDep,
    status: RunStatus | None = None,
    name: str | None = Query(None, max_length=128, description="substring of the run name"),
    tag: Annotated[
        list[str] | None,
        Query(max_length=MAX_TAGS, description="runs carrying every tag given (repeat: ?tag=a&tag=b)"),
    ] = None,
    group: str | None = Query(None, max_length=MAX_GROUP_LEN, description="the run group (exact)"),
    offset: int = Query(0, ge=0),
    limit: int = Query(50, ge=1, le=500),
) -> Any:
    tags = [check_query_label(t, "tag") for t in tag or []]
    group = check_query_label(group, "group", MAX_GROUP_LEN) if group is not None else None
    data, count = runs.list_runs(session, status=status, name=name, tags=tags, group=group, offset=offset, limit=limit)
    return RunsPublic(data=runs.public(session, data), count=count)


@router.get("/{run_id}", response_model=RunPublic)
def get_run(run_id: int, session: SessionDep, principal: PrincipalDep) -> Any:
    permissions.check_run_access(principal, run_id)
    return runs.public(session, [runs.get(session, run_id)])[0]


@router.patch("/{run_id}", response_model=RunPublic, responses={422: {"description": "a bad tag, notes or group"}})
def update_run(run_id: int, change: RunUpdate, session: SessionDep, user: UserDep) -> Any:
    """Set the run's ``tags`` (the whole list), ``notes`` and/or ``group`` (its owner or an admin, in any state);
    fields left out stay. A tag is 1-64 printable characters (no control characters); at most 32 tags."""
    return runs.public(session, [runs.update_by(session, run_id, user, change)])[0]


@router.post("/{run_id}/stop", response_model=RunPublic)
def stop_run(run_id: int, session: SessionDep, user: UserDep, via: SurfaceDep) -> Any:
    """Cancel a queued run at once, or ask the worker to stop a launched one: the answer shows the run as it is
    when asked (still ``running``); it becomes ``cancelled`` once its processes have stopped, with the reason
    ``stopped by <user> via API`` (``via CLI`` from ``asyncrl runs stop``)."""
    run = runs.stop_by(session, run_id, user, via=via)
    session.refresh(run)
    return runs.public(session, [run])[0]


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
    """Events of the run's processes (``disk_full``, ``truncated``, the watchdog's ``stalled``...) sent by its
    supervisor (run token, while the run is live) or its owner or an admin; each is recorded once as a run event of its
    kind (a repeat is skipped). A new ``stalled`` event fires the alert rules and, with ``watchdog.on_stall`` ``stop`` or
    ``restart``, asks the run's stop (``runs.act_on_stalls``)."""
    permissions.check_run_access(principal, run_id)
    run = runs.get(session, run_id, lock=True)
    permissions.require_run(principal, run, "status")
    events = [e.model_dump() for e in body.events]
    recorded = runs.record_engine_events(session, run, events)
    stop = runs.act_on_stalls(session, run, events)  # watchdog.on_stall = "stop" | "restart"
    session.commit()
    if stop:
        enqueue(TaskName.stop_run, run_id)
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


@router.get("/{run_id}/lineage", response_model=lineage.Lineage)
def run_lineage(run_id: int, session: SessionDep, _user: UserDep) -> Any:
    """The fork tree that holds the run: its root, every fork below it (depth-first), each fork's checkpoint step,
    the changes it asked for and the spec keys that differ from the parent's config in effect at that step."""
    return lineage.lineage(session, run_id)


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
    return runs.public(session, [run])[0]


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
    runs.enqueue_launch(session, stored_id(child))
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
    process: str = Query("trainer", max_length=32, description=f"one of {runs.LOG_PROCESS_RULE}"),
    tail: int = Query(200, ge=1, le=runs.MAX_LOG_LINES, description="last N lines"),
) -> Any:
    """The last ``tail`` lines of one process's log (read-only; user token or this run's token). The log is read
    only as a regular file inside the run's folder (``worker.run.run_files``): a symbolic link gets 403."""
    if not runs.is_log_process(process):
        raise HTTPException(422, f"query.process: expected {runs.LOG_PROCESS_RULE}, got {process!r}")
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
    """The step read (None: every step, newest first, or the run wrote no rollouts yet)."""
    data: list[dict[str, Any]]
    """Rollout records as the orchestrator wrote them (task, completion, reward, advantage, policy_span, group, env,
    token ids, log-probs, mask, ...), each with its ``id`` (``<run>-<step>-<line>``)."""
    total: int
    """Records that pass the filters (``data`` is ``limit`` of them from ``offset``)."""
    offset: int = 0
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
    step: int | None = Query(None, ge=0, le=2**62, description="default: the newest step (every step with `task`)"),
    group: int | None = Query(None, ge=0, le=2**31, description="the group's index in its step"),
    env: str | None = Query(None, max_length=200, description="environment name (mixtures)"),
    policy_version: int | None = Query(None, ge=0, le=2**62, description="rollouts whose policy span holds it"),
    task: str | None = Query(None, max_length=500, description="exact task key; searches every step"),
    offset: int = Query(0, ge=0, le=2**31),
    limit: int = Query(20, ge=1, le=rollouts.MAX_PAGE),
) -> Any:
    """Rollout records of a run, read from the run directory's ``rollouts/step_<n>.jsonl`` (regular files inside
    the run's folder: a symbolic link gets 403; bad lines are skipped and counted in ``skipped``), filtered and
    paged (``server.services.rollouts.browse``). Without ``step``: the newest step, or every step when ``task`` is
    given."""
    permissions.check_run_access(principal, run_id)
    run = runs.get(session, run_id)
    try:
        if step is None and task is None:
            steps = rollouts.rollout_steps(run)
            step = steps[-1] if steps else None
        if step is None and task is None:
            return RolloutsPublic(run_id=run_id, step=None, data=[], total=0)
        filters = rollouts.Filters(step=step, group=group, env=env, policy_version=policy_version, task=task)
        page = rollouts.browse(run, filters, offset=offset, limit=limit)

    except RunFileError as err:
        raise HTTPException(403, f"step: run {run_id}'s rollouts are refused: {err}") from None
    return RolloutsPublic(
        run_id=run_id, step=step, data=page.records, total=page.total, offset=offset, skipped=page.skipped
    )


class RolloutTokens(BaseModel):
    run_id: int
    id: str
    summary: dict[str, Any]
    """Step, group, env, task, policy_span, reward, advantage, finish_reason, truncated, dropped, completion."""
    decoded: bool
    """Whether token texts come from the run's tokenizer (``model.name``); False: ``text`` is null, ids only."""
    prompt: list[dict[str, Any]]
    """Prompt tokens: ``{"index", "id", "text"}``."""
    turns: list[dict[str, Any]]
    """The completion as turns ``{"kind": "model" | "env", "tokens": [{"index", "id", "text", "logprob",
    "entropy", "masked"}]}``: ``logprob`` the recorded sampling log-prob (nats), null on masked env tokens."""


@router.get(
    "/{run_id}/rollouts/{rid}",
    response_model=RolloutTokens,
    responses={
        403: {"description": "the rollouts file is a link or not a file"},
        404: {"description": "no such rollout in this run (or the id names another run)"},
        422: {"description": "the id is not <run>-<step>-<line>"},
    },
)
def get_rollout(run_id: int, rid: str, session: SessionDep, principal: PrincipalDep) -> Any:
    """One rollout's tokens (``server.services.rollouts.rollout``): its prompt, then its completion as model and
    environment turns with the recorded log-probs; decoded with the run's tokenizer where it is a local folder.
    A malformed id is 422 and an id of another run 404 (``server/errors.py``), both naming ``rid``."""
    permissions.check_run_access(principal, run_id)
    run = runs.get(session, run_id)
    try:
        view = rollouts.rollout(run, rid, tokenizer=rollouts.run_tokenizer(run))
    except RunFileError as err:
        raise HTTPException(403, f"rid: run {run_id}'s rollouts are refused: {err}") from None
    return RolloutTokens(
        run_id=run_id,
        id=rid,
        summary=view.summary,
        decoded=view.decoded,
        prompt=view.prompt,
        turns=[{"kind": t.kind, "tokens": t.tokens} for t in view.turns],
    )
