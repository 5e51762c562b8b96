"""Multi-turn rollouts on the real vLLM server: reverse_twice conversations and a short RL run.

Checks that every model-sampled token id and logprob in a rollout is exactly what vLLM returned,
that the environment turn sits in a loss-mask gap, that rewards are the environment's reward on
the parsed replies, and that a 3-step RL run on the multi-turn environment completes with metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path
from typing import Any

import pytest

from worker.envs import load_environment, parse_answer
from worker.envs.reverse_text import ANSWER_TAG, lcs_ratio
from worker.inference.client import Completion, InferenceClient
from worker.launchers.local import launch_rl
from worker.orchestrator.batch import read_batch
from worker.orchestrator.multiturn import run_conversation
from worker.policy.models import load_tokenizer
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import load_spec_data, validate_spec

pytestmark = pytest.mark.vllm
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "reverse_text" / "rl.toml"


def by_source(run: RunDir, source: str) -> list[dict[str, Any]]:
    return sorted((r for r in read_jsonl(run.metrics) if r["source"] == source), key=lambda r: r["step"])


class RecordingClient(InferenceClient):
    """The real client, keeping every completion vLLM returned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.returned: list[Completion] = []

    async def generate(self, *args: Any, **kwargs: Any) -> list[Completion]:
        out = await super().generate(*args, **kwargs)
        self.returned += out
        return out


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """(value, length) runs of a 0/1 mask."""
    return [(k, len(list(g))) for k, g in itertools.groupby(mask)]


def test_real_conversations_keep_vllm_tokens(vllm_server: Any) -> None:
    tok = load_tokenizer(vllm_server.model_path)
    env = load_environment("reverse_twice", split="eval", seed=0)

    async def go() -> list[tuple[Any, list[Completion]]]:
        out = []
        async with RecordingClient(vllm_server.url) as client:
            for index in range(4):
                client.returned = []
                rollout = await run_conversation(
                    client,
                    tok,
                    env,
                    env.task(index),
                    max_tokens=24,
                    temperature=1.0,
                    max_len=512,
                    policy_version=lambda: 0,
                )
                out.append((rollout, client.returned))
        return out

    for index, (rollout, returned) in enumerate(asyncio.run(go())):
        task = env.task(index)
        assert len(returned) == 2  # two model turns: the env always answers the first
        mask = rollout.completion_mask
        shape = runs(mask)
        assert [k for k, _ in shape] == [1, 0, 1], shape  # the env turn is a gap in the loss mask
        assert [n for k, n in shape if k == 1] == [len(c.token_ids) for c in returned]
        sampled = [t for t, m in zip(rollout.completion_ids, mask, strict=True) if m]
        assert sampled == returned[0].token_ids + returned[1].token_ids  # exactly vLLM's ids
        lps = [lp for lp, m in zip(rollout.completion_logprobs, mask, strict=True) if m]
        assert lps == returned[0].logprobs + returned[1].logprobs
        assert all(math.isfinite(lp) and lp <= 0 for lp in lps)
        assert all(lp == 0.0 for lp, m in zip(rollout.completion_logprobs, mask, strict=True) if not m)
        env_text = tok.decode([t for t, m in zip(rollout.completion_ids, mask, strict=True) if not m])
        assert f"Now reverse this: {task.data.texts[1]}" in env_text
        replies = [tok.decode(c.token_ids, skip_special_tokens=True) for c in returned]
        expected = (
            sum(lcs_ratio(parse_answer(r, ANSWER_TAG), a) for r, a in zip(replies, task.data.answers, strict=True)) / 2
        )
        assert rollout.reward == pytest.approx(expected)


def test_rl_run_on_multi_turn_env(vllm_server: Any, tmp_path: Path) -> None:
    overrides = {
        "model.name": str(vllm_server.model_path),
        "inference.url": vllm_server.url,
        "output_dir": str(tmp_path),
        "name": "multiturn",
        "max_steps": "3",
        "env.id": "reverse_twice",
        "orchestrator.batch_size": "4",
        "orchestrator.group_size": "4",
        "orchestrator.max_tokens": "24",
        "orchestrator.eval.num_examples": "8",
        "orchestrator.eval.interval": "0",
    }
    spec = validate_spec("rl", load_spec_data([CONFIG], list(overrides.items())))
    summary = launch_rl(spec, quiet=True)
    assert summary["status"] == "completed", summary
    run = RunDir(spec.run_dir)
    orch, trainer = by_source(run, "orchestrator"), by_source(run, "trainer")
    assert [r["step"] for r in orch] == [1, 2, 3] and [r["step"] for r in trainer] == [1, 2, 3]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in orch)
    assert all(math.isfinite(r["loss"]) and r["num_loss_tokens"] > 0 for r in trainer)
    assert [r["step"] for r in by_source(run, "eval")] == [0, 3]
    samples = [s for mb in read_batch(run.batch(1))["micro_batches"] for s in mb]
    assert samples and all([k for k, _ in runs(s["loss_mask"])] == [0, 1, 0, 1] for s in samples)
    rollouts = read_jsonl(run.rollout_file(1))
    assert len(rollouts) == 16 and all("[user] Now reverse this: " in r["completion"] for r in rollouts)
