"""Advantage functions of the orchestrator: one small module per algorithm, keyed by the spec's type.

``compute_advantages(type, rewards, completion_lengths, **params)`` scores ONE group (the rollouts of
one task); ``params`` are the other fields of ``[orchestrator.advantage]``.

| type  | advantage of rollout i                                     | module   |
|-------|------------------------------------------------------------|----------|
| grpo  | R_i - mean R (optionally / max(std R, std_floor))          | grpo.py  |
| maxrl | (R_i - mean R) / mean R                                     | maxrl.py |

Both accept ``length_penalty`` (a centred length term, see ``grpo``). Missing rewards (``None``,
non-finite) are excluded from the statistics and get advantage ``None``; a group with no reward at
all is flagged ``all_missing`` (case C8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from worker.orchestrator.advantages.common import AdvantageResult
from worker.orchestrator.advantages.grpo import grpo
from worker.orchestrator.advantages.maxrl import maxrl

AdvantageFn = Callable[..., AdvantageResult]

ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "maxrl": maxrl,
}
"""Advantage functions keyed by the spec's ``orchestrator.advantage.type``."""

DEFAULT_ADVANTAGE = "grpo"


def compute_advantages(
    type: str,
    rewards: Sequence[float | None],
    completion_lengths: Sequence[int],
    **params: Any,
) -> AdvantageResult:
    """Advantages of one group with the algorithm named ``type``.

    Args:
        type: a key of ``ADVANTAGES``.
        rewards: one per rollout; ``None`` (or NaN/inf) when the reward function gave none.
        completion_lengths: sampled-token count per rollout (``worker.packing.completion_length``).
        **params: the algorithm's keyword parameters.

    Returns:
        ``AdvantageResult`` with one advantage per rollout (``None`` = do not train).

    Raises:
        ValueError: unknown ``type`` or parameter, or a parameter out of range, naming the
            ``orchestrator.advantage`` field.
    """
    fn = ADVANTAGES.get(type)
    if fn is None:
        raise ValueError(f"orchestrator.advantage.type: expected one of {sorted(ADVANTAGES)}, got {type!r}")
    allowed = sorted(fn.__kwdefaults__ or {})
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"orchestrator.advantage.{unknown[0]}: not a parameter of {type!r}; expected some of {allowed}"
        )
    return fn(rewards, completion_lengths, **params)


def is_zero_advantage(result: AdvantageResult) -> bool:
    """True when the group has present advantages and all of them are exactly 0 (no learning signal).

    A group with every reward missing is not "zero advantage": it is reported by ``all_missing``.
    """
    present = [a for a in result.advantages if a is not None]
    return bool(present) and all(a == 0 for a in present)


__all__ = [
    "ADVANTAGES",
    "DEFAULT_ADVANTAGE",
    "AdvantageResult",
    "compute_advantages",
    "grpo",
    "is_zero_advantage",
    "maxrl",
]
