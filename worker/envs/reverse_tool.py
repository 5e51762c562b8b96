"""reverse-tool: reverse a made-up sentence with the help of a `reverse` tool (a tool-using taskset).

The prompt is a sentence; the task offers one tool, `reverse(text) -> text[::-1]`, served by verifiers'
own tool server (`ReverseToolset`, an MCP toolset declared by the taskset: started once and shared by every
rollout, ``worker.orchestrator.harness.serving_tools``). A model may call the tool and
then answer, or answer directly. The reward (`@vf.reward`) is the LCS ratio (`lcs_ratio`) of the final
reply's answer (`parse_answer`, tag ``reversed_text``) against the true reversal, as in reverse_text.

Tasks with tools run through verifiers' agent harness (`worker.orchestrator.harness`): the model's
tool calls are parsed and executed by verifiers, and the tool results come back as tool messages.
Tasks are generated from `(seed, split, index)` alone.

`ReverseToolTask.sft_conversation` gives the warm-up conversation SFT trains on (``asyncrl sft``): a call
``reverse(text)``, the tool's result, and the tagged answer, with the tool's spec as verifiers advertises it, so
the SFT tokens are the ones the RL rollouts render (the model's chat template with tools).
"""

from __future__ import annotations

import json
import random
from typing import Any, Literal

import verifiers.v1 as vf

from worker.envs import SplitConfig, SplitTaskset, parse_answer
from worker.envs.reverse_text import ANSWER_TAG, lcs_ratio
from worker.envs.sentences import make_sentence
from worker.spec.env_args import ReverseToolArgs

SYSTEM_PROMPT = "Reverse the text. You may call the reverse tool."


class ReverseToolset(vf.Toolset[vf.ToolsetConfig]):
    """The `reverse` tool (verifiers serves it as ``python -m worker.envs.reverse_tool``, once a run), advertised
    bare as ``reverse`` (no ``<toolset>_`` prefix)."""

    TOOL_PREFIX = None

    @vf.tool
    async def reverse(self, text: str) -> str:
        """Return `text` reversed character by character."""
        return text[::-1]


TOOL_SPEC: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "reverse",
        "description": (ReverseToolset.reverse.__doc__ or "").strip(),
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}
"""The `reverse` tool as the chat template sees it (the template renders its name, parameter names and
description; tests/e2e/test_tool_rl.py checks the SFT prompt tokens equal a real rollout's)."""


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

    def sft_conversation(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The ideal rollout as OpenAI chat messages (prompt, assistant call ``reverse(text)``, tool result,
        assistant answer in ``<reversed_text>`` tags) and the tool specs (OpenAI function form, as verifiers'
        TrainClient passes them to the chat template)."""
        d = self.data
        messages: list[dict[str, Any]] = [{"role": "system", "content": d.system_prompt}] if d.system_prompt else []
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "reverse", "arguments": json.dumps({"text": d.text})},
        }
        messages += [
            {"role": "user", "content": d.text},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": d.answer, "tool_call_id": "call_0"},
            {"role": "assistant", "content": f"<{ANSWER_TAG}>{d.answer}</{ANSWER_TAG}>"},
        ]
        return messages, [TOOL_SPEC]

    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        return lcs_ratio(parse_answer(trace.last_reply or "", ANSWER_TAG), self.data.answer)


class ReverseToolConfig(ReverseToolArgs, SplitConfig):
    """The taskset config: the split and seed, the arguments of `ReverseToolArgs`, and the task config with the
    tool."""

    task: ReverseToolTaskConfig = ReverseToolTaskConfig()


class ReverseToolTaskset(SplitTaskset[ReverseToolTask, ReverseToolConfig]):
    def __init__(self, config: ReverseToolConfig) -> None:
        if config.max_chars < config.min_chars:
            raise ValueError(f"max_chars ({config.max_chars}) must be >= min_chars ({config.min_chars})")
        super().__init__(config)

    @classmethod
    def toolsets(cls, config: ReverseToolConfig) -> list[vf.Toolset]:
        """The `reverse` tool, shared by every task (it holds no per-task state): one server for a whole run."""
        return [ReverseToolset(config.task.tools)]

    def make_task(self, split: Literal["train", "eval"], index: int) -> ReverseToolTask:
        c = self.config
        rng = random.Random(f"reverse_tool/{c.seed}/{split}/{index}")
        text = make_sentence(rng, c.min_chars, c.max_chars)
        data = ReverseToolData(
            id=f"{split}/{c.seed}/{index}",
            prompt=text,
            system_prompt=SYSTEM_PROMPT if c.system_message else None,
            text=text,
            answer=text[::-1],
        )
        return ReverseToolTask(data, c.task)


if __name__ == "__main__":
    ReverseToolset.run()
