"""The colocated route's CPU-testable parts (``worker/weight_sync/cuda_ipc.py``): the flat-buffer layout, the
acknowledgement watcher and its fallback file, and the filesystem fallback when the weights are not on a GPU. The CUDA
IPC transfer itself is ``tests/e2e/test_weight_sync_gpu.py::test_cuda_ipc_update_on_one_shared_gpu`` (GPU machine)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

import worker.weight_sync.cuda_ipc as cuda_ipc
from worker.run.rundir import STABLE_MARKER, RunDir
from worker.spec import WeightSyncConfig
from worker.weight_sync.cuda_ipc import IPC_FILE, IpcSender, plan_layout, views
from worker.weight_sync.publish import FAILED, LOADED, WEIGHTS_FILE


def shapes_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in state.items()}


def test_layout_aligns_every_tensor_to_256_bytes() -> None:
    shapes = {"a": [3], "b": [2, 5], "c": [128]}
    # bf16: 256 bytes = 128 elements; a (3) -> [0, 128), b (10) -> [128, 256), c (128) -> [256, 384)
    assert plan_layout(shapes, torch.bfloat16) == ([["a", [3], 0], ["b", [2, 5], 128], ["c", [128], 256]], 384)
    # float32: 64 elements per 256 bytes; c takes exactly two slots
    assert plan_layout(shapes, torch.float32) == ([["a", [3], 0], ["b", [2, 5], 64], ["c", [128], 128]], 256)


def test_views_round_trip_the_weights_through_one_flat_buffer() -> None:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(4, 3, generator=g), "bias": torch.randn(5, generator=g)}
    layout, numel = plan_layout(shapes_of(state), torch.float32)
    flat = torch.full((numel,), float("nan"))
    for (_, view), t in zip(views(flat, layout), state.values(), strict=True):
        view.copy_(t)
    back = dict(views(flat, layout))
    assert set(back) == {"w", "bias"}
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert back["w"].data_ptr() == flat.data_ptr()  # views, not copies


def test_weights_not_on_a_gpu_fall_back_to_the_filesystem(tmp_path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    sender = IpcSender(run, WeightSyncConfig(kind="cuda_ipc", timeout_s=1), torch.device("cpu"), torch.float32)
    state = {"w": torch.arange(6.0).view(2, 3)}
    folder = sender.publish(iter(state.items()), shapes_of(state), 1, keep_versions=3)
    assert sender.failed is not None and "not on a CUDA device" in sender.failed
    assert sorted(p.name for p in folder.iterdir()) == [STABLE_MARKER, WEIGHTS_FILE]
    assert torch.equal(load_file(folder / WEIGHTS_FILE)["w"], state["w"])
    folder2 = sender.publish(iter(state.items()), shapes_of(state), 2, keep_versions=3)  # no second attempt
    assert not (folder2 / IPC_FILE).exists() and (folder2 / WEIGHTS_FILE).exists()


@pytest.fixture
def cpu_sender(tmp_path, monkeypatch: pytest.MonkeyPatch) -> IpcSender:
    """A sender whose buffer lives on the CPU (the handle is a stand-in: nothing opens it), so the whole publish ->
    watch -> fallback path runs without a GPU."""
    monkeypatch.setattr(cuda_ipc, "export_handle", lambda flat: {"handle": "stand-in", "uuid": "cpu"})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    run = RunDir(tmp_path / "run")
    run.create()
    return IpcSender(run, WeightSyncConfig(kind="cuda_ipc", timeout_s=30), torch.device("cpu"), torch.float32)


def test_failed_load_gets_its_file_from_the_buffer_at_once_not_at_the_next_publish(cpu_sender: IpcSender) -> None:
    """The orchestrator writes FAILED and waits, inference paused, for the version's file: the watcher writes it
    right away (the next publish would come only after a batch the paused server cannot finish)."""
    state = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2)}
    folder = cpu_sender.publish(iter(state.items()), shapes_of(state), 4, keep_versions=5)
    meta = json.loads((folder / IPC_FILE).read_text())
    assert meta["version"] == 4 and meta["tensors"] == [["w", [2, 3], 0], ["b", [2], 64]]
    assert cpu_sender.pending == 4 and not (folder / WEIGHTS_FILE).exists()
    (folder / FAILED).write_text("cannot open the handle")
    t0 = time.monotonic()
    while not (folder / WEIGHTS_FILE).exists():
        assert time.monotonic() - t0 < 5, "no fallback file 5 s after FAILED (timeout_s is 30 s)"
        time.sleep(0.01)
    cpu_sender.settle()
    assert cpu_sender.failed == "version 4: inference answered FAILED"
    written = load_file(folder / WEIGHTS_FILE)
    assert torch.equal(written["w"], state["w"]) and torch.equal(written["b"], state["b"])
    later = cpu_sender.publish(iter(state.items()), shapes_of(state), 5, keep_versions=5)
    assert (later / WEIGHTS_FILE).exists() and not (later / IPC_FILE).exists()


def test_the_buffer_is_reused_after_the_version_or_a_newer_one_is_acknowledged(cpu_sender: IpcSender) -> None:
    state = {"w": torch.zeros(3)}
    cpu_sender.publish(iter(state.items()), shapes_of(state), 1, keep_versions=5)
    (cpu_sender.run.weight_dir(1) / LOADED).write_text("")
    new = {"w": torch.ones(3)}
    folder = cpu_sender.publish(iter(new.items()), shapes_of(new), 2, keep_versions=5)  # settles version 1 first
    assert cpu_sender.failed is None and not (cpu_sender.run.weight_dir(1) / WEIGHTS_FILE).exists()
    assert torch.equal(dict(views(cpu_sender.buffer, cpu_sender.layout))["w"], torch.ones(3))
    cpu_sender.run.weight_dir(3).mkdir(parents=True)
    (cpu_sender.run.weight_dir(3) / LOADED).write_text("")  # a newer version loaded: 2 is no longer read
    cpu_sender.settle()
    assert cpu_sender.failed is None and cpu_sender.pending is None and not (folder / WEIGHTS_FILE).exists()


def test_no_acknowledgement_in_time_writes_the_file_and_gives_up(cpu_sender: IpcSender) -> None:
    cpu_sender.cfg = WeightSyncConfig(kind="cuda_ipc", timeout_s=0.1)
    state = {"w": torch.ones(3)}
    folder = cpu_sender.publish(iter(state.items()), shapes_of(state), 7, keep_versions=5)
    cpu_sender.settle()
    assert cpu_sender.failed == "version 7: inference answered nothing within 0.1s"
    assert torch.equal(load_file(folder / WEIGHTS_FILE)["w"], torch.ones(3))


def test_weights_out_of_order_are_an_error(cpu_sender: IpcSender) -> None:
    state = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(RuntimeError, match="weights out of order: expected a, got b"):
        cpu_sender.publish(iter(reversed(list(state.items()))), shapes_of(state), 1, keep_versions=5)
