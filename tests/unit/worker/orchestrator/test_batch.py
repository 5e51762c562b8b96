"""``worker.orchestrator.batch``: the batch hand-off file (msgspec JSON), read back exactly, with the ``json`` fallback
that keeps non-finite floats."""

from __future__ import annotations

import json
import math
from pathlib import Path

from worker.orchestrator.batch import Batch, TrainSample, encode_batch, read_batch, write_batch


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


def test_a_batch_is_encoded_in_parts_of_whole_micro_batches_that_join_to_the_file(tmp_path: Path) -> None:
    micro_batches = [[_sample(0.5, -1.0)] * 2, [_sample(-0.5, -2.0)] * 3, [_sample(1.0, -3.0)], [_sample(0.0, -4.0)]]
    batch = Batch(step=9, num_samples=7, num_loss_tokens=14, micro_batches=micro_batches)
    parts = list(encode_batch(batch, samples_per_part=3))
    # the head, parts of >= 3 samples each (2+3 samples, then 1+1), the closing brackets
    assert len(parts) == 4
    assert parts[0] == b'{"step":9,"num_samples":7,"num_loss_tokens":14,"micro_batches":['
    assert parts[-1] == b"]}"
    assert json.loads(parts[1].join([b"[", b"]"]))[1] == micro_batches[1]
    path = tmp_path / "step_9.json"
    write_batch(path, batch)
    assert path.read_bytes() == b"".join(parts)
    assert json.loads(b"".join(parts)) == batch == read_batch(path)


def test_only_the_part_with_a_non_finite_float_falls_back_to_json() -> None:
    batch = Batch(
        step=2, num_samples=2, num_loss_tokens=4, micro_batches=[[_sample(0.5, -1.0)], [_sample(float("nan"), -2.0)]]
    )
    first, nan_part = list(encode_batch(batch, samples_per_part=1))[1:3]
    assert b"NaN" not in first and b", " not in first  # msgspec: compact
    assert nan_part.startswith(b",") and b"NaN" in nan_part and b", " in nan_part  # json.dumps: spaced, NaN kept
    assert math.isnan(json.loads(b"".join(encode_batch(batch)))["micro_batches"][1][0]["advantage"])


def test_an_empty_batch_is_an_object_with_no_micro_batches() -> None:
    batch = Batch(step=1, num_samples=0, num_loss_tokens=0, micro_batches=[])
    assert json.loads(b"".join(encode_batch(batch))) == batch
