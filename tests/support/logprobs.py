"""Sampled-token logprobs of vLLM against a transformers model (the parity checks of ``tests/e2e``)."""

from __future__ import annotations

import torch

from worker.inference.client import Completion

TOL = 1e-4  # fp32 on both sides
PROMPT = [1, 42, 71, 78, 78, 81, 13, 2, 1, 66, 70, 70]


def hf_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """Logprobs of ``completion`` tokens under log_softmax(logits / T) of a transformers model."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def max_diff(model: torch.nn.Module, prompt: list[int], completions: list[Completion], temperature: float) -> float:
    worst = 0.0
    for c in completions:
        ref = hf_logprobs(model, prompt, c.token_ids, temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)))
    return worst
