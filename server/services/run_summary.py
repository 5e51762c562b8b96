"""What the runs table shows per run beyond its row: training pace (steps/s), best eval reward and a downsampled
reward trend (the sparkline), each computed for a page of runs in one grouped query."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import bindparam, text
from sqlalchemy import select as select_columns
from sqlmodel import Session, col, func, select

from server.models import Metric

SPARK_POINTS = 40
"""Points of each run's reward trend (downsampled as ``metrics.series``: every k-th step and the newest)."""
PACE = ("trainer", "step_time_s")
"""The metric whose steps and measurement times give a run's pace (one point per trainer step)."""
BEST = ("eval", "reward_mean")
"""The metric whose maximum is a run's best eval reward."""
TREND = ("orchestrator", "reward_mean")
"""The metric the sparkline draws."""


@dataclass
class RunSummary:
    steps_per_s: float | None = None
    """(newest - oldest trainer step) / (their measurement times' difference, seconds), over the run's stored
    ``step_time_s`` points: the wall-clock pace, waits and evals included. None below two points."""
    best_eval: tuple[int, float] | None = None
    """(step, value) of the highest finite eval ``reward_mean`` (the earliest step on a tie); None without one."""
    trend: list[float] = field(default_factory=list)
    """The train ``reward_mean`` by step, at most ``SPARK_POINTS`` finite values."""


_TREND_SQL = text("""
WITH s AS (
    SELECT run_id, step, value,
           row_number() OVER (PARTITION BY run_id ORDER BY step) AS rn,
           count(*) OVER (PARTITION BY run_id) AS n
    FROM metrics
    WHERE run_id IN :run_ids AND name = :name AND source = :source AND value < :inf AND value > -:inf
)
SELECT run_id, value FROM s
WHERE n <= :k OR rn = n OR (rn - 1) % ((n + :k - 2) / (:k - 1)) = 0
ORDER BY run_id, step
""").bindparams(bindparam("run_ids", expanding=True))


def summaries(session: Session, run_ids: Sequence[int], *, spark_points: int = SPARK_POINTS) -> dict[int, RunSummary]:
    """Run id -> :class:`RunSummary` for each of ``run_ids`` (one with nothing known when a run has no metrics).
    Non-finite values (NaN, inf; SQLite stores NaN as inf) are left out of the best and the trend.

    Raises:
        ValueError: ``spark_points`` < 2 (a trend needs two points).
    """
    if spark_points < 2:
        raise ValueError(f"spark_points: expected at least 2, got {spark_points}")
    out = {run_id: RunSummary() for run_id in run_ids}
    if not run_ids:
        return out
    ids = list(out)
    pace = session.execute(
        select_columns(
            col(Metric.run_id),
            func.min(col(Metric.step)),
            func.max(col(Metric.step)),
            func.min(col(Metric.time)),
            func.max(col(Metric.time)),
        )
        .where(col(Metric.run_id).in_(ids), col(Metric.source) == PACE[0], col(Metric.name) == PACE[1])
        .group_by(col(Metric.run_id))
    ).all()
    for run_id, first, last, t0, t1 in pace:
        if last > first and t1 > t0:
            out[run_id].steps_per_s = (last - first) / (t1 - t0)
    finite = (col(Metric.value) < math.inf, col(Metric.value) > -math.inf)
    best = (
        select(col(Metric.run_id), func.max(col(Metric.value)).label("best"))
        .where(col(Metric.run_id).in_(ids), col(Metric.source) == BEST[0], col(Metric.name) == BEST[1], *finite)
        .group_by(col(Metric.run_id))
        .subquery()
    )
    rows = session.execute(
        select(col(Metric.run_id), func.min(col(Metric.step)), best.c.best)
        .join(best, (col(Metric.run_id) == best.c.run_id) & (col(Metric.value) == best.c.best))
        .where(col(Metric.source) == BEST[0], col(Metric.name) == BEST[1])
        .group_by(col(Metric.run_id), best.c.best)
    ).all()
    for run_id, step, value in rows:
        out[run_id].best_eval = (int(step), float(value))
    trend = session.execute(
        _TREND_SQL, {"run_ids": ids, "name": TREND[1], "source": TREND[0], "inf": math.inf, "k": spark_points}
    ).all()
    for run_id, value in trend:
        out[run_id].trend.append(float(value))
    return out
