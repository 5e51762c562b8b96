"""MaxRL: advantage normalised by the group mean reward, a sampled estimate of maximum likelihood.

From "Maximum Likelihood Reinforcement Learning" (Tajwar, Zeng, Zhou, Song, Arora, Jiang, Schneider,
Salakhutdinov, Feng, Zanette 2026, arXiv:2602.02710; zanette-labs.github.io/MaxRL). For pass/fail
rewards the likelihood of a correct answer is p(x), and RL's objective E[p] only matches the first
term of log p = -sum_k (1 - p)^k / k. The gradient of log p is grad p / p; MaxRL estimates it from a
group of N rollouts with K successes as (1/K) * sum over successes of grad log pi, i.e. it divides by
the number of successes instead of N. With the group mean as control variate this is

    A_i = (R_i - mean_j R_j) / mean_j R_j

so hard tasks (few successes, small mean) get large advantages: a lone success among 8 rollouts gets
7, a success in a group of all-but-one successes gets 1/7. The advantages sum to 0 over the group.

Rewards must be >= 0 (success probabilities or scores in [0, 1]); a group with mean reward 0 (all
failures) or with all rewards equal gets advantages of exactly 0. Missing rewards (``None``, non-finite)
are handled as in GRPO (case C8, see ``group``). ``length_penalty`` is the centred length term of
``grpo``, added after the normalisation. MaxRL has no std normalisation, so its spec table
(``MaxRLAdvantage``) has no ``std_normalize`` or ``std_floor``.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.orchestrator.advantages.group import AdvantageResult, assemble, length_shaping, mean, split_scored
from worker.spec import MaxRLAdvantage


def maxrl(
    rewards: Sequence[float | None], completion_lengths: Sequence[int], config: MaxRLAdvantage
) -> AdvantageResult:
    """MaxRL advantages of one group: reward minus the group mean, divided by the group mean.

    Args:
        rewards: one reward per rollout, each >= 0; ``None`` or non-finite means missing.
        completion_lengths: sampled-token count per rollout.
        config: ``[orchestrator.advantage]`` with ``type = "maxrl"`` (``length_penalty``; bounds checked by the spec).

    Returns:
        ``AdvantageResult``; present advantages sum to 0 (up to rounding).

    Raises:
        ValueError: a negative reward (naming ``orchestrator.advantage.type``), rewards and lengths of different
            counts, or an empty group.
    """
    scored = split_scored(rewards, completion_lengths)
    values = scored.rewards
    if values and min(values) < 0:
        raise ValueError(
            f'orchestrator.advantage.type: "maxrl" needs rewards >= 0, got {min(values)!r}; use type = "grpo"'
        )
    if not values:
        return assemble(len(rewards), scored, [])

    mu = mean(values)
    if mu == 0 or max(values) == min(values):
        normalised = [0.0] * len(values)
    else:
        normalised = [(r - mu) / mu for r in values]
    shaping = length_shaping(scored.lengths, config.length_penalty)
    return assemble(len(rewards), scored, [a - s for a, s in zip(normalised, shaping, strict=True)])
