"""Environment mixtures (``[[env]]``): which environment each group of a step samples, and per-env metrics.

A run's spec names one environment (``[env]``) or several (``[[env]]``, each with a ``name`` and a sampling
``weight``). Each group (slot ``s`` of step ``n``) draws its environment with probability ``w_e / sum(w)``:

    u = blake2b((seed, "env", n, s)) / 2**64  in [0, 1)       e = first env whose cumulative weight share exceeds u

so the choice is a function of the run seed and the place alone: a resumed or forked run repeats it (a fork that
changes ``orchestrator.batch_size`` keeps the choice of every slot that exists in both). Each environment keeps its
own data order and cursor (a ``data.TaskSampler``); a step takes from environment e as many tasks as slots drew
e. Checkpoints hold one cursor per environment: ``orchestrator/state.json`` for a single environment (as before
mixtures), ``orchestrator/envs/<name>/state.json`` for each environment of a mixture.

Per-env metrics: with more than one environment, every data-dependent metric of a step (``PER_ENV_METRICS`` of
``worker.tracking.alert_rules``) is also logged as ``<metric>/<env name>`` over that environment's groups alone; the
trainer does the same for ``mismatch_kl`` from each sample's ``env`` and evals for every eval metric.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.orchestrator.batcher import Rollout, step_metrics
from worker.orchestrator.data import TaskSampler
from worker.tracking.alert_rules import PER_ENV_METRICS

if TYPE_CHECKING:
    from worker.envs import Environment
    from worker.orchestrator.batch import TrainSample
    from worker.spec import CurriculumConfig, EnvConfig


def env_draw(seed: int, step: int, slot: int) -> float:
    """The uniform number in ``[0, 1)`` that picks the environment of group ``slot`` of step ``step``."""
    digest = hashlib.blake2b(repr((seed, "env", step, slot)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def choose_env(weights: Sequence[float], seed: int, step: int, slot: int) -> int:
    """Index of the environment group ``slot`` of step ``step`` samples: env i with probability
    ``weights[i] / sum(weights)``, the same for the same ``(seed, step, slot)``.

    Args:
        weights: sampling weights, each >= 0, not all 0 (the spec checks it: ``env.weight``).

    Returns:
        An index into ``weights`` whose weight is above 0.
    """
    total = sum(weights)
    cumulative, running = [], 0.0
    for w in weights:
        running += w
        cumulative.append(running / total)
    index = bisect.bisect_right(cumulative, env_draw(seed, step, slot))
    # float rounding can leave the last cumulative share a hair below 1: fall back to the last env with weight
    return min(index, max(i for i, w in enumerate(weights) if w > 0))


def env_metric(metric: str, env_name: str) -> str:
    """The per-env name of ``metric``: ``reward_mean/arithmetic``."""
    return f"{metric}/{env_name}"


@dataclass
class MixtureEnv:
    """One environment of the run: its spec table, train and eval splits, and its data cursor."""

    config: EnvConfig
    train: Environment
    eval: Environment
    sampler: TaskSampler


class EnvMixture:
    """The run's environments and the per-(step, slot) choice among them; hands out tasks as ``TaskSampler`` does.

    ``take(step, batch_size)`` returns ``(env index, task index)`` per slot, ``write_state(folder, step)`` writes
    every environment's cursor: the same calls as ``TaskSampler``, so the orchestrator drives either alike.
    """

    def __init__(self, envs: list[MixtureEnv], seed: int) -> None:
        self.envs, self.seed = envs, seed
        self.weights = [e.config.weight for e in envs]

    @classmethod
    def load(
        cls,
        configs: list[EnvConfig],
        part_dir: Path,
        *,
        step: int,
        seed: int,
        batch_size: int,
        curriculum: CurriculumConfig | None = None,
        max_async_level: int = 0,
    ) -> EnvMixture:
        """Load each environment's train and eval split and its cursor from the orchestrator part ``part_dir`` of
        checkpoint ``step`` (0: a fresh run); each environment keeps its own curriculum state (``curriculum``,
        ``max_async_level``: see ``TaskSampler.resume``).

        Raises:
            EnvironmentLoadError: an environment does not load (``worker.envs.load_environment``).
            ValueError: ``difficulty_pool`` with an endless taskset.
        """
        from worker.envs import load_environment

        envs = []
        for c in configs:
            train = load_environment(c.id, split="train", seed=seed, **c.args)
            evals = load_environment(c.id, split="eval", seed=seed, **c.args)
            folder = part_dir if len(configs) == 1 else part_dir / "envs" / c.name
            # a mixture's fallback cursor (a checkpoint without one) is a guess: the env's expected share
            share = c.weight / sum(x.weight for x in configs)
            sampler = TaskSampler.resume(
                folder,
                step=step,
                num_tasks=train.num_tasks,
                seed=seed,
                batch_size=round(batch_size * share),
                curriculum=curriculum,
                max_async_level=max_async_level,
            )
            envs.append(MixtureEnv(c, train, evals, sampler))
        return cls(envs, seed)

    @property
    def names(self) -> list[str]:
        return [e.config.name for e in self.envs]

    @property
    def position(self) -> int:
        """Tasks handed out so far over all environments (the sum of their cursors): the next global position."""
        return sum(e.sampler.cursor for e in self.envs)

    def take(
        self,
        step: int,
        batch_size: int,
        spares: int = 0,
        curriculum: CurriculumConfig | None = None,
        places: tuple[int, int] | None = None,
    ) -> list[tuple[int, int]]:
        """``(env index, task index)`` of each of the ``batch_size`` groups of step ``step``, then of its ``spares``
        spare groups (gates: slots ``batch_size + j``); advances each environment's cursor (and draws from its
        curriculum) by the slots that chose it (steps are taken in order).

        Args:
            places: ``(a, b)``: draw slot s's environment as ``choose_env(.., a, b + s)`` instead of ``(step, s)``
                (continuous admission: ``(CONTINUOUS_SEED, the chunk's first position)``, ``admission.py``).
        """
        if len(self.envs) == 1:
            return [(0, i) for i in self.envs[0].sampler.take(step, batch_size, spares, curriculum)]
        a, b = places if places is not None else (step, 0)
        chosen = [choose_env(self.weights, self.seed, a, b + slot) for slot in range(batch_size + spares)]
        tasks = [iter(e.sampler.take(step, chosen.count(i), 0, curriculum)) for i, e in enumerate(self.envs)]
        return [(env, next(tasks[env])) for env in chosen]

    def observe(
        self,
        step: int,
        groups: Sequence[tuple[tuple[int, int], Sequence[float | None]]],
        curriculum: CurriculumConfig,
    ) -> dict[str, Any]:
        """Feed step ``step``'s started groups ``((env index, task index), rewards)`` to each environment's
        curriculum (every environment sees every step, in order, even one no group of the step chose).

        Returns:
            The curriculum metrics (``TaskSampler.observe``): summed over the environments, and per environment as
            ``<metric>/<env name>`` when there are several.
        """
        metrics: dict[str, Any] = {}
        for i, e in enumerate(self.envs):
            mine = [(task, rewards) for (env, task), rewards in groups if env == i]
            for key, value in e.sampler.observe(step, mine, curriculum).items():
                metrics[key] = metrics.get(key, 0) + value
                if len(self.envs) > 1:
                    metrics[env_metric(key, e.config.name)] = value
        return metrics

    def write_state(self, part_dir: Path, step: int) -> None:
        """Write every environment's cursor after step ``step`` into the orchestrator part ``part_dir``."""
        if len(self.envs) == 1:
            self.envs[0].sampler.write_state(part_dir, step)
            return
        for e in self.envs:
            folder = part_dir / "envs" / e.config.name
            folder.mkdir(parents=True, exist_ok=True)
            e.sampler.write_state(folder, step)


# ----------------------------------------------------------------------------- per-env metrics


def env_step_metrics(
    step: int,
    groups: list[list[Rollout]],
    samples: list[TrainSample],
    names: list[str],
) -> dict[str, Any]:
    """Tag each trained sample with its group's ``env`` and return the step's per-env orchestrator metrics.

    Call once per step after ``build_batch`` (which set each rollout's ``advantage`` and ``dropped``, counted where
    the drop happened). With one environment it does nothing (batches stay as they were before mixtures). Per
    environment e, over e's groups only, the metrics of ``PER_ENV_METRICS`` that ``batcher.step_metrics`` reports
    for the whole step (same function, same definitions: a group dropped for a stale member counts all its rollouts
    with a reward in ``dropped_stale/<e>`` and once in ``dropped_stale_groups/<e>``), named ``<metric>/<e>``.

    Args:
        groups: the step's rollout groups, each rollout's ``env`` set (``names[0]`` when empty).
        samples: ``build_batch``'s samples, each with its ``group`` index; gets an ``env`` key.

    Returns:
        ``{"reward_mean/<e>": ..., "num_samples/<e>": ..., ...}`` for every e of ``names`` (empty with one env).
    """
    if len(names) <= 1:
        return {}

    def env_of(group: Sequence[Rollout]) -> str:
        return (group[0].env or names[0]) if group else names[0]

    for s in samples:
        gi = s.get("group", -1)
        s["env"] = env_of(groups[gi]) if 0 <= gi < len(groups) else names[0]
    out: dict[str, Any] = {}
    for name in names:
        values = step_metrics(step, [g for g in groups if g and env_of(g) == name])
        out.update({env_metric(k, name): v for k, v in values.items() if k in PER_ENV_METRICS["orchestrator"]})
    return out


def combine_evals(results: dict[str, dict[str, float | int | None]]) -> dict[str, float | int | None]:
    """One eval's metrics over a mixture: each environment's under ``<metric>/<env>``, and the whole eval's
    (``reward_mean``, ``pass_at_k``, ``completion_len_mean`` weighted by each env's ``num_examples``; counts
    summed; ``k`` and ``n`` as is). With one environment, its results unchanged.

    Args:
        results: env name -> ``worker.orchestrator.eval.evaluate``'s result.
    """
    if len(results) == 1:
        return next(iter(results.values()))
    out: dict[str, float | int | None] = {}
    total = sum(int(r["num_examples"] or 0) for r in results.values())
    for name in ("reward_mean", "pass_at_k", "completion_len_mean"):
        parts = [(float(v), int(r["num_examples"] or 0)) for r in results.values() if (v := r[name]) is not None]
        out[name] = sum(v * n for v, n in parts) / total if total else float("nan")
    out["k"] = next(iter(results.values()))["k"]
    if "n" in next(iter(results.values())):
        out["n"] = next(iter(results.values()))["n"]
    out["num_examples"] = total
    out["reward_missing"] = sum(int(r["reward_missing"] or 0) for r in results.values())
    for env, r in results.items():
        out.update({env_metric(k, env): v for k, v in r.items() if k not in ("k", "n")})
    return out
