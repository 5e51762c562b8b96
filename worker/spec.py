"""Run-spec schema: the one description of an RL, SFT or eval run.

People write TOML (``asyncrl rl @ base.toml @ override.toml --trainer.optim.lr 1e-5``); the program
writes the resolved spec as JSON into the run directory and the service stores it in Postgres.

This module imports nothing heavy (no torch, vllm, fastapi): the server validates specs with it,
and ``tests/unit/test_spec.py`` checks that in a fresh interpreter.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from worker.alert_rules import AlertRule
from worker.dotted_keys import with_keys


class SpecError(ValueError):
    """A spec that cannot be used; the message is one line naming the field and what is allowed."""


class _Strict(BaseModel):
    # coerce_numbers_to_str: ``--name 123`` or ``--model.name 2024`` parse as TOML numbers; text fields take them as text
    # allow_inf_nan=False: `lr = inf` or `--trainer.optim.lr nan` is refused naming the key (JSON would store null)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True, allow_inf_nan=False)


# ----------------------------------------------------------------------------- model / env


class ModelConfig(_Strict):
    name: str = Field(min_length=1)
    """HF model id or local path (a directory written by ``save_pretrained``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and compute dtype of the trainer and of vLLM."""


class EnvConfig(_Strict):
    id: str = "reverse_text"
    """Built-in environment (``reverse_text``, ``arithmetic``) or ``package.module:function`` returning a Taskset."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment loader (e.g. ``num_train``, ``max_chars``)."""


# ----------------------------------------------------------------------------- inference


class InferenceConfig(_Strict):
    url: str | None = None
    """Use an already running vLLM server at this base URL instead of starting one."""
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    """0 picks a free port."""
    max_model_len: int = Field(512, ge=16)
    """vLLM context length in tokens."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    extra_args: list[str] = Field(default_factory=list)
    """Extra ``api_server`` flags, passed through unchanged."""
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(3, ge=0, le=20)
    """Retries of one request (exponential backoff) before the run fails."""
    startup_timeout_s: float = Field(300.0, gt=0)


# ----------------------------------------------------------------------------- orchestrator


class GrpoAdvantage(_Strict):
    """GRPO: reward minus the group mean, optionally over the group std (``worker/orchestrator/advantages/grpo.py``)."""

    type: Literal["grpo"] = "grpo"
    std_normalize: bool = False
    """Divide by the group's population reward std, floored at ``std_floor`` (off: Dr. GRPO's mean-only form)."""
    std_floor: float = Field(1e-2, gt=0)
    """Lower bound of the std divisor (> 0); bounds the inflation of near-uniform groups."""
    length_penalty: float = Field(0.0, ge=0)
    """Weight of the centred length term ``(L_i - mean L) / max L`` subtracted from each advantage (0 = off)."""


class MaxRLAdvantage(_Strict):
    """MaxRL: reward minus the group mean, over the group mean (``worker/orchestrator/advantages/maxrl.py``)."""

    type: Literal["maxrl"] = "maxrl"
    length_penalty: float = Field(0.0, ge=0)
    """Weight of the centred length term ``(L_i - mean L) / max L`` subtracted from each advantage (0 = off)."""


def _advantage_type(value: Any) -> str:
    """The ``type`` of an ``[orchestrator.advantage]`` table; a table without one is GRPO's (the default)."""
    if isinstance(value, dict):
        return str(value.get("type", "grpo"))
    return str(getattr(value, "type", "grpo"))


AdvantageConfig = Annotated[
    Annotated[GrpoAdvantage, Tag("grpo")] | Annotated[MaxRLAdvantage, Tag("maxrl")],
    Discriminator(_advantage_type),
]
"""``[orchestrator.advantage]``: one config class per advantage type, chosen by ``type`` (default ``grpo``)."""


class HarnessConfig(_Strict):
    """Rollouts of tasksets with tools, run through verifiers' agent harness (``worker.orchestrator.harness``)."""

    id: str = "null"
    """verifiers harness id (``null``: verifiers' chat program, a subprocess per rollout, needs ``uv``)."""
    tool_parser: str | None = "qwen3"
    """``renderers`` parser that reads tool calls from sampled token ids (``qwen3``: ``<tool_call>{json}</tool_call>``)."""
    max_concurrent: int = Field(8, ge=1)
    """Agent rollouts running at once (each may start a subprocess and tool servers)."""
    max_turns: int = Field(8, ge=1)
    """Model turns per rollout at most."""


class EvalConfig(_Strict):
    interval: int = Field(0, ge=0)
    """Run an online eval every this many steps (0 = only at the start and the end)."""
    num_examples: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of evals (0 = greedy)."""
    pass_k: int = Field(1, ge=1)
    """Samples per eval task; reports mean reward and pass@k (reward >= ``pass_threshold``)."""
    pass_threshold: float = Field(1.0, ge=0, le=1)


class OrchestratorConfig(_Strict):
    batch_size: int = Field(8, ge=1)
    """Tasks (groups) per step."""
    group_size: int = Field(8, ge=1)
    """Rollouts per task."""
    max_tokens: int = Field(64, ge=1)
    """Completion token budget per rollout."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer scales its logits by the same value."""
    seq_len: int = Field(2048, ge=8)
    """Micro-batch size in tokens: samples are packed into sequences of at most this length."""
    share_prompt: bool = True
    """Pack a group's samples next to each other so that the trainer lays their common prompt out once
    (same logits and gradients, fewer tokens: ``worker.packing.pack_shared_prompt``)."""
    max_async_level: int = Field(1, ge=0)
    """Rollouts for step n start once the inference policy version is >= n - 1 - max_async_level."""
    max_off_policy_steps: int = Field(8, ge=0)
    """A rollout whose generating policy version lags the trainer's (n - 1) by more than this is dropped."""
    advantage: AdvantageConfig = Field(default_factory=GrpoAdvantage)
    """How rollouts are scored against their group (``worker/orchestrator/advantages/``)."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    drop_zero_advantage: bool = True
    """Drop groups whose advantages are all zero (no learning signal)."""
    harness: HarnessConfig = Field(default_factory=HarnessConfig)


# ----------------------------------------------------------------------------- trainer


class OptimConfig(_Strict):
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = Field(1.0, gt=0)

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"expected two values in [0, 1), got {list(v)}")
        return v


class SchedulerConfig(_Strict):
    type: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class _LossBase(_Strict):
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or one per sample (geometric mean over its loss tokens)."""


class DppoKlLoss(_LossBase):
    """DPPO trust-region mask by advantage sign plus a squared-log-ratio KL term (``worker/trainer/loss/dppo_kl.py``)."""

    type: Literal["dppo_kl"] = "dppo_kl"
    mask_low: float = Field(0.2, gt=0)
    """A token with negative advantage is masked once ``p_train - p_infer < -mask_low``."""
    mask_high: float = Field(0.2, gt=0)
    """A token with positive advantage is masked once ``p_train - p_infer > mask_high``."""
    kl_tau: float = Field(1e-3, ge=0)
    """Weight of the KL term ``kl_tau * sum (log r)^2`` over every loss token (0 = off)."""


class IpoLoss(_LossBase):
    """Symmetric probability-difference trust region (``worker/trainer/loss/ipo.py``)."""

    type: Literal["ipo"] = "ipo"
    epsilon: float = Field(0.2, gt=0)
    """A token is masked once ``abs(p_train - p_infer) > epsilon``, whatever its advantage's sign."""


class IcePopLoss(_LossBase):
    """Drop tokens whose train/infer probability ratio leaves a band (``worker/trainer/loss/icepop.py``)."""

    type: Literal["icepop"] = "icepop"
    band: tuple[float, float] = (0.5, 5.0)
    """``[low, high]`` with ``0 < low < 1 < high``: tokens with ratio ``pi_train / pi_infer`` outside are masked."""

    @field_validator("band", mode="wrap")
    @classmethod
    def _band(cls, v: Any, handler: Any) -> tuple[float, float]:
        band: tuple[float, float] = handler(v)
        if not 0 < band[0] < 1 < band[1]:
            shown = list(v) if isinstance(v, list | tuple) else list(band)  # as written: [1.5, 5], not [1.5, 5.0]
            raise ValueError(f"expected [low, high] with 0 < low < 1 < high, got {shown}")
        return band


class AipoLoss(_LossBase):
    """Policy gradient weighted by the truncated importance ratio (``worker/trainer/loss/aipo.py``)."""

    type: Literal["aipo"] = "aipo"
    max_ratio: float = Field(2.0, gt=1)
    """Truncation of the importance weight ``min(r, max_ratio)`` (> 1); nothing is masked."""


LossConfig = Annotated[DppoKlLoss | IpoLoss | IcePopLoss | AipoLoss, Field(discriminator="type")]


class WeightSyncConfig(_Strict):
    """How the trainer hands a new policy version to vLLM (``worker/trainer/weight_sync.py``).

    ``filesystem``: safetensors in ``weights/step_n`` loaded by path. ``process_group``: the weights are
    broadcast in buckets from trainer rank 0 to the vLLM workers over a separate process group (NCCL on
    cuda, gloo on cpu), no disk; any failure falls back to the filesystem route with a logged warning.
    """

    kind: Literal["filesystem", "process_group"] = "filesystem"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto``: nccl when the trainer runs on cuda, else gloo."""
    master_addr: str = Field("127.0.0.1", min_length=1)
    """Address of trainer rank 0 as the vLLM workers reach it (the group's TCP store listens there)."""
    master_port: int = Field(0, ge=0, le=65535)
    """Port of the group's TCP store; 0 picks a free port."""
    bucket_mb: int = Field(256, ge=1, le=16384)
    """Upper bound of one broadcast bucket in MiB (tensors of one dtype flattened together; a larger tensor
    goes alone)."""
    timeout_s: float = Field(120.0, gt=0)
    """Bound on forming the group (after inference is up) and on one update, on both sides; past it the
    update falls back to the filesystem."""


class TrainerConfig(_Strict):
    optim: OptimConfig = Field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    loss: LossConfig = Field(default_factory=DppoKlLoss)
    threads: int = Field(1, ge=1)
    """torch intra-op threads of the trainer process (CPU)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer computes. ``cuda``: FSDP2 over the GPUs ``torchrun`` starts one process each for
    (one GPU without torchrun); ``cpu``: one plain process, or FSDP2 over gloo under ``torchrun``."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass (less memory, ~1/3 more compute)."""
    attention: Literal["sdpa", "flex_attention"] = "sdpa"
    """Attention kernel of the trainer: SDPA with a dense packed mask, or flex attention with a block mask
    that skips the blocks across sample boundaries (compiled; GPU)."""
    compile: bool = False
    """``torch.compile`` each decoder block (fuses the elementwise kernels around the matmuls; GPU)."""
    slow_step_s: float = Field(0.0, ge=0)
    """Testing aid: sleep this long after every step to make the trainer the bottleneck."""
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """How new policy versions reach vLLM: safetensors on disk (default) or a process-group broadcast."""


class CheckpointConfig(_Strict):
    interval: int = Field(0, ge=0)
    """Save trainer and orchestrator state every this many steps (0 = never)."""
    keep: int = Field(2, ge=1)
    """Complete checkpoints kept on disk."""


# ----------------------------------------------------------------------------- launcher


_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SlurmConfig(_Strict):
    partition: str | None = None
    account: str | None = None
    reservation: str | None = None
    time_limit: str | None = None
    """Slurm time format: ``minutes``, ``HH:MM:SS`` or ``D-HH:MM:SS``; None takes the partition's default."""
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    inference_nodes: int = Field(0, ge=0)
    """With ``nodes > 1``: the first k nodes serve inference, the rest train (orchestrator on the first trainer node)."""
    allocation: str | None = None
    """Run inside this existing job id (``srun --jobid=<id> --overlap``) instead of submitting a new job."""
    signal_before_end_s: int = Field(120, ge=0)
    """Seconds before the time limit at which the batch shell gets USR1: checkpoint now, then requeue (0 = off)."""
    requeue: bool = True
    rdzv_port: int = Field(29500, ge=1, le=65535)
    """Port of the trainer's torchrun c10d rendezvous on the first trainer node."""
    inference_port: int = Field(8000, ge=1, le=65535)
    """Port of the vLLM server on the first inference node (multi-node layouts)."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """More ``#SBATCH`` options, each ``--name`` or ``--name=value``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Variables exported in the job script."""

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
        for opt in v:
            if not opt.startswith("--") or "\n" in opt:
                raise ValueError(f"expected options like '--constraint=a100' (one line each), got {opt!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _ENV_NAME.match(name):
                raise ValueError(f"expected variable names of letters, digits and '_', got {name!r}")
        return v

    @field_validator("inference_nodes")
    @classmethod
    def _layout(cls, v: int, info: ValidationInfo) -> int:
        nodes = info.data.get("nodes", 1)
        if nodes == 1 and v:
            raise ValueError(f"a 1-node job runs every process on its node, so use 0, got {v}")
        if nodes > 1 and not 1 <= v < nodes:
            raise ValueError(f"must be between 1 and nodes - 1 ({nodes - 1}) with nodes = {nodes}, got {v}")
        return v


class LocalConfig(_Strict):
    """Placement of a local run's processes on this machine's GPUs (``worker/launchers/local.py``).

    Each list becomes the process's ``CUDA_VISIBLE_DEVICES``; an empty list leaves the inherited one (every
    process sees every GPU, as on a one-GPU machine where vLLM and the trainer share the card). Lists may overlap
    (colocation); parallelism flags of vLLM over several inference GPUs go in ``inference.extra_args``.
    """

    inference_gpus: list[int] = Field(default_factory=list)
    """CUDA device ids of the vLLM server."""
    trainer_gpus: list[int] = Field(default_factory=list)
    """CUDA device ids of the trainer: with more than one, ``torchrun`` starts one FSDP2 rank per GPU."""
    trainer_processes: int = Field(0, ge=0, le=1024)
    """Trainer ranks under ``torchrun`` (FSDP2; gloo on cpu). 0: one per ``trainer_gpus`` entry, else 1 (a plain
    process)."""

    @field_validator("inference_gpus", "trainer_gpus")
    @classmethod
    def _device_ids(cls, v: list[int]) -> list[int]:
        if any(i < 0 for i in v) or len(set(v)) != len(v):
            raise ValueError(f"expected distinct CUDA device ids >= 0, got {v}")
        return v


class LauncherConfig(_Strict):
    kind: Literal["local", "slurm"] = "local"
    """Where the service runs the run's processes: on the worker's machine, or as a Slurm job."""
    local: LocalConfig = Field(default_factory=LocalConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)


# ----------------------------------------------------------------------------- runs


RUN_NAME_RULE = "1-100 characters: letters, digits, '-', '_' or '.', not starting with '.' (it names a directory)"


def _check_run_name(cls: type, v: str) -> str:  # noqa: ARG001 - pydantic passes the class by this name
    """Run names become directory names: 1-100 ASCII letters, digits, '-', '_', '.' (not leading)."""
    ok = 0 < len(v) <= 100 and not v.startswith(".") and all(c.isascii() and (c.isalnum() or c in "-_.") for c in v)
    if not ok:
        raise ValueError(f"expected {RUN_NAME_RULE}, got {v!r}")
    return v


class RLSpec(_Strict):
    kind: Literal["rl"] = "rl"
    name: str = "rl"
    output_dir: str = "outputs"
    """Run directories are created below this folder, as ``<output_dir>/<name>``."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds data order, torch and vLLM (which seeds numpy with it: 0 <= seed < 2**32)."""
    max_steps: int = Field(100, ge=1)
    model: ModelConfig
    env: EnvConfig = Field(default_factory=EnvConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    alerts: list[AlertRule] = Field(default_factory=list)
    """Alert rules of this run (``worker/alert_rules.py``); the service adds them to its rules at submission."""

    _name = field_validator("name")(_check_run_name)

    @model_validator(mode="after")
    def _cross_checks(self) -> RLSpec:
        adv, orch = self.orchestrator.advantage, self.orchestrator
        if adv.type == "grpo" and orch.group_size < 2:
            raise ValueError(
                f"orchestrator.group_size: GRPO needs at least 2 rollouts per group, got {orch.group_size}"
            )
        if orch.max_tokens >= self.inference.max_model_len:
            raise ValueError(
                f"orchestrator.max_tokens: must be below inference.max_model_len ({self.inference.max_model_len}), "
                f"got {orch.max_tokens}"
            )
        local = self.launcher.local
        if local.trainer_gpus and self.trainer.device != "cuda":
            raise ValueError("launcher.local.trainer_gpus: needs trainer.device = 'cuda'")
        if local.trainer_gpus and local.trainer_processes not in (0, len(local.trainer_gpus)):
            raise ValueError(
                f"launcher.local.trainer_processes: one rank per trainer GPU ({len(local.trainer_gpus)}) or 0, "
                f"got {local.trainer_processes}"
            )
        return self

    @property
    def trainer_ranks(self) -> int:
        """Trainer processes a local launch starts (``launcher.local``): 1 means a plain process, no torchrun."""
        local = self.launcher.local
        return local.trainer_processes or max(len(local.trainer_gpus), 1)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


class SFTDataConfig(_Strict):
    num_examples: int = Field(4096, ge=1)
    """Generated prompt/completion pairs (from the environment's train split)."""
    batch_size: int = Field(32, ge=1)
    """Samples per optimizer step."""


class SFTSpec(_Strict):
    kind: Literal["sft"] = "sft"
    name: str = "sft"
    output_dir: str = "outputs"
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds data order, torch and vLLM (which seeds numpy with it: 0 <= seed < 2**32)."""
    max_steps: int = Field(200, ge=1)
    model: ModelConfig
    env: EnvConfig = Field(default_factory=EnvConfig)
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    seq_len: int = Field(2048, ge=8)
    """Packed sequence length in tokens."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3))
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    threads: int = Field(2, ge=1)
    eval_interval: int = Field(0, ge=0)
    """Greedy held-out eval every this many steps (0 = at the end only)."""
    eval_examples: int = Field(64, ge=1)
    alerts: list[AlertRule] = Field(default_factory=list)
    """Alert rules of this run (``worker/alert_rules.py``)."""

    _name = field_validator("name")(_check_run_name)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


SPEC_TYPES: dict[str, type[_Strict]] = {"rl": RLSpec, "sft": SFTSpec}


# ----------------------------------------------------------------------------- loading


def _closest_key(model: type[BaseModel], key: str) -> str | None:
    matches = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.5)
    return matches[0] if matches else None


def _submodel(annotation: Any, value: Any) -> type[BaseModel] | None:
    """The pydantic model class a field holds, resolving the loss union by its ``type``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = getattr(annotation, "__args__", ()) or ()
    for arg in args:
        inner = _submodel(arg, value)
        if inner is None:
            continue
        type_field = inner.model_fields.get("type")
        if (
            type_field is None
            or not isinstance(value, dict)
            or value.get("type", type_field.default) == type_field.default
        ):
            return inner
    return None


def check_unknown_keys(model: type[BaseModel], data: dict[str, Any], prefix: str = "") -> None:
    """Reject keys the schema does not know, naming the dotted key and the closest valid one.

    Raises:
        SpecError: ``unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)``.
    """
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in model.model_fields:
            hint = _closest_key(model, key)
            valid = ", ".join(sorted(model.model_fields))
            suggestion = f"did you mean '{prefix}{hint}'?" if hint else f"valid keys here: {valid}"
            raise SpecError(f"unknown key '{dotted}' ({suggestion})")
        inner = _submodel(model.model_fields[key].annotation, value)
        if inner is not None and isinstance(value, dict):
            check_unknown_keys(inner, value, prefix=f"{dotted}.")


_VARIANT_TAGS = frozenset(
    str(cls.model_fields["type"].default)
    for cls in (DppoKlLoss, IpoLoss, IcePopLoss, AipoLoss, GrpoAdvantage, MaxRLAdvantage)
)
"""The ``type`` tags of the loss and advantage unions: pydantic puts them in an error's location; messages drop them."""


def _format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and p in _VARIANT_TAGS))
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "union_tag_invalid":
        ctx = first.get("ctx", {})
        field = str(ctx.get("discriminator", "type")).strip("'")
        field = field if field.isidentifier() else "type"  # a callable discriminator (advantages) reads `type`
        return f"{loc}.{field}: expected one of {ctx.get('expected_tags')}, got {ctx.get('tag')!r}"
    given = first.get("input")
    if first["type"] != "missing" and "got " not in msg and not isinstance(given, dict | list):
        msg = f"{msg}, got {given!r}"  # the value as written, e.g. "max_steps: ... greater than or equal to 1, got -1"
    return f"{loc}: {msg}" if loc else msg


def validate_spec(kind: str, data: dict[str, Any]) -> RLSpec | SFTSpec:
    """Validate a raw mapping into a spec of ``kind`` (``rl`` or ``sft``).

    Raises:
        SpecError: one line naming the field and what is allowed.
    """
    if kind not in SPEC_TYPES:
        raise SpecError(f"kind: expected one of {sorted(SPEC_TYPES)}, got {kind!r}")
    model = SPEC_TYPES[kind]
    data = dict(data)
    data.setdefault("kind", kind)
    if data["kind"] != kind:
        raise SpecError(f"kind: this command runs '{kind}' specs, got {data['kind']!r}")
    check_unknown_keys(model, data)
    try:
        return model.model_validate(data)  # type: ignore[return-value]
    except ValidationError as err:
        raise SpecError(_format_validation_error(err)) from None


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Merge ``override`` into a copy of ``base``; nested tables merge, other values are replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override_value(text: str) -> Any:
    """A CLI value as a TOML literal (``1e-5``, ``true``, ``[0.5, 5]``), else as a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_spec_data(files: list[str | Path], overrides: list[tuple[str, str]]) -> dict[str, Any]:
    """Read TOML/JSON files (later files win) and apply ``--dotted.key value`` overrides.

    Raises:
        SpecError: a file that is missing, a directory, unreadable, not UTF-8, does not parse (the message
            gives line and column) or is not a table; an override key with an empty part (``--a..b``).
    """
    import json

    data: dict[str, Any] = {}
    for f in files:
        path = Path(f)
        fmt = "JSON" if path.suffix == ".json" else "TOML"
        if path.is_dir():
            raise SpecError(f"config file {path} is a directory; expected a {fmt} file")
        if not path.is_file():
            raise SpecError(f"config file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
            layer = json.loads(text) if fmt == "JSON" else tomllib.loads(text)
        except OSError as err:
            raise SpecError(f"config file {path}: cannot read ({err.strerror or type(err).__name__})") from None
        except UnicodeDecodeError as err:
            raise SpecError(f"{path}: not valid {fmt}: not UTF-8 text (byte {err.start})") from None
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
            raise SpecError(f"{path}: not valid {fmt}: {err}") from None
        if not isinstance(layer, dict):
            raise SpecError(f"{path}: expected a JSON object of spec keys, got {type(layer).__name__}")
        data = deep_merge(data, layer)
    for dotted, raw in overrides:
        if not all(dotted.split(".")):
            raise SpecError(f"--{dotted}: expected a dotted key such as --trainer.optim.lr")
        data = deep_merge(data, with_keys({}, {dotted: parse_override_value(raw)}))
    return data
