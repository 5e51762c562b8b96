"""``/api/sweeps`` on the real Postgres: a 2x2 grid whose trials are held at the rung (each run's ``ckpt.hold_at``)
and stopped through the normal stop path, the worst pruned there (C17, with the metric posted by hand through the runs' own metric route), and every bad input of a
sweep spec answered 422 naming the field with nothing created."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, func, select

from server.models import Run, Sweep
from server.services import runs, sweeps
from tests.support.checkpoints import mark_complete
from tests.support.server import new_token, run_token_headers, spec
from tests.support.webui import login

GRID = {"trainer.optim.lr": [1e-4, 3e-4], "orchestrator.temperature": [0.7, 1.0]}


def sweep_spec(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "c17",
        "base": spec(max_steps=4),
        "grid": GRID,
        "max_parallel": 4,
        "metric": "eval/reward_mean",
        "mode": "max",
        "pruning": {"rule": "successive_halving", "at_steps": [2], "reduction_factor": 1.5},
    }
    body.update(overrides)
    return body


def report(run_id: int, *statuses: str) -> None:
    from fastapi.testclient import TestClient

    from server.main import app

    with TestClient(app) as c:
        for status in statuses:
            resp = c.post(f"/api/runs/{run_id}/status", json={"status": status}, headers=run_token_headers(run_id))
            assert resp.status_code == 200, resp.text


def post_metric(client: Any, run_id: int, values: dict[int, float]) -> None:
    points = [
        {"source": "eval", "step": s, "name": "reward_mean", "value": v, "time": time.time()} for s, v in values.items()
    ]
    resp = client.post(f"/api/runs/{run_id}/metrics", json={"points": points}, headers=run_token_headers(run_id))
    assert resp.status_code == 200, resp.text


def test_c17_grid_2x2_prunes_the_worst_at_the_rung_and_reports_the_best(
    client: Any, auth: dict[str, str], session: Session
) -> None:
    resp = client.post("/api/sweeps", json=sweep_spec(), headers=auth)
    assert resp.status_code == 201, resp.text
    sw = resp.json()
    assert [t["params"] for t in sw["trials"]] == [
        {"trainer.optim.lr": 1e-4, "orchestrator.temperature": 0.7},
        {"trainer.optim.lr": 1e-4, "orchestrator.temperature": 1.0},
        {"trainer.optim.lr": 3e-4, "orchestrator.temperature": 0.7},
        {"trainer.optim.lr": 3e-4, "orchestrator.temperature": 1.0},
    ]
    ids = [t["run_id"] for t in sw["trials"]]
    assert None not in ids and len(set(ids)) == 4  # max_parallel 4: every trial has its run at once
    for trial, run_id in zip(sw["trials"], ids, strict=True):
        run = client.get(f"/api/runs/{run_id}", headers=auth).json()
        assert run["name"] == f"c17-{trial['index']}" and run["status"] == "queued"
        assert run["spec"]["trainer"]["optim"]["lr"] == trial["params"]["trainer.optim.lr"]
        assert run["spec"]["orchestrator"]["temperature"] == trial["params"]["orchestrator.temperature"]
        assert run["spec"]["ckpt"]["hold_at"] == [2]  # its trainer checkpoints at the rung and holds there
        events = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
        assert [e["data"]["sweep_id"] for e in events if e["kind"] == "sweep"] == [sw["id"]]  # points back
    for run_id in ids:
        report(run_id, "starting", "running")
    # step 1 and 2 values; trial 3 is clearly worst at step 2 (0.05 against 0.40, 0.55, 0.30)
    values = {0: {1: 0.30, 2: 0.40}, 1: {1: 0.35, 2: 0.55}, 2: {1: 0.20, 2: 0.30}, 3: {1: 0.10, 2: 0.05}}
    for i in (0, 1, 2):
        post_metric(client, ids[i], values[i])
        checkpoint(client, auth, ids[i], 2)  # what its trainer does at a ckpt.hold_at step: checkpoint, then hold
    post_metric(client, ids[3], {1: 0.10})
    held = "held at step 2 until the rung is decided: eval/reward_mean"
    assert sweeps.tick(session, sw["id"]) == [
        f"trial 0 (run {ids[0]}): {held} 0.4",
        f"trial 1 (run {ids[1]}): {held} 0.55",
        f"trial 2 (run {ids[2]}): {held} 0.3",
    ]  # trial 3 has not reached step 2: the rung waits
    post_metric(client, ids[3], {2: 0.05})
    checkpoint(client, auth, ids[3], 2)
    done = sweeps.tick(session, sw["id"])
    reason = "pruned at step 2 by successive_halving: eval/reward_mean 0.05"
    promoted = "promoted at step 2 by successive_halving: eval/reward_mean"
    assert done == [
        f"trial 3 (run {ids[3]}): {held} 0.05",
        f"trial 0 (run {ids[0]}): {promoted} 0.4",
        f"trial 1 (run {ids[1]}): {promoted} 0.55",
        f"trial 2 (run {ids[2]}): {promoted} 0.3",
        f"trial 3 (run {ids[3]}): {reason}",
        "rung 2 decided: 1 pruned, 3 promoted",
    ]  # the held runs still stop: none resumes yet
    now = client.get(f"/api/sweeps/{sw['id']}", headers=auth).json()
    assert [t["status"] for t in now["trials"]] == ["waiting", "waiting", "waiting", "pruned"]
    assert (now["trials"][3]["pruned_step"], now["trials"][3]["reason"]) == (2, reason)
    assert now["decided_steps"] == [2]
    assert now["best"] == {"trial": 1, "run_id": ids[1], "params": sw["trials"][1]["params"], "step": 2, "value": 0.55}
    for i in range(4):  # every run stopped once, through the normal stop path, at the rung it was held at
        events = client.get(f"/api/runs/{ids[i]}/events", headers=auth).json()["data"]
        kinds = [
            (e["kind"], e["data"].get("step")) for e in events if e["kind"] in ("held", "pruned", "stop_requested")
        ]
        assert kinds == [("held", 2), ("stop_requested", None), *([("pruned", 2)] if i == 3 else [])]
    assert sweeps.tick(session, sw["id"]) == []  # decided once; the held runs still stop
    login(client, new_token(f"sweep-web-{sw['id']}"))
    frag = client.get(f"/sweeps/{sw['id']}", params={"part": "trials"}, headers={"HX-Request": "true"})
    assert frag.status_code == 200 and '<tr data-trial="3" class="trial-pruned">' in frag.text  # htmx keeps polling
    assert "<html" not in frag.text
    for run_id in ids:
        report(run_id, "cancelled")  # what stop_run does: cancelled, checkpoints kept
    resumed = "resumed from checkpoint step 2 after the rung at step 2"
    assert sweeps.tick(session, sw["id"]) == [f"trial {i} (run {ids[i]}): {resumed}" for i in (0, 1, 2)]
    for i in (0, 1, 2):
        report(ids[i], "starting", "running", "completed")
    assert sweeps.tick(session, sw["id"]) == [
        f"sweep completed: best: trial 1 (run {ids[1]}) eval/reward_mean 0.55 at step 2"
    ]
    final = client.get(f"/api/sweeps/{sw['id']}", headers=auth).json()
    assert final["status"] == "completed"
    assert [t["status"] for t in final["trials"]] == ["finished", "finished", "finished", "pruned"]
    assert [t["run_status"] for t in final["trials"]] == ["completed", "completed", "completed", "cancelled"]

    login(client, new_token("sweep-viewer", role="viewer"))  # the dashboard page, read by a viewer
    html = client.get(f"/sweeps/{sw['id']}").text
    assert '<tr data-trial="3" class="trial-pruned">' in html and "pruned at step 2</strong>" in html
    assert html.count('class="trial-finished"') == 3
    assert '<strong id="best-value">0.55</strong> at step 2' in html
    figs = json.loads(html.split('<script type="application/json" data-figures>')[1].split("</script>")[0])
    assert sorted(figs) == ["by-step", "swept-0", "swept-1"]
    kept, pruned = figs["swept-0"]["data"]
    assert (kept["x"], kept["y"], pruned["x"], pruned["y"]) == ([1e-4, 1e-4, 3e-4], [0.40, 0.55, 0.30], [3e-4], [0.10])
    assert figs["swept-0"]["layout"]["xaxis"]["title"]["text"] == "trainer.optim.lr"
    assert [len(t["x"]) for t in figs["by-step"]["data"]] == [2, 2, 2, 2]
    frag = client.get(f"/sweeps/{sw['id']}", params={"part": "trials"}, headers={"HX-Request": "true"})
    assert frag.status_code == 286  # ended: htmx stops polling
    assert f'<a href="/sweeps/{sw["id"]}">#{sw["id"]} c17</a>' in client.get("/sweeps").text


def checkpoint(client: Any, auth: dict[str, str], run_id: int, step: int) -> None:
    """A complete checkpoint of ``step`` in the run's directory (both parts with their ``.complete`` marker)."""
    mark_complete(Path(client.get(f"/api/runs/{run_id}", headers=auth).json()["run_dir"]), step)


def test_synchronous_halving_holds_trials_at_the_rung_and_resumes_the_promoted(
    client: Any, auth: dict[str, str], session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_parallel 2 < 4 trials: the first two are held at the rung (stopped, ``waiting``), which lets the next two
    start; trial 3's run fails before the rung (decided without it); the rung prunes trial 2 on its value AT step 2
    (its later, better value does not count) and resumes trials 0 and 1 from their step-2 checkpoint, one slot at a
    time."""
    sent: list[tuple[str, int]] = []
    monkeypatch.setattr(sweeps, "enqueue", lambda task, run_id: sent.append((task.value, run_id)))
    monkeypatch.setattr(runs, "enqueue", lambda task, run_id: sent.append((task.value, run_id)))  # the launches
    base = spec(max_steps=4, ckpt={"interval": 2})
    resp = client.post("/api/sweeps", json=sweep_spec(name="sync", base=base, max_parallel=2), headers=auth)
    assert resp.status_code == 201, resp.text
    sw = resp.json()
    assert [t["status"] for t in sw["trials"]] == ["running", "running", "pending", "pending"]
    a, b = (t["run_id"] for t in sw["trials"][:2])
    assert sent == [("asyncrl.launch_run", a), ("asyncrl.launch_run", b)]  # the route's first tick
    sent.clear()

    def trials() -> list[tuple[str, int | None]]:
        got = client.get(f"/api/sweeps/{sw['id']}", headers=auth).json()["trials"]
        return [(t["status"], t["held_step"]) for t in got]

    for run_id in (a, b):
        report(run_id, "starting", "running")
    post_metric(client, a, {1: 0.30, 2: 0.40, 3: 0.45})  # trained past the rung before the tick saw it
    post_metric(client, b, {1: 0.35, 2: 0.55})
    assert sweeps.tick(session, sw["id"]) == []  # the rung's checkpoint is not written yet: neither is held
    checkpoint(client, auth, a, 2)
    checkpoint(client, auth, b, 2)
    held = "held at step 2 until the rung is decided: eval/reward_mean"
    assert sweeps.tick(session, sw["id"]) == [f"trial 0 (run {a}): {held} 0.4", f"trial 1 (run {b}): {held} 0.55"]
    assert sent == [("asyncrl.stop_run", a), ("asyncrl.stop_run", b)]  # the normal stop path
    assert trials() == [("waiting", 2), ("waiting", 2), ("pending", None), ("pending", None)]
    for run_id in (a, b):
        events = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
        assert [(e["kind"], e["data"].get("step")) for e in events if e["kind"] in ("held", "stop_requested")] == [
            ("held", 2),
            ("stop_requested", None),
        ]
    assert sweeps.tick(session, sw["id"]) == []  # the held runs still stop: their slots are not free yet
    report(a, "cancelled")
    report(b, "cancelled")  # what stop_run does: cancelled, checkpoints kept
    started = sweeps.tick(session, sw["id"])
    now = client.get(f"/api/sweeps/{sw['id']}", headers=auth).json()
    c, d = (t["run_id"] for t in now["trials"][2:])
    assert started == [f"trial 2: run {c} created", f"trial 3: run {d} created"]
    assert trials() == [("waiting", 2), ("waiting", 2), ("running", None), ("running", None)]

    for run_id in (c, d):
        report(run_id, "starting", "running")
    post_metric(client, d, {1: 0.90})
    report(d, "failed")  # ends before the rung: the rung is decided without it
    post_metric(client, c, {1: 0.20, 2: 0.05, 3: 0.50})  # worst AT step 2, better than trial 0 at step 3
    assert sweeps.tick(session, sw["id"]) == []  # trial 2 has no step-2 checkpoint yet: the rung waits
    checkpoint(client, auth, c, 2)
    sent.clear()
    done = sweeps.tick(session, sw["id"])
    pruned = "pruned at step 2 by successive_halving: eval/reward_mean 0.05"
    promoted = "promoted at step 2 by successive_halving: eval/reward_mean"
    assert done == [
        f"trial 2 (run {c}): {held} 0.05",
        f"trial 0 (run {a}): {promoted} 0.4",
        f"trial 1 (run {b}): {promoted} 0.55",
        f"trial 2 (run {c}): {pruned}",
        "rung 2 decided: 1 pruned, 2 promoted",
        f"trial 0 (run {a}): resumed from checkpoint step 2 after the rung at step 2",
    ]  # trial 2's run still stops: one slot is free, so trial 1 waits for it
    assert sent == [("asyncrl.launch_run", a), ("asyncrl.stop_run", c)]
    assert trials() == [("running", None), ("waiting", 2), ("pruned", None), ("finished", None)]
    now = client.get(f"/api/sweeps/{sw['id']}", headers=auth).json()
    assert now["decided_steps"] == [2] and now["trials"][3]["reason"] == "run failed"
    assert (now["trials"][2]["pruned_step"], now["trials"][2]["reason"]) == (2, pruned)
    run_a = client.get(f"/api/runs/{a}", headers=auth).json()
    assert run_a["status"] == "queued"  # the same run, resumed: the trial keeps pointing at it
    assert now["trials"][0]["run_id"] == a and now["trials"][0]["last"] == {"step": 2, "value": 0.40}  # 3 re-done
    events = client.get(f"/api/runs/{a}/events", headers=auth).json()["data"]
    assert [(e["kind"], e["reason"]) for e in events if e["kind"] in ("promoted", "resumed")] == [
        ("promoted", f"{promoted} 0.4"),
        ("resumed", f"resumed by sweep {sw['id']} from checkpoint step 2"),
    ]
    events = client.get(f"/api/runs/{c}/events", headers=auth).json()["data"]
    assert [e["kind"] for e in events if e["kind"] in ("held", "pruned", "stop_requested")] == [
        "held",
        "stop_requested",
        "pruned",
    ]  # stopped once: the pruned run was already held
    login(client, new_token(f"sweep-sync-{sw['id']}"))
    html = client.get(f"/sweeps/{sw['id']}").text
    assert '<tr data-trial="1" class="trial-waiting">' in html and "waiting at step 2</strong>" in html

    report(c, "cancelled")
    sent.clear()
    assert sweeps.tick(session, sw["id"]) == [
        f"trial 1 (run {b}): resumed from checkpoint step 2 after the rung at step 2"
    ]
    assert sent == [("asyncrl.launch_run", b)]
    assert client.get(f"/api/runs/{c}", headers=auth).json()["status"] == "cancelled"  # stays stopped, resumable
    for run_id, values in ((a, {3: 0.60, 4: 0.70}), (b, {3: 0.65, 4: 0.80})):
        report(run_id, "starting", "running")
        post_metric(client, run_id, values)
        report(run_id, "completed")
    assert sweeps.tick(session, sw["id"]) == [
        f"sweep completed: best: trial 3 (run {d}) eval/reward_mean 0.9 at step 1"
    ]
    final = client.get(f"/api/sweeps/{sw['id']}", headers=auth).json()
    assert [(t["status"], t["run_status"]) for t in final["trials"]] == [
        ("finished", "completed"),
        ("finished", "completed"),
        ("pruned", "cancelled"),
        ("finished", "failed"),
    ]


def test_max_parallel_starts_trials_as_runs_end(client: Any, auth: dict[str, str], session: Session) -> None:
    body = sweep_spec(name="par", max_parallel=1, grid={"trainer.optim.lr": [1e-4, 2e-4, 3e-4]}, pruning=None)
    sw = client.post("/api/sweeps", json=body, headers=auth).json()
    assert [t["status"] for t in sw["trials"]] == ["running", "pending", "pending"]
    report(sw["trials"][0]["run_id"], "starting", "running", "failed")
    assert sweeps.tick(session, sw["id"])[-1].startswith("trial 1: run ")
    now = client.get(f"/api/sweeps/{sw['id']}", headers=auth).json()
    assert [t["status"] for t in now["trials"]] == ["finished", "running", "pending"]
    assert now["trials"][0]["reason"] == "run failed"
    stopped = client.post(f"/api/sweeps/{sw['id']}/stop", headers={**auth, "User-Agent": "asyncrl-cli"}).json()
    assert stopped["status"] == "cancelled"
    run = client.get(f"/api/runs/{now['trials'][1]['run_id']}", headers=auth).json()
    assert run["status"] == "cancelled"  # queued, never launched: cancelled at once
    owner = run["owner"]
    assert stopped["status_reason"] == f"stopped by {owner} via CLI"
    assert run["status_reason"] == f"stopped by {owner} via CLI (sweep {sw['id']}) before launch"
    assert sweeps.tick(session, sw["id"]) == []


def _counts(session: Session) -> tuple[int, int]:
    session.rollback()
    return (
        int(session.exec(select(func.count()).select_from(Sweep)).one()),
        int(session.exec(select(func.count()).select_from(Run)).one()),
    )


NOT_SWEEPABLE = (
    "not sweepable (a sweep varies numbers, text or booleans of the run spec; not name, kind, output_dir, launcher, "
    "env, monitor, alerts or lists)"
)
BAD = [
    (
        {"grid": {"trainer.optim.lrr": [1e-4]}},
        "grid.trainer.optim.lrr: unknown spec key (did you mean 'trainer.optim.lr'?)",
    ),
    (
        {"grid": {"trainer.optim": [1]}},
        "grid.trainer.optim: a table, not a value; sweep one of its keys such as trainer.optim.betas",
    ),
    ({"grid": {"output_dir": ["/tmp/x"]}}, f"grid.output_dir: {NOT_SWEEPABLE}"),
    ({"grid": {"launcher.type": ["local"]}}, f"grid.launcher.type: {NOT_SWEEPABLE}"),
    ({"grid": {}}, "grid: empty; give at least one dotted key with a list of values"),
    ({"grid": {"trainer.optim.lr": []}}, "grid.trainer.optim.lr: empty list; give at least one value"),
    ({"grid": None}, "grid: missing; give a [grid] of dotted keys with values and/or a [random] of ranges"),
    (
        {"grid": None, "random": {"trainer.optim.lr": {"low": 1e-3, "high": 1e-5}}},
        "random.trainer.optim.lr: low 0.001 > high 1e-05; expected low <= high",
    ),
    ({"max_parallel": 0}, "max_parallel: expected an integer from 1 to 64, got 0"),
    ({"max_parallel": -3}, "max_parallel: expected an integer from 1 to 64, got -3"),
    ({"mode": "maximum"}, "mode: Input should be 'max' or 'min'"),
    ({"metric": "reward"}, "metric: expected <source>/<name> such as eval/reward_mean, got 'reward'"),
    (
        {"metric": "eval/reward_maen"},
        "metric: eval logs no 'reward_maen' (did you mean 'reward_mean'?); it logs reward_mean, pass_at_k, k, n, "
        "num_examples, completion_len_mean, reward_missing",
    ),
    (
        {"metric": "evl/reward_mean"},
        "metric: unknown source 'evl' in 'evl/reward_mean'; expected one of trainer, orchestrator, eval, inference, vllm",
    ),
    (
        {"pruning": {"rule": "successive_halving", "at_steps": [4]}},
        "pruning.at_steps: step 4 is not before base max_steps 4",
    ),
    # a trial's bad value is named as the submitter wrote the key: grid.<key>, random.<key>, or base.<key> (trial i)
    ({"grid": {"trainer.optim.lr": [-1.0]}}, "grid.trainer.optim.lr: Input should be greater than 0, got -1.0"),
    (
        {"grid": None, "random": {"orchestrator.group_size": {"low": 2000, "high": 2000, "integer": True}}},
        "random.orchestrator.group_size: Input should be less than or equal to 1024, got 2000",
    ),
    (  # the base alone is valid; trial 1's max_steps makes its own ckpt.hold_at too late
        {"base": spec(max_steps=4, ckpt={"hold_at": [3]}), "grid": {"max_steps": [4, 3]}, "pruning": None},
        "base.ckpt.hold_at: step 3 is not before max_steps 3 (trial 1: max_steps = 3)",
    ),
    (
        {"grid": {"inference.max_model_len": [1024, 64], "trainer.optim.lr": [1e-4]}, "pruning": None},
        "base.orchestrator.max_tokens: must be below inference.max_model_len (64), got 64 (trial 1: "
        "inference.max_model_len = 64, trainer.optim.lr = 0.0001)",
    ),
    (
        {"base": spec(max_steps=4, model={"name": "/etc/x"})},
        "base.model.name: '/etc/x' is not allowed in a run submitted to the service; allowed: a hub id (org/name) or "
        "a path under MODEL_ROOTS (/nonexistent, /tmp), without '..' or '~'",
    ),
    (
        {"grid": {"model.name": ["/etc/x"]}, "pruning": None},
        "grid.model.name: '/etc/x' is not allowed in a run submitted to the service; allowed: a hub id (org/name) or "
        "a path under MODEL_ROOTS (/nonexistent, /tmp), without '..' or '~'",
    ),
    # fresh-user findings (2026-12-04): each was created and then never ran, or ran twice the same, or never pruned
    (
        {"grid": {"trainer.optim.lr": [1e-4, 1e-4]}},
        "grid.trainer.optim.lr: 0.0001 is listed twice; each value once (two trials would be the same)",
    ),
    (
        {"grid": {"max_steps": [8, 2]}, "pruning": {"rule": "successive_halving", "at_steps": [2]}},
        "pruning.at_steps: step 2 is not before max_steps 2 of the trial (max_steps = 2)",
    ),
    # a number swept into a text key would be taken as text (model.name = "0.84"): only numeric keys take numbers
    (
        {"grid": None, "pruning": None, "random": {"model.name": {"low": 0, "high": 1}}},
        "random.model.name: a text key; a random range draws numbers, so only numeric keys take one (sweep text with "
        "grid values)",
    ),
    (
        {"grid": {"model.name": [0.5, 1.5]}, "pruning": None},
        'grid.model.name: 0.5 is a number, but model.name takes text; give text values such as "0.5"',
    ),
    (
        {"base": "configs/reverse_text/rl.toml"},
        "base: expected the run spec as a table (the CLI reads base = 'path.toml' into it)",
    ),
    (
        {"base": {**spec(max_steps=4), "output_dir": "/tmp/x"}},
        "base.output_dir: the service chooses the run folder (<ASYNCRL_OUTPUT_DIR>/runs/<id>/<name>); leave "
        "output_dir out of a submitted spec",
    ),
    (  # the API's own words, not the CLI's ("this command runs 'rl' specs")
        {"base": {**spec(max_steps=4), "kind": "sft"}},
        "base.kind: a sweep runs 'rl' runs; give an 'rl' spec as its base, got 'sft'",
    ),
    (
        {"max_paralel": 4},
        "max_paralel: unknown sweep key (did you mean 'max_parallel'?); allowed: name, base, grid, random, "
        "num_samples, seed, max_parallel, metric, mode, pruning",
    ),
    (
        {"base": {**spec(max_steps=4), "trainer": {"optim": {"lrr": 1e-4}}}},
        "base.trainer.optim.lrr: unknown key (did you mean 'trainer.optim.lr'?)",
    ),
    (  # the rungs join the base's own ckpt.hold_at in each trial's run: 32 + rung 2 is one too many
        {"base": spec(max_steps=40, ckpt={"hold_at": list(range(3, 35))})},
        "base.ckpt.hold_at: List should have at most 32 items after validation, not 33 (with the rungs of "
        "pruning.at_steps added)",
    ),
    (  # what the launch would refuse is refused at submit (server.services.launch_checks); port 9: nothing listens
        {"base": spec(max_steps=4, inference={"urls": ["http://127.0.0.1:9"]})},
        "base.inference.urls.0: http://127.0.0.1:9 does not answer GET /health within 2 s",
    ),
]


@pytest.mark.parametrize(("change", "detail"), BAD, ids=[b[1].split(":")[0] + f"-{i}" for i, b in enumerate(BAD)])
def test_bad_sweep_is_422_naming_the_field_and_creates_nothing(
    client: Any, auth: dict[str, str], session: Session, change: dict[str, Any], detail: str
) -> None:
    body = {k: v for k, v in sweep_spec(**change).items() if v is not None}
    before = _counts(session)
    resp = client.post("/api/sweeps", json=body, headers=auth)
    assert resp.status_code == 422, resp.text
    assert resp.json() == {"detail": detail}, resp.json()["detail"]
    assert _counts(session) == before


def test_capacity_errors_name_the_sweep_key(client: Any, auth: dict[str, str], session: Session, declared: Any) -> None:
    """No worker holds the base (``base.<key>``), a swept value (``grid.<key>``), or a trial whose swept values make
    a base key too large (``base.<key>: ... (trial i: ...)``): 422, nothing created."""
    declared("small", 2, 4, 0)
    cap = "exceeds the worker's capacity (2 cores, 4 GiB, 0 GPUs)"
    cases = [
        ({"base": spec(max_steps=4, trainer={"threads": 3})}, f"base.trainer.threads: 3 {cap}: at most 2"),
        ({"grid": {"trainer.threads": [1, 3]}}, f"grid.trainer.threads: 3 {cap}: at most 2"),
        (
            {
                "base": spec(max_steps=4, orchestrator={"batch_size": 32}),
                "grid": {"orchestrator.group_size": [8, 1024]},
            },
            "base.orchestrator.batch_size: 32 (x group_size 1024 x inference.max_model_len 512 = 16777216 rollout "
            f"tokens per step) {cap}: at most 8388608 tokens (256 bytes each in 0.5 of the memory) (trial 1: "
            "orchestrator.group_size = 1024)",
        ),
    ]
    for change, detail in cases:
        before = _counts(session)
        resp = client.post("/api/sweeps", json=sweep_spec(**change), headers=auth)
        assert (resp.status_code, resp.json()) == (422, {"detail": detail}), change
        assert _counts(session) == before


def test_unknown_sweep_is_404_and_writes_need_a_token(client: Any, auth: dict[str, str]) -> None:
    assert client.get("/api/sweeps/999999", headers=auth).json() == {"detail": "sweep 999999 not found"}
    assert client.post("/api/sweeps", json=sweep_spec()).status_code == 401


def test_asyncrl_sweep_submits_and_exits_2_on_a_bad_key(
    capsys: pytest.CaptureFixture[str],
    live_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    session: Session,
) -> None:
    from worker.cli import main

    monkeypatch.setenv("ASYNCRL_URL", live_server)
    monkeypatch.setenv("ASYNCRL_TOKEN", new_token("cli-sweep"))
    (tmp_path / "base.toml").write_text('name = "b"\nmax_steps = 4\n[model]\nname = "/nonexistent/m"\n')
    bad = tmp_path / "bad.toml"
    bad.write_text('base = "base.toml"\nmax_parallel = 2\n[grid]\n"orchestrator.temprature" = [0.7, 1.0]\n')
    before = _counts(session)
    assert main(["sweep", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: 422: grid.orchestrator.temprature: unknown spec key (did you mean 'orchestrator.temperature'?)"
    )
    assert _counts(session) == before
    good = tmp_path / "good.toml"
    good.write_text(
        'name = "cli"\nbase = "base.toml"\nmax_parallel = 2\n[grid]\n"orchestrator.temperature" = [0.7, 1.0, 1.2]\n'
    )
    assert main(["sweep", str(good)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["name"], out["trials"], len(out["runs"])) == ("cli", 3, 2)  # max_parallel 2: two runs queued
    assert main(["sweep", "show", str(out["id"])]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [t["status"] for t in shown["trials"]] == ["running", "running", "pending"]
    assert main(["sweep", "stop", str(out["id"])]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "cancelled"
