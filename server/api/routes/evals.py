"""``/api/runs/{id}/evals``: eval jobs of a training run's checkpoints (one per request, as the run page's "Evaluate"
button) and eval reward over its checkpoints (``server/services/evals.py``). Eval jobs of any model are submitted as
``POST /api/runs`` with ``kind = "eval"``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from server.api.deps import PrincipalDep, SessionDep, UserDep
from server.api.responses import creates
from server.models import RunPublic
from server.services import evals, permissions, runs

router = APIRouter(prefix="/runs", tags=["evals"])


class EvalRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"step": 20}]})
    step: int = Field(ge=0, le=2**62, description="a step with a complete checkpoint")


class EvalPointPublic(BaseModel):
    run_id: int = Field(description="the eval job")
    step: int | None = Field(description="the evaluated checkpoint's step; null: the final weights")
    x: int = Field(description="where the point is drawn: step, or max_steps for the final weights")
    status: str
    metrics: dict[str, float] = Field(description="the job's eval metrics: reward_mean, pass_at_k, ... (per env)")


class EvalPointsPublic(BaseModel):
    run_id: int
    data: list[EvalPointPublic]
    count: int


@creates(
    router,
    "/{run_id}/evals",
    RunPublic,
    invalid="not a training run, or no complete checkpoint at that step",
    not_found="no such run",
)
def create_eval(run_id: int, body: EvalRequest, session: SessionDep, user: UserDep) -> Any:
    """Evaluate checkpoint ``step`` (its owner or an admin): a queued eval job on the run's environments with its
    eval settings (``evals.checkpoint_spec``); its ``eval`` metrics are the point of this step on ``GET``."""
    return evals.evaluate_checkpoint(session, run_id, user, step=body.step)


@router.get("/{run_id}/evals", response_model=EvalPointsPublic)
def list_evals(run_id: int, session: SessionDep, principal: PrincipalDep) -> Any:
    """The eval jobs of this run's weights (checkpoints and final), by step: status and eval metrics."""
    permissions.check_run_access(principal, run_id)
    found = evals.evals_of(session, runs.get(session, run_id))
    data = [EvalPointPublic(run_id=p.run_id, step=p.step, x=p.x, status=p.status, metrics=p.metrics) for p in found]
    return EvalPointsPublic(run_id=run_id, data=data, count=len(data))
