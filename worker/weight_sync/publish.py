"""Weight sync, trainer end: publish each policy version for vLLM, through the filesystem (``publish_weights``,
``[trainer.weight_sync] kind = "filesystem"``) or over a process group: trainer rank 0 broadcasts it to the
vLLM workers in buckets, no disk (``kind = "process_group"``, ``WeightSender``); the filesystem route is its
fallback. The inference end is ``worker/weight_sync/load.py``.

The whole path of policy version n, with the file behind each arrow::

    trainer, end of step n                                      worker/trainer/train.py
      -> weights/step_n/{model.safetensors, STABLE}             publish_weights (here): filesystem
         or weights/step_n/{group.json, STABLE}                 WeightSender.publish (here): process group,
            + buckets broadcast over gloo/NCCL                    buckets and group helpers (here)
      -> the orchestrator's weight watcher sees version n       worker/orchestrator/orchestrator.py
      -> pause, load, reset the prefix cache, resume            InferenceClient.publish_weights,
         (load: POST /collective_rpc)                             worker/inference/client.py
         group.json: WeightReceiver.load, writes LOADED/FAILED  worker/weight_sync/load.py
      -> vLLM worker extension reloads the weights in place     WeightUpdateExtension,
         (receives the buckets, or reads the safetensors)         worker/weight_sync/load.py
      -> the orchestrator relays version n: policy_version,     worker/orchestrator/orchestrator.py
         ``weight_update_s`` in metrics, rollouts tagged n

Design (the run directory stays the one place trainer and orchestrator meet; only the tensors move over
the group):

- **Group.** A separate process group of ``1 + n`` ranks: trainer rank 0 (rank 0) and the ``n`` vLLM workers
  (ranks ``1..n``, ``n`` = vLLM's tensor-parallel size). It is not the trainer's FSDP group nor vLLM's own
  groups: a ``TCPStore`` hosted by the trainer, a ``PrefixStore`` and a gloo (CPU) or NCCL (cuda) backend
  built directly on it (:func:`new_group`, the recipe of vLLM's ``init_gloo_process_group`` /
  ``stateless_init_torch_distributed_process_group``, torch only, so the trainer needs no vLLM). At start the
  trainer writes ``weight_sync.json`` (address, port, world size, backend) and forms the group in a
  background thread; the orchestrator, once vLLM is up, reads the file and asks the workers to join
  (``/collective_rpc init_weight_update_group``).
- **Metadata.** For version n the trainer writes ``weights/step_n/group.json`` (names, dtypes, shapes,
  bucket boundaries; :func:`plan_buckets`) and the ``STABLE`` marker: the orchestrator's weight watcher sees a
  new version as today. It pauses vLLM (keep), sends the metadata in the body of
  ``/collective_rpc update_weights_from_group``, resets the prefix cache and resumes.
- **Overlap.** The RPC blocks until the workers have received and loaded every bucket; the broadcast runs in
  the trainer process at the same time (the trainer starts it right after writing ``group.json``; the
  first bucket waits for the workers to enter the receive). The orchestrator's RPC is an awaited HTTP call,
  so its event loop keeps batching meanwhile.
- **Acknowledgement and fallback.** The orchestrator writes ``LOADED`` (or ``FAILED``) into
  ``weights/step_n``; the trainer waits for it after the broadcast. On a broadcast error, ``FAILED`` or no
  answer within ``timeout_s`` the trainer logs a warning, writes ``model.safetensors`` into ``weights/step_n``
  (temporary name, then rename) and uses the filesystem for the rest of the run; the orchestrator, after a
  failed RPC, waits for that file and loads it by path. A version folder holding ``model.safetensors`` is
  always loaded by path.

Buckets: tensors are grouped by dtype (stable order), each bucket is a contiguous run of one dtype of at most
``bucket_mb`` MiB, flattened into one 1-D tensor (a tensor larger than the bound goes alone).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from worker.run.rundir import STABLE_MARKER, RunDir, step_dirs, writing
from worker.trainer.dist import is_main_rank, weights_state_dict

logger = logging.getLogger(__name__)

GROUP_FILE = "weight_sync.json"
"""In the run directory: how to join the trainer's weight-sync group (written by trainer rank 0)."""
META_FILE = "group.json"
"""In ``weights/step_n``: the version's tensor metadata; its presence means "sent over the group"."""
LOADED, FAILED = "LOADED", "FAILED"
"""Acknowledgements the orchestrator writes into ``weights/step_n``."""
WEIGHTS_FILE = "model.safetensors"


# ----------------------------------------------------------------------------- buckets


def plan_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> dict[str, Any]:
    """Metadata of a bucketed broadcast of ``state`` (JSON-serialisable).

    Returns:
        ``{"tensors": [[name, dtype, shape], ...], "buckets": [[start, stop], ...]}``: tensors ordered by
        dtype (first appearance), then by their order in ``state``; bucket ``b`` holds tensors
        ``start..stop-1``, all of one dtype, at most ``bucket_bytes`` bytes unless it is a single tensor.

    Raises:
        ValueError: ``bucket_bytes`` < 1.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: expected >= 1, got {bucket_bytes}")
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in state.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    tensors: list[list[Any]] = []
    buckets: list[list[int]] = []
    for dtype, names in by_dtype.items():
        size = 0
        for name in names:
            t = state[name]
            nbytes = t.numel() * t.element_size()
            if buckets and size and size + nbytes <= bucket_bytes and buckets[-1][1] == len(tensors):
                buckets[-1][1] += 1
                size += nbytes
            else:
                buckets.append([len(tensors), len(tensors) + 1])
                size = nbytes
            tensors.append([name, str(dtype).removeprefix("torch."), list(t.shape)])
    return {"tensors": tensors, "buckets": buckets}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensors: unknown dtype {name!r}")
    return dtype


def bucket_numel(meta: dict[str, Any], b: int) -> tuple[int, torch.dtype]:
    """Element count and dtype of bucket ``b``'s flat tensor."""
    start, stop = meta["buckets"][b]
    numel = sum(_numel(shape) for _, _, shape in meta["tensors"][start:stop])
    return numel, _dtype(meta["tensors"][start][1])


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def flatten_bucket(state: dict[str, torch.Tensor], meta: dict[str, Any], b: int, device: torch.device) -> torch.Tensor:
    """Bucket ``b`` of ``state`` as one contiguous 1-D tensor on ``device`` (tensors in metadata order)."""
    start, stop = meta["buckets"][b]
    parts = [state[name].detach().reshape(-1) for name, _, _ in meta["tensors"][start:stop]]
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
    return flat.to(device).contiguous()


def unflatten_bucket(flat: torch.Tensor, meta: dict[str, Any], b: int) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` (bucket ``b``) as ``(name, tensor)`` with the shapes of the metadata.

    Raises:
        ValueError: ``flat`` does not have the bucket's element count.
    """
    start, stop = meta["buckets"][b]
    numel, _ = bucket_numel(meta, b)
    if flat.numel() != numel:
        raise ValueError(f"bucket {b}: {flat.numel()} elements, metadata says {numel}")
    out, offset = [], 0
    for name, _, shape in meta["tensors"][start:stop]:
        n = _numel(shape)
        out.append((name, flat[offset : offset + n].view(shape)))
        offset += n
    return out


# ----------------------------------------------------------------------------- group


def resolve_backend(backend: str, device: str) -> str:
    """``auto`` -> ``nccl`` when ``device`` is cuda, else ``gloo``; other values unchanged."""
    if backend == "auto":
        return "nccl" if device.startswith("cuda") else "gloo"
    return backend


def new_group(store: torch.distributed.Store, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """A process-group backend (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) of ``world_size`` ranks on ``store``.

    Not registered with ``torch.distributed`` (no default group is created or touched), so it coexists with
    the trainer's FSDP group and vLLM's groups; use its own ``broadcast`` method. The gloo constructor blocks
    until every rank has joined (at most ``timeout_s``); NCCL connects at the first collective.
    """
    from torch.distributed import PrefixStore

    prefix = PrefixStore("asyncrl-weight-sync", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        return ProcessGroupGloo(prefix, rank, world_size, timeout)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(prefix, rank, world_size, opts)
    raise ValueError(f"backend: expected gloo or nccl, got {backend!r}")


def join_store(master_addr: str, master_port: int, world_size: int, timeout_s: float) -> torch.distributed.Store:
    """A client of the trainer's ``TCPStore`` (the vLLM side)."""
    from torch.distributed import TCPStore

    return TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def broadcast(group: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast ``tensor`` in place from group rank 0 (send on rank 0, receive elsewhere) and wait.

    Raises:
        RuntimeError: the collective failed or (gloo) did not finish within ``timeout_s``.
    """
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timedelta(seconds=timeout_s)
    group.broadcast([tensor], opts).wait()


def send(
    group: Any, state: dict[str, torch.Tensor], meta: dict[str, Any], device: torch.device, timeout_s: float
) -> None:
    """Broadcast every bucket of ``state`` (planned in ``meta``) from rank 0."""
    for b in range(len(meta["buckets"])):
        broadcast(group, flatten_bucket(state, meta, b, device), timeout_s)


# ----------------------------------------------------------------------------- trainer side


def inference_workers(extra_args: list[str]) -> int:
    """vLLM workers of one server: its ``--tensor-parallel-size`` / ``-tp`` among the extra args (default 1)."""
    for i, arg in enumerate(extra_args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if arg == flag and i + 1 < len(extra_args):
                return int(extra_args[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return 1


class WeightSender:
    """Trainer rank 0's end of the weight-sync group (see the module docstring).

    Args:
        run: the run directory (``weight_sync.json`` and ``weights/step_n`` are written there).
        cfg: ``spec.trainer.weight_sync``.
        device: the trainer's device (buckets are moved there before an NCCL broadcast).
        workers: vLLM workers that join (ranks 1..workers).
        join_timeout_s: how long the group may take to form (vLLM boot included).
        start_step: the step the trainer starts after (its resume step), written with the join info so the
            orchestrator of the same launch does not read a file left by an earlier trainer.
    """

    def __init__(
        self, run: RunDir, cfg: Any, device: torch.device, *, workers: int, join_timeout_s: float, start_step: int = 0
    ) -> None:
        from worker.weight_sync.store import master_store  # listens on master_addr only, not every interface

        self.run, self.cfg = run, cfg
        self.backend = resolve_backend(cfg.backend, device.type)
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        self.world_size = 1 + workers
        self.join_timeout_s = join_timeout_s
        self.group: Any = None
        self.failed: str | None = None
        """Why the group route was given up (then every version goes through the filesystem)."""
        self._store = master_store(cfg.master_addr, cfg.master_port, self.world_size, timeout_s=join_timeout_s)
        info = {
            "start_step": start_step,
            "master_addr": cfg.master_addr,
            "master_port": self._store.port,
            "world_size": self.world_size,
            "backend": self.backend,
        }
        tmp = run.root / f".{GROUP_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, run.root / GROUP_FILE)
        self._joined = threading.Event()
        self._thread = threading.Thread(target=self._join, name="weight-sync-join", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        try:
            self.group = new_group(self._store, 0, self.world_size, self.backend, self.join_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure means: filesystem route
            self.failed = f"forming the group failed: {e}"
        finally:
            self._joined.set()

    def usable(self) -> bool:
        """Wait (at most ``join_timeout_s``) for the group; False once the route has failed."""
        if not self._joined.wait(self.join_timeout_s):
            self._give_up(f"the vLLM workers did not join within {self.join_timeout_s:g}s")
        return self.failed is None and self.group is not None

    def _give_up(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            logger.warning("weight sync over the process group: %s; using the filesystem from now on", reason)

    def publish(self, state: dict[str, torch.Tensor], version: int, keep_versions: int) -> Path:
        """Publish ``state`` (full HF-named weights, tied ``lm_head`` left out) as policy ``version``.

        Over the group when it is usable, else (or after any failure) as ``weights/step_<version>/model.safetensors``.
        Returns the version folder.

        Raises:
            DiskFull: the filesystem is full (the version's folder is removed: no half-written version is left).
        """
        final = self.run.weight_dir(version)
        if not self.usable():
            path = write_version(self.run, version, state, None)
        else:
            meta = {"version": version, **plan_buckets(state, self.cfg.bucket_mb * 2**20)}
            path = write_version(self.run, version, None, meta)
            try:
                send(self.group, state, meta, self.device, self.cfg.timeout_s)
                ack = _wait_ack(final, self.cfg.timeout_s)
                if ack != LOADED:
                    raise RuntimeError(
                        f"version {version}: inference answered {ack or 'nothing'} within {self.cfg.timeout_s:g}s"
                    )
            except Exception as e:  # noqa: BLE001 - fall back, never lose a version
                self._give_up(str(e).splitlines()[0] if str(e) else type(e).__name__)
                with writing(f"policy version {version}", final / WEIGHTS_FILE, partial=final):
                    write_file(final / WEIGHTS_FILE, state)
        prune_versions(self.run, version, keep_versions)
        return path


def publish_weights(model: torch.nn.Module, run: RunDir, version: int, keep_versions: int) -> Path:
    """Publish policy ``version`` as ``weights/step_<version>/model.safetensors`` with STABLE written last.

    The filesystem route (``[trainer.weight_sync] kind = "filesystem"``). Versions older than the newest
    ``keep_versions`` are deleted. With FSDP2 every rank calls it (the weights are gathered) and rank 0 writes.

    Raises:
        DiskFull: the filesystem is full (no folder of the version is left, complete or temporary).
    """
    weights = weights_state_dict(model)
    if not is_main_rank():
        return run.weight_dir(version)
    final = write_version(run, version, weights, None)
    prune_versions(run, version, keep_versions)
    return final


def publish_adapter(peft_model: Any, run: RunDir, version: int, keep_versions: int) -> Path:
    """Publish policy ``version`` of a LoRA run (``[trainer.lora]``) as the adapter only:
    ``weights/step_<version>/{adapter_config.json, adapter_model.safetensors}`` (PEFT's ``save_pretrained`` format,
    ``worker/trainer/lora.py``), STABLE written last, the folder renamed into place; older versions pruned as in
    :func:`publish_weights`. One trainer rank (``RLSpec`` refuses LoRA on several); on a GPU it is still an FSDP2
    module, whose adapter tensors are gathered here.

    Raises:
        DiskFull: the filesystem is full (no folder of the version is left, complete or temporary).
    """
    from worker.trainer.lora import save_adapter

    def write(tmp: Path) -> None:
        save_adapter(peft_model, tmp)
        if os.environ.get(TEST_ADAPTER_TARGETS_VAR):
            _retarget_adapter(tmp, os.environ[TEST_ADAPTER_TARGETS_VAR])

    final = write_version(run, version, None, None, write=write)
    prune_versions(run, version, keep_versions)
    return final


TEST_ADAPTER_TARGETS_VAR = "ASYNCRL_TEST_ADAPTER_TARGETS"
"""Test only (case C14 for LoRA, ``tests/e2e/test_lora_run.py``): when set in the trainer's environment, every
published adapter targets the module named by its value instead of the trained ones (:func:`_retarget_adapter`), so
inference gets an adapter that binds to no module of the model. Never set it in a real run."""


def _retarget_adapter(folder: Path, module: str) -> None:
    """Rewrite the PEFT adapter in ``folder`` to target ``module`` only: ``adapter_config.json``'s ``target_modules``
    and the module name before ``.lora_A`` / ``.lora_B`` in every tensor name (vLLM 0.31 binds an adapter by its
    tensor names, not by ``target_modules``)."""
    from safetensors.torch import load_file, save_file

    from worker.policy.lora_adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    config["target_modules"] = [module]
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
    state = load_file(str(folder / ADAPTER_WEIGHTS))
    renamed = {re.sub(r"\.[^.]+(?=\.lora_[AB]\.)", f".{module}", name): t for name, t in state.items()}
    save_file(renamed, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def prune_versions(run: RunDir, version: int, keep_versions: int) -> None:
    """Delete the version folders older than the newest ``keep_versions`` (``version`` is the newest)."""
    for n, p in step_dirs(run.weights).items():
        if n <= version - keep_versions:
            shutil.rmtree(p, ignore_errors=True)


def write_file(path: Path, state: dict[str, torch.Tensor]) -> None:
    """``state`` as safetensors at ``path``, through a temporary name in the same folder (never half-written).

    Raises:
        DiskFull: the filesystem is full (the temporary file is removed).
    """
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(path.name, path, partial=tmp):
        save_file(state, str(tmp))
    os.replace(tmp, path)


def write_version(
    run: RunDir,
    version: int,
    state: dict[str, torch.Tensor] | None,
    meta: dict[str, Any] | None,
    *,
    write: Callable[[Path], None] | None = None,
) -> Path:
    """``weights/step_<version>`` with safetensors (``state``), ``group.json`` (``meta``) or what ``write(folder)``
    puts there (a LoRA adapter), STABLE last, renamed into place; a failed write removes the temporary folder.

    Raises:
        DiskFull: the filesystem is full.
    """
    final = run.weight_dir(version)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    with writing(f"policy version {version}", final, partial=tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if state is not None:
            write_file(tmp / WEIGHTS_FILE, state)
        if meta is not None:
            (tmp / META_FILE).write_text(json.dumps(meta))
        if write is not None:
            write(tmp)
        (tmp / STABLE_MARKER).write_text(str(version))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def _wait_ack(folder: Path, timeout_s: float, poll_s: float = 0.01) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ack in (LOADED, FAILED):
            if (folder / ack).exists():
                return ack
        time.sleep(poll_s)
    return None
