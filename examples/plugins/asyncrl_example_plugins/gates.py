"""A custom gate for ``[[orchestrator.gates]] type = "custom"``: reject groups the policy already solves.

A group whose pass rate (the share of its present rewards >= ``pass_threshold``) is above ``max_pass_rate`` teaches
little; rejecting it makes the step re-sample a spare task in its place (``orchestrator.max_resample``). DAPO's
dynamic sampling (Yu et al. 2025, arXiv:2503.14476, section 3.2) filters the all-solved groups, ``max_pass_rate``
just below 1. asyncrl passes one reward and one advantage per rollout, None where the reward is missing.
"""

from __future__ import annotations


def too_easy(
    rewards: list[float | None],
    advantages: list[float | None],  # noqa: ARG001 - the plugin signature; unused here
    *,
    pass_threshold: float = 1.0,
    max_pass_rate: float = 0.75,
) -> bool:
    """True (reject) when more than ``max_pass_rate`` of the group's present rewards are >= ``pass_threshold``;
    False for a group without a reward (the batcher flags it)."""
    present = [r for r in rewards if r is not None]
    if not present:
        return False
    return sum(r >= pass_threshold for r in present) / len(present) > max_pass_rate
