"""A LoRA run's adapters (``[trainer.lora]``) as the trainer, inference server, orchestrator and export see them:
the files of one adapter, where a checkpoint keeps it, the name vLLM serves each policy version under and how many
versions stay loaded. Nothing here imports torch or vLLM, so every side imports it.

On disk an adapter is PEFT's ``save_pretrained`` format (``worker/trainer/lora.py`` writes it), the one vLLM's
``/v1/load_lora_adapter`` reads::

    <folder>/adapter_config.json           rank, alpha, dropout, target modules, base model
    <folder>/adapter_model.safetensors     the A and B tensors
"""

from __future__ import annotations

import hashlib
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a folder a LoRA adapter (PEFT's ``save_pretrained`` format)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The adapter's A and B tensors (safetensors, PEFT's names ``base_model.model.<module>.lora_A.weight``)."""
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
"""An adapter folder's files."""
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""``trainer.lora.target_modules`` when unset: every linear layer of a decoder block (attention and MLP)."""
ADAPTER_DIR = "adapter"
"""A LoRA checkpoint's adapter folder inside its ``trainer`` part (``trainer/adapter/``), and ``final/adapter/``."""


def lora_adapter_name(run_dir: str | Path, version: int) -> str:
    """The model name policy ``version`` of the run in ``run_dir`` is served under (what rollouts send as ``model``):
    ``policy-<version>-<8 hex digits of sha256(resolved run_dir)>``.

    Unique per run, so two runs sharing one inference server (``inference.url``) never name each other's adapter,
    and the same for every attempt of one run, so a resume against a server that still holds the version reloads
    it under its own name (``load_inplace``: ``worker.inference.client.InferenceClient.load_lora_adapter``).
    """
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    return f"policy-{version}-{digest}"


def adapters_in_use(max_async_level: int) -> int:
    """How many policy versions' adapters a running rollout may still name: ``max_async_level + 2``.

    Rollouts of step n start at a served version >= n - 1 - max_async_level (``worker/orchestrator/staleness.py``)
    and run while versions up to n - 1 load (v(n) needs batch n); an eval that the main loop starts after writing
    batch n runs while v(n) loads. So versions n - 1 - max_async_level .. n, ``max_async_level + 2`` of them, may be
    named at once: the orchestrator keeps that many loaded (the oldest is unloaded after a newer one loads) and the
    run's vLLM server takes that many (``--max-loras``, :func:`worker.inference.server.lora_args`). A multi-turn or
    tool rollout names the adapter its first turn was sampled under on every turn (``worker/orchestrator/harness.py``).

    Raises:
        ValueError: ``max_async_level`` < 0.
    """
    if max_async_level < 0:
        raise ValueError(f"orchestrator.max_async_level: must be >= 0, got {max_async_level}")
    return max_async_level + 2
