"""Held-out evaluation against an inference server: mean reward and pass@k.

Shared by online evals (orchestrator) and ``asyncrl eval``. pass@k is the fraction of tasks with at
least one of k samples scoring >= ``pass_threshold`` (the unbiased estimator of Chen et al. 2021,
"Evaluating Large Language Models Trained on Code", with n = k reduces to this).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from worker.envs import Environment
from worker.orchestrator.data import request_seed
from worker.orchestrator.rollouts import rollout_group
from worker.tracking import progress

if TYPE_CHECKING:
    from worker.inference.client import InferenceClient
    from worker.orchestrator.harness import HarnessRunner


TaskResult = tuple[list[float | None], list[int]]
"""One eval task's ``pass_k`` samples: their rewards (None: missing) and completion lengths in tokens."""


def check_num_examples(env: Environment, num_examples: int, field: str) -> None:
    """Refuse an eval of more tasks than ``env`` (an eval split) has, instead of evaluating fewer without a word (a
    fresh user asked 512 and got 200). ``field`` is the key that set the count, named in the error
    (``eval.num_examples``, ``orchestrator.eval.num_examples``, ``eval_examples``, ``--num-examples``); an endless
    taskset (``num_tasks`` None) has every count.

    Raises:
        SpecError: ``eval.num_examples: 512 eval tasks asked, but environment 'reverse_text' has 200 (its eval
            split); use at most 200``.
    """
    from worker.spec import SpecError

    if env.num_tasks is not None and num_examples > env.num_tasks:
        raise SpecError(
            f"{field}: {num_examples} eval tasks asked, but environment {env.id!r} has {env.num_tasks} (its "
            f"{env.split} split); use at most {env.num_tasks}"
        )


async def evaluate(
    client: InferenceClient,
    env: Environment,
    tokenizer: Any,
    *,
    num_examples: int,
    temperature: float,
    max_tokens: int,
    max_len: int | None = None,
    pass_k: int = 1,
    pass_threshold: float = 1.0,
    harness: HarnessRunner | None = None,
    seed: int | None = None,
    done: Mapping[int, TaskResult] | None = None,
    on_task: Callable[[int, TaskResult], None] | None = None,
) -> dict[str, float | int | None]:
    """Score ``num_examples`` eval tasks (``pass_k`` samples each) with the environment's rewards.

    Each task's samples are one rollout group on the environment's path (``worker.orchestrator.rollouts``): a
    multi-turn environment runs whole conversations (``worker.orchestrator.multiturn``) of at most ``max_len``
    tokens (default: unbounded but for ``max_tokens`` per turn); ``completion_len_mean`` then counts
    model-sampled tokens only. A taskset with tools (``env.needs_harness``) runs through ``harness`` (verifiers'
    agent harness, ``worker.orchestrator.harness``).

    ``seed`` (None: unseeded) seeds task i's requests with ``request_seed(seed, i)``.

    ``done`` (an interrupted eval's record, task index -> :data:`TaskResult`): those tasks are not sampled again, their
    recorded results are used; ``on_task(index, result)`` is called as each other task finishes (the eval job records
    it, ``worker.evaluation``). The result is the same whichever tasks came from ``done``: tasks are combined in index
    order.

    Returns:
        ``{"reward_mean", "pass_at_k", "k", "num_examples", "completion_len_mean", "reward_missing"}``;
        rewards that are None are left out of the mean and counted.

    Raises:
        InferenceError: the server did not answer within the client's bounded retries.
        ValueError: ``env`` needs the agent harness and ``harness`` is None.
        SpecError: ``num_examples`` is more than ``env`` has (:func:`check_num_examples`; never fewer silently).
    """
    if env.needs_harness and harness is None:
        raise ValueError(f"environment {env.id!r}: its tasks have tools; evaluating them needs a HarnessRunner")
    check_num_examples(env, num_examples, "num_examples")  # callers check it first, naming their own key
    count = num_examples

    done = done or {}

    async def one(index: int) -> TaskResult:
        if index in done:
            return done[index]
        rollouts = await rollout_group(
            client,
            tokenizer,
            env,
            index,
            harness=harness,
            n=pass_k,
            max_tokens=max_tokens,
            temperature=temperature,
            policy_version=lambda: 0,
            max_len=max_len,
            seed=None if seed is None else request_seed(seed, index),
        )
        progress.recorder.tick("eval_groups")
        result: TaskResult = ([r.reward for r in rollouts], [sum(r.loss_mask) for r in rollouts])
        if on_task is not None:
            on_task(index, result)
        return result

    results = await asyncio.gather(*(one(i) for i in range(count)))
    rewards = [r for rs, _ in results for r in rs if r is not None]
    lengths = [n for _, ns in results for n in ns]
    passed = [any(r is not None and r >= pass_threshold for r in rs) for rs, _ in results]
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "pass_at_k": sum(passed) / max(1, len(passed)),
        "k": pass_k,
        "num_examples": count,
        "completion_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "reward_missing": sum(r is None for rs, _ in results for r in rs),
    }
