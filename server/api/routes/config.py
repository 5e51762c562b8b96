"""``/api/runs/{id}/config``: live config revisions (change, list, acknowledge).

Live keys and who applies them: ``worker/live_config.py`` (``LIVE_KEYS``). The run's supervisor polls
``GET …/config?after=N``, hands new revisions to the processes through the run directory and posts their
acknowledgements (``POST …/config/{revision}/ack``) with the run token.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field
from pydantic.config import JsonDict

from server.api.deps import PrincipalDep, SessionDep, UserDep
from server.models import ConfigRevision, Run
from server.services import config, permissions, runs
from worker.live_config import LIVE_KEYS

router = APIRouter(prefix="/runs", tags=["config"])

_CHANGES_EXAMPLE: JsonDict = {"trainer.optim.lr": 5e-5, "orchestrator.temperature": 1.2}
_NOW = "2026-11-30T21:40:00Z"


class ConfigChange(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"changes": _CHANGES_EXAMPLE}]})
    changes: dict[str, Any] = Field(description=f"dotted live key -> new value; live keys: {', '.join(LIVE_KEYS)}")


class ConfigRevisionPublic(BaseModel):
    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "revision": 1,
                    "changes": _CHANGES_EXAMPLE,
                    "applied": {"trainer": 12, "orchestrator": 13},
                    "state": "in effect",
                    "created_by": "me",
                    "created_at": _NOW,
                }
            ]
        },
    )
    revision: int
    changes: dict[str, Any]
    applied: dict[str, int]
    """Process -> first step it ran with this revision (absent until that process acknowledged it)."""
    state: str = "pending"
    """``in effect`` (every process that applies one of its keys acknowledged it), ``pending`` (the run is live), or
    ``not applied: the run ended first (<process>, …)`` (``server.services.config.state``)."""
    created_by: str
    created_at: datetime


class LiveConfigPublic(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "run_id": 7,
                    "revision": 1,
                    "values": {
                        "trainer.optim.lr": 5e-5,
                        "orchestrator.temperature": 1.2,
                        "orchestrator.max_tokens": 48,
                        "orchestrator.max_off_policy_steps": 8,
                        "orchestrator.eval.interval": 40,
                    },
                    "in_effect": {
                        "trainer.optim.lr": 5e-5,
                        "orchestrator.temperature": 1.2,
                        "orchestrator.max_tokens": 48,
                        "orchestrator.max_off_policy_steps": 8,
                        "orchestrator.eval.interval": 40,
                    },
                    "owners": {**LIVE_KEYS},
                    "data": [
                        {
                            "revision": 1,
                            "changes": _CHANGES_EXAMPLE,
                            "applied": {"trainer": 12, "orchestrator": 13},
                            "state": "in effect",
                            "created_by": "me",
                            "created_at": _NOW,
                        }
                    ],
                }
            ]
        }
    )
    run_id: int
    revision: int
    """Newest revision number (0: none yet)."""
    values: dict[str, Any]
    """Every live key's value once all revisions are applied (what was asked for)."""
    in_effect: dict[str, Any]
    """Every live key's value as the run's processes took it up: acknowledged revisions only (a pending revision, or
    one the run ended before applying, is not in it)."""
    owners: dict[str, str]
    """Live key -> the process that applies it."""
    data: list[ConfigRevisionPublic]
    """Revisions numbered above ``after``, oldest first."""


class ConfigAck(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"process": "trainer", "step": 12}]})
    process: str = Field(min_length=1, max_length=32)
    step: int = Field(ge=0, le=2**62, description="first step the process ran with the revision's values")


@router.patch(
    "/{run_id}/config",
    status_code=201,
    response_model=ConfigRevisionPublic,
    responses={
        409: {"description": "the run has ended"},
        422: {"description": "a key that is not live, or a value the spec refuses"},
    },
)
def change_config(run_id: int, body: ConfigChange, session: SessionDep, user: UserDep) -> Any:
    """Change live keys of a queued, starting, running or paused run; the change becomes the run's next
    numbered revision, which the processes apply at their next step boundary. Its owner or an admin."""
    permissions.require_run(user, runs.get(session, run_id), "config")
    row = config.create(session, run_id, body.changes, by=user.name)
    session.commit()
    session.refresh(row)
    return _public(row, runs.get(session, run_id))


@router.get("/{run_id}/config", response_model=LiveConfigPublic)
def get_config(
    run_id: int,
    session: SessionDep,
    principal: PrincipalDep,
    after: int = Query(0, ge=0, le=2**62, description="only revisions numbered above this"),
) -> Any:
    """The live values in effect and the revisions after ``after``, each with the step every process applied
    it at."""
    permissions.check_run_access(principal, run_id)
    run = runs.get(session, run_id)
    rows, values = config.current(session, run)
    return LiveConfigPublic(
        run_id=run_id,
        revision=rows[-1].revision if rows else 0,
        values=values,
        in_effect=config.in_effect(session, run),
        owners=LIVE_KEYS,
        data=[_public(r, run) for r in rows if r.revision > after],
    )


def _public(row: ConfigRevision, run: Run) -> ConfigRevisionPublic:
    """The revision as the API shows it, with its :func:`server.services.config.state`."""
    return ConfigRevisionPublic.model_validate(row).model_copy(update={"state": config.state(row, run)})


@router.post(
    "/{run_id}/config/{revision}/ack",
    response_model=ConfigRevisionPublic,
    responses={403: {"description": "not this run's token"}, 404: {"description": "no such revision"}},
)
def ack_config(run_id: int, revision: int, body: ConfigAck, session: SessionDep, principal: PrincipalDep) -> Any:
    """The run's supervisor reports the step a process started using ``revision`` at (run token only, while the run
    is live; repeating the same report is harmless)."""
    if principal.run_id is None:
        raise HTTPException(403, "only the run's own token acknowledges config revisions")
    permissions.check_run_access(principal, run_id)
    permissions.require_run(principal, runs.get(session, run_id), "config")
    row = config.ack(session, run_id, revision, process=body.process, step=body.step)
    session.commit()
    session.refresh(row)
    return _public(row, runs.get(session, run_id))
