"""Pruning rules of a sweep: which trials stop at a pruning step (a *rung*), from the metric each trial logged.

| rule | decides at rung ``s`` | stops | source |
|---|---|---|---|
| ``median`` | over the trials that reached ``s`` | a trial whose best value up to ``s`` is worse than the median of the other trials' running means up to ``s`` | Golovin et al. 2017, "Google Vizier", section 3.2.2 (median stopping rule) |
| ``successive_halving`` | over the trials that reached ``s`` | all but the ``ceil(n / reduction_factor)`` best by their last value at or before ``s`` | Jamieson & Talwalkar 2016, "Non-stochastic best arm identification and hyperparameter optimization", Algorithm 1; Li et al. 2018 (Hyperband) |

Pure functions of plain numbers; ``server/services/sweeps.py`` reads the metric and stops the runs. ``mode`` is
``"max"`` (higher is better, e.g. ``eval/reward_mean``) or ``"min"`` (a loss). Ties are broken by trial index: of two
equal trials the later one is pruned, so the outcome never depends on dictionary order.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Literal

Mode = Literal["max", "min"]
History = Sequence[tuple[int, float]]
"""One trial's metric as ``(step, value)`` pairs, ascending steps."""


def reached(history: History, step: int) -> bool:
    """Whether the trial logged the metric at ``step`` or later."""
    return bool(history) and history[-1][0] >= step


def _upto(history: History, step: int) -> list[float]:
    return [v for s, v in history if s <= step]


def _better(a: float, b: float, mode: Mode) -> bool:
    return a > b if mode == "max" else a < b


def median_stopping(histories: Mapping[int, History], step: int, mode: Mode) -> set[int]:
    """Trials the median stopping rule stops at rung ``step``.

    For trial ``t`` among those that reached ``step`` (at least 3 of them, else nothing stops), with ``best_t`` its best
    value at steps ``<= step`` and ``mean_j`` the running mean of trial ``j``'s values at steps ``<= step``, ``t``
    stops when ``best_t`` is strictly worse than ``median({mean_j : j != t})`` (Vizier, section 3.2.2).

    Args:
        histories: trial index -> its ``(step, value)`` pairs (NaN values are ignored).
        step: the rung, in trainer steps.
        mode: ``"max"`` or ``"min"``.

    Returns:
        The indices of the trials to stop.
    """
    clean = {t: [(s, v) for s, v in h if math.isfinite(v)] for t, h in histories.items()}
    upto = {t: _upto(h, step) for t, h in clean.items() if reached(h, step) and _upto(h, step)}
    if len(upto) < 3:
        return set()
    means = {t: statistics.fmean(vs) for t, vs in upto.items()}
    out = set()
    for t, values in upto.items():
        best = max(values) if mode == "max" else min(values)
        median = statistics.median(m for j, m in means.items() if j != t)
        if _better(median, best, mode):
            out.add(t)
    return out


def successive_halving(histories: Mapping[int, History], step: int, mode: Mode, reduction_factor: float) -> set[int]:
    """Trials successive halving stops at rung ``step``: of the ``n`` trials that reached ``step``, ranked by their
    last value at or before ``step``, all but the best ``ceil(n / reduction_factor)`` stop.

    Args:
        histories: trial index -> its ``(step, value)`` pairs (NaN values are ignored; a trial with none at or before
            ``step`` does not take part).
        step: the rung, in trainer steps.
        mode: ``"max"`` or ``"min"``.
        reduction_factor: ``eta > 1``; 2 halves the trials, 1.5 keeps two thirds (rounded up).

    Returns:
        The indices of the trials to stop.

    Raises:
        ValueError: ``reduction_factor <= 1``.
    """
    if not reduction_factor > 1:
        raise ValueError(f"pruning.reduction_factor: expected a number > 1, got {reduction_factor}")
    scores = {}
    for t, h in histories.items():
        values = _upto([(s, v) for s, v in h if math.isfinite(v)], step)
        if reached(h, step) and values:
            scores[t] = values[-1]
    sign = -1.0 if mode == "max" else 1.0
    ranked = sorted(scores, key=lambda t: (sign * scores[t], t))
    keep = math.ceil(len(ranked) / reduction_factor)
    return set(ranked[keep:])


def best_value(history: History, mode: Mode) -> tuple[int, float] | None:
    """The ``(step, value)`` of the trial's best finite value (the earliest of equal ones), or None."""
    best: tuple[int, float] | None = None
    for s, v in history:
        if math.isfinite(v) and (best is None or _better(v, best[1], mode)):
            best = (s, v)
    return best
