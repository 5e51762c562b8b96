"""Control-plane throughput: metric ingestion and downsampled series queries through the real server.

1. Create a scratch database ``asyncrl_bench_<random>`` on the local Postgres (``ASYNCRL_BENCH_POSTGRES``,
   default ``postgresql://postgres@127.0.0.1:5432``), ``alembic upgrade head``, a user token and two runs.
2. Start ``asyncrl server --no-migrate`` (uvicorn, one process) on a free 127.0.0.1 port.
3. **Ingestion**: ``B`` batches of 1000 points (10 metric names x 100 steps, new keys every batch) posted
   one after the other with httpx, as a run's supervisor does, after 3 warm-up batches; then the same with
   ``--concurrency`` clients at once (as several runs do). Points/s = points / wall seconds; p50/p99 of
   the per-batch latency (client side, and the app's own time from the ``Server-Timing`` header).
4. **Query**: one series of 100,000 points (a second run), then ``Q`` ``GET /api/runs/{id}/metrics?name=...
   &max_points=1000`` after 2 warm-up queries: p50/p99 of the server time (``Server-Timing``) and of the
   client time.
5. Stop the server and drop the scratch database (all rows go with it), also on errors.

Goals: ingestion >= 20,000 points/s, query <= 300 ms server time.
Run: ``.venv/bin/python benchmarks/service_throughput.py [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

NAMES = [f"bench/m{i}" for i in range(10)]


def batch(first_step: int, size: int, names: list[str]) -> dict:
    steps = size // len(names)
    t = time.time()
    return {
        "points": [
            {"source": "trainer", "step": first_step + s, "name": n, "value": 0.001 * s, "time": t}
            for s in range(steps)
            for n in names
        ]
    }


def ingest(url: str, headers: dict, run_id: int, *, batches: int, size: int, concurrency: int, offset: int) -> dict:
    """``batches`` batches of ``size`` points in total, split over ``concurrency`` client threads."""
    import httpx

    per_step = size // len(NAMES)
    bodies = [batch(offset + i * per_step, size, NAMES) for i in range(batches)]
    times, errors = C.Timings(), []

    def worker(k: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
            for body in bodies[k::concurrency]:
                t0 = time.perf_counter()
                resp = client.post(f"/api/runs/{run_id}/metrics", json=body)
                times.add(resp, (time.perf_counter() - t0) * 1000)
                if resp.status_code != 200 or resp.json()["inserted"] != len(body["points"]):
                    errors.append(resp.text[:200])  # list.append is atomic: the threads share the list

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"ingestion failed: {errors[0]}")
    return {
        "concurrency": concurrency,
        "batches": batches,
        "batch_points": size,
        "points": batches * size,
        "wall_s": round(wall, 3),
        "points_per_s": round(batches * size / wall),
        **times.summary(),
    }


def _measure(
    args: argparse.Namespace, url: str, headers: dict, ids: list[int], batches: int, queries: int
) -> tuple[dict, dict, dict]:
    """The ingestion passes (1 client, then ``--concurrency``) and the series queries against the server."""
    import httpx

    size = args.batch_points
    ingest(url, headers, ids[0], batches=3, size=size, concurrency=1, offset=0)  # warm-up
    step0 = 3 * size // len(NAMES)
    seq = ingest(url, headers, ids[0], batches=batches, size=size, concurrency=1, offset=step0)
    C.say(f"[bench] ingestion, 1 client: {seq['points_per_s']:,} points/s, p50 {seq['latency_ms_p50']} ms")
    step1 = step0 + batches * size // len(NAMES)
    par = ingest(url, headers, ids[0], batches=batches, size=size, concurrency=args.concurrency, offset=step1)
    C.say(f"[bench] ingestion, {args.concurrency} clients: {par['points_per_s']:,} points/s")

    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        for i in range(0, args.series_points, 5000):
            n = min(5000, args.series_points - i)
            body = {
                "points": [
                    {
                        "source": "trainer",
                        "step": i + s,
                        "name": "bench/series",
                        "value": math.sin((i + s) / 100),
                        "time": 0.0,
                    }
                    for s in range(n)
                ]
            }
            client.post(f"/api/runs/{ids[1]}/metrics", json=body).raise_for_status()
        params = {"name": "bench/series", "max_points": args.max_points}
        times = C.Timings()
        for q in range(queries + C.WARMUP_ROUNDS):
            resp = times.send(lambda: client.get(f"/api/runs/{ids[1]}/metrics", params=params), q)
            resp.raise_for_status()
            series = resp.json()["series"][0]
            assert series["total"] == args.series_points and len(series["step"]) <= args.max_points + 1
    query = {
        "series_points": args.series_points,
        "max_points": args.max_points,
        "returned": len(series["step"]),
        "queries": queries,
        **times.summary(),
    }
    C.say(f"[bench] series query: server p50 {query['server_ms_p50']} ms p99 {query['server_ms_p99']} ms")
    return seq, par, query


def store() -> tuple[str, list]:
    """A user token and the ids of two empty runs (the ingestion run and the query run)."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.services import runs, tokens

    with Session(engine) as s:
        _, token = tokens.create(s, name="bench")
        ids = [
            runs.create(s, data={"name": f"bench-{i}", "model": {"name": "bench/no-such-model"}}, owner="bench").id
            for i in range(2)
        ]
        s.commit()
    engine.dispose()
    return token, ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny counts: 20 batches, 5 queries")
    ap.add_argument("--batches", type=int, default=None, help="timed ingestion batches (default 200; quick 20)")
    ap.add_argument("--batch-points", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=4, help="clients of the concurrent ingestion pass")
    ap.add_argument("--series-points", type=int, default=100_000)
    ap.add_argument("--max-points", type=int, default=1000)
    ap.add_argument("--queries", type=int, default=None, help="timed series queries (default 20; quick 5)")
    args = ap.parse_args()
    batches = args.batches or (20 if args.quick else 200)
    queries = args.queries or (5 if args.quick else 20)
    started, machine = time.time(), C.machine_facts()

    with C.stored_server(store, C.TMP / "service_throughput_server.log") as ((token, ids), _, url):
        headers = {"Authorization": f"Bearer {token}"}
        seq, par, query = _measure(args, url, headers, ids, batches, queries)

    payload = {
        "ingestion": [seq, par],
        "query": query,
        "goals": {"ingestion_points_per_s": 20_000, "query_server_ms": 300},
        "setup": C.SERVER_SETUP,
    }
    out = C.write_result("service_throughput", payload, quick=args.quick, started=started, machine=machine)
    rows = [
        [
            f"ingest {r['batch_points']}-point batches, {r['concurrency']} client(s)",
            r["points_per_s"],
            r["latency_ms_p50"],
            r["latency_ms_p99"],
            r["server_ms_p50"],
            r["server_ms_p99"],
        ]
        for r in (seq, par)
    ]
    rows.append(
        [
            f"query {query['series_points']:,} points, max_points {query['max_points']}",
            "-",
            query["latency_ms_p50"],
            query["latency_ms_p99"],
            query["server_ms_p50"],
            query["server_ms_p99"],
        ]
    )
    table = C.md_table(["what", "points/s", "client p50 ms", "client p99 ms", "server p50 ms", "server p99 ms"], rows)
    return C.finish(out, table)


if __name__ == "__main__":
    sys.exit(main())
