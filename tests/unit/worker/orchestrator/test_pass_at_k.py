"""pass@k by the unbiased estimator (worker.orchestrator.eval.pass_at_k: 1 - C(n-c, k) / C(n, k), Chen et al. 2021)
from n >= k samples per task, and ``num_samples`` in the specs and ``asyncrl eval``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from worker.orchestrator import eval as eval_module
from worker.orchestrator.eval import evaluate, pass_at_k
from worker.spec import SpecError, validate_spec


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 1 - 3 / 10),  # C(3,2) = 3, C(5,2) = 10
        (6, 1, 3, 1 - 10 / 20),  # C(5,3) = 10, C(6,3) = 20
        (10, 3, 1, 0.3),  # k = 1: the fraction passed
        (4, 0, 1, 0.0),
        (3, 3, 2, 1.0),  # C(0,2) = 0
        (4, 3, 2, 1.0),  # n - c < k: every k-subset holds a pass
        (2, 1, 2, 1.0),  # n = k: whether any passed
    ],
)
def test_pass_at_k_by_hand(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def _evaluate(monkeypatch: pytest.MonkeyPatch, rewards: list[list[float | None]], **kwargs: Any) -> dict[str, Any]:
    """``evaluate`` over tasks whose sampled rewards are ``rewards`` (one list per task); the samples asked per task
    are recorded in ``asked``."""
    asked: list[int] = []

    async def fake_group(_client: Any, _tok: Any, _env: Any, index: int, *, n: int, **_: Any) -> list[Any]:
        asked.append(n)
        return [SimpleNamespace(reward=r, loss_mask=[1] * 3) for r in rewards[index]]

    monkeypatch.setattr(eval_module, "rollout_group", fake_group)
    env = SimpleNamespace(needs_harness=False, num_tasks=len(rewards), id="t", split="eval")
    out = asyncio.run(evaluate(None, env, None, num_examples=len(rewards), temperature=1.0, max_tokens=8, **kwargs))  # type: ignore[arg-type]
    return {**out, "asked": asked}


def test_evaluate_estimates_pass_at_2_from_4_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    # task 0: c = 2 of 4 (a missing reward does not pass): 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6
    # task 1: c = 1 of 4 (0.5 is below the threshold 1.0): 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2
    out = _evaluate(
        monkeypatch, [[1.0, 0.0, 1.0, None], [0.0, 0.5, 0.0, 1.0]], pass_k=2, num_samples=4, pass_threshold=1.0
    )
    assert out["asked"] == [4, 4]
    assert out["pass_at_k"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert (out["k"], out["n"], out["reward_missing"]) == (2, 4, 1)
    assert out["reward_mean"] == pytest.approx(3.5 / 7)  # the 7 scored samples


def test_without_num_samples_pass_k_samples_and_any_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _evaluate(monkeypatch, [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]], pass_k=3)
    assert out["asked"] == [3, 3, 3]
    assert out["pass_at_k"] == pytest.approx(2 / 3)
    assert out["n"] == 3


def test_fewer_samples_than_k_is_refused_before_anything_is_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="num_samples: 2 samples per task cannot estimate pass@4; use at least 4"):
        _evaluate(monkeypatch, [[1.0, 0.0]], pass_k=4, num_samples=2)


@pytest.mark.parametrize(
    ("kind", "data"),
    [
        ("rl", {"model": {"name": "m"}, "orchestrator": {"eval": {"pass_k": 4, "num_samples": 2}}}),
        ("eval", {"model": {"name": "m"}, "env": {"id": "reverse_text"}, "eval": {"pass_k": 4, "num_samples": 2}}),
    ],
)
def test_specs_refuse_fewer_samples_than_k_naming_the_field(kind: str, data: dict[str, Any]) -> None:
    with pytest.raises(SpecError, match="num_samples: expected at least pass_k = 4, got 2"):
        validate_spec(kind, data)


def test_specs_take_num_samples_of_at_least_k() -> None:
    spec = validate_spec("rl", {"model": {"name": "m"}, "orchestrator": {"eval": {"pass_k": 4, "num_samples": 16}}})
    assert spec.orchestrator.eval.num_samples == 16  # type: ignore[union-attr]
