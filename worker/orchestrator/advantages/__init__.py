"""Advantage functions of the orchestrator: one small module per algorithm, keyed by the spec's type.

The run makes ONE ``Advantage`` (``make_advantage(config)``) and the batcher hands it one ``Group`` at a time (the
rollouts of one task, with each rollout's ``role`` and ``episode`` where the environment has several roles);
``config`` is ``[orchestrator.advantage]``, one config class per type (``worker.spec``), whose fields and bounds are
checked there and only there. Stateless types are a function of one group (``ADVANTAGES``, also reachable as
``compute_advantages(config, rewards, completion_lengths)``); stateful or role-aware types are an ``Advantage``
subclass (``ROLE_ADVANTAGES``), whose ``state()`` the orchestrator saves in every checkpoint
(``checkpoints/step_k/orchestrator/advantage_state.json``) and restores on resume.

| type              | advantage of rollout i                                          | config                    | module          |
|-------------------|-----------------------------------------------------------------|---------------------------|-----------------|
| grpo              | R_i - mean R (optionally / max(std R, std_floor))               | GrpoAdvantage             | grpo.py         |
| maxrl             | (R_i - mean R) / mean R                                          | MaxRLAdvantage            | maxrl.py        |
| rae               | R_i - b[env, role_i], b an EMA over steps (updated, then scored) | RaeAdvantage              | rae.py          |
| hierarchical_grpo | R_i - mean R of its role in its episode (``episode_agents``) or  | HierarchicalGrpoAdvantage | hierarchical.py |
|                   | of its role in the group (other roles: the proposer)             |                           |                 |
| custom            | your ``import_path`` function of the present rewards (a plugin)  | CustomAdvantage           | custom.py       |

``grpo`` and ``maxrl`` take ``length_penalty`` (a centred length term, see ``grpo``). Missing rewards (``None``,
non-finite) are excluded from the statistics and get advantage ``None``; a group with no reward at all is flagged
``all_missing`` (case C8, ``group.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from worker.orchestrator.advantages.custom import custom
from worker.orchestrator.advantages.group import Advantage, AdvantageResult, Group
from worker.orchestrator.advantages.grpo import grpo
from worker.orchestrator.advantages.hierarchical import HierarchicalGrpo
from worker.orchestrator.advantages.maxrl import maxrl
from worker.orchestrator.advantages.rae import RoleBaselines
from worker.spec import AdvantageConfig

AdvantageFn = Callable[[Sequence[float | None], Sequence[int], Any], AdvantageResult]

ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "maxrl": maxrl,
    "custom": custom,
}
"""Stateless advantage functions of one group, keyed by the spec's ``orchestrator.advantage.type``."""

ROLE_ADVANTAGES: dict[str, Callable[..., Advantage]] = {
    "rae": RoleBaselines,
    "hierarchical_grpo": HierarchicalGrpo,
}
"""Advantage classes (stateful or reading roles and episodes), keyed by ``orchestrator.advantage.type``."""

STATE_FILE = "advantage_state.json"
"""The advantage's part of the orchestrator checkpoint: ``checkpoints/step_k/orchestrator/advantage_state.json``."""


def make_advantage(config: AdvantageConfig, *, env: str = "") -> Advantage:
    """The run's advantage for ``[orchestrator.advantage]``, made once per run.

    Args:
        config: ``[orchestrator.advantage]``.
        env: the run's environment id, the environment of groups that name none (``rae`` keys its baselines by it).
    """
    if config.type in ROLE_ADVANTAGES:
        return ROLE_ADVANTAGES[config.type](config, env=env)
    return Advantage(config, ADVANTAGES[config.type], env=env)


def write_state(advantage: Advantage, part_dir: Path) -> None:
    """Write ``advantage.state()`` into the orchestrator part folder ``part_dir`` (nothing for a stateless type)."""
    state = advantage.state()
    if state:
        (part_dir / STATE_FILE).write_text(json.dumps(state))


def restore_state(advantage: Advantage, part_dir: Path) -> None:
    """Load the state a checkpoint's orchestrator part saved (``write_state``); no file (a fresh run, a stateless
    type, or a checkpoint from before this file existed) leaves ``advantage`` as made."""
    state_file = part_dir / STATE_FILE
    if state_file.is_file():
        advantage.load_state(json.loads(state_file.read_text()))


def compute_advantages(
    config: AdvantageConfig, rewards: Sequence[float | None], completion_lengths: Sequence[int]
) -> AdvantageResult:
    """Advantages of one group with the algorithm ``config.type``.

    Args:
        config: ``[orchestrator.advantage]`` (``GrpoAdvantage`` or ``MaxRLAdvantage``).
        rewards: one per rollout; ``None`` (or NaN/inf) when the reward function gave none.
        completion_lengths: sampled-token count per rollout (``worker.orchestrator.packing.completion_length``).

    Returns:
        ``AdvantageResult`` with one advantage per rollout (``None`` = do not train).

    Raises:
        ValueError: rewards the algorithm cannot score (``maxrl``: a negative reward), rewards and lengths
            of different counts, an empty group, or a type of ``ROLE_ADVANTAGES`` (use ``make_advantage``).
    """
    if config.type not in ADVANTAGES:
        raise ValueError(f"advantages: type {config.type!r} scores groups through make_advantage(config).score(group)")
    return ADVANTAGES[config.type](rewards, completion_lengths, config)


def is_zero_advantage(result: AdvantageResult) -> bool:
    """True when the group has present advantages and all of them are exactly 0 (no learning signal).

    A group with every reward missing is not "zero advantage": it is reported by ``all_missing``.
    """
    present = [a for a in result.advantages if a is not None]
    return bool(present) and all(a == 0 for a in present)


__all__ = [
    "ADVANTAGES",
    "ROLE_ADVANTAGES",
    "STATE_FILE",
    "Advantage",
    "AdvantageResult",
    "Group",
    "HierarchicalGrpo",
    "RoleBaselines",
    "compute_advantages",
    "grpo",
    "is_zero_advantage",
    "make_advantage",
    "maxrl",
    "restore_state",
    "write_state",
]
