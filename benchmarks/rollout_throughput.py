"""Rollout tokens/s of one vLLM server alone vs the same server inside an RL run.

1. Build (or reuse) the tiny model SFT'd for 60 steps on reverse-text (``bench_support.sft_model``), so
   completions stop at a realistic length instead of running to ``max_tokens``.
2. Start one vLLM server on it (``worker.inference.server.start_server``, 1 OMP thread, as runs do).
3. **Alone**: 8 reverse-text prompts x 8 samples x ``max_tokens`` 48 at T=1, sent the way the
   orchestrator sends them (one ``/v1/completions`` request per prompt with ``n = 8``, all 8 at
   once), one warm-up round then ``R`` rounds on fresh prompts; generated tokens / wall seconds,
   median over rounds.
4. **In the loop**: a real RL run (``launch_rl``, ``configs/reverse_text/rl.toml``: 8 x 8 x 48,
   ``max_async_level`` 1, trainer on 1 thread) pointed at the same server (``inference.url``).
   From its ``metrics.jsonl`` (orchestrator rows, after ``--warmup-steps``):
   - ``generation``: sum of ``rollout_tokens`` / sum of ``generation_s`` (seconds each step's
     rollouts took; with ``max_async_level`` 1 two steps' rollouts can overlap, so this sum can
     double-count time and understates the server's rate);
   - ``wall``: the same tokens / wall seconds between the orchestrator rows of the first and last
     counted step (everything the loop adds: weight updates, pauses, waiting for the trainer).
   - ``server CPU s / wall s`` and ``tokens / server CPU s``: the server's processes' CPU time (``/proc``, sampled
     every 0.2 s) over the same window, against the same for the alone rounds: how busy the server was in the loop
     and whether a CPU second of it made as many tokens as alone (the loop waiting for the trainer shows as idle
     time, the loop slowing the server as fewer tokens per CPU second).
5. **Alone again** after the run (weights are now the RL policy's), to show the server itself did
   not change speed.
6. **The bound**: the loop cannot make more rollout tokens per second than the slower of the server alone and the
   trainer's pace (a step's rollout tokens / the trainer's mean step time): ``ratio_loop_wall_vs_bound`` is the
   share of that bound the loop reached, i.e. what the loop's own machinery (weight updates, pauses, hand-offs)
   cost. On the 2-core box the trainer (1 thread, fwd + bwd of every prompt and completion token) is the slower one
   at reverse-text's ~15-token completions.
7. ``--contend``: the server alone once more while a trainer's load (forward, backward, AdamW of the same model)
   runs beside it, to tell the machine's own slowdown (shared caches, memory bandwidth) from the loop's.

Run: ``.venv/bin/python benchmarks/rollout_throughput.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402


async def _alone_round(url: str, prompts: list[list[int]], n: int, max_tokens: int) -> tuple[int, float]:
    from worker.inference.client import InferenceClient

    async with InferenceClient(url, read_timeout_s=600) as client:
        t0 = time.perf_counter()
        groups = await asyncio.gather(
            *(client.generate(p, n=n, max_tokens=max_tokens, temperature=C.BENCH_TEMPERATURE) for p in prompts)
        )
        dt = time.perf_counter() - t0
    return sum(len(c.token_ids) for g in groups for c in g), dt


def measure_alone(
    url: str,
    model: Path,
    *,
    rounds: int,
    offset: int,
    server_pid: int,
    prompts: int = 8,
    n: int = 8,
    max_tokens: int = 48,
) -> dict:
    from worker.orchestrator.prompts import prompt_ids
    from worker.policy.models import load_tokenizer

    tok = load_tokenizer(model)
    env = C.bench_env(model)  # the RL run's prompts
    per_round = []
    cpu_s = 0.0
    for r in range(rounds + 1):  # round 0 is warm-up
        base = offset + r * prompts
        ids = [prompt_ids(tok, env.prompt_messages(env.task(base + i))) for i in range(prompts)]
        cpu0 = C.tree_cpu_s(server_pid)
        tokens, dt = asyncio.run(_alone_round(url, ids, n, max_tokens))
        if r > 0:
            cpu_s += C.tree_cpu_s(server_pid) - cpu0
            per_round.append({"tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt, 1)})
    tokens_all, wall_all = sum(x["tokens"] for x in per_round), sum(x["seconds"] for x in per_round)
    return {
        "rounds": per_round,
        "server_cpu_s": round(cpu_s, 2),
        "server_cpu_per_wall_s": round(cpu_s / wall_all, 3),
        "tokens_per_server_cpu_s": round(tokens_all / cpu_s, 1) if cpu_s else None,
        "tokens_per_s_median": C.median([x["tokens_per_s"] for x in per_round]),
        "completion_len_mean": sum(x["tokens"] for x in per_round) / (len(per_round) * prompts * n),
    }


class ServerCpu:
    """Samples the CPU seconds of the vLLM server's processes (API server + engine core) every ``period_s`` in a
    thread, so that the RL run's counted window can be cut out of them afterwards (:meth:`between`)."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, float]] = []  # (time.time(), CPU seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), C.tree_cpu_s(self.pid)))
            self._stop.wait(self.period_s)

    def __enter__(self) -> ServerCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> float:
        """Server CPU seconds between wall times ``t0`` and ``t1`` (linear between samples)."""

        def at(t: float) -> float:
            xs = self.samples
            for (ta, ca), (tb, cb) in zip(xs, xs[1:], strict=False):
                if ta <= t <= tb:
                    return ca + (cb - ca) * (t - ta) / (tb - ta) if tb > ta else ca
            raise ValueError(f"time {t} outside the sampled window {xs[0][0]}..{xs[-1][0]}")

        return at(t1) - at(t0)


def loop_throughput(run_dir: Path, warmup_steps: int, server_cpu: ServerCpu | None = None) -> dict:
    rows = C.read_metrics(run_dir)
    orch = sorted((r for r in rows if r["source"] == "orchestrator"), key=lambda r: r["step"])
    trainer = sorted((r for r in rows if r["source"] == "trainer"), key=lambda r: r["step"])
    counted = [r for r in orch if r["step"] > warmup_steps]
    tokens = sum(r["rollout_tokens"] for r in counted)
    gen = [r.get("generation_s") for r in counted]
    gen_s = sum(gen) if all(isinstance(g, int | float) for g in gen) else None
    before = [r for r in orch if r["step"] == warmup_steps]
    t_first = before[0]["time"] if before else None
    wall_s = counted[-1]["time"] - t_first if counted and t_first else None
    cpu_s = server_cpu.between(t_first, counted[-1]["time"]) if server_cpu and wall_s else None
    counted_trainer = [r for r in trainer if r["step"] > warmup_steps]
    trainer_s = sum(r["step_time_s"] for r in counted_trainer) / max(1, len(counted_trainer))
    return {
        "server_cpu_s": cpu_s,
        "server_cpu_per_wall_s": cpu_s / wall_s if cpu_s and wall_s else None,
        "tokens_per_server_cpu_s": tokens / cpu_s if cpu_s else None,
        "steps_counted": len(counted),
        "rollout_tokens": tokens,
        "generation_s_sum": gen_s,
        "wall_s": wall_s,
        "tokens_per_s_generation": tokens / gen_s if gen_s else None,
        "tokens_per_s_wall": tokens / wall_s if wall_s else None,
        "completion_len_mean": tokens / (64 * len(counted)) if counted else None,
        "trainer_step_time_s_mean": trainer_s,
        "trainer_wait_for_batch_s_mean": (
            sum(r.get("wait_for_batch_s", 0.0) for r in counted_trainer) / max(1, len(counted_trainer))
        ),
        # the most the loop can make if the trainer never waits: a step's rollout tokens per trainer step
        "trainer_bound_tokens_per_s": tokens / len(counted) / trainer_s if counted and trainer_s else None,
        "wait_for_policy_s_sum": sum(r.get("wait_for_policy_s", 0.0) for r in counted),
        "note_generation_s": None if gen_s else "metrics.jsonl has no generation_s: orchestrator predates it",
    }


def _train_forever(model: str, threads: int) -> None:
    """A trainer's load for ``--contend``: forward, backward and an AdamW step of ``model`` on 8 random 64-token
    sequences, on ``threads`` threads, until killed."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
    ids = torch.randint(0, net.config.vocab_size, (8, 64))
    while True:
        net(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def split_cpus(cpus: list[int]) -> dict[str, list[int]]:
    """``--pin``: the first CPU of ``cpus`` for the vLLM server (API server and engine core), the rest for the
    client and the RL run's trainer and orchestrator. Raises ``ValueError`` with fewer than 2 CPUs."""
    if len(cpus) < 2:
        raise ValueError(f"--pin: needs at least 2 CPUs in this process's affinity, got {cpus}")
    return {"server": cpus[:1], "others": cpus[1:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny counts: 2 rounds, 4 RL steps")
    ap.add_argument("--rounds", type=int, default=None, help="alone rounds R (default 10; quick 2)")
    ap.add_argument("--rl-steps", type=int, default=None, help="RL steps (default 30; quick 4)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="RL steps left out (default 2; quick 1)")
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument(
        "--pin",
        action="store_true",
        help="server on the first CPU, everything else (client, trainer, orchestrator) on the others, in both "
        "measurements (default: no pinning)",
    )
    ap.add_argument(
        "--async-level",
        type=int,
        default=None,
        help="orchestrator.max_async_level of the RL run (default: rl.toml's, 1)",
    )
    ap.add_argument(
        "--admission",
        choices=["step", "continuous"],
        default="step",
        help="orchestrator.admission of the RL run (default step). With continuous, the server alone is measured "
        "with as many prompts at once as the run keeps in flight (inflight_groups), so both sides get the same load",
    )
    ap.add_argument(
        "--contend",
        action="store_true",
        help="also measure the server alone while a trainer's load (forward, backward, AdamW of the same model on 1 "
        "thread) runs beside it (on the other CPUs with --pin): how much of the loop's loss is the machine itself",
    )
    ap.add_argument(
        "--result-name",
        default="rollout_throughput",
        help="write benchmarks/results/<name>.json (default rollout_throughput, the one the README table shows)",
    )
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 10)
    rl_steps = args.rl_steps or (4 if args.quick else 30)
    warmup = args.warmup_steps if args.warmup_steps is not None else (1 if args.quick else 2)

    if args.pin and len(os.sched_getaffinity(0)) < 2:
        ap.error(f"--pin: needs at least 2 CPUs in this process's affinity, got {sorted(os.sched_getaffinity(0))}")
    started = time.time()
    machine = C.machine_facts()
    model = C.sft_model(args.sft_steps)

    from worker.inference.server import start_server, stop_server, wait_ready
    from worker.launchers.local import free_port, launch_rl

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = C.TMP / "rollout_throughput.server.log"
    log.unlink(missing_ok=True)
    cpus = sorted(os.sched_getaffinity(0))
    pinned = split_cpus(cpus) if args.pin else None
    if pinned:  # children inherit the affinity at spawn: the server's processes get pinned["server"]
        os.sched_setaffinity(0, pinned["server"])
    proc = start_server(str(model), port=port, log_path=log, max_model_len=256)
    if pinned:  # this process (the client), and the RL run's trainer and orchestrator spawned below
        os.sched_setaffinity(0, pinned["others"])
    try:
        boot_s = wait_ready(url, 600, proc, log)
        C.say(f"[bench] vLLM ready in {boot_s:.0f}s at {url}")
        spec = C.rl_spec(
            model,
            "bench-rollout",
            [
                ("max_steps", str(rl_steps)),
                ("inference.url", url),
                ("orchestrator.eval.interval", "0"),
                ("orchestrator.eval.num_examples", "8"),
                ("ckpt.interval", "0"),
                *([("orchestrator.max_async_level", str(args.async_level))] if args.async_level is not None else []),
                ("orchestrator.admission", args.admission),
            ],
        )
        # prompts at once in the loop: a step's batch (step admission) or the groups kept in flight (continuous)
        n_prompts = spec.orchestrator.batch_size if args.admission == "step" else spec.orchestrator.groups_in_flight()
        alone = measure_alone(url, model, rounds=rounds, offset=100_000, server_pid=proc.pid, prompts=n_prompts)
        C.say(f"[bench] alone: {alone['tokens_per_s_median']:.0f} tok/s (median of {rounds}, {n_prompts} prompts)")
        contended = None
        if args.contend:
            import multiprocessing

            load = multiprocessing.get_context("spawn").Process(
                target=_train_forever, args=(str(model), spec.trainer.threads), daemon=True
            )
            load.start()
            try:
                time.sleep(15)  # its model loaded and a few steps in
                contended = measure_alone(
                    url, model, rounds=rounds, offset=300_000, server_pid=proc.pid, prompts=n_prompts
                )
            finally:
                load.kill()
                load.join()
            C.say(f"[bench] alone beside a trainer's load: {contended['tokens_per_s_median']:.0f} tok/s")
        t0 = time.time()
        with ServerCpu(proc.pid) as server_cpu:
            summary = launch_rl(spec, overwrite=True, quiet=True)  # type: ignore[arg-type]
        run_wall = time.time() - t0
        if summary["status"] != "completed":
            raise RuntimeError(f"RL run {summary['status']}: see {spec.run_dir}/logs")
        loop = loop_throughput(spec.run_dir, warmup, server_cpu)
        alone_after = measure_alone(url, model, rounds=rounds, offset=200_000, server_pid=proc.pid, prompts=n_prompts)
    finally:
        stop_server(proc)

    a = alone["tokens_per_s_median"]
    ratio_gen = loop["tokens_per_s_generation"] / a if loop["tokens_per_s_generation"] else None
    ratio_wall = loop["tokens_per_s_wall"] / a if loop["tokens_per_s_wall"] else None
    bound = min(a, loop["trainer_bound_tokens_per_s"] or a)  # the slower of server alone and the trainer's pace
    ratio_bound = loop["tokens_per_s_wall"] / bound if loop["tokens_per_s_wall"] else None
    cpu_eff = (
        loop["tokens_per_server_cpu_s"] / alone["tokens_per_server_cpu_s"]
        if loop["tokens_per_server_cpu_s"] and alone["tokens_per_server_cpu_s"]
        else None
    )
    payload = {
        "setup": {
            "model": str(model.relative_to(C.ROOT)),
            "sft_steps": args.sft_steps,
            "prompts": 8,
            "n": 8,
            "max_tokens": 48,
            "temperature": C.BENCH_TEMPERATURE,
            "rounds": rounds,
            "rl_steps": rl_steps,
            "warmup_steps": warmup,
            "server_omp_threads": 1,
            "trainer_threads": spec.trainer.threads,
            "max_async_level": spec.orchestrator.max_async_level,
            "admission": args.admission,
            "alone_prompts_at_once": n_prompts,
            "server_boot_s": round(boot_s, 1),
            "cpus": cpus,
            "pinned": pinned,
        },
        "alone": alone,
        "alone_after_rl": alone_after,
        "alone_beside_trainer_load": contended,
        "in_loop": loop,
        "rl_run": {"run_dir": str(spec.run_dir), "wall_s": round(run_wall, 1), "summary": summary},
        "ratio_loop_generation_vs_alone": ratio_gen,
        "ratio_loop_wall_vs_alone": ratio_wall,
        "ratio_loop_tokens_per_server_cpu_s_vs_alone": cpu_eff,
        "bound_tokens_per_s": bound,
        "ratio_loop_wall_vs_bound": ratio_bound,
    }
    out = C.write_result(args.result_name, payload, quick=args.quick, started=started, machine=machine)

    def f(x):  # noqa: E306
        return "n/a" if x is None else x

    def alone_row(label: str, m: dict) -> list:
        return [
            label,
            m["tokens_per_s_median"],
            round(m["tokens_per_s_median"] / a, 2),
            round(m["completion_len_mean"], 1),
            m["server_cpu_per_wall_s"],
            m["tokens_per_server_cpu_s"],
        ]

    table = C.md_table(
        [
            "measure",
            "rollout tok/s",
            "vs alone",
            "completion len (mean)",
            "server CPU s / wall s",
            "tokens / server CPU s",
        ],
        [
            alone_row(f"server alone (median of {rounds} rounds)", alone),
            *([alone_row("server alone beside a trainer's load", contended)] if contended else []),
            [
                "in RL loop: tokens / generation_s",
                f(loop["tokens_per_s_generation"]),
                f(ratio_gen and round(ratio_gen, 2)),
                round(loop["completion_len_mean"] or 0, 1),
                "",
                "",
            ],
            [
                "in RL loop: tokens / wall s",
                f(loop["tokens_per_s_wall"]),
                f(ratio_wall and round(ratio_wall, 2)),
                "",
                f(loop["server_cpu_per_wall_s"] and round(loop["server_cpu_per_wall_s"], 3)),
                f(loop["tokens_per_server_cpu_s"] and round(loop["tokens_per_server_cpu_s"], 1)),
            ],
            ["bound: min(server alone, a step's rollout tokens / trainer step time)", round(bound), round(bound / a, 2)]
            + [""] * 3,
            [
                "in RL loop: tokens / wall s, vs the bound",
                f(loop["tokens_per_s_wall"]),
                f(ratio_bound and round(ratio_bound, 2)),
            ]
            + [""] * 3,
            alone_row("server alone after the RL run", alone_after),
        ],
    )
    return C.finish(out, table)


if __name__ == "__main__":
    sys.exit(main())
