"""The one-GPU check: a Qwen3-0.6B-shape model through asyncrl's whole RL
loop on one GPU, vLLM and the trainer sharing it, against the same vLLM alone.

Run on the GPU machine through ``benchmarks/gpu/one_gpu_rl.sh`` (it unpacks what ``scripts/gpu-prepare.sh`` made);
``--parts`` picks what runs, in this order:

- ``alone``: vLLM's OpenAI server started exactly as a run starts it (``worker.inference.server.server_command``,
  the same memory share and dtype), with nothing else on the GPU; ``--rounds`` batches of the run's step (``batch``
  reverse-text tasks x ``group`` samples, the same temperature and ``max_tokens``) sent through the orchestrator's
  own ``single_turn_group``; tokens/s = completion tokens of one batch / its wall time (the orchestrator's
  ``rollout_tokens_per_s``), median over the timed rounds after 2 warm-up rounds.
- ``async`` / ``sync``: ``asyncrl rl`` (the local launcher: vLLM server, trainer on ``cuda``, orchestrator) for
  ``--steps`` steps with ``max_async_level`` 1 / 0, weight sync ``--weight-sync`` (``filesystem`` by default;
  ``cuda_ipc``: both runs on the colocated route, so ``async_speedup`` compares them on it).
- ``ipc``: as ``async`` with ``trainer.weight_sync.kind = cuda_ipc`` (the colocated route: vLLM reads each version
  from the trainer's GPU buffer, ``worker/weight_sync/cuda_ipc.py``); its numbers are reported beside the
  filesystem run's (``weight_update_s.cuda_ipc``, ``ipc_run``).
- ``pg``: as ``async`` with ``trainer.weight_sync.kind = process_group`` (gloo: NCCL cannot join two ranks on one
  GPU), fewer steps.
- ``lora``: as ``async`` with ``[trainer.lora]`` (rank 16, alpha 32, all linear projections): adapter update latency
  and trainer tokens/s, compared with the ``async`` run's full fine-tuning at the same batch.

From each run's ``metrics.jsonl`` (steps ``--skip`` and earlier dropped as warm-up: compile, first allocation):
medians of the orchestrator's ``rollout_tokens_per_s``, the inference ``weight_update_s`` (pause -> load -> reset
prefix cache -> resume) and its parts ``weight_update_pause_s`` / ``weight_update_load_s``, the trainer's ``mfu`` and ``tokens_per_s``; the run's wall time from the trainer's step
``--skip`` to its last step. ``async_speedup`` = sync wall / async wall over those same steps;
``rollout_throughput_ratio`` = in-loop median / alone median. The JSON files are rewritten after every part, so a
timeout still leaves the parts that finished: ``gpu_one_gpu_rl.json`` and ``gpu_lora.json`` in ``--out``; beside
them each run's ``metrics.jsonl``, console log and ``policy_check/`` folder (the probe, the trainer's log-probs), and
a failed run's ``failed:`` console line as its ``failure``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("alone", "async", "sync", "ipc", "pg", "lora")
LORA = {"rank": 16, "alpha": 32.0}


def say(line: str) -> None:
    """One progress line on stdout, flushed (the `run` tool returns the tail of the output)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def machine() -> dict[str, Any]:
    """GPU, driver, CPU count and the versions that matter; shapes: flat dict of strings/numbers."""
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "torch": torch.__version__}
    for name in ("vllm", "transformers", "peft", "verifiers"):
        try:
            info[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - a missing package is a fact to record, not a failure here
            info[name] = f"unavailable ({type(e).__name__})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        info["driver"] = None
    return info


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------------------- vLLM alone


async def _alone_rounds(url: str, model: Path, a: argparse.Namespace) -> list[dict[str, float]]:
    from transformers import AutoTokenizer

    from worker.envs import load_environment
    from worker.inference.client import InferenceClient
    from worker.orchestrator.rollouts import single_turn_group

    env = load_environment("reverse_text", split="train", seed=0, system_message=False)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rounds: list[dict[str, float]] = []
    async with InferenceClient(url, read_timeout_s=600, max_retries=0) as client:
        for r in range(a.rounds + 2):
            tasks = [env.task(r * a.batch + i) for i in range(a.batch)]
            t0 = time.perf_counter()
            groups = await asyncio.gather(
                *(
                    single_turn_group(
                        client,
                        tokenizer,
                        env,
                        task,
                        task_key=str(i),
                        n=a.group,
                        max_tokens=a.max_tokens,
                        temperature=a.temperature,
                        policy_version=lambda: 0,
                    )
                    for i, task in enumerate(tasks)
                )
            )
            wall = time.perf_counter() - t0
            n_tok = sum(len(x.completion_ids) for g in groups for x in g)
            n_prompt = sum(len(x.prompt_ids) for g in groups for x in g)
            row = {"round": r, "warmup": r < 2, "wall_s": wall, "completion_tokens": n_tok, "prompt_tokens": n_prompt}
            row["rollout_tokens_per_s"] = n_tok / wall
            say(f"alone round {r}: {n_tok} tokens in {wall:.2f} s = {n_tok / wall:.0f} tok/s")
            rounds.append(row)
    return rounds


def vllm_alone(model: Path, a: argparse.Namespace, log: Path, timeout_s: float) -> dict[str, Any]:
    """Start the server as the launcher does, time ``--rounds`` batches, stop it. Returns the part's JSON."""
    from worker.inference.server import server_command, server_env, wait_ready
    from worker.run.procs import kill_group, spawn

    port = 8311
    cmd = server_command(
        str(model),
        "127.0.0.1",
        port,
        max_model_len=a.max_model_len,
        dtype=a.dtype,
        extra_args=[f"--gpu-memory-utilization={a.gpu_memory_utilization}"],
    )
    proc = spawn(cmd, log, server_env())
    try:
        boot = wait_ready(f"http://127.0.0.1:{port}", timeout_s, proc, log)
        rounds = asyncio.run(asyncio.wait_for(_alone_rounds(f"http://127.0.0.1:{port}", model, a), timeout_s - boot))
    finally:
        kill_group(proc)
    timed = [r["rollout_tokens_per_s"] for r in rounds if not r["warmup"]]
    return {
        "server_boot_s": boot,
        "rounds": rounds,
        "rollout_tokens_per_s": median(timed),
        "command": " ".join(cmd),
    }


# ----------------------------------------------------------------------------- RL runs


def spec_toml(name: str, model: Path, a: argparse.Namespace, *, async_level: int, steps: int, extra: str = "") -> str:
    return f"""name = "{name}"
max_steps = {steps}
output_dir = "{a.work}/runs"

[model]
name = "{model}"
dtype = "{a.dtype}"

[env]
id = "reverse_text"
args = {{ system_message = false }}

[inference]
max_model_len = {a.max_model_len}
gpu_memory_utilization = {a.gpu_memory_utilization}
startup_timeout_s = 600

[orchestrator]
batch_size = {a.batch}
group_size = {a.group}
max_tokens = {a.max_tokens}
temperature = {a.temperature}
seq_len = {a.seq_len}
max_async_level = {async_level}

[orchestrator.eval]
num_examples = 8

[trainer]
device = "{a.device}"
attention = "{a.attention}"
compile = {str(a.compile).lower()}

[trainer.optim]
lr = 1e-5
{extra}"""


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def run_rl(name: str, spec: str, a: argparse.Namespace, timeout_s: float, out: Path) -> dict[str, Any]:
    """``asyncrl rl @ spec`` under ``timeout_s``; on timeout the launcher gets SIGTERM, then every process it started
    SIGKILL. Returns the metrics summary (``summarize``) plus rc and wall time."""
    path = Path(a.work) / f"{name}.toml"
    path.write_text(spec)
    log = out / f"{name}_console.log"
    cmd = [sys.executable, "-m", "worker.cli", "rl", "@", str(path)]
    t0 = time.time()
    seen: set[int] = set()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        rc = None
        while time.time() - t0 < timeout_s:
            seen.update(_descendants(proc.pid))
            rc = proc.poll()
            if rc is not None:
                break
            time.sleep(1.0)
        if rc is None:
            say(f"{name}: timeout after {timeout_s:.0f} s, stopping")
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            rc = f"timeout ({rc})"
        for pid in seen | set(_descendants(proc.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    wall = time.time() - t0
    run_dir = Path(a.work) / "runs" / name
    result: dict[str, Any] = {"rc": rc, "wall_s": wall, "command": " ".join(cmd), "spec": spec}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        (out / f"{name}_metrics.jsonl").write_text(metrics.read_text())
        result.update(summarize(rows, a.skip))
    failed = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("failed:")]
    result["failure"] = failed[-1][len("failed:") :].strip()[:1000] if failed else None
    if (run_dir / "policy_check").is_dir():  # the probe and the trainer's log-probs of each version: small JSON
        shutil.copytree(run_dir / "policy_check", out / f"{name}_policy_check", dirs_exist_ok=True)
    for proc_log in ("trainer", "orchestrator", "inference"):
        lp = run_dir / "logs" / f"{proc_log}.log"
        if lp.is_file():
            result[f"{proc_log}_log_tail"] = lp.read_text(errors="replace").splitlines()[-12:]
    say(f"{name}: rc={rc} wall={wall:.0f}s " + json.dumps({k: v for k, v in result.items() if "median" in k}))
    return result


def summarize(rows: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Medians of one run's metrics after step ``skip`` and its wall time from the trainer's step ``skip`` to its last.

    ``rows``: metrics.jsonl records (``source``, ``step``, ``time`` and values). Keys absent from the run are None.
    """

    def values(source: str, key: str, first: int = skip + 1) -> list[float]:
        return [
            float(r[key])
            for r in rows
            if r.get("source") == source and r.get("step", 0) >= first and isinstance(r.get(key), int | float)
        ]

    trainer = sorted((r for r in rows if r.get("source") == "trainer"), key=lambda r: r["step"])
    steps = [r["step"] for r in trainer]
    times = {r["step"]: r["time"] for r in trainer}
    last = max(steps) if steps else None
    wall = times[last] - times[skip] if last is not None and skip in times and last > skip else None
    rollout = [r for r in rows if r.get("source") == "orchestrator" and "rollout_tokens" in r]
    return {
        "trainer_step_times": times,
        "trainer_steps": len(steps),
        "last_step": last,
        "timed_steps": f"{skip + 1}..{last}" if wall is not None else None,
        "wall_s_timed_steps": wall,
        "s_per_step": wall / (last - skip) if wall is not None and last is not None else None,
        "rollout_tokens_per_s_median": median(values("orchestrator", "rollout_tokens_per_s")),
        "rollout_tokens_per_step_mean": statistics.fmean(r["rollout_tokens"] for r in rollout) if rollout else None,
        "generation_s_median": median(values("orchestrator", "generation_s")),
        "weight_update_s_median": median(values("inference", "weight_update_s", first=1)),
        "weight_update_s_all": values("inference", "weight_update_s", first=0),
        "weight_update_pause_s_median": median(values("inference", "weight_update_pause_s", first=1)),
        "weight_update_load_s_median": median(values("inference", "weight_update_load_s", first=1)),
        "weight_update_reset_s_median": median(values("inference", "weight_update_reset_s", first=1)),
        "weight_update_resume_s_median": median(values("inference", "weight_update_resume_s", first=1)),
        "weight_update_worker_s_median": median(values("inference", "weight_update_worker_s", first=1)),
        "weight_update_pause_s_all": values("inference", "weight_update_pause_s", first=0),
        "trainer_mfu_median": median(values("trainer", "mfu")),
        "trainer_tokens_per_s_median": median(values("trainer", "tokens_per_s")),
        "trainer_step_time_s_median": median(values("trainer", "step_time_s")),
        "trainer_wait_for_batch_s_median": median(values("trainer", "wait_for_batch_s")),
        "trainer_peak_memory_gib_max": max(values("trainer", "peak_memory_gib", first=0), default=None),
        "mismatch_kl_median": median(values("trainer", "mismatch_kl")),
        "policy_check_max_abs_diff_max": max(values("inference", "policy_check_max_abs_diff", first=0), default=None),
        "policy_moved_from_base_min": min(values("inference", "policy_moved_from_base", first=1), default=None),
    }


def speedup(a_run: dict[str, Any], s_run: dict[str, Any], skip: int) -> tuple[float | None, str | None]:
    """Sync wall / async wall over the trainer steps both runs reached (``skip`` -> the lower last step)."""
    ta = {int(k): v for k, v in (a_run.get("trainer_step_times") or {}).items()}
    ts = {int(k): v for k, v in (s_run.get("trainer_step_times") or {}).items()}
    last = min(max(ta, default=0), max(ts, default=0))
    if last <= skip or skip not in ta or skip not in ts:
        return None, None
    return (ts[last] - ts[skip]) / (ta[last] - ta[skip]), f"{skip}..{last}"


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON results and logs")
    p.add_argument("--parts", default="alone,async,sync", help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--work", default="/tmp/one_gpu_rl", help="scratch: model, specs, run directories")
    p.add_argument("--steps", type=int, default=22, help="RL steps per run (the first --skip are warm-up)")
    p.add_argument("--pg-steps", type=int, default=10)
    p.add_argument(
        "--weight-sync", default="filesystem", choices=("filesystem", "cuda_ipc"), help="route of the async/sync parts"
    )
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="tasks per step")
    p.add_argument("--group", type=int, default=8, help="samples per task")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seq-len", type=int, default=8192, help="trainer packed-row capacity")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--attention", default="flex_attention")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of the vLLM-alone measurement")
    p.add_argument("--budget-s", type=float, default=560, help="wall budget of the whole command")
    p.add_argument(
        "--part-timeout-s", type=float, default=240, help="wall limit of one RL run (at most its share of what is left)"
    )
    p.add_argument("--alone-timeout-s", type=float, default=130)
    p.add_argument("--model-size", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda", help="trainer device (cpu only to try the script on a CPU machine)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--merge", type=Path, help="an earlier gpu_one_gpu_rl.json whose parts this call keeps")
    a = p.parse_args()
    t_start = time.time()
    parts = [x for x in a.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; allowed: {', '.join(PARTS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    Path(a.work).mkdir(parents=True, exist_ok=True)

    def left() -> float:
        return a.budget_s - (time.time() - t_start)

    res_path, lora_path = a.out / "gpu_one_gpu_rl.json", a.out / "gpu_lora.json"
    res: dict[str, Any] = {"measured": now(), "machine": machine(), "settings": vars(a) | {"out": str(a.out)}}
    res["settings"]["work"] = a.work
    lora: dict[str, Any] = {"measured": res["measured"], "machine": res["machine"]}

    def save() -> None:
        alone = res.get("vllm_alone", {}).get("rollout_tokens_per_s")
        runs = res.get("runs", {})
        a_run, s_run = runs.get("async", {}), runs.get("sync", {})
        res["rollout_throughput_ratio"] = ratio(a_run.get("rollout_tokens_per_s_median"), alone)
        res["rollout_throughput_ratio_sync"] = ratio(s_run.get("rollout_tokens_per_s_median"), alone)

        def update_s(run: dict[str, Any], route: str) -> float | None:  # a run of another route: None
            return run.get("weight_update_s_median") if run.get("weight_sync", "filesystem") == route else None

        res["weight_update_s"] = {
            "filesystem": update_s(a_run, "filesystem"),
            "filesystem_sync_run": update_s(s_run, "filesystem"),
            "process_group_gloo": runs.get("pg", {}).get("weight_update_s_median"),
            "cuda_ipc": runs.get("ipc", {}).get("weight_update_s_median") or update_s(a_run, "cuda_ipc"),
            "cuda_ipc_sync_run": update_s(s_run, "cuda_ipc"),
        }
        res["async_sync_weight_sync"] = sorted({r.get("weight_sync", "filesystem") for r in (a_run, s_run) if r})
        if "ipc" in runs:
            i_run = runs["ipc"]
            res["ipc_run"] = {
                "rollout_throughput_ratio": ratio(i_run.get("rollout_tokens_per_s_median"), alone),
                "trainer_mfu": i_run.get("trainer_mfu_median"),
                "async_speedup_vs_sync_filesystem": speedup(i_run, s_run, a.skip)[0],
            }
        res["trainer_mfu"] = a_run.get("trainer_mfu_median")
        res["trainer_mfu_sync"] = s_run.get("trainer_mfu_median")
        res["async_speedup"], res["async_speedup_steps"] = speedup(a_run, s_run, a.skip)
        res["elapsed_s"] = time.time() - t_start
        res_path.write_text(json.dumps(res, indent=1, default=str) + "\n")
        if "lora" in runs:
            lr = runs["lora"]
            lora.update(
                lora=LORA,
                adapter_update_s=lr.get("weight_update_s_median"),
                full_weight_update_s=a_run.get("weight_update_s_median"),
                trainer_tokens_per_s_lora=lr.get("trainer_tokens_per_s_median"),
                trainer_tokens_per_s_full=a_run.get("trainer_tokens_per_s_median"),
                lora_vs_full_tokens_per_s=ratio(
                    lr.get("trainer_tokens_per_s_median"), a_run.get("trainer_tokens_per_s_median")
                ),
                run=lr,
            )
            lora_path.write_text(json.dumps(lora, indent=1, default=str) + "\n")

    from worker.policy.models import init_model

    model = Path(a.work) / f"model-{a.model_size}"
    if not (model / "config.json").is_file():
        t0 = time.time()
        init_model(model, size=a.model_size, seed=0, overwrite=True)
        res["model_init_s"] = time.time() - t0
    res["model"] = {"size": a.model_size, "path": str(model), "config": json.loads((model / "config.json").read_text())}
    say(f"model ready {time.time() - t_start:.0f} s")
    save()

    res.setdefault("runs", {})
    if a.merge is not None:  # a second call (e.g. lora,pg) keeps the first call's numbers
        old = json.loads(a.merge.read_text())
        res["vllm_alone"] = old.get("vllm_alone", {})
        res["runs"].update(old.get("runs", {}))
        res["merged_from"] = {"file": str(a.merge), "measured": old.get("measured")}
    rl_left = [x for x in parts if x != "alone"]
    for part in parts:
        if part == "alone":
            budget = min(a.alone_timeout_s, left() - 10)
        else:  # an equal share of what is left with each RL part still to run: the last one gets the rest
            budget = min(a.part_timeout_s, (left() - 10) / len(rl_left))
            rl_left.remove(part)
        if budget < 60:
            res.setdefault("skipped", []).append(f"{part}: {budget:.0f} s left")
            save()
            continue
        say(f"== {part} ({budget:.0f} s) {time.time() - t_start:.0f} s")
        try:
            if part == "alone":
                res["vllm_alone"] = vllm_alone(model, a, a.out / "alone_inference.log", budget)
            else:
                async_level = 0 if part == "sync" else 1
                steps = a.pg_steps if part == "pg" else a.steps
                route = {"pg": "process_group", "ipc": "cuda_ipc", "lora": "filesystem"}.get(part, a.weight_sync)
                extra = {
                    "process_group": '\n[trainer.weight_sync]\nkind = "process_group"\nbackend = "gloo"\n',
                    "cuda_ipc": '\n[trainer.weight_sync]\nkind = "cuda_ipc"\n',
                }.get(route, "")
                if part == "lora":
                    extra = f"\n[trainer.lora]\nrank = {LORA['rank']}\nalpha = {LORA['alpha']}\n"
                spec = spec_toml(f"gpu-{part}", model, a, async_level=async_level, steps=steps, extra=extra)
                res["runs"][part] = run_rl(f"gpu-{part}", spec, a, budget, a.out) | {"weight_sync": route}
        except Exception as e:  # noqa: BLE001 - one part failing must not lose the others' numbers
            res.setdefault("errors", {})[part] = f"{type(e).__name__}: {e}"[:2000]
            say(f"{part} failed: {e}")
        save()
    say(json.dumps({k: res.get(k) for k in ("rollout_throughput_ratio", "weight_update_s", "trainer_mfu")}))
    say(json.dumps({k: res.get(k) for k in ("async_speedup", "rollout_throughput_ratio_sync", "elapsed_s")}))
    if res.get("ipc_run"):
        say(json.dumps({"ipc_run": res["ipc_run"]}))
    if lora.get("run"):
        say(json.dumps({k: v for k, v in lora.items() if k not in ("run", "machine")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
