"""One group's bookkeeping for the advantage functions: the result type, missing rewards, length shaping.

An advantage function takes ONE group (the ``group_size`` rollouts of one task) and returns one
advantage per rollout. Rewards that are ``None`` (the reward function failed or returned nothing) or
not finite (NaN, inf) are *missing*: they are left out of every group statistic, and their rollouts
get advantage ``None`` and must not be trained on (case C8). A group whose rewards are all missing
is flagged with ``all_missing``; it is never scored 0.

That rule (``worker.rewards.present_reward``) is the run's one rule for a missing reward, applied per rollout
everywhere a reward is read (``reward_mean``/``reward_std`` over the present rewards, ``reward_missing`` = rollouts
without one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from worker.rewards import present_reward


@dataclass(frozen=True)
class AdvantageResult:
    """Advantages of one group plus the reward statistics the orchestrator logs."""

    advantages: list[float | None]
    """One per rollout, in input order; ``None`` for a rollout with a missing reward (do not train it)."""
    reward_mean: float | None
    """Mean over the present rewards; ``None`` when all are missing."""
    reward_missing: int
    """Number of missing rewards (``None`` or not finite)."""
    all_missing: bool
    """True when no reward of the group is present: flag the group, never score it 0."""


@dataclass(frozen=True)
class ScoredGroup:
    """The rollouts of a group that have a reward."""

    index: list[int]
    """Positions of the present rewards in the group."""
    rewards: list[float]
    lengths: list[int]


def split_scored(rewards: Sequence[float | None], completion_lengths: Sequence[int]) -> ScoredGroup:
    """Keep the rollouts whose reward is present (not ``None``, finite)."""
    if len(rewards) != len(completion_lengths):
        raise ValueError(
            f"advantages: got {len(rewards)} rewards but {len(completion_lengths)} completion lengths for one group"
        )
    if not rewards:
        raise ValueError("advantages: a group needs at least one rollout, got none")
    present = [(i, r) for i, r in enumerate(map(present_reward, rewards)) if r is not None]
    return ScoredGroup(
        index=[i for i, _ in present],
        rewards=[r for _, r in present],
        lengths=[int(completion_lengths[i]) for i, _ in present],
    )


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def length_shaping(lengths: Sequence[int], length_penalty: float) -> list[float]:
    """Per-rollout penalty ``length_penalty * (L_i - mean L) / max L`` over the scored rollouts.

    Centred, so it sums to 0 over the group and never moves the group's mean advantage; scaled by
    the group's longest completion, so it lies in ``(-length_penalty, length_penalty)``. Lengths are
    sampled-token counts (``worker.orchestrator.packing.completion_length``, case C11).
    """
    longest = max(lengths, default=0)
    if length_penalty == 0 or longest == 0:
        return [0.0] * len(lengths)
    mean_len = mean(lengths)
    return [length_penalty * (n - mean_len) / longest for n in lengths]


def assemble(n: int, scored: ScoredGroup, values: Sequence[float]) -> AdvantageResult:
    """Scatter the scored rollouts' advantages back into a group of ``n``, ``None`` elsewhere."""
    advantages: list[float | None] = [None] * n
    for i, a in zip(scored.index, values, strict=True):
        advantages[i] = a
    return AdvantageResult(
        advantages=advantages,
        reward_mean=mean(scored.rewards) if scored.rewards else None,
        reward_missing=n - len(scored.index),
        all_missing=not scored.index,
    )


@dataclass(frozen=True)
class Group:
    """One group as the batcher hands it to the run's ``Advantage``: the rollouts of one task, in order.

    Single-role tasks leave ``roles`` and ``episodes`` as ``None`` per rollout. Two-role tasks (``worker.envs.self_play``)
    give each rollout its role (``"proposer"``, ``"solver"``) and the index of its episode in the group.
    """

    rewards: Sequence[float | None]
    completion_lengths: Sequence[int]
    roles: Sequence[str | None] | None = None
    """One per rollout (None: all rollouts have no role)."""
    episodes: Sequence[int | None] | None = None
    """One per rollout: the episode (one proposal and its solver attempts) it belongs to; None: no episodes."""
    env: str | None = None
    """The environment of the group (None: the run's single environment, as the ``Advantage`` was made with)."""

    def role_of(self, i: int) -> str | None:
        return None if self.roles is None else self.roles[i]

    def episode_of(self, i: int) -> int | None:
        return None if self.episodes is None else self.episodes[i]


class Advantage:
    """The run's advantage, made once per run from ``[orchestrator.advantage]``; scores one ``Group`` at a time.

    This base scores each group alone with the stateless function of ``config.type`` (the ``ADVANTAGES`` table:
    ``grpo``, ``maxrl``) and has no state; stateful types (``rae``) subclass it and save ``state()`` in the
    orchestrator part of every checkpoint (``advantage_state.json``), restored by ``load_state`` on resume.
    """

    def __init__(self, config: Any, fn: Callable[..., AdvantageResult] | None = None, *, env: str = "") -> None:
        self.config, self.fn, self.env = config, fn, env

    def score(self, group: Group) -> AdvantageResult:
        """Advantages of ``group`` (one per rollout, ``None`` = do not train).

        Raises:
            ValueError: see the algorithm's function (``maxrl``: a negative reward), mismatched counts, an empty group.
        """
        if self.fn is None:
            raise NotImplementedError(f"advantage {self.config.type!r} scores groups in its own class")
        return self.fn(group.rewards, group.completion_lengths, self.config)

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to score the next group as this one would (JSON-serialisable)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore ``state()`` as saved in a checkpoint (a stateless advantage ignores it)."""
