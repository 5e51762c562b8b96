"""Learning-rate schedules (``worker/trainer/optim.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from worker.spec import SchedulerConfig
from worker.trainer.optim import build_scheduler

# ----------------------------------------------------------------------------- scheduler


def _factors(cfg: SchedulerConfig, max_steps: int, steps: int) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2.0)
    sched = build_scheduler(opt, cfg, max_steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"] / 2.0)
        opt.step()
        sched.step()
    return out


def test_scheduler_constant_with_warmup() -> None:
    got = _factors(SchedulerConfig(type="constant", warmup_steps=4), max_steps=10, steps=7)
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])
    assert _factors(SchedulerConfig(), max_steps=3, steps=3) == [1.0, 1.0, 1.0]


def test_scheduler_linear_with_warmup() -> None:
    # warmup 2 of 10 steps, then 1 - (s - 2) / 8 scaled into [0.2, 1]: 0.2 + 0.8 * (1 - (s - 2) / 8)
    got = _factors(SchedulerConfig(type="linear", warmup_steps=2, min_lr_ratio=0.2), max_steps=10, steps=12)
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.2])


def test_scheduler_cosine_with_warmup() -> None:
    # warmup 2, then 0.1 + 0.9 * 0.5 * (1 + cos(pi * (s - 2) / 4)) for max_steps 6
    got = _factors(SchedulerConfig(type="cosine", warmup_steps=2, min_lr_ratio=0.1), max_steps=6, steps=8)
    half = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))  # 0.868198...
    quarter = 0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4))  # 0.231801...
    assert got == pytest.approx([0.5, 1.0, 1.0, half, 0.55, quarter, 0.1, 0.1])
    assert half == pytest.approx(0.8681980515)
