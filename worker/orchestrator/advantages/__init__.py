"""Advantage functions of the orchestrator: one small module per algorithm, keyed by the spec's type.

``compute_advantages(config, rewards, completion_lengths)`` scores ONE group (the rollouts of one
task); ``config`` is ``[orchestrator.advantage]``, one config class per type (``worker.spec``), whose
fields and bounds are checked there and only there.

| type  | advantage of rollout i                                     | config          | module   |
|-------|------------------------------------------------------------|-----------------|----------|
| grpo  | R_i - mean R (optionally / max(std R, std_floor))          | GrpoAdvantage   | grpo.py  |
| maxrl | (R_i - mean R) / mean R                                     | MaxRLAdvantage  | maxrl.py |
| custom | your ``import_path`` function of the present rewards (a plugin) | CustomAdvantage | custom.py |

Both take ``length_penalty`` (a centred length term, see ``grpo``). Missing rewards (``None``,
non-finite) are excluded from the statistics and get advantage ``None``; a group with no reward at
all is flagged ``all_missing`` (case C8, ``group.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from worker.orchestrator.advantages.custom import custom
from worker.orchestrator.advantages.group import AdvantageResult
from worker.orchestrator.advantages.grpo import grpo
from worker.orchestrator.advantages.maxrl import maxrl
from worker.spec import AdvantageConfig

AdvantageFn = Callable[[Sequence[float | None], Sequence[int], Any], AdvantageResult]

ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "maxrl": maxrl,
    "custom": custom,
}
"""Advantage functions keyed by the spec's ``orchestrator.advantage.type``."""


def compute_advantages(
    config: AdvantageConfig, rewards: Sequence[float | None], completion_lengths: Sequence[int]
) -> AdvantageResult:
    """Advantages of one group with the algorithm ``config.type``.

    Args:
        config: ``[orchestrator.advantage]`` (``GrpoAdvantage`` or ``MaxRLAdvantage``).
        rewards: one per rollout; ``None`` (or NaN/inf) when the reward function gave none.
        completion_lengths: sampled-token count per rollout (``worker.packing.completion_length``).

    Returns:
        ``AdvantageResult`` with one advantage per rollout (``None`` = do not train).

    Raises:
        ValueError: rewards the algorithm cannot score (``maxrl``: a negative reward), rewards and lengths
            of different counts, or an empty group.
    """
    return ADVANTAGES[config.type](rewards, completion_lengths, config)


def is_zero_advantage(result: AdvantageResult) -> bool:
    """True when the group has present advantages and all of them are exactly 0 (no learning signal).

    A group with every reward missing is not "zero advantage": it is reported by ``all_missing``.
    """
    present = [a for a in result.advantages if a is not None]
    return bool(present) and all(a == 0 for a in present)


__all__ = [
    "ADVANTAGES",
    "AdvantageResult",
    "compute_advantages",
    "grpo",
    "is_zero_advantage",
    "maxrl",
]
