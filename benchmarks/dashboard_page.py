"""Dashboard run page with 100,000 stored points: server time of the HTML and of each live fragment.

1. A scratch database (``bench_support.scratch_database``), a user token and one run; 100,000 metric points stored
   for the run, spread evenly over every (source, metric) the run page draws (``webui.figures``), so each chart
   series is ~6,700 steps long and is downsampled to ``figures.MAX_POINTS``; one live config revision acknowledged
   by the trainer (a marker on every chart) and 64 rollout records of the newest step in the run directory.
2. ``asyncrl server --no-migrate`` (one uvicorn process); an httpx client logs in through ``/login``.
3. ``N`` rounds (after 2 warm-up rounds) of ``GET /runs/{id}`` (the whole page, charts included) and of each
   fragment the page polls (``?part=status|charts|events|rollouts|logs``): p50/p99 of the app's time from the
   ``Server-Timing`` header and of the client time.

Goal: the run page <= 300 ms server time. Run: ``.venv/bin/python benchmarks/dashboard_page.py [--quick]``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

PARTS = ("", "status", "charts", "events", "rollouts", "logs")


def store(points: int) -> tuple[str, int, int]:
    """Token, run id and points per series of the benchmark run (see the module docstring)."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.models import MetricPoint
    from server.services import config, metrics, runs, tokens
    from webui import figures
    from worker.rundir import RunDir, append_jsonl

    pairs = sorted({(src, name) for c in figures.CHARTS for src, name, _ in c.lines} | set(figures.BOTTLENECK_LINES))
    steps = points // len(pairs)
    with Session(engine) as s:
        _, token = tokens.create(s, name="bench")
        run = runs.create(
            s, data={"name": "bench-page", "max_steps": steps, "model": {"name": "bench/no-such-model"}}, owner="bench"
        )
        for first in range(1, steps + 1, 2000):
            batch = [
                MetricPoint(source=src, step=n, name=name, value=1.0 / n, time=float(n))
                for n in range(first, min(first + 2000, steps + 1))
                for src, name in pairs
            ]
            metrics.ingest(s, run_id=run.id, points=batch)  # type: ignore[arg-type]
        rev = config.create(s, run.id, {"trainer.optim.lr": 5e-5}, by="bench")  # type: ignore[arg-type]
        rev.applied = {"trainer": steps // 2}
        s.add(rev)
        s.commit()
        run_id, run_dir = int(run.id), run.run_dir  # type: ignore[arg-type]
    engine.dispose()
    rd = RunDir(run_dir)
    rd.rollouts.mkdir(parents=True)
    for i in range(64):
        append_jsonl(
            rd.rollout_file(steps),
            {"step": steps, "task": f"prompt {i}", "completion": "x" * 40, "reward": 0.5, "advantage": 0.1},
        )
    return token, run_id, steps


def login(client, token: str) -> None:  # noqa: ANN001 - httpx.Client
    csrf = re.search(r'name="csrf" value="([^"]+)"', client.get("/login").text).group(1)  # type: ignore[union-attr]
    resp = client.post("/login", data={"csrf": csrf, "token": token, "next": "/runs"})
    if resp.status_code != 303:
        raise RuntimeError(f"login failed: {resp.status_code} {resp.text[:200]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 rounds instead of 30")
    ap.add_argument("--points", type=int, default=100_000, help="metric points stored for the run")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 30; quick 5)")
    args = ap.parse_args()
    rounds = args.rounds or (5 if args.quick else 30)
    started, machine = time.time(), C.machine_facts()
    import httpx

    with C.scratch_database():
        t0 = time.perf_counter()
        token, run_id, steps = store(args.points)
        C.say(f"[bench] stored {args.points:,} points ({steps} steps per series) in {time.perf_counter() - t0:.1f}s")
        with C.api_server(C.TMP / "dashboard_page_server.log") as url, httpx.Client(base_url=url, timeout=60) as client:
            login(client, token)
            srv: dict[str, list[float]] = {p: [] for p in PARTS}
            lat: dict[str, list[float]] = {p: [] for p in PARTS}
            size: dict[str, int] = {}
            for r in range(rounds + 2):
                for part in PARTS:
                    t = time.perf_counter()
                    resp = client.get(f"/runs/{run_id}", params={"part": part} if part else None)
                    dt = (time.perf_counter() - t) * 1000
                    if resp.status_code != 200 or (not part and "data-figures" not in resp.text):
                        raise RuntimeError(f"/runs/{run_id}?part={part}: {resp.status_code} {resp.text[:200]}")
                    size[part] = len(resp.content)
                    if r >= 2:
                        srv[part].append(C.server_ms(resp))
                        lat[part].append(dt)
    results = [
        {
            "request": "/runs/{id}" + (f"?part={p}" if p else ""),
            "bytes": size[p],
            "server_ms_p50": round(C.percentile(srv[p], 50), 1),
            "server_ms_p99": round(C.percentile(srv[p], 99), 1),
            "latency_ms_p50": round(C.percentile(lat[p], 50), 1),
            "latency_ms_p99": round(C.percentile(lat[p], 99), 1),
        }
        for p in PARTS
    ]
    payload = {
        "points": args.points,
        "steps_per_series": steps,
        "rounds": rounds,
        "results": results,
        "goals": {"page_server_ms": 300},
        "setup": "one uvicorn process (asyncrl server) and the client on the same machine, Postgres on 127.0.0.1",
    }
    out = C.write_result("dashboard_page", payload, quick=args.quick, started=started, machine=machine)
    table = C.md_table(
        [
            f"request ({args.points:,} points stored)",
            "KiB",
            "server p50 ms",
            "server p99 ms",
            "client p50 ms",
            "client p99 ms",
        ],
        [
            [
                r["request"],
                round(r["bytes"] / 1024),
                r["server_ms_p50"],
                r["server_ms_p99"],
                r["latency_ms_p50"],
                r["latency_ms_p99"],
            ]
            for r in results
        ],
    )
    return C.finish(out, table)


if __name__ == "__main__":
    sys.exit(main())
