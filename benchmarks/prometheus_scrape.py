"""Prometheus scrape of 100 live runs: time and server CPU of ``GET /metrics`` with the per-run metrics.

1. A scratch database (``bench_support.scratch_database``) with ``--runs`` runs (default 100) marked ``running``,
   each with ``--names`` metric series (default 30: 20 from the orchestrator, 10 from the trainer) of ``--steps``
   steps (default 300): 900,000 stored points by default.
2. ``asyncrl server --no-migrate`` (one uvicorn process) on a free 127.0.0.1 port.
3. ``R`` scrapes of ``GET /metrics`` (after 2 warm-up scrapes), one after the other as one Prometheus does: p50/p99
   of the app's time (``Server-Timing``) and of the client time, the exposition's size and series, and the server
   process's CPU seconds (user + system, from ``/proc``) over the timed scrapes divided by ``R``.
4. The index ``ix_metrics_latest`` dropped, then one warm-up and ``--no-index-rounds`` more scrapes (default 2): what
   the scrape costs without it.

Goal: p99 < 200 ms server time at 100 live runs. Run: ``.venv/bin/python benchmarks/prometheus_scrape.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

GOAL_P99_MS = 200


def names(count: int) -> list[tuple[str, str]]:
    """``count`` (source, name) series: two thirds from the orchestrator, the rest from the trainer."""
    orchestrator = count * 2 // 3
    return [("orchestrator", f"bench/o{i}") for i in range(orchestrator)] + [
        ("trainer", f"bench/t{i}") for i in range(count - orchestrator)
    ]


def store(runs_n: int, series: list[tuple[str, str]], steps: int) -> tuple[str, list[int]]:
    """``runs_n`` running runs with ``steps`` points of every series, and a read token (the per-run series are served
    only to a scrape with a user token); ``(the token, the run ids)``."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.models import MetricPoint, RunStatus
    from server.services import metrics, runs, tokens

    ids = []
    with Session(engine) as s:
        for r in range(runs_n):
            run = runs.create(s, data={"name": f"bench-{r}", "model": {"name": "bench/no-such-model"}}, owner="bench")
            run.status = RunStatus.running
            s.add(run)
            s.flush()
            points = [
                MetricPoint(source=src, step=st, name=name, value=r + st / 1000, time=float(st))
                for st in range(steps)
                for src, name in series
            ]
            metrics.ingest(s, run_id=int(run.id), points=points)  # type: ignore[arg-type]  # flushed: it has an id
            ids.append(int(run.id))  # type: ignore[arg-type]
        _, token = tokens.create(s, name="prometheus", scope="read")
        s.commit()
    engine.dispose()
    return token, ids


def server_pid() -> int:
    """The pid of the ``asyncrl server`` this process started (``bench_support.api_server``)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == os.getpid() and b"server" in cmd:
            return int(entry)
    raise RuntimeError("asyncrl server process not found")


def db_cpu_s() -> float:
    """CPU seconds of the Postgres backends serving the scratch database (the server's pooled connections), from
    /proc; Postgres runs on this machine."""
    from sqlalchemy import text

    from server.core.db import engine

    with engine.connect() as conn:
        pids = conn.execute(
            text("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
        ).scalars()
        return sum(C.tree_cpu_s(int(p)) for p in pids)


def scrapes(url: str, token: str, rounds: int, pid: int, warmup: int = C.WARMUP_ROUNDS) -> dict:
    """``rounds`` timed scrapes after ``warmup`` untimed ones: times, size, series, and the CPU per scrape of the server process
    and of the Postgres backends."""
    import httpx

    times = C.Timings()
    with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {token}"}) as client:
        for _ in range(warmup):
            times.send(lambda: client.get("/metrics"), 0)
        cpu0, db0 = C.tree_cpu_s(pid), db_cpu_s()
        for _ in range(rounds):
            resp = times.send(lambda: client.get("/metrics"))
            resp.raise_for_status()
        cpu, db = (C.tree_cpu_s(pid) - cpu0) / rounds, (db_cpu_s() - db0) / rounds
    lines = [x for x in resp.text.splitlines() if x.startswith("asyncrl_run_metric{")]
    return {
        "scrapes": rounds,
        "bytes": len(resp.content),
        "run_metric_series": len(lines),
        "server_cpu_ms_per_scrape": round(cpu * 1000, 1),
        "postgres_cpu_ms_per_scrape": round(db * 1000, 1),
        **times.summary(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 runs of 20 steps, 5 scrapes, 1 without the index")
    ap.add_argument("--runs", type=int, default=None, help="live runs (default 100; quick 5)")
    ap.add_argument("--names", type=int, default=30, help="metric series a run")
    ap.add_argument("--steps", type=int, default=None, help="steps of every series (default 300; quick 20)")
    ap.add_argument("--rounds", type=int, default=None, help="timed scrapes (default 50; quick 5)")
    ap.add_argument("--no-index-rounds", type=int, default=None, help="scrapes without the index (default 2)")
    args = ap.parse_args()
    runs_n = args.runs or (5 if args.quick else 100)
    steps = args.steps or (20 if args.quick else 300)
    rounds = args.rounds or (5 if args.quick else 50)
    no_index_rounds = args.no_index_rounds if args.no_index_rounds is not None else (1 if args.quick else 2)
    series = names(args.names)
    started, machine = time.time(), C.machine_facts()

    log = C.TMP / "prometheus_scrape_server.log"
    with C.stored_server(lambda: store(runs_n, series, steps), log) as ((token, ids), stored_s, url):
        C.say(f"[bench] {runs_n} runs x {len(series)} series x {steps} steps stored in {stored_s:.0f} s")
        pid = server_pid()
        with_index = scrapes(url, token, rounds, pid)
        from server.core.config import settings

        expected = min(runs_n, settings.PROMETHEUS_MAX_RUNS) * min(len(series), settings.PROMETHEUS_MAX_METRICS_PER_RUN)
        if with_index["run_metric_series"] != expected:
            raise RuntimeError(f"expected {expected} asyncrl_run_metric series, got {with_index['run_metric_series']}")
        C.say(f"[bench] with the index: server p50 {with_index['server_ms_p50']} ms p99 {with_index['server_ms_p99']}")
        without = None
        if no_index_rounds:
            from sqlalchemy import text

            from server.core.db import engine

            with engine.begin() as conn:
                conn.execute(text("DROP INDEX ix_metrics_latest"))
            engine.dispose()
            without = scrapes(url, token, no_index_rounds, pid, warmup=1)
            C.say(f"[bench] without the index: server p50 {without['server_ms_p50']} ms")

    payload = {
        "runs": runs_n,
        "series_per_run": len(series),
        "steps": steps,
        "points": runs_n * len(series) * steps,
        "store_s": round(stored_s, 1),
        "with_index": with_index,
        "without_index": without,
        "goal_p99_ms": GOAL_P99_MS,
        "setup": C.SERVER_SETUP,
    }
    out = C.write_result("prometheus_scrape", payload, quick=args.quick, started=started, machine=machine)
    label = f"{runs_n} live runs x {len(series)} series, {payload['points']:,} points stored"
    rows = [
        [
            f"{label}, index ix_metrics_latest",
            r["scrapes"],
            r["run_metric_series"],
            round(r["bytes"] / 1024),
            r["server_cpu_ms_per_scrape"],
            r["postgres_cpu_ms_per_scrape"],
            *C.Timings.cells(r),
        ]
        for r in [with_index]
    ]
    if without:
        rows.append(
            [
                "the same without the index",
                without["scrapes"],
                without["run_metric_series"],
                round(without["bytes"] / 1024),
                without["server_cpu_ms_per_scrape"],
                without["postgres_cpu_ms_per_scrape"],
                *C.Timings.cells(without),
            ]
        )
    headers = [
        "GET /metrics",
        "scrapes",
        "run series",
        "KiB",
        "server CPU ms/scrape",
        "Postgres CPU ms/scrape",
        *C.LATENCY_HEADERS,
    ]
    return C.finish(out, C.md_table(headers, rows))


if __name__ == "__main__":
    sys.exit(main())
