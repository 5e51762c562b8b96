"""The boot warm-up's input check and its pause cycle's failure path (worker.inference.warmup); its effect is case
C25 (tests/e2e/test_update_under_load.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from worker.inference.client import InferenceClient, InferenceError
from worker.inference.warmup import BURST, warm_up


def test_warm_up_needs_two_prompt_tokens_and_sends_nothing_without() -> None:
    async def go() -> None:
        async with InferenceClient("http://127.0.0.1:9", max_retries=0) as client:  # nothing listens: no request made
            await warm_up(client, [5])

    with pytest.raises(ValueError, match="prompt_ids: expected at least 2 token ids, got 1"):
        asyncio.run(go())


class Listener(ThreadingHTTPServer):
    request_queue_size = 4 * BURST  # the burst connects at once
    daemon_threads = True


class Server:
    """An HTTP server on 127.0.0.1 that answers the inference routes the warm-up and a weight update call, records
    each request's route in order, and answers ``/pause`` only after ``pause_delay_s`` (a server that paused, whose
    reply reaches the client after its read timeout)."""

    def __init__(self, pause_delay_s: float = 0.0) -> None:
        self.routes: list[str] = []
        self.pause_delay_s = pause_delay_s
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client pools connections

            def do_POST(self) -> None:
                route = self.path.split("?")[0]
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                outer.routes.append(route)
                if route == "/pause":
                    time.sleep(outer.pause_delay_s)
                reply: dict[str, Any] = {}
                if route == "/v1/completions":
                    ids = body["prompt"]
                    rows = [None] + [{str(t): {"logprob": -1.0}} for t in ids[1:]]
                    one = {"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length"}
                    reply = {"choices": [{"index": i, **one, "prompt_logprobs": rows} for i in range(body.get("n", 1))]}
                elif route == "/reset_prefix_cache":
                    reply = {"success": True}
                data = json.dumps(reply).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (read timeout)
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.http = Listener(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_a_pause_that_times_out_is_resumed_by_the_warm_up_and_a_weight_update() -> None:
    """The pause reached the server (it paused) but its reply came after the client's read timeout: the server must
    still get its /resume, or it stays paused for every client."""
    server = Server(pause_delay_s=0.6)

    async def go() -> None:
        async with InferenceClient(server.url, read_timeout_s=0.2, max_retries=0) as client:
            with pytest.raises(InferenceError, match=r"POST http://127\.0\.0\.1:\d+/pause: "):
                await warm_up(client, [3, 4, 5])
            assert [r for r in server.routes if r != "/v1/completions"] == ["/pause", "/resume"]
            assert server.routes[0] == "/v1/completions"  # the lone request; the burst is cancelled by the failure
            server.routes.clear()

            async def load(path: Path) -> dict[str, Any]:
                raise AssertionError(f"no load after a failed pause ({path})")

            with pytest.raises(InferenceError, match=r"/pause: "):
                await client.publish_weights("/nowhere", load=load)
            assert server.routes == ["/pause", "/resume"]

    try:
        asyncio.run(go())
    finally:
        server.close()


def test_the_warm_up_of_a_shared_server_pauses_nothing() -> None:
    """``pause_cycle=False`` (the orchestrator's choice when ``inference.url`` is set): the same traffic, no pause."""
    server = Server()

    async def go() -> dict[str, float]:
        async with InferenceClient(server.url, max_retries=0) as client:
            return await warm_up(client, [3, 4, 5], pause_cycle=False)

    try:
        times = asyncio.run(go())
    finally:
        server.close()
    assert server.routes == ["/v1/completions"] * (1 + BURST + 1)  # lone, burst, prompt_logprobs
    assert set(times) == {"lone_s", "burst_s", "prompt_logprobs_s", "total_s"}
