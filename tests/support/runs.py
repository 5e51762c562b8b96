"""Short reverse-text runs on the tiny random model: their specs, and readers of their results (run directory
and API). Used by the end-to-end tests (``tests/e2e``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.server import wait_for
from worker.rundir import RunDir, read_jsonl
from worker.spec import RLSpec, load_spec_data, validate_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "reverse_text"


def rl_spec(model: Path, url: str, out: Path, name: str, **overrides: Any) -> RLSpec:
    """The shipped reverse-text RL config, pointed at ``model`` and the shared server, with overrides."""
    pairs = [
        ("model.name", str(model)),
        ("inference.url", url),
        ("output_dir", str(out)),
        ("name", name),
        ("orchestrator.eval.num_examples", "32"),
        ("orchestrator.eval.interval", "0"),
    ]
    pairs += [(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in overrides.items()]
    return validate_spec("rl", load_spec_data([CONFIGS / "rl.toml"], pairs))  # type: ignore[return-value]


def by_source(run: RunDir, source: str) -> list[dict[str, Any]]:
    return sorted((r for r in read_jsonl(run.metrics) if r["source"] == source), key=lambda r: r["step"])


def real_spec(model: Path, name: str, max_steps: int) -> dict[str, Any]:
    """The shipped reverse-text RL config on the tiny model, small and short."""
    return load_spec_data(
        [CONFIGS / "rl.toml"],
        [
            ("name", name),
            ("max_steps", str(max_steps)),
            ("model.name", str(model)),
            ("orchestrator.batch_size", "4"),
            ("orchestrator.group_size", "4"),
            ("orchestrator.max_tokens", "16"),
            ("orchestrator.eval.interval", "0"),
            ("orchestrator.eval.num_examples", "8"),
            ("ckpt.interval", "0"),
            ("trainer.scheduler.warmup_steps", "0"),
        ],
    )


def small_spec(model: Path, name: str, max_steps: int) -> dict[str, Any]:
    return load_spec_data(
        [CONFIGS / "rl.toml"],
        [
            ("name", name),
            ("max_steps", str(max_steps)),
            ("model.name", str(model)),
            ("orchestrator.batch_size", "4"),
            ("orchestrator.group_size", "4"),
            ("orchestrator.max_tokens", "16"),
            ("orchestrator.eval.interval", "0"),
            ("orchestrator.eval.num_examples", "8"),
            ("ckpt.interval", "2"),
            ("trainer.scheduler.warmup_steps", "0"),
            ("trainer.scheduler.type", "constant"),
            ("trainer.optim.lr", "1e-4"),
        ],
    )


def run_of(client: Any, auth: dict[str, str], run_id: int) -> dict[str, Any]:
    return dict(client.get(f"/api/runs/{run_id}", headers=auth).json())


def trainer_steps(client: Any, auth: dict[str, str], run_id: int) -> list[int]:
    loss = client.get(f"/api/runs/{run_id}/metrics", params={"name": "loss"}, headers=auth).json()
    return [step for s in loss["series"] if s["source"] == "trainer" for step in s["step"]]


def ended(client: Any, auth: dict[str, str], run_id: int, timeout: float = 400) -> dict[str, Any]:
    return wait_for(
        lambda: (r := run_of(client, auth, run_id))["status"] in {"completed", "failed", "cancelled"} and r,
        timeout,
        f"run {run_id} ended",
    )
