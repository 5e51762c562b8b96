"""``[trainer]`` and ``[ckpt]``: optimizer, scheduler, losses (a union on ``type``), weight sync, checkpoints."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from worker.policy.lora_adapters import DEFAULT_LORA_TARGETS
from worker.spec.strict import StrictModel, check_port
from worker.spec.user_code import CustomCode


class OptimConfig(StrictModel):
    lr: float = Field(default=1e-4, gt=0, le=1)
    """Peak learning rate; AdamW diverges long before 1, so a larger value is a typo (``1e-5`` written ``1e5``)."""
    weight_decay: float = Field(default=0.0, ge=0, le=1)
    """Decoupled weight decay; above 1 a step would more than erase the weights."""
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = Field(default=1.0, gt=0, le=1e6)
    """Gradient clipping norm; 1e6 is already "no clipping", larger values only hide a typo."""

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"expected two values in [0, 1), got {list(v)}")
        return v


class SchedulerConfig(StrictModel):
    type: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(default=0, ge=0, le=1_000_000)
    """Linear warmup steps; bounded like ``max_steps`` (a longer warmup never ends)."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of the decayed learning rate as a fraction of ``lr`` (at most 1: no decay)."""


MAX_RATIO = 1e6
"""Largest importance-ratio bound of a loss: ``exp(14) ~ 1.2e6``, past which float32 log-ratios carry no signal."""


class _LossBase(StrictModel):
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or one per sample (geometric mean over its loss tokens)."""


class DppoKlLoss(_LossBase):
    """DPPO trust-region mask by advantage sign plus a squared-log-ratio KL term (``worker/trainer/loss/dppo_kl.py``)."""

    type: Literal["dppo_kl"] = "dppo_kl"
    mask_low: float = Field(default=0.2, gt=0, le=1)
    """A token with negative advantage is masked once ``p_train - p_infer < -mask_low`` (a probability
    difference: at most 1, where nothing is ever masked)."""
    mask_high: float = Field(default=0.2, gt=0, le=1)
    """A token with positive advantage is masked once ``p_train - p_infer > mask_high`` (at most 1, as
    ``mask_low``)."""
    kl_tau: float = Field(default=1e-3, ge=0, le=100)
    """Weight of the KL term ``kl_tau * sum (log r)^2`` over every loss token (0 = off); above 100 the KL term
    drowns the policy gradient."""


class IpoLoss(_LossBase):
    """Symmetric probability-difference trust region (``worker/trainer/loss/ipo.py``)."""

    type: Literal["ipo"] = "ipo"
    epsilon: float = Field(default=0.2, gt=0, le=1)
    """A token is masked once ``abs(p_train - p_infer) > epsilon``, whatever its advantage's sign (a probability
    difference: at most 1)."""


class IcePopLoss(_LossBase):
    """Drop tokens whose train/infer probability ratio leaves a band (``worker/trainer/loss/icepop.py``)."""

    type: Literal["icepop"] = "icepop"
    band: tuple[float, float] = (0.5, 5.0)
    """``[low, high]`` with ``0 < low < 1 < high``: tokens with ratio ``pi_train / pi_infer`` outside are masked."""

    @field_validator("band", mode="wrap")
    @classmethod
    def _band(cls, v: Any, handler: Any) -> tuple[float, float]:
        band: tuple[float, float] = handler(v)
        shown = list(v) if isinstance(v, list | tuple) else list(band)  # as written: [1.5, 5], not [1.5, 5.0]
        if not 0 < band[0] < 1 < band[1]:
            raise ValueError(f"expected [low, high] with 0 < low < 1 < high, got {shown}")
        if band[1] > MAX_RATIO:
            raise ValueError(f"high must be at most {MAX_RATIO:g} (a ratio beyond it masks nothing), got {shown}")
        return band


class AipoLoss(_LossBase):
    """Policy gradient weighted by the truncated importance ratio (``worker/trainer/loss/aipo.py``)."""

    type: Literal["aipo"] = "aipo"
    max_ratio: float = Field(default=2.0, gt=1, le=MAX_RATIO)
    """Truncation of the importance weight ``min(r, max_ratio)`` (> 1, at most ``MAX_RATIO``); nothing is masked."""


class CustomLoss(CustomCode):
    """A loss function of your own: ``fn(inputs, **kwargs) -> LossOutputs`` (``worker/trainer/loss/__init__.py``)."""

    type: Literal["custom"] = "custom"


LossConfig = Annotated[DppoKlLoss | IpoLoss | IcePopLoss | AipoLoss | CustomLoss, Field(discriminator="type")]


class WeightSyncConfig(StrictModel):
    """How the trainer hands a new policy version to vLLM (``worker/weight_sync/``: publish.py, load.py).

    ``filesystem``: safetensors in ``weights/step_n`` loaded by path. ``process_group``: the weights are
    broadcast in buckets from trainer rank 0 to the vLLM workers over a separate process group (NCCL on
    cuda, gloo on cpu), no disk. ``cuda_ipc``: colocated on one GPU (trainer rank 0 and vLLM see the same
    device): vLLM reads each version from the trainer's GPU buffer through a CUDA IPC handle
    (``worker/weight_sync/cuda_ipc.py``); needs ``trainer.device = "cuda"``. Any failure of the last two falls
    back to the filesystem route with a logged warning.
    """

    kind: Literal["filesystem", "process_group", "cuda_ipc"] = "filesystem"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto``: nccl when the trainer runs on cuda, else gloo."""
    master_addr: str = Field(default="127.0.0.1", min_length=1)
    """Address of trainer rank 0 as the vLLM workers reach it (the group's TCP store listens there)."""
    master_port: int = Field(default=0, ge=0, le=65535)
    """Port of the group's TCP store, 1024-65535; 0 picks a free port."""
    bucket_mb: int = Field(default=256, ge=1, le=16384)
    """Upper bound of one broadcast bucket in MiB (tensors of one dtype flattened together; a larger tensor
    goes alone)."""
    timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    """Bound (at most a day: a longer wait is a hung run) on forming the group (after inference is up) and on one update, on both sides; past it the
    update falls back to the filesystem."""

    @field_validator("master_port")
    @classmethod
    def _port(cls, v: int) -> int:
        return check_port(v, free=True)


class LoraConfig(StrictModel):
    """LoRA RL (``[trainer.lora]``; absent = full fine-tune): the trainer trains PEFT low-rank adapters only
    (``W + (alpha / rank) * B @ A`` on each targeted linear layer, Hu et al. 2021, arXiv:2106.09685), checkpoints and
    publishes only the adapter, and vLLM serves the base model with the current adapter (``--enable-lora``)."""

    rank: int = Field(default=8, ge=1, le=512)
    """Rank ``r`` of each adapter's ``A [r, in]`` and ``B [out, r]`` (vLLM's ``--max-lora-rank`` is this rounded up
    to a value it takes; at most 512, the largest it serves)."""
    alpha: float = Field(default=16.0, gt=0, le=1e6)
    """Scale numerator: the update is ``(alpha / rank) * B @ A``; 1e6 is already a diverging scale."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training (``[0, 1)``). vLLM samples without it, so above 0 the trainer's
    log-probs of the sampled tokens are those of a randomly thinned adapter, not of the policy that sampled them: the
    importance ratio and ``mismatch_kl`` get that noise on top of the real mismatch. Keep 0 for RL (the default)."""
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    """Names (module-name suffixes, PEFT's matching) of the linear layers that get adapters; each must match a module
    of the model (checked at launch)."""

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if not v or not all(isinstance(m, str) and m.strip() for m in v):
            raise ValueError(f"expected a non-empty list of module names, e.g. ['q_proj', 'v_proj'], got {v}")
        return v


class TrainerConfig(StrictModel):
    optim: OptimConfig = Field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    loss: LossConfig = Field(default_factory=DppoKlLoss)
    threads: int = Field(default=1, ge=1, le=1024)
    """torch intra-op threads of the trainer process (CPU). At most 1024 here; at submit also at most the cores the
    worker declares (``worker/launchers/capacity.py``): more threads than cores only thrash."""
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
    slow_step_s: float = Field(default=0.0, ge=0, le=3600)
    """Testing aid: sleep this long after every step to make the trainer the bottleneck (at most an hour)."""
    gpu_memory_fraction: float | None = Field(default=None, gt=0, le=1)
    """Share of each trainer GPU's memory the trainer may allocate (``torch.cuda.set_per_process_memory_fraction``;
    None: no cap). With vLLM on the same GPU (colocated, ``worker.spec.runs.RLSpec.colocated``) it and
    ``inference.gpu_memory_utilization`` must add up to at most 1; a model whose trainer state does not fit the share
    is refused at launch with the numbers (``worker.launchers.capacity.check_trainer_memory``)."""
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """How new policy versions reach vLLM: safetensors on disk (default) or a process-group broadcast."""
    lora: LoraConfig | None = None
    """LoRA RL: train adapters only and ship only the adapter per policy version (None: full fine-tune)."""


class CheckpointConfig(StrictModel):
    interval: int = Field(default=0, ge=0, le=1_000_000)
    """Save trainer and orchestrator state every this many steps (0 = never); bounded like ``max_steps``."""
    keep: int = Field(default=2, ge=1, le=1000)
    """Complete checkpoints kept on disk (each a full copy of weights and optimizer: 1000 already fills disks)."""


MAX_HOLD_STEPS = 32
"""Most ``ckpt.hold_at`` steps of one run (a sweep's pruning steps are bounded the same)."""


class RLCheckpointConfig(CheckpointConfig):
    """An RL run's checkpoints: the periodic ones, and the steps it holds at."""

    hold_at: list[int] = Field(default_factory=list, max_length=MAX_HOLD_STEPS)
    """Steps at which the run checkpoints (whatever ``interval`` says) and then holds: trainer and orchestrator do no
    further step (the orchestrator runs its eval of that version first) until the run is stopped; resumed, it goes on
    to the next one or ``max_steps``. Each from 1 to ``max_steps - 1``, distinct; kept ascending. A sweep sets its
    pruning steps here (``server/services/sweeps.py``), so a trial stops exactly at a rung."""

    @field_validator("hold_at")
    @classmethod
    def _hold_at(cls, v: list[int]) -> list[int]:
        if any(s < 1 for s in v) or len(set(v)) != len(v):
            raise ValueError(f"expected distinct steps >= 1, got {v}")
        return sorted(v)
