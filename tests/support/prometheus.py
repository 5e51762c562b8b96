"""Debian's ``prometheus`` scraping a test's asyncrl server every second (tests/service/test_prometheus.py,
test_monitoring_files.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.support.server import free_port


@contextmanager
def prometheus(server_url: str, token: str, folder: Path, rules: Path | None = None) -> Iterator[str]:
    """A Prometheus on a free 127.0.0.1 port that scrapes ``server_url``'s ``/metrics`` every second with ``token``
    (sent as Bearer) and, with ``rules``, evaluates that rule file every second; yields its API's base URL
    (``http://127.0.0.1:<port>/api/v1``). Its config, data and log live in ``folder``; stopped on exit."""
    port = free_port()
    config = folder / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        + (f"rule_files: ['{rules}']\n" if rules is not None else "")
        + f"scrape_configs:\n  - job_name: asyncrl\n    authorization: {{credentials: '{token}'}}\n"
        f"    static_configs:\n      - targets: ['{server_url.removeprefix('http://')}']\n"
    )
    with (folder / "prometheus.log").open("wb") as log:
        argv = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}"]
        proc = subprocess.Popen([*argv, f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
        try:
            yield f"http://127.0.0.1:{port}/api/v1"
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def api_get(api: str, path: str, **params: Any) -> Any:
    """``data`` of a Prometheus API answer, or None while it does not answer 200 (starting up)."""
    try:
        r = httpx.get(f"{api}/{path}", params=params, timeout=5)
    except httpx.HTTPError:
        return None
    return r.json()["data"] if r.status_code == 200 else None
