"""The pipeline page's Stop and Resume buttons in headless Chromium (issue 22): a one-stage SFT pipeline whose run is
driven by status reports (no training) is stopped and resumed by clicks, each button shown only while the pipeline's
state allows it; the page's htmx refresh shows it completing, and a Resume clicked on a page left open from before
(the pipeline completed meanwhile) answers with its one-line error on the page. The screenshot is the completed
pipeline's page."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import pytest
from sqlmodel import Session

from server.core.db import engine
from server.services import pipelines
from tests.support.server import BAD_MODEL, new_token, run_token_headers

pytestmark = pytest.mark.browser


def _post(base: str, path: str, body: Any, headers: dict[str, str]) -> Any:
    resp = httpx.post(f"{base}{path}", json=body, headers=headers)
    assert resp.status_code in (200, 201), resp.text
    return resp.json()


def test_stop_and_resume_buttons_follow_the_pipeline_state(page: Any, login: Any, live_server: str) -> None:
    token = new_token(f"piper-{secrets.token_hex(3)}")
    name = f"web-{secrets.token_hex(3)}"
    stage = {"kind": "sft", "base": {"model": {"name": BAD_MODEL}, "max_steps": 4}}
    p = _post(live_server, "/api/pipelines", {"name": name, "stages": [stage]}, {"Authorization": f"Bearer {token}"})
    pid, first = p["id"], p["stages"][0]["run_id"]
    url = f"{live_server}/pipelines/{pid}"

    login(page, live_server, token)
    page.get_by_role("link", name="Pipelines", exact=True).click()
    page.get_by_role("link", name=f"#{pid} {name}").click()
    page.wait_for_url(url)
    assert page.locator("#pipeline-status").inner_text() == "running"
    assert page.locator("#pipeline-resume").count() == 0

    page.locator("#pipeline-stop").click()
    page.wait_for_url(url)
    assert page.locator("#pipeline-status").inner_text() == "cancelled"
    assert page.locator("#pipeline-stop").count() == 0
    assert page.locator(f'tr[data-stage="0"] a[href="/runs/{first}"] + .status').inner_text() == "cancelled"
    stale = page.context.new_page()  # left open on the cancelled pipeline, its Resume button shown
    stale.goto(url)
    assert stale.locator("#pipeline-resume").is_visible()

    page.locator("#pipeline-resume").click()
    page.wait_for_url(url)
    assert page.locator("#pipeline-status").inner_text() == "running"
    assert page.locator("#pipeline-resume").count() == 0 and page.locator("#pipeline-stop").is_visible()
    with Session(engine) as s:
        again = pipelines.public(s, pipelines.get(s, pid))["stages"][0]["run_id"]
    assert again != first  # stopped before its first checkpoint: the stage re-runs as a new run
    assert page.locator(f'tr[data-stage="0"] a[href="/runs/{again}"]').is_visible()

    for status in ("starting", "running", "completed"):  # the stage's run reports; no training
        _post(live_server, f"/api/runs/{again}/status", {"status": status}, run_token_headers(again))
    with Session(engine) as s:
        assert pipelines.tick(s, pid)[-1] == "every stage completed (1)"
    page.wait_for_selector("#pipeline-status:text-is('completed')")  # the htmx refresh, no reload
    assert page.locator("#pipeline-stop").count() == 0 and page.locator("#pipeline-resume").count() == 0

    stale.locator("#pipeline-resume").click()
    stale.wait_for_url(url + "/resume")
    assert stale.locator("#page-error").inner_text() == (
        f"pipeline {pid} is completed: only failed or cancelled pipelines resume"
    )
    assert stale.locator("#pipeline-status").inner_text() == "completed"
    assert stale.locator("#pipeline-resume").count() == 0
    stale.close()
