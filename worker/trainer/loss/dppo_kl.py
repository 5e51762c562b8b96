"""DPPO+KL: probability-difference trust-region mask by advantage sign, plus a squared-log-ratio KL term.

The default loss of asyncrl, after prime-rl's default RL loss (``src/prime_rl/trainer/rl/loss.py``,
``default_loss_fn``; defaults from ``DefaultLossConfig``: ``dppo_mask_low = dppo_mask_high = 0.2``,
``kl_tau = 1e-3``), which combines

- the DPPO binary-TV trust region ("Rethinking the Trust Region in LLM Reinforcement Learning",
  arXiv:2602.04879): the total-variation distance between pi_train and pi_infer restricted to the
  sampled token is approximated by the probability difference ``d = p_train - p_infer``, and a token
  leaves the trust region only in the direction its advantage pushes it;
- the KL regulariser of Kimi K2.5 (arXiv:2602.02276): ``kl_tau * (log r)^2`` on every loss token,
  which pulls pi_train back toward pi_infer where the two engines disagree.

Per loss token t (all tensors ``[seq]``, one sample; r_t = pi_train / pi_infer at ``ratio_level``):

    masked_t = (A_t > 0 and d_t >  mask_high)      # prob. already raised too far; pushing more is unsafe
            or (A_t < 0 and d_t < -mask_low)       # prob. already lowered too far
    loss = -sum_{t kept} r_t * A_t  +  kl_tau * sum_{t loss token} (log r_t)^2

The policy-gradient term has gradient ``-r_t A_t grad log pi_t`` (the ratio is not detached); masked
tokens get only the KL gradient. Tokens with ``A_t == 0`` are never masked (they carry no policy
gradient). The mask uses token probabilities at both ratio levels; with ``ratio_level="sequence"``
the importance ratio of the policy-gradient term is the sample's geometric mean (GSPO), while the KL
term stays per token (it measures per-token engine mismatch). Masked positions of ``loss_mask``
never enter any arithmetic (see ``conventions``).

Metrics (sums over loss tokens): ``mismatch_kl``, ``is_ratio``, ``masked``, ``masked_low``,
``masked_high``, ``loss_tokens``, and ``kl`` (sum of ``(log r)^2``).
"""

from __future__ import annotations

import torch

from worker.trainer.loss.conventions import LossInputs, LossOutputs, base_metrics, prepare, ratio_pg_loss


def dppo_kl(
    inputs: LossInputs,
    *,
    mask_low: float = 0.2,
    mask_high: float = 0.2,
    kl_tau: float = 1e-3,
    ratio_level: str = "token",
) -> LossOutputs:
    """DPPO-masked policy gradient plus ``kl_tau * (log r)^2`` for one sample.

    Args:
        inputs: the sample's ``[seq]`` tensors.
        mask_low: mask a negative-advantage token once ``p_train - p_infer < -mask_low`` (> 0).
        mask_high: mask a positive-advantage token once ``p_train - p_infer > mask_high`` (> 0).
        kl_tau: weight of the squared-log-ratio term over all loss tokens (>= 0).
        ratio_level: ``"token"`` or ``"sequence"`` importance ratio in the policy-gradient term.

    Returns:
        ``LossOutputs`` with the summed loss and summed metrics.

    The parameters are in range (validated by the spec, ``worker/spec/trainer.py``).
    """
    p = prepare(inputs, ratio_level)

    prob_diff = p.trainer_probs - p.sampling_probs  # [seq], detached
    masked_high = (p.advantages > 0) & (prob_diff > mask_high)  # [seq]
    masked_low = (p.advantages < 0) & (prob_diff < -mask_low)  # [seq]
    keep = p.mask & ~(masked_high | masked_low)  # [seq]

    kl_per_token = torch.where(p.mask, p.log_ratio.square(), torch.zeros_like(p.log_ratio))  # [seq]
    kl = kl_per_token.sum()
    loss = ratio_pg_loss(p, keep) + kl_tau * kl

    metrics = base_metrics(p, keep, masked_low, masked_high)
    metrics["kl"] = kl.detach()
    return LossOutputs(loss=loss, metrics=metrics)
