"""RL losses of the trainer: one module per loss family, selected by ``[trainer.loss] type = "<name>"``.

Each loss is a pure function ``loss(inputs: LossInputs, **params) -> LossOutputs`` over ONE sample's
per-token ``[seq]`` tensors; its keyword parameters are the spec's ``trainer.loss`` fields:

- ``dppo_kl`` (default): mask_low=0.2, mask_high=0.2, kl_tau=1e-3. Masks a token whose probability
  moved past the trust region in the direction its advantage pushes (``p_train - p_infer``), plus
  ``kl_tau * (log r)^2`` on every loss token.
- ``ipo``: epsilon=0.2. Masks a token once ``abs(p_train - p_infer) > epsilon``, whatever the advantage.
- ``icepop``: band=(0.5, 5.0). Masks a token whose ratio ``r = pi_train / pi_infer`` leaves the band.
- ``aipo``: max_ratio=2.0. Masks nothing; weights each token by the detached ``min(r, max_ratio)``.

All take ``ratio_level="token"`` (one ratio per token) or ``"sequence"`` (one per sample, GSPO).
``loss`` is a SUM over kept tokens and each metric a SUM over loss tokens: the caller sums over the
samples of a step and divides by the global loss-token count. Conventions, masking and the
sequence-level ratio are described in ``conventions``; the log-probabilities a loss receives come
from ``worker/trainer/logprobs.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.trainer.loss.aipo import aipo
from worker.trainer.loss.conventions import LossInputs, LossOutputs
from worker.trainer.loss.dppo_kl import dppo_kl
from worker.trainer.loss.icepop import icepop
from worker.trainer.loss.ipo import ipo

LossFn = Callable[..., LossOutputs]

LOSSES: dict[str, LossFn] = {
    "dppo_kl": dppo_kl,
    "ipo": ipo,
    "icepop": icepop,
    "aipo": aipo,
}
"""Loss functions keyed by the spec's ``trainer.loss.type``."""

DEFAULT_LOSS = "dppo_kl"


def compute_sample_loss(type: str, inputs: LossInputs, **params: Any) -> LossOutputs:
    """Run the loss named ``type`` on one sample.

    Args:
        type: a key of ``LOSSES`` (the spec's ``trainer.loss.type``).
        inputs: the sample's ``[seq]`` tensors.
        **params: the loss's keyword parameters (the other ``trainer.loss`` fields).

    Returns:
        ``LossOutputs``: summed loss and summed metrics of the sample.

    Raises:
        ValueError: unknown ``type`` or an unknown parameter, naming the ``trainer.loss`` field. Parameter
            values are not checked here: the spec validates them (``worker/spec/trainer.py``).
    """
    fn = LOSSES.get(type)
    if fn is None:
        raise ValueError(f"trainer.loss.type: expected one of {sorted(LOSSES)}, got {type!r}")
    allowed = sorted(fn.__kwdefaults__ or {})
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"trainer.loss.{unknown[0]}: not a parameter of loss {type!r}; expected some of {allowed}")
    return fn(inputs, **params)


__all__ = [
    "DEFAULT_LOSS",
    "LOSSES",
    "LossInputs",
    "LossOutputs",
    "aipo",
    "compute_sample_loss",
    "dppo_kl",
    "icepop",
    "ipo",
]
