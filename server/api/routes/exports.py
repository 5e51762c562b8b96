"""``/api/runs/{id}/checkpoints`` and ``/api/runs/{id}/exports``: a run's complete checkpoints, and exports of them
as Hugging Face model directories written by the worker (``server/services/exports.py``,
``worker/policy/export.py``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from server.api.deps import PrincipalDep, SessionDep, UserDep
from server.services import exports, permissions, runs

router = APIRouter(prefix="/runs", tags=["exports"])


class CheckpointPublic(BaseModel):
    step: int
    kind: str = Field(description="full (model weights) or lora (a PEFT adapter)")
    exports: list[str] = Field(description="folders of the finished exports of this step")


class CheckpointsPublic(BaseModel):
    run_id: int
    data: list[CheckpointPublic]
    count: int


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"step": 20, "adapter_only": False}]})
    step: int = Field(ge=0, le=2**62, description="a step with a complete checkpoint")
    adapter_only: bool = Field(False, description="LoRA runs: write the PEFT adapter instead of the merged model")


class ExportAccepted(BaseModel):
    run_id: int
    step: int
    adapter_only: bool
    path: str = Field(description="the folder the worker writes; events export_started, export_done / export_failed")


@router.get(
    "/{run_id}/checkpoints",
    response_model=CheckpointsPublic,
    responses={409: {"description": "the checkpoints folder is a link or not a folder"}},
)
def list_checkpoints(run_id: int, session: SessionDep, principal: PrincipalDep) -> Any:
    """The run's complete checkpoints (both parts with their ``.complete`` marker), ascending, each with its kind and
    finished exports."""
    permissions.check_run_access(principal, run_id)
    found = exports.checkpoints(runs.get(session, run_id))
    data = [CheckpointPublic(step=c.step, kind=c.kind, exports=c.exports) for c in found]
    return CheckpointsPublic(run_id=run_id, data=data, count=len(data))


@router.post(
    "/{run_id}/exports",
    status_code=202,
    response_model=ExportAccepted,
    responses={
        409: {"description": "already exported or under way"},
        422: {"description": "no complete checkpoint at that step; adapter_only on a full fine-tune"},
    },
)
def create_export(run_id: int, body: ExportRequest, session: SessionDep, user: UserDep) -> Any:
    """Export a checkpoint (its owner or an admin): the worker writes ``<run home>/exports/step_<N>[-adapter]/``
    and records ``export_started`` then ``export_done`` (path) or ``export_failed`` (reason) as run events."""
    out = exports.request_export(session, run_id, user, step=body.step, adapter_only=body.adapter_only)
    return ExportAccepted(run_id=run_id, step=body.step, adapter_only=body.adapter_only, path=str(out))
