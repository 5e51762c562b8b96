"""Browser tests of the dashboard: Debian's headless Chromium driven by Playwright against a real server on Postgres.

The database, Redis queue and server fixtures are the ones of ``tests/conftest.py`` (helpers: ``tests.support``): one
test database a pytest process, made by whichever folder asks first and dropped at the process's end, so a pytest-xdist
process that runs files of ``tests/browser`` and ``tests/e2e/service`` in any order makes it once (a package-scoped
database of this folder's own, under the same name, was made a second time there: ``CREATE DATABASE`` of one that
exists). The tests name what they make (runs, sweeps, tags) uniquely: other folders' rows do not disturb them.
Every test leaves a full-page screenshot in ``$ASYNCRL_ARTIFACTS`` (default ``test-artifacts/``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import (
    STATE,
    ApiServer,
    processes,
    start_celery_worker,
    stop_process_group,
)

CHROMIUM = os.environ.get("ASYNCRL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(os.environ.get("ASYNCRL_ARTIFACTS", "test-artifacts"))


@pytest.fixture(scope="session", autouse=True)
def migrated_database(database: str) -> str:
    """Every test here runs against the session's migrated test database."""
    return database


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _page(browser: Any, request: pytest.FixtureRequest, **context: Any) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000}, **context)
    ctx.set_default_timeout(20_000)
    page = ctx.new_page()
    try:
        yield page
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
        ctx.close()


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh browser context and page; a screenshot of it is saved when the test ends."""
    yield from _page(browser, request)


@pytest.fixture
def nojs_page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Like ``page`` with JavaScript disabled."""
    yield from _page(browser, request, java_script_enabled=False)


def _login(page: Any, base: str, token: str) -> None:
    page.goto(f"{base}/login")
    page.get_by_label("API token").fill(token)
    page.keyboard.press("Enter")  # keyboard only
    page.wait_for_url(f"{base}/runs")


@pytest.fixture
def login() -> Any:
    """``login(page, base_url, token)``: log in through the form, keyboard only."""
    return _login


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``asyncrl server`` and a Celery worker, both real processes; yields the server URL. Runs left running by a
    test that failed mid-run are killed at the end (:func:`kill_run_sessions`)."""
    from server.jobs.celery_app import app

    app.control.purge()  # launches queued by earlier tests of this session
    logs = tmp_path_factory.mktemp("service")
    api = ApiServer(logs / "server.log")
    api.start()
    worker = start_celery_worker(api.url, logs / "worker.log")
    try:
        yield api.url
    finally:
        stop_process_group(worker)
        api.kill()
        kill_run_sessions()


def kill_run_sessions() -> None:
    """SIGKILL every process of run supervisors' sessions under this test session's output dir (a test that fails
    mid-run leaves its run training: the supervisor has its own session)."""
    procs = processes()
    sessions = {
        pid
        for pid, (sid, cmd) in procs.items()
        if pid == sid and "worker.launchers.supervisor" in cmd and str(STATE) in cmd
    }
    for pid, (sid, _) in procs.items():
        if sid in sessions:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
