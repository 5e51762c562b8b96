"""``/api/runs/{id}/metrics``: batched idempotent ingestion and downsampled series."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query

from server.alerts import rules as alert_rules
from server.api.deps import PrincipalDep, SessionDep
from server.core.config import settings
from server.models import MetricBatch, MetricIngestResult, MetricSeriesPublic
from server.services import metrics, permissions, runs

router = APIRouter(prefix="/runs", tags=["metrics"])


@router.post("/{run_id}/metrics", response_model=MetricIngestResult)
def ingest_metrics(run_id: int, batch: MetricBatch, session: SessionDep, principal: PrincipalDep) -> Any:
    """Store a batch of points; a key ``(source, step, name)`` already stored is skipped, so replays are safe. The
    run's token while the run is live (401 after its final status), or its owner or an admin."""
    permissions.check_run_access(principal, run_id)
    if len(batch.points) > settings.MAX_METRIC_POINTS:
        raise HTTPException(413, f"points: {len(batch.points)} in one batch, at most {settings.MAX_METRIC_POINTS}")
    permissions.require_run(principal, runs.get(session, run_id), "metrics")
    inserted = metrics.ingest(session, run_id=run_id, points=batch.points)
    session.commit()
    alert_rules.on_metrics(session, run_id, batch.points)  # after the points committed: they are in the windows
    session.commit()
    return MetricIngestResult(received=len(batch.points), inserted=inserted)


@router.get("/{run_id}/metrics", response_model=MetricSeriesPublic)
def get_metrics(
    run_id: int,
    session: SessionDep,
    principal: PrincipalDep,
    name: str = Query(..., min_length=1, max_length=128, examples=["reward_mean"]),
    since_step: int = Query(-1, ge=-1, le=2**62, description="only points with step > since_step"),
    max_points: int = Query(1000, ge=1, le=100_000, description="per source; the last point is kept"),
) -> Any:
    permissions.check_run_access(principal, run_id)
    runs.get(session, run_id)
    return MetricSeriesPublic(
        name=name,
        series=metrics.series(session, run_id=run_id, name=name, since_step=since_step, max_points=max_points),
    )
