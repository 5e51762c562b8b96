"""The run's one rule for a missing reward, shared by the environments and the orchestrator (neither imports the
other's internals for it).

A reward is *missing* when it is ``None`` (the reward function failed or returned nothing) or not finite (NaN,
+-inf): it is left out of every statistic, its rollout gets no advantage and is not trained on (case C8). The rule is
applied per rollout everywhere a reward is read: the advantages (``worker.orchestrator.advantages.group``), the
batcher's and the per-env reward statistics, the gates, the curriculum's pass fraction, and the self-play proposer's
reward (``worker.envs.self_play``).
"""

from __future__ import annotations

import math


def present_reward(reward: float | None) -> float | None:
    """The reward as a float when it is present, None when it is missing (None, NaN, +-inf)."""
    if reward is None or not math.isfinite(reward):
        return None
    return float(reward)
