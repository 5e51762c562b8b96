"""Worker extension that loads new policy weights into a running vLLM server in place.

Loaded into vLLM's worker with ``--worker-extension-cls worker.inference.weight_ext.WeightUpdateExtension``
and called through the dev route ``POST /collective_rpc`` with
``{"method": "update_weights_from_path", "args": ["/dir/with/safetensors"]}``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every ``*.safetensors`` file in directory ``path``."""
    from safetensors import safe_open

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not p.exists() or not files:
        raise FileNotFoundError(f"{p}: no *.safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, sf.get_tensor(name)


class WeightUpdateExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner.model`` is the model)."""

    def update_weights_from_path(self, path: str) -> dict[str, Any]:
        """Load all ``*.safetensors`` in directory ``path`` (HF parameter names) into the model in place.

        Uses the model runner's layerwise ``reload_weights``: on CPU the linear layers no longer hold
        their checkpoint-format weights after boot (they were packed for oneDNN and replaced by empty
        tensors), so a plain ``model.load_weights`` cannot write into them; the layerwise reload
        restores each layer, loads it through ``model.load_weights`` and re-runs the layer's weight
        processing (re-packing). The tied lm_head is then fixed (:func:`_fix_cpu_tied_lm_head`).
        Call it while generation is paused and reset the prefix cache afterwards.
        """
        t0 = time.perf_counter()
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        names: list[str] = []

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in iter_safetensors(path):
                names.append(name)
                yield name, t

        runner.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        fix = _fix_cpu_tied_lm_head(model)
        return {"path": str(path), "tensors": len(names), "seconds": time.perf_counter() - t0, **fix}


def _fix_cpu_tied_lm_head(model: torch.nn.Module) -> dict[str, Any]:
    """Re-tie ``lm_head`` to the (reloaded) input embedding and re-pack its CPU GEMM weight.

    Tied checkpoints carry no ``lm_head.weight``, so the layerwise reload never reprocesses the LM
    head: on CPU it keeps the oneDNN/SGL handle packed from the *old* embedding at boot and would
    keep producing logits of the old weights. Returns what was done, for the RPC reply.
    """
    lm_head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    info: dict[str, Any] = {"tied": tied, "retied": False, "repacked": False}
    if lm_head is None or embed is None or not hasattr(lm_head, "weight"):
        return info
    if tied and lm_head.weight is not embed.weight:
        lm_head.weight = embed.weight
        info["retied"] = True
    # Re-run the CPU GEMM dispatch so the packed weight (or oneDNN handle) matches lm_head.weight.
    if hasattr(lm_head, "cpu_linear"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
        info["repacked"] = True
    return info
