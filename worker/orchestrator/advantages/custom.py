"""Custom advantages: ``[orchestrator.advantage] type = "custom"`` calls a function of your own (a plugin).

The function scores one group's PRESENT rewards; missing ones (``None``, non-finite: case C8) are taken out
before the call and get advantage ``None``, exactly as for the built-ins (``group.py``):

    def function(rewards: list[float], completion_lengths: list[int], *, <your kwargs>) -> Sequence[float]

``rewards`` and ``completion_lengths`` (sampled-token counts, ``worker.orchestrator.packing.completion_length``) have
one entry per scored rollout, in group order, at least one; the result has one finite advantage per entry. ``kwargs`` of
the spec table are passed on every call. Where the code may come from is ``worker/spec/user_code.py``'s rule; the
signature is checked at launch and by ``asyncrl rl --dry-run`` (:func:`load_custom_advantage`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from worker.orchestrator.advantages.group import AdvantageResult, assemble, split_scored
from worker.spec import CustomAdvantage
from worker.spec.user_code import load_function

CUSTOM_ADVANTAGE_ARGS = ("rewards", "completion_lengths")
"""The positional arguments a custom advantage takes (then its ``kwargs``)."""


def load_custom_advantage(config: CustomAdvantage) -> Callable[..., Sequence[float]]:
    """The function of an ``orchestrator.advantage`` with ``type = "custom"``, its signature checked.

    Raises:
        SpecError: one line naming ``orchestrator.advantage.import_path`` (does not import, not callable, does not
            take ``(rewards, completion_lengths, **kwargs)``).
    """
    return _load(config.import_path, tuple(sorted(config.kwargs)))


@functools.lru_cache(maxsize=8)
def _load(import_path: str, kwarg_names: tuple[str, ...]) -> Callable[..., Sequence[float]]:
    return load_function(
        "orchestrator.advantage.import_path",
        import_path,
        args=CUSTOM_ADVANTAGE_ARGS,
        kwargs=dict.fromkeys(kwarg_names),
    )


def custom(
    rewards: Sequence[float | None], completion_lengths: Sequence[int], config: CustomAdvantage
) -> AdvantageResult:
    """Advantages of one group from the configured function (see the module docstring).

    Raises:
        ValueError: the function returned a different count of advantages or a non-finite one (naming
            ``orchestrator.advantage.import_path``), rewards and lengths of different counts, or an empty group.
        SpecError: the function does not load.
    """
    scored = split_scored(rewards, completion_lengths)
    if not scored.rewards:
        return assemble(len(rewards), scored, [])
    fn = load_custom_advantage(config)
    values: Any = fn(list(scored.rewards), list(scored.lengths), **config.kwargs)
    values = [float(v) for v in values]
    if len(values) != len(scored.rewards) or not all(math.isfinite(v) for v in values):
        raise ValueError(
            f"orchestrator.advantage.import_path: {config.import_path} returned {values!r} for "
            f"{len(scored.rewards)} rewards; expected one finite advantage per reward"
        )
    return assemble(len(rewards), scored, values)
