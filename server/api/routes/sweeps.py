"""``/api/sweeps``: submit a sweep (runs of one base spec over swept values, pruned on a metric), list, show, stop."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from server.api.deps import SessionDep, SurfaceDep, UserDep
from server.api.job_groups import GroupSummary, Limit, Offset, page, submitted
from server.api.responses import creates, spec_body
from server.api.routes.runs import SubmittedSpec
from server.models import Role
from server.services import sweeps

router = APIRouter(prefix="/sweeps", tags=["sweeps"])
_SWEEP_BODY = spec_body(
    {
        "name": "lr-temp",
        "base": {"name": "reverse-text-rl", "max_steps": 20, "model": {"name": "outputs/models/tiny"}},
        "grid": {"trainer.optim.lr": [1e-4, 3e-4], "orchestrator.temperature": [0.7, 1.0]},
        "max_parallel": 4,
        "metric": "eval/reward_mean",
        "mode": "max",
        "pruning": {"rule": "successive_halving", "at_steps": [10], "reduction_factor": 1.5},
    },
    "sweep spec",
)


class Point(BaseModel):
    step: int
    value: float


class TrialPublic(BaseModel):
    index: int
    params: dict[str, Any]
    """Dotted spec key -> value of this trial."""
    status: str
    """``pending`` (no run yet), ``running``, ``waiting`` (held at rung ``held_step``, its run stopped, until the rung
    is decided), ``pruned`` or ``finished``."""
    reason: str
    pruned_step: int | None
    held_step: int | None
    run_id: int | None
    run_status: str | None
    last: Point | None
    """Newest value of the sweep metric."""
    best: Point | None


class BestPublic(BaseModel):
    trial: int
    run_id: int | None
    params: dict[str, Any]
    step: int
    value: float


class SweepPublic(BaseModel):
    id: int
    name: str
    owner: str
    status: str
    status_reason: str
    metric: str
    mode: str
    spec: dict[str, Any]
    decided_steps: list[int]
    """Pruning steps already decided."""
    created_at: datetime
    finished_at: datetime | None
    trials: list[TrialPublic]
    best: BestPublic | None


class SweepSummary(GroupSummary):
    pass


class SweepsPublic(BaseModel):
    data: list[SweepSummary]
    count: int


@creates(
    router,
    "",
    SweepPublic,
    invalid="invalid sweep spec (the message names the field); nothing is created",
    openapi_extra=_SWEEP_BODY,
)
def create_sweep(session: SessionDep, user: UserDep, data: SubmittedSpec) -> Any:
    """Submit a sweep spec (JSON body, or a TOML/JSON file upload with the base spec inline); its first
    ``max_parallel`` runs are queued at once, the rest as runs end or are pruned."""
    sweep = sweeps.create(session, data=data, owner=user.name, admin=user.role == Role.admin)  # SpecError: 422
    return submitted(session, sweep, sweeps.tick, sweeps.get, sweeps.public)


@router.get("", response_model=SweepsPublic)
def list_sweeps(session: SessionDep, _user: UserDep, offset: Offset = 0, limit: Limit = 50) -> Any:
    return page(*sweeps.list_sweeps(session, offset=offset, limit=limit), SweepSummary)


@router.get("/{sweep_id}", response_model=SweepPublic)
def get_sweep(sweep_id: int, session: SessionDep, _user: UserDep) -> Any:
    """The sweep's trials (swept values, run and status, the metric's last and best value, pruned step) and the best
    trial so far."""
    return sweeps.public(session, sweeps.get(session, sweep_id))


@router.post("/{sweep_id}/stop", response_model=SweepPublic)
def stop_sweep(sweep_id: int, session: SessionDep, user: UserDep, via: SurfaceDep) -> Any:
    """Cancel the sweep (its owner or an admin): no more trials start; its live runs stop with their checkpoints
    (reason ``stopped by <user> via API (sweep <id>)``, ``via CLI`` from ``asyncrl sweep stop``)."""
    sweeps.stop_by(session, sweep_id, user, via=via)
    return sweeps.public(session, sweeps.get(session, sweep_id))
