"""The rollout path choice: one group of rollouts of a task, by the path its environment needs.

| environment                                      | path                                                | module         |
|--------------------------------------------------|-----------------------------------------------------|----------------|
| tasks with tools or no prompt (``needs_harness``) | verifiers' agent harness, ``HarnessRunner.run_group`` | ``harness.py``   |
| tasks that answer the model (``is_multi_turn``)   | one growing token sequence per rollout, ``run_group`` | ``multiturn.py`` |
| two roles (a task with ``solver_task``)          | ``n`` proposer -> solvers episodes, ``self_play_group`` | here           |
| otherwise (single turn)                          | one vLLM request with ``n`` samples, ``single_turn_group`` | here         |

Training (`worker.orchestrator.orchestrator`) and evaluation (`worker.orchestrator.eval`) both call
`rollout_group`, so a taskset runs the same way in both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from worker.envs import Environment, EnvTask
from worker.envs.self_play import PROPOSER, SOLVER, proposer_reward
from worker.orchestrator.batcher import Rollout
from worker.orchestrator.data import request_seed
from worker.orchestrator.multiturn import run_group
from worker.orchestrator.prompts import prompt_ids

Scorer = Callable[[list[str]], Awaitable[list[float | None] | None]]
"""Scores a group's completion texts elsewhere (``ScoreProcess.score`` of the group's task); None: it cannot."""

if TYPE_CHECKING:
    from worker.inference.client import InferenceClient
    from worker.orchestrator.harness import HarnessRunner


async def single_turn_group(
    client: InferenceClient,
    tokenizer: Any,
    env: Environment,
    task: EnvTask,
    *,
    task_key: str,
    n: int,
    max_tokens: int,
    temperature: float,
    policy_version: Callable[[], int],
    seed: int | None = None,
    scorer: Scorer | None = None,
) -> list[Rollout]:
    """`n` completions of `task`'s chat-templated prompt in one vLLM request, each scored by the environment.

    The policy span is the inference policy version before the request and after it returned (scoring not
    counted); completion ids and sampling logprobs are vLLM's (never re-tokenized). ``scorer``: scores the
    completion texts elsewhere (``worker.orchestrator.scoring``), None when it cannot (then, and without one,
    ``env.score`` here).

    Raises:
        InferenceError: the server did not answer within the client's bounded retries.
    """
    ids = prompt_ids(tokenizer, env.prompt_messages(task))
    v_start, t0 = policy_version(), time.perf_counter()
    completions = await client.generate(ids, n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)
    span, seconds = (v_start, policy_version()), time.perf_counter() - t0
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    rewards = await scorer(texts) if scorer is not None else None
    if rewards is None:
        rewards = await asyncio.gather(*(env.score(task, text) for text in texts))
    return [
        Rollout(
            task_key=task_key,
            prompt_ids=ids,
            completion_ids=c.token_ids,
            completion_logprobs=c.logprobs,
            completion_text=text,
            finish_reason=c.finish_reason,
            reward=reward,
            advantage=None,
            policy_span=span,
            temperature=temperature,
            generation_s=seconds,
        )
        for c, text, reward in zip(completions, texts, rewards, strict=True)
    ]


async def rollout_group(
    client: InferenceClient,
    tokenizer: Any,
    env: Environment,
    index: int,
    *,
    harness: HarnessRunner | None,
    n: int,
    max_tokens: int,
    temperature: float,
    policy_version: Callable[[], int],
    max_len: int | None = None,
    max_total_tokens: int | None = None,
    seed: int | None = None,
    scorer: Scorer | None = None,
) -> list[Rollout]:
    """The `n` rollouts of task `index` of `env` (one group), by the path the environment needs (module table).

    Args:
        max_tokens: token budget of each model turn.
        max_len: multi-turn only: prompt + all turns in tokens at most (None: unbounded).
        max_total_tokens: harness only: no new model turn once a call's context exceeds this (None: no cap).
        policy_version: reads the inference policy version (the rollouts' ``policy_span``).
        seed: vLLM sampling seed of the group (``data.request_seed``); None: unseeded. Single-turn and multi-turn
            paths seed every request from it; the harness path (verifiers makes the requests) is not seeded.
        scorer: single-turn path only: scores the group's completion texts (of task ``index``) in another process
            (``worker.orchestrator.scoring``); None, or when it answers None: ``env.score`` in this process.

    Returns:
        The group's rollouts (a harness rollout may give several records, one per trainable branch).

    Raises:
        ValueError: `env` needs the agent harness and `harness` is None.
        InferenceError: the server did not answer within the client's bounded retries.
    """
    task = env.task(index)
    if env.needs_harness:
        if harness is None:
            raise ValueError(f"environment {env.id!r}: its tasks have tools; running them needs a HarnessRunner")
        return await harness.run_group(
            task,
            n=n,
            tools=env.tools,
            max_tokens=max_tokens,
            temperature=temperature,
            policy_version=policy_version,
            max_total_tokens=max_total_tokens,
        )
    if hasattr(task, "solver_task"):
        return await self_play_group(
            client,
            tokenizer,
            env,
            task,
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            policy_version=policy_version,
            seed=seed,
        )
    if env.is_multi_turn:
        return await run_group(
            client,
            tokenizer,
            env,
            task,
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            max_len=max_len if max_len is not None else 1 << 30,
            policy_version=policy_version,
            seed=seed,
        )
    return await single_turn_group(
        client,
        tokenizer,
        env,
        task,
        task_key=str(getattr(task, "key", index)),
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        policy_version=policy_version,
        seed=seed,
        scorer=scorer,
    )


async def self_play_group(
    client: InferenceClient,
    tokenizer: Any,
    env: Environment,
    task: Any,
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    policy_version: Callable[[], int],
    seed: int | None = None,
) -> list[Rollout]:
    """`n` episodes of a two-role task (``worker.envs.self_play``), one group: in each, the proposer's completion
    (one sample on the task's prompt) becomes the solvers' task (``task.solver_task``), answered by
    ``task.num_solvers`` samples in one request; both roles are the same policy.

    Each rollout gets its ``role`` (``"proposer"``/``"solver"``) and ``episode`` (0..n-1); the solvers' rewards are the
    environment's on their task, the proposer's is ``proposer_reward`` of its validity and the solvers' rewards.
    Episode e seeds its two requests with ``request_seed(seed, e, stage)`` (None: unseeded).

    Returns:
        ``n * (1 + task.num_solvers)`` rollouts, episode by episode, the proposer first.

    Raises:
        InferenceError: the server did not answer within the client's bounded retries.
    """

    async def sample(stage_task: Any, count: int, e: int, stage: int) -> list[Rollout]:
        return await single_turn_group(
            client,
            tokenizer,
            env,
            stage_task,
            task_key=str(stage_task.key),
            n=count,
            max_tokens=max_tokens,
            temperature=temperature,
            policy_version=policy_version,
            seed=None if seed is None else request_seed(seed, e, stage),
        )

    async def episode(e: int) -> list[Rollout]:
        (proposer,) = await sample(task, 1, e, 0)
        proposal = task.proposal(proposer.completion_text)
        solvers = await sample(task.solver_task(proposal), task.num_solvers, e, 1)
        proposer.reward = proposer_reward(proposal is not None, [s.reward for s in solvers])
        for r in (proposer, *solvers):
            r.role, r.episode = (PROPOSER if r is proposer else SOLVER), e
        return [proposer, *solvers]

    return [r for rollouts in await asyncio.gather(*(episode(e) for e in range(n))) for r in rollouts]
