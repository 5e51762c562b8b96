"""Pieces shared by the per-sample RL losses of this package.

Conventions of every loss here (see ``worker/trainer/loss/__init__.py`` for the registry):

- A loss is a pure function of ONE sample's per-token tensors, all ``[seq]``: ``LossInputs`` in,
  ``LossOutputs(loss, metrics)`` out. ``loss`` is the SUM over the tokens that keep a gradient and
  every metric is a SUM over the sample's loss tokens, so the caller sums over samples (and ranks)
  and divides by the global loss-token count.
- ``r = pi_train / pi_infer`` is the importance ratio of a sampled token: trainer probability over
  the probability vLLM reported when it sampled the token. ``ratio_level="token"`` uses one ratio per
  token; ``"sequence"`` uses one per sample, ``s = exp(mean of log r over the loss tokens)`` (the
  geometric mean of GSPO, Zheng et al. 2025, arXiv:2507.18071), applied to every token in the
  GSPO-token form ``s * pi_t / sg(pi_t)``: its value is ``s`` and its gradient ``s * grad log pi_t``.
- Masking comes before any arithmetic (case C1). Positions with ``loss_mask`` False (prompt, tool
  output, padding) may hold NaN or garbage in ``sampling_logprobs``; ``prepare`` replaces them with
  ``torch.where`` (never a multiplication: NaN * 0 = NaN) before a ratio is formed, and each loss
  zeroes the log ratio of dropped tokens before ``exp``, so neither the loss, the metrics nor the
  gradient can pick up NaN or inf from a token that does not train.
- ``mismatch_kl`` is the k3 estimator ``r - log r - 1`` (Schulman, "Approximating KL divergence",
  2020) of KL(pi_infer || pi_train), token-level, summed over loss tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

RATIO_LEVELS = ("token", "sequence")


@dataclass
class LossInputs:
    """One sample's per-token tensors, all of shape ``[seq]``."""

    trainer_logprobs: Tensor
    """float, requires grad: log pi_train(token), logits scaled by the sampling temperature."""
    sampling_logprobs: Tensor
    """float: log pi_infer(token) as reported by vLLM; may be NaN/garbage where ``loss_mask`` is False."""
    advantages: Tensor
    """float: per-token advantage (the same value over a sample's completion)."""
    loss_mask: Tensor
    """bool: True on policy-sampled completion tokens."""


@dataclass
class LossOutputs:
    loss: Tensor
    """Scalar: SUM over the tokens that keep a gradient (the caller divides by the global token count)."""
    metrics: dict[str, Tensor]
    """Detached scalars, each a SUM over the sample's loss tokens (counts for ``masked`` and friends)."""


@dataclass
class Prepared:
    """``LossInputs`` with masked positions neutralised, plus the log ratios. All ``[seq]``."""

    mask: Tensor
    """bool: the loss tokens."""
    advantages: Tensor
    """0 where ``mask`` is False."""
    trainer_probs: Tensor
    """detached pi_train; 1 where ``mask`` is False."""
    sampling_probs: Tensor
    """pi_infer; 1 where ``mask`` is False."""
    log_ratio: Tensor
    """token log r = log pi_train - log pi_infer, with gradient; 0 (r = 1) where ``mask`` is False."""
    is_log_ratio: Tensor
    """log of the importance ratio at the requested ``ratio_level`` (value), gradient d log pi_t."""


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


def mismatch_kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 estimator of KL(pi_infer || pi_train) per token: ``r - log r - 1`` with ``r = exp(log_ratio)``.

    Elementwise, always >= 0, 0 exactly where the two engines agree; ``expm1`` keeps small values accurate.
    """
    return torch.expm1(log_ratio) - log_ratio


def check_ratio_level(ratio_level: str) -> None:
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f'trainer.loss.ratio_level: expected "token" or "sequence", got {ratio_level!r}')


def check_positive(name: str, value: float, *, above: float = 0.0, allow_equal: bool = False) -> None:
    """One-line ValueError naming ``trainer.loss.<name>`` unless ``value`` > ``above`` (>= with allow_equal)."""
    relation = ">=" if allow_equal else ">"
    ok = isinstance(value, int | float) and math.isfinite(value) and (value >= above if allow_equal else value > above)
    if not ok:
        raise ValueError(f"trainer.loss.{name}: expected a number {relation} {above:g}, got {value!r}")


def prepare(inputs: LossInputs, ratio_level: str) -> Prepared:
    """Neutralise masked positions with ``torch.where``, then form the token and IS log ratios."""
    check_ratio_level(ratio_level)
    tensors = (inputs.trainer_logprobs, inputs.sampling_logprobs, inputs.advantages, inputs.loss_mask)
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"loss inputs: expected four [seq] tensors of one length, got shapes {sorted(shapes)}")
    mask = inputs.loss_mask.bool()
    zero = torch.zeros((), dtype=inputs.trainer_logprobs.dtype, device=inputs.trainer_logprobs.device)
    trainer_lp = torch.where(mask, inputs.trainer_logprobs, zero)  # [seq], grad flows on loss tokens only
    sampling_lp = torch.where(mask, inputs.sampling_logprobs.detach().to(zero.dtype), zero)  # [seq]
    advantages = torch.where(mask, inputs.advantages.detach().to(zero.dtype), zero)  # [seq]
    log_ratio = trainer_lp - sampling_lp  # [seq], 0 off the mask
    if ratio_level == "token":
        is_log_ratio = log_ratio
    else:
        seq_log_ratio = log_ratio.detach().sum() / mask.sum().clamp_min(1)  # scalar: mean over loss tokens
        is_log_ratio = trainer_lp - trainer_lp.detach() + seq_log_ratio  # [seq]: value s, grad d log pi_t
    return Prepared(
        mask=mask,
        advantages=advantages,
        trainer_probs=torch.exp(trainer_lp.detach()),
        sampling_probs=torch.exp(sampling_lp),
        log_ratio=log_ratio,
        is_log_ratio=is_log_ratio,
    )


def ratio_pg_loss(p: Prepared, keep: Tensor) -> Tensor:
    """``-sum over kept tokens of r * A`` (r at the IS level, with gradient r * A * grad log pi).

    The log ratio of a dropped token is set to 0 before ``exp``, so an extreme ratio on a dropped token
    cannot turn into inf * 0 = NaN in the backward pass.
    """
    ratio = torch.exp(torch.where(keep, p.is_log_ratio, torch.zeros_like(p.is_log_ratio)))  # [seq]
    return -torch.where(keep, ratio * p.advantages, torch.zeros_like(ratio)).sum()


def base_metrics(p: Prepared, keep: Tensor, masked_low: Tensor, masked_high: Tensor) -> dict[str, Tensor]:
    """Metrics every loss reports, each a detached sum over the loss tokens."""
    mask = p.mask
    zero = torch.zeros_like(p.log_ratio, requires_grad=False)
    lr = p.log_ratio.detach()
    is_ratio = torch.exp(p.is_log_ratio.detach())
    return {
        "loss_tokens": mask.sum().to(lr.dtype),
        "mismatch_kl": torch.where(mask, mismatch_kl_k3(lr), zero).sum(),
        "is_ratio": torch.where(mask, is_ratio, zero).sum(),
        "masked": (mask & ~keep).sum().to(lr.dtype),
        "masked_low": (mask & masked_low).sum().to(lr.dtype),
        "masked_high": (mask & masked_high).sum().to(lr.dtype),
    }


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


_COMPILED: dict[str, object] = {}


def _kernels(compiled: bool) -> tuple[object, object]:
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
    def forward(  # type: ignore[override]
        ctx: object,
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
            lse[s:e], picked, entropy[s:e] = stats(z, targets[s:e], t)  # type: ignore[operator]
            lp[s:e] = picked - lse[s:e]
        ctx.save_for_backward(hidden, weight, targets, lse, temps)  # type: ignore[attr-defined]
        ctx.chunk_size, ctx.compiled = chunk_size, compiled  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(entropy)  # type: ignore[attr-defined]
        return lp, entropy

    @staticmethod
    def backward(ctx: object, grad_lp: Tensor, grad_entropy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]  # noqa: ARG004
        hidden, weight, targets, lse, temps = ctx.saved_tensors  # type: ignore[attr-defined]
        _, grad_fn = _kernels(ctx.compiled)  # type: ignore[attr-defined]
        n, chunk_size = hidden.shape[0], ctx.chunk_size  # type: ignore[attr-defined]
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # type: ignore[attr-defined]
        want_w = ctx.needs_input_grad[1]  # type: ignore[attr-defined]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_lp = grad_lp.float()
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            z = hidden[s:e] @ weight.T  # [c, vocab], recomputed
            t = None if temps is None else temps[s:e]
            g = grad_fn(z, targets[s:e], t, lse[s:e], grad_lp[s:e])  # type: ignore[operator]
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
    return _FusedLogprobEntropy.apply(hidden, weight, targets, temps, chunk_size, compiled)  # type: ignore[no-any-return]
