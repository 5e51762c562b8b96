"""Live config API on Postgres: numbered revisions, whitelist and value checks (nothing written on error), auth,
ended runs, ``GET ?after=``, acknowledgements, and the supervisor's bridge to the run directory."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import free_port, run_token_headers
from worker.live_config import ACKS_FILE, LIVE_CONFIG_FILE, LIVE_KEYS, read_revisions


def patch(client: Any, run_id: int, changes: Any, headers: dict[str, str]) -> Any:
    return client.patch(f"/api/runs/{run_id}/config", json={"changes": changes}, headers=headers)


def stored_rows(client: Any, run_id: int, auth: dict[str, str]) -> tuple[int, int]:
    """(revisions, events) stored for the run."""
    revisions = client.get(f"/api/runs/{run_id}/config", headers=auth).json()["data"]
    events = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["count"]
    return len(revisions), events


def test_revisions_are_numbered_and_normalised_and_get_after_shows_the_rest(
    client: Any, auth: dict[str, str], make_run: Any
) -> None:
    run_id = make_run(trainer={"optim": {"lr": 1e-4}}, orchestrator={"temperature": 1.0, "max_tokens": 32})["id"]
    first = patch(client, run_id, {"trainer.optim.lr": 5e-5, "orchestrator.temperature": "1.5"}, auth)
    assert first.status_code == 201, first.text
    body = first.json()
    assert body["revision"] == 1 and body["applied"] == {} and body["created_by"].startswith("user-")
    assert body["changes"] == {"trainer.optim.lr": 5e-5, "orchestrator.temperature": 1.5}  # "1.5" -> 1.5
    second = patch(client, run_id, {"orchestrator.max_tokens": 40, "orchestrator.eval.interval": 5}, auth)
    assert second.status_code == 201 and second.json()["revision"] == 2

    state = client.get(f"/api/runs/{run_id}/config", headers=auth).json()
    assert state["revision"] == 2 and [r["revision"] for r in state["data"]] == [1, 2]
    assert state["values"] == {
        "trainer.optim.lr": 5e-5,
        "orchestrator.temperature": 1.5,
        "orchestrator.max_tokens": 40,
        "orchestrator.max_off_policy_steps": 8,
        "orchestrator.eval.interval": 5,
        "orchestrator.group_size": 8,
        "orchestrator.batch_size": 8,
        "trainer.loss.kl_tau": 1e-3,
        "trainer.loss.mask_low": 0.2,
        "trainer.loss.mask_high": 0.2,
        "trainer.loss.epsilon": None,  # a field of the ipo loss: not in this (dppo_kl) run
        "trainer.loss.band": None,
        **{f"orchestrator.curriculum.weights.{pool}": None for pool in ("hard", "normal", "easy", "unseen")},
    }  # pool weights: fields of a difficulty_pool curriculum, not of this (standard) run
    assert state["owners"] == LIVE_KEYS
    after = client.get(f"/api/runs/{run_id}/config", params={"after": 1}, headers=auth).json()
    assert after["revision"] == 2 and [r["revision"] for r in after["data"]] == [2]
    assert client.get(f"/api/runs/{run_id}/config", params={"after": 2}, headers=auth).json()["data"] == []
    events = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    assert [(e["kind"], e["data"].get("revision")) for e in events if e["kind"] == "config_revision"] == [
        ("config_revision", 1),
        ("config_revision", 2),
    ]
    # numbering is per run
    other = make_run()["id"]
    assert patch(client, other, {"trainer.optim.lr": 2e-5}, auth).json()["revision"] == 1


def test_concurrent_patches_get_distinct_numbers(live_server: str, auth: dict[str, str], make_run: Any) -> None:
    run_id = make_run()["id"]

    def one(i: int) -> int:
        with httpx.Client(base_url=live_server, headers=auth, timeout=30) as c:
            resp = c.patch(f"/api/runs/{run_id}/config", json={"changes": {"trainer.optim.lr": (i + 1) * 1e-5}})
            assert resp.status_code == 201, resp.text
            return int(resp.json()["revision"])

    with ThreadPoolExecutor(8) as pool:
        numbers = list(pool.map(one, range(8)))
    assert sorted(numbers) == list(range(1, 9))


@pytest.mark.parametrize(
    ("changes", "detail"),
    [
        (
            {"trainer.optim.betas": [0.8, 0.9]},
            "trainer.optim.betas: not a live key; only these change while a run is live: " + ", ".join(LIVE_KEYS),
        ),
        (
            {"trainer.optim.lrr": 1e-5, "trainer.optim.lr": 1e-5},
            "trainer.optim.lrr: not a live key (did you mean 'trainer.optim.lr'?); only these change",
        ),
        ({}, "changes: expected at least one live key"),
        ({"trainer.optim.lr": -1}, "trainer.optim.lr: Input should be greater than 0"),
        ({"trainer.optim.lr": "fast"}, "trainer.optim.lr: Input should be a valid number"),
        ({"orchestrator.temperature": 0}, "orchestrator.temperature: Input should be greater than 0"),
        (
            {"orchestrator.max_tokens": 512},
            "orchestrator.max_tokens: must be below inference.max_model_len (512), got 512",
        ),
        ({"orchestrator.max_tokens": True}, "orchestrator.max_tokens: expected a number, got True"),
        ({"orchestrator.eval.interval": -2}, "orchestrator.eval.interval: Input should be greater than or equal to 0"),
        ({"orchestrator.group_size": 1}, "orchestrator.group_size: GRPO needs at least 2 rollouts per group, got 1"),
        (  # a larger step must still fit the worker, as at submit
            {"orchestrator.batch_size": 65536, "orchestrator.group_size": 1024},
            "orchestrator.batch_size: 65536 (x group_size 1024 x inference.max_model_len 512 = 34359738368 rollout "
            "tokens per step) exceeds the worker's capacity (",
        ),
        ({"trainer.loss.kl_tau": -1}, "trainer.loss.kl_tau: Input should be greater than or equal to 0, got -1"),
        (
            {"trainer.loss.epsilon": 0.1},
            "trainer.loss.epsilon: not a field of this run's trainer.loss (type 'dppo_kl')",
        ),
    ],
)
def test_bad_changes_are_422_naming_the_key_and_write_nothing(
    client: Any, auth: dict[str, str], make_run: Any, changes: dict[str, Any], detail: str
) -> None:
    run_id = make_run()["id"]
    assert patch(client, run_id, {"orchestrator.max_off_policy_steps": 3}, auth).status_code == 201
    before = stored_rows(client, run_id, auth)
    resp = patch(client, run_id, changes, auth)
    assert resp.status_code == 422 and resp.json()["detail"].startswith(detail), resp.text
    assert stored_rows(client, run_id, auth) == before
    values = client.get(f"/api/runs/{run_id}/config", headers=auth).json()["values"]
    assert values["trainer.optim.lr"] == 1e-4 and values["orchestrator.max_off_policy_steps"] == 3


def test_value_checks_see_earlier_revisions(client: Any, auth: dict[str, str], make_run: Any) -> None:
    run_id = make_run(inference={"max_model_len": 128})["id"]
    resp = patch(client, run_id, {"orchestrator.max_tokens": 128}, auth)
    assert resp.status_code == 422 and "inference.max_model_len (128)" in resp.json()["detail"]
    assert patch(client, run_id, {"orchestrator.max_tokens": 100}, auth).status_code == 201
    assert client.get(f"/api/runs/{run_id}/config", headers=auth).json()["values"]["orchestrator.max_tokens"] == 100


@pytest.mark.parametrize("body", [{}, {"changes": [1]}, {"changes": {"trainer.optim.lr": 1e-5}, "extra": 1}])
def test_malformed_body_is_422(client: Any, auth: dict[str, str], make_run: Any, body: Any) -> None:
    run_id = make_run()["id"]
    resp = client.patch(f"/api/runs/{run_id}/config", json=body, headers=auth)
    assert resp.status_code == 422 and resp.json()["detail"].startswith("body."), resp.text
    assert stored_rows(client, run_id, auth)[0] == 0


def test_ended_run_is_409_and_unknown_run_404(client: Any, auth: dict[str, str], make_run: Any) -> None:
    run_id = make_run()["id"]
    assert client.post(f"/api/runs/{run_id}/stop", headers=auth).json()["status"] == "cancelled"
    before = stored_rows(client, run_id, auth)
    resp = patch(client, run_id, {"trainer.optim.lr": 1e-5}, auth)
    assert resp.status_code == 409
    assert resp.json()["detail"] == (
        f"run {run_id} is cancelled: config changes only while it is queued, starting, running or paused"
    )
    assert stored_rows(client, run_id, auth) == before
    assert patch(client, 999_999, {"trainer.optim.lr": 1e-5}, auth).status_code == 404
    assert client.get("/api/runs/999999/config", headers=auth).status_code == 404


def test_auth(client: Any, auth: dict[str, str], make_run: Any) -> None:
    mine, other = make_run()["id"], make_run()["id"]
    assert patch(client, mine, {"trainer.optim.lr": 1e-5}, auth).status_code == 201
    rt = run_token_headers(mine)
    assert patch(client, mine, {"trainer.optim.lr": 1e-5}, {}).status_code == 401
    resp = patch(client, mine, {"trainer.optim.lr": 1e-5}, rt)  # run tokens do not change config
    assert resp.status_code == 403 and "use a user token" in resp.json()["detail"]
    assert client.get(f"/api/runs/{mine}/config", headers=rt).json()["revision"] == 1
    resp = client.get(f"/api/runs/{other}/config", headers=rt)
    assert resp.status_code == 403 and resp.json()["detail"] == f"this run token belongs to run {mine}, not run {other}"
    ack = {"process": "trainer", "step": 3}
    resp = client.post(f"/api/runs/{mine}/config/1/ack", json=ack, headers=auth)
    assert resp.status_code == 403 and resp.json()["detail"] == "only the run's own token acknowledges config revisions"
    assert client.post(f"/api/runs/{mine}/config/1/ack", json=ack, headers=run_token_headers(other)).status_code == 403
    assert client.get(f"/api/runs/{mine}/config", headers=auth).json()["data"][0]["applied"] == {}


def test_ack_is_recorded_once_and_shown(client: Any, auth: dict[str, str], make_run: Any) -> None:
    run_id = make_run()["id"]
    rt = run_token_headers(run_id)
    patch(client, run_id, {"trainer.optim.lr": 5e-5, "orchestrator.temperature": 1.2}, auth)
    for _ in range(2):  # a repeat with the same step changes nothing
        resp = client.post(f"/api/runs/{run_id}/config/1/ack", json={"process": "trainer", "step": 12}, headers=rt)
        assert resp.status_code == 200 and resp.json()["applied"] == {"trainer": 12}, resp.text
    resp = client.post(f"/api/runs/{run_id}/config/1/ack", json={"process": "orchestrator", "step": 13}, headers=rt)
    assert resp.json()["applied"] == {"trainer": 12, "orchestrator": 13}
    state = client.get(f"/api/runs/{run_id}/config", headers=auth).json()
    assert state["data"][0]["applied"] == {"trainer": 12, "orchestrator": 13}
    events = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    applied = [e for e in events if e["kind"] == "config_applied"]
    assert [e["data"] for e in applied] == [
        {"revision": 1, "process": "trainer", "step": 12},
        {"revision": 1, "process": "orchestrator", "step": 13},
    ]
    assert applied[0]["reason"] == "revision 1 in effect for trainer from step 12"
    # a resumed run that re-did the steps reports the new step: it replaces the old one
    client.post(f"/api/runs/{run_id}/config/1/ack", json={"process": "trainer", "step": 10}, headers=rt)
    assert client.get(f"/api/runs/{run_id}/config", headers=auth).json()["data"][0]["applied"]["trainer"] == 10
    # bad acks: unknown revision, a process that owns none of its keys, a negative step
    resp = client.post(f"/api/runs/{run_id}/config/7/ack", json={"process": "trainer", "step": 1}, headers=rt)
    assert resp.status_code == 404 and resp.json()["detail"] == f"run {run_id} has no config revision 7"
    patch(client, run_id, {"orchestrator.max_tokens": 20}, auth)
    resp = client.post(f"/api/runs/{run_id}/config/2/ack", json={"process": "trainer", "step": 1}, headers=rt)
    assert (
        resp.status_code == 422
        and resp.json()["detail"] == "process: revision 2 is applied by orchestrator, not 'trainer'"
    )
    resp = client.post(f"/api/runs/{run_id}/config/2/ack", json={"process": "orchestrator", "step": -1}, headers=rt)
    assert resp.status_code == 422 and resp.json()["detail"].startswith("body.step")
    assert client.get(f"/api/runs/{run_id}/config", headers=auth).json()["data"][1]["applied"] == {}


def _status(client: Any, run_id: int, *statuses: str) -> None:
    for status in statuses:
        resp = client.post(
            f"/api/runs/{run_id}/status", json={"status": status, "reason": status}, headers=run_token_headers(run_id)
        )
        assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    ("end", "later"), [("completed", ""), ("cancelled", "; a resume applies it"), ("failed", "; a resume applies it")]
)
def test_a_change_the_run_ended_before_applying_is_not_reported_in_effect(
    web: tuple[Any, str], auth: dict[str, str], make_run: Any, end: str, later: str
) -> None:
    """Revision 1 (lr 1e-4 -> 5e-5) is taken up by the trainer at step 3; revision 2 (lr 2e-5, temperature 1.0 ->
    1.3) arrives in the run's last seconds: the orchestrator takes it at step 9, the trainer never does, and the run
    ends. Its lr is then not in effect: ``in_effect`` keeps 5e-5 (and the temperature 1.3 the orchestrator took),
    the revision says which process never applied it."""
    client = web[0]  # logged in to the dashboard too
    run_id = make_run(trainer={"optim": {"lr": 1e-4}}, orchestrator={"temperature": 1.0}, max_steps=9)["id"]
    rt = run_token_headers(run_id)
    _status(client, run_id, "starting", "running")
    patch(client, run_id, {"trainer.optim.lr": 5e-5}, auth)
    client.post(f"/api/runs/{run_id}/config/1/ack", json={"process": "trainer", "step": 3}, headers=rt)
    patch(client, run_id, {"trainer.optim.lr": 2e-5, "orchestrator.temperature": 1.3}, auth)
    live = client.get(f"/api/runs/{run_id}/config", headers=auth).json()
    assert [r["state"] for r in live["data"]] == ["in effect", "pending"]
    assert live["values"]["trainer.optim.lr"] == 2e-5 and live["in_effect"]["trainer.optim.lr"] == 5e-5
    acked = client.post(f"/api/runs/{run_id}/config/2/ack", json={"process": "orchestrator", "step": 9}, headers=rt)
    assert acked.json()["state"] == "pending (trainer)", acked.text
    _status(client, run_id, end)

    body = client.get(f"/api/runs/{run_id}/config", headers=auth).json()
    assert [r["state"] for r in body["data"]] == ["in effect", f"not applied: the run ended first (trainer){later}"]
    assert body["values"]["trainer.optim.lr"] == 2e-5  # what was asked for
    assert body["in_effect"]["trainer.optim.lr"] == 5e-5 and body["in_effect"]["orchestrator.temperature"] == 1.3
    assert body["values"]["orchestrator.temperature"] == 1.3
    page = client.get(f"/runs/{run_id}")  # the dashboard says the same
    assert page.status_code == 200, page.text
    assert f"not applied: the run ended first (trainer){later}" in page.text
    assert '<td id="in-effect-trainer-optim-lr">5e-05</td>' in page.text


def test_openapi_has_the_config_operations_with_examples(client: Any) -> None:
    doc = client.get("/openapi.json").json()
    ops = {op["operationId"] for path in doc["paths"].values() for op in path.values()}
    assert {"config-change_config", "config-get_config", "config-ack_config"} <= ops
    assert doc["components"]["schemas"]["ConfigChange"]["examples"][0]["changes"]["trainer.optim.lr"] == 5e-5


# ----------------------------------------------------------------------------- supervisor bridge


def test_supervisor_bridge_delivers_revisions_and_acks_once_and_survives_the_server_down(
    live_server: str, auth: dict[str, str], make_run: Any, tmp_path: Path
) -> None:
    from worker.launchers.reporter import ConfigBridge

    run_id = make_run()["id"]
    run_dir, home = tmp_path / "run", tmp_path / "home"
    run_dir.mkdir()
    home.mkdir()
    user = httpx.Client(base_url=live_server, headers=auth, timeout=30)
    run_client = httpx.Client(base_url=live_server, headers=run_token_headers(run_id), timeout=30)
    assert user.patch(f"/api/runs/{run_id}/config", json={"changes": {"trainer.optim.lr": 5e-5}}).status_code == 201

    bridge = ConfigBridge(run_client, run_id, run_dir, home / "acks.offset")
    bridge.sync()
    assert not (run_dir / LIVE_CONFIG_FILE).exists()  # no run directory yet (no config.json): it waits
    (run_dir / "config.json").write_text("{}")
    bridge.sync()
    bridge.sync()
    assert [(r["revision"], r["changes"]) for r in read_revisions(run_dir)] == [(1, {"trainer.optim.lr": 5e-5})]

    # the server goes down: a new revision waits there, acks wait in the file
    down = ConfigBridge(
        httpx.Client(base_url=f"http://127.0.0.1:{free_port()}", timeout=2), run_id, run_dir, home / "acks.offset"
    )
    assert (
        user.patch(f"/api/runs/{run_id}/config", json={"changes": {"orchestrator.temperature": 1.3}}).status_code == 201
    )
    with (run_dir / ACKS_FILE).open("a") as f:
        f.write(json.dumps({"revision": 1, "process": "trainer", "step": 4, "time": 0}) + "\n")
    with pytest.raises(httpx.ConnectError):
        down.sync()
    assert len(read_revisions(run_dir)) == 1

    bridge = ConfigBridge(run_client, run_id, run_dir, home / "acks.offset")  # a restarted supervisor
    bridge.sync()
    assert [r["revision"] for r in read_revisions(run_dir)] == [1, 2]
    with (run_dir / ACKS_FILE).open("a") as f:
        f.write(json.dumps({"revision": 2, "process": "orchestrator", "step": 6, "time": 0}) + "\n")
        f.write(json.dumps({"revision": 9, "process": "trainer", "step": 6, "time": 0}) + "\n")  # unknown: skipped
        f.write('{"revision": 2, "process": "orch')  # half-written: waits for the rest
    bridge.sync()
    assert bridge.offset == (run_dir / ACKS_FILE).stat().st_size - len('{"revision": 2, "process": "orch')
    assert int((home / "acks.offset").read_text()) == bridge.offset
    state = user.get(f"/api/runs/{run_id}/config").json()
    assert [r["applied"] for r in state["data"]] == [{"trainer": 4}, {"orchestrator": 6}]
    bridge.sync()
    events = user.get(f"/api/runs/{run_id}/events").json()["data"]
    assert len([e for e in events if e["kind"] == "config_applied"]) == 2  # each ack posted once
    assert [r["revision"] for r in read_revisions(run_dir)] == [1, 2]
