"""Cases C14 and C27 on one CUDA GPU (issue 34): the shipped reverse-text config with ``--trainer.device cuda``, its
own vLLM server on the same GPU with CUDA graphs (``inference.enforce_eager`` unset), the default served-policy
check. A server that silently loads no new weights (``ASYNCRL_TEST_SKIP_WEIGHT_LOAD``) fails the run at the first
update; the tolerance is the one set from the hardware's own served-vs-trainer noise on the base weights. Run on the
GPU machine with ``-m gpu`` (``scripts/gpu-check.sh``; CI deselects it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from worker.launchers.local import launch_rl
from worker.orchestrator.policy_check import DEFAULT_TOLERANCE, default_tolerance
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import RLSpec, load_spec_data, validate_spec
from worker.weight_sync.load import TEST_SKIP_LOAD_VAR

pytestmark = pytest.mark.gpu
RL_TOML = Path(__file__).resolve().parents[2] / "configs" / "reverse_text" / "rl.toml"
# no tests.support.runs here: it imports the control plane's test support (psycopg), which the GPU image lacks


def _events(run: RunDir, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run.events) if e["event"] == kind]


def test_c14_frozen_policy_fails_at_the_first_update_on_a_gpu_with_graphs(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU")
    monkeypatch.setenv(TEST_SKIP_LOAD_VAR, "1")  # the run's own server inherits it: it loads no new version
    overrides = {
        "model.name": str(tiny_model),
        "output_dir": str(tmp_path),
        "name": "frozen-gpu",
        "max_steps": "3",
        "trainer.device": "cuda",
        "orchestrator.max_async_level": "0",  # step 2's rollouts wait for version 1, which the check fails
        "orchestrator.eval.interval": "0",
        "orchestrator.eval.num_examples": "4",
        "trainer.scheduler.warmup_steps": "0",
        "ckpt.interval": "0",
        "inference.startup_timeout_s": "600",
    }
    spec = validate_spec("rl", load_spec_data([RL_TOML], list(overrides.items())))
    assert isinstance(spec, RLSpec) and spec.inference.url is None  # the run starts its own server, on the GPU
    summary = launch_rl(spec, quiet=True)
    run = RunDir(spec.run_dir)
    [ready] = _events(run, "inference_ready")
    assert ready["enforce_eager"] is False and ready["boot_s"] > 0, ready  # CUDA graphs on a GPU by default
    assert summary["status"] == "failed", summary
    [event] = _events(run, "policy_check_failed")
    assert event["step"] == 1 and "the served log-probs differ" in event["reason"], event
    [row] = [r for r in read_jsonl(run.metrics) if r["source"] == "inference"]
    noise = row["policy_check_base_max_abs_diff"]
    assert event["tolerance"] == row["policy_check_tolerance"] == default_tolerance("float32", noise)
    assert DEFAULT_TOLERANCE["float32"] <= event["tolerance"] < event["max_abs_diff"]
    print(
        f"C14 on GPU: base noise {noise:.3g}, tolerance {event['tolerance']:.3g}, frozen diff {event['max_abs_diff']:.3g}"
    )
