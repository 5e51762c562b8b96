"""Packed rows: samples laid out in one row with the attention mask that keeps them apart, and the forward
pass of such a row up to the final hidden states (the LM head is applied in ``worker/trainer/logprobs.py``).

``micro_batch_tensors`` builds a ``PackedTensors`` row (shared-prompt packing included); ``visible`` is the
one attention rule behind its dense SDPA mask and its flex attention block mask (with the sliding window of the
layers that have one: ``layer_windows``); ``forward_hidden`` runs the model on it, finding the output projection
through the model's own accessors, never by attribute name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def visible(
    q: torch.Tensor,
    k: torch.Tensor,
    seg: torch.Tensor,
    lead: torch.Tensor,
    shared: torch.Tensor,
    pos: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Whether row token ``q`` may attend to row token ``k`` in a packed row (broadcasts over index tensors).

    Causal, and inside the own sample, or onto the prompt tokens of the sample whose prompt ``q``
    reuses (shared-prompt packing). With a sliding ``window`` (and the row's ``pos``itions), also only
    onto keys less than ``window`` positions back, HF's rule (``kv > q - window``). The one rule behind
    both the dense SDPA mask and the flex attention block mask.
    """
    ok = (q >= k) & ((seg[q] == seg[k]) | ((lead[q] == seg[k]) & shared[k]))
    if window is not None and pos is not None:
        ok = ok & (pos[q] - pos[k] < window)
    return ok


class ArchitectureError(ValueError):
    """A model the trainer cannot train; the message is one line naming its architecture and what is missing."""


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config keys of transforms some causal LMs apply to the logits after the output projection (Gemma 2's
soft-capping, Cohere's scale, Granite's divisor). The trainer's fused LM head (``worker.trainer.logprobs``) computes
``hidden @ weight.T`` and nothing else, so a model with one of them set (not None, not 1) is refused."""


def architecture(model: torch.nn.Module) -> str:
    """The model's ``config.model_type`` (``llama``, ``gemma3_text``, ...), or its class name without a config."""
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", None) or type(model).__name__)


def output_embedding(model: torch.nn.Module) -> torch.nn.Module:
    """The model's output projection (``get_output_embeddings()``), checked to be what the fused LM head computes:
    a ``[vocab, hidden]`` weight, no bias, no transform of the logits after it (``LOGIT_TRANSFORMS``).

    Raises:
        ArchitectureError: one line naming the architecture and what does not fit.
    """
    arch = architecture(model)
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    weight = getattr(head, "weight", None)
    if head is None or weight is None or weight.dim() != 2:
        raise ArchitectureError(f"{arch}: get_output_embeddings() gives no [vocab, hidden] output projection")
    if getattr(head, "bias", None) is not None:
        raise ArchitectureError(
            f"{arch}: the output projection has a bias; the trainer's fused LM head computes hidden @ weight.T only"
        )
    config = getattr(model, "config", None)
    for key in LOGIT_TRANSFORMS:
        value = getattr(config, key, None)
        if value is not None and value != 1:
            raise ArchitectureError(
                f"{arch}: config.{key} = {value} transforms the logits after the output projection, which the "
                "trainer's fused LM head does not do"
            )
    return head


ATTENTION_TYPES = ("full_attention", "sliding_attention")
"""The attention layer types (``config.layer_types``) the packed mask knows: causal, and causal within
``config.sliding_window`` positions."""


def layer_windows(model: torch.nn.Module) -> dict[str, int | None]:
    """The sliding window of each attention layer type of ``model`` (None: full causal attention), from its config.

    A config with ``layer_types`` (Gemma 3, Qwen2/3) gets ``{layer type: window}``, the window
    ``config.sliding_window`` for ``sliding_attention`` layers; any other gets one entry ``{"": window}`` for every
    layer (``config.sliding_window`` of Mistral, Phi-3; None where absent), as the model builds its own masks.

    Raises:
        ArchitectureError: a layer type other than ``ATTENTION_TYPES`` (chunked, linear attention, ...).
    """
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        return {"": window}
    unknown = sorted(set(types) - set(ATTENTION_TYPES))
    if unknown:
        raise ArchitectureError(
            f"{architecture(model)}: attention layer types {unknown} (the packed attention mask knows "
            f"{', '.join(ATTENTION_TYPES)})"
        )
    return {t: window if t == "sliding_attention" else None for t in sorted(set(types))}


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
        """Dense ``[1, 1, T, T]`` bool mask (True = may attend) of full causal attention, on the row's device (SDPA)."""
        return self.dense_mask()

    def dense_mask(self, window: int | None = None) -> torch.Tensor:
        """Dense ``[1, 1, T, T]`` bool mask (True = may attend), within a sliding ``window`` if given, on the row's
        device (for SDPA)."""
        idx = torch.arange(self.seg.numel(), device=self.seg.device)
        pos = self.position_ids[0]
        return visible(idx[:, None], idx[None, :], self.seg, self.lead, self.shared, pos, window)[None, None]

    def block_mask(self, window: int | None = None) -> Any:
        """The same rule as a flex attention ``BlockMask`` (128-token blocks; fully masked blocks are skipped)."""
        from torch.nn.attention.flex_attention import create_block_mask

        seg, lead, shared, pos = self.seg, self.lead, self.shared, self.position_ids[0]

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # noqa: ARG001
            return visible(q, k, seg, lead, shared, pos, window)

        n = self.seg.numel()
        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=self.seg.device)

    def mask_for(self, attn_implementation: str, windows: dict[str, int | None] | None = None) -> Any:
        """The attention mask argument for the model's attention implementation (``sdpa``/``eager`` or
        ``flex_attention``) and its layers' sliding windows (``layer_windows``; None: all full).

        One mask when every layer has the same window; else ``{layer type: mask}``, the mapping HF models with
        ``config.layer_types`` (Gemma 3, Qwen2/3) take in place of building their own masks."""
        windows = windows or {"": None}
        build = self.block_mask if attn_implementation == "flex_attention" else self.dense_mask
        if len(set(windows.values())) == 1:
            return build(next(iter(windows.values())))
        return {layer_type: build(w) for layer_type, w in windows.items()}

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


def trainer_attention(model: PreTrainedModel) -> str:
    """The model's attention implementation; a ``flex_attention`` model is switched (in place, once) to ``FLEX_OR_CAUSAL``.

    ``worker.trainer.dist.prepare_model`` calls it, before the model's first forward pass, so that every forward pass
    of the trainer takes the same kernels. The served-policy check's base log-probs (``policy_check/step_0.json``,
    computed before the first step) once went through HF's own flex attention path instead (an unmasked probe
    sequence: HF's causal block mask, and flex attention's decoding kernel below 128 tokens, which torch 2.11 on an
    H100 cannot even lower for Qwen3-0.6B's 2 query heads per KV head: ``NoValidChoicesError``), every later version's
    through SDPA ``is_causal``; the 0.6B-shape loop failed its check at version 0 by 0.95 nats (issue 34).
    """
    impl = model.config._attn_implementation
    if impl == "flex_attention":
        from transformers import AttentionInterface

        AttentionInterface.register(FLEX_OR_CAUSAL, _flex_or_causal)
        model.config._attn_implementation = impl = FLEX_OR_CAUSAL
    return impl


def forward_hidden(model: PreTrainedModel, t: PackedTensors, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states of one packed row and the output embedding: ``(hidden [T, D], weight [vocab, D])``.

    The model runs without its output projection (``get_output_embeddings()``, swapped for an identity through
    ``set_output_embeddings`` during the call, so the ``[T, vocab]`` logits are never built;
    ``worker.trainer.logprobs.fused_logprob_entropy`` takes the head). ``worker.trainer.dist.output_embedding``
    refuses a model that transforms its logits after that projection (soft-capping, a scale).
    Both come in the compute dtype: bf16 under ``autocast`` (one CPU process) or FSDP2's bf16 policy,
    else the model's. Under FSDP2 ``weight`` is the root's unsharded parameter, which stays gathered
    from the forward to the backward pass (FSDP2 does not reshard the root after forward).

    Attention: a row holding ONE sample gets no mask, i.e. the model's own causal (and sliding-window) masks,
    SDPA with ``is_causal`` (cuDNN/flash kernels) for full attention, also for ``trainer.attention =
    "flex_attention"`` (see ``FLEX_OR_CAUSAL``); a row of several samples gets its packing mask (dense for ``sdpa``,
    a block mask for flex attention), one per attention layer type where their sliding windows differ
    (``layer_windows``). Both give the logits of each sample run alone.
    """
    impl = trainer_attention(model)
    flex = impl == FLEX_OR_CAUSAL
    single = len(t.spans) == 1  # its positions are 0..T-1: plain causal attention
    mask = None if single else t.mask_for("flex_attention" if flex else impl, layer_windows(model))
    # flex attention picks its decoding kernel (no backward) for rows under 128 tokens unless told otherwise
    extra = {"kernel_options": {"FORCE_USE_FLEX_ATTENTION": True}} if flex else {}
    head = output_embedding(model)
    model.set_output_embeddings(torch.nn.Identity())
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = model(input_ids=t.input_ids, position_ids=t.position_ids, attention_mask=mask, **extra).logits[0]
    finally:
        model.set_output_embeddings(head)
    dtype = torch.bfloat16 if autocast else hidden.dtype
    return hidden.to(dtype), cast(torch.Tensor, head.weight).to(dtype)


def packed_attention_mask(lengths: list[int]) -> torch.Tensor:
    """Block-diagonal causal mask ``[1, 1, T, T]`` (True = may attend) for samples packed in one row.

    With SDPA this keeps attention inside each sample, so a packed row gives the same logits as the
    samples run one by one (checked in ``tests/unit/worker/trainer/test_packed.py``).
    """
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [T]
    total = int(seg.numel())
    causal = torch.ones(total, total, dtype=torch.bool).tril_()
    return (causal & (seg[:, None] == seg[None, :]))[None, None]


def _shares_prompt(leader: Mapping[str, Any] | None, sample: Mapping[str, Any]) -> bool:
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


def micro_batch_tensors(samples: Sequence[Mapping[str, Any]]) -> PackedTensors:
    """Lay samples (``TrainSample`` dicts, or any with ``input_ids``/``loss_mask``) out in one row.

    A sample is laid out in full, except one that follows a sample of its group with the same
    ``prefix_len`` prompt (``worker.orchestrator.packing.pack_shared_prompt`` puts them next to each other): it
    contributes only its tokens after the prompt, which attend to the first sample's prompt tokens
    and causally to themselves, at their own positions. The logits of every sample are then those of
    the sample run alone (``tests/unit/worker/trainer/test_packed.py``); ``rows[i]`` says where they are.
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
    leader: Mapping[str, Any] | None = None
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
