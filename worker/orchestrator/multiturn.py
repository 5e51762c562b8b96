"""Multi-turn rollouts: the model and the environment take turns on one growing token sequence.

A conversation starts from the chat-templated prompt ids. Each model turn is one vLLM request on the
whole sequence so far; its sampled token ids and logprobs are appended as they came back (never
re-tokenized, loss mask 1). The reply text goes to the environment's own code
(`Environment.env_response`, the task's `env_response(trace)`), whose next user message is the only
text tokenized here: the chat template's tokens between the end of the reply and the opening of the
next assistant turn (`env_turn_ids`), loss mask 0, logprob 0.0. The conversation ends when the
environment answers None, at `max_turns` model turns, or when another turn would not fit in
`max_len` tokens. The reward is the task's own `@vf.reward` functions on the whole conversation
(`Environment.score_conversation`). The rollout records the policy-version span
`[version at the first request, version after the last reply]`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker.envs import Environment, EnvTask, trace_reward
from worker.orchestrator.batcher import Rollout
from worker.orchestrator.data import request_seed
from worker.orchestrator.prompts import prompt_ids

if TYPE_CHECKING:
    from worker.inference.client import InferenceClient

MAX_TURNS = 8
"""Model turns per conversation at most (a guard against an environment that never ends)."""
_REPLY_MARKER = "\u2063ASYNCRL_REPLY\u2063"


def env_turn_ids(tokenizer: Any, messages: list[dict[str, Any]], reply_ids: list[int], user_text: str) -> list[int]:
    """Token ids that follow the model's reply `reply_ids` when the environment answers `user_text`.

    `messages` is the conversation before the reply (prompt and earlier turns, chat messages). The ids are
    the chat template's text after the reply's content up to the opening of the next assistant turn
    (e.g. ``<|im_end|>\\n<|im_start|>user\\n{user_text}<|im_end|>\\n<|im_start|>assistant\\n``), tokenized
    without special-token insertion; a leading end-of-turn token is left out when the reply already ends
    with it (vLLM returns the EOS it stopped on).

    Raises:
        ValueError: the chat template drops or rewrites the assistant content (no reply marker found).
    """
    rendered = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": _REPLY_MARKER}, {"role": "user", "content": user_text}],
        add_generation_prompt=True,
        tokenize=False,
    )
    if rendered.count(_REPLY_MARKER) != 1:
        raise ValueError("chat template does not render an assistant message's content verbatim")
    suffix = rendered.split(_REPLY_MARKER)[1]
    eos = tokenizer.eos_token
    if eos and reply_ids and reply_ids[-1] == tokenizer.eos_token_id and suffix.startswith(eos):
        suffix = suffix[len(eos) :]
    return list(tokenizer.encode(suffix, add_special_tokens=False))


async def run_conversation(
    client: InferenceClient,
    tokenizer: Any,
    env: Environment,
    task: EnvTask,
    *,
    max_tokens: int,
    temperature: float,
    max_len: int,
    policy_version: Callable[[], int],
    max_turns: int = MAX_TURNS,
    seed: int | None = None,
) -> Rollout:
    """One multi-turn rollout of `task` (see the module docstring).

    `max_tokens` bounds each model turn (tokens); `max_len` the whole sequence (prompt + all turns, tokens);
    `seed` (None: unseeded) seeds turn t's request with ``request_seed(seed, t)``.
    The returned rollout's `completion_ids` hold every token after the prompt (model and environment turns),
    `completion_mask` 1 on model-sampled tokens and 0 on environment tokens, `completion_logprobs` vLLM's
    sampling logprob on sampled tokens and 0.0 elsewhere; `reward` is the environment's (None if unscored).

    Raises:
        InferenceError: the server did not answer within the client's bounded retries.
    """
    messages = env.prompt_messages(task)
    ids = prompt_ids(tokenizer, messages)
    n_prompt = len(ids)
    mask: list[int] = []
    logprobs: list[float] = []
    turns: list[dict[str, Any]] = []
    v_start, t0 = policy_version(), time.perf_counter()
    finish_reason = "length"
    for turn in range(max_turns):
        budget = min(max_tokens, max_len - len(ids))
        if budget <= 0:
            finish_reason = "length"
            break
        turn_seed = None if seed is None else request_seed(seed, turn)
        (completion,) = await client.generate(ids, n=1, max_tokens=budget, temperature=temperature, seed=turn_seed)
        finish_reason = completion.finish_reason
        ids += completion.token_ids
        mask += [1] * len(completion.token_ids)
        logprobs += completion.logprobs
        reply = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        turns.append({"role": "assistant", "content": reply})
        user_text = await env.env_response(task, turns)
        if user_text is None:
            break
        env_ids = env_turn_ids(tokenizer, messages + turns[:-1], completion.token_ids, user_text)
        ids += env_ids
        mask += [0] * len(env_ids)
        logprobs += [0.0] * len(env_ids)
        turns.append({"role": "user", "content": user_text})
    span, seconds = (v_start, policy_version()), time.perf_counter() - t0
    trace = await env.score_conversation(task, turns)
    return Rollout(
        task_key=str(task.key),
        prompt_ids=ids[:n_prompt],
        completion_ids=ids[n_prompt:],
        completion_logprobs=logprobs,
        completion_text="\n".join(f"[{t['role']}] {t['content']}" for t in turns),
        finish_reason=finish_reason,
        reward=trace_reward(trace),
        advantage=None,
        policy_span=span,
        temperature=temperature,
        completion_mask=mask,
        generation_s=seconds,
    )


async def run_group(
    client: InferenceClient,
    tokenizer: Any,
    env: Environment,
    task: EnvTask,
    *,
    n: int,
    seed: int | None = None,
    **kwargs: Any,
) -> list[Rollout]:
    """`n` concurrent `run_conversation`s of `task` (one rollout group); rollout i is seeded with
    ``request_seed(seed, i)`` (None: unseeded); `kwargs` as for `run_conversation`."""
    seeds = [None if seed is None else request_seed(seed, i) for i in range(n)]
    return list(
        await asyncio.gather(*(run_conversation(client, tokenizer, env, task, seed=s, **kwargs) for s in seeds))
    )
