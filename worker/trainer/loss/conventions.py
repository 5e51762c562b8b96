"""The conventions every per-sample RL loss of this package follows, and the pieces they share.

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
- A loss is arithmetic only: its parameters are validated once, by the spec (``worker/spec/trainer.py``,
  ``trainer.loss``; the trainer reads its spec through it), and reach it in range.
- ``mismatch_kl`` is the k3 estimator ``r - log r - 1`` (Schulman, "Approximating KL divergence",
  2020) of KL(pi_infer || pi_train), token-level, summed over loss tokens.

The trainer log-probabilities a loss receives come from ``worker/trainer/logprobs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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


def mismatch_kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 estimator of KL(pi_infer || pi_train) per token: ``r - log r - 1`` with ``r = exp(log_ratio)``.

    Elementwise, always >= 0, 0 exactly where the two engines agree; ``expm1`` keeps small values accurate.
    """
    return torch.expm1(log_ratio) - log_ratio


def prepare(inputs: LossInputs, ratio_level: str) -> Prepared:
    """Neutralise masked positions with ``torch.where``, then form the token and IS log ratios.

    ``ratio_level`` is ``"token"`` or ``"sequence"`` (checked by the spec, ``worker/spec/trainer.py``).

    Raises:
        ValueError: the four input tensors are not ``[seq]`` of one length.
    """
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
