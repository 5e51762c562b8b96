"""The fault matrix: every process of a real RL run and every service it depends on killed with SIGKILL
mid-run; time to detect, time to recover, steps lost, metric points lost or duplicated, processes left.

1. A stack of its own (``tests/support/faults.py``): a Postgres and a Redis started for it on free ports (never the
   shared ones), ``asyncrl server`` and ``asyncrl worker`` (Celery, embedded beat, reconcile every 2 s) on them.
2. One reverse-text RL run on the tiny random model (4 prompts x 4 samples, 16 tokens, checkpoint every 2 steps,
   ``max_async_level`` 1, ``--max-steps`` steps) and, while it trains, the cells of
   ``tests/support/fault_matrix.py``: the Celery worker, the API server, Postgres and Redis killed and restarted
   after ``--down`` seconds (the run must go on), then trainer, orchestrator, inference (vLLM) and the supervisor
   killed one step after a checkpoint (the run must fail, leave no process, and resume from the checkpoint).
3. The run must complete with its stored metric points equal to its ``metrics.jsonl``.

The same cells are the test ``tests/e2e/service/test_fault_matrix.py``. Writes ``benchmarks/results/fault_matrix.json``
(``table_md``: the README's "Fault matrix" table; ``benchmarks/update_readme.py`` copies it there).

Run: ``.venv/bin/python benchmarks/fault_matrix.py`` (about 12 minutes on 2 cores; run nothing else beside it).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-steps", type=int, default=150, help="trainer steps of the run")
    ap.add_argument("--down", type=float, default=5.0, help="seconds each service stays down before its restart")
    ap.add_argument("--services", default="worker,api,postgres,redis", help="service cells, in order")
    ap.add_argument("--processes", default="trainer,orchestrator,inference,supervisor", help="process cells")
    ap.add_argument("--keep", action="store_true", help="keep the stack's folder (logs, run directory)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop still stops the stack (the finally below)

    from tests.support.fault_matrix import FaultMatrix, table
    from tests.support.faults import Stack, new_root, remove
    from tests.support.runs import small_spec
    from worker.policy.models import init_model

    machine, started = C.machine_facts(), time.time()
    root = new_root()
    stack = Stack(root)
    try:
        stack.start()
        with tempfile.TemporaryDirectory() as tmp:
            model = init_model(Path(tmp) / "model", size="tiny", seed=0)
            spec = small_spec(model, "fault-matrix", max_steps=args.max_steps)
            matrix = FaultMatrix(stack, stack.token(), spec, down_s=args.down, say=C.say)
            matrix.submit()
            for name in filter(None, args.services.split(",")):
                matrix.service_cell(name)
            for name in filter(None, args.processes.split(",")):
                matrix.process_cell(name)
            final = matrix.finish()
    finally:
        stack.close()
        if args.keep:
            C.say(f"kept {root}")
        else:
            remove(root)
    C.say(str(final))
    payload = {
        "max_steps": args.max_steps,
        "down_s": args.down,
        "reconcile_interval_s": float(stack.env["RECONCILE_INTERVAL_S"]),
        "cells": [asdict(c) for c in matrix.cells],
        "final": final,
    }
    path = C.write_result("fault_matrix", payload, quick=False, started=started, machine=machine)
    return C.finish(path, table(matrix.cells, final))


if __name__ == "__main__":
    sys.exit(main())
