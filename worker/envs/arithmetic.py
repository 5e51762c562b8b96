"""arithmetic: evaluate a short integer expression (single-turn), from reasoning-gym.

Tasks are reasoning-gym `basic_arithmetic` items, generated offline (`Calculate 12 + 7 * 3.`).
The answer is the reply with any `<think>...</think>` block dropped, the content of `<answer>`
tags if the reply has them, and surrounding whitespace stripped. The reward is reasoning-gym's own
`score_answer` for the item: 1.0 for the exact result, `len(result) / len(answer)` when the result
is a substring of the answer, else 0.0.

Each split is a reasoning-gym dataset with its own seed derived from `(seed, split)`, so an item
is rebuilt from its index alone. Train items never repeat an eval question: a train item that hits
one is redrawn from a fresh seed.
"""

from __future__ import annotations

import hashlib
from functools import cache, cached_property
from typing import Any, Literal

import reasoning_gym
import verifiers.v1 as vf
from reasoning_gym.dataset import ProceduralDataset

from worker.envs import SingleTurnTask, SplitConfig, SplitTaskset, parse_answer
from worker.spec.env_args import ArithmeticArgs

SYSTEM_PROMPT = "Compute the result. Answer with the number only."
ANSWER_TAG = "answer"
DATASET = "basic_arithmetic"
_MAX_REDRAWS = 1000


@cache
def _scorer() -> ProceduralDataset:
    # `score_answer` depends only on the entry passed in, not on the dataset's seed or size.
    return reasoning_gym.create_dataset(DATASET, seed=0, size=1)


def score_arithmetic(answer: str, entry: dict[str, Any]) -> float:
    """reasoning-gym's `score_answer` of `answer` for the dataset item `entry`."""
    return float(_scorer().score_answer(answer, entry))


class ArithmeticData(vf.TaskData):
    answer: str
    """The exact result, as reasoning-gym writes it."""
    entry: dict[str, Any]
    """The reasoning-gym item (`question`, `answer`, `metadata`) that `score_answer` reads."""


class ArithmeticTask(SingleTurnTask[ArithmeticData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return score_arithmetic(parse_answer(trace.last_reply, ANSWER_TAG), self.data.entry)


class ArithmeticConfig(ArithmeticArgs, SplitConfig):
    """The taskset config: the split and seed, and the arguments of `ArithmeticArgs`."""


class ArithmeticTaskset(SplitTaskset[ArithmeticTask, ArithmeticConfig]):
    def __init__(self, config: ArithmeticConfig) -> None:
        super().__init__(config)
        self._datasets: dict[tuple[str, int], ProceduralDataset] = {}

    def make_task(self, split: Literal["train", "eval"], index: int) -> ArithmeticTask:
        """Task `index` of `split`, a function of the config alone."""
        if split == "eval":
            entry = self._dataset("eval", 0)[index]
        else:
            draws = (self._dataset("train", attempt)[index] for attempt in range(_MAX_REDRAWS))
            entry = next((e for e in draws if e["question"] not in self._eval_questions), None)
            if entry is None:
                raise ValueError(f"arithmetic: no train item outside the eval set in {_MAX_REDRAWS} draws")
        data = ArithmeticData(
            id=f"{split}/{self.config.seed}/{index}",
            prompt=entry["question"],
            system_prompt=SYSTEM_PROMPT,
            answer=entry["answer"],
            entry=entry,
        )
        return ArithmeticTask(data, self.config.task)

    def _dataset(self, split: str, attempt: int) -> ProceduralDataset:
        key = (split, attempt)
        if key not in self._datasets:
            # reasoning-gym seeds item i with `seed + i`: 64-bit split seeds keep the two index
            # ranges far apart.
            digest = hashlib.sha256(f"arithmetic/{self.config.seed}/{split}/{attempt}".encode()).digest()
            c = self.config
            self._datasets[key] = reasoning_gym.create_dataset(
                DATASET,
                seed=int.from_bytes(digest[:8], "big"),
                size=2**62,
                min_terms=c.min_terms,
                max_terms=c.max_terms,
                min_digits=c.min_digits,
                max_digits=c.max_digits,
                operators=tuple(c.operators),
            )
        return self._datasets[key]

    @cached_property
    def _eval_questions(self) -> frozenset[str]:
        dataset = self._dataset("eval", 0)
        return frozenset(dataset[i]["question"] for i in range(self.config.num_eval))
