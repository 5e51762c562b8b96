"""RAE: role-conditioned advantage estimation, reward minus a moving baseline of the same environment and role.

From SPIRAL (Liu, Guertler, Yu, Liu, Qi, Balcells, Liu, Tan, Shi, Lin, Lee, Jaques 2025, "SPIRAL: Self-Play on
Zero-Sum Games Incentivizes Reasoning via Multi-Agent Multi-Turn Reinforcement Learning", arXiv:2506.24119, section 3,
Eq. 2 and Algorithm 1). One shared policy plays several roles; roles differ in expected return (a proposer and a
solver, a first and a second mover), so each (environment G, role p) gets its own baseline b_{G,p}: an exponential
moving average of that role's rewards with decay alpha (``decay``), starting at 0 (Algorithm 1, line 1). As in
Algorithm 1 (lines 21-22), each rollout first updates its baseline, then is scored against the updated one:

    b_{G,p} <- alpha * b_{G,p} + (1 - alpha) * R
    A       =  R - b_{G,p}                          (= alpha * (R - b_{G,p} before the update))

Rollouts are taken one at a time in group order and groups in step order (``build_batch``), so the same rollouts give
the same baselines in every run. No statistic of the group is used, so it works with ``group_size = 1``: the baseline
carries across steps. Rollouts without a role share the role ``""``. A missing reward (``None``, non-finite) leaves the
baseline as it is and gets advantage ``None``; a group with every reward missing is flagged ``all_missing`` (case C8).
Unlike prime-rl's, the baselines are saved in the orchestrator part of every checkpoint (``state()``,
``advantage_state.json``) and restored on resume, so a resumed run scores its next rollout as the original would.
"""

from __future__ import annotations

from typing import Any

from worker.orchestrator.advantages.group import Advantage, AdvantageResult, Group, assemble, split_scored
from worker.spec import RaeAdvantage


class RoleBaselines(Advantage):
    """RAE (module docstring): one EMA baseline per (environment, role), updated rollout by rollout."""

    config: RaeAdvantage

    def __init__(self, config: RaeAdvantage, *, env: str = "") -> None:
        super().__init__(config, env=env)
        self.baselines: dict[str, dict[str, float]] = {}
        """``{environment: {role: baseline}}``; a pair not seen yet has baseline 0."""

    def score(self, group: Group) -> AdvantageResult:
        """RAE advantages of one group, updating the baselines of its (environment, role) pairs.

        Args:
            group: rewards (``None``/non-finite = missing), completion lengths (unused), roles (None = ``""``) and
                the environment (None = the run's).

        Returns:
            ``AdvantageResult`` with ``R_i - b`` for present rewards, ``None`` for missing ones.

        Raises:
            ValueError: rewards and lengths of different counts, or an empty group.
        """
        scored = split_scored(group.rewards, group.completion_lengths)
        baselines = self.baselines.setdefault(group.env if group.env is not None else self.env, {})
        alpha = self.config.decay
        values = []
        for i, reward in zip(scored.index, scored.rewards, strict=True):
            role = group.role_of(i) or ""
            b = baselines[role] = alpha * baselines.get(role, 0.0) + (1 - alpha) * reward
            values.append(reward - b)
        return assemble(len(group.rewards), scored, values)

    def state(self) -> dict[str, Any]:
        return {"type": "rae", "baselines": {env: dict(roles) for env, roles in self.baselines.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        self.baselines = {env: {r: float(b) for r, b in roles.items()} for env, roles in state["baselines"].items()}
