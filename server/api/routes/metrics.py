"""``/api/runs/{id}/metrics``: batched idempotent ingestion and downsampled series; ``/api/runs/{id}/metrics/export``
and ``/api/metrics/export`` (several runs): the stored points as CSV or Parquet."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Response
from sqlmodel import Session

from server.alerts import rules as alert_rules
from server.api.deps import PrincipalDep, SessionDep
from server.core.config import settings
from server.models import MetricBatch, MetricIngestResult, MetricSeriesPublic
from server.services import metric_export, metrics, permissions, runs
from server.services.metric_export import ExportFormat
from server.services.tokens import Principal

router = APIRouter(prefix="/runs", tags=["metrics"])
export_router = APIRouter(prefix="/metrics", tags=["metrics"])


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


_EXPORT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the file: columns run_id, source, step, name, value, time (``server.services.metric_export``)",
        "content": {"text/csv": {}, "application/vnd.apache.parquet": {}},
    },
    404: {"description": "no such run, or a metric none of the runs has"},
}
NamesQuery = Annotated[
    list[str] | None,
    Query(max_length=metric_export.MAX_NAMES, description="metric names (repeat); default every metric"),
]


def _export(
    session: Session, principal: Principal, run_ids: list[int], names: list[str], fmt: ExportFormat
) -> Response:
    for run_id in run_ids:
        permissions.check_run_access(principal, run_id)
        runs.get(session, run_id)
    body = metric_export.export(session, run_ids=run_ids, names=list(dict.fromkeys(names)), fmt=fmt)
    disposition = f'attachment; filename="{metric_export.filename(run_ids, fmt)}"'
    return Response(body, media_type=metric_export.MEDIA_TYPES[fmt], headers={"Content-Disposition": disposition})


@router.get("/{run_id}/metrics/export", response_class=Response, responses=_EXPORT_RESPONSES)
def export_run_metrics(
    run_id: int,
    session: SessionDep,
    principal: PrincipalDep,
    name: NamesQuery = None,
    format: ExportFormat = "csv",
) -> Response:
    """Every stored point of the run (or of the metrics ``name``) as a CSV or Parquet file, one row per point."""
    return _export(session, principal, [run_id], name or [], format)


@export_router.get("/export", response_class=Response, responses=_EXPORT_RESPONSES)
def export_compared_metrics(
    session: SessionDep,
    principal: PrincipalDep,
    run: Annotated[list[int], Query(min_length=1, max_length=metric_export.MAX_RUNS, description="run ids (repeat)")],
    name: NamesQuery = None,
    format: ExportFormat = "csv",
) -> Response:
    """The stored points of several runs (a comparison) in one CSV or Parquet file, told apart by ``run_id``."""
    return _export(session, principal, list(dict.fromkeys(run)), name or [], format)
