"""Metric export of 100,000 stored points as CSV and as Parquet: server time of ``GET /api/runs/{id}/metrics/export``.

1. A scratch database (``bench_support.scratch_database``), a user token and one run with 100,000 metric points:
   20 metrics (trainer and orchestrator) x 5,000 steps.
2. ``asyncrl server --no-migrate`` (one uvicorn process); an httpx client with the token.
3. ``N`` rounds (after 2 warm-up rounds) of the whole run's export as CSV and as Parquet, and of a two-run
   comparison (``GET /api/metrics/export?run=a&run=b``, 2 x 100,000 points): p50/p99 of the app's time from the
   ``Server-Timing`` header and of the client time; each file is read back and its row count checked.

Goal: 100k points in under 2 s server time. Run: ``.venv/bin/python benchmarks/metric_export.py [--quick]``.
"""

from __future__ import annotations

import csv
import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

METRICS = 20


def store(points: int) -> tuple[str, list[int]]:
    """Token and ids of two runs, each with ``points`` points (see the module docstring)."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.models import MetricPoint
    from server.services import metrics, runs, tokens

    steps = points // METRICS
    ids = []
    with Session(engine) as s:
        _, token = tokens.create(s, name="bench")
        for r in range(2):
            run = runs.create(
                s,
                data={"name": f"bench-export-{r}", "max_steps": steps, "model": {"name": "bench/no-such-model"}},
                owner="bench",
            )
            for first in range(0, steps, 1000):
                batch = [
                    MetricPoint(
                        source="trainer" if m % 2 else "orchestrator",
                        step=n,
                        name=f"m{m:02d}",
                        value=m / (n + 1),
                        time=1e9 + n,
                    )
                    for n in range(first, min(first + 1000, steps))
                    for m in range(METRICS)
                ]
                metrics.ingest(s, run_id=run.id, points=batch)  # type: ignore[arg-type]
            s.commit()
            ids.append(int(run.id))  # type: ignore[arg-type]
    engine.dispose()
    return token, ids


def rows_in(fmt: str, body: bytes) -> int:
    if fmt == "csv":
        return sum(1 for _ in csv.reader(io.StringIO(body.decode()))) - 1
    import pyarrow.parquet as pq

    return int(pq.read_metadata(io.BytesIO(body)).num_rows)


def main() -> int:
    args, rounds = C.rounds_args(__doc__, rounds=10, quick=3, points="metric points stored per run")
    started, machine = time.time(), C.machine_facts()
    import httpx

    cases = []
    with C.stored_server(lambda: store(args.points), C.TMP / "metric_export_server.log") as ((token, (a, b)), s, url):
        C.say(f"[bench] stored 2 x {args.points:,} points in {s:.1f}s")
        headers = {"Authorization": f"Bearer {token}"}
        requests = [
            ("csv", "one run", f"/api/runs/{a}/metrics/export", {"format": "csv"}, args.points),
            ("parquet", "one run", f"/api/runs/{a}/metrics/export", {"format": "parquet"}, args.points),
            ("csv", "two runs", "/api/metrics/export", {"format": "csv", "run": [a, b]}, 2 * args.points),
            ("parquet", "two runs", "/api/metrics/export", {"format": "parquet", "run": [a, b]}, 2 * args.points),
        ]
        with httpx.Client(base_url=url, timeout=120, headers=headers) as client:
            for fmt, what, path, params, expect in requests:
                times, size = C.Timings(), 0
                for r in range(rounds + C.WARMUP_ROUNDS):
                    resp = times.send(lambda path=path, params=params: client.get(path, params=params), r)
                    if resp.status_code != 200 or rows_in(fmt, resp.content) != expect:
                        raise RuntimeError(f"{path} {params}: {resp.status_code} {resp.text[:200]}")
                    size = len(resp.content)
                cases.append({"format": fmt, "export": what, "points": expect, "bytes": size, **times.summary()})
                C.say(f"[bench] {fmt} {what}: server p50 {cases[-1]['server_ms_p50']} ms")
    payload = {
        "points_per_run": args.points,
        "rounds": rounds,
        "results": cases,
        "goals": {"server_ms_100k_points": 2000},
        "setup": C.SERVER_SETUP,
    }
    out = C.write_result("metric_export", payload, quick=args.quick, started=started, machine=machine)
    table = C.md_table(
        ["export", "format", "points", "KiB", *C.LATENCY_HEADERS],
        [[c["export"], c["format"], f"{c['points']:,}", round(c["bytes"] / 1024), *C.Timings.cells(c)] for c in cases],
    )
    return C.finish(out, table)


if __name__ == "__main__":
    sys.exit(main())
