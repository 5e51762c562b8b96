"""reverse-tool: reverse a made-up sentence with the help of a `reverse` tool (a tool-using taskset).

The prompt is a sentence; the task offers one tool, `reverse(text) -> text[::-1]`, served by verifiers'
own tool server (`ReverseToolset`, an MCP toolset launched per rollout). A model may call the tool and
then answer, or answer directly. The reward (`@vf.reward`) is the LCS ratio (`lcs_ratio`) of the final
reply's answer (`parse_answer`, tag ``reversed_text``) against the true reversal, as in reverse_text.

Tasks with tools run through verifiers' agent harness (`worker.orchestrator.harness`): the model's
tool calls are parsed and executed by verifiers, and the tool results come back as tool messages.
Tasks are generated from `(seed, split, index)` alone.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from itertools import count
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field

from worker.envs import parse_answer
from worker.envs.reverse_text import ANSWER_TAG, lcs_ratio
from worker.envs.sentences import make_sentence

SYSTEM_PROMPT = "Reverse the text. You may call the reverse tool."


class ReverseToolset(vf.Toolset[vf.ToolsetConfig]):
    """The `reverse` tool (verifiers serves it per rollout as ``python -m worker.envs.reverse_tool``)."""

    @vf.tool
    async def reverse(self, text: str) -> str:
        """Return `text` reversed character by character."""
        return text[::-1]


class ReverseToolTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ReverseToolData(vf.TaskData):
    text: str
    """The sentence to reverse (also the user prompt)."""
    answer: str
    """The true reversal of `text`."""


class ReverseToolTask(vf.Task[ReverseToolData, vf.State, ReverseToolTaskConfig]):
    @property
    def key(self) -> str:
        return self.data.id or self.hash

    @classmethod
    def toolsets(cls, config: ReverseToolTaskConfig) -> list[vf.Toolset]:
        return [ReverseToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        return lcs_ratio(parse_answer(trace.last_reply or "", ANSWER_TAG), self.data.answer)


class ReverseToolConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    seed: int = 0
    num_train: int | None = Field(None, ge=1)
    """Number of train tasks; None yields train tasks forever."""
    num_eval: int = Field(100, ge=1)
    min_chars: int = Field(5, ge=2)
    max_chars: int = Field(20, ge=2)
    system_message: bool = True
    """Send the instruction as a system message."""
    task: ReverseToolTaskConfig = ReverseToolTaskConfig()


class ReverseToolTaskset(vf.Taskset[ReverseToolTask, ReverseToolConfig]):
    def __init__(self, config: ReverseToolConfig) -> None:
        if config.max_chars < config.min_chars:
            raise ValueError(f"max_chars ({config.max_chars}) must be >= min_chars ({config.min_chars})")
        super().__init__(config)
        self.INFINITE = config.split == "train" and config.num_train is None

    def load(self) -> Iterator[ReverseToolTask]:
        c = self.config
        size = c.num_eval if c.split == "eval" else c.num_train
        for index in count() if size is None else range(size):
            rng = random.Random(f"reverse_tool/{c.seed}/{c.split}/{index}")
            text = make_sentence(rng, c.min_chars, c.max_chars)
            data = ReverseToolData(
                id=f"{c.split}/{c.seed}/{index}",
                prompt=text,
                system_prompt=SYSTEM_PROMPT if c.system_message else None,
                text=text,
                answer=text[::-1],
            )
            yield ReverseToolTask(data, c.task)


if __name__ == "__main__":
    ReverseToolset.run()
