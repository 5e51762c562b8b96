"""A step's CPU work in slices on the event loop (``orchestrator.slices``, ``batcher.batch_groups``), rollout records
through msgspec with the NaN fallback (``batcher.encode_records``), and the orchestrator's GC policy (``heap``)."""

from __future__ import annotations

import gc
import json
import math

from worker.orchestrator import heap
from worker.orchestrator.advantages import make_advantage
from worker.orchestrator.batcher import Rollout, batch_groups, batch_metrics, build_batch, encode_records
from worker.orchestrator.orchestrator import slices
from worker.orchestrator.packing import completion_length
from worker.spec import OrchestratorConfig


def rollout(reward: float | None, n_tokens: int, task: str, mask: list[int] | None = None) -> Rollout:
    return Rollout(
        task_key=task,
        prompt_ids=[1, 2, 3],
        completion_ids=list(range(10, 10 + n_tokens)),
        completion_logprobs=[-0.25] * n_tokens,
        completion_text="x" * n_tokens,
        finish_reason="stop",
        reward=reward,
        advantage=None,
        policy_span=(0, 0),
        temperature=1.0,
        completion_mask=mask,
        generation_s=0.01 * n_tokens,
    )


def groups_of(sizes: list[int]) -> list[list[Rollout]]:
    return [[rollout(float(i % 3) / 2, 2 + (i + g) % 5, f"t{g}") for i in range(size)] for g, size in enumerate(sizes)]


def test_slices_cover_the_groups_in_order_each_with_at_least_size_rollouts() -> None:
    groups = [[0] * 4, [0] * 4, [0] * 1, [0] * 8, [0] * 3]
    assert slices(groups, size=8) == [(0, 2), (2, 4), (4, 5)]  # 8, 9, then the last 3
    assert slices(groups, size=1) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert slices(groups, size=100) == [(0, 5)]
    assert slices([], size=8) == []


def test_batching_a_slice_at_a_time_gives_build_batchs_samples_and_metrics() -> None:
    orch = OrchestratorConfig(batch_size=6, group_size=4, advantage={"type": "rae"})  # a stateful advantage
    whole, whole_metrics = build_batch(1, groups_of([4] * 6), orch)
    groups = groups_of([4] * 6)
    advantage = make_advantage(orch.advantage)
    sliced = []
    for lo, hi in slices(groups, size=8):
        sliced += batch_groups(1, groups[lo:hi], orch, advantage, first=lo)
    assert sliced == whole
    assert [s["group"] for s in sliced] == [s["group"] for s in whole] and sliced[-1]["group"] == 5
    assert batch_metrics(1, groups) == whole_metrics


def test_completion_len_counts_sampled_tokens_without_building_the_mask() -> None:
    multi_turn = rollout(1.0, 15, "t", mask=[0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1])  # case C11
    assert multi_turn.completion_len == 9 == completion_length(multi_turn.loss_mask)
    assert rollout(1.0, 7, "t").completion_len == 7


def test_records_encode_as_json_lines_and_keep_nan_and_infinity() -> None:
    plain, nan_reward, inf_logprob = rollout(0.5, 3, "a"), rollout(math.nan, 2, "b"), rollout(1.0, 2, "c")
    inf_logprob.completion_logprobs = [-0.5, -math.inf]
    records = [r.record(4, g) for g, r in enumerate([plain, nan_reward, inf_logprob])]
    lines = encode_records(records).decode().splitlines()
    assert [json.loads(line) for line in lines[:1]] == records[:1]
    assert "NaN" in lines[1] and math.isnan(json.loads(lines[1])["reward"])  # not null: as json.dumps wrote it
    assert json.loads(lines[2])["completion_logprobs"] == [-0.5, -math.inf]
    assert encode_records([]) == b""


def test_settle_freezes_the_heap_and_full_collections_come_every_n_steps() -> None:
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        heap.settle()
        assert gc.get_freeze_count() > frozen
        assert gc.get_threshold()[2] == heap.NO_AUTOMATIC_FULL
        assert [s for s in range(1, 11) if heap.after_step(s, every=4)] == [4, 8]
        assert [s for s in (49, 50, 51, 100) if heap.after_step(s)] == [50, 100]  # FULL_COLLECTION_EVERY
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
