"""Copy the tables of the latest ``benchmarks/results/*.json`` into ``benchmarks/README.md``, and the fault matrix
into the project README.

Replaces everything between ``<!-- results:start -->`` and ``<!-- results:end -->`` with, per
benchmark, its command, date, machine facts, any ``note`` and the table the script printed; and in ``README.md``
everything between ``<!-- fault-matrix:start -->`` and ``<!-- fault-matrix:end -->`` (section "Reliability and
security") with the same for ``results/fault_matrix.json`` (``benchmarks/fault_matrix.py``).

Run: ``.venv/bin/python benchmarks/update_readme.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

README = C.ROOT / "benchmarks" / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
PROJECT_README = C.ROOT / "README.md"
FAULTS_START, FAULTS_END = "<!-- fault-matrix:start -->", "<!-- fault-matrix:end -->"
TITLES = {
    "rollout_throughput": "Rollout throughput: server alone vs in the RL loop",
    "trainer_throughput": "Trainer throughput",
    "vs_trl": "asyncrl vs TRL GRPOTrainer",
    "service_throughput": "Control plane: metric ingestion and series queries",
    "dashboard_page": "Dashboard: run page server time with 100k stored points",
    "metric_export": "Metric export: 100k stored points as CSV and Parquet",
    "difficulty_pool_learning": "Learning check: difficulty_pool vs standard curriculum on reverse-text",
    "weight_update_under_load": "Weight update under a burst of 64 generations on fresh servers (case C25)",
    "orchestrator_scale": "Orchestrator at 256 / 1,024 / 4,096 rollouts in flight (simulated inference server)",
}


def section(name: str) -> str:
    path = C.RESULTS / f"{name}.json"
    if not path.is_file():
        return f"### {TITLES[name]}\n\nNo result yet (`benchmarks/results/{name}.json`)."
    d = json.loads(path.read_text())
    m = d["machine"]
    load = ", ".join(f"{x:.1f}" for x in m.get("loadavg_at_start", []))
    lines = [
        f"### {TITLES[name]}",
        "",
        f"`{d['command']}` — {d['date']}, {d['duration_s']:.0f} s; {m['nproc']} × {m['cpu_model']}, "
        f"torch {m['torch']}, vLLM {m['vllm']}, transformers {m['transformers']}, TRL {m['trl']}; "
        f"load average at start {load}.",
    ]
    if d.get("note"):
        lines += ["", f"> **Note:** {d['note']}"]
    lines += ["", d.get("table_md", "(no table in the result file)")]
    return "\n".join(lines)


def fault_matrix() -> str:
    """The README's fault-matrix block: command, date, machine and the table of ``results/fault_matrix.json``."""
    path = C.RESULTS / "fault_matrix.json"
    if not path.is_file():
        return "No result yet (`benchmarks/results/fault_matrix.json`: run `benchmarks/fault_matrix.py`)."
    d = json.loads(path.read_text())
    m = d["machine"]
    load = ", ".join(f"{x:.1f}" for x in m.get("loadavg_at_start", []))
    return "\n".join(
        [
            f"`{d['command']}` — {d['date']}, {d['duration_s'] / 60:.1f} min; {m['nproc']} × {m['cpu_model']}, "
            f"vLLM {m['vllm']}; load average at start {load}. Run of {d['max_steps']} steps; each service down "
            f"{d['down_s']:.0f} s; reconcile every {d['reconcile_interval_s']:.0f} s.",
            "",
            d.get("table_md", "(no table in the result file)"),
        ]
    )


def replace_between(path: Path, start: str, end: str, body: str) -> bool:
    """Put ``body`` between the markers ``start`` and ``end`` of ``path``; False when a marker is missing."""
    text = path.read_text()
    if start not in text or end not in text:
        C.say(f"{path}: markers {start} / {end} not found")
        return False
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{body}\n{end}{tail}")
    C.say(f"updated {path.relative_to(C.ROOT)}")
    return True


def main() -> int:
    body = "\n\n".join(section(n) for n in TITLES)
    done = replace_between(README, START, END, body)
    done = replace_between(PROJECT_README, FAULTS_START, FAULTS_END, fault_matrix()) and done
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
