"""Orchestrator at scale: the real orchestrator against a simulated inference server at 256 / 1024 / 4096 rollouts
in flight.

Per level L, three processes on 127.0.0.1:

- the simulated OpenAI-compatible server ``benchmarks/sim_inference.py`` (latency ``ttft + per_token * length``
  with a log-normal jitter, log-normal completion lengths, token ids and logprobs in vLLM's shape);
- the orchestrator: ``worker.orchestrator.orchestrator.Orchestrator.main_loop`` itself (warm-up, eval, producer,
  groups of ``group_size`` through ``rollout_group`` on the ``reverse_text`` environment with the tiny model's
  tokenizer, batcher, ``batches/step_n.json`` write, rollout records, metrics, weight watcher with
  pause / load / reset / resume on every version). Each step holds ``L / (max_async_level + 1)`` rollouts and
  ``max_async_level`` is ``--async-level`` (default 1), so the producer's gate allows at most L rollouts in flight;
  the server reports how many were (time-average and maximum over the measured window);
- a stand-in trainer (``--trainer``): reads each batch with ``worker.orchestrator.batch.read_batch`` as the trainer does
  (timed) and publishes version n at once (``weights/step_n/STABLE``), so the orchestrator is never held by training.

Measured in the orchestrator process over the steps after ``--warmup-steps``: rollouts/s (rollouts of the steps
whose batches were written / seconds between the first and last of those writes), the event-loop lag (a ticker
task that sleeps ``TICK_S`` and records its oversleep, p50/p99/max in ms), RSS (peak, sampled every tick), and the
batch hand-off: the orchestrator's ``write_step`` (JSON + atomic write; packing is ``pack_step``, before it) and the trainer's ``read_batch``
(read + parse), median ms, with the batch's size. The run directory of each level stays under
``benchmarks/results/tmp/orchestrator_scale/`` as the record (config, batches, rollouts, metrics, weights markers).
``--profile`` records the orchestrator of the largest level with py-spy (``results/orchestrator_scale_profile.txt``:
the top functions by own and total samples).

``--admission continuous`` (or ``step continuous``: both, level by level) runs the orchestrator with
``orchestrator.admission = "continuous"`` (``worker/orchestrator/admission.py``: ``L / group_size`` groups kept in
flight, each batch the first groups to finish), a row per (admission, level); its ceiling is
:func:`continuous_ceiling`. A run that includes ``step`` (the default) writes ``results/orchestrator_scale.json`` (the
README's table), ``continuous`` alone ``results/orchestrator_scale_continuous.json``. Each level's run directory also
keeps, in its ``orchestrator_scale.json``, the ten largest loop lags with their time in the measured window, the times
the batches were written, and the garbage collector's pauses by generation (``worker/orchestrator/heap.py``).
``--slow-callback-ms N`` runs the orchestrator's loop in asyncio's debug mode and logs each callback that held it longer
than N ms (its ``logs/orchestrator.log``); ``--full-gc-every N`` sets the steps between full collections.

Run: ``.venv/bin/python benchmarks/orchestrator_scale.py`` (~3 min); ``--quick``: 256 only, few steps.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

TICK_S = 0.01
"""Period of the event-loop lag ticker (its oversleep past this is the lag)."""
OUT_DIR = C.TMP / "orchestrator_scale"
PAGE = os.sysconf("SC_PAGE_SIZE")


def tokenizer_model() -> Path:
    """The tiny Qwen3 of ``asyncrl model init`` (its byte-level tokenizer is what the orchestrator loads)."""
    out = C.TMP / "tiny-init"
    if not (out / "config.json").is_file():
        from worker.policy.models import init_model

        init_model(out, size="tiny", seed=0, overwrite=True)
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


# ---------------------------------------------------------------------------------------------- stand-in trainer


def trainer(run_dir: Path, steps: int) -> int:
    """Read every batch as the trainer does and publish its version at once; timings to ``trainer_handoff.json``."""
    from worker.orchestrator.batch import read_batch
    from worker.run.rundir import STABLE_MARKER, RunDir

    run = RunDir(run_dir)
    rows = []
    for step in range(1, steps + 1):
        path = run.batch(step)
        while not path.exists():
            time.sleep(0.002)
        t0 = time.perf_counter()
        batch = read_batch(path)
        read_s = time.perf_counter() - t0
        rows.append({"step": step, "read_s": read_s, "bytes": path.stat().st_size, "samples": batch["num_samples"]})
        folder = run.weight_dir(step)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STABLE_MARKER).write_text("")
    (run.root / "trainer_handoff.json").write_text(json.dumps(rows, indent=1))
    return 0


# ---------------------------------------------------------------------------------------------- orchestrator side


def orchestrator(
    run_dir: Path, url: str, warmup_steps: int, slow_callback_ms: float | None = None, full_gc_every: int | None = None
) -> int:
    """Run the real orchestrator's main loop on ``run_dir`` with a lag ticker; results to ``orchestrator_scale.json``
    in the run directory. ``slow_callback_ms``: asyncio debug mode, every callback or task step that holds the loop
    longer is logged (``asyncio`` logger, ``Executing <Task ...> took 0.123 seconds``)."""
    import httpx

    from worker.orchestrator import heap
    from worker.orchestrator.orchestrator import Orchestrator
    from worker.run.rundir import RunDir
    from worker.spec import RLSpec

    run = RunDir(run_dir)
    spec = RLSpec.model_validate_json(run.config.read_text())
    writes: dict[int, dict[str, float]] = {}
    window: dict[str, Any] = {}

    class Timed(Orchestrator):
        async def write_step(self, step: int, batch: Any) -> None:
            t0 = time.perf_counter()
            await super().write_step(step, batch)
            writes[step] = {"t": time.perf_counter(), "write_s": time.perf_counter() - t0}

    orch = Timed(spec, run, url, 0)
    gc_pauses: list[tuple[float, int, float]] = []  # (time, generation, seconds) of each cyclic GC collection
    gc_started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[:] = [time.perf_counter()]
        elif gc_started:
            gc_pauses.append((time.perf_counter(), info["generation"], time.perf_counter() - gc_started[0]))

    gc.callbacks.append(on_gc)
    heap.settle()  # as the orchestrator's process does before its loop
    if full_gc_every is not None:
        heap.FULL_COLLECTION_EVERY = full_gc_every
    lags: list[tuple[float, float]] = []
    rss: list[tuple[float, int]] = []

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(TICK_S)
            now = loop.time()
            lags.append((time.perf_counter(), now - t0 - TICK_S))
            rss.append((time.perf_counter(), rss_bytes()))

    async def server_window() -> None:
        async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
            while warmup_steps not in writes:
                await asyncio.sleep(0.005)
            await http.post("/sim/stats/reset")
            cpu0, tree0 = time.process_time(), C.tree_cpu_s(os.getpid())
            while spec.max_steps not in writes:
                await asyncio.sleep(0.005)
            window["cpu_s"] = time.process_time() - cpu0
            window["tree_cpu_s"] = C.tree_cpu_s(os.getpid()) - tree0
            window["server"] = (await http.get("/sim/stats")).json()

    async def main() -> None:
        if slow_callback_ms is not None:
            loop = asyncio.get_running_loop()
            loop.set_debug(True)
            loop.slow_callback_duration = slow_callback_ms / 1000
        tick = asyncio.create_task(ticker())
        stats = asyncio.create_task(server_window())
        try:
            await orch.main_loop()
            await stats
        finally:
            tick.cancel()
            stats.cancel()

    asyncio.run(main())
    t_first, t_last = writes[warmup_steps]["t"], writes[spec.max_steps]["t"]
    per_step = spec.orchestrator.batch_size * spec.orchestrator.group_size
    rollouts = per_step * (spec.max_steps - warmup_steps)
    lag_ms = [1000 * x for t, x in lags if t_first <= t <= t_last]
    result = {
        "rollouts": rollouts,
        "seconds": t_last - t_first,
        "rollouts_per_s": rollouts / (t_last - t_first),
        "loop_lag_p50_ms": C.percentile(lag_ms, 50),
        "loop_lag_p99_ms": C.percentile(lag_ms, 99),
        "loop_lag_max_ms": max(lag_ms),
        "loop_lag_top_ms_at_s": sorted(
            ([round(1000 * x, 1), round(t - t_first, 3)] for t, x in lags if t_first <= t <= t_last), reverse=True
        )[:10],
        "batch_written_at_s": {s: round(w["t"] - t_first, 3) for s, w in sorted(writes.items())},
        "ticks": len(lag_ms),
        "rss_peak_mb": max(b for _, b in rss) / 2**20,
        "rss_window_peak_mb": max(b for t, b in rss if t_first <= t <= t_last) / 2**20,
        "write_step_ms": [1000 * writes[s]["write_s"] for s in sorted(writes)],
        "gc_ms_by_generation": {
            g: sorted(round(1000 * d, 1) for t, gen, d in gc_pauses if gen == g and t_first <= t <= t_last)
            for g in (0, 1, 2)
        },
        "gc_full_ms_whole_run": [round(1000 * d, 1) for _, gen, d in gc_pauses if gen == 2],
        "full_collection_every_steps": heap.FULL_COLLECTION_EVERY,
        "orchestrator_main_cpu_s": window["cpu_s"],
        "orchestrator_main_cpu_ms_per_rollout": 1000 * window["cpu_s"] / rollouts,
        "orchestrator_cpu_s": window["tree_cpu_s"],
        "orchestrator_cpu_ms_per_rollout": 1000 * window["tree_cpu_s"] / rollouts,
        "server_cpu_ms_per_rollout": 1000 * window["server"]["cpu_s"] / rollouts,
        "server": window["server"],
    }
    (run.root / "orchestrator_scale.json").write_text(json.dumps(result, indent=1))
    return 0


# ---------------------------------------------------------------------------------------------- driver


def wait_health(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"simulated server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)


def run_level(
    level: int, args: argparse.Namespace, model: Path, profile: Path | None, admission: str = "step"
) -> dict[str, Any]:
    from worker.run.rundir import RunDir

    async_level = args.async_level
    per_step = level // (async_level + 1)
    if per_step % args.group_size:
        raise SystemExit(f"--levels: {level} / {async_level + 1} is not a multiple of --group-size {args.group_size}")
    steps = args.warmup_steps + args.steps
    name = f"inflight_{level}" if admission == "step" else f"inflight_{level}_{admission}"
    spec = C.rl_spec(
        model,
        name,
        [
            ("orchestrator.admission", admission),
            ("output_dir", str(OUT_DIR)),
            ("max_steps", str(steps)),
            ("orchestrator.batch_size", str(per_step // args.group_size)),
            ("orchestrator.group_size", str(args.group_size)),
            ("orchestrator.max_tokens", str(args.max_tokens)),
            ("orchestrator.seq_len", str(args.seq_len)),
            ("inference.max_model_len", str(args.seq_len)),
            ("orchestrator.max_async_level", str(async_level)),
            ("orchestrator.eval.num_examples", "16"),
            ("orchestrator.eval.interval", "0"),
        ],
    )
    run = RunDir(OUT_DIR / name)
    shutil.rmtree(run.root, ignore_errors=True)
    run.create()
    run.config.write_text(spec.model_dump_json(indent=1))
    port = C.free_port()
    url = f"http://127.0.0.1:{port}"
    sim_args = [
        "--ttft-ms",
        str(args.ttft_ms),
        "--per-token-ms",
        str(args.per_token_ms),
        "--len-mean",
        str(args.len_mean),
    ]
    (run.root / "sim_server.json").write_text(json.dumps({"argv": sim_args}))
    here = Path(__file__).resolve()
    env = {**os.environ, "PYTHONPATH": str(C.ROOT)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        log = run.logs / "sim_server.log"
        with open(log, "wb") as out:
            server = subprocess.Popen(
                [sys.executable, str(C.ROOT / "benchmarks" / "sim_inference.py"), "--port", str(port), *sim_args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        procs.append(server)
        wait_health(url, server, log)
        with open(run.logs / "trainer.log", "wb") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(here), "--trainer", str(run.root), "--steps", str(steps)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
        cmd = [
            sys.executable,
            str(here),
            "--async-level",
            str(async_level),
            "--orchestrator",
            str(run.root),
            "--url",
            url,
            "--warmup-steps",
            str(args.warmup_steps),
            *(["--slow-callback-ms", str(args.slow_callback_ms)] if args.slow_callback_ms is not None else []),
            *(["--full-gc-every", str(args.full_gc_every)] if args.full_gc_every is not None else []),
        ]
        if profile is not None:
            cmd = [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--nonblocking",
                "--format",
                "raw",
                "--rate",
                "50",
                "-o",
                str(profile),
                "--",
                *cmd,
            ]
        with open(run.logs / "orchestrator.log", "wb") as out:
            subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=True, timeout=900)
        procs[1].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
    o = json.loads((run.root / "orchestrator_scale.json").read_text())
    t = json.loads((run.root / "trainer_handoff.json").read_text())[args.warmup_steps :]
    return {
        "inflight": level,
        "admission": admission,
        "max_async_level": async_level,
        "group_size": args.group_size,
        "rollouts_per_step": per_step,
        **{k: v for k, v in o.items() if k != "write_step_ms"},
        "inflight_mean_measured": o["server"]["inflight_mean"],
        "inflight_max_measured": o["server"]["inflight_max"],
        "handoff_write_ms": C.median(o["write_step_ms"][args.warmup_steps :]),
        "handoff_read_ms": C.median([1000 * r["read_s"] for r in t]),
        "batch_mb": C.median([r["bytes"] / 2**20 for r in t]),
        "run_dir": str(run.root.relative_to(C.ROOT)),
    }


def gate_ceiling(level: int, args: argparse.Namespace, steps: int = 400, seed: int = 0) -> float:
    """Rollouts/s of a zero-cost orchestrator, trainer and weight update at ``level`` under the same start gate.

    The simulated server's latency model (``sim_inference.SimState``: group latency ``(ttft + per_token * longest of
    group_size log-normal lengths cut at max_tokens) * log-normal jitter``) sampled for ``steps`` steps of
    ``level / (k + 1)`` rollouts, ``k = --async-level``: step n starts when batch n - 1 - k is written (its version
    served), and batch n is written when its slowest group answered (and batch n - 1 was). Rollouts/s as measured:
    the steps after ``--warmup-steps``. The bound the benchmark's gate puts on any orchestrator.
    """
    from sim_inference import SimConfig

    c = SimConfig(ttft_ms=args.ttft_ms, per_token_ms=args.per_token_ms, len_mean=args.len_mean, seed=seed)
    rng = random.Random(seed)

    def group_s() -> float:
        longest = max(
            min(max(1, round(c.len_mean * math.exp(rng.gauss(0.0, c.len_sigma)))), args.max_tokens)
            for _ in range(args.group_size)
        )
        return (c.ttft_ms + c.per_token_ms * longest) * math.exp(rng.gauss(0.0, c.jitter_sigma)) / 1000.0

    k = args.async_level
    per_step = level // (k + 1)
    groups = per_step // args.group_size
    written = [0.0] * (steps + 1)
    for n in range(1, steps + 1):
        start = written[n - 1 - k] if n > 1 + k else 0.0
        written[n] = max(written[n - 1], start + max(group_s() for _ in range(groups)))
    w = args.warmup_steps
    return (steps - w) * per_step / (written[steps] - written[w])


def continuous_ceiling(level: int, args: argparse.Namespace, samples: int = 20_000, seed: int = 0) -> float:
    """Rollouts/s of a zero-cost orchestrator under continuous admission at ``level``: ``level / group_size`` slots,
    each starting a new group the moment its last one answers, so in the long run (renewal) the rate is
    ``level / mean group latency``; the latency model as in :func:`gate_ceiling`, the mean over ``samples`` groups."""
    from sim_inference import SimConfig

    c = SimConfig(ttft_ms=args.ttft_ms, per_token_ms=args.per_token_ms, len_mean=args.len_mean, seed=seed)
    rng = random.Random(seed)
    total = 0.0
    for _ in range(samples):
        longest = max(
            min(max(1, round(c.len_mean * math.exp(rng.gauss(0.0, c.len_sigma)))), args.max_tokens)
            for _ in range(args.group_size)
        )
        total += (c.ttft_ms + c.per_token_ms * longest) * math.exp(rng.gauss(0.0, c.jitter_sigma)) / 1000.0
    return level / (total / samples)


def summarize_profile(raw: Path, out: Path, top: int = 40) -> None:
    """py-spy's raw (collapsed stacks) output -> the top functions by own samples and by total (inclusive) samples."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        samples += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for f in set(frames):
            total[f] += n
    lines = [f"py-spy samples: {samples} (50 Hz), orchestrator process, largest level", "", "## own"]
    lines += [f"{100 * n / samples:5.1f}%  {f}" for f, n in own.most_common(top)]
    lines += ["", "## total (inclusive)"]
    lines += [f"{100 * n / samples:5.1f}%  {f}" for f, n in total.most_common(top)]
    out.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/orchestrator_scale.py")
    p.add_argument("--levels", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="measured steps per level")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--per-token-ms", type=float, default=10.0)
    p.add_argument("--len-mean", type=float, default=48.0)
    p.add_argument(
        "--async-level",
        type=int,
        default=1,
        help="orchestrator.max_async_level; each step holds level / (async_level + 1) rollouts",
    )
    p.add_argument(
        "--admission",
        nargs="+",
        choices=["step", "continuous"],
        default=["step"],
        help="orchestrator.admission, one run per level each; continuous alone: results/orchestrator_scale_continuous.json",
    )
    p.add_argument("--profile", action="store_true", help="py-spy the orchestrator of the largest level")
    p.add_argument(
        "--full-gc-every",
        type=int,
        default=None,
        help="steps between the orchestrator's full garbage collections (worker/orchestrator/heap.py; default its 50)",
    )
    p.add_argument(
        "--slow-callback-ms",
        type=float,
        default=None,
        help="asyncio debug mode in the orchestrator: log each callback holding the loop longer (its orchestrator.log)",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--trainer", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--orchestrator", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trainer is not None:
        return trainer(args.trainer, args.steps)
    if args.orchestrator is not None:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        return orchestrator(args.orchestrator, args.url, args.warmup_steps, args.slow_callback_ms, args.full_gc_every)
    if args.quick:
        args.levels, args.steps, args.warmup_steps = [256], 3, 2
    started, machine = time.time(), C.machine_facts()
    model = tokenizer_model()
    rows = []
    for level in args.levels:
        for admission in args.admission:
            raw = C.TMP / "orchestrator_scale_profile.raw" if args.profile and level == max(args.levels) else None
            C.say(f"[bench] {level} rollouts in flight, {admission} admission ...")
            row = run_level(level, args, model, raw, admission)
            ceiling = gate_ceiling if admission == "step" else continuous_ceiling
            row["gate_ceiling_rollouts_per_s"] = ceiling(level, args)
            C.say(
                f"[bench] {level} {admission}: {row['rollouts_per_s']:.0f} rollouts/s (ceiling "
                f"{row['gate_ceiling_rollouts_per_s']:.0f}), lag p99 {row['loop_lag_p99_ms']:.1f} ms"
            )
            rows.append(row)
            if raw is not None:
                summarize_profile(raw, C.RESULTS / "orchestrator_scale_profile.txt")
    payload = {
        "setup": {
            "env": "reverse_text (configs/reverse_text/rl.toml), tiny Qwen3 tokenizer",
            "group_size": args.group_size,
            "max_async_level": args.async_level,
            "max_tokens": args.max_tokens,
            "sim_server": {"ttft_ms": args.ttft_ms, "per_token_ms": args.per_token_ms, "len_mean": args.len_mean},
            "measured_steps": args.steps,
            "warmup_steps": args.warmup_steps,
        },
        "levels": rows,
    }
    name = "orchestrator_scale" if "step" in args.admission else "orchestrator_scale_continuous"
    path = C.write_result(name, payload, quick=args.quick, started=started, machine=machine)
    table = C.md_table(
        [
            "in flight",
            "admission",
            "mean in flight (server)",
            "rollouts/s",
            "gate ceiling rollouts/s",
            "orchestrator CPU ms / rollout",
            "server CPU ms / rollout",
            "loop lag p50 ms",
            "loop lag p99 ms",
            "RSS peak MB",
            "batch MB",
            "hand-off write ms",
            "hand-off read ms",
        ],
        [
            [
                r["inflight"],
                r["admission"],
                r["inflight_mean_measured"],
                r["rollouts_per_s"],
                r["gate_ceiling_rollouts_per_s"],
                r["orchestrator_cpu_ms_per_rollout"],
                r["server_cpu_ms_per_rollout"],
                r["loop_lag_p50_ms"],
                r["loop_lag_p99_ms"],
                r["rss_peak_mb"],
                r["batch_mb"],
                r["handoff_write_ms"],
                r["handoff_read_ms"],
            ]
            for r in rows
        ],
    )
    return C.finish(path, table)


if __name__ == "__main__":
    raise SystemExit(main())
