"""reverse-text: reverse a made-up sentence character by character (single-turn).

Each task is one sentence from `worker.envs.sentences.make_sentence`; the model answers with the
reversed text. The answer is the reply with any `<think>...</think>` block dropped, the content of
`<reversed_text>` tags if the reply has them, and surrounding whitespace stripped. The reward is
the LCS ratio of that answer against the true reversal: `difflib.SequenceMatcher(None, a, b).ratio()`,
as in prime-rl's reverse-text environment (PrimeIntellect-ai/prime-rl
`environments/vf_reverse_text/vf_reverse_text.py`, `lcs_reward_func`), so a partly right
reversal earns partial credit.

Tasks are generated from `(seed, split, index)` alone, so any task can be rebuilt without the ones
before it. Train tasks never repeat an eval sentence: a train draw that hits one is redrawn.
"""

from __future__ import annotations

import difflib
import random
from functools import cached_property
from typing import Literal

import verifiers.v1 as vf

from worker.envs import SingleTurnTask, SplitConfig, SplitTaskset, parse_answer
from worker.envs.sentences import make_sentence
from worker.spec.env_args import ReverseTextArgs

SYSTEM_PROMPT = "Reverse the text."
ANSWER_TAG = "reversed_text"
_MAX_REDRAWS = 1000


def lcs_ratio(a: str, b: str) -> float:
    """Similarity of `a` and `b` in [0, 1]: `2 * matched / (len(a) + len(b))`.

    `difflib.SequenceMatcher` matches blocks greedily (Ratcliff/Obershelp), which is close to,
    but not always equal to, the longest common subsequence. Two empty strings score 1.0.
    """
    return difflib.SequenceMatcher(None, a, b).ratio()


class ReverseTextData(vf.TaskData):
    text: str
    """The sentence to reverse (also the user prompt)."""
    answer: str
    """The true reversal of `text`."""


class ReverseTextTask(SingleTurnTask[ReverseTextData]):
    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        return lcs_ratio(parse_answer(trace.last_reply, ANSWER_TAG), self.data.answer)


class ReverseTextConfig(ReverseTextArgs, SplitConfig):
    """The taskset config: the split and seed, and the arguments of `ReverseTextArgs`."""


class ReverseTextTaskset(SplitTaskset[ReverseTextTask, ReverseTextConfig]):
    def make_task(self, split: Literal["train", "eval"], index: int) -> ReverseTextTask:
        """Task `index` of `split`, a function of the config alone."""
        if split == "eval":
            text = self._sentence("eval", index, 0)
        else:
            draws = (self._sentence("train", index, attempt) for attempt in range(_MAX_REDRAWS))
            found = next((t for t in draws if t not in self._eval_texts), None)
            if found is None:
                raise ValueError(f"reverse_text: no train sentence outside the eval set in {_MAX_REDRAWS} draws")
            text = found
        data = ReverseTextData(
            id=f"{split}/{self.config.seed}/{index}",
            prompt=text,
            system_prompt=SYSTEM_PROMPT if self.config.system_message else None,
            text=text,
            answer=text[::-1],
        )
        return ReverseTextTask(data, self.config.task)

    def _sentence(self, split: str, index: int, attempt: int) -> str:
        # A str seed is hashed with SHA-512, so the stream is the same in every process.
        rng = random.Random(f"reverse_text/{self.config.seed}/{split}/{index}/{attempt}")
        return make_sentence(rng, self.config.min_chars, self.config.max_chars)

    @cached_property
    def _eval_texts(self) -> frozenset[str]:
        return frozenset(self._sentence("eval", i, 0) for i in range(self.config.num_eval))
