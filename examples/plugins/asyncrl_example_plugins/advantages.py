"""A custom advantage for ``[orchestrator.advantage] type = "custom"``: the leave-one-out baseline (RLOO).

From "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs"
(Ahmadian et al. 2024, arXiv:2402.14740, Sec. 3.2, RLOO): each rollout's baseline is the mean reward of the
OTHER rollouts of its group, so the baseline does not depend on the rollout it scores:

    A_i = R_i - (sum_j R_j - R_i) / (N - 1)  =  N / (N - 1) * (R_i - mean R)

times ``scale``. A group of one has no other rollout: advantage 0. asyncrl passes only the present rewards
(missing ones are taken out before the call and never trained on).
"""

from __future__ import annotations


def leave_one_out(
    rewards: list[float],
    completion_lengths: list[int],  # noqa: ARG001 - the plugin signature; unused by RLOO
    *,
    scale: float = 1.0,
) -> list[float]:
    """RLOO advantages of one group: ``scale * (R_i - mean of the other rewards)``; ``[0.0]`` for a single reward.

    ``completion_lengths`` (sampled tokens per rollout) is part of the plugin signature and unused here.
    """
    n = len(rewards)
    if n == 1:
        return [0.0]
    total = sum(rewards)
    return [scale * (r - (total - r) / (n - 1)) for r in rewards]
