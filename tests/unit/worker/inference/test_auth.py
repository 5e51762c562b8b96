"""worker.inference.auth: the middleware a run's vLLM server gets, on a real ASGI app, and how the server is
started with it (command line without the key, environment with it)."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from worker.inference.auth import API_KEY_VAR, RequireApiKey, key_header, new_api_key
from worker.inference.server import server_command, server_env


def app() -> Starlette:
    async def ok(_request: object) -> JSONResponse:
        return JSONResponse({"ok": True})

    paths = ("/health", "/v1/models", "/collective_rpc", "/pause")
    s = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in paths])
    s.add_middleware(RequireApiKey)
    return s


def test_every_path_but_health_needs_the_bearer_key(monkeypatch: pytest.MonkeyPatch) -> None:
    key = new_api_key()
    assert len(key) == 43 and key != new_api_key()
    monkeypatch.setenv(API_KEY_VAR, key)
    with TestClient(app()) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/health").status_code == 401  # only the GET probe is open
        for path in ("/v1/models", "/collective_rpc", "/pause"):
            for headers in ({}, {"Authorization": f"Bearer {key}x"}, {"Authorization": f"Basic {key}"}):
                assert c.post(path, headers=headers).status_code == 401
            assert c.post(path, headers=key_header(key)).json() == {"ok": True}
            assert c.post(path, headers=key_header()).status_code == 200  # key_header reads the variable


def test_the_server_does_not_start_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_VAR, raising=False)
    with pytest.raises(RuntimeError, match=f"{API_KEY_VAR} is empty"), TestClient(app()) as c:
        c.get("/health")
    assert key_header() == {}


def test_server_command_and_env_carry_the_key_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_VAR, "inherited")
    cmd = server_command("m", "127.0.0.1", 8000, require_key=True)
    assert cmd[cmd.index("--middleware") + 1] == "worker.inference.auth.RequireApiKey"
    assert "--api-key" not in cmd and "--middleware" not in server_command("m", "127.0.0.1", 8000)
    env = server_env({"PATH": "/bin", API_KEY_VAR: "inherited", "VLLM_API_KEY": "old"}, api_key="k1")
    assert (env[API_KEY_VAR], env["VLLM_API_KEY"]) == ("k1", "k1")
    open_env = server_env({"PATH": "/bin", API_KEY_VAR: "inherited", "VLLM_API_KEY": "old"})
    assert API_KEY_VAR not in open_env and "VLLM_API_KEY" not in open_env
