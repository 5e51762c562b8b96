"""A custom loss for ``[trainer.loss] type = "custom"``: plain on-policy REINFORCE, no importance ratio, no mask.

Williams 1992 ("Simple statistical gradient-following algorithms", Eq. 11 with a baseline in the advantage): per
sample, over its loss tokens t (``[seq]`` tensors, see ``worker/trainer/loss/conventions.py``)

    loss = -scale * sum_t A_t * log pi_train(token_t)

Masked positions never enter the arithmetic (``torch.where``, not a product: their sampling logprobs may be NaN).
It reports only ``loss_tokens``; asyncrl fills in the other standard metrics.
"""

from __future__ import annotations

import torch

from worker.trainer.loss import LossInputs, LossOutputs


def reinforce(inputs: LossInputs, *, scale: float = 1.0) -> LossOutputs:
    """``-scale * sum over loss tokens of A_t * log pi_train``; metrics: ``loss_tokens``."""
    mask = inputs.loss_mask.bool()
    zero = torch.zeros_like(inputs.trainer_logprobs)
    terms = torch.where(mask, inputs.advantages * inputs.trainer_logprobs, zero)  # [seq]
    return LossOutputs(loss=-scale * terms.sum(), metrics={"loss_tokens": mask.sum().to(zero.dtype)})
