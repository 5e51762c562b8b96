"""Trainer components shared by RL and SFT: packed tensors, optimizer, scheduler, weights, checkpoints."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from worker.checkpoint import prune, write_part
from worker.rundir import STABLE_MARKER, RunDir, step_dirs
from worker.spec import OptimConfig, SchedulerConfig

logger = logging.getLogger(__name__)


def visible(
    q: torch.Tensor, k: torch.Tensor, seg: torch.Tensor, lead: torch.Tensor, shared: torch.Tensor
) -> torch.Tensor:
    """Whether row token ``q`` may attend to row token ``k`` in a packed row (broadcasts over index tensors).

    Causal, and inside the own sample, or onto the prompt tokens of the sample whose prompt ``q``
    reuses (shared-prompt packing). The one rule behind both the dense SDPA mask and the flex
    attention block mask.
    """
    return (q >= k) & ((seg[q] == seg[k]) | ((lead[q] == seg[k]) & shared[k]))


@dataclass
class PackedTensors:
    input_ids: torch.Tensor  # [1, T] long
    position_ids: (
        torch.Tensor
    )  # [1, T] long, each sample's own positions (a shared-prompt follower starts at its prompt length)
    loss_mask: torch.Tensor  # [T] bool
    sampling_logprobs: torch.Tensor  # [T] float
    spans: list[tuple[int, int]]  # (start, length) of each sample's own tokens in the row
    rows: list[torch.Tensor]  # per sample, [L-1] long: the row whose logits predict the sample's tokens 1..L-1
    seg: torch.Tensor  # [T] long: sample index owning each row token
    lead: torch.Tensor  # [T] long: sample index whose prompt each row token may see
    shared: torch.Tensor  # [T] bool: row token is a prompt token other samples may see

    def to(self, device: torch.device | str) -> PackedTensors:
        """The same row with its tensors on ``device`` (``rows`` stay on CPU, index lists for ``sample_logits``)."""
        moved = {
            f: getattr(self, f).to(device)
            for f in ("input_ids", "position_ids", "loss_mask", "sampling_logprobs", "seg", "lead", "shared")
        }
        return PackedTensors(spans=self.spans, rows=self.rows, **moved)  # rows stay on CPU: see ``sample_logits``

    @staticmethod
    def sample_logits(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``logits[rows]`` for CPU ``rows`` (logits or hidden states ``[T, ...]``): a view when they are consecutive (no copy)."""
        n = rows.numel()
        if n and torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + n)):
            return logits[int(rows[0]) : int(rows[0]) + n]
        return logits[rows.to(logits.device)]

    @property
    def attention_mask(self) -> torch.Tensor:
        """Dense ``[1, 1, T, T]`` bool mask (True = may attend), built on the row's device (for SDPA)."""
        idx = torch.arange(self.seg.numel(), device=self.seg.device)
        return visible(idx[:, None], idx[None, :], self.seg, self.lead, self.shared)[None, None]

    def block_mask(self) -> Any:
        """The same rule as a flex attention ``BlockMask`` (128-token blocks; fully masked blocks are skipped)."""
        from torch.nn.attention.flex_attention import create_block_mask

        seg, lead, shared = self.seg, self.lead, self.shared

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # noqa: ARG001
            return visible(q, k, seg, lead, shared)

        n = self.seg.numel()
        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=self.seg.device)

    def mask_for(self, attn_implementation: str) -> Any:
        """The attention mask argument for the model's attention implementation (``sdpa``/``eager`` or ``flex_attention``)."""
        return self.block_mask() if attn_implementation == "flex_attention" else self.attention_mask

    @property
    def attended_pairs(self) -> int:
        """(query, key) pairs the mask allows: every token sees exactly its own position + 1 keys (MFU's attention term)."""
        return int((self.position_ids + 1).sum())


FLEX_OR_CAUSAL = "asyncrl_flex_or_causal"
"""Attention implementation the trainer gives a ``flex_attention`` model: flex attention for a block mask, SDPA
``is_causal`` (cuDNN/flash kernels) when the mask is None."""


def _flex_or_causal(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """HF attention function ``FLEX_OR_CAUSAL``: q ``[B, H, T, d]``, k/v ``[B, H_kv, T, d]`` -> ``([B, T, H, d], None)``.

    Chosen per call from the mask, so an activation-checkpointing recompute takes the same kernel.
    """
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None:
        kwargs.pop("kernel_options", None)
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _attention_for(model: torch.nn.Module) -> str:
    """The model's attention implementation; a ``flex_attention`` model is switched (in place, once) to ``FLEX_OR_CAUSAL``."""
    impl = model.config._attn_implementation
    if impl == "flex_attention":
        from transformers import AttentionInterface

        AttentionInterface.register(FLEX_OR_CAUSAL, _flex_or_causal)
        model.config._attn_implementation = impl = FLEX_OR_CAUSAL
    return impl


def forward_hidden(model: torch.nn.Module, t: PackedTensors, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states of one packed row and the output embedding: ``(hidden [T, D], weight [vocab, D])``.

    The model runs without its LM head (swapped for an identity during the call, so the ``[T, vocab]``
    logits are never built; ``worker.trainer.loss.common.fused_logprob_entropy`` takes the head).
    Both come in the compute dtype: bf16 under ``autocast`` (one CPU process) or FSDP2's bf16 policy,
    else the model's. Under FSDP2 ``weight`` is the root's unsharded parameter, which stays gathered
    from the forward to the backward pass (FSDP2 does not reshard the root after forward).

    Attention: a row holding ONE sample gets no mask, i.e. SDPA with ``is_causal`` (cuDNN/flash
    kernels), also for ``trainer.attention = "flex_attention"`` (see ``FLEX_OR_CAUSAL``); a row of
    several samples gets its packing mask (dense for ``sdpa``, a block mask for flex attention). Both
    give the logits of each sample run alone.
    """
    impl = _attention_for(model)
    flex = impl == FLEX_OR_CAUSAL
    single = len(t.spans) == 1  # its positions are 0..T-1: plain causal attention
    mask = None if single else t.mask_for("flex_attention" if flex else impl)
    # flex attention picks its decoding kernel (no backward) for rows under 128 tokens unless told otherwise
    extra = {"kernel_options": {"FORCE_USE_FLEX_ATTENTION": True}} if flex else {}
    head = model.lm_head
    model.lm_head = torch.nn.Identity()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = model(input_ids=t.input_ids, position_ids=t.position_ids, attention_mask=mask, **extra).logits[0]
    finally:
        model.lm_head = head
    dtype = torch.bfloat16 if autocast else hidden.dtype
    return hidden.to(dtype), head.weight.to(dtype)


def packed_attention_mask(lengths: list[int]) -> torch.Tensor:
    """Block-diagonal causal mask ``[1, 1, T, T]`` (True = may attend) for samples packed in one row.

    With SDPA this keeps attention inside each sample, so a packed row gives the same logits as the
    samples run one by one (checked in ``tests/unit/test_trainer_common.py``).
    """
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [T]
    total = int(seg.numel())
    causal = torch.ones(total, total, dtype=torch.bool).tril_()
    return (causal & (seg[:, None] == seg[None, :]))[None, None]


def _shares_prompt(leader: dict[str, Any] | None, sample: dict[str, Any]) -> bool:
    """Whether ``sample`` can reuse ``leader``'s prompt tokens: same group, same prompt, a non-empty rest."""
    p = sample.get("prefix_len", 0)
    return (
        leader is not None
        and 0 < p < len(sample["input_ids"])
        and sample.get("group") is not None
        and sample.get("group") == leader.get("group")
        and leader.get("prefix_len") == p
        and leader["input_ids"][:p] == sample["input_ids"][:p]
    )


def _tensor(values: list[Any], dtype: type) -> torch.Tensor:
    """A CPU tensor of a flat Python list, converted by numpy (``dtype`` a numpy scalar type)."""
    return torch.from_numpy(np.asarray(values, dtype=dtype))


def micro_batch_tensors(samples: list[dict[str, Any]]) -> PackedTensors:
    """Lay samples (``TrainSample`` dicts, or any with ``input_ids``/``loss_mask``) out in one row.

    A sample is laid out in full, except one that follows a sample of its group with the same
    ``prefix_len`` prompt (``worker.packing.pack_shared_prompt`` puts them next to each other): it
    contributes only its tokens after the prompt, which attend to the first sample's prompt tokens
    and causally to themselves, at their own positions. The logits of every sample are then those of
    the sample run alone (``tests/unit/test_trainer_common.py``); ``rows[i]`` says where they are.
    """
    ids: list[int] = []
    pos: list[int] = []
    seg: list[int] = []  # sample index owning each row token
    lead: list[int] = []  # sample index whose prompt each row token may see
    shared: list[bool] = []  # row token is a prompt token other samples may see
    lmask: list[bool] = []
    lps: list[float] = []
    spans: list[tuple[int, int]] = []
    rows: list[torch.Tensor] = []
    leader: dict[str, Any] | None = None
    leader_k = leader_start = 0
    for k, s in enumerate(samples):
        n, start = len(s["input_ids"]), len(ids)
        sample_lps = s.get("sampling_logprobs") or [0.0] * n
        if _shares_prompt(leader, s):
            p, owner = s["prefix_len"], leader_k
            # tokens 1..p are predicted by the leader's prompt rows, tokens p+1..n-1 by this sample's own rows
            rows.append(
                torch.cat([torch.arange(leader_start, leader_start + p), torch.arange(start, start + n - p - 1)])
            )
        else:
            leader, leader_k, leader_start = s, k, start
            p, owner = 0, k
            rows.append(torch.arange(start, start + n - 1))
        own_prefix = s.get("prefix_len", 0) if owner == k else 0
        # tokens p..n-1, whole slices at a time (a per-token loop cost ~25 ms per 16k-token row)
        ids.extend(s["input_ids"][p:n])
        pos.extend(range(p, n))
        seg.extend([k] * (n - p))
        lead.extend([owner] * (n - p))
        n_shared = max(0, min(own_prefix, n) - p)  # positions j < own_prefix
        shared.extend([True] * n_shared + [False] * (n - p - n_shared))
        lmask.extend(map(bool, s["loss_mask"][p:n]))
        lps.extend(sample_lps[p:n])
        spans.append((start, n - p))
    return PackedTensors(  # lists -> tensors through numpy: ~3x faster than torch.tensor on a 16k-long list
        input_ids=_tensor(ids, np.int64)[None],
        position_ids=_tensor(pos, np.int64)[None],
        loss_mask=_tensor(lmask, np.bool_),
        sampling_logprobs=_tensor(lps, np.float32),
        spans=spans,
        rows=rows,
        seg=_tensor(seg, np.int64),
        lead=_tensor(lead, np.int64),
        shared=_tensor(shared, np.bool_),
    )


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps``, then constant, linear or cosine decay to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.type == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        shape = 1 - progress if cfg.type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def is_main_rank() -> bool:
    """True in a single process and on rank 0 of a distributed trainer (the rank that writes files)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full HF-named state dict on CPU; with FSDP2 gathered from the shards (a collective).

    Every rank must call it; ranks other than 0 of a sharded model get ``{}``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def weights_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named parameters, cloned and contiguous; a tied ``lm_head.weight`` is left out (it is the embedding).

    A collective with FSDP2 (see ``full_state_dict``): ranks other than 0 get ``{}``.
    """
    state = full_state_dict(model)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def publish_weights(model: torch.nn.Module, run: RunDir, version: int, keep_versions: int) -> Path:
    """Publish policy ``version`` as ``weights/step_<version>/model.safetensors`` with STABLE written last.

    Versions older than the newest ``keep_versions`` are deleted. With FSDP2 every rank calls it (the
    weights are gathered) and rank 0 writes.
    """
    final = run.weight_dir(version)
    weights = weights_state_dict(model)
    if not is_main_rank():
        return final
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights, tmp / "model.safetensors")
    (tmp / STABLE_MARKER).write_text(str(version))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for n, path in step_dirs(run.weights).items():
        if n <= version - keep_versions:
            shutil.rmtree(path, ignore_errors=True)
    return final


def save_final(model: torch.nn.Module, base_name: str, out: Path) -> None:
    """``save_pretrained`` the model with the base model's tokenizer, so ``out`` loads by path.

    With FSDP2 every rank calls it (the weights are gathered) and rank 0 writes.
    """
    from transformers import AutoTokenizer

    state = full_state_dict(model)
    if not is_main_rank():
        return
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state)
    AutoTokenizer.from_pretrained(base_name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


class BackgroundCheckpointer:
    """Writes trainer checkpoint parts on a thread so training goes on while files are written.

    The state is copied on the calling thread (a consistent snapshot), then written by the thread.
    One save at a time: a new save first waits for the previous one. Optimizer state is stored by
    parameter name (``get_optimizer_state_dict``), so a checkpoint loads with any number of ranks;
    with FSDP2 every rank calls ``save`` (the state is gathered) and rank 0 writes.
    """

    def __init__(self, run: RunDir, keep: int) -> None:
        self.run, self.keep = run, keep
        self._thread: threading.Thread | None = None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self.wait()
        weights = weights_state_dict(model)
        opt_state = get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if not is_main_rank():
            return
        # optimizer state tensors are cloned so the next step cannot change them under the writer
        opt_state = {
            "state": {
                k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                for k, s in opt_state["state"].items()
            },
            "param_groups": opt_state["param_groups"],
        }
        meta = {"scheduler": scheduler.state_dict(), "rng": _rng_state(), "step": step}

        def write(folder: Path) -> None:
            save_file(weights, folder / "model.safetensors")
            torch.save({"optimizer": opt_state, **meta}, folder / "state.pt")
            (folder / "meta.json").write_text(json.dumps({"step": step}))

        def job() -> None:
            write_part(self.run, step, "trainer", write)
            prune(self.run, self.keep)
            logger.info("checkpoint step %d written", step)

        self._thread = threading.Thread(target=job, name=f"ckpt-{step}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def load_trainer_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
    """Load a trainer checkpoint part into model, optimizer, scheduler and RNGs; returns its step.

    Works on a plain and on an FSDP2-sharded model (every rank reads the files and keeps its shard).

    Raises:
        RuntimeError: the checkpoint's tensor names do not match the model.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    weights = load_file(folder / "model.safetensors")
    full = StateDictOptions(full_state_dict=True, strict=False)
    missing, unexpected = set_model_state_dict(model, weights, options=full)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"checkpoint {folder} does not match the model: missing {missing}, unexpected {unexpected}")
    state = torch.load(folder / "state.pt", weights_only=False)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=full)
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return int(state["step"])
