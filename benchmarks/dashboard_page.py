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
    from worker.run.rundir import RunDir, append_jsonl

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
    args, rounds = C.rounds_args(__doc__, rounds=30, quick=5, points="metric points stored for the run")
    started, machine = time.time(), C.machine_facts()
    import httpx

    log = C.TMP / "dashboard_page_server.log"
    with C.stored_server(lambda: store(args.points), log) as ((token, run_id, steps), s, url):
        C.say(f"[bench] stored {args.points:,} points ({steps} steps per series) in {s:.1f}s")
        with httpx.Client(base_url=url, timeout=60) as client:
            login(client, token)
            times = {p: C.Timings() for p in PARTS}
            size: dict[str, int] = {}
            for r in range(rounds + C.WARMUP_ROUNDS):
                for part in PARTS:
                    params = {"part": part} if part else None
                    resp = times[part].send(lambda params=params: client.get(f"/runs/{run_id}", params=params), r)
                    if resp.status_code != 200 or (not part and "data-figures" not in resp.text):
                        raise RuntimeError(f"/runs/{run_id}?part={part}: {resp.status_code} {resp.text[:200]}")
                    size[part] = len(resp.content)
    results = [
        {"request": "/runs/{id}" + (f"?part={p}" if p else ""), "bytes": size[p], **times[p].summary()} for p in PARTS
    ]
    payload = {
        "points": args.points,
        "steps_per_series": steps,
        "rounds": rounds,
        "results": results,
        "goals": {"page_server_ms": 300},
        "setup": C.SERVER_SETUP,
    }
    out = C.write_result("dashboard_page", payload, quick=args.quick, started=started, machine=machine)
    table = C.md_table(
        [f"request ({args.points:,} points stored)", "KiB", *C.LATENCY_HEADERS],
        [[r["request"], round(r["bytes"] / 1024), *C.Timings.cells(r)] for r in results],
    )
    return C.finish(out, table)


if __name__ == "__main__":
    sys.exit(main())
