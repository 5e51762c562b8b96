"""IPO: symmetric probability-difference trust region, independent of the advantage sign.

"IPO" here is INTELLECT Policy Optimization, the loss prime-rl shipped as its default for INTELLECT-3
(prime-rl ``src/prime_rl/trainer/rl/loss.py``, ``default_loss_fn`` before the rename of its
``ipo_mask_low/high`` fields to ``dppo_mask_low/high``; default threshold 0.2). It is the DPPO
binary-TV trust region (arXiv:2602.04879) made symmetric: prime-rl's docstring argues that in async
RL, where each batch is used for a single optimizer step, the advantage sign does not predict which
way the policy moved, so a token is dropped as soon as its probability differs from the sampling
probability by more than ``epsilon`` in either direction (the same shift as GRPO -> CISPO, with the
trust region measured by probability difference rather than ratio).

Per loss token t (tensors ``[seq]``, one sample; d_t = p_train - p_infer; r_t at ``ratio_level``):

    masked_t = |d_t| > epsilon
    loss = -sum_{t kept} r_t * A_t           # gradient -r_t A_t grad log pi_t

No KL term (the run spec gives IPO no ``kl_tau``; use ``dppo_kl`` for the regularised variant).
With ``ratio_level="sequence"`` the mask stays per token and the importance ratio is the sample's
geometric mean (GSPO). Masked positions of ``loss_mask`` never enter any arithmetic (see ``conventions``).

Metrics (sums over loss tokens): ``mismatch_kl``, ``is_ratio``, ``masked``, ``masked_low`` (d < -eps),
``masked_high`` (d > eps), ``loss_tokens``.
"""

from __future__ import annotations

from worker.trainer.loss.conventions import LossInputs, LossOutputs, base_metrics, prepare, ratio_pg_loss


def ipo(inputs: LossInputs, *, epsilon: float = 0.2, ratio_level: str = "token") -> LossOutputs:
    """Policy gradient on tokens whose probability moved by at most ``epsilon`` since sampling.

    Args:
        inputs: the sample's ``[seq]`` tensors.
        epsilon: half-width of the trust region on ``p_train - p_infer`` (> 0).
        ratio_level: ``"token"`` or ``"sequence"`` importance ratio in the policy-gradient term.

    Returns:
        ``LossOutputs`` with the summed loss and summed metrics.

    The parameters are in range (validated by the spec, ``worker/spec/trainer.py``).
    """
    p = prepare(inputs, ratio_level)

    prob_diff = p.trainer_probs - p.sampling_probs  # [seq], detached
    masked_high = prob_diff > epsilon  # [seq]
    masked_low = prob_diff < -epsilon  # [seq]
    keep = p.mask & ~(masked_high | masked_low)  # [seq]

    return LossOutputs(loss=ratio_pg_loss(p, keep), metrics=base_metrics(p, keep, masked_low, masked_high))
