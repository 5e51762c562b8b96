"""reverse-twice: reverse a made-up sentence, then a second one the environment sends (two turns).

Turn 1: the user prompt is sentence A; the model answers with A reversed. The environment then
replies ``"Now reverse this: B"`` (`ReverseTwiceTask.env_response`); turn 2: the model answers with
B reversed, and the conversation ends. Answers are parsed as in reverse_text (`parse_answer`, tag
``reversed_text``). The reward (`@vf.reward`) is the mean LCS ratio (`lcs_ratio`) of the two
answers against the true reversals; a missing second reply scores 0 for that turn.

`env_response(trace) -> str | None` is the multi-turn protocol the orchestrator runs
(`worker.orchestrator.multiturn`): given the conversation so far as a verifiers trace, the
environment's next user message, or None to end the conversation.

Tasks are generated from `(seed, split, index)` alone; a train task never reuses an eval A sentence.
"""

from __future__ import annotations

import random
from functools import cached_property
from typing import Literal

import verifiers.v1 as vf

from worker.envs import SplitConfig, SplitTaskset, parse_answer
from worker.envs.reverse_text import ANSWER_TAG, SYSTEM_PROMPT, lcs_ratio
from worker.envs.sentences import make_sentence
from worker.spec.env_args import ReverseTwiceArgs

FOLLOW_UP = "Now reverse this: {text}"
_MAX_REDRAWS = 1000


class ReverseTwiceData(vf.TaskData):
    texts: list[str]
    """The two sentences: the first is the user prompt, the second the env's follow-up."""
    answers: list[str]
    """Their true reversals."""


class ReverseTwiceTask(vf.Task[ReverseTwiceData]):
    @property
    def key(self) -> str:
        return self.data.id or self.hash

    async def env_response(self, trace: vf.Trace) -> str | None:
        """The environment's next user message after the model's latest reply; None ends the conversation."""
        if trace.num_turns == 1:
            return FOLLOW_UP.format(text=self.data.texts[1])
        return None

    @vf.stop
    async def two_turns(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 2

    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        replies = ([m.content or "" for m in trace.assistant_messages] + ["", ""])[:2]  # a missing reply scores 0
        scores = [lcs_ratio(parse_answer(r, ANSWER_TAG), a) for r, a in zip(replies, self.data.answers, strict=True)]
        return sum(scores) / len(scores)


class ReverseTwiceConfig(ReverseTwiceArgs, SplitConfig):
    """The taskset config: the split and seed, and the arguments of `ReverseTwiceArgs`."""


class ReverseTwiceTaskset(SplitTaskset[ReverseTwiceTask, ReverseTwiceConfig]):
    def __init__(self, config: ReverseTwiceConfig) -> None:
        if config.max_chars < config.min_chars:
            raise ValueError(f"max_chars ({config.max_chars}) must be >= min_chars ({config.min_chars})")
        super().__init__(config)

    def make_task(self, split: Literal["train", "eval"], index: int) -> ReverseTwiceTask:
        """Task `index` of `split`, a function of the config alone."""
        attempts = range(1) if split == "eval" else range(_MAX_REDRAWS)
        texts = next(
            (
                t
                for t in (self._pair(split, index, a) for a in attempts)
                if split == "eval" or t[0] not in self._eval_texts
            ),
            None,
        )
        if texts is None:
            raise ValueError(f"reverse_twice: no train sentence outside the eval set in {_MAX_REDRAWS} draws")
        data = ReverseTwiceData(
            id=f"{split}/{self.config.seed}/{index}",
            prompt=texts[0],
            system_prompt=SYSTEM_PROMPT if self.config.system_message else None,
            texts=texts,
            answers=[t[::-1] for t in texts],
        )
        return ReverseTwiceTask(data, self.config.task)

    def _pair(self, split: str, index: int, attempt: int) -> list[str]:
        rng = random.Random(f"reverse_twice/{self.config.seed}/{split}/{index}/{attempt}")
        return [make_sentence(rng, self.config.min_chars, self.config.max_chars) for _ in range(2)]

    @cached_property
    def _eval_texts(self) -> frozenset[str]:
        return frozenset(self._pair("eval", i, 0)[0] for i in range(self.config.num_eval))
