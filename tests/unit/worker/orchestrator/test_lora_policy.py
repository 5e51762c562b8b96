"""A LoRA run's policy versions on the orchestrator side (``Orchestrator.load_policy``): an adapter folder is loaded
under the run's own name for the version (``lora_adapter_name``) inside the pause/reset/resume, rollouts name it,
adapters no running rollout may name any more are unloaded, and a full model folder (version 0 on a shared server)
goes back to the base name."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from worker.orchestrator.orchestrator import Orchestrator
from worker.policy.lora_adapters import adapters_in_use, lora_adapter_name
from worker.run.rundir import RunDir
from worker.spec import validate_spec


class FakeClient:
    """The three calls load_policy makes, recording them and the adapters the server would hold."""

    def __init__(self) -> None:
        self.model: str | None = None
        self.calls: list[tuple[str, ...]] = []
        self.loaded: set[str] = set()

    async def publish_weights(self, path: Path, load: Any = None) -> dict[str, Any]:
        self.calls.append(("pause",))
        info = await load(path) if load is not None else {"full": str(path)}
        self.calls.append(("resume",))
        return {**info, "pause_s": 0.125, "load_s": 0.25, "reset_s": 0.0625, "resume_s": 0.0625, "total_s": 0.5}

    async def load_lora_adapter(self, name: str, path: Path) -> dict[str, Any]:
        self.calls.append(("load", name, Path(path).name))
        self.loaded.add(name)
        return {"adapter": name}

    async def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        self.loaded.remove(name)


def _orchestrator(client: FakeClient, run: RunDir, max_async_level: int) -> Orchestrator:
    orch = Orchestrator.__new__(Orchestrator)  # only what load_policy touches
    orch.client = client  # a stand-in with the three calls load_policy makes
    orch.spec = validate_spec("rl", {"model": {"name": "m"}, "orchestrator": {"max_async_level": max_async_level}})
    orch.run = run
    orch.weight_sync = None
    orch.harnesses = {}
    orch.policy_version = 0
    orch._adapters = []
    return orch


def _adapter(tmp_path: Path, version: int) -> Path:
    folder = tmp_path / "weights" / f"step_{version}"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    return folder


def test_adapter_versions_are_named_and_old_ones_unloaded(tmp_path: Path) -> None:
    client = FakeClient()
    run = RunDir(tmp_path / "run")
    orch = _orchestrator(client, run, max_async_level=0)  # on-policy: 2 adapters kept
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_text("")

    def name(v: int) -> str:
        return lora_adapter_name(run.root, v)

    async def go() -> list[str | None]:
        orch._version_changed = asyncio.Condition()
        names = []
        for v in (1, 2, 3):
            assert await orch.load_policy(_adapter(tmp_path, v), v) == {
                "weight_update_s": 0.5,
                "weight_update_pause_s": 0.125,
                "weight_update_load_s": 0.25,
                "weight_update_reset_s": 0.0625,
                "weight_update_resume_s": 0.0625,
            }
            names.append(client.model)
            assert orch.policy_version == v
        await orch.load_policy(base, 0)
        names.append(client.model)
        return names

    assert asyncio.run(go()) == [name(1), name(2), name(3), None]
    assert client.calls == [
        ("pause",), ("load", name(1), "step_1"), ("resume",),
        ("pause",), ("load", name(2), "step_2"), ("resume",),
        ("pause",), ("load", name(3), "step_3"), ("resume",),
        ("unload", name(1)),
        ("pause",), ("resume",),
    ]  # fmt: skip


@pytest.mark.parametrize("max_async_level", [0, 1, 2, 3])
def test_every_adapter_a_running_rollout_may_name_stays_loaded(tmp_path: Path, max_async_level: int) -> None:
    """While v(n) loads, an eval started after batch n and a harness rollout of step n may still name the adapter of
    v(n - 1 - max_async_level) on every turn (``worker/policy/lora_adapters.adapters_in_use``): all of v(n - 1 - k) ..
    v(n) stay loaded, and never more than the server's ``--max-loras`` (the same function) at once."""
    client = FakeClient()
    run = RunDir(tmp_path / "run")
    orch = _orchestrator(client, run, max_async_level)

    async def go() -> None:
        orch._version_changed = asyncio.Condition()
        for n in range(1, 10):
            await orch.load_policy(_adapter(tmp_path, n), n)
            may_name = {lora_adapter_name(run.root, v) for v in range(max(1, n - 1 - max_async_level), n + 1)}
            assert may_name <= client.loaded, (n, sorted(may_name - client.loaded))
            assert len(client.loaded) <= adapters_in_use(max_async_level)

    asyncio.run(go())
    assert len(client.loaded) == adapters_in_use(max_async_level) == max_async_level + 2


def test_a_harness_rollout_names_the_adapter_of_the_version_its_span_starts_at(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rollout B waits for the one harness slot while rollout A runs; version 2 loads meanwhile. B names v2's adapter
    on every turn and records v_start 2 (taking the name before the slot named v1's adapter under a span starting
    at 2: an adapter ``adapters_in_use`` may already have unloaded)."""
    from worker.orchestrator import harness
    from worker.spec import HarnessConfig

    runner = harness.HarnessRunner.__new__(harness.HarnessRunner)
    runner.model, runner.inference_url, runner.config = "m", "http://x", HarnessConfig(max_concurrent=1)
    runner._served, runner._slots, runner.adapter = "m", asyncio.Semaphore(1), "policy-1-run"
    version = [1]
    named: list[tuple[str, int]] = []
    release = asyncio.Event()

    class Agent:
        def __init__(self, config: Any) -> None:
            self.model = config.model

        async def run(self, task: Any, *, tools: Any) -> Any:
            assert tools is None  # no taskset tools lent here
            named.append((self.model, version[0]))
            if len(named) == 1:
                await release.wait()
            return type("Trace", (), {"ok": True})()

    monkeypatch.setattr(harness, "agent_config", lambda *a, served_model, **k: type("C", (), {"model": served_model}))
    monkeypatch.setattr(harness.vf, "Agent", Agent)
    spans: list[tuple[int, int]] = []
    monkeypatch.setattr(
        harness, "trace_to_rollouts", lambda trace, *, policy_span, **k: spans.append(policy_span) or []
    )

    async def go() -> None:
        kwargs = {"max_tokens": 8, "temperature": 1.0, "policy_version": lambda: version[0]}
        task = type("Task", (), {"key": 0})()
        a = asyncio.create_task(runner.run(task, **kwargs))
        b = asyncio.create_task(runner.run(task, **kwargs))
        await asyncio.sleep(0.01)  # A holds the slot, B waits for it
        version[0], runner.adapter = 2, "policy-2-run"  # what load_policy sets for version 2
        release.set()
        await asyncio.gather(a, b)

    asyncio.run(go())
    assert named == [("policy-1-run", 1), ("policy-2-run", 2)]
    assert spans == [(1, 2), (2, 2)]
