"""Gates (``[[orchestrator.gates]]``): online difficulty filtering of finished groups, with re-sampling.

A gate looks at one scored group (the rollouts of one task) and rejects it or lets it through. A rejected group is
not trained on: the step starts a group of a spare task in its place, so the batch stays full (DAPO's dynamic
sampling, Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning system at scale", section 3.2, filters
groups of all-equal rewards and samples more until the batch is full; a gate generalises the filter). At most
``orchestrator.max_resample`` spare groups start per step; slots still rejected then stay empty and are counted.
The spare tasks are taken with the step's own (``data.TaskSampler.take``: the next ``max_resample`` of the data order,
or the continuation of a ``difficulty_pool`` draw), so what a step may start never depends on how fast other steps
run and a resume repeats it; the standard order skips the spares a step did not use.

| type            | rejects a group when                                                        | config             |
|-----------------|-----------------------------------------------------------------------------|--------------------|
| advantage_range | ``reject_min <= mean of abs(A_i) <= reject_max`` (rollouts with an advantage) | AdvantageRangeGate |
| custom          | your ``import_path`` function returns True (a plugin, ``custom_gate``)        | CustomGate         |

``A_i`` are the advantages of ``orchestrator.advantage`` (``worker/orchestrator/advantages``), the values the
batch would train on; a group whose rewards are all missing has none and passes (the batcher flags it). The
zero-advantage drop of the batcher (``drop_zero_advantage``) stays as it is: ``[0, 0]`` as a gate re-samples those
groups instead of dropping them. A gate function takes the group's rewards, its advantages and its config and
returns True to reject (``GATES`` keys them by ``type``). Rewards reach a gate by the run's one rule for missing
rewards (``worker.rewards.present_reward``): None for a missing one (None, NaN, inf), and its advantage is None.

A custom gate (``type = "custom"``, a plugin like custom losses and advantages: ``worker/spec/user_code.py``) is

    def function(rewards: list[float | None], advantages: list[float | None], *, <your kwargs>) -> bool

one entry per rollout of the group, in order; True rejects the group. Its signature is checked at launch and by
``asyncrl rl --dry-run`` (``load_custom_gate``).
"""

from __future__ import annotations

import asyncio
import functools
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from worker.orchestrator.advantages import compute_advantages
from worker.rewards import present_reward
from worker.spec import AdvantageConfig, AdvantageRangeGate, CustomGate, GateConfig
from worker.spec.user_code import load_function

G = TypeVar("G")
T = TypeVar("T")
"""A task of a step: its task index, or ``(env index, task index)`` in the orchestrator (``mixture.EnvMixture``)."""
GateFn = Callable[[Sequence[float | None], Sequence[float | None], Any], bool]


def advantage_range(
    _rewards: Sequence[float | None], advantages: Sequence[float | None], config: AdvantageRangeGate
) -> bool:
    """True (reject) when the group's mean |advantage| lies in ``[reject_min, reject_max]``.

    Args:
        _rewards: one per rollout (unused: the advantages carry them).
        advantages: one per rollout, None where the rollout has none (missing reward).

    Returns:
        False for a group without any advantage.
    """
    present = [abs(a) for a in advantages if a is not None]
    if not present:
        return False
    return config.reject_min <= statistics.fmean(present) <= config.reject_max


CUSTOM_GATE_ARGS = ("rewards", "advantages")
"""The positional arguments a custom gate takes (then its ``kwargs``)."""
CUSTOM_GATE_KEY = "orchestrator.gates.import_path"


def load_custom_gate(config: CustomGate, key: str = CUSTOM_GATE_KEY) -> Callable[..., Any]:
    """The function of a ``[[orchestrator.gates]]`` table with ``type = "custom"``, its signature checked.

    Args:
        key: the dotted spec key named in errors (``orchestrator.gates.<i>.import_path`` at launch).

    Raises:
        SpecError: one line naming ``key`` (does not import, not callable, does not take
            ``(rewards, advantages, **kwargs)``).
    """
    return _load(config.import_path, tuple(sorted(config.kwargs)), key)


@functools.lru_cache(maxsize=16)
def _load(import_path: str, kwarg_names: tuple[str, ...], key: str) -> Callable[..., Any]:
    return load_function(key, import_path, args=CUSTOM_GATE_ARGS, kwargs=dict.fromkeys(kwarg_names))


def custom_gate(rewards: Sequence[float | None], advantages: Sequence[float | None], config: CustomGate) -> bool:
    """True (reject) when the configured function returns True for the group (see the module docstring).

    Raises:
        ValueError: the function returned something that is not a bool (:func:`as_bool`), naming
            ``orchestrator.gates.import_path``, the function and the type it returned.
        SpecError: the function does not load.
    """
    fn = load_custom_gate(config)
    returned = fn([present_reward(r) for r in rewards], list(advantages), **config.kwargs)
    verdict = as_bool(returned)
    if verdict is None:
        raise ValueError(
            f"{CUSTOM_GATE_KEY}: {config.import_path} returned {returned!r} ({type(returned).__name__}); expected "
            "True (reject) or False (keep)"
        )
    return verdict


def as_bool(value: object) -> bool | None:
    """``value`` as a bool when it is one: a Python bool, a NumPy ``bool_`` (what ``np.mean(x) > t`` gives) or a
    one-element NumPy array or torch tensor of dtype bool; None for anything else (ints, floats, None, strings: a
    gate's verdict is never guessed from truthiness)."""
    if isinstance(value, bool):
        return value
    if str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        numel = getattr(value, "numel", None)  # torch: a method; NumPy: .size, a number
        if (numel() if callable(numel) else getattr(value, "size", None)) == 1:
            return bool(value)  # NumPy/torch scalars define __bool__
    return None


GATES: dict[str, GateFn] = {
    "advantage_range": advantage_range,
    "custom": custom_gate,
}
"""Gate functions keyed by ``orchestrator.gates[i].type``."""


def rejected_by(
    gates: Sequence[GateConfig], advantage: AdvantageConfig, rewards: Sequence[float | None], lengths: Sequence[int]
) -> int | None:
    """Index of the first gate that rejects a group with these rewards and completion lengths, or None.

    Raises:
        ValueError: rewards the advantage cannot score (as ``compute_advantages``).
    """
    return first_rejecting(gates, rewards, compute_advantages(advantage, rewards, lengths).advantages)


def first_rejecting(
    gates: Sequence[GateConfig], rewards: Sequence[float | None], advantages: Sequence[float | None]
) -> int | None:
    """Index of the first gate that rejects a group with these rewards and advantages (one per rollout), or None."""
    for i, gate in enumerate(gates):
        if GATES[gate.type](rewards, advantages, gate):
            return i
    return None


@dataclass
class GatedStep(Generic[T, G]):
    """One step's groups after its gates: ``kept`` (slot order) and every group started with its task index."""

    kept: list[G]
    started: list[tuple[T, G]] = field(default_factory=list)
    """``(task, group)`` of every group of the step, rejected ones included (in start order)."""
    rejected: int = 0
    resampled: int = 0
    unfilled: int = 0
    """Slots left without a group once ``max_resample`` spares were used."""

    def dropped(self) -> list[G]:
        """The groups started but not kept (rejected by a gate), in start order."""
        kept = {id(g) for g in self.kept}
        return [g for _, g in self.started if id(g) not in kept]

    def metrics(self) -> dict[str, int]:
        return {
            "gate_rejected_groups": self.rejected,
            "gate_resampled_groups": self.resampled,
            "gate_unfilled_groups": self.unfilled,
        }


async def fill_batch(
    indices: Sequence[T],
    groups: Sequence[G],
    spares: Sequence[T],
    rejects: Callable[[G], bool],
    start: Callable[[int, T], Awaitable[G]],
) -> GatedStep[T, G]:
    """Replace the rejected groups of a step by groups of spare tasks, in rounds, until none is rejected or the
    spares run out.

    Each round starts one spare per rejected slot (lowest slots first; spare j is ``spares[j]``, in order) and
    waits for all of them, so which spare lands in which slot depends on the rewards alone, not on timing.

    Args:
        indices: the step's task indices, one per slot; ``groups`` their finished groups.
        spares: the step's spare task indices (at most ``max_resample``).
        rejects: True for a group a gate rejects.
        start: ``start(j, task index)`` runs the group of spare j.

    Returns:
        The kept groups in slot order and the counts (a rejected spare counts as rejected too).
    """
    slots: list[G | None] = list(groups)
    out: GatedStep[T, G] = GatedStep(kept=[], started=list(zip(indices, groups, strict=True)))
    pending = [s for s, g in enumerate(groups) if rejects(g)]
    out.rejected = len(pending)
    while pending and out.resampled < len(spares):
        batch = pending[: len(spares) - out.resampled]
        tasks = [spares[out.resampled + k] for k in range(len(batch))]
        new = list(await asyncio.gather(*(start(out.resampled + k, t) for k, t in enumerate(tasks))))
        out.resampled += len(batch)
        out.started += list(zip(tasks, new, strict=True))
        again = []
        for slot, group in zip(batch, new, strict=True):
            slots[slot] = group
            if rejects(group):
                again.append(slot)
        out.rejected += len(again)
        pending = again + pending[len(batch) :]
    for slot in pending:
        slots[slot] = None
    out.unfilled = len(pending)
    out.kept = [g for g in slots if g is not None]
    return out


def group_rejects(gates: Sequence[GateConfig], advantage: AdvantageConfig) -> Callable[[Any], bool]:
    """``rejects(group)`` for ``fill_batch`` over a group of ``Rollout``s (``reward``, ``loss_mask``, ``trace``): the
    advantages it judges are the ones the batch would train (a forked trace counted once: ``branches.trace_advantages``,
    case C22)."""
    from worker.orchestrator.advantages import make_advantage
    from worker.orchestrator.branches import trace_advantages

    scorer = make_advantage(advantage)  # stateless types only (the spec refuses gates with rae, hierarchical_grpo)

    def rejects(group: Any) -> bool:
        lengths = [r.completion_len for r in group]
        advantages = trace_advantages(scorer, group, lengths).advantages
        return first_rejecting(gates, [r.reward for r in group], advantages) is not None

    return rejects
