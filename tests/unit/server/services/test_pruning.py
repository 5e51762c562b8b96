"""The pruning rules of sweeps (``server/services/pruning.py``) against numbers worked by hand.

Four trials, metric at steps 1 and 2:

| trial | step 1 | step 2 | mean up to 2 | best up to 2 (max) |
|---|---|---|---|---|
| 0 | 0.2 | 0.4 | 0.3 | 0.4 |
| 1 | 0.5 | 0.7 | 0.6 | 0.7 |
| 2 | 0.6 | 0.6 | 0.6 | 0.6 |
| 3 | 0.1 | 0.1 | 0.1 | 0.1 |
"""

from __future__ import annotations

import math

import pytest

from server.services.pruning import best_value, median_stopping, successive_halving

H = {
    0: [(1, 0.2), (2, 0.4)],
    1: [(1, 0.5), (2, 0.7)],
    2: [(1, 0.6), (2, 0.6)],
    3: [(1, 0.1), (2, 0.1)],
}


def test_median_stopping_max_at_step_2() -> None:
    # trial 0: others' means {0.6, 0.6, 0.1}, median 0.6 > best 0.4 -> stop
    # trial 1: others' means {0.3, 0.6, 0.1}, median 0.3 < 0.7 -> keep; trial 2: median 0.3 < 0.6 -> keep
    # trial 3: others' means {0.3, 0.6, 0.6}, median 0.6 > 0.1 -> stop
    assert median_stopping(H, 2, "max") == {0, 3}


def test_median_stopping_min_at_step_2() -> None:
    # min: best = smallest. trial 0: 0.2 vs median 0.6 -> keep; trial 1: 0.5 vs median{0.3, 0.6, 0.1} = 0.3 -> stop;
    # trial 2: 0.6 vs 0.3 -> stop; trial 3: 0.1 vs median{0.3, 0.6, 0.6} = 0.6 -> keep
    assert median_stopping(H, 2, "min") == {1, 2}


def test_median_stopping_uses_only_values_up_to_the_rung() -> None:
    # at step 1 the means are the step-1 values: 0.2 < median{0.5, 0.6, 0.1} = 0.5; 0.1 < median{0.2, 0.5, 0.6} = 0.5
    assert median_stopping(H, 1, "max") == {0, 3}


def test_median_stopping_only_among_trials_that_reached_the_rung() -> None:
    behind = {**H, 3: [(1, 0.1)]}  # trial 3 has not logged step 2: not judged, not counted
    # trial 0: 0.4 < median{0.6, 0.6}; trial 1: 0.7 > median{0.3, 0.6} = 0.45; trial 2: 0.6 > 0.45
    assert median_stopping(behind, 2, "max") == {0}
    assert median_stopping({0: H[0], 1: H[1]}, 2, "max") == set()  # fewer than 3 trials: nothing stops


@pytest.mark.parametrize(
    ("mode", "eta", "stopped"),
    [
        ("max", 2.0, {0, 3}),  # scores 0.4 0.7 0.6 0.1: keep ceil(4/2) = 2 -> trials 1, 2
        ("max", 1.5, {3}),  # keep ceil(4/1.5) = ceil(2.67) = 3 -> only the worst stops
        ("max", 4.0, {0, 2, 3}),  # keep 1
        ("min", 2.0, {1, 2}),  # keep the two smallest: trials 3 (0.1), 0 (0.4)
    ],
    ids=["max-halve", "max-drop-worst", "max-keep-one", "min-halve"],
)
def test_successive_halving(mode: str, eta: float, stopped: set[int]) -> None:
    assert successive_halving(H, 2, mode, eta) == stopped  # type: ignore[arg-type]  # mode: a Mode literal


def test_successive_halving_ties_and_nan() -> None:
    tie = {0: [(2, 0.5)], 1: [(2, 0.5)]}
    assert successive_halving(tie, 2, "max", 2.0) == {1}  # equal scores: the later trial stops
    nan = {0: [(1, 0.3), (2, math.nan)], 1: [(2, 0.2)], 2: [(2, 0.9)]}
    # trial 0 ranks by 0.3 (its last finite value); keep ceil(3/2) = 2 -> trials 2 (0.9), 0 (0.3)
    assert successive_halving(nan, 2, "max", 2.0) == {1}
    with pytest.raises(ValueError, match=r"^pruning.reduction_factor: expected a number > 1, got 1.0$"):
        successive_halving(H, 2, "max", 1.0)


def test_best_value() -> None:
    assert best_value(H[1], "max") == (2, 0.7)
    assert best_value(H[2], "max") == (1, 0.6)  # the earliest of equal values
    assert best_value([(1, math.nan), (3, 0.2)], "min") == (3, 0.2)
    assert best_value([], "max") is None
