"""Weight sync over NCCL on a machine with >= 2 GPUs: the trainer side (this process) on cuda:0 broadcasts
bucketed weights to a real vLLM server on cuda:1; afterwards vLLM's logprobs equal transformers' logprobs of
the new weights. Run on the GPU machine with ``-m gpu`` (CI deselects it)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch

from tests.support.logprobs import PROMPT, max_diff
from worker.inference.client import InferenceClient
from worker.rundir import STABLE_MARKER, RunDir
from worker.spec import WeightSyncConfig
from worker.weight_sync.load import WeightReceiver
from worker.weight_sync.publish import LOADED, WEIGHTS_FILE, WeightSender

pytestmark = pytest.mark.gpu
GPU_TOL = 2e-3  # fp32 on both sides; vLLM's GPU kernels (and TF32 where enabled) differ from CPU transformers


def test_nccl_update_from_cuda0_to_vllm_on_cuda1(tmp_path: Path) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.fail(f"needs >= 2 visible CUDA GPUs, found {torch.cuda.device_count()}")
    from worker.inference.server import start_server, stop_server, wait_ready
    from worker.models import init_model, load_model
    from worker.procs import free_port

    model_dir = init_model(tmp_path / "model", size="tiny", seed=0)
    log = tmp_path / "server.log"
    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("ASYNCRL_TEST_VLLM_GPU", "1")}
    proc = start_server(str(model_dir), "127.0.0.1", port, log_path=log, max_model_len=512, dtype="float32", env=env)
    url = f"http://127.0.0.1:{port}"
    run = RunDir(tmp_path / "run")
    run.create()
    cfg = WeightSyncConfig(kind="process_group", backend="auto", bucket_mb=1, timeout_s=120)
    new = load_model(model_dir).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    state = {k: v.detach().clone().contiguous() for k, v in new.state_dict().items()}
    if new.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)

    async def go() -> None:
        torch.cuda.set_device(0)
        sender = WeightSender(run, cfg, torch.device("cuda", 0), workers=1, join_timeout_s=120)
        assert sender.backend == "nccl"
        async with InferenceClient(url, max_retries=0) as client:
            receiver = WeightReceiver(client, run, cfg)
            assert await receiver.join(wait_s=30)
            pub = asyncio.create_task(asyncio.to_thread(sender.publish, state, 1, 5))
            t0 = time.monotonic()
            while not (run.weight_dir(1) / STABLE_MARKER).exists():
                assert time.monotonic() - t0 < 60
                await asyncio.sleep(0.01)
            info = await client.publish_weights(run.weight_dir(1), load=receiver.load)
            await pub
            assert info["route"] == "process_group" and info["buckets"] > 1, info
            assert sender.failed is None and (run.weight_dir(1) / LOADED).exists()
            assert not (run.weight_dir(1) / WEIGHTS_FILE).exists()
            outs = await client.generate(PROMPT, n=8, max_tokens=32, temperature=1.0, seed=5)
            assert max_diff(new, PROMPT, outs, 1.0) < GPU_TOL

    try:
        wait_ready(url, timeout_s=600, proc=proc, log_path=log)
        asyncio.run(go())
    finally:
        stop_server(proc)
