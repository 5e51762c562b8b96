"""Optimizer and learning-rate schedule of the trainer (RL and SFT): AdamW and a warmup + decay ``LambdaLR``."""

from __future__ import annotations

import math

import torch

from worker.spec import OptimConfig, SchedulerConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (``requires_grad``: all of them, or a LoRA run's adapters only)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


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
