"""The rollout browser (issue 21, build 2) over a real run: a 2-step multi-turn reverse_twice run of the tiny model
with its own vLLM server writes its run directory (once a session: ``multiturn_run``); the API and the pages show
each rollout's tokens with the log-probs its ``rollouts/step_<n>.jsonl`` records, the environment turn as masked,
filters that keep exactly the records that match, and refuse a rollout id of another run (404 naming ``rid``).
Heavy: vLLM."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import multiturn_run
from tests.support.server import new_token, spec
from tests.support.webui import login
from worker.run.rundir import RunDir, read_jsonl

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def real_run(client: Any, auth: dict[str, str], model: Path) -> tuple[dict[str, Any], RunDir]:
    """A stored run whose run directory a real short multi-turn run wrote."""
    resp = client.post("/api/runs", json=spec(model={"name": str(model)}), headers=auth)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    return run, multiturn_run(model, Path(run["run_dir"]), max_steps=2)


def sampled(rec: dict[str, Any]) -> list[float]:
    """The recorded log-probs of the model-sampled tokens of a record (mask 1)."""
    return [lp for lp, m in zip(rec["completion_logprobs"], rec["completion_mask"], strict=True) if m]


def test_tokens_have_the_recorded_logprobs_and_the_env_turn_is_masked(
    client: Any, auth: dict[str, str], real_run: tuple[dict[str, Any], RunDir]
) -> None:
    run, rd = real_run
    rid = run["id"]
    records = {step: read_jsonl(rd.rollout_file(step)) for step in (1, 2)}
    assert [len(records[1]), len(records[2])] == [4, 4]  # 2 groups x 2 rollouts a step
    assert [r["group"] for r in records[1]] == [0, 0, 1, 1]
    for step, recs in records.items():
        listed = client.get(f"/api/runs/{rid}/rollouts", params={"step": step, "limit": 200}, headers=auth).json()
        assert listed["total"] == 4 and [d["id"] for d in listed["data"]] == [f"{rid}-{step}-{n}" for n in range(4)]
        assert [d["completion_logprobs"] for d in listed["data"]] == [r["completion_logprobs"] for r in recs]
        for n, rec in enumerate(recs):
            resp = client.get(f"/api/runs/{rid}/rollouts/{rid}-{step}-{n}", headers=auth)
            assert resp.status_code == 200, resp.text
            view = resp.json()
            assert view["decoded"] is True and view["summary"]["reward"] == rec["reward"]
            assert [t["kind"] for t in view["turns"]] == ["model", "env", "model"]  # the env answers turn 1
            model_tokens = [t for turn in view["turns"] if turn["kind"] == "model" for t in turn["tokens"]]
            assert [t["logprob"] for t in model_tokens] == sampled(rec)  # exactly the records' floats
            assert [t["id"] for turn in view["turns"] for t in turn["tokens"]] == rec["completion_ids"]
            env = view["turns"][1]["tokens"]
            assert all(t["masked"] and t["logprob"] is None for t in env)
            assert len(env) == rec["completion_mask"].count(0) and "Now reverse this: " in "".join(
                t["text"] for t in env
            )
            assert [t["id"] for t in view["prompt"]] == rec["prompt_ids"]
            assert view["summary"]["truncated"] == (rec["finish_reason"] == "length")


def test_filters_paging_and_task_search_keep_exactly_the_matching_records(
    client: Any, auth: dict[str, str], real_run: tuple[dict[str, Any], RunDir]
) -> None:
    run, rd = real_run
    rid, url = run["id"], f"/api/runs/{run['id']}/rollouts"
    every = [(step, n, r) for step in (2, 1) for n, r in enumerate(read_jsonl(rd.rollout_file(step)))]
    group1 = client.get(url, params={"step": 1, "group": 1}, headers=auth).json()
    assert [d["id"] for d in group1["data"]] == [f"{rid}-1-2", f"{rid}-1-3"]
    task = every[-1][2]["task"]  # a task of step 1
    found = client.get(url, params={"task": task, "limit": 200}, headers=auth).json()
    assert found["step"] is None
    assert [d["id"] for d in found["data"]] == [f"{rid}-{s}-{n}" for s, n, r in every if r["task"] == task]
    for version in (0, 1):
        held = [f"{rid}-{s}-{n}" for s, n, r in every if r["policy_span"][0] <= version <= r["policy_span"][1]]
        got = client.get(url, params={"step": 1, "policy_version": version}, headers=auth).json()
        assert [d["id"] for d in got["data"]] == [i for i in held if i.startswith(f"{rid}-1-")]
    page = client.get(url, params={"step": 2, "offset": 3, "limit": 3}, headers=auth).json()
    assert page["total"] == 4 and [d["id"] for d in page["data"]] == [f"{rid}-2-3"]


def test_a_rollout_id_of_another_run_is_refused(
    client: Any, auth: dict[str, str], make_run: Any, real_run: tuple[dict[str, Any], RunDir]
) -> None:
    run, _ = real_run
    other = make_run()
    for rid in (f"{run['id']}-1-0", f"{run['id']}-2-3"):
        resp = client.get(f"/api/runs/{other['id']}/rollouts/{rid}", headers=auth)
        assert resp.status_code == 404
        assert resp.json()["detail"] == f"rid: rollout {rid} is of run {run['id']}, not of run {other['id']}"
    past = client.get(f"/api/runs/{run['id']}/rollouts/{run['id']}-1-4", headers=auth)
    assert past.status_code == 404 and past.json()["detail"] == f"rid: run {run['id']} has no rollout {run['id']}-1-4"
    bad = client.get(f"/api/runs/{run['id']}/rollouts/1-x", headers=auth)
    assert bad.status_code == 422 and bad.json()["detail"].startswith("rid: expected <run>-<step>-<line>")
    client.cookies.clear()
    assert client.get(f"/api/runs/{run['id']}/rollouts/{run['id']}-1-0").status_code == 401  # no token


def test_pages_show_tokens_filters_and_the_same_task_side_by_side(
    client: Any, make_run: Any, real_run: tuple[dict[str, Any], RunDir]
) -> None:
    run, rd = real_run
    rid = run["id"]
    login(client, new_token(f"viewer-{rid}", role="viewer"))
    rec = read_jsonl(rd.rollout_file(1))[0]
    text = client.get(f"/runs/{rid}/rollouts/{rid}-1-0").text
    shown = [float(x) for x in re.findall(r'data-logprob="([^"]+)"', text)]
    assert shown == sampled(rec)
    assert text.count('class="turn turn-env"') == 1 and "env turn (masked)" in text
    listing = client.get(f"/runs/{rid}/rollouts", params={"step": "1", "group": "0"}).text
    assert re.findall(rf'href="/runs/{rid}/rollouts/({rid}-\d+-\d+)"', listing) == [f"{rid}-1-0", f"{rid}-1-1"]
    assert "1–2 of 2 rollouts" in listing
    assert f'href="/runs/{rid}/rollouts"' in client.get(f"/runs/{rid}").text  # reached from the run page
    other = make_run()
    side = client.get("/rollouts/compare", params={"task": rec["task"], "a": rid, "b": other["id"]}).text
    n = sum(r["task"] == rec["task"] for s in (1, 2) for r in read_jsonl(rd.rollout_file(s)))
    assert f"{n} rollouts of <code>{html.escape(rec['task'])}</code>" in side
    assert f"No rollouts of task <code>{html.escape(rec['task'])}</code>" in side
    bad = client.get(f"/runs/{rid}/rollouts", params={"group": "x"})
    assert bad.status_code == 422 and bad.json()["detail"] == "group: expected a whole number, got 'x'"
