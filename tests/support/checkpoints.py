"""Run directories with checkpoints made by hand for the export tests: full weights perturbed from a base model, or a
PEFT LoRA adapter with a non-zero ``lora_B`` (``worker/policy/export.py``'s two kinds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from worker.run.rundir import COMPLETE_MARKER

IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 64, 12]])  # (1, 8) token ids of the probe


def logits(model: Any) -> torch.Tensor:
    """(1, 8, vocab) logits of the probe."""
    with torch.no_grad():
        return model(IDS).logits


def base_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_run(root: Path, model_dir: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model": {"name": str(model_dir), "dtype": "float32"}}))
    return root


def mark_complete(root: Path, step: int) -> Path:
    """Both parts of checkpoint ``step`` get their ``.complete`` marker (``worker.run.checkpoint.is_complete``); returns
    the trainer part."""
    for part in ("trainer", "orchestrator"):
        folder = root / "checkpoints" / f"step_{step}" / part
        folder.mkdir(parents=True, exist_ok=True)
        (folder / COMPLETE_MARKER).write_text(str(step))
    return root / "checkpoints" / f"step_{step}" / "trainer"


def full_checkpoint(root: Path, model_dir: Path, step: int, seed: int) -> Any:
    """Write a full checkpoint of ``step`` whose weights are the base's plus N(0, 0.02) noise, as the trainer writes
    them (HF names, the tied ``lm_head.weight`` left out); returns the perturbed model."""
    model = base_model(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, mark_complete(root, step) / "model.safetensors")
    return model


def lora_checkpoint(root: Path, model_dir: Path, step: int) -> Any:
    """Write a LoRA checkpoint of ``step``: a PEFT adapter (r=4 on q_proj/v_proj, lora_B set to N(0, 0.05) so it
    changes the model) saved with ``save_pretrained`` into ``trainer/adapter/``; returns the PEFT model."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        base_model(model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    ).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(mark_complete(root, step) / "adapter")
    return peft_model
