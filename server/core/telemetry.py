"""Prometheus metrics of the server, served at ``GET /metrics`` (text exposition format; the per-run series only to a
scrape with a user token: ``server.main``).

- ``asyncrl_http_requests_total{method, route, status}`` and ``asyncrl_http_request_duration_seconds{method,
  route}``: every HTTP request, by route template (``/api/runs/{run_id}``; ``unmatched`` for unknown paths, so
  the label set stays small). Each response also carries ``Server-Timing: app;dur=<ms>``.
- ``asyncrl_runs{status}``: runs by status, counted in the database at scrape time.
- ``asyncrl_metric_points_received_total`` / ``asyncrl_metric_points_inserted_total``: metric points ingested
  (inserted excludes replays of keys already stored).
- ``asyncrl_run_metric{run, source, name, env, owner}``: the newest value of every metric series of the live runs
  (not completed, failed or cancelled), and ``asyncrl_run_step{run, source, env, owner}`` the newest step of a
  source's series; at most ``PROMETHEUS_MAX_RUNS`` runs (newest first) and ``PROMETHEUS_MAX_METRICS_PER_RUN``
  series a run, what the caps left out counted in ``asyncrl_run_metrics_left_out{cap}`` (:class:`RunMetrics`).

One registry of this module (not the global one), so building the app twice does not register twice.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy import text
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REGISTRY = CollectorRegistry()
REQUESTS = Counter("asyncrl_http_requests", "HTTP requests", ["method", "route", "status"], registry=REGISTRY)
LATENCY = Histogram(
    "asyncrl_http_request_duration_seconds",
    "HTTP request time in the app",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
POINTS_RECEIVED = Counter("asyncrl_metric_points_received", "Metric points received by ingestion", registry=REGISTRY)
POINTS_INSERTED = Counter("asyncrl_metric_points_inserted", "Metric points stored (new keys)", registry=REGISTRY)


class RunsByStatus(Collector):
    """``asyncrl_runs{status}`` from one ``GROUP BY`` query per scrape (every status listed, zeros included)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from sqlalchemy import func
        from sqlmodel import Session, select

        from server.core.db import engine
        from server.models import Run, RunStatus

        with Session(engine) as session:
            counts = dict(session.exec(select(Run.status, func.count()).group_by(Run.status)).all())
        family = GaugeMetricFamily("asyncrl_runs", "Runs by status", labels=["status"])
        for status in RunStatus:
            family.add_metric([status.value], float(counts.get(status.value, 0)))
        yield family


_LATEST_PG = text("""
WITH RECURSIVE k(run_id, source, name, step, value, n) AS (
    SELECT r.id, f.source, f.name, f.step, f.value, 1
    FROM unnest(CAST(:ids AS integer[])) AS r(id) CROSS JOIN LATERAL (
        SELECT m.source, m.name, m.step, m.value FROM metrics m WHERE m.run_id = r.id
        ORDER BY m.source DESC, m.name DESC, m.step DESC LIMIT 1) f
  UNION ALL
    SELECT k.run_id, f.source, f.name, f.step, f.value, k.n + 1
    FROM k CROSS JOIN LATERAL (
        SELECT m.source, m.name, m.step, m.value FROM metrics m
        WHERE m.run_id = k.run_id AND (m.source, m.name) < (k.source, k.name)
        ORDER BY m.source DESC, m.name DESC, m.step DESC LIMIT 1) f
    WHERE k.n <= :max_series
)
SELECT run_id, source, name, step, value, n FROM k
""")
"""The newest point of each ``(source, name)`` of the runs ``ids``, at most ``max_series + 1`` a run: a skip scan
over ``ix_metrics_latest`` (run_id, source, name, step) read backwards, one index probe per series however many
steps it has (a ``DISTINCT ON`` over the runs' points reads them all: seconds at 100 runs of 300 steps)."""

_LATEST_SQLITE = text("""
WITH RECURSIVE k(run_id, rid, n) AS (
    SELECT r.value, (SELECT m.rowid FROM metrics m WHERE m.run_id = r.value
                     ORDER BY m.source DESC, m.name DESC, m.step DESC LIMIT 1), 1
    FROM json_each(:ids) AS r
  UNION ALL
    SELECT k.run_id, coalesce(
        (SELECT m.rowid FROM metrics m WHERE m.run_id = k.run_id AND m.source = p.source AND m.name < p.name
         ORDER BY m.name DESC, m.step DESC LIMIT 1),
        (SELECT m.rowid FROM metrics m WHERE m.run_id = k.run_id AND m.source < p.source
         ORDER BY m.source DESC, m.name DESC, m.step DESC LIMIT 1)), k.n + 1
    FROM k JOIN metrics p ON p.rowid = k.rid
    WHERE k.n <= :max_series
)
SELECT m.run_id, m.source, m.name, m.step, m.value, k.n FROM k JOIN metrics m ON m.rowid = k.rid
""")
"""``_LATEST_PG`` on SQLite (no ``LATERAL``): the same skip scan, each probe giving the row id of the next series'
newest point. The next series is sought in the same source, then in the sources before it: SQLite bounds an index
range by the first column of a row value only, so ``(source, name) < (?, ?)`` would re-read every point of the
series already seen."""


def env_label(spec: dict[str, Any]) -> str:
    """A stored spec's environment as the ``env`` label: its name (default its ``id``); a mixture's names joined by
    commas."""
    env = spec.get("env")
    envs = env if isinstance(env, list) else [env] if isinstance(env, dict) else []
    return ",".join(str(e.get("name") or e.get("id", "")) for e in envs)


def label_value(value: str) -> str:
    """``value`` escaped for a label of the text format: backslash, double quote and newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class RunMetrics:
    """``asyncrl_run_metric``, ``asyncrl_run_step`` and ``asyncrl_run_metrics_left_out`` of the live runs, read at
    scrape time: the ids of the newest ``PROMETHEUS_MAX_RUNS`` live runs (with the number of live runs), then the
    newest point of each of their series (:data:`_LATEST_PG`), at most ``PROMETHEUS_MAX_METRICS_PER_RUN`` a run, the
    last ones in (source, name) order. A run's ``env`` and ``owner`` never change: they are read once per run (a third
    query, only in a scrape that finds new runs) and kept while the run is exported.

    Written as text here rather than through ``prometheus_client``'s collectors, which spent most of a 3,000-series
    scrape's server CPU formatting and sorting samples (``benchmarks/prometheus_scrape.py``). ``source`` and ``name``
    need no escaping (``server.models.MetricPoint`` allows neither quotes, backslashes nor newlines)."""

    def __init__(self) -> None:
        self._labels: dict[int, str] = {}
        """Run id -> ``env="..",owner=".."`` of the runs exported by the last scrape."""

    def exposition(self) -> str:
        """The three families in the text format; empty when ``PROMETHEUS_MAX_RUNS`` is 0."""
        import json

        from sqlalchemy import func
        from sqlmodel import Session, col, select

        from server.core.config import settings
        from server.core.db import engine
        from server.models import TERMINAL, Run

        max_runs, max_series = settings.PROMETHEUS_MAX_RUNS, settings.PROMETHEUS_MAX_METRICS_PER_RUN
        if not max_runs:
            return ""
        rows: list[Any] = []
        with Session(engine) as session:
            found = session.exec(
                select(col(Run.id), func.count().over())
                .where(col(Run.status).not_in([s.value for s in TERMINAL]))
                .order_by(col(Run.id).desc())
                .limit(max_runs)
            ).all()
            ids = [int(i) for i, _ in found]  # type: ignore[arg-type]  # stored rows have ids
            labels = {i: self._labels[i] for i in ids if i in self._labels}
            if new := [i for i in ids if i not in labels]:
                described = select(col(Run.id), col(Run.owner), col(Run.spec)).where(col(Run.id).in_(new))
                for i, owner, spec in session.exec(described).all():
                    labels[int(i)] = f'env="{label_value(env_label(spec))}",owner="{label_value(owner)}"'  # type: ignore[arg-type]
            self._labels = labels
            if ids:
                postgres = engine.dialect.name == "postgresql"
                params = {"ids": ids if postgres else json.dumps(ids), "max_series": max_series}
                rows = list(session.execute(_LATEST_PG if postgres else _LATEST_SQLITE, params).all())
        lines = [
            "# HELP asyncrl_run_metric Newest value of a live run's metric",
            "# TYPE asyncrl_run_metric gauge",
        ]
        newest: dict[tuple[int, str], int] = {}
        capped = set()
        for run_id, source, name, step, value, n in rows:
            if n > max_series:
                capped.add(run_id)
                continue
            lines.append(
                f'asyncrl_run_metric{{run="{run_id}",source="{source}",name="{name}",{labels[run_id]}}} '
                f"{floatToGoString(value)}"
            )
            newest[(run_id, source)] = max(step, newest.get((run_id, source), step))
        lines += [
            "# HELP asyncrl_run_step Newest step of a live run's metrics from one source",
            "# TYPE asyncrl_run_step gauge",
        ]
        lines += [
            f'asyncrl_run_step{{run="{run_id}",source="{source}",{labels[run_id]}}} {floatToGoString(step)}'
            for (run_id, source), step in sorted(newest.items())
        ]
        live = int(found[0][1]) if found else 0
        lines += [
            "# HELP asyncrl_run_metrics_left_out What the caps on per-run metrics left out of this scrape",
            "# TYPE asyncrl_run_metrics_left_out gauge",
            f'asyncrl_run_metrics_left_out{{cap="runs"}} {floatToGoString(live - len(ids))}',
            f'asyncrl_run_metrics_left_out{{cap="metrics"}} {floatToGoString(len(capped))}',
        ]
        return "\n".join(lines) + "\n"


RUN_METRICS = RunMetrics()
REGISTRY.register(RunsByStatus())


def exposition(*, runs: bool) -> bytes:
    """The registry, then (``runs``: the scrape carried a user token) the live runs' metrics (:class:`RunMetrics`), in
    Prometheus text format (version 0.0.4)."""
    return generate_latest(REGISTRY) + (RUN_METRICS.exposition().encode() if runs else b"")


class PrometheusMiddleware:
    """Count and time every HTTP request by its route template; add ``Server-Timing`` to the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_timed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                ms = (time.perf_counter() - start) * 1000
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"server-timing", f"app;dur={ms:.2f}".encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_timed)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            LATENCY.labels(method, path).observe(time.perf_counter() - start)
            REQUESTS.labels(method, path, str(status)).inc()
