"""Held-out evaluation against an inference server: mean reward and pass@k.

Shared by online evals (orchestrator) and ``asyncrl eval``. pass@k is the chance that at least one of k samples of a
task scores >= ``pass_threshold``, averaged over tasks, by the unbiased estimator of Chen et al. 2021 ("Evaluating
Large Language Models Trained on Code", eq. 1) from n >= k samples per task of which c passed:
``1 - C(n - c, k) / C(n, k)`` (:func:`pass_at_k`). With n = k it is the fraction of tasks with a passing sample; more
samples (``num_samples``) lower its variance.

What passes is a sample's reward, never a part of it: partial credit below ``pass_threshold`` (default 1.0, so the
LCS-ratio 0.9 of an almost-reversed text) fails, and so does a sample without a reward (the rollout failed or was not
scored) or one that never came back. A sample is one rollout of the task: a tool-using rollout that trains several
branches (``worker.orchestrator.harness``) is one sample with one reward (:func:`task_result`).
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from worker.envs import Environment
from worker.orchestrator.data import request_seed
from worker.orchestrator.rollouts import rollout_group
from worker.tracking import progress

if TYPE_CHECKING:
    from worker.inference.client import InferenceClient
    from worker.orchestrator.batcher import Rollout
    from worker.orchestrator.harness import HarnessRunner


TaskResult = tuple[list[float | None], list[int]]
"""One eval task's samples: their rewards (None: missing) and completion lengths in model-sampled tokens."""


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


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task from ``n`` samples of which ``c`` passed: ``1 - C(n - c, k) / C(n, k)``.

    Numerically stable as it stands: the binomials are exact Python integers (no float overflow, where C(1024, 512)
    ~ 4.5e306) and their quotient is rounded once, where Chen et al.'s float product
    ``1 - prod_{i = n-c+1}^{n} (1 - k / i)`` rounds c times. 0 when c = 0; 1 when ``n - c < k`` (every k of the n
    samples hold a pass).

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def task_result(rollouts: list[Rollout]) -> TaskResult:
    """One eval task's :data:`TaskResult` from its rollouts: a tool-using sample's branches (the records of one
    ``trace``, all with its reward) count once, with their model-sampled tokens summed; a record without a trace is a
    sample of its own."""
    samples: dict[object, tuple[float | None, int]] = {}
    for i, r in enumerate(rollouts):
        key = i if r.trace is None else r.trace
        reward, tokens = samples.get(key, (r.reward, 0))
        samples[key] = (reward, tokens + sum(r.loss_mask))
    return [reward for reward, _ in samples.values()], [tokens for _, tokens in samples.values()]


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
    num_samples: int | None = None,
    harness: HarnessRunner | None = None,
    seed: int | None = None,
    done: Mapping[int, TaskResult] | None = None,
    on_task: Callable[[int, TaskResult], None] | None = None,
) -> dict[str, float | int | None]:
    """Score ``num_examples`` eval tasks (``num_samples`` samples each, default ``pass_k``) with the environment's
    rewards; pass@``pass_k`` by :func:`pass_at_k` (a sample whose reward is missing did not pass, nor one that never
    came back: counted missing).

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
        ``{"reward_mean", "pass_at_k", "k", "n", "num_examples", "completion_len_mean", "reward_missing"}`` (``n``:
        samples per task); rewards that are None are left out of the mean and counted.

    Raises:
        InferenceError: the server did not answer within the client's bounded retries.
        ValueError: ``env`` needs the agent harness and ``harness`` is None; ``num_samples`` below ``pass_k``.
        SpecError: ``num_examples`` is more than ``env`` has (:func:`check_num_examples`; never fewer silently).
    """
    if env.needs_harness and harness is None:
        raise ValueError(f"environment {env.id!r}: its tasks have tools; evaluating them needs a HarnessRunner")
    check_num_examples(env, num_examples, "num_examples")  # callers check it first, naming their own key
    count, samples = num_examples, pass_k if num_samples is None else num_samples
    if samples < pass_k:
        raise ValueError(
            f"num_samples: {samples} samples per task cannot estimate pass@{pass_k}; use at least {pass_k}"
        )

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
            n=samples,
            max_tokens=max_tokens,
            temperature=temperature,
            policy_version=lambda: 0,
            max_len=max_len,
            seed=None if seed is None else request_seed(seed, index),
        )
        progress.recorder.tick("eval_groups")
        rewards, lengths = task_result(rollouts)
        result: TaskResult = (rewards + [None] * (samples - len(rewards)), lengths)  # a lost sample: missing
        if on_task is not None:
            on_task(index, result)
        return result

    results = await asyncio.gather(*(one(i) for i in range(count)))
    rewards = [r for rs, _ in results for r in rs if r is not None]
    lengths = [n for _, ns in results for n in ns]
    # n: at least the samples asked (a record of an interrupted eval may hold fewer: the others did not pass)
    per_task = [
        pass_at_k(max(len(rs), samples), sum(r is not None and r >= pass_threshold for r in rs), pass_k)
        for rs, _ in results
    ]
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "pass_at_k": statistics.fmean(per_task) if per_task else 0.0,
        "k": pass_k,
        "n": samples,
        "num_examples": count,
        "completion_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "reward_missing": sum(r is None for rs, _ in results for r in rs),
    }
