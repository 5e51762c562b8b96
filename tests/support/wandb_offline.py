"""Read back an offline W&B run (``run-<id>.wandb``): its history rows, as the tests' check of the W&B export.

wandb 0.31 no longer ships a Python reader of its transaction log, so this reads the format directly: a 7-byte file
header (``:W&B``, a 2-byte magic, a version byte), then LevelDB-log records in 32 KiB blocks, each ``crc32c (4) |
length (2, little endian) | type (1: full, 2: first, 3: middle, 4: last)`` followed by ``length`` bytes; a block's
tail shorter than a record header is zero padding. The payload of a full (or reassembled) record is a
``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
FILE_HEADER = 7
RECORD_HEADER = 7


def records(path: Path) -> list[Any]:
    """Every ``Record`` of the transaction log ``path``, in order (checksums not verified)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out, pos, parts = [], FILE_HEADER, b""
    while pos + RECORD_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < RECORD_HEADER:
            pos += left_in_block  # zero padding at a block's end
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0 and length == 0:  # padding / preallocated tail
            break
        payload = data[pos + RECORD_HEADER : pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        parts = payload if kind in (1, 2) else parts + payload
        if kind in (1, 4):
            record = pb.Record()  # type: ignore[attr-defined]
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def offline_runs(run_dir: Path) -> list[Path]:
    """The offline W&B run folders under ``run_dir`` (``<run_dir>/wandb/offline-run-<time>-<id>``), oldest first: one
    per attempt of the run (a resumed export continues the same W&B run id in a new folder)."""
    return sorted(run_dir.glob("wandb/offline-run-*"))


def history(offline_run: Path) -> list[dict[str, Any]]:
    """The history rows (``run.log`` payloads, W&B's own ``_step``/``_runtime``/``_timestamp`` left out) of one
    offline W&B run folder (:func:`offline_runs`)."""
    (path,) = offline_run.glob("run-*.wandb")
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
        rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows
