"""Where run processes report: an explicit ASYNCRL_SERVER_URL, else the URL the server published in ASYNCRL_HOME."""

from __future__ import annotations

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
