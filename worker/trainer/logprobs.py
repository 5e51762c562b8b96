"""Log-probability and entropy kernels of the trainer: from logits, or straight from hidden states.

- ``selective_log_softmax``/``entropy_from_logits``: per-row log-probability of a target token and
  entropy, from materialised ``[seq, vocab]`` logits, chunked (SFT and references).
- ``fused_logprob_entropy``: the same two quantities from the final hidden states and the output
  embedding, applying the LM head chunk by chunk so the ``[N, vocab]`` logits never exist, with a
  recomputing backward pass (the RL trainer's path, after ``worker.trainer.packed.forward_hidden``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def selective_log_softmax(logits: Tensor, targets: Tensor, chunk_size: int = 1024) -> Tensor:
    """Log-probability of each target token: ``log_softmax(logits)[t, targets[t]]``.

    Memory-light: never materialises the full ``[seq, vocab]`` log-softmax; works on ``chunk_size``
    rows at a time (gather the target logit, subtract the row's logsumexp). bf16/fp16 logits are
    upcast to float32 per chunk, where the logsumexp is accurate.

    Args:
        logits: ``[seq, vocab]`` float, already divided by the sampling temperature.
        targets: ``[seq]`` int64 token ids.
        chunk_size: rows per chunk.

    Returns:
        ``[seq]`` float32 (float64 for float64 logits) log-probabilities, differentiable in ``logits``.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [seq, vocab] and targets [seq], got {list(logits.shape)} and {list(targets.shape)}"
        )
    out = []
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start : start + chunk_size]  # [chunk, vocab]
        if chunk.dtype not in (torch.float32, torch.float64):
            chunk = chunk.float()
        picked = chunk.gather(-1, targets[start : start + chunk_size].unsqueeze(-1)).squeeze(-1)  # [chunk]
        out.append(picked - torch.logsumexp(chunk, dim=-1))  # [chunk]
    if not out:
        return logits.new_zeros(0, dtype=torch.float32)
    return torch.cat(out)


@torch.no_grad()
def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy of each row's categorical distribution, ``H = logsumexp(z) - sum softmax(z) * z``.

    A metric: computed without gradient, ``chunk_size`` rows at a time, in float32.

    Args:
        logits: ``[seq, vocab]`` float, already divided by the sampling temperature.
        chunk_size: rows per chunk.

    Returns:
        ``[seq]`` float32 entropies in nats (0 for a one-hot row, log(vocab) for a uniform one).
    """
    out = []
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start : start + chunk_size].float()  # [chunk, vocab]
        lse = torch.logsumexp(chunk, dim=-1)  # [chunk]
        probs = torch.exp(chunk - lse.unsqueeze(-1))  # [chunk, vocab]
        out.append(lse - (probs * chunk).sum(-1))
    if not out:
        return logits.new_zeros(0, dtype=torch.float32)
    return torch.cat(out)


def _chunk_stats(z: Tensor, targets: Tensor, temps: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of one logits chunk ``z`` ``[c, vocab]`` (compute dtype): fp32 logsumexp, target logit, entropy.

    The logits are upcast to float32 and divided by ``temps`` ``[c]`` (None: temperature 1) first, as
    ``selective_log_softmax`` and ``entropy_from_logits`` do. Returns three ``[c]`` float32 tensors.
    """
    z = z.float()
    if temps is not None:
        z = z / temps[:, None]
    lse = torch.logsumexp(z, dim=-1)  # [c]
    picked = z.gather(-1, targets[:, None]).squeeze(-1)  # [c]
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)  # [c]
    return lse, picked, entropy


def _chunk_grad(z: Tensor, targets: Tensor, temps: Tensor | None, lse: Tensor, grad_lp: Tensor) -> Tensor:
    """Gradient of ``sum(grad_lp * log_softmax(z / temps)[target])`` w.r.t. the chunk's logits ``z`` ``[c, vocab]``.

    ``(onehot(target) - softmax(z / T)) * grad_lp / T`` per row, returned in ``z``'s dtype.
    """
    zf = z.float()
    if temps is not None:
        zf = zf / temps[:, None]
    g = -torch.exp(zf - lse[:, None]) * grad_lp[:, None]  # [c, vocab]
    g = g.scatter_add(-1, targets[:, None], grad_lp[:, None])
    if temps is not None:
        g = g / temps[:, None]
    return g.to(z.dtype)


_StatsFn = Callable[[Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor, Tensor]]
_GradFn = Callable[[Tensor, Tensor, Tensor | None, Tensor, Tensor], Tensor]
_COMPILED: dict[str, Any] = {}


def _kernels(compiled: bool) -> tuple[_StatsFn, _GradFn]:
    """``_chunk_stats`` and ``_chunk_grad``, through ``torch.compile`` (fused elementwise + reductions) if asked."""
    if not compiled:
        return _chunk_stats, _chunk_grad
    if not _COMPILED:
        _COMPILED["stats"] = torch.compile(_chunk_stats, dynamic=True)
        _COMPILED["grad"] = torch.compile(_chunk_grad, dynamic=True)
    return _COMPILED["stats"], _COMPILED["grad"]


class _FusedLogprobEntropy(torch.autograd.Function):
    """See ``fused_logprob_entropy``; saves only the hidden rows, the weight and one logsumexp per row."""

    @staticmethod
    def forward(
        ctx: Any,  # autograd's context, carrying this function's own attributes too
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        temps: Tensor | None,
        chunk_size: int,
        compiled: bool,
    ) -> tuple[Tensor, Tensor]:
        stats, _ = _kernels(compiled)
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(lp)
        lse = torch.empty_like(lp)
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            z = hidden[s:e] @ weight.T  # [c, vocab], compute dtype
            t = None if temps is None else temps[s:e]
            lse[s:e], picked, entropy[s:e] = stats(z, targets[s:e], t)
            lp[s:e] = picked - lse[s:e]
        ctx.save_for_backward(hidden, weight, targets, lse, temps)
        ctx.chunk_size, ctx.compiled = chunk_size, compiled
        ctx.mark_non_differentiable(entropy)
        return lp, entropy

    @staticmethod
    def backward(ctx: Any, grad_lp: Tensor, grad_entropy: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ARG004
        hidden, weight, targets, lse, temps = ctx.saved_tensors
        _, grad_fn = _kernels(ctx.compiled)
        n, chunk_size = hidden.shape[0], ctx.chunk_size
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        want_w = ctx.needs_input_grad[1]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_lp = grad_lp.float()
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            z = hidden[s:e] @ weight.T  # [c, vocab], recomputed
            t = None if temps is None else temps[s:e]
            g = grad_fn(z, targets[s:e], t, lse[s:e], grad_lp[s:e])
            del z
            if grad_h is not None:
                grad_h[s:e] = g @ weight  # [c, D]
            if grad_w is not None:
                grad_w += (g.T @ hidden[s:e]).float()  # [vocab, D], fp32 accumulation over chunks
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def fused_logprob_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temps: Tensor | None = None,
    chunk_size: int = 4096,
    compiled: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-probability of each target token and the entropy of each row, straight from hidden states.

    ``z = hidden @ weight.T`` (the LM head) in the inputs' dtype, ``chunk_size`` rows at a time, so
    the full ``[N, vocab]`` logits never exist; per chunk the logits are upcast to float32, divided
    by ``temps``, and the logsumexp, the target logit and the entropy are taken (the values of
    ``selective_log_softmax`` and ``entropy_from_logits`` on the materialised logits). The backward
    pass recomputes each chunk's logits and applies ``d log p_t / d z = onehot(t) - softmax(z)``
    (divided by the temperature), accumulating the weight's gradient in float32 over chunks.

    Args:
        hidden: ``[N, D]`` float (bf16 or fp32): final hidden states of the rows that predict ``targets``.
        weight: ``[vocab, D]`` of the same dtype: the output embedding.
        targets: ``[N]`` int64 token ids.
        temps: ``[N]`` float32 sampling temperatures, or None for 1.
        chunk_size: rows per chunk (peak extra memory ~ ``chunk_size * vocab * 6`` bytes for bf16).
        compiled: run the per-chunk elementwise work through ``torch.compile`` (fused kernels).

    Returns:
        ``(logprobs, entropy)``, both ``[N]`` float32; ``logprobs`` is differentiable in ``hidden`` and
        ``weight``, ``entropy`` (nats) carries no gradient.

    Raises:
        ValueError: shapes or dtypes that do not fit together.
    """
    if (
        hidden.dim() != 2
        or weight.dim() != 2
        or hidden.shape[1] != weight.shape[1]
        or targets.shape != hidden.shape[:1]
    ):
        raise ValueError(
            f"expected hidden [N, D], weight [vocab, D], targets [N]; got {list(hidden.shape)}, "
            f"{list(weight.shape)}, {list(targets.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    if temps is not None and temps.shape != targets.shape:
        raise ValueError(f"temps: expected [N] = {list(targets.shape)}, got {list(temps.shape)}")
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty + (hidden.sum() + weight.sum()).float() * 0, empty
    return _FusedLogprobEntropy.apply(hidden, weight, targets, temps, chunk_size, compiled)
