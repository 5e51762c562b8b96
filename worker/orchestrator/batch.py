"""The training batch: what the orchestrator hands the trainer for one step.

A batch is ``batches/step_<n>.json``: packed micro-batches, each a list of samples whose token
counts add up to at most ``orchestrator.seq_len``. Every per-token list of a sample is aligned with
``input_ids`` (prompt then completion); the trainer predicts token t from positions < t.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import NotRequired, TypedDict

import msgspec

from worker.run.rundir import atomic_write_bytes


class TrainSample(TypedDict):
    input_ids: list[int]
    """Prompt then completion token ids, as sampled (never re-tokenized)."""
    loss_mask: list[int]
    """1 on policy-sampled completion tokens, 0 on prompt and environment tokens."""
    sampling_logprobs: list[float]
    """vLLM's logprob of each sampled token (0.0 where loss_mask is 0)."""
    advantage: float
    temperature: float
    """Sampling temperature the completion was drawn at; the trainer divides logits by it."""
    policy_span: list[int]
    """[first, last] policy version the completion was generated under."""
    group: NotRequired[int]
    """Index of the sample's rollout group in its step (samples of a group share the prompt)."""
    prefix_len: NotRequired[int]
    """Leading tokens identical for the whole group (the prompt): packed once per chunk when
    ``orchestrator.share_prompt`` is on (``worker.orchestrator.packing.pack_shared_prompt``)."""
    env: NotRequired[str]
    """Name of the sample's environment (the trainer logs ``mismatch_kl/<env>`` for runs of several)."""


class Batch(TypedDict):
    step: int
    num_samples: int
    num_loss_tokens: int
    micro_batches: list[list[TrainSample]]


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


def write_batch(path: Path, batch: Batch) -> None:
    """Write ``batch`` as JSON to ``path`` atomically (``rundir.atomic_write_bytes``): the parts of
    :func:`encode_batch` joined.

    Raises:
        DiskFull: the filesystem is full.
        OSError: any other failure to write.
    """
    atomic_write_bytes(path, b"".join(encode_batch(batch)))


SAMPLES_PER_PART = 256
"""Samples :func:`encode_batch` encodes in one part (~2-3 ms of msgspec for reverse-text's ~90-token samples): a
caller on an event loop returns to it between parts."""


def encode_batch(batch: Batch, samples_per_part: int = SAMPLES_PER_PART) -> Iterator[bytes]:
    """The JSON text of ``batch`` in parts whose concatenation is one JSON object (its keys, then
    ``micro_batches``), each part holding whole micro-batches of about ``samples_per_part`` samples.

    msgspec encodes them (a 5 MB batch of 2,048 samples: 13-23 ms in all against ~144 ms for ``json.dumps``,
    ``benchmarks/orchestrator_scale.py``); encoding in parts lets the orchestrator's event loop run between them
    (one 20 ms encode held it, and a thread would hold the GIL as long). msgspec writes a non-finite float as
    ``null``; a part with one (``null`` in its text: no field of a batch is None otherwise) is written by
    ``json.dumps`` instead, which keeps ``NaN`` / ``Infinity``.
    """
    head = _ENCODER.encode({k: v for k, v in batch.items() if k != "micro_batches"})
    yield head[:-1] + (b"," if len(head) > 2 else b"") + b'"micro_batches":['
    micro_batches = batch["micro_batches"]
    lo = 0
    while lo < len(micro_batches):
        hi, count = lo, 0
        while hi < len(micro_batches) and (count < samples_per_part or hi == lo):
            count += len(micro_batches[hi])
            hi += 1
        part = _ENCODER.encode(micro_batches[lo:hi])
        if b"null" in part:
            part = json.dumps(micro_batches[lo:hi]).encode()
        yield (b"," if lo else b"") + part[1:-1]
        lo = hi
    yield b"]}"


def read_batch(path: Path) -> Batch:
    """The batch written by :func:`write_batch` (msgspec's decoder; ``json.loads`` for a batch with ``NaN``, which
    msgspec does not read).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON (``json.JSONDecodeError``).
    """
    data = path.read_bytes()
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError:
        return json.loads(data)
