"""RL losses of the trainer: one module per loss family, selected by ``[trainer.loss] type = "<name>"``.

Each loss is a pure function ``loss(inputs: LossInputs, **params) -> LossOutputs`` over ONE sample's
per-token ``[seq]`` tensors; its keyword parameters are the spec's ``trainer.loss`` fields:

- ``dppo_kl`` (default): mask_low=0.2, mask_high=0.2, kl_tau=1e-3. Masks a token whose probability
  moved past the trust region in the direction its advantage pushes (``p_train - p_infer``), plus
  ``kl_tau * (log r)^2`` on every loss token.
- ``ipo``: epsilon=0.2. Masks a token once ``abs(p_train - p_infer) > epsilon``, whatever the advantage.
- ``icepop``: band=(0.5, 5.0). Masks a token whose ratio ``r = pi_train / pi_infer`` leaves the band.
- ``aipo``: max_ratio=2.0. Masks nothing; weights each token by the detached ``min(r, max_ratio)``.
- ``custom``: import_path="package.module:function", kwargs={...}. Your own loss (a plugin), called as
  ``function(inputs, **kwargs)``:

      def function(inputs: LossInputs, *, <your kwargs>) -> LossOutputs

  with ``inputs`` and the result following ``conventions`` (one sample's ``[seq]`` tensors; the loss a SUM over
  kept tokens, metrics detached SUMs over loss tokens). Metrics it leaves out of the standard set
  (``loss_tokens``, ``mismatch_kl``, ``is_ratio``, ``masked``, ``masked_low``, ``masked_high``) are filled in
  as for a loss that masks nothing. The signature is checked at launch and by ``asyncrl rl --dry-run``
  (:func:`load_custom_loss`); at the service the path must be allowed (``worker/spec/user_code.py``).

The built-ins take ``ratio_level="token"`` (one ratio per token) or ``"sequence"`` (one per sample, GSPO).
``loss`` is a SUM over kept tokens and each metric a SUM over loss tokens: the caller sums over the
samples of a step and divides by the global loss-token count. Conventions, masking and the
sequence-level ratio are described in ``conventions``; the log-probabilities a loss receives come
from ``worker/trainer/logprobs.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from worker.spec import CustomLoss
from worker.spec.user_code import load_function
from worker.trainer.loss.aipo import aipo
from worker.trainer.loss.conventions import LossInputs, LossOutputs, base_metrics, prepare
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
CUSTOM_LOSS_ARGS = ("inputs",)
"""The positional arguments a custom loss takes (then its ``kwargs``)."""


def load_custom_loss(config: CustomLoss) -> LossFn:
    """The function of a ``trainer.loss`` with ``type = "custom"``, its signature checked.

    Raises:
        SpecError: one line naming ``trainer.loss.import_path`` (does not import, not callable, does not take
            ``(inputs, **kwargs)``).
    """
    return _load_custom(config.import_path, tuple(sorted(config.kwargs)))


@functools.lru_cache(maxsize=8)
def _load_custom(import_path: str, kwarg_names: tuple[str, ...]) -> LossFn:
    kwargs = dict.fromkeys(kwarg_names)
    return load_function("trainer.loss.import_path", import_path, args=CUSTOM_LOSS_ARGS, kwargs=kwargs)


def _custom_loss(inputs: LossInputs, import_path: str, kwargs: dict[str, Any]) -> LossOutputs:
    """Run a custom loss and fill in the standard metrics it does not report (as for a loss that masks nothing)."""
    out = _load_custom(import_path, tuple(sorted(kwargs)))(inputs, **kwargs)
    p = prepare(inputs, "token")
    none = torch.zeros_like(p.mask)
    return LossOutputs(loss=out.loss, metrics={**base_metrics(p, p.mask, none, none), **out.metrics})


def token_separable(type: str, params: dict[str, Any]) -> bool:
    """Whether the loss of several samples' tokens laid end to end is the sum of their losses, metrics included: the
    built-in losses at ``ratio_level = "token"`` (every mask, term and metric is per token). The trainer then computes
    a micro-batch's loss in a few calls instead of one per sample (the small per-sample kernels, forward and
    backward, bounded a GPU step). A custom loss or a sequence-level ratio is computed sample by sample."""
    return type in LOSSES and params.get("ratio_level", "token") == "token"


def compute_sample_loss(type: str, inputs: LossInputs, **params: Any) -> LossOutputs:
    """Run the loss named ``type`` on one sample.

    Args:
        type: a key of ``LOSSES`` or ``"custom"`` (the spec's ``trainer.loss.type``).
        inputs: the sample's ``[seq]`` tensors.
        **params: the loss's keyword parameters (the other ``trainer.loss`` fields).

    Returns:
        ``LossOutputs``: summed loss and summed metrics of the sample.

    Raises:
        SpecError: ``type = "custom"`` whose function does not load (see :func:`load_custom_loss`).
        ValueError: unknown ``type`` or an unknown parameter, naming the ``trainer.loss`` field. Parameter
            values are not checked here: the spec validates them (``worker/spec/trainer.py``).
    """
    if type == "custom":
        return _custom_loss(inputs, params["import_path"], params.get("kwargs", {}))
    fn = LOSSES.get(type)
    if fn is None:
        raise ValueError(f"trainer.loss.type: expected one of {sorted([*LOSSES, 'custom'])}, got {type!r}")
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
    "load_custom_loss",
    "dppo_kl",
    "token_separable",
    "icepop",
    "ipo",
]
