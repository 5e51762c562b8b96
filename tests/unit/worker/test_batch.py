"""``worker.batch``: the batch hand-off file (msgspec JSON), read back exactly, with the ``json`` fallback that keeps
non-finite floats."""

from __future__ import annotations

import json
import math
from pathlib import Path

from worker.batch import Batch, TrainSample, read_batch, write_batch


def _sample(advantage: float, logprob: float) -> TrainSample:
    return TrainSample(
        input_ids=[7, 8, 9],
        loss_mask=[0, 1, 1],
        sampling_logprobs=[0.0, -0.25, logprob],
        advantage=advantage,
        temperature=1.0,
        policy_span=[2, 3],
        group=1,
        prefix_len=1,
    )


def test_a_batch_reads_back_exactly_and_is_plain_json(tmp_path: Path) -> None:
    batch = Batch(step=4, num_samples=2, num_loss_tokens=4, micro_batches=[[_sample(0.5, -1.5)], [_sample(-0.5, -3.0)]])
    path = tmp_path / "batches" / "step_4.json"
    write_batch(path, batch)
    assert read_batch(path) == batch
    assert json.loads(path.read_text()) == batch  # the run directory's record stays JSON any reader can parse
    assert [p.name for p in path.parent.iterdir()] == ["step_4.json"]  # no temporary file left


def test_a_non_finite_float_is_kept_as_json_writes_it(tmp_path: Path) -> None:
    batch = Batch(step=1, num_samples=1, num_loss_tokens=2, micro_batches=[[_sample(float("nan"), float("-inf"))]])
    path = tmp_path / "step_1.json"
    write_batch(path, batch)
    text = path.read_text()
    assert "NaN" in text and "-Infinity" in text and "null" not in text
    (sample,) = read_batch(path)["micro_batches"][0]
    assert math.isnan(sample["advantage"])
    assert sample["sampling_logprobs"] == [0.0, -0.25, float("-inf")]
