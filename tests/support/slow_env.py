"""A reverse-text environment whose reward can be made slow, for the hang watchdog's tests (cases C18, C19).

``env.id = "tests.support.slow_env:SlowReverseTextTaskset"`` (a local ``asyncrl rl`` may name any module). Its tasks
are reverse-text's; scoring an eval rollout first sleeps ``eval_sleep_s`` seconds, and scoring any rollout waits while
the file ``stall_file`` exists (the test creates it to stall the environment and removes it to let the run go on), but for eval tasks below
``stall_eval_from``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal

import verifiers.v1 as vf

from worker.envs import SplitTaskset
from worker.envs.reverse_text import ReverseTextConfig, ReverseTextTask, ReverseTextTaskset


class SlowReverseTextConfig(ReverseTextConfig):
    eval_sleep_s: float = 0.0
    """Seconds each eval rollout's scoring sleeps."""
    stall_file: str = ""
    """While this file exists, every scoring waits (polled every 0.1 s); "" never waits."""
    stall_eval_from: int = 0
    """Eval tasks below this index are scored without waiting for ``stall_file`` (an eval job stopped mid-way)."""


class SlowReverseTextTask(ReverseTextTask):
    eval_sleep_s = 0.0
    stall_file = ""
    stall_eval_from = 0

    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        if self.eval_sleep_s and self.data.id.startswith("eval/"):
            await asyncio.sleep(self.eval_sleep_s)
        is_eval, index = self.data.id.startswith("eval/"), int(self.data.id.rsplit("/", 1)[-1])
        while self.stall_file and Path(self.stall_file).exists() and not (is_eval and index < self.stall_eval_from):
            await asyncio.sleep(0.1)
        return await super().lcs(trace)


class SlowReverseTextTaskset(SplitTaskset[SlowReverseTextTask, SlowReverseTextConfig]):
    def make_task(self, split: Literal["train", "eval"], index: int) -> SlowReverseTextTask:
        base = ReverseTextTaskset.make_task(self, split, index)  # type: ignore[arg-type]  # the same config fields
        task = SlowReverseTextTask(base.data, self.config.task)
        task.eval_sleep_s, task.stall_file = self.config.eval_sleep_s, self.config.stall_file
        task.stall_eval_from = self.config.stall_eval_from
        return task

    _sentence = ReverseTextTaskset._sentence
    _eval_texts = ReverseTextTaskset._eval_texts
