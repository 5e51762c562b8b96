"""The rollout browser in headless Chromium (issue 21's acceptance): a real 2-step multi-turn reverse_twice run of the
tiny model (its own vLLM server; once a session: ``multiturn_run``) writes its run directory; from the run page a
viewer opens the rollout list, filters it by group, opens a rollout and sees its model tokens carrying exactly the
log-probs of the run's rollout record and the environment's turn shown as masked. The screenshot is the token view.
Heavy: vLLM."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.runs import multiturn_run
from tests.support.server import new_token, spec
from worker.run.rundir import read_jsonl

pytestmark = [pytest.mark.browser, pytest.mark.vllm]


def test_a_real_rollout_shows_recorded_logprobs_and_a_masked_env_turn(
    page: Any, login: Any, live_server: str, tmp_path: Path
) -> None:
    from worker.policy.models import init_model

    model = init_model(tmp_path / "model", size="tiny", seed=0)
    owner = {"Authorization": f"Bearer {new_token(f'owner-{secrets.token_hex(3)}', role='member')}"}
    resp = httpx.post(f"{live_server}/api/runs", json=spec(model={"name": str(model)}), headers=owner)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    rd = multiturn_run(model, Path(run["run_dir"]), max_steps=2)
    rid = run["id"]
    records = read_jsonl(rd.rollout_file(2))
    assert len(records) == 4

    login(page, live_server, new_token(f"viewer-{secrets.token_hex(3)}", role="viewer"))
    page.goto(f"{live_server}/runs/{rid}")
    page.get_by_role("link", name="Browse all rollouts").click()
    page.wait_for_url(f"{live_server}/runs/{rid}/rollouts")
    assert page.locator("#rollouts-list tbody tr").count() == 8  # 2 steps x 2 groups x 2 rollouts, newest first
    page.get_by_label("Step").select_option("2")
    page.get_by_label("Group").fill("1")
    page.get_by_role("button", name="Filter").click()  # htmx swaps the table
    page.locator("#rollouts-list caption", has_text="1–2 of 2 rollouts").wait_for()
    links = page.locator("#rollouts-list tbody a[href*='/rollouts/']:not([href*='?'])")
    assert links.all_inner_texts() == [f"{rid}-2-2", f"{rid}-2-3"]
    links.first.click()
    page.wait_for_url(f"{live_server}/runs/{rid}/rollouts/{rid}-2-2")

    rec = records[2]
    assert rec["group"] == 1
    kinds = page.locator(".turn").evaluate_all("els => els.map(e => e.dataset.kind)")
    assert kinds == ["model", "env", "model"]
    env = page.locator(".turn-env")
    assert env.locator(".turn-label").inner_text() == "env turn (masked)"
    assert env.locator(".tok.env").count() == rec["completion_mask"].count(0)
    assert "Now reverse this: " in env.locator(".tokens").inner_text()
    assert env.locator(".tok.env").first.evaluate("e => getComputedStyle(e).textDecorationLine") == "line-through"
    shown = page.locator(".turn .tok.model").evaluate_all("els => els.map(e => parseFloat(e.dataset.logprob))")
    assert shown == [lp for lp, m in zip(rec["completion_logprobs"], rec["completion_mask"], strict=True) if m]
    page.get_by_text("Token table").click()
    masked_rows = page.locator("#token-table tr.masked")
    assert masked_rows.count() == rec["completion_mask"].count(0)
    assert masked_rows.first.locator("td").nth(4).inner_text() == "—"
