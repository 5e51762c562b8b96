"""Hierarchical GRPO: group-relative advantages of multi-agent episodes (a proposer and the solvers of its task).

A group of a two-role task is ``group_size`` episodes; an episode is one proposer rollout (it writes a task) and the
rollouts of the solvers that attempt that task (``worker.envs.self_play``). Solvers of different episodes answer
different tasks, so a solver is compared only with the solvers of its own episode; each episode has one proposer, so
a proposer is compared with the proposers of the other episodes of its group (same prompt). ``episode_agents`` names
the roles scored within their episode; every other role is scored across the group (prime-rl's per-agent GRPO
baseline, ``orchestrator/algo/grpo.py``, has the same split). With the group-relative mean of Dr. GRPO (Liu et al.
2025, arXiv:2503.20783; no std division), for rollout i of role r in episode e:

    A_i = R_i - mean{R_j : role_j = r, episode_j = e}    if r in episode_agents     (e.g. the solvers)
    A_i = R_i - mean{R_j : role_j = r}                    otherwise                  (e.g. the proposers of the group)

The proposer's reward R_P derives from its solvers' results; the environment gives it when it scores the episode,
because only the environment knows whether the proposal was valid. ``self_play`` uses R-Zero's uncertainty reward
(Huang et al. 2025, "R-Zero: Self-Evolving Reasoning LLM from Zero Data", arXiv:2508.05004, section 3.2):

    R_P = v * (1 - 2 * |p - 1/2|)    v = 1 for a valid proposal else 0, p = the fraction of the episode's scored
                                      solvers that solved it (reward >= ``worker.envs.self_play.SOLVED_AT``, 1.0)

highest (1) when half the solvers succeed, 0 for a task every solver passes or fails. p is the fraction solved, not
the mean solver reward; with partial rewards the two differ: solver rewards 0.5 and 0.5 give p = 0 and R_P = 0, where
their mean 0.5 would give 1 (``tests/unit/worker/envs/test_self_play.py``). Each set of peers (one role of one episode,
or one role of the group) sums to 0; a peer set of one rollout (a singleton) gets 0. Missing rewards are left out of
every mean and get ``None`` (case C8); a group with none present is flagged ``all_missing``. Rollouts with no role or
episode form the role ``None`` / episode ``None``, so a single-role group is plain Dr. GRPO.
"""

from __future__ import annotations

from collections import defaultdict

from worker.orchestrator.advantages.group import Advantage, AdvantageResult, Group, assemble, mean, split_scored
from worker.spec import HierarchicalGrpoAdvantage


class HierarchicalGrpo(Advantage):
    """Hierarchical GRPO (module docstring): peers within the episode for ``episode_agents``, else within the group."""

    config: HierarchicalGrpoAdvantage

    def __init__(self, config: HierarchicalGrpoAdvantage, *, env: str = "") -> None:
        super().__init__(config, env=env)

    def score(self, group: Group) -> AdvantageResult:
        """Advantages of the episodes of one group.

        Args:
            group: rewards (``None``/non-finite = missing), lengths (unused), each rollout's role and episode.

        Returns:
            ``AdvantageResult``; present advantages sum to 0 within each peer set.

        Raises:
            ValueError: rewards and lengths of different counts, or an empty group.
        """
        scored = split_scored(group.rewards, group.completion_lengths)
        within = set(self.config.episode_agents)
        peers: dict[tuple[str | None, int | None], list[int]] = defaultdict(list)
        for k, i in enumerate(scored.index):
            role = group.role_of(i)
            peers[(role, group.episode_of(i) if role in within else None)].append(k)
        values = [0.0] * len(scored.index)
        for members in peers.values():
            rewards = [scored.rewards[k] for k in members]
            if max(rewards) == min(rewards):
                continue  # exact zeros, as in grpo
            baseline = mean(rewards)
            for k in members:
                values[k] = scored.rewards[k] - baseline
        return assemble(len(group.rewards), scored, values)
