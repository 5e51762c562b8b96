"""The orchestrator's own bookkeeping (``worker/orchestrator/orchestrator.py``): background-task failures end the run,
case C24's truncation warning, one eval per policy version."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from worker.orchestrator import orchestrator as orch_module
from worker.orchestrator.orchestrator import TRUNCATED_WARN_FRACTION, Orchestrator, until
from worker.rundir import RunDir, read_jsonl
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


def test_a_policy_version_is_evaluated_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int | None] = []

    async def fake_evaluate(*_: Any, seed: int | None, **__: Any) -> dict[str, float]:
        calls.append(seed)
        return {"reward_mean": 0.5}

    monkeypatch.setattr(orch_module, "evaluate", fake_evaluate)
    run = RunDir(tmp_path / "run")
    run.create()
    spec = RLSpec.model_validate({"model": {"name": "m"}})
    env = SimpleNamespace(config=spec.envs[0], eval=None)
    sampler = SimpleNamespace(envs=[env])
    fake = _fake(
        run, spec=spec, policy_version=3, _evaluated=set(), client=None, pool=None, sampler=sampler, tokenizer=None
    )
    fake.harness, fake._seed = None, lambda *where: Orchestrator._seed(fake, *where)
    assert asyncio.run(Orchestrator.run_eval(fake)) == {"reward_mean": 0.5}
    assert asyncio.run(Orchestrator.run_eval(fake)) is None  # same weights: skipped, no second eval row
    fake.policy_version = 4
    assert asyncio.run(Orchestrator.run_eval(fake)) == {"reward_mean": 0.5}
    assert [r["step"] for r in read_jsonl(run.metrics) if r["source"] == "eval"] == [3, 4]
    assert len(calls) == 2 and calls[0] != calls[1] and None not in calls  # seeded by version
