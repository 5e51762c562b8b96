"""Trainer components shared by RL and SFT: packed tensors, optimizer, scheduler, weights, checkpoints."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from worker.checkpoint import prune, write_part
from worker.rundir import STABLE_MARKER, RunDir, step_dirs
from worker.spec import OptimConfig, SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass
class PackedTensors:
    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, restarting at 0 for every sample
    attention_mask: torch.Tensor  # [1, 1, T, T] bool, causal within a sample, False across samples
    loss_mask: torch.Tensor  # [T] bool
    sampling_logprobs: torch.Tensor  # [T] float
    spans: list[tuple[int, int]]  # (start, length) of each sample


def packed_attention_mask(lengths: list[int]) -> torch.Tensor:
    """Block-diagonal causal mask ``[1, 1, T, T]`` (True = may attend) for samples packed in one row.

    With SDPA this keeps attention inside each sample, so a packed row gives the same logits as the
    samples run one by one (checked in ``tests/unit/test_trainer.py``).
    """
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [T]
    total = int(seg.numel())
    causal = torch.ones(total, total, dtype=torch.bool).tril_()
    return (causal & (seg[:, None] == seg[None, :]))[None, None]


def micro_batch_tensors(samples: list[dict[str, Any]]) -> PackedTensors:
    """Concatenate samples (``TrainSample`` dicts, or any with ``input_ids``/``loss_mask``) into one row."""
    lengths = [len(s["input_ids"]) for s in samples]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    ids = torch.tensor([t for s in samples for t in s["input_ids"]], dtype=torch.long)
    mask = torch.tensor([m for s in samples for m in s["loss_mask"]], dtype=torch.bool)
    lps = [lp for s in samples for lp in s.get("sampling_logprobs", [0.0] * len(s["input_ids"]))]
    return PackedTensors(
        input_ids=ids[None],
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        attention_mask=packed_attention_mask(lengths),
        loss_mask=mask,
        sampling_logprobs=torch.tensor(lps, dtype=torch.float32),
        spans=list(zip(starts, lengths, strict=True)),
    )


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps``, then constant, linear or cosine decay to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.type == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        shape = 1 - progress if cfg.type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def weights_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named parameters, cloned and contiguous; a tied ``lm_head.weight`` is left out (it is the embedding)."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def publish_weights(model: torch.nn.Module, run: RunDir, version: int, keep_versions: int) -> Path:
    """Publish policy ``version`` as ``weights/step_<version>/model.safetensors`` with STABLE written last.

    Versions older than the newest ``keep_versions`` are deleted.
    """
    final = run.weight_dir(version)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights_state_dict(model), tmp / "model.safetensors")
    (tmp / STABLE_MARKER).write_text(str(version))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for n, path in step_dirs(run.weights).items():
        if n <= version - keep_versions:
            shutil.rmtree(path, ignore_errors=True)
    return final


def save_final(model: torch.nn.Module, base_name: str, out: Path) -> None:
    """``save_pretrained`` the model with the base model's tokenizer, so ``out`` loads by path."""
    from transformers import AutoTokenizer

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base_name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


class BackgroundCheckpointer:
    """Writes trainer checkpoint parts on a thread so training goes on while files are written.

    The state is copied on the calling thread (a consistent snapshot), then written by the thread.
    One save at a time: a new save first waits for the previous one.
    """

    def __init__(self, run: RunDir, keep: int) -> None:
        self.run, self.keep = run, keep
        self._thread: threading.Thread | None = None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self.wait()
        weights = weights_state_dict(model)
        # optimizer state tensors are cloned so the next step cannot change them under the writer
        opt_state = optimizer.state_dict()
        opt_state = {
            "state": {
                k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                for k, s in opt_state["state"].items()
            },
            "param_groups": opt_state["param_groups"],
        }
        meta = {"scheduler": scheduler.state_dict(), "rng": _rng_state(), "step": step}

        def write(folder: Path) -> None:
            save_file(weights, folder / "model.safetensors")
            torch.save({"optimizer": opt_state, **meta}, folder / "state.pt")
            (folder / "meta.json").write_text(json.dumps({"step": step}))

        def job() -> None:
            write_part(self.run, step, "trainer", write)
            prune(self.run, self.keep)
            logger.info("checkpoint step %d written", step)

        self._thread = threading.Thread(target=job, name=f"ckpt-{step}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def load_trainer_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
    """Load a trainer checkpoint part into model, optimizer, scheduler and RNGs; returns its step."""
    weights = load_file(folder / "model.safetensors")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"checkpoint {folder} does not match the model: missing {missing}, unexpected {unexpected}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    state = torch.load(folder / "state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return int(state["step"])
