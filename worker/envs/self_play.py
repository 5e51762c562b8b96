"""self-play: a proposer writes a word, solvers reverse it; one policy plays both roles (a two-role task).

An episode has two stages (run by ``worker.orchestrator.rollouts.self_play_group``):

1. **Proposer**: the prompt asks for one word of ``min_letters``-``max_letters`` lowercase letters (a-z) inside
   ``<word></word>``. The reply is parsed with ``parse_answer`` (tag ``word``: any ``<think>`` block dropped, the last
   tag's content or the whole reply, stripped) and the proposal is valid only if that text is entirely such a word
   (``[a-z]{min,max}``, no spaces, capitals or punctuation): ``parse_proposal``.
2. **Solvers**: ``num_solvers`` solver rollouts answer the reverse-text task on the proposal (system ``"Reverse the
   text."``, the word as the user prompt; reward: the LCS ratio of the parsed answer against the reversal, as in
   ``reverse_text``). An invalid proposal gives the solvers the task's fixed fallback word instead (``example``, drawn
   from ``(seed, split, index)``), so every episode trains its solvers; the proposer then scores 0.

The proposer's reward derives from the solvers' results, R-Zero's uncertainty reward (Huang et al. 2025, "R-Zero:
Self-Evolving Reasoning LLM from Zero Data", arXiv:2508.05004, section 3.2), gated by validity:

    R_P = v * (1 - 2 * |p - 1/2|)     v = 1 if the proposal is valid else 0,
                                    p = solved / present   (a solver solved it when its reward >= SOLVED_AT = 1.0)

``present`` counts the solvers with a reward (None, NaN and inf are missing: ``worker.rewards.present_reward``),
``solved`` those of them whose LCS reward is >= ``SOLVED_AT`` (1.0: the exact reversal; a
partly right answer does not count). R_P is 1 for a word that half the solvers reverse exactly, 0 for one all of
them reverse or none of them does, as the proposer's prompt says (``proposer_reward``; None when no solver reward is
present). The proposer task's own ``@vf.reward`` is the validity v (what scoring its
trace alone can know); the episode replaces it by R_P once the solvers are scored.

Tasks are a function of ``(seed, split, index)``; the fallback word of a train task is never an eval task's. An eval
of this environment runs whole episodes too: its ``reward_mean`` averages the proposers' and the solvers' rewards.
"""

from __future__ import annotations

import random
import re
import string
from functools import cached_property
from typing import Literal

import verifiers.v1 as vf

from worker.envs import SingleTurnTask, SplitConfig, SplitTaskset, parse_answer
from worker.envs.reverse_text import SYSTEM_PROMPT as SOLVER_SYSTEM_PROMPT
from worker.envs.reverse_text import ReverseTextData, ReverseTextTask
from worker.rewards import present_reward
from worker.spec.env_args import SelfPlayArgs

PROPOSER, SOLVER = "proposer", "solver"
"""The two roles (``Rollout.role``)."""
ANSWER_TAG = "word"
PROPOSER_SYSTEM_PROMPT = (
    "Write one word of {low}-{high} lowercase letters a-z in <word></word> for others to reverse; "
    "you score most if half of them succeed."
)
PROPOSER_PROMPT = "Propose a word, e.g. <word>{example}</word>."
_MAX_REDRAWS = 1000
SOLVED_AT = 1.0
"""A solver solved the proposal when its reward (the LCS ratio) is >= this: 1.0 is the exact reversal."""


def parse_proposal(reply: str, min_letters: int, max_letters: int) -> str | None:
    """The proposed word of a proposer reply, or None when it is not exactly one word of ``min_letters`` to
    ``max_letters`` lowercase letters a-z (after ``parse_answer`` with tag ``word``)."""
    word = parse_answer(reply, ANSWER_TAG)
    return word if re.fullmatch(rf"[a-z]{{{min_letters},{max_letters}}}", word) else None


def proposer_reward(valid: bool, solver_rewards: list[float | None]) -> float | None:
    """R_P = v * (1 - 2 |p - 1/2|) (module docstring): v = ``valid``, p = the fraction of the present solver rewards
    that are >= ``SOLVED_AT`` (solvers that reversed the word exactly).

    Args:
        valid: whether the proposal parsed (``parse_proposal``).
        solver_rewards: one per solver; None or non-finite = missing (left out of p).

    Returns:
        A reward in [0, 1]; 0.0 for an invalid proposal; None when no solver reward is present (missing, case C8).
    """
    present = [r for r in map(present_reward, solver_rewards) if r is not None]
    if not present:
        return None
    if not valid:
        return 0.0
    p = sum(r >= SOLVED_AT for r in present) / len(present)
    return 1.0 - 2.0 * abs(p - 0.5)


class SelfPlayData(vf.TaskData):
    example: str
    """The fallback word: shown in the proposer prompt, and the solvers' word when the proposal is invalid."""
    answer: str
    """A valid proposal (``<word>example</word>``): the reference an SFT warm-up trains the proposer on."""
    min_letters: int
    max_letters: int
    num_solvers: int
    """Solver rollouts per episode."""
    solver_system_message: bool
    """Whether the solvers' task has the system message ``"Reverse the text."``."""


class SelfPlayTask(SingleTurnTask[SelfPlayData]):
    """The proposer's task; ``solver_task`` makes the solvers' task of its episode."""

    @property
    def num_solvers(self) -> int:
        return self.data.num_solvers

    def proposal(self, reply: str) -> str | None:
        """The valid word of a proposer reply, or None (``parse_proposal``)."""
        return parse_proposal(reply, self.data.min_letters, self.data.max_letters)

    def solver_task(self, proposal: str | None) -> ReverseTextTask:
        """The reverse-text task of the solvers: reverse ``proposal``, or the fallback word when it is None."""
        word = proposal if proposal is not None else self.data.example
        data = ReverseTextData(
            id=f"{self.key}/{SOLVER}/{word}",
            prompt=word,
            system_prompt=SOLVER_SYSTEM_PROMPT if self.data.solver_system_message else None,
            text=word,
            answer=word[::-1],
        )
        return ReverseTextTask(data, self.config)

    @vf.reward(weight=1.0)
    async def valid(self, trace: vf.Trace) -> float:
        return float(self.proposal(trace.last_reply) is not None)


class SelfPlayConfig(SelfPlayArgs, SplitConfig):
    """The taskset config: the split and seed, and the arguments of `SelfPlayArgs`."""


class SelfPlayTaskset(SplitTaskset[SelfPlayTask, SelfPlayConfig]):
    def make_task(self, split: Literal["train", "eval"], index: int) -> SelfPlayTask:
        """Task `index` of `split`, a function of the config alone."""
        if split == "eval":
            word = self._word("eval", index, 0)
        else:
            draws = (self._word("train", index, attempt) for attempt in range(_MAX_REDRAWS))
            found = next((w for w in draws if w not in self._eval_words), None)
            if found is None:
                raise ValueError(f"self_play: no train word outside the eval set in {_MAX_REDRAWS} draws")
            word = found
        c = self.config
        instruction = PROPOSER_SYSTEM_PROMPT.format(low=c.min_letters, high=c.max_letters)
        prompt = PROPOSER_PROMPT.format(example=word)
        data = SelfPlayData(
            id=f"{split}/{c.seed}/{index}",
            prompt=prompt if c.system_message else f"{instruction} {prompt}",
            system_prompt=instruction if c.system_message else None,
            example=word,
            answer=f"<{ANSWER_TAG}>{word}</{ANSWER_TAG}>",
            min_letters=c.min_letters,
            max_letters=c.max_letters,
            num_solvers=c.num_solvers,
            solver_system_message=c.system_message,
        )
        return SelfPlayTask(data, self.config.task)

    def _word(self, split: str, index: int, attempt: int) -> str:
        rng = random.Random(f"self_play/{self.config.seed}/{split}/{index}/{attempt}")
        size = rng.randint(self.config.min_letters, self.config.max_letters)
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(size))

    @cached_property
    def _eval_words(self) -> frozenset[str]:
        return frozenset(self._word("eval", i, 0) for i in range(self.config.num_eval))
