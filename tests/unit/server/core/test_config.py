"""Where run processes report: an explicit ASYNCRL_SERVER_URL, else the URL the server published in ASYNCRL_HOME."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.core.config import Settings


def test_worker_finds_the_server_published_on_its_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCRL_SERVER_URL", raising=False)
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path))
    assert Settings().server_url() == "http://127.0.0.1:8000"  # nothing published yet: the default
    assert Settings().publish_server_url("0.0.0.0", 8731) == "http://127.0.0.1:8731"
    assert (tmp_path / "server_url").read_text() == "http://127.0.0.1:8731\n"
    assert Settings().server_url() == "http://127.0.0.1:8731"  # a worker started later, same home
    assert Settings().publish_server_url("::1", 9000) == "http://[::1]:9000"
    monkeypatch.setenv("ASYNCRL_SERVER_URL", "http://10.0.0.5:8000")
    assert Settings().server_url() == "http://10.0.0.5:8000"  # explicit setting wins


def _server(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ASYNCRL_HOME": str(home)}
    env.pop("ASYNCRL_SERVER_URL", None)
    return subprocess.run(
        [str(Path(sys.executable).parent / "asyncrl"), "server", "--no-migrate", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_server_on_a_busy_port_fails_in_one_line_and_publishes_nothing(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _server(tmp_path, "--port", str(port))
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: --port: cannot listen on 127.0.0.1:{port} (Address already in use)"
    assert not (tmp_path / "server_url").exists()  # the server that owns the port keeps its published URL


@pytest.mark.parametrize("port", ["99999", "0", "80a"])
def test_server_port_must_be_a_tcp_port(tmp_path: Path, port: str) -> None:
    out = _server(tmp_path, "--port", port)
    assert out.returncode == 2 and out.stderr.strip().endswith(f"expected a TCP port 1-65535, got {port!r}")


def test_embedded_server_on_sqlite_serves_the_dashboard_with_runs(tmp_path: Path) -> None:
    """Embedded mode (no DATABASE_URL: SQLite, whose timestamps load without a zone): the README's first mode.
    The run list and run page once used ``utcnow() - created_at`` on a naive value and answered 500."""
    import re

    import httpx

    exe = str(Path(sys.executable).parent / "asyncrl")
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "CELERY_BROKER_URL", "ASYNCRL_SERVER_URL"}}
    env["ASYNCRL_HOME"] = str(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [exe, "server", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = tmp_path / "server_url"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for _ in range(300):
                try:
                    if client.get("/healthz").json()["database"] == "sqlite":
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            assert url.read_text().strip() == f"http://127.0.0.1:{port}"
            token = subprocess.run(
                [exe, "token", "create", "--name", "me"],
                env=env,
                cwd=tmp_path,
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            spec = {"name": "embedded", "model": {"name": "/nonexistent/model"}}
            run = client.post("/api/runs", json=spec, headers={"Authorization": f"Bearer {token}"})
            assert run.status_code == 201, run.text
            assert run.json()["created_at"].endswith(("Z", "+00:00"))  # aware on SQLite too
            csrf = re.search(r'name="csrf" value="([^"]+)"', client.get("/login").text).group(1)  # type: ignore[union-attr]
            assert client.post("/login", data={"csrf": csrf, "token": token, "next": "/runs"}).status_code == 303
            listing = client.get("/runs")
            assert listing.status_code == 200 and "embedded" in listing.text
            page = client.get(f"/runs/{run.json()['id']}")
            assert page.status_code == 200 and "embedded" in page.text
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_generated_secret_key_file_is_0600_and_a_lax_one_is_tightened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SECRET_KEY", raising=False)
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path))
    old = os.umask(0o000)  # the most permissive umask: the mode must not depend on it
    try:
        key = Settings().secret_key()
    finally:
        os.umask(old)
    path = tmp_path / "secret_key"
    assert (path.stat().st_mode & 0o777, len(key)) == (0o600, 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret_key"]  # no temporary file left
    assert Settings().secret_key() == key  # generated once
    path.chmod(0o644)  # written by an older version
    assert Settings().secret_key() == key and path.stat().st_mode & 0o777 == 0o600


def test_code_and_run_env_settings_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALLOWED_CODE_PACKAGES", "mypkg, other_pkg,")
    monkeypatch.setenv("INFERENCE_ALLOW_HOSTS", "vllm.internal")
    monkeypatch.setenv("RUN_ENV_ALLOW", "")
    s = Settings()
    assert (s.ALLOWED_CODE_PACKAGES, s.INFERENCE_ALLOW_HOSTS, s.RUN_ENV_ALLOW) == (
        ["mypkg", "other_pkg"],
        ["vllm.internal"],
        [],
    )
