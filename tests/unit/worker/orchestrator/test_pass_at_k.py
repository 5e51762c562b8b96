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
        (5, 2, 3, 0.9),  # C(3,3) = 1, C(5,3) = 10
        (5, 0, 3, 0.0),  # none passed
        (6, 1, 3, 1 - 10 / 20),  # C(5,3) = 10, C(6,3) = 20
        (10, 3, 1, 0.3),  # k = 1: the fraction passed
        (4, 0, 1, 0.0),
        (3, 3, 2, 1.0),  # C(0,2) = 0
        (4, 3, 2, 1.0),  # n - c < k: every k-subset holds a pass
        (2, 1, 2, 1.0),  # n = k: whether any passed
        (1024, 1, 1, 1 / 1024),  # the spec's bound on num_samples
        (1024, 1, 512, 0.5),  # C(1023,512) / C(1024,512) = (1024 - 512) / 1024
        (1024, 512, 512, 1.0),  # 1 - 1 / C(1024,512), C(1024,512) ~ 4.5e306: no overflow
    ],
)
def test_pass_at_k_by_hand(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def _branch(reward: float | None, trace: str, tokens: int = 3) -> SimpleNamespace:
    """One record of a tool-using rollout: a branch of ``trace`` (its reward) with ``tokens`` model-sampled tokens."""
    return SimpleNamespace(reward=reward, loss_mask=[1] * tokens, trace=trace)


def _evaluate(
    monkeypatch: pytest.MonkeyPatch, rewards: list[list[float | None | SimpleNamespace]], **kwargs: Any
) -> dict[str, Any]:
    """``evaluate`` over tasks whose sampled rewards are ``rewards`` (one list per task; a reward is a rollout of 3
    tokens of its own, or a :func:`_branch`); the samples asked per task are recorded in ``asked``."""
    asked: list[int] = []

    async def fake_group(_client: Any, _tok: Any, _env: Any, index: int, *, n: int, **_: Any) -> list[Any]:
        asked.append(n)
        return [
            r if isinstance(r, SimpleNamespace) else SimpleNamespace(reward=r, loss_mask=[1] * 3, trace=None)
            for r in rewards[index]
        ]

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


def test_partial_credit_below_the_threshold_does_not_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # rewards 0.9 and 0.5 (an almost-right reversal) fail at pass_threshold 1.0 and pass at 0.5: c = 0, then c = 2
    assert _evaluate(monkeypatch, [[0.9, 0.5]], pass_k=1, num_samples=2)["pass_at_k"] == 0.0
    assert _evaluate(monkeypatch, [[0.9, 0.5]], pass_k=1, num_samples=2, pass_threshold=0.5)["pass_at_k"] == 1.0


def test_a_tool_using_sample_with_several_branches_counts_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 samples: trace a (2 branches of 3 and 5 sampled tokens, reward 1.0) and trace b (reward 0.0): n = 2, c = 1,
    # pass@1 = 1/2 (the 3 records as samples would give 2/3); lengths per sample: 3 + 5 and 3
    rollouts = [_branch(1.0, "a"), _branch(1.0, "a", tokens=5), _branch(0.0, "b")]
    out = _evaluate(monkeypatch, [rollouts], pass_k=1, num_samples=2)
    assert out["pass_at_k"] == pytest.approx(1 / 2)
    assert out["reward_mean"] == pytest.approx(1 / 2) and out["completion_len_mean"] == pytest.approx(11 / 2)


def test_a_sample_that_never_came_back_is_missing_and_did_not_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 samples asked, 2 came back (a tool-using rollout that failed before sampling gives no record):
    # n = 3, c = 1: 1 - C(2,2)/C(3,2) = 2/3 (n = 2 would give 1)
    out = _evaluate(monkeypatch, [[_branch(1.0, "a"), _branch(0.0, "b")]], pass_k=2, num_samples=3)
    assert out["pass_at_k"] == pytest.approx(2 / 3)
    assert out["reward_missing"] == 1 and out["reward_mean"] == pytest.approx(1 / 2)


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
