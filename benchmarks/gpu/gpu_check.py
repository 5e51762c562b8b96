"""The one-call GPU check, on the GPU machine: run through ``scripts/gpu-check.sh --device OUT``, which
unpacks the vLLM bundle and wheels made on a CPU machine first. Parts, run in the order ``--parts`` names them, each
within what is left of ``--budget-s`` (a part that does not fit is recorded as not run, never guessed):

- ``rl``: ``asyncrl sft @ configs/reverse_text/sft.toml --device cuda`` from a fresh tiny model, then the shipped
  ``asyncrl rl @ configs/reverse_text/rl.toml`` with only ``--model.name`` (the SFT result), ``--output_dir`` and
  ``--trainer.device cuda`` added: the default served-policy check, vLLM with CUDA graphs (``inference.enforce_eager``
  unset). Recorded: status, eval reward before/after, every version's ``policy_check_max_abs_diff``, the version-0
  noise and the tolerance set from it, vLLM's boot, weight updates, step times.
- ``tests``: ``pytest -m gpu`` over the files that hold gpu-marked tests (one pytest per top folder, each with
  ``--confcutdir`` there: the repo's root conftest needs the control plane's packages, which the GPU image lacks);
  tests that need more GPUs than the machine has are deselected and listed.
- ``boot``: vLLM's boot on the tiny model as a run starts it, eager then with CUDA graphs (a fresh compile cache).
- ``loop``: the Qwen3-0.6B-shape loop measurement, ``benchmarks/gpu/one_gpu_rl.py --parts alone,async,sync`` on the
  colocated route (``cuda_ipc``), 16 tasks x 8 samples x 128 tokens a step, vLLM with the run's own flags (CUDA
  graphs) in the loop and alone. It does not fit one call beside the other parts: run it as a second call
  (``--parts loop --merge`` the first call's JSON). On a cold H100 even its three runs hardly fit one 578 s call: each
  starts its own vLLM (90-97 s to ready with graphs) and the first RL run also compiles the trainer; at d250eaa vLLM
  alone took 131 s, which left the async run 198 s, cut before its first trainer step (it needs ~230 s cold). Then
  run ``one_gpu_rl.py --parts async`` once more on the same machine while it is held (``parts.loop.notes``).

Writes ``gpu_check.json`` (keys: ``commit``, ``gpu``, ``tests_passed``, ``tests_failed``,
``step_time_s``, ``rollout_ratio``, ``trainer_inloop_vs_bench``, ``weight_update_s``, ``async_speedup``,
``policy_check_max_abs_diff``; null for what these calls did not measure) after every part, and the logs, into
``--out``. From ``loop`` (``top_level_from_loop``): ``step_time_s`` the async run's seconds per trainer step after
the warm-up steps, ``rollout_ratio`` its median rollout tok/s / vLLM alone's, ``weight_update_s`` its median
``cuda_ipc`` update (pause -> resume), ``async_speedup`` sync / async wall over the same steps.
``trainer_inloop_vs_bench`` stays null: ``benchmarks/gpu/trainer_bench.py`` measures other shapes (16 x 1024-token
samples in one row) and does not fit the same call; the loop's trainer tok/s and MFU are in ``parts.loop``.
``policy_check_max_abs_diff`` is the max over the shipped RL run's versions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("rl", "tests", "boot", "loop")
LOOP_SHAPE = {"batch": 16, "group": 8, "max_tokens": 128}
"""The loop measurement's step: tasks, samples per task, completion tokens."""
RL_NEEDS_S = 330.0
"""Seconds the ``rl`` part needs (H100: SFT 83 s, the RL run 223 s with vLLM's boot); with less left it is not run."""
ALONE_TIMEOUT_S = 240.0
"""Seconds the loop's vLLM-alone part may take: a cold H100 boot of the 0.6B shape with CUDA graphs took 104 s plus the
model load (an earlier 130 s limit cut it before its first round), then 2 warm-up and 5 timed rounds."""
LOOP_STEPS, LOOP_SKIP = 12, 2
"""RL steps of each loop run, and the first steps dropped as warm-up (compile, first allocation)."""
TWO_GPU_TESTS = (
    "tests/e2e/test_weight_sync_gpu.py::test_nccl_update_from_cuda0_to_vllm_on_cuda1",
    "tests/unit/worker/trainer/test_dist.py::test_fsdp2_two_gpus_equal_one_gpu",
)
"""gpu-marked tests that need 2 GPUs: deselected (and listed) on a one-GPU machine."""


def say(line: str) -> None:
    sys.stdout.write(f"[{time.strftime('%H:%M:%S')}] {line}\n")
    sys.stdout.flush()


def gpu_info() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None, "gpus": 0}
    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "gpus": torch.cuda.device_count(), "gpu_memory_gib": round(p.total_memory / 2**30, 1)}


def versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "vllm", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            out[name] = f"unavailable ({type(e).__name__})"
    return out


def run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, float]:
    """Run ``cmd`` with stdout+stderr to ``log``; returns (exit code, wall s); 124 when it ran past ``timeout_s``."""
    t0 = time.monotonic()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=max(timeout_s, 1), env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - t0


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- rl


def part_rl(out: Path, work: Path, deadline: float) -> dict[str, Any]:
    py = sys.executable
    model, runs = work / "tiny", work / "runs"
    res: dict[str, Any] = {"command": None}
    left = deadline - time.monotonic()
    if left < RL_NEEDS_S:
        return {**res, "status": f"not run: {left:.0f} s left, needs {RL_NEEDS_S:.0f}"}
    rc, wall = run_logged([py, "-m", "worker.cli", "model", "init", "--out", str(model)], out / "init.log", 120)
    if rc != 0:
        return {**res, "status": f"model init failed (rc {rc})"}
    sft = [py, "-m", "worker.cli", "sft", "@", "configs/reverse_text/sft.toml", "--model.name", str(model)]
    sft += ["--output_dir", str(runs), "--device", "cuda"]
    rc, wall = run_logged(sft, out / "sft.log", deadline - time.monotonic() - 200)
    res["sft_command"], res["sft_wall_s"], res["sft_rc"] = " ".join(sft[1:]), round(wall, 1), rc
    say(f"sft rc={rc} in {wall:.0f} s")
    final = runs / "reverse-text-sft" / "final"
    if rc != 0 or not final.is_dir():
        return {**res, "status": f"sft failed (rc {rc})"}
    rl = [py, "-m", "worker.cli", "rl", "@", "configs/reverse_text/rl.toml", "--model.name", str(final)]
    rl += ["--output_dir", str(runs), "--trainer.device", "cuda"]
    res["command"] = " ".join(rl[1:])
    rc, wall = run_logged(rl, out / "rl_console.log", deadline - time.monotonic() - 10)
    say(f"rl rc={rc} in {wall:.0f} s")
    run = runs / "reverse-text-rl"
    res.update(rc=rc, wall_s=round(wall, 1))
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    res["status"] = summary.get("status", "timed out" if rc == 124 else f"rc {rc}")
    for key in ("steps", "reason", "eval_reward_first", "eval_reward_last", "eval_reward_last_version", "wall_s"):
        if key in summary:
            res[f"summary_{key}" if key == "wall_s" else key] = summary[key]
    rows = read_jsonl(run / "metrics.jsonl")
    inf = sorted((r for r in rows if r["source"] == "inference"), key=lambda r: r["step"])
    diffs = [r["policy_check_max_abs_diff"] for r in inf if r.get("policy_check_max_abs_diff") is not None]
    res["policy_check_versions"] = len(diffs)
    res["policy_check_max_abs_diff_min"] = min(diffs) if diffs else None
    res["policy_check_max_abs_diff_max"] = max(diffs) if diffs else None
    res["policy_check_max_abs_diff_first"] = diffs[0] if diffs else None
    base = [r["policy_check_base_max_abs_diff"] for r in inf if "policy_check_base_max_abs_diff" in r]
    res["policy_check_base_max_abs_diff"] = base[0] if base else None
    tols = sorted({r["policy_check_tolerance"] for r in inf if "policy_check_tolerance" in r})
    res["policy_check_tolerance"] = tols
    updates = [r["weight_update_s"] for r in inf if r.get("weight_update_s") is not None]
    res["weight_update_s_median"] = statistics.median(updates) if updates else None
    trainer = sorted((r for r in rows if r["source"] == "trainer"), key=lambda r: r["step"])
    times = [b["time"] - a["time"] for a, b in zip(trainer[5:], trainer[6:], strict=False)]
    res["step_time_s_median"] = statistics.median(times) if times else None
    events = read_jsonl(run / "events.jsonl")
    ready = [e for e in events if e["event"] == "inference_ready"]
    res["inference_ready"] = ready[0] if ready else None
    res["policy_check_failed"] = [e for e in events if e["event"] == "policy_check_failed"]
    if run.is_dir():
        # policy_check/: the probe and every version's trainer log-probs (how the served diff grows with training)
        kept = [x for x in ("logs", "metrics.jsonl", "events.jsonl", "policy_check") if (run / x).exists()]
        subprocess.run(["tar", "czf", str(out / "rl_run.tgz"), "-C", str(run), *kept])
        for name in ("metrics.jsonl", "events.jsonl"):
            if (run / name).is_file():
                (out / f"rl_{name}").write_bytes((run / name).read_bytes())
    return res


# ----------------------------------------------------------------------------- tests


def gpu_test_files() -> list[str]:
    found = subprocess.run(
        ["grep", "-rl", "--include=test_*.py", "pytest.mark.gpu", "tests"], capture_output=True, text=True, cwd=ROOT
    ).stdout.split()
    return sorted(found)


def part_tests(out: Path, deadline: float, gpus: int) -> dict[str, Any]:
    files = gpu_test_files()
    deselect = [t for t in TWO_GPU_TESTS if gpus < 2]
    groups: dict[str, list[str]] = {}
    for f in files:
        groups.setdefault("/".join(f.split("/")[:2]), []).append(f)
    cases: list[dict[str, Any]] = []
    for i, (top, group) in enumerate(sorted(groups.items(), key=lambda kv: kv[0] != "tests/e2e")):
        xml = out / f"pytest_{i}.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-v", "-s", "--confcutdir", top]
        cmd += [f"--junitxml={xml}", *[f"--deselect={t}" for t in deselect], *group]
        left = deadline - time.monotonic()
        if left < 60:
            cases += [{"name": f, "outcome": "not run (out of time)"} for f in group]
            continue
        rc, wall = run_logged(cmd, out / f"pytest_{i}.log", left)
        say(f"pytest {top}: rc={rc} in {wall:.0f} s")
        if xml.is_file():
            for tc in ET.parse(xml).getroot().iter("testcase"):
                outcome = "passed"
                for tag in ("failure", "error", "skipped"):
                    if tc.find(tag) is not None:
                        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                name = f"{tc.get('classname', '').replace('.', '/')}.py::{tc.get('name')}"
                cases.append({"name": name, "outcome": outcome, "time_s": float(tc.get("time") or 0)})
        else:
            cases += [{"name": f, "outcome": f"no report (rc {rc})"} for f in group]
    log_text = "".join(p.read_text(errors="replace") for p in sorted(out.glob("pytest_*.log")))
    c14 = re.findall(r"C14 on GPU: .*", log_text)
    return {
        "files": files,
        "deselected": [f"{t} (needs 2 GPUs, {gpus} here)" for t in deselect],
        "cases": cases,
        "passed": sum(c["outcome"] == "passed" for c in cases),
        "failed": sum(c["outcome"] in ("failed", "error") or c["outcome"].startswith("no report") for c in cases),
        "c14_gpu": c14[0] if c14 else None,
    }


# ----------------------------------------------------------------------------- boot


def part_boot(out: Path, work: Path, deadline: float) -> dict[str, Any]:
    """vLLM's boot on the tiny model as a run starts it (spawn -> /health): eager, then CUDA graphs with a fresh
    compile cache (``VLLM_CACHE_ROOT``), so the graphs boot includes the compile."""
    from worker.inference.server import server_command, server_env, wait_ready
    from worker.policy.models import init_model
    from worker.run.procs import free_port, kill_group, spawn

    model = init_model(work / "boot-model", size="tiny", seed=0)
    res: dict[str, Any] = {}
    for name, eager in (("eager", True), ("graphs", False)):
        left = deadline - time.monotonic()
        if left < 90:
            res[name] = None
            continue
        port = free_port()
        cmd = server_command(str(model), "127.0.0.1", port, max_model_len=256, enforce_eager=eager)
        env = server_env({**os.environ, "VLLM_CACHE_ROOT": tempfile.mkdtemp(prefix="vllm-cache-")})
        proc = spawn(cmd, out / f"boot_{name}.log", env)
        try:
            res[name] = round(wait_ready(f"http://127.0.0.1:{port}", left - 10, proc, out / f"boot_{name}.log"), 1)
        except (RuntimeError, TimeoutError) as e:
            res[name] = None
            res[f"{name}_error"] = str(e)[:500]
        finally:
            kill_group(proc)
        say(f"boot {name}: {res[name]} s")
    return res


# ----------------------------------------------------------------------------- loop


def part_loop(out: Path, work: Path, deadline: float) -> dict[str, Any]:
    """``benchmarks/gpu/one_gpu_rl.py`` (its own process: it starts and stops vLLM servers and runs) within what is
    left of the deadline: vLLM alone, then the async and the sync run; its JSON and logs land in ``out/loop``."""
    left = deadline - time.monotonic() - 15
    if left < 300:
        return {"status": f"not run: {left:.0f} s left, needs 300"}
    alone_s = ALONE_TIMEOUT_S
    run_s = left  # a cap only: one_gpu_rl.py gives each RL run an equal share of what vLLM alone left
    loop_out = out / "loop"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "one_gpu_rl.py"), "--out", str(loop_out)]
    cmd += ["--work", str(work / "loop"), "--parts", "alone,async,sync", "--weight-sync", "cuda_ipc"]
    cmd += ["--batch", str(LOOP_SHAPE["batch"]), "--group", str(LOOP_SHAPE["group"])]
    cmd += ["--max-tokens", str(LOOP_SHAPE["max_tokens"]), "--steps", str(LOOP_STEPS), "--skip", str(LOOP_SKIP)]
    cmd += ["--budget-s", f"{left:.0f}", "--alone-timeout-s", f"{alone_s:.0f}", "--part-timeout-s", f"{run_s:.0f}"]
    rc, wall = run_logged(cmd, out / "loop_console.log", left + 10)
    say(f"loop rc={rc} in {wall:.0f} s")
    res: dict[str, Any] = {"command": " ".join(cmd[1:]), "rc": rc, "wall_s": round(wall, 1), **LOOP_SHAPE}
    path = loop_out / "gpu_one_gpu_rl.json"
    if not path.is_file():
        return {**res, "status": f"no result (rc {rc})"}
    return {**res, **loop_summary(json.loads(path.read_text()), rc)}


LOOP_RUN_KEYS = (
    "rc", "failure", "wall_s", "weight_sync", "last_step", "timed_steps", "s_per_step", "rollout_tokens_per_s_median",
    "generation_s_median", "weight_update_s_median", "weight_update_pause_s_median", "weight_update_load_s_median",
    "weight_update_reset_s_median", "weight_update_resume_s_median", "weight_update_worker_s_median",
    "weight_update_pause_s_all",
    "trainer_tokens_per_s_median", "trainer_mfu_median", "trainer_step_time_s_median",
    "trainer_wait_for_batch_s_median", "trainer_peak_memory_gib_max", "policy_check_max_abs_diff_max",
)  # fmt: skip
"""What ``parts.loop.runs`` keeps of each run of ``gpu_one_gpu_rl.json`` (the rest stays in the logs)."""


def run_failure(run: dict[str, Any]) -> str | None:
    """Why an RL run of ``one_gpu_rl.py`` ended with a non-zero rc: its ``failure`` line, else the last ERROR line of
    its orchestrator or trainer log tail; None for a run that ended with 0."""
    if run.get("rc") == 0:
        return None
    if run.get("failure"):
        return run["failure"]
    for tail in ("orchestrator_log_tail", "trainer_log_tail"):
        errors = [line for line in run.get(tail) or [] if " ERROR " in line]
        if errors:
            return errors[-1].split(" ERROR ", 1)[1][:500]
    return f"rc {run.get('rc')}"


def loop_summary(one: dict[str, Any], rc: int) -> dict[str, Any]:
    """``parts.loop`` from ``one_gpu_rl.py``'s ``gpu_one_gpu_rl.json`` (``one``) and its exit code."""
    runs = {name: {**run, "failure": run_failure(run)} for name, run in one.get("runs", {}).items()}
    failed = [f"{name}: {run['failure']}" for name, run in runs.items() if run["failure"]]
    complete = rc == 0 and {"async", "sync"} <= runs.keys() and not failed
    res: dict[str, Any] = {"status": "completed" if complete else f"failed (rc {rc})", "failures": failed}
    res["vllm_alone"] = {k: v for k, v in one.get("vllm_alone", {}).items() if k != "rounds"}
    res["runs"] = {name: {k: run.get(k) for k in LOOP_RUN_KEYS} for name, run in runs.items()}
    for key in ("rollout_throughput_ratio", "rollout_throughput_ratio_sync", "async_speedup", "async_speedup_steps"):
        res[key] = one.get(key)
    res["skipped"], res["errors"] = one.get("skipped", []), one.get("errors", {})
    return res


def top_level_from_loop(loop: dict[str, Any]) -> dict[str, Any]:
    """The issue's loop keys from ``parts.loop`` (``part_loop``'s result); None where the loop did not measure it."""
    a_run = loop.get("runs", {}).get("async", {})
    return {
        "step_time_s": a_run.get("s_per_step"),
        "rollout_ratio": loop.get("rollout_throughput_ratio"),
        "weight_update_s": a_run.get("weight_update_s_median"),
        "async_speedup": loop.get("async_speedup"),
    }


# ----------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", default="rl,tests,boot")
    p.add_argument("--budget-s", type=float, default=540, help="seconds from the script's start (setup included)")
    p.add_argument("--started", type=float, default=None, help="unix time the wrapper started (for the budget)")
    p.add_argument("--commit", default=None)
    p.add_argument("--merge", type=Path, default=None, help="an earlier gpu_check.json whose parts this call keeps")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_check"))
    a = p.parse_args()
    started = a.started or time.time()
    deadline = time.monotonic() + a.budget_s - (time.time() - started)
    parts = [x for x in a.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; choose from {PARTS}")
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    old = json.loads(a.merge.read_text()) if a.merge else {}
    info = gpu_info()
    res: dict[str, Any] = {
        "commit": a.commit,
        "gpu": info["gpu"],
        "tests_passed": None,
        "tests_failed": None,
        "step_time_s": None,
        "rollout_ratio": None,
        "trainer_inloop_vs_bench": None,
        "weight_update_s": None,
        "async_speedup": None,
        "policy_check_max_abs_diff": None,
        "machine": {**info, **versions(), "cpus": os.cpu_count()},
        "parts": {**old.get("parts", {})},
        "calls": [*old.get("calls", [])],
        "note": (
            "step_time_s, rollout_ratio, weight_update_s and async_speedup are the 0.6B-shape loop's (parts.loop: "
            "benchmarks/gpu/one_gpu_rl.py, cuda_ipc, 16 tasks x 8 samples x 128 tokens, CUDA graphs; step_time_s = "
            "the async run's s/step after the warm-up steps, rollout_ratio = its rollout tok/s / vLLM alone's with the "
            "same flags, weight_update_s = its median update pause -> resume, async_speedup = sync / async wall over "
            "the same steps); null when not measured. trainer_inloop_vs_bench is null: benchmarks/gpu/trainer_bench.py "
            "measures other shapes (16 x 1024-token samples in one row) and does not fit the same call; the loop's "
            "trainer tok/s and MFU are in parts.loop.runs. policy_check_max_abs_diff: max over the shipped "
            "reverse-text RL run's versions (parts.rl)."
        ),
    }

    logs = a.work / "logs"  # every part's logs; back as OUT/logs.tgz (the run tool returns at most 8 files)
    logs.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        tests = res["parts"].get("tests")
        if tests:
            res["tests_passed"], res["tests_failed"] = tests["passed"], tests["failed"]
        rl = res["parts"].get("rl")
        if rl:
            res["policy_check_max_abs_diff"] = rl.get("policy_check_max_abs_diff_max")
        loop = res["parts"].get("loop")
        if loop:
            res.update(top_level_from_loop(loop))
        (a.out / "gpu_check.json").write_text(json.dumps(res, indent=1) + "\n")
        subprocess.run(["tar", "czf", str(a.out / "logs.tgz"), "-C", str(a.work), "logs"], check=False)

    call = {
        "parts": parts,
        "commit": a.commit,
        "gpu": info["gpu"],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
    }
    res["calls"].append(call)
    for part in parts:
        t0 = time.monotonic()
        say(f"part {part}: {deadline - t0:.0f} s left")
        if part == "rl":
            res["parts"]["rl"] = part_rl(logs, a.work, deadline)
        elif part == "tests":
            res["parts"]["tests"] = part_tests(logs, deadline, info["gpus"])
        elif part == "loop":
            res["parts"]["loop"] = part_loop(logs, a.work, deadline)
        else:
            res["parts"]["boot"] = part_boot(logs, a.work, deadline)
        call[f"{part}_s"] = round(time.monotonic() - t0, 1)
        write()
    call["wall_s"] = round(time.time() - started, 1)
    write()
    say(json.dumps({k: v for k, v in res.items() if k not in ("parts", "machine", "calls", "note")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
