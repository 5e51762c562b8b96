"""A reverse-text environment whose reward can be made slow, for the hang watchdog's tests (cases C18, C19).

``env.id = "tests.support.slow_env:SlowReverseTextTaskset"`` (a local ``asyncrl rl`` may name any module). Its tasks
are reverse-text's; scoring an eval rollout first sleeps ``eval_sleep_s`` seconds, and scoring any rollout waits while
the file ``stall_file`` exists (the test creates it to stall the environment and removes it to let the run go on).
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


class SlowReverseTextTask(ReverseTextTask):
    eval_sleep_s = 0.0
    stall_file = ""

    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        if self.eval_sleep_s and self.data.id.startswith("eval/"):
            await asyncio.sleep(self.eval_sleep_s)
        while self.stall_file and Path(self.stall_file).exists():
            await asyncio.sleep(0.1)
        return await super().lcs(trace)


class SlowReverseTextTaskset(SplitTaskset[SlowReverseTextTask, SlowReverseTextConfig]):
    def make_task(self, split: Literal["train", "eval"], index: int) -> SlowReverseTextTask:
        base = ReverseTextTaskset.make_task(self, split, index)  # type: ignore[arg-type]  # the same config fields
        task = SlowReverseTextTask(base.data, self.config.task)
        task.eval_sleep_s, task.stall_file = self.config.eval_sleep_s, self.config.stall_file
        return task

    _sentence = ReverseTextTaskset._sentence
    _eval_texts = ReverseTextTaskset._eval_texts
