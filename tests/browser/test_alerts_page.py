"""The dashboard's /alerts page in headless Chromium: a rule added with the keyboard only (Tab between fields,
type-ahead in the selects, Enter submits); the screenshot is the page with the new rule."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import pytest

from tests.support.alerts import new_run
from tests.support.server import new_token

pytestmark = pytest.mark.browser


def test_add_rule_with_the_keyboard_only(page: Any, login: Any, live_server: str, auth: dict[str, str]) -> None:
    run_id = new_run()
    login(page, live_server, new_token(f"alerts-{secrets.token_hex(3)}"))
    page.get_by_role("link", name="Alerts", exact=True).focus()
    page.keyboard.press("Enter")
    page.wait_for_url(f"{live_server}/alerts")
    page.locator("#rule-scope").focus()
    page.keyboard.type(str(run_id))
    page.keyboard.press("Tab")  # kind: type-ahead picks "threshold" (op: "<")
    page.keyboard.type("thre")
    for text in ("", "reward_mean", "", "<", "0.2", "3"):  # name, metric, source, op, value, window
        page.keyboard.press("Tab")
        page.keyboard.type(text)
    page.keyboard.press("Escape")  # a datalist popup, if any, closes
    page.keyboard.press("Enter")
    page.wait_for_url(f"{live_server}/alerts#rule-*")
    rule = page.locator("#rules tbody tr").last
    assert rule.locator("td").all_inner_texts()[1:6] == [
        f"run #{run_id}",
        "threshold",
        "orchestrator/reward_mean < 0.2 for 3 steps",
        "yes",
        "ok",
    ]
    stored = httpx.get(f"{live_server}/api/runs/{run_id}/alerts/rules", headers=auth).json()["data"]
    assert [r["rule"] for r in stored] == [
        {
            "kind": "threshold",
            "name": "",
            "metric": "reward_mean",
            "source": "orchestrator",
            "op": "<",
            "value": 0.2,
            "window": 3,
            "after_step": 0,
        }
    ]
