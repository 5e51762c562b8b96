"""GRPO: group-relative advantage, reward minus the group mean (the asyncrl default).

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300) scores each rollout against the other
rollouts of the same task instead of a learned value function:

    A_i = (R_i - mean_j R_j) / max(std_j R_j, std_floor)   if std_normalize   (population std)
    A_i =  R_i - mean_j R_j                                 otherwise (default)

The default drops the std division, as Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) and prime-rl's
``orchestrator/algo/grpo.py`` do: dividing by a small std inflates near-uniform groups and weights
easy and very hard tasks more than the rest. ``std_floor`` bounds that inflation when it is on.

Optional length shaping (``length_penalty`` > 0), in the spirit of Kimi k1.5's length reward (Kimi
Team 2025, arXiv:2501.12599, section 2.3.3), which rewards the shorter of a group's responses relative
to the group's length range:

    A_i <- A_i - length_penalty * (L_i - mean_j L_j) / max_j L_j

L_i is the number of sampled tokens (``worker.orchestrator.packing.completion_length``). The term is centred, so
advantages still sum to 0 over the group, and it is added after any std normalisation, so its size
does not depend on the reward spread. Means, stds and lengths use only rollouts with a reward;
rollouts with a missing reward get ``None`` (case C8, see ``group``). When every present reward is
equal and ``length_penalty`` is 0 the advantages are exactly 0 (the caller drops such groups).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from worker.orchestrator.advantages.group import AdvantageResult, assemble, length_shaping, mean, split_scored
from worker.spec import GrpoAdvantage


def grpo(rewards: Sequence[float | None], completion_lengths: Sequence[int], config: GrpoAdvantage) -> AdvantageResult:
    """Group-relative advantages of one group.

    Args:
        rewards: one reward per rollout; ``None`` or non-finite means missing.
        completion_lengths: sampled-token count per rollout.
        config: ``[orchestrator.advantage]`` with ``type = "grpo"`` (``std_normalize``, ``std_floor``,
            ``length_penalty``; bounds checked by the spec).

    Returns:
        ``AdvantageResult``; present advantages sum to 0 (up to rounding).

    Raises:
        ValueError: rewards and lengths of different counts, or an empty group.
    """
    scored = split_scored(rewards, completion_lengths)
    values = scored.rewards
    if not values:
        return assemble(len(rewards), scored, [])

    if max(values) == min(values):
        centred = [0.0] * len(values)  # exact zeros, not mean-rounding residue like 1e-17
    else:
        mu = mean(values)
        centred = [r - mu for r in values]
        if config.std_normalize:
            std = math.sqrt(mean([c * c for c in centred]))
            centred = [c / max(std, config.std_floor) for c in centred]
    shaping = length_shaping(scored.lengths, config.length_penalty)
    return assemble(len(rewards), scored, [c - s for c, s in zip(centred, shaping, strict=True)])
