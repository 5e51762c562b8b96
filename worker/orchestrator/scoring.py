"""Scoring of single-turn groups in a separate process, off the orchestrator's event loop.

verifiers' ``Task.score`` costs ~0.2 ms a completion (most of it its per-call hook discovery, ``inspect.signature``
and the pydantic trace, ``benchmarks/orchestrator_scale.py``): at thousands of rollouts/s that is most of the one
core the orchestrator's event loop has. A step of at least ``SCORE_PROCESS_MIN_ROLLOUTS`` rollouts scores its
single-turn groups in one worker process instead, which rebuilds the run's environments from their config
(``worker.envs.load_environment`` with the same id, split, seed and args as ``EnvMixture.load``), so task ``index``
is the same task there and the same reward functions score it: the rewards are those in-process scoring gives.
A worker that dies (``BrokenProcessPool``) is not replaced: a warning, and the groups score in this process again.
Smaller runs (and evals, multi-turn, self-play and harness groups) score in the orchestrator process as before.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any

from worker.tracking import progress

if TYPE_CHECKING:
    from worker.envs import Environment

SCORE_PROCESS_MIN_ROLLOUTS = 512
"""Rollouts per step (``batch_size * group_size``) from which single-turn groups are scored in a worker process:
below it the process (~200 MB, seconds to import verifiers) costs more than the loop time it saves."""
WORKER_NICENESS = 5
"""The worker's niceness above the orchestrator's: scoring is throughput work, and where both want the one core left
the event loop (requests, weight updates, batches) runs first; the worker takes the CPU the loop leaves
(``benchmarks/orchestrator_scale.py``: loop lag p99 at 4,096 rollouts in flight, section 11)."""
logger = logging.getLogger("asyncrl.orchestrator")

_CONFIGS: list[tuple[str, dict[str, Any]]] = []
_SEED = 0
_ENVS: dict[tuple[int, str], Environment] = {}
_LOOP: asyncio.AbstractEventLoop | None = None


def _init(configs: list[tuple[str, dict[str, Any]]], seed: int) -> None:
    global _SEED, _LOOP
    os.nice(WORKER_NICENESS)
    _CONFIGS[:] = configs
    _SEED = seed
    _LOOP = asyncio.new_event_loop()


def _env(env: int, split: str) -> Environment:
    if (env, split) not in _ENVS:
        from worker.envs import load_environment

        env_id, args = _CONFIGS[env]
        _ENVS[env, split] = load_environment(env_id, split=split, seed=_SEED, **args)  # type: ignore[arg-type]
    return _ENVS[env, split]


def _warm(envs: int) -> int:
    for env in range(envs):
        _env(env, "train")
    return envs


def _score(env: int, split: str, index: int, texts: list[str]) -> list[float | None]:
    environment = _env(env, split)
    task = environment.task(index)
    assert _LOOP is not None
    return _LOOP.run_until_complete(_gather(environment, task, texts))


async def _gather(environment: Environment, task: Any, texts: list[str]) -> list[float | None]:
    return list(await asyncio.gather(*(environment.score(task, text) for text in texts)))


class ScoreProcess:
    """One worker process scoring single-turn completions of the run's environments (module docstring).

    Args:
        configs: ``(env id, env args)`` of each environment of the run, in ``spec.envs`` order.
        seed: the run's seed (``spec.seed``), as ``EnvMixture.load`` gives it.
    """

    def __init__(self, configs: list[tuple[str, dict[str, Any]]], seed: int) -> None:
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init,
            initargs=(configs, seed),
        )
        self._pool.submit(_warm, len(configs))  # the import and environment load start now, beside the warm-up

    @property
    def alive(self) -> bool:
        """False once the worker died: groups score in the orchestrator process again."""
        return self._pool is not None

    async def score(self, env: int, split: str, index: int, texts: list[str], name: str) -> list[float | None] | None:
        """The rewards of ``texts`` as completions of task ``index`` of environment ``env``'s ``split`` (each as
        ``Environment.score`` gives it: None when unscored), or None when the worker process is gone (the caller
        scores in process then). ``name``: the environment's id in the progress record's calls in flight.

        Raises:
            Exception: what a reward function raised (as in-process scoring would).
        """
        if self._pool is None:
            return None
        try:
            with progress.recorder.call("environment", f"{name} score (scoring process)"):
                return await asyncio.get_running_loop().run_in_executor(self._pool, _score, env, split, index, texts)
        except BrokenProcessPool as e:
            if self._pool is not None:
                logger.warning("the scoring process died (%s): scoring in the orchestrator process from now on", e)
                self.close()
            return None

    def close(self) -> None:
        """Stop the worker (queued scores are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
