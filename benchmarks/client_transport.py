"""The inference client's own CPU per completion request, A/B between two checkouts.

One simulated server (``benchmarks/sim_inference.py``, its default latency model: 50 ms + 10 ms per token of the
longest completion, log-normal lengths around 48 tokens cut at ``max_tokens`` 128) and, in turn, one client process
per checkout (``--roots``; each imports ``worker.inference.client`` from its own tree, first on ``sys.path``) that
keeps ``--concurrency`` requests of ``n = 16`` completions in flight with ``InferenceClient.generate``, as the
orchestrator does at 4,096 rollouts in flight (256 groups of 16). Measured in the client process, after
``2 * concurrency`` warm-up requests, over ``--requests`` requests: its CPU seconds (``time.process_time``: user +
system, this process only) per request, and requests/s. Nothing else runs in the client process (no scoring, no
batches), so the difference between two checkouts is their HTTP path: transport, connection pool, JSON body,
retries wrapper and reply decoding. Checkouts take turns for ``--rounds`` rounds against the same server.

Run: ``.venv/bin/python benchmarks/client_transport.py --roots /work/main .`` (~1 min per round on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

PROMPT = list(range(40, 80))
"""40 prompt token ids (the reverse-text prompts of the tiny tokenizer are ~30-60)."""


def client(root: Path, url: str, requests: int, concurrency: int) -> dict[str, Any]:
    """Keep ``concurrency`` generate calls in flight until ``requests`` (after the warm-up) have answered, with the
    ``InferenceClient`` of checkout ``root``."""
    sys.path.insert(0, str(root))  # ahead of this checkout (bench_support puts it on the path)
    import worker.inference.client as module
    from worker.inference.client import InferenceClient

    if Path(module.__file__ or "").resolve() != root / "worker" / "inference" / "client.py":
        raise SystemExit(f"imported {module.__file__}, not the client of {root}")

    async def run() -> dict[str, Any]:
        async with InferenceClient(url, read_timeout_s=120) as c:
            sem = asyncio.Semaphore(concurrency)

            async def one() -> int:
                async with sem:
                    out = await c.generate(PROMPT, n=16, max_tokens=128, temperature=1.0)
                    return sum(len(x.token_ids) for x in out)

            await asyncio.gather(*[one() for _ in range(2 * concurrency)])
            cpu0, t0 = time.process_time(), time.perf_counter()
            tokens = sum(await asyncio.gather(*[one() for _ in range(requests)]))
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        return {
            "client": module.__file__,
            "requests": requests,
            "completions": 16 * requests,
            "tokens": tokens,
            "cpu_s": cpu,
            "wall_s": wall,
            "cpu_ms_per_request": 1000 * cpu / requests,
            "requests_per_s": requests / wall,
        }

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/client_transport.py")
    p.add_argument("--roots", type=Path, nargs="+", default=[C.ROOT], help="checkouts to compare, in turn")
    p.add_argument("--requests", type=int, default=3000, help="measured requests per client run")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--name", default="client_transport", help="result file benchmarks/results/<name>.json")
    p.add_argument("--quick", action="store_true", help="400 requests, 64 in flight, 1 round")
    p.add_argument("--client", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client is not None:
        sys.stdout.write(
            json.dumps(client(args.roots[0].resolve(), args.client, args.requests, args.concurrency)) + "\n"
        )
        return 0
    if args.quick:
        args.requests, args.concurrency, args.rounds = 400, 64, 1
    started, machine = time.time(), C.machine_facts()
    roots = [r.resolve() for r in args.roots]
    heads = {
        str(r): subprocess.run(
            ["git", "-C", str(r), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        for r in roots
    }
    port = C.free_port()
    url = f"http://127.0.0.1:{port}"
    log = C.TMP / "client_transport_sim.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, str(C.ROOT / "benchmarks" / "sim_inference.py"), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(C.ROOT)},
            start_new_session=True,
        )
    try:
        from orchestrator_scale import wait_health

        wait_health(url, server, log)
        for round_ in range(1, args.rounds + 1):
            for root in roots:
                load0 = os.getloadavg()[0]
                cmd = [sys.executable, str(Path(__file__).resolve()), "--client", url, "--roots", str(root)]
                cmd += ["--requests", str(args.requests), "--concurrency", str(args.concurrency)]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900)
                row = {"round": round_, "root": str(root), "head": heads[str(root)], **json.loads(done.stdout)}
                row["loadavg_start_end"] = [load0, os.getloadavg()[0]]
                C.say(
                    f"[bench] round {round_} {root} ({row['head']}): {row['cpu_ms_per_request']:.3f} CPU ms / request, "
                    f"{row['requests_per_s']:.0f} requests/s"
                )
                rows.append(row)
    finally:
        server.terminate()
        server.wait(timeout=30)
    payload = {
        "setup": {
            "sim_server": "benchmarks/sim_inference.py defaults (50 ms + 10 ms/token, len median 48, cut 128)",
            "n": 16,
            "max_tokens": 128,
            "prompt_tokens": len(PROMPT),
            "concurrency": args.concurrency,
            "requests": args.requests,
            "warmup_requests": 2 * args.concurrency,
        },
        "runs": rows,
    }
    path = C.write_result(args.name, payload, quick=args.quick, started=started, machine=machine)
    table = C.md_table(
        ["round", "checkout", "head", "load avg start -> end", "client CPU ms / request", "requests/s"],
        [
            [
                r["round"],
                r["root"],
                r["head"],
                f"{r['loadavg_start_end'][0]:.1f} -> {r['loadavg_start_end'][1]:.1f}",
                r["cpu_ms_per_request"],
                r["requests_per_s"],
            ]
            for r in rows
        ],
    )
    return C.finish(path, table)


if __name__ == "__main__":
    raise SystemExit(main())
