"""What a worker machine can hold (cores, memory, GPUs), and whether a spec fits it.

A worker declares its capacity (``server/services/capacity.py`` stores it: the Celery worker on start, embedded mode
from the settings); the service checks each submitted spec against it (``check``), so a spec that would exhaust
the machine (a million trainer threads, 1024 trainer processes, a GPU it does not have) is refused at submit with
a one-line error naming the key, the value and the capacity. The static maxima of the spec (``worker/spec/``) hold
whatever the machine. Imports nothing heavy (no torch: GPUs are counted with ``nvidia-smi``).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from pydantic import BaseModel, ConfigDict, Field

from worker.spec import EvalSpec, RLSpec, SFTSpec, SpecError

ROLLOUT_TOKEN_BYTES = 256
"""Host memory one rollout token may take, all processes together (a rough upper bound): the token id, its
log-prob, mask and advantage as Python objects in the orchestrator and as text in ``batches/step_n.json``, and the
trainer's packed tensors. A step holds ``batch_size * group_size * max_model_len`` such tokens at most."""
MEMORY_SHARE = 0.5
"""Share of the declared memory one step's rollout tokens may take (the rest: model, optimizer, vLLM, the OS)."""


class Capacity(BaseModel):
    """A worker's declared capacity."""

    model_config = ConfigDict(frozen=True)

    cores: int = Field(ge=1)
    """CPU cores the worker may use (its affinity mask)."""
    memory_gib: float = Field(gt=0)
    """Host memory in GiB."""
    gpus: int = Field(ge=0)
    """CUDA devices (ids ``0 .. gpus - 1``)."""

    def __str__(self) -> str:
        return f"{self.cores} cores, {self.memory_gib:g} GiB, {self.gpus} GPUs"


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return round(pages * size / 2**30, 1)


def _gpus() -> int:
    """CUDA devices ``nvidia-smi -L`` lists (restricted by ``CUDA_VISIBLE_DEVICES`` when set), 0 without it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    found = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    if visible is not None:
        return min(found, len([d for d in visible.split(",") if d.strip()]))
    return found


def detect() -> Capacity:
    """This machine's capacity: cores of the process's affinity mask, ``MemTotal``, GPUs ``nvidia-smi`` lists."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return Capacity(cores=max(cores, 1), memory_gib=max(_memory_gib(), 0.1), gpus=_gpus())


def check(spec: RLSpec | SFTSpec | EvalSpec, cap: Capacity) -> None:
    """Refuse a spec whose local run would not fit ``cap``. A Slurm run's processes run on the cluster, not on the
    worker: only the static bounds of the spec apply to it.

    Raises:
        SpecError: ``trainer.threads: 64 exceeds the worker's capacity (2 cores, 7.7 GiB, 0 GPUs): at most 2``.
    """

    def refuse(key: str, value: object, what: str) -> SpecError:
        return SpecError(f"{key}: {value} exceeds the worker's capacity ({cap}): {what}")

    if spec.launcher.kind != "local":
        return
    limit = spec.launcher.memory_limit_gib
    if limit is not None and limit > cap.memory_gib:
        raise refuse("launcher.memory_limit_gib", f"{limit:g}", f"at most {cap.memory_gib:g}")
    if isinstance(spec, SFTSpec):
        if spec.threads > cap.cores:
            raise refuse("threads", spec.threads, f"at most {cap.cores}")
        return
    if not isinstance(spec, RLSpec):  # an eval job: one vLLM server of the model, sized by vLLM itself
        return
    if spec.trainer.threads > cap.cores:
        raise refuse("trainer.threads", spec.trainer.threads, f"at most {cap.cores}")
    local = spec.launcher.local
    if local.trainer_processes > cap.cores:
        raise refuse("launcher.local.trainer_processes", local.trainer_processes, f"at most {cap.cores}")
    for key, ids in (("inference_gpus", local.inference_gpus), ("trainer_gpus", local.trainer_gpus)):
        if ids and max(ids) >= cap.gpus:
            raise refuse(f"launcher.local.{key}", ids, f"device ids below {cap.gpus}")
    if spec.trainer.device == "cuda" and cap.gpus == 0:
        raise refuse("trainer.device", "'cuda'", "no GPU")
    inf = spec.inference
    if inf.enforce_eager is False and cap.gpus == 0 and inf.url is None and not inf.urls:
        raise refuse("inference.enforce_eager", "false", "CUDA graphs need a GPU; leave it unset or set it to true")
    orch = spec.orchestrator
    tokens = orch.batch_size * orch.group_size * spec.inference.max_model_len
    limit = int(cap.memory_gib * 2**30 * MEMORY_SHARE / ROLLOUT_TOKEN_BYTES)
    if tokens > limit:
        raise refuse(
            "orchestrator.batch_size",
            f"{orch.batch_size} (x group_size {orch.group_size} x inference.max_model_len "
            f"{spec.inference.max_model_len} = {tokens} rollout tokens per step)",
            f"at most {limit} tokens ({ROLLOUT_TOKEN_BYTES} bytes each in {MEMORY_SHARE:g} of the memory)",
        )


TRAINER_BYTES_PER_TRAINED_PARAM = 16
"""GPU bytes per trained parameter that the trainer holds at least: fp32 master weight (4), its gradient (4) and
AdamW's two moments (8); activations, the packed batch and the CUDA context come on top."""
TRAINER_BYTES_PER_FROZEN_PARAM = 4
"""GPU bytes per frozen parameter (a LoRA run's base weights, kept in fp32)."""


def check_trainer_memory(
    spec: RLSpec, *, params: int, trained_params: int, gpu_bytes: int, gpu_name: str = "the GPU"
) -> None:
    """Refuse a run whose trainer state cannot fit its share of one GPU, before anything is allocated.

    The state, at least ``16 B x trained + 4 B x frozen`` parameters (:data:`TRAINER_BYTES_PER_TRAINED_PARAM`), is
    split over the trainer's FSDP2 ranks; the share is ``trainer.gpu_memory_fraction``, else what vLLM leaves on a
    shared GPU (``1 - inference.gpu_memory_utilization``), else the whole GPU. ``params``: all parameters of the
    model; ``trained_params``: those the optimizer updates (all, or the LoRA adapters); ``gpu_bytes``: one GPU's total
    memory in bytes.

    Raises:
        SpecError: ``trainer.gpu_memory_fraction: the trainer needs at least 9.5 GiB ... but its share is ...``.
    """
    frozen = params - trained_params
    need = (TRAINER_BYTES_PER_TRAINED_PARAM * trained_params + TRAINER_BYTES_PER_FROZEN_PARAM * frozen) / max(
        spec.trainer_ranks, 1
    )
    share = spec.trainer.gpu_memory_fraction
    if share is None:
        share = 1 - spec.inference.gpu_memory_utilization if spec.colocated else 1.0
    have = share * gpu_bytes
    if need > have:
        gib = 2**30
        per_rank = f" over {spec.trainer_ranks} ranks" if spec.trainer_ranks > 1 else ""
        raise SpecError(
            f"trainer.gpu_memory_fraction: the trainer needs at least {need / gib:.1f} GiB per GPU ({params / 1e6:.0f}M "
            f"parameters, {trained_params / 1e6:.0f}M trained: {TRAINER_BYTES_PER_TRAINED_PARAM} B each for fp32 "
            f"weights, gradients and AdamW moments, {TRAINER_BYTES_PER_FROZEN_PARAM} B per frozen one{per_rank}) but "
            f"its share is {share:g} of {gpu_name}'s {gpu_bytes / gib:.1f} GiB = {have / gib:.1f} GiB"
        )
