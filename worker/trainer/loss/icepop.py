"""IcePop: drop every token whose train/infer probability ratio leaves a band ``[low, high]``.

From "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model" (Ring-1T,
Ling Team, arXiv:2510.18855, section "IcePop: Discard All Noisy Gradient Updates"; blog
ringtech.notion.site/icepop). The paper's objective multiplies the policy gradient by a masking
function M(k) = k if alpha <= k <= beta else 0, with k = pi_train / pi_infer of the sampled token;
tokens outside the band are discarded rather than clipped, because their update is dominated by
engine mismatch (MoE routing, kernels), which compounds over long generations. Ring-1T trained with
alpha = 0.5, beta = 5 (our default band).

In asyncrl each batch takes one optimizer step, so the paper's PPO ratio pi_theta / pi_theta_old is 1
and only the masked mismatch weight remains. Per loss token t (tensors ``[seq]``, one sample):

    r_t      = pi_train / pi_infer                  # per token, or the sample's geometric mean (GSPO)
    masked_t = r_t < low or r_t > high
    loss     = -sum_{t kept} r_t * A_t              # gradient -r_t A_t grad log pi_t   (= -M(r) A grad log pi)

With ``ratio_level="sequence"`` one ratio decides for the whole sample: all of its tokens are kept or
all are masked. No KL term. Masked positions of ``loss_mask`` never enter any arithmetic (``conventions``).

Metrics (sums over loss tokens): ``mismatch_kl``, ``is_ratio``, ``masked``, ``masked_low`` (r < low),
``masked_high`` (r > high), ``loss_tokens``.
"""

from __future__ import annotations

import math

from worker.trainer.loss.conventions import LossInputs, LossOutputs, base_metrics, prepare, ratio_pg_loss


def icepop(inputs: LossInputs, *, band: tuple[float, float] = (0.5, 5.0), ratio_level: str = "token") -> LossOutputs:
    """Policy gradient on tokens whose ratio ``pi_train / pi_infer`` lies in ``band``; others masked.

    Args:
        inputs: the sample's ``[seq]`` tensors.
        band: ``(low, high)`` with ``0 < low < 1 < high``; the band is inclusive.
        ratio_level: ``"token"`` or ``"sequence"`` (one ratio, and one keep/mask decision, per sample).

    Returns:
        ``LossOutputs`` with the summed loss and summed metrics.

    The parameters are in range (validated by the spec, ``worker/spec/trainer.py``).
    """
    low, high = band
    p = prepare(inputs, ratio_level)

    log_r = p.is_log_ratio.detach()  # [seq]
    masked_low = log_r < math.log(low)  # [seq]
    masked_high = log_r > math.log(high)  # [seq]
    keep = p.mask & ~(masked_low | masked_high)  # [seq]

    return LossOutputs(loss=ratio_pg_loss(p, keep), metrics=base_metrics(p, keep, masked_low, masked_high))
