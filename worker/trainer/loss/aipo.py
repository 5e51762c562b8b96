"""AIPO: policy gradient weighted by the importance ratio truncated from above, ``min(r, max_ratio)``.

From "LlamaRL: A Distributed Asynchronous Reinforcement Learning Framework for Efficient Large-scale
LLM Training" (Meta GenAI, arXiv:2505.24034), Asynchronous Importance weighted Policy Optimization:
rollouts come from a lagging inference policy mu, and the off-policy correction is the importance
weight pi / mu, truncated at rho and treated as a constant (stop-gradient), which bounds the variance
a single stale token can add while keeping every token in the update (nothing is masked). The
truncation level is a free hyperparameter; asyncrl defaults to ``max_ratio = 2``.

Per loss token t (tensors ``[seq]``, one sample; r_t = pi_train / pi_infer at ``ratio_level``):

    w_t  = sg(min(r_t, max_ratio))
    loss = -sum_{t loss token} w_t * A_t * pi_t / sg(pi_t)     # value -sum w A, gradient -w_t A_t grad log pi_t

Writing the log-probability as ``pi_t / sg(pi_t)`` (value 1) keeps the loss value the truncated IS
surrogate ``-sum w A`` instead of ``-sum w A log pi``; the gradient is the same. With
``ratio_level="sequence"`` the weight is ``min(s, max_ratio)`` for the sample's geometric-mean ratio s.
No KL term. Masked positions of ``loss_mask`` never enter any arithmetic (see ``conventions``).

Metrics (sums over loss tokens): ``mismatch_kl``, ``is_ratio`` (before truncation), ``masked``,
``masked_low`` and ``masked_high`` (always 0), ``loss_tokens``, and ``truncated`` (tokens with
r > max_ratio).
"""

from __future__ import annotations

import math

import torch

from worker.trainer.loss.conventions import LossInputs, LossOutputs, base_metrics, prepare


def aipo(inputs: LossInputs, *, max_ratio: float = 2.0, ratio_level: str = "token") -> LossOutputs:
    """Policy gradient with the detached weight ``min(pi_train / pi_infer, max_ratio)`` on every loss token.

    Args:
        inputs: the sample's ``[seq]`` tensors.
        max_ratio: truncation level rho of the importance weight (> 1).
        ratio_level: ``"token"`` or ``"sequence"`` importance ratio.

    Returns:
        ``LossOutputs`` with the summed loss and summed metrics.

    The parameters are in range (validated by the spec, ``worker/spec/trainer.py``).
    """
    p = prepare(inputs, ratio_level)

    log_r = p.is_log_ratio  # [seq]; 0 off the mask in token mode
    weight = torch.exp(torch.clamp(log_r.detach(), max=math.log(max_ratio)))  # [seq], sg(min(r, rho))
    unit = torch.exp(log_r - log_r.detach())  # [seq]: value 1, gradient d log pi_t
    per_token = torch.where(p.mask, weight * p.advantages * unit, torch.zeros_like(weight))  # [seq]
    loss = -per_token.sum()

    never = torch.zeros_like(p.mask)
    metrics = base_metrics(p, p.mask, never, never)
    metrics["truncated"] = (p.mask & (log_r.detach() > math.log(max_ratio))).sum().to(weight.dtype)
    return LossOutputs(loss=loss, metrics=metrics)
