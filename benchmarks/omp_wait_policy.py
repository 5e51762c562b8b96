"""Torch's OpenMP threads on an oversubscribed CPU box: the default wait policy (spin) against ``OMP_WAIT_POLICY=
PASSIVE`` (a waiting thread sleeps).

Each configuration runs ``--jobs`` copies of the same short SFT at once (``asyncrl sft @
configs/reverse_tool/sft.toml``, the tiny model, ``--steps`` steps, ``threads = 2`` as the config says) and records the
wall time of the slowest: ``--jobs 2`` on two cores is what the test suite's real-run pass does (two tests at once, each
with a trainer of two threads beside a vLLM server); ``--jobs 1`` is one run alone. The policies alternate round by
round, so a change of load on the box falls on both.

Run: ``.venv/bin/python benchmarks/omp_wait_policy.py [--jobs 1,2] [--steps 20] [--rounds 2] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

POLICIES = {"default": None, "passive": "PASSIVE"}


def sft_wall(model: Path, work: Path, jobs: int, steps: int, policy: str | None) -> float:
    """Seconds until all ``jobs`` SFTs started together have ended (each must exit 0)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    config = C.ROOT / "configs" / "reverse_tool" / "sft.toml"
    t0 = time.perf_counter()
    procs = []
    for j in range(jobs):
        out = Path(tempfile.mkdtemp(dir=work))
        argv = [sys.executable, "-m", "worker.cli", "sft", "@", str(config), "--model.name", str(model)]
        argv += ["--output_dir", str(out), "--name", f"job{j}", "--max_steps", str(steps)]
        log = (out / "sft.log").open("w")
        procs.append((subprocess.Popen(argv, env=env, cwd=C.ROOT, stdout=log, stderr=subprocess.STDOUT), out))
    for proc, out in procs:
        if proc.wait() != 0:
            raise SystemExit(f"asyncrl sft failed (exit {proc.returncode}): see {out / 'sft.log'}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", default="1,2", help="comma-separated numbers of SFTs at once (default 1,2)")
    ap.add_argument("--steps", type=int, default=20, help="SFT steps per job (default 20)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per configuration (default 2)")
    ap.add_argument("--quick", action="store_true", help="3 steps, one round")
    args = ap.parse_args()
    steps, rounds = (3, 1) if args.quick else (args.steps, args.rounds)
    started, machine = time.time(), C.machine_facts()
    from worker.policy.models import init_model

    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = init_model(work / "tiny", size="tiny", seed=0)
        for jobs in (int(j) for j in args.jobs.split(",")):
            walls: dict[str, list[float]] = {name: [] for name in POLICIES}
            for r in range(rounds):
                for name, policy in POLICIES.items():
                    walls[name].append(round(sft_wall(model, work, jobs, steps, policy), 1))
                    C.say(f"jobs {jobs} round {r + 1}: {name} {walls[name][-1]} s")
            default, passive = C.median(walls["default"]), C.median(walls["passive"])
            results.append({"jobs": jobs, "steps": steps, "wall_s": walls})
            rows.append([jobs, steps, default, passive, round(default / passive, 2)])
    path = C.write_result("omp_wait_policy", {"runs": results}, quick=args.quick, started=started, machine=machine)
    table = C.md_table(["SFTs at once", "steps", "default s (median)", "PASSIVE s (median)", "default / PASSIVE"], rows)
    return C.finish(path, table)


if __name__ == "__main__":
    raise SystemExit(main())
