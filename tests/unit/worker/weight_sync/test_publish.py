"""Weight sync over a process group: bucket plan, flatten/unflatten round trip, and a real two-rank gloo
broadcast of a state dict (two threads, a real TCPStore)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from worker.weight_sync.publish import (
    broadcast,
    bucket_numel,
    flatten_bucket,
    inference_workers,
    join_store,
    new_group,
    plan_buckets,
    resolve_backend,
    send,
    unflatten_bucket,
)

pytestmark = pytest.mark.serial  # gloo process groups: not beside the parallel pass (a peer closed under load)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(4, 8, generator=g),  # 128 B
        "b16": torch.randn(10, generator=g).to(torch.bfloat16),  # 20 B
        "c": torch.randn(3, generator=g),  # 12 B
        "big": torch.randn(100, generator=g),  # 400 B: over the bound, alone
        "d": torch.randn(2, 2, generator=g),  # 16 B
        "e16": torch.randn(7, generator=g).to(torch.bfloat16),  # 14 B
        "scalar": torch.tensor(3.0),  # 4 B, shape []
    }


def test_plan_buckets_boundaries() -> None:
    state = _state()
    meta = plan_buckets(state, bucket_bytes=150)
    names = [n for n, _, _ in meta["tensors"]]
    assert sorted(names) == sorted(state)  # every tensor exactly once
    # grouped by dtype in order of first appearance, state order inside a dtype
    assert names == ["a", "c", "big", "d", "scalar", "b16", "e16"]
    assert meta["buckets"] == [[0, 2], [2, 3], [3, 5], [5, 7]]
    assert meta["buckets"][0][0] == 0 and meta["buckets"][-1][1] == len(names)
    for (start, stop), (nxt, _) in zip(meta["buckets"], [*meta["buckets"][1:], [len(names), 0]], strict=True):
        assert stop == nxt  # contiguous, no gaps
        dtypes = {meta["tensors"][i][1] for i in range(start, stop)}
        assert len(dtypes) == 1
        nbytes = sum(state[meta["tensors"][i][0]].nbytes for i in range(start, stop))
        assert nbytes <= 150 or stop - start == 1
    assert meta["tensors"][4] == ["scalar", "float32", []]
    # a bound larger than the model: one bucket per dtype
    assert plan_buckets(state, 2**20)["buckets"] == [[0, 5], [5, 7]]
    # a bound of one byte: every tensor alone
    assert len(plan_buckets(state, 1)["buckets"]) == len(state)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(state, 0)


def test_flatten_unflatten_round_trip() -> None:
    state = _state()
    meta = plan_buckets(state, bucket_bytes=150)
    seen = {}
    for b in range(len(meta["buckets"])):
        flat = flatten_bucket(state, meta, b, torch.device("cpu"))
        numel, dtype = bucket_numel(meta, b)
        assert flat.dim() == 1 and flat.numel() == numel and flat.dtype == dtype
        for name, t in unflatten_bucket(flat.clone(), meta, b):
            seen[name] = t
    assert seen.keys() == state.keys()
    for name, t in state.items():
        assert seen[name].shape == t.shape and seen[name].dtype == t.dtype
        assert torch.equal(seen[name], t)
    with pytest.raises(ValueError, match="bucket 0"):
        unflatten_bucket(torch.zeros(3), meta, 0)


def test_gloo_broadcast_of_a_state_dict_between_two_ranks() -> None:
    """Rank 0 hosts the store and sends; rank 1 (a thread) joins through the store and receives every bucket."""
    from torch.distributed import TCPStore

    state = _state()
    meta = plan_buckets(state, bucket_bytes=150)
    master = TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    received: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank1() -> None:
        try:
            group = new_group(join_store("127.0.0.1", master.port, 2, 30), 1, 2, "gloo", 30)
            for b in range(len(meta["buckets"])):
                numel, dtype = bucket_numel(meta, b)
                flat = torch.empty(numel, dtype=dtype)
                broadcast(group, flat, 30)
                received.update(unflatten_bucket(flat, meta, b))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=rank1)
    t.start()
    group0 = new_group(master, 0, 2, "gloo", 30)
    send(group0, state, meta, torch.device("cpu"), 30)
    t.join(60)
    assert not errors, errors
    assert received.keys() == state.keys()
    assert all(torch.equal(received[k], v) for k, v in state.items())


def test_gloo_broadcast_times_out_without_a_receiver() -> None:
    from torch.distributed import TCPStore

    master = TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    joined = threading.Event()

    def rank1() -> None:
        new_group(join_store("127.0.0.1", master.port, 2, 30), 1, 2, "gloo", 30)
        joined.set()  # joins, then never receives

    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    group0 = new_group(master, 0, 2, "gloo", 30)
    joined.wait(30)
    with pytest.raises(RuntimeError):
        broadcast(group0, torch.zeros(4), timeout_s=1.0)


def test_backend_and_workers() -> None:
    assert resolve_backend("auto", "cuda") == "nccl"
    assert resolve_backend("auto", "cpu") == "gloo"
    assert resolve_backend("gloo", "cuda") == "gloo"
    assert inference_workers([]) == 1
    assert inference_workers(["--tensor-parallel-size", "2"]) == 2
    assert inference_workers(["--max-num-seqs", "8", "-tp=4"]) == 4
