"""Copy the tables of the latest ``benchmarks/results/*.json`` into ``benchmarks/README.md``.

Replaces everything between ``<!-- results:start -->`` and ``<!-- results:end -->`` with, per
benchmark, its command, date, machine facts, any ``note`` and the table the script printed.

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
TITLES = {
    "rollout_throughput": "Rollout throughput: server alone vs in the RL loop",
    "trainer_throughput": "Trainer throughput",
    "vs_trl": "asyncrl vs TRL GRPOTrainer",
    "service_throughput": "Control plane: metric ingestion and series queries",
    "dashboard_page": "Dashboard: run page server time with 100k stored points",
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


def main() -> int:
    text = README.read_text()
    if START not in text or END not in text:
        C.say(f"{README}: markers {START} / {END} not found")
        return 1
    body = "\n\n".join(section(n) for n in TITLES)
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n{body}\n{END}{tail}")
    C.say(f"updated {README.relative_to(C.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
