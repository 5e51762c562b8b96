"""Branches of one multi-turn trace (trajectory merging): each sampled token trains once, each trace counts once.

A rollout through verifiers' harness is a message graph, not always one sequence: when a sampled node (a tool
call) does not re-tokenize to the ids vLLM sampled, verifiers starts a new branch from it, and the trace has
several root-to-leaf branches that share a prefix (``worker/orchestrator/harness.py``, ``Trace.branches``). Made
into one training sample per branch as they are, the shared prefix's sampled tokens would be trained once per
branch, and the trace would count once per branch in its group's baseline (case C22: a forked trace with reward
1 and a trace with reward 0 would get advantages ``[1/3, 1/3, -2/3]`` instead of ``[0.5, -0.5]``). Here:

- :func:`merge_branches` (one trace): branches are taken longest first; a token at a position of the longest
  common token prefix with a branch taken before keeps its ids (it is context) but loses its loss mask, so each
  shared sampled token carries loss weight once in total. A branch left without a loss token only repeated (or
  extended to) a branch taken before: it is merged into that one, i.e. dropped (branches that only extend each
  other become one sample). Every branch kept is marked with its trace id.
- :func:`trace_advantages` (one group; the batcher's hook): the group's advantage function scores one entry per
  trace (reward of the trace, length = its sampled tokens summed over the kept branches, each counted once), and
  every branch of a trace gets its trace's advantage.

Rollouts of a plain conversation (``multiturn.run_conversation``) and single-turn rollouts have one branch and
no trace id: they are their own trace.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Hashable, Sequence
from typing import Protocol, TypeVar

from worker.orchestrator.advantages import Advantage, AdvantageResult, Group


class Branch(Protocol):
    """What this module reads and sets of a rollout (``worker.orchestrator.batcher.Rollout``, which imports this
    module for its hook)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int] | None
    completion_logprobs: list[float]
    reward: float | None
    trace: str | None
    role: str | None
    episode: int | None
    env: str

    @property
    def loss_mask(self) -> list[int]: ...


B = TypeVar("B", bound=Branch)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def merge_branches(branches: Sequence[B], trace: str) -> list[B]:
    """The training rollouts of ONE trace's branches (see the module docstring), longest branch first.

    Args:
        branches: one rollout per branch, all of the same trace (same task, reward, policy span).
        trace: the trace's id, set as each kept rollout's ``trace``.

    Returns:
        New rollouts (inputs are not changed) whose loss masks together weight every position of a shared prefix
        once; a branch left without a loss token is dropped.
    """
    kept: list[B] = []
    kept_ids: list[list[int]] = []
    for branch in sorted(branches, key=lambda r: len(r.prompt_ids) + len(r.completion_ids), reverse=True):
        ids = branch.prompt_ids + branch.completion_ids
        shared = max((_common_prefix(ids, other) for other in kept_ids), default=0)
        start = len(branch.prompt_ids)
        mask = [0 if start + j < shared else m for j, m in enumerate(branch.loss_mask)]
        if not any(mask):
            continue  # everything it would train is trained in a branch taken before
        merged = copy.copy(branch)
        merged.completion_mask, merged.trace = mask, trace
        # a token this branch no longer trains (a longer branch does) has no sampling log-prob here either: 0.0, as on
        # environment tokens (the batch's rule, worker.orchestrator.batch.TrainSample)
        merged.completion_logprobs = [lp if m else 0.0 for lp, m in zip(branch.completion_logprobs, mask, strict=True)]
        kept.append(merged)
        kept_ids.append(ids)
    return kept


def trace_advantages(
    advantage: Advantage, group: Sequence[Branch], completion_lengths: Sequence[int]
) -> AdvantageResult:
    """``advantage.score`` of a group in which a trace may have several branches: one entry per trace.

    Args:
        advantage: the run's advantage (``worker.orchestrator.advantages.make_advantage``).
        group: the group's rollouts; those with the same ``trace`` are branches of one trace (same reward), a
            rollout with ``trace`` None is a trace of its own.
        completion_lengths: sampled-token count per rollout (after :func:`merge_branches`).

    Returns:
        The advantage function's result over the traces, with ``advantages`` spread back to one per rollout
        (every branch gets its trace's advantage). ``reward_mean`` and ``reward_missing`` count traces.

    Raises:
        ValueError: as ``advantage.score``.
    """
    keys: list[Hashable] = [r.trace if r.trace is not None else ("rollout", i) for i, r in enumerate(group)]
    traces = list(dict.fromkeys(keys))
    first = {k: keys.index(k) for k in traces}
    rewards = [group[first[k]].reward for k in traces]
    lengths = [sum(n for key, n in zip(keys, completion_lengths, strict=True) if key == k) for k in traces]
    firsts = [group[first[k]] for k in traces]
    env = (group[0].env or None) if group else None  # the group's environment: rae keys its baselines by (env, role)
    result = advantage.score(Group(rewards, lengths, [r.role for r in firsts], [r.episode for r in firsts], env=env))
    per_trace = dict(zip(traces, result.advantages, strict=True))
    return dataclasses.replace(result, advantages=[per_trace[k] for k in keys])
