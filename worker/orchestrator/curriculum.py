"""Curricula: which tasks a step takes (``[orchestrator.curriculum]``, a union on ``type``).

| type            | tasks of step n                                                        | where             |
|-----------------|------------------------------------------------------------------------|-------------------|
| standard        | the next ``batch_size`` of the data order (a finite taskset reshuffled every pass) | ``data.py`` |
| difficulty_pool | drawn by the pool weight of each task's running pass rate              | this module       |

**Pass.** A rollout passes when its reward is >= ``pass_threshold`` (default 1.0: a perfect answer); a group's
pass fraction is ``p = passed / scored`` over its rollouts with a reward (missing rewards excluded; a group with
none leaves its task as it was).

**Running pass rate** of a task: its first group sets ``rate = p``; each later group
``rate <- decay * rate + (1 - decay) * p`` (an exponential moving average; ``decay = 0``: the latest group alone).

**Pools** (defaults from the issue): ``unseen`` (no rate yet, weight 1.0), ``hard`` (rate <= ``hard_max`` = 0.25,
weight 0.2), ``normal`` (rate <= ``normal_max`` = 0.75, weight 1.0), ``easy`` (above, weight 0.2). A task is drawn
with probability ``w_pool(task) / sum over tasks of w_pool``; one step takes distinct tasks (weighted sampling
without replacement: the order of the keys ``E_i / w_i``, ``E_i ~ Exp(1)``, Efraimidis & Spirakis 2006, "Weighted
random sampling with a reservoir", IPL 97(5); tasks of weight 0 follow in a uniform order, and a step wanting more
tasks than there are cycles through the order again).

**Determinism.** Step n's draw uses the run seed and n alone (a fresh ``random.Random`` per step, so no generator
position is saved) and the pass rates of the groups of steps ``<= n - 1 - max_async_level``: those are scored
before step n may start (the producer waits for policy version ``n - 1 - max_async_level``, trained from that
step's batch), however fast the steps run. The checkpoint of step k saves the rates folded through step
``k - max_async_level`` and the pass fractions of the steps after it (their groups are scored, not yet due), so a
resumed run draws what the uninterrupted run drew.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from worker.rewards import present_reward
from worker.spec import DifficultyPoolCurriculum

POOLS = ("unseen", "hard", "normal", "easy")


def pass_fraction(rewards: Sequence[float | None], pass_threshold: float) -> float | None:
    """Fraction of a group's scored rollouts whose reward is >= ``pass_threshold``; None when none has a reward.

    Missing rewards (None, NaN, inf) are left out of both counts (case C8).
    """
    scored = [x for x in map(present_reward, rewards) if x is not None]
    if not scored:
        return None
    return sum(r >= pass_threshold for r in scored) / len(scored)


def update_rate(rate: float | None, fraction: float, decay: float) -> float:
    """A task's running pass rate after a group with pass fraction ``fraction`` (``rate`` None: its first group)."""
    return fraction if rate is None else decay * rate + (1 - decay) * fraction


def pool_of(rate: float | None, hard_max: float, normal_max: float) -> str:
    """The pool of a task with running pass rate ``rate``: unseen (None), hard (<= hard_max), normal (<= normal_max),
    else easy."""
    if rate is None:
        return "unseen"
    if rate <= hard_max:
        return "hard"
    return "normal" if rate <= normal_max else "easy"


def weighted_order(weights: Sequence[float], rng: random.Random) -> list[int]:
    """Indices ``0..len(weights)-1`` in a random order where index i comes first with probability
    ``w_i / sum w`` (sequential weighted sampling without replacement).

    Key of index i: ``-log(1 - u_i) / w_i`` with ``u_i`` uniform in [0, 1) (an Exp(1) draw over the weight;
    Efraimidis & Spirakis 2006); the smallest key comes first. Indices of weight 0 come after all others,
    ordered by ``u_i``. One ``rng.random()`` per index, in index order.

    Raises:
        ValueError: a negative weight.
    """
    keyed: list[tuple[int, float, int]] = []
    for i, w in enumerate(weights):
        if w < 0:
            raise ValueError(f"weight of task {i} is negative: {w}")
        u = rng.random()
        keyed.append((0, -math.log1p(-u) / w, i) if w > 0 else (1, u, i))
    return [i for _, _, i in sorted(keyed)]


def draw_tasks(
    rates: dict[int, float], num_tasks: int, count: int, config: DifficultyPoolCurriculum, seed: int, step: int
) -> tuple[list[int], dict[str, int]]:
    """The ``count`` task indices of step ``step`` and the pool sizes they were drawn from.

    Args:
        rates: running pass rate per task index seen so far (others are unseen).
        num_tasks: size of the (finite) taskset.
        count: tasks wanted (more than ``num_tasks``: the order repeats).

    Returns:
        ``(indices, {"unseen": n, "hard": n, "normal": n, "easy": n})``.
    """
    pools = [pool_of(rates.get(i), config.hard_max, config.normal_max) for i in range(num_tasks)]
    w = config.weights
    by_pool = {"unseen": w.unseen, "hard": w.hard, "normal": w.normal, "easy": w.easy}
    order = weighted_order([by_pool[p] for p in pools], random.Random(f"difficulty_pool/{seed}/{step}"))
    sizes = {p: pools.count(p) for p in POOLS}
    return [order[k % num_tasks] for k in range(count)], sizes


class DifficultyPool:
    """Running pass rates of a finite taskset's tasks and the draw of each step's tasks (module docstring).

    ``rates`` holds every step's pass fractions folded in through step ``folded``; ``pending`` the pass fractions
    of the observed steps after it, in group order; ``observed`` is the last step observed. ``lag`` is the run's
    ``max_async_level``: step n draws from the rates through step ``n - 1 - lag``.
    """

    def __init__(self, num_tasks: int, seed: int, lag: int, *, observed: int = 0) -> None:
        self.num_tasks, self.seed, self.lag = num_tasks, seed, lag
        self.rates: dict[int, float] = {}
        self.folded = self.observed = observed
        self.pending: dict[int, list[tuple[int, float]]] = {}
        self.sizes: dict[int, dict[str, int]] = {}
        """Pool sizes each step drew from (for its metrics), until the step is observed."""

    def _fold(self, rates: dict[int, float], steps: Sequence[int], decay: float) -> None:
        for s in steps:
            for task, fraction in self.pending[s]:
                rates[task] = update_rate(rates.get(task), fraction, decay)

    def observe(
        self, step: int, groups: Sequence[tuple[int, Sequence[float | None]]], config: DifficultyPoolCurriculum
    ) -> None:
        """Record step ``step``'s groups ``(task index, rewards)`` (steps observed in order, each once), then fold
        the steps no later draw can precede (``<= step - lag``) into ``rates``.

        Raises:
            ValueError: ``step`` is not the step after the last one observed.
        """
        if step != self.observed + 1:
            raise ValueError(f"difficulty_pool: observed step {step} after step {self.observed}")
        fractions = [(task, pass_fraction(rewards, config.pass_threshold)) for task, rewards in groups]
        self.pending[step] = [(task, p) for task, p in fractions if p is not None]
        self.observed = step
        due = [s for s in sorted(self.pending) if s <= step - self.lag]
        self._fold(self.rates, due, config.decay)
        for s in due:
            del self.pending[s]
        self.folded = max(self.folded, step - self.lag)

    def draw(self, step: int, count: int, config: DifficultyPoolCurriculum) -> list[int]:
        """The ``count`` tasks of step ``step`` from the rates through step ``step - 1 - lag``; keeps the pool sizes.

        Raises:
            RuntimeError: a step the draw needs was not observed yet (the producer ran ahead of its start gate).
        """
        through = step - 1 - self.lag
        if through > self.observed:
            raise RuntimeError(
                f"difficulty_pool: step {step} needs the groups of step {through}, scored up to step {self.observed}"
            )
        rates = dict(self.rates)
        self._fold(rates, [s for s in sorted(self.pending) if s <= through], config.decay)
        indices, self.sizes[step] = draw_tasks(rates, self.num_tasks, count, config, self.seed, step)
        return indices

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state: rates, the step they are folded through, pending pass fractions, last observed step."""
        return {
            "rates": {str(t): r for t, r in sorted(self.rates.items())},
            "folded": self.folded,
            "observed": self.observed,
            "pending": {str(s): [[t, p] for t, p in groups] for s, groups in sorted(self.pending.items())},
        }

    @classmethod
    def from_state(
        cls, state: dict[str, Any] | None, *, num_tasks: int, seed: int, lag: int, step: int
    ) -> DifficultyPool:
        """The pool of a run resumed at checkpoint ``step`` (``state`` None: a fresh run, or a checkpoint written
        without this curriculum: every task unseen)."""
        pool = cls(num_tasks, seed, lag, observed=step)
        if state:
            pool.rates = {int(t): float(r) for t, r in state["rates"].items()}
            pool.folded, pool.observed = int(state["folded"]), int(state["observed"])
            pool.pending = {int(s): [(int(t), float(p)) for t, p in g] for s, g in state["pending"].items()}
        return pool
