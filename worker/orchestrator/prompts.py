"""Prompt token ids: an environment's opening messages through the model's chat template."""

from __future__ import annotations

from typing import Any


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Chat-templated prompt token ids with the assistant turn opened (``add_generation_prompt``)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)
