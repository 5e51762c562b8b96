"""The architectures ``asyncrl model init --arch`` builds: transformers' own config classes, random init, tiny shapes.

Each entry is one family a researcher brings (Llama 3.x, Qwen2.5, Qwen3, Qwen3-MoE, Gemma 3 text, Mistral, Phi-3,
OLMo 2) with the keys that make its shape that family's, and whether the family's small checkpoints tie the output
projection to the input embedding (``tie_word_embeddings``): qwen2, qwen3 and gemma3 tie, the others do not, so both
kinds go through every test of the matrix (``tests/unit/worker/test_architectures.py``). The sizes (``SIZES`` in
``worker/policy/models.py``) give hidden width, depth and heads; the family keys here are added on top.

Gemma 3 alternates sliding-window and full attention layers (its window is 32 positions in these shapes, shorter
than the test rows, so the window is exercised); Mistral's every layer slides (v0.1's layout, window 32); Qwen3-MoE
has 4 experts, 2 routed per token. No config here sets a logit soft-cap: the trainer refuses one
(``worker.trainer.packed.output_embedding``).

Only transformers' config classes are read (no hub access); importing this module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PretrainedConfig

SLIDING_WINDOW = 32
"""Sliding window (positions) of the sliding-attention layers of the tiny Gemma 3 and Mistral shapes."""


@dataclass(frozen=True)
class Architecture:
    config_class: str
    """The transformers config class (``AutoModelForCausalLM`` picks the model class from it)."""
    tied: bool
    """Whether the family's small checkpoints tie the output projection to the input embedding."""
    family: str
    """The checkpoints it stands for, for help texts."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Config keys of the family, on top of the size's shape (``{name}`` in a value is filled from the shape)."""


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("LlamaConfig", tied=False, family="Llama 3.x", extra={"rms_norm_eps": 1e-5}),
    "qwen2": Architecture("Qwen2Config", tied=True, family="Qwen2.5", extra={"rms_norm_eps": 1e-6}),
    "qwen3": Architecture("Qwen3Config", tied=True, family="Qwen3", extra={"rms_norm_eps": 1e-6}),
    "qwen3_moe": Architecture(
        "Qwen3MoeConfig",
        tied=False,
        family="Qwen3-MoE (4 experts, top-2)",
        extra={
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": "{half_intermediate}",
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rms_norm_eps": 1e-6,
        },
    ),
    "gemma3": Architecture(
        "Gemma3TextConfig",
        tied=True,
        family="Gemma 3 (text)",
        extra={
            "query_pre_attn_scalar": "{head_dim}",
            "sliding_window": SLIDING_WINDOW,
            "layer_types": "{alternating}",
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        },
    ),
    "mistral": Architecture(
        "MistralConfig", tied=False, family="Mistral", extra={"sliding_window": SLIDING_WINDOW, "rms_norm_eps": 1e-5}
    ),
    "phi3": Architecture("Phi3Config", tied=False, family="Phi-3", extra={"rms_norm_eps": 1e-5}),
    "olmo2": Architecture("Olmo2Config", tied=False, family="OLMo 2", extra={"rms_norm_eps": 1e-6}),
}
DEFAULT_ARCH = "qwen3"


def check_arch(arch: str) -> Architecture:
    """The entry of ``arch``.

    Raises:
        ValueError: one line naming the allowed values.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch: expected one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    return ARCHITECTURES[arch]


def build_config(
    arch: str,
    shape: dict[str, Any],
    *,
    vocab_size: int,
    eos_token_id: int,
    pad_token_id: int,
    tied: bool | None = None,
    max_position_embeddings: int = 1024,
) -> PretrainedConfig:
    """The transformers config of ``arch`` with ``shape``'s width, depth and heads (a ``SIZES`` entry), fp32.

    ``tied``: tie the output projection to the input embedding (None: the family's default). No BOS token (the chat
    template writes none), ``eos_token_id`` and ``pad_token_id`` from the tokenizer.

    Raises:
        ValueError: an unknown ``arch`` (:func:`check_arch`).
    """
    import torch
    import transformers

    entry = check_arch(arch)
    head_dim = shape.get("head_dim", 64)
    layers = shape["num_hidden_layers"]
    fill = {
        "head_dim": head_dim,
        "half_intermediate": shape["intermediate_size"] // 2,
        "alternating": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    }
    extra = {k: fill[v[1:-1]] if isinstance(v, str) and v.startswith("{") else v for k, v in entry.extra.items()}
    keys: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": shape["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "intermediate_size": shape["intermediate_size"],
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": entry.tied if tied is None else tied,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        **extra,
    }
    if arch != "phi3":  # Phi-3 derives the head width from hidden / heads
        keys["head_dim"] = head_dim
    keys.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    if arch == "phi3":
        keys["rope_parameters"] = {**keys["rope_parameters"], "partial_rotary_factor": 1.0}
    config = getattr(transformers, entry.config_class)(**keys)
    config.dtype = torch.float32
    return config
