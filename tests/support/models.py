"""Small random-init models for unit tests of the trainer (CPU, milliseconds)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def tiny_qwen3(seed: int = 0, tie: bool = True, attention: str = "sdpa") -> Qwen3ForCausalLM:
    """A 2-layer Qwen3 (vocab 300, hidden 64, 4 heads of 16, 2 KV heads) initialised from ``seed``, in eval mode
    (call ``.train()`` for dropout-free training: the config has no dropout); ``tie`` ties the LM head to the
    embeddings; ``attention`` is the ``attn_implementation`` (``sdpa``, ``eager``, ``flex_attention``)."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        attn_implementation=attention,
    )
    return Qwen3ForCausalLM(cfg).eval()
