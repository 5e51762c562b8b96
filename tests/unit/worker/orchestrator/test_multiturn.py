"""Multi-turn rollouts -> training samples: exact ids, loss mask, logprobs and rewards.

The model side is a scripted `generate` (hand-built completions, as a verifiers trace records them);
the environment side is the real reverse_twice taskset; the tokenizer is the tiny byte-level one.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from worker.envs import load_environment
from worker.envs.reverse_twice import FOLLOW_UP
from worker.inference.client import Completion
from worker.orchestrator.batcher import build_batch
from worker.orchestrator.data import request_seed
from worker.orchestrator.multiturn import env_turn_ids, run_conversation
from worker.orchestrator.prompts import prompt_ids
from worker.policy.models import build_tokenizer
from worker.spec import OrchestratorConfig


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer(0)


class ScriptedModel:
    """`InferenceClient.generate` returning the given replies in order; records the prompts it got."""

    def __init__(self, replies: list[Completion]) -> None:
        self.replies, self.prompts, self.seeds = list(replies), [], []

    async def generate(
        self, ids: list[int], *, n: int, max_tokens: int, temperature: float, seed: int | None = None
    ) -> list[Completion]:
        assert n == 1
        self.prompts.append(list(ids))
        self.seeds.append(seed)
        reply = self.replies.pop(0)
        return [Completion(reply.token_ids[:max_tokens], reply.logprobs[:max_tokens], reply.finish_reason)]


def reply(tok: Any, text: str, eos: bool = True) -> Completion:
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    return Completion(ids, [-0.5 - i / 100 for i in range(len(ids))], "stop" if eos else "length")


def test_env_turn_ids_follow_the_chat_template(tok: Any) -> None:
    messages = [{"role": "system", "content": "S."}, {"role": "user", "content": "Ab cd."}]
    r = reply(tok, ".dc bA")
    env_ids = env_turn_ids(tok, messages, r.token_ids, "Now: Ef.")
    assert tok.decode(env_ids) == "\n<|im_start|>user\nNow: Ef.<|im_end|>\n<|im_start|>assistant\n"
    full = prompt_ids(tok, messages) + r.token_ids + env_ids
    expected = prompt_ids(
        tok, [*messages, {"role": "assistant", "content": ".dc bA"}, {"role": "user", "content": "Now: Ef."}]
    )
    assert full == expected
    # a reply cut at max_tokens has no EOS: the env turn closes it
    cut = reply(tok, ".dc", eos=False)
    assert env_turn_ids(tok, messages, cut.token_ids, "Now: Ef.")[0] == tok.eos_token_id


def test_conversation_to_train_sample_exact(tok: Any) -> None:
    env = load_environment("reverse_twice", split="eval", seed=0)
    task = env.task(3)
    a, b = task.data.answers
    r1, r2 = reply(tok, a), reply(tok, f"<reversed_text>{b[:-1]}</reversed_text>")
    model = ScriptedModel([r1, r2])
    versions = iter([4, 6])
    rollout = asyncio.run(
        run_conversation(
            model,
            tok,
            env,
            task,
            max_tokens=200,
            temperature=1.0,
            max_len=1000,  # type: ignore[arg-type]
            policy_version=lambda: next(versions),
            seed=7,
        )
    )
    p_ids = prompt_ids(tok, env.prompt_messages(task))
    env_ids = env_turn_ids(tok, env.prompt_messages(task), r1.token_ids, FOLLOW_UP.format(text=task.data.texts[1]))
    assert rollout.prompt_ids == p_ids
    assert rollout.completion_ids == r1.token_ids + env_ids + r2.token_ids
    assert rollout.completion_mask == [1] * len(r1.token_ids) + [0] * len(env_ids) + [1] * len(r2.token_ids)
    assert rollout.completion_logprobs == r1.logprobs + [0.0] * len(env_ids) + r2.logprobs
    assert model.prompts == [p_ids, p_ids + r1.token_ids + env_ids]  # turn 2 extends turn 1's exact tokens
    assert rollout.policy_span == (4, 6)
    assert model.seeds == [request_seed(7, 0), request_seed(7, 1)]  # each turn's request seeded by the turn
    assert len(set(model.seeds)) == 2
    assert rollout.finish_reason == "stop"
    from worker.envs.reverse_text import lcs_ratio

    assert rollout.reward == pytest.approx((1.0 + lcs_ratio(b[:-1], b)) / 2)
    assert 0.5 < rollout.reward < 1.0

    other = [rollout, dataclasses.replace(rollout, reward=0.0)]
    samples, metrics = build_batch(1, [other], OrchestratorConfig(max_off_policy_steps=10))
    s = samples[0]
    assert s["input_ids"] == p_ids + rollout.completion_ids
    assert s["loss_mask"] == [0] * len(p_ids) + rollout.completion_mask
    assert s["sampling_logprobs"] == [0.0] * len(p_ids) + rollout.completion_logprobs
    assert s["policy_span"] == [4, 6] and s["prefix_len"] == len(p_ids)
    assert metrics["completion_len_max"] == len(r1.token_ids) + len(r2.token_ids)  # env tokens not counted


def test_conversation_stops_at_max_len(tok: Any) -> None:
    env = load_environment("reverse_twice", split="eval", seed=0)
    task = env.task(0)
    p_ids = prompt_ids(tok, env.prompt_messages(task))
    r1 = reply(tok, task.data.answers[0])
    model = ScriptedModel([r1, r1])
    rollout = asyncio.run(
        run_conversation(
            model,
            tok,
            env,
            task,
            max_tokens=200,
            temperature=1.0,  # type: ignore[arg-type]
            max_len=len(p_ids) + len(r1.token_ids) + 5,
            policy_version=lambda: 0,
        )
    )
    assert len(model.prompts) == 1  # the env turn left no room for a second model turn
    assert model.seeds == [None]  # no seed given: vLLM samples unseeded
    assert rollout.finish_reason == "length"
    assert rollout.reward == pytest.approx(0.5)  # the unanswered second turn scores 0


def test_reverse_twice_env_turns_and_splits() -> None:
    train = load_environment("reverse_twice", split="train", seed=0)
    ev = load_environment("reverse_twice", split="eval", seed=0)
    assert train.is_multi_turn and ev.is_multi_turn and train.unsupported is None
    assert not load_environment("reverse_text", split="eval", seed=0).is_multi_turn
    assert ev.num_tasks == 100 and train.num_tasks is None
    eval_firsts = {ev.task(i).data.texts[0] for i in range(100)}
    assert not eval_firsts & {train.task(i).data.texts[0] for i in range(200)}
    assert load_environment("reverse_twice", split="eval", seed=0).task(7).data == ev.task(7).data
    task = ev.task(1)
    first = [{"role": "assistant", "content": task.data.answers[0]}]
    assert asyncio.run(ev.env_response(task, first)) == f"Now reverse this: {task.data.texts[1]}"
    both = [*first, {"role": "user", "content": "x"}, {"role": "assistant", "content": task.data.answers[1]}]
    assert asyncio.run(ev.env_response(task, both)) is None
    assert asyncio.run(ev.score_conversation(task, both)).reward == 1.0


def test_taskset_opened_by_a_user_gets_a_one_line_reason() -> None:
    import verifiers.v1 as vf

    from worker.envs import Environment

    class UserOpened(vf.Taskset):
        def load(self):  # noqa: ANN202
            yield vf.Task(vf.TaskData(id="a", prompt=None, system_prompt="Play."))

    env = Environment("pkg.mod:user_opened", UserOpened(vf.TasksetConfig()), split="train", seed=0)
    assert env.is_multi_turn
    assert env.unsupported is not None and "\n" not in env.unsupported
    assert env.unsupported.startswith("environment 'pkg.mod:user_opened': its tasks have no opening prompt")
    assert load_environment("reverse_twice", split="train", seed=0).unsupported is None
