"""An SFT run launched from the dashboard's Launch page, in headless Chromium (issue 22): pick
``reverse_text/sft.toml`` from the config list, load it, point it at a tiny model and shorten it, launch; the run
(real Celery worker on Redis -> supervisor -> SFT trainer on CPU, metrics into Postgres) completes and its run page
draws its loss chart, every point the value the trainer wrote in ``metrics.jsonl``.

The model is the tiny random-init Qwen3 (``asyncrl model init``); the data are reverse-text's reference answers (the
config's own). Heavy: run it under ``flock /tmp/asyncrl-heavy.lock``.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w

from tests.support.server import new_token, wait_for
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import load_spec_data

pytestmark = [pytest.mark.browser, pytest.mark.slow]
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "reverse_text" / "sft.toml"
MAX_STEPS = 12


def chart(page: Any, key: str, expr: str) -> Any:
    return page.evaluate(
        f"() => {{ const d = document.getElementById('chart-{key}'); "
        f"return d && d.data && d.data.length ? {expr} : null }}"
    )


def test_launch_an_sft_run_from_the_launch_page_and_see_its_loss_chart(
    page: Any, login: Any, service: str, tmp_path: Path
) -> None:
    from worker.policy.models import init_model

    model = init_model(tmp_path / "model", size="tiny", seed=0)
    token = new_token(f"browser-sft-{secrets.token_hex(3)}")
    login(page, service, token)
    page.goto(f"{service}/launch")
    page.get_by_label("Config from").select_option("reverse_text/sft.toml")
    page.get_by_role("button", name="Load").click()
    page.wait_for_url(f"{service}/launch?config=reverse_text%2Fsft.toml")
    assert page.get_by_label("Run spec (TOML)").input_value() == CONFIG.read_text()  # the config as it is

    name = f"browser-sft-{secrets.token_hex(3)}"
    overrides = {
        "name": name,
        "model.name": str(model),
        "max_steps": str(MAX_STEPS),
        "data.num_examples": "64",
        "data.batch_size": "4",
        "scheduler.warmup_steps": "2",
        "eval_examples": "4",
        "threads": "1",
    }
    page.get_by_label("Run spec (TOML)").fill(tomli_w.dumps(load_spec_data([CONFIG], list(overrides.items()))))
    page.get_by_role("button", name="Launch").click()
    page.wait_for_url(f"{service}/runs/*")
    run_id = int(page.url.rsplit("/", 1)[1])
    assert page.locator("h1").inner_text() == f"#{run_id} {name}"
    assert page.locator("#no-live-config").inner_text().startswith("An sft run has no live config")

    # the run page gains SFT loss points while it trains (htmx polling), then the run completes
    wait_for(lambda: chart(page, "loss", "d.data[0].name") == "sft loss", 300, "the first SFT step on the loss chart")
    wait_for(lambda: page.locator("#status-badge").inner_text() == "completed", 300, "the SFT run completed")
    page.reload()  # the final render: every step stored (the supervisor sends its metrics before its status)
    drawn = wait_for(lambda: chart(page, "loss", "d.data.map(t => [t.name, t.x, t.y])"), 20, "the final loss chart")

    with httpx.Client(base_url=service, headers={"Authorization": f"Bearer {token}"}, timeout=10) as api:
        run = api.get(f"/api/runs/{run_id}").json()
    assert run["kind"] == "sft" and run["status"] == "completed", run["status_reason"]
    rows = {r["step"]: r for r in read_jsonl(RunDir(run["run_dir"]).metrics) if r["source"] == "sft"}
    assert sorted(rows) == list(range(1, MAX_STEPS + 1))
    lines = {label: (xs, ys) for label, xs, ys in drawn}
    assert set(lines) == {"sft loss", "held-out"}, lines
    assert lines["held-out"][0] == [MAX_STEPS]  # the held-out loss is measured at the last step
    assert lines["held-out"][1] == pytest.approx([rows[MAX_STEPS]["eval_loss"]], rel=1e-12)
    xs, ys = lines["sft loss"]
    assert xs == list(range(1, MAX_STEPS + 1))
    assert ys == pytest.approx([rows[s]["loss"] for s in xs], rel=1e-12)
    assert ys[-1] < ys[0]  # it learns: the last step's loss is below the first's
