"""Pipelines: stages run one after another, each an ordinary run of the service that starts from an earlier stage's
output (e.g. SFT -> RL -> eval).

A pipeline spec (TOML or JSON; the CLI inlines each ``base = "path.toml"``)::

    name = "reverse"
    [[stages]]
    kind = "sft"                       # sft | rl | eval
    [stages.base]                      # the stage's run spec (inline; the CLI reads a path)
    ...
    [stages.overrides]                 # dotted keys set on top of base
    max_steps = 40
    [[stages]]
    kind = "rl"                        # starts from stage 0's final weights (``from``: the previous stage by default)
    [stages.base]
    ...
    [[stages]]
    kind = "eval"
    from = 1                           # or "stage 1": an earlier stage that trains (sft, rl)
    step = 4                           # eval only: that stage's checkpoint step; unset: its final weights
    [stages.base]
    ...

What a stage takes from its ``from`` stage (the run the service records for it): an ``sft`` / ``rl`` stage's
``model.name`` becomes that run's final weights, ``<run_dir>/final`` (``save_pretrained`` with the tokenizer,
``worker/trainer/checkpointer.save_final``; the worker copies it into the stage's own home before the stage starts,
``worker.run.inputs``: a run's uid cannot enter another run's folder); an ``eval`` stage's ``model.run`` becomes that
run's id and ``model.step`` its ``step`` (``runs.resolve_eval_source`` copies the weights). The first stage starts
from its own spec. Each stage's run is named ``<pipeline>-<index>`` unless the stage gives a ``name``.

States (literal tables below). A pipeline is ``running → completed | failed | cancelled``; ``failed`` and
``cancelled`` go back to ``running`` through :func:`resume_by` only. A stage is ``pending`` (no run yet) ``→
running`` (its run exists; the run's ``pipeline`` event and ``pipeline_stages.run_id`` point back) ``→ completed |
failed | cancelled``; a failed or cancelled stage goes back to ``running`` (its run resumed) or ``pending`` (a new
run) on resume.

:func:`tick` advances one running pipeline: the current stage (the first not completed) whose run completed is
``completed`` and the next stage's run is created; one whose run failed (or was cancelled) ends the pipeline
``failed`` (``cancelled``) with a reason naming the stage; a stage whose run cannot be created (e.g. the final weights
are missing) fails the pipeline the same way, except a full queue, which it waits out. The pipeline completes when
every stage completed. Celery beat runs it for every running pipeline (``server/jobs/tasks.py``, every ``SWEEP_TICK_S``);
``POST /api/pipelines`` and resume run it once at once.

:func:`stop_by` cancels the pipeline and stops its live stage's run through the normal stop path (checkpoints kept);
:func:`resume_by` continues the failed or cancelled stage: its run through ``runs.resume`` (a training run from its
newest complete checkpoint; an eval job in place, after the tasks it recorded), or a new run when a training run has
no checkpoint (stopped before its first one), then the stages after it.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlmodel import Session, col, select

from server.jobs.celery_app import TaskName, enqueue
from server.models import (
    TERMINAL,
    Pipeline,
    PipelineStage,
    PipelineStatus,
    Run,
    RunEvent,
    RunStatus,
    stored_id,
    utcnow,
)
from server.services import capacity, job_groups, metrics, permissions, runs, spec_policy
from server.services.tokens import Principal
from worker.dotted_keys import DottedKeyError, closest, with_keys
from worker.spec import CHAINED_MODEL_KEYS, SpecError, spec_kind_of_keys, validate_spec

StageKind = Literal["sft", "rl", "eval"]
KINDS: tuple[str, ...] = ("sft", "rl", "eval")
TRAINING = ("sft", "rl")
"""Kinds of stage whose final weights or checkpoints a later stage starts from."""
MAX_STAGES = 16
PIPELINE_EVENT = "pipeline"
"""Event kind on a stage's run: ``{"pipeline_id", "stage"}``."""


class StageStatus:
    pending = "pending"
    running = "running"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"


T = StageStatus
STAGE_TRANSITIONS: dict[str, frozenset[str]] = {
    T.pending: frozenset({T.running, T.failed}),
    T.running: frozenset({T.completed, T.failed, T.cancelled}),
    T.completed: frozenset(),
    T.failed: frozenset({T.running, T.pending}),  # resume: its run resumed, or a new run
    T.cancelled: frozenset({T.running, T.pending}),
}
P = PipelineStatus
PIPELINE_TRANSITIONS: dict[PipelineStatus, frozenset[PipelineStatus]] = {
    P.running: frozenset({P.completed, P.failed, P.cancelled}),
    P.completed: frozenset(),
    P.failed: frozenset({P.running}),  # resume
    P.cancelled: frozenset({P.running}),  # resume
}
_FROM = re.compile(r"^stage (\d+)$")


class PipelineNotFound(LookupError):
    pass


class StageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    kind: StageKind
    name: str | None = Field(None, min_length=1, max_length=100)
    """The stage's run name (default ``<pipeline>-<index>``)."""
    base: dict[str, Any] = Field(default_factory=dict)
    """The stage's run spec (inline; the CLI reads ``base = "path.toml"``)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Dotted keys set on top of ``base``."""
    from_: int | None = Field(None, alias="from")
    """The earlier stage this one starts from (default: the previous one; none for the first)."""
    step: int | None = Field(None, ge=1)
    """Eval stages: the checkpoint step of the ``from`` stage to evaluate; unset: its final weights."""

    @field_validator("from_", mode="before")
    @classmethod
    def _from(cls, v: Any) -> Any:
        if isinstance(v, str) and (m := _FROM.match(v.strip())):
            return int(m.group(1))
        if isinstance(v, bool) or (v is not None and not isinstance(v, int)):
            raise ValueError(f"expected an earlier stage's index (2 or 'stage 2'), got {v!r}")
        return v


class PipelineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field("pipeline", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
    stages: list[StageSpec]


def _validation_line(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = list(first["loc"])
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "pipeline"
    if first["type"] == "extra_forbidden" and len(loc) == 1:
        hint = closest(where, list(PipelineSpec.model_fields))
        return (
            f"{where}: unknown pipeline key"
            + (f" (did you mean '{hint}'?)" if hint else "")
            + "; allowed: name, stages"
        )
    if first["type"] == "extra_forbidden" and len(loc) == 3:
        allowed = ["kind", "name", "base", "overrides", "from", "step"]
        hint = closest(str(loc[2]), allowed)
        return (
            f"{where}: unknown stage key"
            + (f" (did you mean '{hint}'?)" if hint else "")
            + f"; allowed: {', '.join(allowed)}"
        )
    if first["type"] == "literal_error" and loc[-1] == "kind":
        return f"{where}: unknown kind {first['input']!r}; expected one of {', '.join(KINDS)}"
    return f"{where}: {first['msg']}".replace("Value error, ", "")


def stage_data(spec: PipelineSpec, i: int) -> dict[str, Any]:
    """Stage ``i``'s run spec mapping before chaining: ``base`` with ``overrides``, its kind and run name.

    Raises:
        SpecError: an override goes through a value that is not a table, ``base.kind`` is another kind, ``base``
            without a ``kind`` has keys of another kind's spec only (``spec_kind_of_keys``: an RL spec as an eval
            stage's base), or the stage sets ``output_dir`` (the service chooses the run folder).
    """
    stage = spec.stages[i]
    if "kind" in stage.base and stage.base["kind"] != stage.kind:
        raise SpecError(f"stages[{i}].base.kind: {stage.base['kind']!r}, but the stage's kind is {stage.kind!r}")
    if "kind" not in stage.base and (foreign := spec_kind_of_keys(stage.kind, stage.base)) is not None:
        other, keys = foreign
        raise SpecError(
            f"stages[{i}].base: an {other} spec ({', '.join(map(repr, keys))} {'is a key' if len(keys) == 1 else 'are keys'} "
            f"of {other} specs), but stage {i} is kind {stage.kind!r}: give an {stage.kind} spec as its base"
        )
    if "kind" in stage.overrides:
        raise SpecError(f"stages[{i}].overrides.kind: the stage's own 'kind' key sets it ({stage.kind!r})")
    try:
        data = with_keys(stage.base, stage.overrides)
    except DottedKeyError as err:
        raise SpecError(f"stages[{i}].overrides.{err.key}: {err}") from None
    if "output_dir" in data:  # the service chooses every run's folder: a value would be replaced, not used
        raise SpecError(f"stages[{i}].{spec_policy.SERVICE_SETS_OUTPUT_DIR}")
    data["kind"] = stage.kind
    data["name"] = stage.name or f"{spec.name}-{i}"
    return data


def source_of(spec: PipelineSpec, i: int) -> int | None:
    """The stage stage ``i`` starts from: its ``from``, else the previous one (None for the first)."""
    stage = spec.stages[i]
    return stage.from_ if stage.from_ is not None else (i - 1 if i > 0 else None)


def chained(data: dict[str, Any], kind: str, source: Run, step: int | None) -> dict[str, Any]:
    """Stage data pointed at the output of ``source`` (the run of its ``from`` stage): an eval's ``model.run`` /
    ``model.step``, a training stage's ``model.name`` = ``<run_dir>/final``."""
    if kind == "eval":
        model = {k: v for k, v in (data.get("model") or {}).items() if k not in ("name", "dtype")}
        return {**data, "model": {**model, "run": stored_id(source), "step": step}}
    return with_keys(data, {"model.name": f"{source.run_dir}/final"})


def _checkpoints_written(stage: dict[str, Any]) -> list[int]:
    """Steps whose checkpoints a training run of this validated spec keeps at its end (``ckpt.interval``, ``keep``)."""
    ckpt = stage.get("ckpt") or {}
    interval, keep, last = int(ckpt.get("interval") or 0), int(ckpt.get("keep") or 1), int(stage["max_steps"])
    return list(range(interval, last + 1, interval))[-keep:] if interval else []


def _prefixed(i: int, err: Exception) -> SpecError:
    text = str(err)
    named = re.match(r"^[\w.\[\]-]+: ", text) is not None
    return SpecError(f"stages[{i}].{text}" if named else f"stages[{i}]: {text}")


def plan(session: Session, data: dict[str, Any], *, owner: str, admin: bool) -> PipelineSpec:
    """Validate a pipeline spec mapping: every stage's run spec (as its run would be created, with the chained
    model set from the first stage's model) against the schema, the code policy and the workers' capacity, and every
    ``from`` / ``step`` against the stages before it, so that nothing is created for a bad one.

    Raises:
        SpecError: one line naming the field: no stages, an unknown stage kind or key, a ``from`` that is not an
            earlier stage or is an eval stage (no weights), a ``step`` on a non-eval stage or one the ``from`` stage
            never keeps a complete checkpoint of, or a stage spec that does not validate (``stages[i].<key>: ...``).
        Forbidden: a first eval stage of another user's run (``runs.resolve_eval_source``), or what submit refuses a
            stage's spec (``runs.check_allowed``, as sweeps check every trial): its ``model.name`` (an SFT stage's
            ``data.path``) inside another user's run folder, a member's Slurm allocation: ``stages[<i>].model.name:
            ...``.
    """
    if isinstance(data.get("stages"), list) and not data["stages"]:
        raise SpecError("stages: empty; give at least one [[stages]] table with kind = 'sft', 'rl' or 'eval'")
    if isinstance(data.get("stages"), list) and len(data["stages"]) > MAX_STAGES:
        raise SpecError(f"stages: {len(data['stages'])} stages; at most {MAX_STAGES}")
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_validation_line(err)) from None
    resolved: list[dict[str, Any]] = []
    for i, stage in enumerate(spec.stages):
        src = source_of(spec, i)
        if stage.from_ is not None and not 0 <= stage.from_ < i:
            earlier = f"0 to {i - 1}" if i else "none: the first stage starts from its own spec"
            raise SpecError(f"stages[{i}].from: no stage {stage.from_} before stage {i}; earlier stages: {earlier}")
        if stage.step is not None and stage.kind != "eval":
            raise SpecError(f"stages[{i}].step: only an eval stage evaluates a checkpoint step; this is {stage.kind!r}")
        if stage.step is not None and src is None:
            raise SpecError(f"stages[{i}].step: a checkpoint step needs a 'from' stage; the first stage has none")
        item = stage_data(spec, i)
        if src is not None:
            if spec.stages[src].kind not in TRAINING:
                raise SpecError(f"stages[{i}].from: stage {src} is an eval stage; it writes no weights to start from")
            root = (resolved[src].get("model") or {}).get("name")  # the weights' base: what the schema checks
            given = [k for k in CHAINED_MODEL_KEYS[stage.kind] if k in (item.get("model") or {})]  # chained() sets
            if given:  # the stage's own value would be replaced without a word
                starts = (
                    f"evaluates stage {src}'s weights (its 'step', else its final weights)"
                    if stage.kind == "eval"
                    else f"starts from stage {src}'s final weights (<run_dir>/final)"
                )
                raise SpecError(
                    f"stages[{i}].model.{given[0]}: this {stage.kind} stage {starts}; leave model.{given[0]} out"
                )
            if stage.kind == "eval":
                model = {k: v for k, v in (item.get("model") or {}).items() if k not in ("run", "step", "name")}
                item = {**item, "model": {**model, "name": root}}
            else:
                item = with_keys(item, {"model.name": root})
            if stage.step is not None and stage.step not in (kept := _checkpoints_written(resolved[src])):
                listed = ", ".join(map(str, kept)) or "none (ckpt.interval = 0)"
                raise SpecError(
                    f"stages[{i}].step: stage {src} keeps no complete checkpoint at step {stage.step} "
                    f"(kept at its end: {listed})"
                )
        try:
            run_spec = validate_spec(stage.kind, item)
        except SpecError as err:
            raise _prefixed(i, err) from None
        try:
            if src is None and stage.kind == "eval":
                run_spec, _ = runs.resolve_eval_source(session, run_spec, owner=owner, admin=admin)  # type: ignore[arg-type]
        except SpecError as err:
            raise _prefixed(i, err) from None
        try:  # the check of submit and launch: code, addresses, flags, and no other user's run folder
            runs.check_allowed(session, run_spec, owner=owner, admin=admin)
            capacity.check_fits(session, run_spec)
        except SpecError as err:
            raise _prefixed(i, err) from None
        except permissions.Forbidden as err:
            raise permissions.Forbidden(f"stages[{i}].{err}") from None
        resolved.append(run_spec.model_dump(mode="json"))
    return spec


def create(session: Session, *, data: dict[str, Any], owner: str, admin: bool = False) -> Pipeline:
    """Validate (:func:`plan`) and add a running pipeline of ``owner`` with its pending stages; flushed, not
    committed. The caller commits, then calls :func:`tick` to start the first stage's run.

    Raises:
        SpecError, Forbidden: see :func:`plan`.
    """
    spec = plan(session, data, owner=owner, admin=admin)
    pipeline = Pipeline(name=spec.name, owner=owner, spec=spec.model_dump(mode="json", by_alias=True))
    session.add(pipeline)
    session.flush()
    for i, stage in enumerate(spec.stages):
        session.add(PipelineStage(pipeline_id=stored_id(pipeline), index=i, kind=stage.kind))
    session.flush()
    return pipeline


def get(session: Session, pipeline_id: int, *, lock: bool = False) -> Pipeline:
    """The pipeline (``lock``: ``SELECT ... FOR UPDATE`` until the transaction ends).

    Raises:
        PipelineNotFound: no pipeline with this id.
    """
    return job_groups.get(session, Pipeline, pipeline_id, lock=lock, missing=PipelineNotFound, what="pipeline")


def stages(session: Session, pipeline_id: int) -> list[PipelineStage]:
    return job_groups.members(session, PipelineStage, pipeline_id)


def list_pipelines(session: Session, *, offset: int = 0, limit: int = 50) -> tuple[list[Pipeline], int]:
    return job_groups.page(session, Pipeline, offset=offset, limit=limit)


def running_ids(session: Session) -> list[int]:
    return job_groups.running_ids(session, Pipeline, P.running)


def of_run(session: Session, run_id: int) -> tuple[int, int] | None:
    """``(pipeline id, stage index)`` of a run a pipeline created (its ``pipeline`` event), None for any other."""
    event = session.exec(
        select(RunEvent).where(RunEvent.run_id == run_id, RunEvent.kind == PIPELINE_EVENT).order_by(col(RunEvent.id))
    ).first()
    return None if event is None else (int(event.data["pipeline_id"]), int(event.data["stage"]))


def _move(stage: PipelineStage, to: str, reason: str) -> None:
    if to not in STAGE_TRANSITIONS[stage.status]:
        raise runs.InvalidTransition(f"pipeline stage {stage.index} is {stage.status}: cannot go to {to}")
    stage.status, stage.reason = to, reason[:2000]


def _set(pipeline: Pipeline, to: PipelineStatus, reason: str) -> None:
    if to not in PIPELINE_TRANSITIONS[PipelineStatus(pipeline.status)]:
        raise runs.InvalidTransition(f"pipeline {pipeline.id} is {pipeline.status}: cannot go to {to.value}")
    now = utcnow()
    pipeline.status, pipeline.status_reason, pipeline.updated_at = to, reason[:2000], now
    pipeline.finished_at = None if to == P.running else now


def _start(session: Session, pipeline: Pipeline, stage: PipelineStage, ss: list[PipelineStage]) -> Run:
    """Create the run of pending ``stage`` from its ``from`` stage's run (flushed).

    Raises:
        SpecError (``runs.QueueFull`` included), Forbidden: ``runs.create`` refused it; RunNotFound: the ``from``
            stage's run was deleted.
    """
    spec = PipelineSpec.model_validate(pipeline.spec)
    data = stage_data(spec, stage.index)
    src = source_of(spec, stage.index)
    if src is not None:
        source_id = ss[src].run_id
        if source_id is None:
            raise SpecError(f"stages[{stage.index}].from: stage {src}'s run was deleted; its weights are gone")
        data = chained(data, stage.kind, runs.get(session, source_id), spec.stages[stage.index].step)
    admin = job_groups.owner_is_admin(session, pipeline.owner)
    run = runs.create(session, data=data, owner=pipeline.owner, admin=admin)
    runs.record_event(
        session,
        run,
        PIPELINE_EVENT,
        reason=f"stage {stage.index} ({stage.kind}) of pipeline {pipeline.id}",
        pipeline_id=pipeline.id,
        stage=stage.index,
    )
    return run


def _what(stage: PipelineStage) -> str:
    return f"stage {stage.index} ({stage.kind}" + (f", run {stage.run_id})" if stage.run_id is not None else ")")


def tick(session: Session, pipeline_id: int) -> list[str]:
    """Advance pipeline ``pipeline_id`` (see the module docstring), commit, then enqueue the launch it decided.
    Returns one line per thing done. A pipeline that is not running is left as it is.

    Raises:
        PipelineNotFound: no such pipeline.
    """
    pipeline = get(session, pipeline_id, lock=True)
    if pipeline.status != P.running:
        session.rollback()
        return []
    ss = stages(session, pipeline_id)
    done: list[str] = []
    launch: int | None = None
    for stage in ss:
        if stage.status == T.completed:
            continue
        if stage.status == T.running:
            run = job_groups.run_of(session, stage)
            status = RunStatus(run.status) if run is not None else None
            if status is not None and status not in TERMINAL:
                break  # live: wait
            if status == RunStatus.completed:
                _move(stage, T.completed, "run completed")
                session.add(stage)
                done.append(f"{_what(stage)} completed")
                continue
            why = f"run {status.value}: {run.status_reason}" if run is not None and status else "run deleted"
            to = T.cancelled if status == RunStatus.cancelled else T.failed
            _move(stage, to, why)
            session.add(stage)
            _set(pipeline, P.cancelled if to == T.cancelled else P.failed, f"{_what(stage)} {to}: {why}")
            done.append(pipeline.status_reason)
            break
        if stage.status == T.pending:
            try:
                with session.begin_nested():  # a refused run leaves no row behind
                    run = _start(session, pipeline, stage, ss)
            except runs.QueueFull as err:  # tried again next tick
                pipeline.status_reason = f"stage {stage.index} waits: {err}"[:2000]
                break
            except (SpecError, permissions.Forbidden, runs.RunNotFound) as err:
                _move(stage, T.failed, f"could not start: {err}")
                session.add(stage)
                _set(pipeline, P.failed, f"{_what(stage)} failed: could not start: {err}")
                done.append(pipeline.status_reason)
                break
            stage.run_id = stored_id(run)
            _move(stage, T.running, "")
            session.add(stage)
            launch = stored_id(run)
            done.append(f"stage {stage.index} ({stage.kind}): run {run.id} created")
            break
        break  # failed or cancelled while the pipeline runs: not reached (resume moves them on)
    else:
        _set(pipeline, P.completed, f"every stage completed ({len(ss)})")
        done.append(pipeline.status_reason)
    pipeline.updated_at = utcnow()
    session.add(pipeline)
    session.commit()
    if launch is not None:
        runs.enqueue_launch(session, launch)  # BrokerUnavailable: the stage's run failed
    return done


def stop_by(session: Session, pipeline_id: int, user: Principal, *, via: str = "API") -> Pipeline:
    """``user`` (the owner or an admin) stops the running pipeline from the surface ``via`` (``runs.STOP_SURFACES``):
    it is ``cancelled``, no later stage starts, and the live stage's run is stopped through the normal stop path (its
    checkpoints kept; its reason ``stopped by <user> via <surface> (pipeline <id>)``); committed, then the stop is
    enqueued. :func:`resume_by` continues that stage.

    Raises:
        PipelineNotFound, Forbidden, InvalidTransition: the pipeline is not running.
    """
    pipeline = get(session, pipeline_id, lock=True)
    permissions.require_owner(user, pipeline.owner, f"pipeline {pipeline_id}", "stop it")
    _set(pipeline, P.cancelled, f"stopped by {user.name} via {via}")
    session.add(pipeline)
    stops: list[int] = []
    for stage in stages(session, pipeline_id):
        if stage.status != T.running:
            continue
        run = job_groups.run_of(session, stage)
        if run is not None:
            stops += job_groups.request_stops(session, [run], by=f"{user.name} via {via} (pipeline {pipeline_id})")
        if run is None or RunStatus(run.status) != RunStatus.completed:
            _move(stage, T.cancelled, f"stopped by {user.name} via {via}")
            session.add(stage)
    session.commit()
    for run_id in stops:
        enqueue(TaskName.stop_run, run_id)
    return pipeline


def resume_by(session: Session, pipeline_id: int, user: Principal) -> Pipeline:
    """``user`` (the owner or an admin) resumes a failed or cancelled pipeline from its first stage not completed:
    a failed or cancelled stage's run is resumed (``runs.resume``: a training run from its newest complete
    checkpoint, an eval job in place after the tasks recorded in its ``eval_tasks.jsonl``) or, with no checkpoint
    to resume from (a training run stopped before its first one) or no run, replaced by a new run;
    then the stages after it follow. Committed, then the launch is enqueued (and :func:`tick` run).

    Raises:
        PipelineNotFound, Forbidden, InvalidTransition: the pipeline is running or completed, or the stage's run
            has not ended yet (a stop still under way).
    """
    pipeline = get(session, pipeline_id, lock=True)
    permissions.require_owner(user, pipeline.owner, f"pipeline {pipeline_id}", "resume it")
    current = PipelineStatus(pipeline.status)
    if current not in (P.failed, P.cancelled):
        raise runs.InvalidTransition(
            f"pipeline {pipeline_id} is {current.value}: only failed or cancelled pipelines resume"
        )
    stage = next((s for s in stages(session, pipeline_id) if s.status != T.completed), None)
    launch = None
    how = "no stage left"
    if stage is not None and stage.status in (T.failed, T.cancelled):
        run = job_groups.run_of(session, stage)
        if run is not None and RunStatus(run.status) not in TERMINAL:
            raise runs.InvalidTransition(
                f"pipeline {pipeline_id}: stage {stage.index}'s run {run.id} is still {run.status}; resume once it ended"
            )
        if run is not None and RunStatus(run.status) == RunStatus.completed:
            _move(stage, T.running, "its run completed")
            how = f"stage {stage.index}'s run {run.id} had completed"
        elif run is not None and run.kind == "eval":  # in place: it goes on after the eval tasks it recorded
            runs.resume(
                session, runs.get(session, stored_id(run), lock=True), by=f"{user.name} (pipeline {pipeline_id})"
            )
            _move(stage, T.running, "eval run resumed after the tasks it recorded")
            launch = stored_id(run)
            how = f"stage {stage.index}'s eval run {run.id} resumed after the tasks it recorded"
        elif run is not None and runs.checkpoint_steps(run):
            step = runs.resume(
                session, runs.get(session, stored_id(run), lock=True), by=f"{user.name} (pipeline {pipeline_id})"
            )
            _move(stage, T.running, f"run resumed from checkpoint step {step}")
            launch = stored_id(run)
            how = f"stage {stage.index}'s run {run.id} resumed from checkpoint step {step}"
        else:
            _move(
                stage, T.pending, "re-run: " + ("no run" if run is None else f"run {run.id} has no complete checkpoint")
            )
            how = f"stage {stage.index} re-run" + ("" if run is None else f" (run {run.id} has no complete checkpoint)")
        session.add(stage)
    elif stage is not None:
        how = f"stage {stage.index} {stage.status}"
    _set(pipeline, P.running, f"resumed by {user.name}: {how}")
    session.add(pipeline)
    session.commit()
    if launch is not None:
        runs.enqueue_launch(session, launch)
    tick(session, pipeline_id)
    return get(session, pipeline_id)


def public(session: Session, pipeline: Pipeline) -> dict[str, Any]:
    """The pipeline as the API and the dashboard show it: its spec and stages (kind, ``from``, status, reason, run id,
    the run's status and its :func:`headline`)."""
    spec = PipelineSpec.model_validate(pipeline.spec)
    rows = []
    for s in stages(session, stored_id(pipeline)):
        run = job_groups.run_of(session, s)
        rows.append(
            {
                "index": s.index,
                "kind": s.kind,
                "name": spec.stages[s.index].name or f"{spec.name}-{s.index}",
                "from": source_of(spec, s.index),
                "step": spec.stages[s.index].step,
                "status": s.status,
                "reason": s.reason,
                "run_id": s.run_id,
                "run_status": run.status if run is not None else None,
                "headline": headline(session, s.kind, s.run_id) if s.run_id is not None else None,
            }
        )
    return {**job_groups.summary_fields(pipeline), "updated_at": pipeline.updated_at, "stages": rows}


HEADLINES: dict[str, tuple[tuple[str, str], str]] = {
    "sft": (("sft", "eval_reward_greedy"), "greedy eval reward"),
    "rl": (("eval", "reward_mean"), "held-out reward"),
    "eval": (("eval", "reward_mean"), "eval reward"),
}
"""Stage kind -> the metric ``(source, name)`` that says what the stage achieved, and its words."""


def headline(session: Session, kind: str, run_id: int) -> str | None:
    """A stage's result in one line from its run's stored metrics: an SFT stage's last greedy eval reward, an RL
    stage's held-out reward at its first eval (the policy it started from) and its last, an eval stage's reward;
    None before the run logged one (``-`` for a NaN)."""
    key, words = HEADLINES[kind]
    found = metrics.series_of(session, run_id=run_id, keys=[key], max_points=2).get(key)
    if found is None:
        return None
    shown = ["-" if v is None else f"{v:.3f}" for v in found.value]
    if kind == "rl" and len(shown) == 2:
        return f"{words} {shown[0]} → {shown[1]}"
    return f"{words} {shown[-1]}"
