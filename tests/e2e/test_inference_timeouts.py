"""Case C9: the inference endpoint accepts TCP connections and never replies.

The client must time out (bounded connect/read timeouts), retry a bounded number of times, then raise
InferenceError with a one-line message naming the URL, the route and what happened, within a bound
computed from its timeouts.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.inference.client import InferenceClient, InferenceError

CONNECT_S, READ_S, RETRIES, BACKOFF_S = 0.5, 0.5, 2, 0.05
SLACK_S = 1.5  # event-loop and thread scheduling on a loaded 2-core machine


class BlackHole:
    """A TCP server on 127.0.0.1 that accepts every connection, reads nothing, answers nothing."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)  # hold it open, never reply

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture
def blackhole() -> Iterator[BlackHole]:
    bh = BlackHole()
    yield bh
    bh.close()


def make_client(url: str) -> InferenceClient:
    return InferenceClient(
        url, connect_timeout_s=CONNECT_S, read_timeout_s=READ_S, max_retries=RETRIES, backoff_s=BACKOFF_S
    )


def bound_s() -> float:
    """Every attempt at its deadline (connect + read) plus every backoff, plus scheduling slack."""
    backoff = sum(BACKOFF_S * 2**k for k in range(RETRIES))
    return (RETRIES + 1) * (CONNECT_S + READ_S) + backoff + SLACK_S


async def _timed(coro) -> tuple[float, InferenceError]:
    t0 = time.monotonic()
    with pytest.raises(InferenceError) as ei:
        await coro
    return time.monotonic() - t0, ei.value


@pytest.mark.parametrize("call", ["generate", "update_weights", "pause"])
def test_silent_server_times_out_retries_and_raises(blackhole: BlackHole, call: str) -> None:
    async def go() -> tuple[float, InferenceError]:
        async with make_client(blackhole.url) as client:
            assert client.max_total_s() <= bound_s()
            if call == "generate":
                return await _timed(client.generate([1, 2, 3], n=2, max_tokens=8, temperature=1.0))
            if call == "update_weights":
                return await _timed(client.update_weights("/tmp/nowhere"))
            return await _timed(client.pause())

    elapsed, err = asyncio.run(go())
    route = {"generate": "/v1/completions", "update_weights": "/collective_rpc", "pause": "/pause"}[call]
    msg = str(err)
    assert "\n" not in msg
    assert f"{blackhole.url}{route}" in msg
    assert "ReadTimeout" in msg or "timed out" in msg
    assert f"after {RETRIES + 1} attempt(s)" in msg
    assert blackhole.accepted == RETRIES + 1  # bounded retries, each a fresh connection
    assert RETRIES + 1 <= elapsed / READ_S + 0.5  # it really waited for each read timeout...
    assert elapsed < bound_s()  # ...and not longer than the bound


def test_refused_connection_raises_quickly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when we leave: nothing listens there

    async def go() -> tuple[float, InferenceError]:
        async with make_client(f"http://127.0.0.1:{port}") as client:
            assert not await client.health()
            return await _timed(client.generate([1], n=1, max_tokens=1, temperature=1.0))

    elapsed, err = asyncio.run(go())
    assert "ConnectError" in str(err) and "/v1/completions" in str(err)
    assert elapsed < bound_s()


def test_health_and_wait_ready_are_bounded(blackhole: BlackHole) -> None:
    async def go() -> float:
        async with make_client(blackhole.url) as client:
            t0 = time.monotonic()
            assert not await client.health()
            with pytest.raises(InferenceError, match="/health"):
                await client.wait_ready(timeout_s=1.0, poll_s=0.1)
            return time.monotonic() - t0

    assert asyncio.run(go()) < CONNECT_S + 1.0 + CONNECT_S + SLACK_S


def test_run_against_a_silent_server_fails_with_the_cause(
    blackhole: BlackHole, tiny_model: Path, tmp_path: Path
) -> None:
    """The whole run (launcher, trainer, orchestrator) pointed at the black hole: it fails within its startup
    timeout plus process start-up, the orchestrator's ``failed`` event and the run's own reason both name the
    route and the timeout, and no process of the run is left."""
    import os

    from worker.launchers.local import launch_rl
    from worker.run.rundir import RunDir, read_jsonl
    from worker.spec import load_spec_data, validate_spec

    configs = Path(__file__).resolve().parents[2] / "configs" / "reverse_text"
    spec = validate_spec(
        "rl",
        load_spec_data(
            [configs / "rl.toml"],
            [
                ("model.name", str(tiny_model)),
                ("inference.url", blackhole.url),
                ("output_dir", str(tmp_path)),
                ("name", "c9"),
                ("max_steps", "3"),
                ("inference.startup_timeout_s", "5"),
                ("inference.connect_timeout_s", "1"),
                ("inference.read_timeout_s", "1"),
                ("inference.max_retries", "1"),
            ],
        ),
    )
    t0 = time.monotonic()
    summary = launch_rl(spec, quiet=True)
    elapsed = time.monotonic() - t0
    assert summary["status"] == "failed"
    assert elapsed < 120, elapsed  # start-up of two Python processes with torch on a loaded 2-core box + 5 s
    events = read_jsonl(RunDir(spec.run_dir).events)
    cause = f"GET {blackhole.url}/health: not ready after 5s"
    assert [e["reason"] for e in events if e.get("process") == "orchestrator"] == [cause]
    last = events[-1]
    assert last["event"] == "failed" and last["reason"].startswith(f"orchestrator exited with code 1: {cause} (log: ")
    pids = next(e["pids"] for e in events if e["event"] == "running")
    for pid in pids.values():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state in {"Z", "X"}, f"{pid} still running"
    assert blackhole.accepted >= 1
