"""``[launcher]``: where a run's processes run, on this machine's GPUs or as a Slurm job."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from worker.spec.strict import StrictModel, check_port

_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
"""A control character (newline, CR, NUL, tab, ...): never in a value written into a job script, even quoted."""
MAX_EXTRA_SBATCH = 64
"""Most ``launcher.slurm.extra_sbatch`` options."""
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,128}(,[A-Za-z0-9_.+-]{1,128}){0,63}$")
"""A Slurm partition, account or reservation name (a comma-separated list for partitions): written into an
``#SBATCH`` line of the job script, so a newline or a shell character must never reach it."""
MAX_MEMORY_GIB = 65_536
"""Largest ``launcher.memory_limit_gib`` (64 TiB): no worker has more; at submit it must also fit the worker."""
MAX_DEVICE_ID = 255
"""Largest CUDA device id of ``launcher.local`` (and trainer ranks <= 256): no machine has more GPUs; at submit the
ids must also be below the worker's declared GPU count (``worker/launchers/capacity.py``)."""


class SlurmConfig(StrictModel):
    partition: str | None = None
    account: str | None = None
    reservation: str | None = None
    time_limit: str | None = None
    """Slurm time format: ``minutes``, ``HH:MM:SS`` or ``D-HH:MM:SS``; None takes the partition's default."""
    nodes: int = Field(default=1, ge=1, le=1024)
    """Nodes of the job (at most 1024)."""
    gpus_per_node: int = Field(default=0, ge=0, le=64)
    """GPUs requested per node (at most 64: no node has more)."""
    inference_nodes: int = Field(default=0, ge=0, le=1023, validate_default=True)
    """With ``nodes > 1``: the first k nodes serve inference, the other ``nodes - k`` train (orchestrator on the first
    trainer node). The trainer's node count has no key of its own: it is always the rest, so no node is left idle
    (``trainer_nodes``, briefly a key that had to equal ``nodes - inference_nodes``, is refused as unknown).
    ``inference.replicas`` left unset is k: one vLLM server a node."""
    allocation: str | None = None
    """Run inside this existing job id (``srun --jobid=<id> --overlap``) instead of submitting a new job."""
    signal_before_end_s: int = Field(default=120, ge=0, le=86_400)
    """Seconds before the time limit at which the batch shell gets USR1: checkpoint now, then requeue (0 = off; at
    most a day)."""
    requeue: bool = True
    rdzv_port: int = Field(default=29500, ge=1, le=65535)
    """Port of the trainer's torchrun c10d rendezvous on the first trainer node (1024-65535)."""
    inference_port: int = Field(default=8000, ge=1, le=65535)
    """Port of the vLLM server on each inference node (multi-node layouts); with ``inference.replicas`` more than the
    inference nodes, a node's second server listens on ``inference_port + 1``, and so on (1024-65535)."""
    extra_sbatch: list[str] = Field(default_factory=list, max_length=MAX_EXTRA_SBATCH)
    """More ``#SBATCH`` options, each ``--name`` or ``--name=value`` (at most ``MAX_EXTRA_SBATCH``)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Variables exported in the job script (each value shell-quoted there; no control characters)."""

    @field_validator("partition", "account", "reservation")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _SLURM_NAME.match(v):
            raise ValueError(
                f"expected a Slurm name of letters, digits, '_', '.', '+', '-' (comma-separated), got {v!r}"
            )
        return v

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not _SLURM_TIME.match(v):
            raise ValueError(f"expected minutes, HH:MM:SS or D-HH:MM:SS, got {v!r}")
        return v

    @field_validator("allocation")
    @classmethod
    def _allocation(cls, v: str | None) -> str | None:
        if v is not None and not v.isdigit():
            raise ValueError(f"expected a Slurm job id (digits), got {v!r}")
        return v

    @field_validator("extra_sbatch")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        for opt in v:  # sbatch reads several options from one "#SBATCH" line: one entry, one option, no spaces
            if not opt.startswith("--") or re.search(r"[\s\x00-\x1f\x7f]", opt):
                raise ValueError(
                    f"expected one option per entry like '--constraint=a100' (no spaces or control characters), "
                    f"got {opt!r}"
                )
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _ENV_NAME.match(name):
                raise ValueError(f"expected variable names of letters, digits and '_', got {name!r}")
        for name, value in v.items():
            if _CONTROL.search(value):
                raise ValueError(
                    f"expected values without control characters (newline, CR, NUL, tab; each value is shell-quoted "
                    f"in the job script), got {name}={value!r}"
                )
        return v

    @field_validator("rdzv_port", "inference_port")
    @classmethod
    def _port(cls, v: int) -> int:
        return check_port(v, free=False)

    @field_validator("inference_nodes")
    @classmethod
    def _layout(cls, v: int, info: ValidationInfo) -> int:
        nodes = info.data.get("nodes", 1)
        if nodes == 1 and v:
            raise ValueError(f"a 1-node job runs every process on its node, so use 0, got {v}")
        if nodes > 1 and not 1 <= v < nodes:
            raise ValueError(f"must be between 1 and nodes - 1 ({nodes - 1}) with nodes = {nodes}, got {v}")
        return v


class LocalConfig(StrictModel):
    """Placement of a local run's processes on this machine's GPUs (``worker/launchers/local.py``).

    Each list becomes the process's ``CUDA_VISIBLE_DEVICES``; an empty list leaves the inherited one (every
    process sees every GPU, as on a one-GPU machine where vLLM and the trainer share the card). Lists may overlap
    (colocation); parallelism flags of vLLM over several inference GPUs go in ``inference.extra_args``.
    """

    inference_gpus: list[int] = Field(default_factory=list)
    """CUDA device ids of the vLLM server."""
    trainer_gpus: list[int] = Field(default_factory=list)
    """CUDA device ids of the trainer: with more than one, ``torchrun`` starts one FSDP2 rank per GPU."""
    trainer_processes: int = Field(default=0, ge=0, le=MAX_DEVICE_ID + 1)
    """Trainer ranks under ``torchrun`` (FSDP2; gloo on cpu). 0: one per ``trainer_gpus`` entry, else 1 (a plain
    process). At most 256 here; at submit also at most the worker's declared cores
    (``worker/launchers/capacity.py``)."""

    @field_validator("inference_gpus", "trainer_gpus")
    @classmethod
    def _device_ids(cls, v: list[int]) -> list[int]:
        if any(not 0 <= i <= MAX_DEVICE_ID for i in v) or len(set(v)) != len(v):
            raise ValueError(f"expected distinct CUDA device ids from 0 to {MAX_DEVICE_ID}, got {v}")
        return v


class LauncherConfig(StrictModel):
    kind: Literal["local", "slurm"] = "local"
    """Where the service runs the run's processes: on the worker's machine, or as a Slurm job."""
    local: LocalConfig = Field(default_factory=LocalConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    memory_limit_gib: float | None = Field(default=None, gt=0, le=MAX_MEMORY_GIB)
    """Host memory all processes of a service-launched local run may use together, in GiB (its cgroup's limit,
    ``worker/run/cgroups.py``): beyond it the kernel kills one of them and the run fails saying ``out of memory``. None:
    no limit of its own. At most 65536 here; at submit also at most the worker's declared memory
    (``worker/launchers/capacity.py``). Not enforced where the worker cannot make cgroups (a run event says so); not
    used by Slurm runs (use ``slurm.extra_sbatch = ["--mem=..."]``)."""


MULTI_NODE_KEYS = ("inference_nodes", "rdzv_port", "inference_port")
"""``launcher.slurm`` keys of an RL run's multi-node layout (``worker/launchers/slurm_layout.py``)."""
PLACEMENT_KEYS = ("inference_gpus", "trainer_gpus", "trainer_processes")
"""``launcher.local`` keys placing an RL run's vLLM server and trainer ranks."""


def _one_process(kind: str) -> str:
    return {"sft": "an SFT run", "eval": "an eval job"}.get(kind, f"a {kind} run")


def check_one_process_nodes(data: Any, kind: str) -> None:
    """The ``launcher.slurm.nodes`` rule of :func:`check_one_process_launcher` on the raw spec mapping ``data``,
    before the launcher's own fields are validated: ``nodes = 2`` alone would otherwise be refused for its missing
    ``inference_nodes`` (an RL layout rule), which sends the user the wrong way.

    Raises:
        ValueError: ``launcher.slurm.nodes`` is given and is not 1 (one line naming it).
    """
    slurm = (data.get("launcher") or {}).get("slurm") if isinstance(data, dict) else None
    nodes = slurm.get("nodes", 1) if isinstance(slurm, dict) else 1
    if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes != 1:
        raise ValueError(f"launcher.slurm.nodes: {_one_process(kind)} runs on one node, so use 1, got {nodes}")


def check_one_process_launcher(launcher: LauncherConfig, kind: str) -> None:
    """Refuse what a job of one process (``kind``: ``"sft"``, ``"eval"``) cannot use: several Slurm nodes or a key
    of the RL multi-node layout (:data:`MULTI_NODE_KEYS`) set to another value than its default, and
    ``launcher.local``'s GPU placement (:data:`PLACEMENT_KEYS`, not empty). An SFT run or an eval job runs on one node
    (the Slurm launcher's job script, the same as an RL run's) or as a local process; ``memory_limit_gib`` and every
    other ``launcher.slurm`` key apply to it.

    Raises:
        ValueError: one line naming the key and what is allowed.
    """
    what = _one_process(kind)
    slurm, local = launcher.slurm, launcher.local
    if slurm.nodes != 1:
        raise ValueError(f"launcher.slurm.nodes: {what} runs on one node, so use 1, got {slurm.nodes}")
    for key in MULTI_NODE_KEYS:
        if getattr(slurm, key) != SlurmConfig.model_fields[key].default:
            raise ValueError(
                f"launcher.slurm.{key}: a key of an RL run's multi-node layout; {what} runs on one node, so leave "
                f"it at {SlurmConfig.model_fields[key].default}, got {getattr(slurm, key)}"
            )
    for key in PLACEMENT_KEYS:
        if getattr(local, key):
            raise ValueError(
                f"launcher.local.{key}: places an RL run's vLLM and trainer processes; {what} is one process, so "
                f"leave it unset, got {getattr(local, key)}"
            )
