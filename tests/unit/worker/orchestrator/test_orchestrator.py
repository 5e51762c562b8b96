"""The orchestrator's own bookkeeping (``worker/orchestrator/orchestrator.py``): background-task failures end the run,
case C24's truncation warning, one eval per policy version with ``orchestrator.eval``'s pass@k settings."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from worker.orchestrator import orchestrator as orch_module
from worker.orchestrator.orchestrator import STARVED_GEN_TIME_RATIO, TRUNCATED_WARN_FRACTION, Orchestrator, until
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import RLSpec


async def _forever() -> None:
    await asyncio.sleep(3600)


async def _fails_after(seconds: float) -> None:
    await asyncio.sleep(seconds)
    raise RuntimeError("weight update failed: HTTP 500")


def test_until_raises_the_watchers_error_instead_of_hanging() -> None:
    async def scenario() -> None:
        watcher = asyncio.create_task(_fails_after(0.05))
        main = asyncio.ensure_future(_forever())
        with pytest.raises(RuntimeError, match="weight update failed: HTTP 500"):
            await asyncio.wait_for(until(main, watcher), timeout=5)
        await asyncio.sleep(0)
        assert main.cancelled()

    asyncio.run(scenario())


def test_until_returns_the_result_while_the_watcher_runs() -> None:
    async def answer() -> int:
        await asyncio.sleep(0.01)
        return 42

    async def scenario() -> None:
        watcher = asyncio.create_task(_forever())
        assert await until(answer(), watcher) == 42
        assert not watcher.done()
        watcher.cancel()

    asyncio.run(scenario())


def _fake(run: RunDir, **fields: Any) -> Any:
    return SimpleNamespace(run=run, _truncation_warned=False, **fields)


def test_c24_truncation_warns_once_per_episode_above_the_threshold(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    fake = _fake(run)
    assert TRUNCATED_WARN_FRACTION == 0.5
    for step, fraction in enumerate([0.4, 1.0, 0.9, 0.5, 0.75], start=1):
        Orchestrator.warn_truncated(fake, step, fraction, max_tokens=2)
    events = [e for e in read_jsonl(run.events) if e["event"] == "truncated"]
    assert [(e["step"], e["fraction"]) for e in events] == [(2, 1.0), (5, 0.75)]  # 0.5 is not above: it clears
    assert events[0]["reason"] == (
        "step 2: 100% of the rollouts stopped at orchestrator.max_tokens = 2 (above 50%): their answers are cut; "
        "raise max_tokens"
    )


def test_c26_starvation_warns_once_per_episode_when_stale_drops_bias_training(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    fake = SimpleNamespace(run=run, _starvation_warned=False)
    assert STARVED_GEN_TIME_RATIO == 0.75
    # (trained_gen_time_ratio, stale groups dropped): no drops -> no warning whatever the ratio; NaN (nothing timed)
    # neither warns nor clears; 0.75 is not below: it clears
    steps = [(0.3, 0), (0.9, 2), (0.29, 12), (0.2, 10), (float("nan"), 3), (0.75, 1), (0.5, 4)]
    for step, (ratio, dropped) in enumerate(steps, start=1):
        Orchestrator.warn_starved(fake, step, ratio, dropped)  # type: ignore[arg-type]
    events = [e for e in read_jsonl(run.events) if e["event"] == "starved"]
    assert [(e["step"], e["trained_gen_time_ratio"], e["dropped_groups"]) for e in events] == [
        (3, 0.29, 12),
        (7, 0.5, 4),
    ]
    assert events[0]["reason"] == (
        "step 3: the trained rollouts took 0.29x the generation time of all finished ones and 12 group(s) were dropped "
        "as stale: slow tasks are being left out of training; raise orchestrator.max_off_policy_steps or use "
        'orchestrator.admission = "step"'
    )


def test_a_policy_version_is_evaluated_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int | None] = []
    asked: list[tuple[int, int | None, float]] = []

    async def fake_evaluate(
        *_: Any, seed: int | None, pass_k: int, num_samples: int | None, pass_threshold: float, **__: Any
    ) -> dict[str, float]:
        calls.append(seed)
        asked.append((pass_k, num_samples, pass_threshold))
        return {"reward_mean": 0.5}

    monkeypatch.setattr(orch_module, "evaluate", fake_evaluate)
    run = RunDir(tmp_path / "run")
    run.create()
    ev = {"pass_k": 2, "num_samples": 8, "pass_threshold": 0.5}
    spec = RLSpec.model_validate({"model": {"name": "m"}, "orchestrator": {"eval": ev}})
    env = SimpleNamespace(config=spec.envs[0], eval=None)
    sampler = SimpleNamespace(envs=[env])
    fake = _fake(
        run,
        spec=spec,
        policy_version=3,
        _evaluated=set(),
        client=SimpleNamespace(base_url="http://127.0.0.1:9"),
        pool=None,
        sampler=sampler,
        tokenizer=None,
        seeded_requests=True,
    )
    fake.harnesses, fake._seed = {}, lambda *where: Orchestrator._seed(fake, *where)
    assert asyncio.run(Orchestrator.run_eval(fake)) == {"reward_mean": 0.5}
    assert asyncio.run(Orchestrator.run_eval(fake)) is None  # same weights: skipped, no second eval row
    fake.policy_version = 4
    assert asyncio.run(Orchestrator.run_eval(fake)) == {"reward_mean": 0.5}
    assert [r["step"] for r in read_jsonl(run.metrics) if r["source"] == "eval"] == [3, 4]
    assert len(calls) == 2 and calls[0] != calls[1] and None not in calls  # seeded by version
    assert asked == [(2, 8, 0.5)] * 2  # pass@2 from 8 samples per task, as orchestrator.eval says


def test_a_tool_group_runs_its_harness_on_the_replica_the_pool_leased(monkeypatch: pytest.MonkeyPatch) -> None:
    """With several replicas, each group's agent-harness rollouts go to the replica its group was leased to (one
    harness runner per replica, sharing one rollout limit), not to the first server."""
    from worker.orchestrator.harness import HarnessRunner
    from worker.spec import HarnessConfig

    urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    first = HarnessRunner("m", urls[0], HarnessConfig(max_concurrent=3))
    harnesses = {url: first.on(url) for url in urls}
    assert [h.inference_url for h in harnesses.values()] == urls
    assert harnesses[urls[0]]._slots is harnesses[urls[1]]._slots is first._slots  # one limit for the machine

    used: list[tuple[str, str | None]] = []

    async def fake_rollout_group(client: Any, *args: Any, harness: HarnessRunner | None, **kw: Any) -> list[Any]:  # noqa: ARG001
        used.append((client.base_url, harness.inference_url if harness else None))
        return [SimpleNamespace(completion_ids=[1, 2], env=None)]

    monkeypatch.setattr(orch_module, "rollout_group", fake_rollout_group)
    replicas = [SimpleNamespace(client=SimpleNamespace(base_url=u), version=None) for u in urls]

    class Pool:
        async def run_on(self, work: Any) -> Any:
            return await work(replicas[len(used) % 2])  # leases alternate between the two replicas

    spec = RLSpec.model_validate({"model": {"name": "m"}})
    env = SimpleNamespace(train=None, config=spec.envs[0])
    fake = SimpleNamespace(
        spec=spec,
        pool=Pool(),
        client=replicas[0].client,
        harnesses=harnesses,
        scoring=None,
        tokenizer=None,
        sampler=SimpleNamespace(envs=[env]),
        policy_version=0,
    )
    monkeypatch.setattr(orch_module.ReplicaPool, "count_tokens", staticmethod(lambda replica, n: None))
    for index in range(4):
        asyncio.run(Orchestrator.rollout_group(fake, index, seed=None))
    assert used == [(urls[0], urls[0]), (urls[1], urls[1])] * 2
