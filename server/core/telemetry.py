"""Prometheus metrics of the server, served at ``GET /metrics`` (text exposition format, no token).

- ``asyncrl_http_requests_total{method, route, status}`` and ``asyncrl_http_request_duration_seconds{method,
  route}``: every HTTP request, by route template (``/api/runs/{run_id}``; ``unmatched`` for unknown paths, so
  the label set stays small). Each response also carries ``Server-Timing: app;dur=<ms>``.
- ``asyncrl_runs{status}``: runs by status, counted in the database at scrape time.
- ``asyncrl_metric_points_received_total`` / ``asyncrl_metric_points_inserted_total``: metric points ingested
  (inserted excludes replays of keys already stored).

One registry of this module (not the global one), so building the app twice does not register twice.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
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


REGISTRY.register(RunsByStatus())


def exposition() -> bytes:
    """The registry in Prometheus text format (version 0.0.4)."""
    return generate_latest(REGISTRY)


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
