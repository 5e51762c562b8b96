"""The run page's write forms keep what is typed while the page polls (issue 21 item 6): the fork form sat in the
status block htmx replaces every ``POLL_S`` seconds, so text typed into it vanished at the next poll."""

from __future__ import annotations

import secrets
import time
from typing import Any

import pytest

from tests.support.server import new_token
from webui.page import POLL_S

pytestmark = [pytest.mark.browser, pytest.mark.timing]  # two refreshes within 3 * POLL_S + 2 s: alone


def test_typed_fork_changes_survive_the_status_refresh(page: Any, login: Any, live_server: str, make_run: Any) -> None:
    run = make_run(name=f"fork-form-{secrets.token_hex(3)}")
    login(page, live_server, new_token(f"fork-form-{secrets.token_hex(3)}"))
    page.goto(f"{live_server}/runs/{run['id']}")
    page.get_by_text("Fork from a checkpoint…").click()
    typed = "trainer.optim.lr = 5e-5\norchestrator.temperature = 1.2"
    page.get_by_label("Changes (TOML").fill(typed)
    page.get_by_label("Name (empty: same)").fill("kept-name")
    swaps = []
    page.evaluate(
        "() => document.body.addEventListener('htmx:afterSwap', e => (window.__swaps = (window.__swaps || 0) + 1))"
    )
    deadline = time.monotonic() + 3 * POLL_S + 2
    while time.monotonic() < deadline:
        page.wait_for_timeout(500)
        swaps.append(page.evaluate("() => window.__swaps || 0"))
    assert swaps[-1] >= 2, swaps  # the page did refresh its fragments meanwhile (status among them)
    assert page.get_by_label("Changes (TOML").input_value() == typed
    assert page.get_by_label("Name (empty: same)").input_value() == "kept-name"
    assert page.locator("details:has(#fork-changes)").evaluate("d => d.open")  # still open
    assert page.locator("#status-badge").inner_text() == "queued"
