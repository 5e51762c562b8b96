"""The scoring process (``worker/orchestrator/scoring.py``): a real spawned worker scores single-turn completions
with the rewards in-process scoring gives, and a killed worker hands scoring back to the orchestrator process."""

from __future__ import annotations

import asyncio
import os
import random
import signal

from worker.envs import load_environment
from worker.orchestrator.scoring import ScoreProcess


def test_the_worker_gives_the_in_process_rewards() -> None:
    env = load_environment("reverse_text", split="train", seed=3)
    rng = random.Random(0)
    texts = ["".join(chr(rng.randrange(32, 127)) for _ in range(40)) for _ in range(6)]

    async def run() -> tuple[list[float | None] | None, list[float | None] | None, list[float | None]]:
        scoring = ScoreProcess([("reverse_text", {})], seed=3)
        try:
            answer = env.task(5).data.answer
            exact = await scoring.score(0, "train", 5, [answer, f"<reversed_text>{answer}</reversed_text>", ""], "rt")
            other = await scoring.score(0, "train", 9, texts, "rt")
            here = list(await asyncio.gather(*(env.score(env.task(9), t) for t in texts)))
            return exact, other, here
        finally:
            scoring.close()

    exact, other, here = asyncio.run(run())
    assert exact == [1.0, 1.0, 0.0]  # the true reversal, the same in its tags, and an empty reply (LCS ratio 0)
    assert other == here
    assert len({x for x in here if x is not None}) > 1  # distinct texts, distinct partial credits


def test_a_dead_worker_hands_scoring_back() -> None:
    async def run() -> tuple[list[float | None] | None, list[float | None] | None, bool]:
        scoring = ScoreProcess([("reverse_text", {})], seed=0)
        first = await scoring.score(0, "train", 0, ["x"], "rt")
        pool = scoring._pool
        assert pool is not None
        (pid,) = pool._processes  # the one worker
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        after = await scoring.score(0, "train", 0, ["x"], "rt")
        return first, after, scoring.alive

    first, after, alive = asyncio.run(run())
    assert first is not None and len(first) == 1 and first[0] is not None and 0.0 <= first[0] <= 1.0
    assert after is None  # the caller scores in process
    assert alive is False
