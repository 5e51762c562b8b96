"""``/api/pipelines``: submit a pipeline (stages run one after another, each an ordinary run starting from an earlier
stage's output), list, show, stop, resume."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from server.api.deps import SessionDep, SurfaceDep, UserDep
from server.api.job_groups import GroupSummary, Limit, Offset, page, submitted
from server.api.responses import creates, spec_body
from server.api.routes.runs import SubmittedSpec
from server.models import Role
from server.services import pipelines

router = APIRouter(prefix="/pipelines", tags=["pipelines"])
_PIPELINE_BODY = spec_body(
    {
        "name": "reverse",
        "stages": [
            {"kind": "sft", "base": {"model": {"name": "outputs/models/tiny"}, "max_steps": 40}},
            {"kind": "rl", "base": {"max_steps": 20}},
            {"kind": "eval", "base": {"eval": {"num_examples": 16, "temperature": 0.0}}},
        ],
    },
    "pipeline spec",
)


class StagePublic(BaseModel):
    index: int
    kind: str
    name: str
    """The stage's run name."""
    from_: int | None = Field(None, alias="from")
    """The stage it starts from (None: the first stage, from its own spec)."""
    step: int | None
    """Eval stages: the checkpoint step of the ``from`` stage (None: its final weights)."""
    status: str
    """``pending`` (no run yet), ``running``, ``completed``, ``failed`` or ``cancelled``."""
    reason: str
    run_id: int | None
    run_status: str | None
    headline: str | None = None
    """What the stage achieved, from its run's metrics: an SFT stage's greedy eval reward, an RL stage's held-out
    reward at its first and last eval (``held-out reward 0.381 → 0.626``), an eval stage's reward."""


class PipelinePublic(BaseModel):
    id: int
    name: str
    owner: str
    status: str
    """``running``, ``completed``, ``failed`` or ``cancelled``; ``status_reason`` names the stage that stopped it."""
    status_reason: str
    spec: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    stages: list[StagePublic]


class PipelineSummary(GroupSummary):
    pass


class PipelinesPublic(BaseModel):
    data: list[PipelineSummary]
    count: int


@creates(
    router,
    "",
    PipelinePublic,
    invalid="invalid pipeline spec (the message names the stage and field); nothing created",
    openapi_extra=_PIPELINE_BODY,
)
def create_pipeline(session: SessionDep, user: UserDep, data: SubmittedSpec) -> Any:
    """Submit a pipeline spec (JSON body, or a TOML/JSON file upload with each stage's base spec inline); its first
    stage's run is queued at once, each later one when the stage before it completed."""
    pipeline = pipelines.create(session, data=data, owner=user.name, admin=user.role == Role.admin)  # SpecError: 422
    return submitted(session, pipeline, pipelines.tick, pipelines.get, pipelines.public)


@router.get("", response_model=PipelinesPublic)
def list_pipelines(session: SessionDep, _user: UserDep, offset: Offset = 0, limit: Limit = 50) -> Any:
    return page(*pipelines.list_pipelines(session, offset=offset, limit=limit), PipelineSummary)


@router.get("/{pipeline_id}", response_model=PipelinePublic)
def get_pipeline(pipeline_id: int, session: SessionDep, _user: UserDep) -> Any:
    """The pipeline's stages (kind, the stage each starts from, status, run and its status)."""
    return pipelines.public(session, pipelines.get(session, pipeline_id))


@router.post("/{pipeline_id}/stop", response_model=PipelinePublic)
def stop_pipeline(pipeline_id: int, session: SessionDep, user: UserDep, via: SurfaceDep) -> Any:
    """Stop the pipeline (its owner or an admin): no later stage starts; the live stage's run stops with its
    checkpoints (reason ``stopped by <user> via API (pipeline <id>)``, ``via CLI`` from ``asyncrl pipeline stop``)."""
    pipelines.stop_by(session, pipeline_id, user, via=via)
    return pipelines.public(session, pipelines.get(session, pipeline_id))


@router.post("/{pipeline_id}/resume", response_model=PipelinePublic)
def resume_pipeline(pipeline_id: int, session: SessionDep, user: UserDep) -> Any:
    """Resume a failed or stopped pipeline (its owner or an admin) from the stage that stopped it: that stage's run
    resumes from its newest complete checkpoint (or runs again when it has none), then the later stages follow."""
    pipelines.resume_by(session, pipeline_id, user)
    return pipelines.public(session, pipelines.get(session, pipeline_id))
