"""The trials a sweep spec expands to (``server.services.sweeps.trial_params``): grid order, seeded random draws."""

from __future__ import annotations

from server.services.sweeps import SweepSpec, trial_params


def test_grid_order_last_key_fastest() -> None:
    spec = SweepSpec(base={}, grid={"a.x": [1, 2], "b.y": [0.5, 1.0, 1.5]})
    assert trial_params(spec) == [
        {"a.x": 1, "b.y": 0.5},
        {"a.x": 1, "b.y": 1.0},
        {"a.x": 1, "b.y": 1.5},
        {"a.x": 2, "b.y": 0.5},
        {"a.x": 2, "b.y": 1.0},
        {"a.x": 2, "b.y": 1.5},
    ]


def test_random_draws_per_grid_point_seeded_and_in_range() -> None:
    data = {
        "base": {},
        "grid": {"b.y": [0.7, 1.0]},
        "random": {"a.lr": {"low": 1e-5, "high": 1e-3, "log": True}, "a.n": {"low": 2, "high": 8, "integer": True}},
        "num_samples": 3,
        "seed": 7,
    }
    trials = trial_params(SweepSpec.model_validate(data))
    assert len(trials) == 6 and [t["b.y"] for t in trials] == [0.7, 0.7, 0.7, 1.0, 1.0, 1.0]
    assert all(1e-5 <= t["a.lr"] <= 1e-3 and isinstance(t["a.n"], int) and 2 <= t["a.n"] <= 8 for t in trials)
    assert len({t["a.lr"] for t in trials}) == 6  # six distinct draws
    assert trial_params(SweepSpec.model_validate(data)) == trials  # the same seed, the same trials
    other = trial_params(SweepSpec.model_validate({**data, "seed": 8}))
    assert [t["a.lr"] for t in other] != [t["a.lr"] for t in trials]
