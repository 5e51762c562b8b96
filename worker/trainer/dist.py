"""The trainer's distributed side: process group, FSDP2 sharding, mixed precision, MFU.

One code path for one CPU process, ``torchrun`` on CPU (gloo) and one or more GPUs (NCCL):

- ``setup(device)``: a single CPU process stays plain (no process group, bf16 through autocast).
  Under ``torchrun`` (``WORLD_SIZE`` > 1) or with ``trainer.device = "cuda"`` it joins a process
  group (gloo on CPU, NCCL on GPU; a lone process gets a one-rank group) and the model is sharded.
- ``prepare_model(model, ...)``: ``fully_shard`` on every decoder block (found through the model's own
  ``_no_split_modules``, never by attribute name: ``decoder_blocks``), then on the root, with a
  ``MixedPrecisionPolicy`` (bf16 params and compute when ``model.dtype`` is bfloat16, fp32 gradient
  reduction). The sharded fp32 parameters are the master weights the optimizer updates.
  FSDP2 averages gradients over ranks; each rank's loss is divided by the step's global loss-token
  count and multiplied by the world size (``loss_scale``), so the average is the batch's gradient.
- ``flops_per_step``/``peak_flops``: model FLOPs utilisation, see ``flops_per_step``.
- ``full_state_dict``/``weights_state_dict``: the full HF-named weights gathered from the shards on rank 0
  (what weight publishing and checkpoints write); ``is_main_rank``: the rank that writes files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from worker.trainer.packed import ArchitectureError, architecture, layer_windows, output_embedding, trainer_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}
"""Dense bf16 tensor-core peak in FLOP/s by a substring of ``torch.cuda.get_device_name``."""


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sharded: bool = False
    """True when the model is wrapped with FSDP2 (a process group exists)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def loss_scale(self) -> float:
        """Factor on each rank's loss that turns FSDP2's gradient average over ranks into the sum."""
        return float(self.world_size) if self.sharded else 1.0


def setup(device: str) -> DistInfo:
    """Join the trainer's process group when one is needed; returns this process's rank, world size, device.

    Args:
        device: the spec's ``trainer.device``, ``"cpu"`` or ``"cuda"``.

    Raises:
        RuntimeError: ``device`` is ``"cuda"`` and no CUDA GPU is visible.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "cpu" and world == 1:
        return DistInfo()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError('trainer.device: "cuda" but no CUDA GPU is visible; use "cpu"')
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if "MASTER_ADDR" in os.environ:  # torchrun (or the caller) set up the rendezvous
            dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None)
        else:  # a lone process: a one-rank group needs no rendezvous
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), device=dev, sharded=True)


def prepare_model(
    model: PreTrainedModel, info: DistInfo, *, bf16: bool, activation_checkpointing: bool, compile: bool = False
) -> torch.nn.Module:
    """Activation checkpointing and ``torch.compile`` per decoder block if asked, then FSDP2 when ``info.sharded``.

    In place (parameter names do not change); ``model`` must hold fp32 weights (the master copy) and pass
    :func:`check_trainable` (else ``ArchitectureError``, before anything changes). A
    ``flex_attention`` model is switched to the trainer's attention (``worker.trainer.packed.trainer_attention``) here,
    before its first forward pass. Returns the same module.
    """
    check_trainable(model)
    trainer_attention(model)  # the probe's base log-probs (before step 1) take the kernels of every later version's
    model.config.use_cache = False
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile:
        for block in decoder_blocks(model):
            block.compile()  # FSDP2's hooks stay outside the compiled graph (dynamo skips them)
    if not info.sharded:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.to(info.device)  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to; mypy misreads it
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    # one rank: keep each block's gathered bf16 weights from forward to backward (nothing to save by
    # freeing them, and the backward pass skips a second gather + cast); several ranks: reshard (memory)
    reshard = info.world_size > 1
    for block in decoder_blocks(model):
        fully_shard(block, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp)
    return model


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of an HF model: the outermost modules whose class its ``_no_split_modules`` names (HF's own
    list of the units that must stay whole on one device), in model order. They are the FSDP2 units, the activation
    checkpointing and ``compile`` units.

    Raises:
        ArchitectureError: the model names no such class, or none of its modules is one.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ArchitectureError(
            f"{architecture(model)}: the model class names no decoder block (_no_split_modules is empty); "
            "the trainer shards and checkpoints it block by block"
        )
    blocks: list[torch.nn.Module] = []
    prefixes: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ in names and not any(name.startswith(p) for p in prefixes):
            blocks.append(module)
            prefixes.append(name + ".")
    if not blocks:
        raise ArchitectureError(
            f"{architecture(model)}: no module is a {' or '.join(sorted(names))} (its _no_split_modules); "
            "the trainer shards and checkpoints it block by block"
        )
    return blocks


def check_trainable(model: torch.nn.Module) -> None:
    """Refuse a model the trainer cannot train, before any work: its decoder blocks, its output projection and its
    attention layer types (``worker.trainer.packed.layer_windows``) must all be found through the model's own
    accessors. Works on a model built on the meta device (no weights).

    Raises:
        ArchitectureError: one line naming the architecture and what is missing.
    """
    decoder_blocks(model)
    output_embedding(model)
    layer_windows(model)


def check_trainable_dir(model_dir: str | Path) -> None:
    """:func:`check_trainable` on the model of ``model_dir`` (a local folder or a hub name), built from its config on
    the meta device: no weights are read. What ``--dry-run`` runs.

    Raises:
        ArchitectureError: one line naming the architecture and what is missing.
        OSError / ValueError: the config does not load.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as err:  # no causal LM class for this config
        raise ArchitectureError(f"{config.model_type}: no causal LM class ({str(err).splitlines()[0]})") from None
    check_trainable(model)


def tied_output_keys(model: torch.nn.Module) -> set[str]:
    """State-dict names of the output projection's weight when it is the input embedding (``tie_word_embeddings``):
    the published weights leave them out (the loader re-ties them). Empty for untied models."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return set()
    head = output_embedding(model)
    return {f"{name}.weight" for name, m in model.named_modules(remove_duplicate=False) if m is head}


def all_ranks_max(value: int, info: DistInfo) -> int:
    """The largest ``value`` over all ranks (``value`` itself without a process group)."""
    if not info.sharded or info.world_size == 1:
        return value
    t = torch.tensor([value], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_ranks_sum(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Sum each named float over all ranks; a name missing on a rank counts 0 there."""
    if not info.sharded or info.world_size == 1:
        return dict(values)
    gathered: list[dict[str, float]] = [{} for _ in range(info.world_size)]
    dist.all_gather_object(gathered, values)
    out: dict[str, float] = {}
    for part in gathered:
        for name, v in part.items():
            out[name] = out.get(name, 0.0) + v
    return out


def grad_norm_value(norm: torch.Tensor) -> float:
    """``clip_grad_norm_``'s result as a float (a DTensor under FSDP2 holds the norm of all shards)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def flops_per_step(config: Any, n_params: int, tokens: int, attended_pairs: int) -> float:
    """Model FLOPs of one training step (forward + backward), the numerator of MFU.

    ``6 * N * tokens + 12 * L * H * d * attended_pairs``: ``N`` all parameters (a tied embedding
    counted once: it is the output projection), ``L`` layers, ``H`` query heads, ``d`` head dim, and
    ``attended_pairs`` the (query, key) pairs the packed mask allows, i.e. per token the
    attention term ``12 * L * H * d * seq`` with ``seq`` the keys the token attends to (``s/2`` on
    average in a causal sample of length ``s``). For one causal 16k sequence this is the
    convention of the published anchors (``6 N + 6 L H d s`` per token).
    """
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6.0 * n_params * tokens + 12.0 * layers * heads * head_dim * attended_pairs


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of one ``device`` from ``PEAK_BF16_FLOPS``; None on CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak allocated GPU memory of this process in GiB since the last reset; None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def broadcast_from_main(obj: object, info: DistInfo) -> object:
    """Rank 0's ``obj`` on every rank (picklable objects; ``obj`` itself without a process group)."""
    if not info.sharded or info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_main_rank() -> bool:
    """True in a single process and on rank 0 of a distributed trainer (the rank that writes files)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def full_state_dict(model: torch.nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The model's full HF-named state dict, on CPU (``cpu_offload``) or on the parameters' device; with FSDP2
    gathered from the shards (a collective).

    Every rank must call it; with ``cpu_offload`` ranks other than 0 of a sharded model get ``{}``, without it every
    rank gets the full tensors.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
    return cast(dict[str, torch.Tensor], state)  # full_state_dict=True: every value is a plain tensor


def weights_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named parameters, cloned and contiguous; a tied output projection (``tied_output_keys``) is left out (it is
    the embedding).

    A collective with FSDP2 (see ``full_state_dict``): ranks other than 0 get ``{}``.
    """
    state = full_state_dict(model)
    for key in tied_output_keys(model):
        state.pop(key, None)
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def on_disk_names(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (tensors under the model's in-memory names: :func:`weights_state_dict`) under the names and layout of
    its checkpoint files, what ``save_pretrained`` writes and vLLM loads. transformers fuses some weights at load
    (Qwen3-MoE's per-expert ``experts.<i>.{gate,up,down}_proj`` into 3-D ``experts.gate_up_proj`` /
    ``experts.down_proj``); its ``revert_weight_conversion`` splits them back. Models without such a conversion get
    ``state`` as it is. Weights published to vLLM must take this form: a fused name loads into nothing there."""
    from transformers.core_model_loading import revert_weight_conversion

    return cast(dict[str, torch.Tensor], revert_weight_conversion(cast("PreTrainedModel", model), state))


def weight_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """HF names and full shapes of the tensors :func:`iter_full_weights` yields, in its order (a tied output
    projection left out); a sharded parameter (FSDP2 ``DTensor``) reports its global shape."""
    tied = tied_output_keys(model)
    return {k: v.shape for k, v in model.state_dict().items() if k not in tied}


def iter_full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named tensors one at a time, each in full on the parameters' device, not cloned (read each before the
    next is asked for, and all before the next optimizer step); a tied output projection left out. With FSDP2 each
    sharded tensor is gathered as it is read (a collective: every rank must read them all, in order), so the peak is
    one full tensor, not the model. The colocated weight sync (``worker/weight_sync/cuda_ipc.py``) copies them into
    its GPU buffer without a trip through host memory.
    """
    from torch.distributed.tensor import DTensor

    tied = tied_output_keys(model)
    for name, t in model.state_dict().items():
        if name in tied:
            continue
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t).detach()
