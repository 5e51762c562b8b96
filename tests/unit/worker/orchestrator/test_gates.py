"""Gates (``worker/orchestrator/gates.py``): the advantage_range decision worked by hand, and re-sampling rounds that
keep the batch full (or count the slots left empty)."""

from __future__ import annotations

import asyncio

import pytest

from worker.orchestrator.gates import GATES, advantage_range, fill_batch, rejected_by
from worker.spec import AdvantageRangeGate, GrpoAdvantage, MaxRLAdvantage


def _gate(low: float, high: float) -> AdvantageRangeGate:
    return AdvantageRangeGate(reject_min=low, reject_max=high)


@pytest.mark.parametrize(
    ("advantages", "low", "high", "rejected"),
    [
        ([0.5, -0.5, -0.5, 0.5], 0.0, 0.4, False),  # mean |A| = 0.5, above the range
        ([0.5, -0.5, -0.5, 0.5], 0.5, 1.0, True),  # 0.5 on the (inclusive) lower bound
        ([0.0, 0.0, 0.0], 0.0, 0.0, True),  # no signal: [0, 0] rejects exactly the zero-advantage groups
        ([0.75, -0.25, -0.25, -0.25], 0.0, 0.3, False),  # (0.75 + 3 * 0.25) / 4 = 0.375
        ([0.75, -0.25, -0.25, -0.25], 0.375, 0.375, True),
        ([0.5, None, -0.5], 0.4, 0.6, True),  # missing advantage left out: (0.5 + 0.5) / 2 = 0.5
        ([None, None], 0.0, 10.0, False),  # no advantage at all: passes (the batcher flags the group)
    ],
)
def test_advantage_range_decision(advantages: list[float | None], low: float, high: float, rejected: bool) -> None:
    assert advantage_range([], advantages, _gate(low, high)) is rejected


def test_rejected_by_scores_with_the_configured_advantage() -> None:
    # GRPO: rewards [1, 0, 0, 0] -> mean 0.25, A = [0.75, -0.25, -0.25, -0.25], mean |A| = 0.375
    gates = [_gate(0.0, 0.1), _gate(0.3, 0.4)]
    assert rejected_by(gates, GrpoAdvantage(), [1.0, 0.0, 0.0, 0.0], [3, 3, 3, 3]) == 1
    assert rejected_by(gates, GrpoAdvantage(), [1.0, 0.0, 1.0, 0.0], [3, 3, 3, 3]) is None  # mean |A| = 0.5
    assert rejected_by(gates, GrpoAdvantage(), [1.0, 1.0], [3, 3]) == 0  # A = [0, 0]
    # MaxRL: (R - mean) / mean: rewards [1, 0, 0, 0] -> A = [3, -1, -1, -1], mean |A| = 1.5
    assert rejected_by([_gate(1.4, 1.6)], MaxRLAdvantage(), [1.0, 0.0, 0.0, 0.0], [3, 3, 3, 3]) == 0
    assert list(GATES) == ["advantage_range", "custom"]  # custom: tests/unit/worker/test_plugins.py


def _fill(groups: list[list[float]], spares: list[int], results: dict[int, list[float]]):  # type: ignore[no-untyped-def]
    calls: list[tuple[int, int]] = []

    async def start(j: int, index: int) -> list[float]:
        calls.append((j, index))
        await asyncio.sleep(0.01 * (3 - j))  # later spares finish first: the slots must not depend on it
        return results[index]

    def rejects(group: list[float]) -> bool:
        return len(set(group)) == 1  # all rewards equal: no signal

    out = asyncio.run(fill_batch([10, 11, 12], groups, spares, rejects, start))
    return out, calls


def test_rejected_groups_are_replaced_in_rounds_until_the_batch_is_full() -> None:
    # slots 1 and 2 rejected -> round 1: spare 0 (task 20) to slot 1, spare 1 (task 21) to slot 2;
    # task 20's group is rejected again -> round 2: spare 2 (task 22) to slot 1
    out, calls = _fill([[1, 0], [1, 1], [0, 0]], [20, 21, 22], {20: [1, 1], 21: [0, 1], 22: [1, 0]})
    assert calls == [(0, 20), (1, 21), (2, 22)]
    assert out.kept == [[1, 0], [1, 0], [0, 1]]  # slot order: slot 0, slot 1 (task 22), slot 2 (task 21)
    assert (out.rejected, out.resampled, out.unfilled) == (3, 3, 0)
    assert [index for index, _ in out.started] == [10, 11, 12, 20, 21, 22]
    assert out.metrics() == {"gate_rejected_groups": 3, "gate_resampled_groups": 3, "gate_unfilled_groups": 0}


def test_max_resample_exhausted_leaves_slots_empty_and_counts_them() -> None:
    # one spare: slot 1 gets task 20 (rejected again), slot 2 gets none -> 2 slots empty
    out, calls = _fill([[1, 0], [1, 1], [0, 0]], [20], {20: [1, 1]})
    assert calls == [(0, 20)]
    assert out.kept == [[1, 0]]
    assert (out.rejected, out.resampled, out.unfilled) == (3, 1, 2)


def test_nothing_rejected_starts_nothing() -> None:
    out, calls = _fill([[1, 0], [0, 1], [1, 0]], [20, 21], {})
    assert calls == [] and out.kept == [[1, 0], [0, 1], [1, 0]]
    assert (out.rejected, out.resampled, out.unfilled) == (0, 0, 0)
