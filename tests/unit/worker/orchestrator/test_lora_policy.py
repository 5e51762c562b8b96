"""A LoRA run's policy versions on the orchestrator side (``Orchestrator.load_policy``): an adapter folder is loaded
as ``policy-<n>`` inside the pause/reset/resume, rollouts name it, the adapter of two versions back is unloaded, and
a full model folder (version 0 on a shared server) goes back to the base name."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from worker.orchestrator.orchestrator import Orchestrator


class FakeClient:
    def __init__(self) -> None:
        self.model: str | None = None
        self.calls: list[tuple[str, ...]] = []

    async def publish_weights(self, path: Path, load: Any = None) -> dict[str, Any]:
        self.calls.append(("pause",))
        info = await load(path) if load is not None else {"full": str(path)}
        self.calls.append(("resume",))
        return {**info, "total_s": 0.5}

    async def load_lora_adapter(self, name: str, path: Path) -> dict[str, Any]:
        self.calls.append(("load", name, Path(path).name))
        return {"adapter": name}

    async def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))


def _orchestrator(client: FakeClient) -> Orchestrator:
    orch = Orchestrator.__new__(Orchestrator)  # only what load_policy touches
    orch.client = client  # a stand-in with the three calls load_policy makes
    orch.weight_sync = None
    orch.harness = None
    orch.policy_version = 0
    orch._adapters = []
    return orch


def test_adapter_versions_are_named_and_old_ones_unloaded(tmp_path: Path) -> None:
    client = FakeClient()
    orch = _orchestrator(client)
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_text("")

    async def go() -> list[str | None]:
        orch._version_changed = asyncio.Condition()
        names = []
        for v in (1, 2, 3):
            folder = tmp_path / f"step_{v}"
            folder.mkdir()
            (folder / "adapter_config.json").write_text("{}")
            assert await orch.load_policy(folder, v) == 0.5
            names.append(client.model)
            assert orch.policy_version == v
        await orch.load_policy(base, 0)
        names.append(client.model)
        return names

    assert asyncio.run(go()) == ["policy-1", "policy-2", "policy-3", None]
    assert client.calls == [
        ("pause",), ("load", "policy-1", "step_1"), ("resume",),
        ("pause",), ("load", "policy-2", "step_2"), ("resume",),
        ("pause",), ("load", "policy-3", "step_3"), ("resume",),
        ("unload", "policy-1"),
        ("pause",), ("resume",),
    ]  # fmt: skip
