"""Metric ingestion (idempotent on ``(run, source, step, name)``) and downsampled series queries."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, text
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Session, col

from server.core.telemetry import POINTS_INSERTED, POINTS_RECEIVED
from server.models import TERMINAL, Metric, MetricPoint, MetricSeries, Run, RunStatus, utcnow

CHUNK = 5000
"""Rows per INSERT statement on SQLite."""

_PG_INGEST = text("""
INSERT INTO metrics (run_id, source, step, name, value, time)
SELECT :run_id, * FROM unnest(CAST(:source AS text[]), CAST(:step AS bigint[]), CAST(:name AS text[]),
                              CAST(:value AS float8[]), CAST(:time AS float8[]))
ON CONFLICT (run_id, source, step, name) DO NOTHING
""")
"""Postgres: one statement with five array parameters for the whole batch (a multi-row VALUES with 6 parameters
a row spent ~190 ms per 1000 points compiling and binding)."""


def ingest(session: Session, *, run_id: int, points: Sequence[MetricPoint]) -> int:
    """Insert points, skipping keys already stored (``ON CONFLICT DO NOTHING``); returns rows inserted."""
    postgres = session.get_bind().dialect.name == "postgresql"
    received, inserted = len(points), 0
    if postgres and points:
        columns = {
            "source": [p.source for p in points],
            "step": [p.step for p in points],
            "name": [p.name for p in points],
            "value": [p.value for p in points],
            "time": [p.time for p in points],
        }
        inserted = session.execute(_PG_INGEST, {"run_id": run_id, **columns}).rowcount  # type: ignore[attr-defined]  # a text() INSERT gives a CursorResult; Session.execute is typed Result
        points = []  # done; the loop below is SQLite's
    for i in range(0, len(points), CHUNK):
        # SQLite turns NaN into NULL (refused: NOT NULL); inf also reads back as null, so store NaN as inf there
        rows = [
            {
                "run_id": run_id,
                "source": p.source,
                "step": p.step,
                "name": p.name,
                "value": p.value if postgres or not math.isnan(p.value) else math.inf,
                "time": p.time,
            }
            for p in points[i : i + CHUNK]
        ]
        stmt = (
            sqlite_insert(Metric)
            .values(rows)
            .on_conflict_do_nothing(index_elements=["run_id", "source", "step", "name"])
            .returning(col(Metric.step))
        )
        inserted += len(session.execute(stmt).all())
    POINTS_RECEIVED.inc(received)
    POINTS_INSERTED.inc(inserted)
    return inserted


_SERIES_SQL = text("""
WITH s AS (
    SELECT source, step, value, time,
           row_number() OVER (PARTITION BY source ORDER BY step) AS rn,
           count(*) OVER (PARTITION BY source) AS n
    FROM metrics
    WHERE run_id = :run_id AND name = :name AND step > :since_step
)
SELECT source, step, value, time, n FROM s
WHERE n <= :max_points OR rn = n
   OR (:max_points > 1 AND (rn - 1) % ((n + :max_points - 2) / (:max_points - 1)) = 0)
ORDER BY source, step
""")


def series(
    session: Session, *, run_id: int, name: str, since_step: int = -1, max_points: int = 1000
) -> list[MetricSeries]:
    """One series per source of metric ``name`` after ``since_step``, each at most ``max_points`` long.

    Downsampling keeps every k-th point by step, k = ceil(n / (max_points - 1)), plus the last point, so a
    chart always ends at the newest value.
    """
    rows = session.execute(
        _SERIES_SQL, {"run_id": run_id, "name": name, "since_step": since_step, "max_points": max_points}
    ).all()
    out: dict[str, MetricSeries] = {}
    for source, step, value, t, n in rows:
        s = out.setdefault(source, MetricSeries(source=source, total=n, step=[], value=[], time=[]))
        s.step.append(step)
        s.value.append(value if math.isfinite(value) else None)
        s.time.append(t)
    return list(out.values())


_PAIR_SQL = text("""
WITH s AS (
    SELECT step, value, time, row_number() OVER (ORDER BY step) AS rn, count(*) OVER () AS n
    FROM metrics
    WHERE run_id = :run_id AND name = :name AND source = :source AND step > :since_step
)
SELECT step, value, time, n FROM s
WHERE n <= :max_points OR rn = n
   OR (:max_points > 1 AND (rn - 1) % ((n + :max_points - 2) / (:max_points - 1)) = 0)
ORDER BY step
""")
"""The downsampling of ``_SERIES_SQL`` for one (source, name): the window sorts integer steps only."""


def series_of(
    session: Session, *, run_id: int, keys: Sequence[tuple[str, str]], since_step: int = -1, max_points: int = 1000
) -> dict[tuple[str, str], MetricSeries]:
    """Downsampled series (as :func:`series`) of several ``(source, name)`` keys, one indexed query each (faster
    than one query over all of them: no sort of text keys); keys without points are absent."""
    out = {}
    for source, name in keys:
        rows = session.execute(
            _PAIR_SQL,
            {"run_id": run_id, "name": name, "source": source, "since_step": since_step, "max_points": max_points},
        ).all()
        if rows:
            out[(source, name)] = MetricSeries(
                source=source,
                total=rows[0][3],
                step=[r[0] for r in rows],
                value=[v if math.isfinite(v) else None for _, v, _, _ in rows],
                time=[r[2] for r in rows],
            )
    return out


def latest(session: Session, *, run_ids: Sequence[int], source: str, name: str) -> dict[int, tuple[int, float | None]]:
    """Run id -> (step, value) of the newest point of metric ``name`` from ``source`` (runs without one absent)."""
    if not run_ids:
        return {}
    newest = (
        select(col(Metric.run_id), func.max(col(Metric.step)).label("step"))
        .where(col(Metric.run_id).in_(run_ids), col(Metric.source) == source, col(Metric.name) == name)
        .group_by(col(Metric.run_id))
        .subquery()
    )
    rows = session.execute(
        select(col(Metric.run_id), col(Metric.step), col(Metric.value))
        .join(newest, (col(Metric.run_id) == newest.c.run_id) & (col(Metric.step) == newest.c.step))
        .where(col(Metric.source) == source, col(Metric.name) == name)
    ).all()
    return {run_id: (step, value if math.isfinite(value) else None) for run_id, step, value in rows}


ETA_WINDOW = 20
"""Trainer steps whose wall-clock rate the ETA extrapolates (the newest ones: a run's pace changes)."""


@dataclass(frozen=True)
class Progress:
    """Where a run stands: ``step`` of ``max_steps`` (the newest trainer step with a ``step_time_s`` point; 0: none),
    ``elapsed_s`` since it first ran (to its end once ended; None: never ran) and ``eta_s``, the seconds to
    ``max_steps`` at the pace of its newest steps (None: ended, done, or fewer than 2 steps to measure)."""

    step: int
    max_steps: int
    elapsed_s: float | None
    eta_s: float | None


def progress(session: Session, run: Run, *, now: datetime | None = None) -> Progress:
    """The :class:`Progress` of ``run`` at ``now`` (default: the current time).

    ETA = (max_steps - step) x (t_newest - t_oldest) / (step_newest - step_oldest) over the newest ``ETA_WINDOW`` + 1
    trainer ``step_time_s`` points (their measurement times, unix seconds): the wall-clock pace, waits and evals
    included.
    """
    rows = session.execute(
        select(col(Metric.step), col(Metric.time))
        .where(col(Metric.run_id) == run.id, col(Metric.source) == "trainer", col(Metric.name) == "step_time_s")
        .order_by(col(Metric.step).desc())
        .limit(ETA_WINDOW + 1)
    ).all()
    max_steps = int(run.spec.get("max_steps", 0))
    step = int(rows[0][0]) if rows else 0
    end = run.finished_at or now or utcnow()
    elapsed = None if run.started_at is None else max(0.0, (end - run.started_at).total_seconds())
    eta = None
    if RunStatus(run.status) not in TERMINAL and len(rows) >= 2 and step < max_steps:
        (newest, t_newest), (oldest, t_oldest) = rows[0], rows[-1]
        eta = (max_steps - step) * max(0.0, t_newest - t_oldest) / (newest - oldest)
    return Progress(step=step, max_steps=max_steps, elapsed_s=elapsed, eta_s=eta)
