"""Weight sync, colocated route (``[trainer.weight_sync] kind = "cuda_ipc"``): the trainer and vLLM share one GPU
(or the trainer's rank 0 shares a GPU with every vLLM worker), so a policy version moves GPU -> vLLM without the
disk and without a process group (NCCL cannot put two ranks on one device).

The path of policy version n::

    trainer rank 0, end of step n: copy the full weights into one flat buffer     IpcSender.publish (here)
      (cast to the served dtype, e.g. bf16), synchronise the stream
      -> weights/step_n/{ipc.json, STABLE}: the buffer's CUDA IPC handle,          export_handle (here)
         the GPU's UUID and each tensor's [name, shape, offset]
      -> the orchestrator pauses vLLM, POST /collective_rpc                         WeightReceiver.load (load.py)
         update_weights_from_ipc [meta]
      -> the vLLM worker opens the handle, views each tensor,                       import_handle (here),
         reloads it in place and closes the handle                                  WeightUpdateExtension (load.py)
      -> the orchestrator writes LOADED (or FAILED) into weights/step_n

One buffer, reused: the trainer writes version n+1 into it only after inference acknowledged version n (or a newer
one; the orchestrator loads versions in order). A watcher thread follows version n from the moment it is visible;
the trainer joins it at the end of step n+1 (inference has had the whole step to load version n) and once more
after the last version, before it exits (the buffer dies with the process). A version answered ``FAILED`` or not at
all within ``timeout_s`` gets its ``model.safetensors`` written from the buffer by the watcher at once (the
orchestrator, with inference paused, waits for that file, as in the process-group route of ``publish.py``), and
every later version goes through the filesystem. With FSDP2 the weights are gathered one tensor at a time into the
buffer (``worker.trainer.dist.iter_full_weights``), so no rank holds a second full copy.

The handle is described in JSON (no pickle: the description crosses HTTP into vLLM's worker): the arguments of
``torch.multiprocessing.reductions.rebuild_cuda_tensor`` with bytes as base64. Memory: one copy of the weights in
the served dtype on the trainer's GPU (1.2 GB for a 0.6B model in bf16).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from worker.run.rundir import RunDir, step_dirs, writing
from worker.weight_sync.publish import FAILED, LOADED, WEIGHTS_FILE, prune_versions, write_file, write_version

logger = logging.getLogger(__name__)

IPC_FILE = "ipc.json"
"""In ``weights/step_n``: the version's CUDA IPC description; its presence means "sent through shared GPU memory"."""
ALIGN_BYTES = 256
"""Each tensor starts at a multiple of this in the flat buffer (aligned views for every dtype and kernel)."""


def gpu_uuid(device: torch.device) -> str:
    """The physical UUID of CUDA ``device`` (``CUDA_VISIBLE_DEVICES`` renumbers devices per process; the UUID does not)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def plan_layout(shapes: Mapping[str, Sequence[int]], dtype: torch.dtype) -> tuple[list[list[Any]], int]:
    """Offsets of tensors of the given ``shapes`` (name -> shape) in one flat buffer of ``dtype``.

    Returns ``([[name, shape, offset], ...], numel)``: ``offset`` counts elements of ``dtype`` and is a multiple of
    ``ALIGN_BYTES / itemsize``; tensors keep ``shapes``' order.
    """
    step = max(ALIGN_BYTES // torch.empty((), dtype=dtype).element_size(), 1)
    layout: list[list[Any]] = []
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        layout.append([name, list(shape), offset])
        offset += -(-numel // step) * step
    return layout, offset


def views(flat: torch.Tensor, layout: list[list[Any]]) -> list[tuple[str, torch.Tensor]]:
    """``(name, view)`` for each ``[name, shape, offset]`` of ``layout`` in the 1-D tensor ``flat`` (no copy)."""
    return [(name, flat[offset : offset + math.prod(shape)].view(shape)) for name, shape, offset in layout]


def export_handle(flat: torch.Tensor) -> dict[str, Any]:
    """A JSON-safe description of CUDA tensor ``flat``'s memory, valid in other processes while ``flat`` is alive.

    The fields are the arguments ``torch.multiprocessing.reductions.reduce_tensor`` returns for
    ``rebuild_cuda_tensor`` (bytes base64-encoded), plus the GPU's UUID.

    Raises:
        RuntimeError: ``flat`` is not on a CUDA device.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    if not flat.is_cuda:
        raise RuntimeError(f"cuda_ipc: the trainer's weights are on {flat.device}, not on a CUDA device")
    _, args = reduce_tensor(flat)
    (_, size, stride, offset, _, dtype, _, handle, nbytes, storage_offset, _, ref, ref_offset, event, event_sync) = args
    b64 = lambda b: None if b is None else base64.b64encode(b).decode()  # noqa: E731
    return {
        "uuid": gpu_uuid(flat.device),
        "dtype": str(dtype).removeprefix("torch."),
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "handle": b64(handle),
        "nbytes": int(nbytes),
        "storage_offset": int(storage_offset),
        "ref_counter": b64(ref),
        "ref_counter_offset": int(ref_offset),
        "event": b64(event),
        "event_sync_required": bool(event_sync),
    }


def import_handle(desc: dict[str, Any]) -> torch.Tensor:
    """Open the tensor described by :func:`export_handle` in this process (the same GPU, found by UUID).

    Raises:
        RuntimeError: no visible CUDA device has the description's UUID (trainer and vLLM are not colocated).
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = next(
        (i for i in range(torch.cuda.device_count()) if gpu_uuid(torch.device("cuda", i)) == desc["uuid"]), None
    )
    if index is None:
        raise RuntimeError(f"cuda_ipc: the trainer's GPU {desc['uuid']} is not visible here: not colocated")
    raw = lambda s: None if s is None else base64.b64decode(s)  # noqa: E731
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(desc["size"]),
        tuple(desc["stride"]),
        desc["offset"],
        torch.UntypedStorage,
        getattr(torch, desc["dtype"]),
        index,
        raw(desc["handle"]),
        desc["nbytes"],
        desc["storage_offset"],
        False,
        raw(desc["ref_counter"]),
        desc["ref_counter_offset"],
        raw(desc["event"]),
        desc["event_sync_required"],
    )


class IpcSender:
    """Trainer rank 0's end of the colocated route (see the module docstring).

    Args:
        run: the run directory (``weights/step_n`` is written there).
        cfg: ``spec.trainer.weight_sync`` (``timeout_s`` bounds each wait for an acknowledgement).
        device: the trainer's CUDA device.
        dtype: the dtype vLLM serves (``spec.model.dtype``); the buffer holds the weights cast to it.
    """

    def __init__(self, run: RunDir, cfg: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.run, self.cfg, self.device, self.dtype = run, cfg, device, dtype
        self.buffer: torch.Tensor | None = None
        self.layout: list[list[Any]] = []
        self.handle: dict[str, Any] = {}
        self.pending: int | None = None
        """The version in the buffer that inference has not acknowledged yet (its watcher is running)."""
        self._watcher: threading.Thread | None = None
        self.failed: str | None = None
        """Why the route was given up (then every version goes through the filesystem)."""

    def _give_up(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            logger.warning("weight sync over CUDA IPC: %s; using the filesystem from now on", reason)

    def _acked_since(self, version: int) -> bool:
        """True once some version >= ``version`` has ``LOADED`` or ``FAILED`` in its folder."""
        return any(
            (folder / LOADED).exists() or (folder / FAILED).exists()
            for n, folder in step_dirs(self.run.weights).items()
            if n >= version
        )

    def _watch(self, version: int) -> None:
        """In a thread, from the moment version ``version`` is visible: wait (at most ``cfg.timeout_s``) for its
        acknowledgement or a newer one's. On ``FAILED`` or no answer, write its ``model.safetensors`` from the buffer
        at once (the orchestrator, with inference paused, waits for that file) and give the route up."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while not self._acked_since(version) and time.monotonic() < deadline:
            time.sleep(0.002)
        folder = self.run.weight_dir(version)
        if (folder / LOADED).exists() or (self._acked_since(version) and not (folder / FAILED).exists()):
            return
        reason = f"version {version}: inference answered " + (
            "FAILED" if (folder / FAILED).exists() else f"nothing within {self.cfg.timeout_s:g}s"
        )
        self._give_up(reason)
        if folder.exists() and self.buffer is not None:
            state = {name: t.cpu() for name, t in views(self.buffer, self.layout)}
            try:
                with writing(f"policy version {version}", folder / WEIGHTS_FILE, partial=folder):
                    write_file(folder / WEIGHTS_FILE, state)
            except Exception:  # noqa: BLE001 - logged; the orchestrator's wait for the file then fails the run
                logger.exception("weight sync over CUDA IPC: writing the fallback file of version %d failed", version)

    def settle(self) -> None:
        """Wait until the pending version's watcher is done (it was acknowledged, or its file written): after that
        the buffer is no longer read. Call it before the buffer is overwritten and once after the last version
        (before the trainer exits: the buffer dies with the process)."""
        if self._watcher is not None:
            self._watcher.join()
        self._watcher, self.pending = None, None

    def publish(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        shapes: Mapping[str, Sequence[int]],
        version: int,
        keep_versions: int,
    ) -> Path:
        """Publish policy ``version``; returns the version folder.

        ``weights``: the full HF-named tensors in the order of ``shapes`` (name -> full shape), on any device,
        consumed one at a time (with FSDP2 each is gathered as it is read: ``worker.trainer.dist.iter_full_weights``;
        every rank reads them all, only rank 0 calls this). Through the shared GPU buffer while the route works (after
        :meth:`settle` of the version before), else ``weights/step_<version>/model.safetensors``.

        Raises:
            DiskFull: the filesystem is full (no half-written version is left).
        """
        if self.failed is None:
            try:
                self.settle()
                if self.failed is None and self.buffer is None:
                    self.layout, numel = plan_layout(shapes, self.dtype)
                    buffer = torch.empty(numel, dtype=self.dtype, device=self.device)
                    self.handle = export_handle(buffer)
                    self.buffer = buffer
                elif self.failed is None and [row[0] for row in self.layout] != list(shapes):
                    raise RuntimeError("the weights' names changed between versions")
            except Exception as e:  # noqa: BLE001 - fall back, never lose a version
                self._give_up(str(e).splitlines()[0] if str(e) else type(e).__name__)
        if self.failed is not None or self.buffer is None:
            final = write_version(self.run, version, {n: t.detach().cpu() for n, t in weights}, None)
            prune_versions(self.run, version, keep_versions)
            return final
        for (name, view), (got, t) in zip(views(self.buffer, self.layout), weights, strict=True):
            if got != name:
                raise RuntimeError(f"weights out of order: expected {name}, got {got}")
            view.copy_(t, non_blocking=True)
        torch.cuda.synchronize(self.device)
        meta = {"version": version, "handle": self.handle, "tensors": self.layout}

        def write(tmp: Path) -> None:
            (tmp / IPC_FILE).write_text(json.dumps(meta))

        path = write_version(self.run, version, None, None, write=write)
        self.pending = version
        self._watcher = threading.Thread(target=self._watch, args=(version,), name="cuda-ipc-ack", daemon=True)
        self._watcher.start()
        prune_versions(self.run, version, keep_versions)
        return path
