"""The one-call GPU check (issue 34), on the GPU machine: run through ``scripts/gpu-check.sh --device OUT``, which
unpacks the vLLM bundle and wheels made on a CPU machine first. Parts, in this order, each within what is left of
``--budget-s`` (a part that does not fit is recorded as not run, never guessed):

- ``rl``: ``asyncrl sft @ configs/reverse_text/sft.toml --device cuda`` from a fresh tiny model, then the shipped
  ``asyncrl rl @ configs/reverse_text/rl.toml`` with only ``--model.name`` (the SFT result), ``--output_dir`` and
  ``--trainer.device cuda`` added: the default served-policy check, vLLM with CUDA graphs (``inference.enforce_eager``
  unset). Recorded: status, eval reward before/after, every version's ``policy_check_max_abs_diff``, the version-0
  noise and the tolerance set from it, vLLM's boot, weight updates, step times.
- ``tests``: ``pytest -m gpu`` over the files that hold gpu-marked tests (one pytest per top folder, each with
  ``--confcutdir`` there: the repo's root conftest needs the control plane's packages, which the GPU image lacks);
  tests that need more GPUs than the machine has are deselected and listed.
- ``boot``: vLLM's boot on the tiny model as a run starts it, eager then with CUDA graphs (a fresh compile cache).

Writes ``gpu_check.json`` (keys of issue 34: ``commit``, ``gpu``, ``tests_passed``, ``tests_failed``,
``step_time_s``, ``rollout_ratio``, ``trainer_inloop_vs_bench``, ``weight_update_s``, ``async_speedup``,
``policy_check_max_abs_diff``; null for what this call did not measure) after every part, and the logs, into
``--out``. ``step_time_s``, ``rollout_ratio``, ``trainer_inloop_vs_bench``, ``weight_update_s`` and
``async_speedup`` are the 0.6B-shape loop's (``benchmarks/gpu/one_gpu_rl.py``), not measured here: null.
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
PARTS = ("rl", "tests", "boot")
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
        subprocess.run(["tar", "czf", str(out / "rl_run.tgz"), "-C", str(run), "logs", "metrics.jsonl", "events.jsonl"])
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
            "step_time_s, rollout_ratio, trainer_inloop_vs_bench, weight_update_s and async_speedup are the 0.6B-shape "
            "loop's (benchmarks/gpu/one_gpu_rl.py): null when not measured in these calls. policy_check_max_abs_diff: "
            "max over the shipped reverse-text RL run's versions (parts.rl)."
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
        (a.out / "gpu_check.json").write_text(json.dumps(res, indent=1) + "\n")
        subprocess.run(["tar", "czf", str(a.out / "logs.tgz"), "-C", str(a.work), "logs"], check=False)

    call = {"parts": parts, "gpu": info["gpu"], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}
    res["calls"].append(call)
    for part in parts:
        t0 = time.monotonic()
        say(f"part {part}: {deadline - t0:.0f} s left")
        if part == "rl":
            res["parts"]["rl"] = part_rl(logs, a.work, deadline)
        elif part == "tests":
            res["parts"]["tests"] = part_tests(logs, deadline, info["gpus"])
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
