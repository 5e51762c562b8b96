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
``worker.alert_rules``) is also logged as ``<metric>/<env name>`` over that environment's groups alone; the
trainer does the same for ``mismatch_kl`` from each sample's ``env`` and evals for every eval metric.
"""

from __future__ import annotations

import bisect
import hashlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.orchestrator.data import TaskSampler
from worker.orchestrator.staleness import admitted, rollout_lag

if TYPE_CHECKING:
    from worker.batch import TrainSample
    from worker.envs import Environment
    from worker.orchestrator.batcher import Rollout
    from worker.spec import CurriculumConfig, EnvConfig, OrchestratorConfig


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

    def take(
        self, step: int, batch_size: int, spares: int = 0, curriculum: CurriculumConfig | None = None
    ) -> list[tuple[int, int]]:
        """``(env index, task index)`` of each of the ``batch_size`` groups of step ``step``, then of its ``spares``
        spare groups (gates: slots ``batch_size + j``); advances each environment's cursor (and draws from its
        curriculum) by the slots that chose it (steps are taken in order)."""
        if len(self.envs) == 1:
            return [(0, i) for i in self.envs[0].sampler.take(step, batch_size, spares, curriculum)]
        chosen = [choose_env(self.weights, self.seed, step, slot) for slot in range(batch_size + spares)]
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
    orch: OrchestratorConfig,
    names: list[str],
) -> dict[str, Any]:
    """Tag each trained sample with its group's ``env`` and return the step's per-env orchestrator metrics.

    Call once per step after ``build_batch`` (which set each rollout's ``advantage``). With one environment it
    does nothing (batches stay as they were before mixtures). Per environment e, over e's groups only, the metrics ``build_batch`` reports for the whole step
    (same definitions), named ``<metric>/<e>``. A candidate rollout (advantage set, group not dropped) that was not
    trained counts as ``dropped_stale`` when its lag exceeds ``max_off_policy_steps``, else ``dropped_overlong``.

    Args:
        groups: the step's rollout groups, each rollout's ``env`` set (``names[0]`` when empty).
        samples: ``build_batch``'s samples, each with its ``group`` index; gets an ``env`` key.

    Returns:
        ``{"reward_mean/<e>": ..., "num_samples/<e>": ..., ...}`` for every e of ``names`` (empty with one env).
    """
    if len(names) <= 1:
        return {}
    trained: dict[int, list[TrainSample]] = {}
    for s in samples:
        gi = s.get("group", -1)
        s["env"] = (groups[gi][0].env or names[0]) if 0 <= gi < len(groups) and groups[gi] else names[0]
        trained.setdefault(gi, []).append(s)
    out: dict[str, Any] = {}
    for name in names:
        mine = [(i, g) for i, g in enumerate(groups) if g and (g[0].env or names[0]) == name]
        rollouts = [r for _, g in mine for r in g]
        rewards = [r.reward for r in rollouts if r.reward is not None]
        lengths = [sum(r.loss_mask) for r in rollouts]
        lags = [rollout_lag(step, r.policy_span) for r in rollouts]
        env_samples = [s for i, _ in mine for s in trained.get(i, [])]
        dropped_zero = dropped_stale = dropped_overlong = all_missing = 0
        for i, g in mine:
            present = [r.advantage for r in g if r.advantage is not None]
            if not present:
                all_missing += all(r.reward is None for r in g)
                continue
            n_trained = len(trained.get(i, []))
            if n_trained == 0 and orch.drop_zero_advantage and all(a == 0 for a in present):
                dropped_zero += 1
                continue
            stale = sum(
                1
                for r in g
                if r.advantage is not None and not admitted(rollout_lag(step, r.policy_span), orch.max_off_policy_steps)
            )
            dropped_stale += stale
            dropped_overlong += len(present) - n_trained - stale
        trained_lags = [rollout_lag(step, (s["policy_span"][0], s["policy_span"][1])) for s in env_samples]
        values: dict[str, Any] = {
            "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
            "reward_std": statistics.pstdev(rewards) if rewards else float("nan"),
            "reward_missing": len(rollouts) - len(rewards),
            "groups_all_missing": all_missing,
            "advantage_abs_mean": statistics.fmean(abs(s["advantage"]) for s in env_samples) if env_samples else 0.0,
            "completion_len_mean": statistics.fmean(lengths) if lengths else 0.0,
            "completion_len_max": max(lengths, default=0),
            "truncated_fraction": sum(r.finish_reason == "length" for r in rollouts) / max(1, len(rollouts)),
            "staleness_mean": statistics.fmean(lags) if lags else 0.0,
            "staleness_max": max(lags, default=0),
            "trained_staleness_max": max(trained_lags, default=0),
            "dropped_stale": dropped_stale,
            "dropped_overlong": dropped_overlong,
            "dropped_zero_advantage_groups": dropped_zero,
            "num_groups": len(mine),
            "num_samples": len(env_samples),
        }
        out.update({env_metric(k, name): v for k, v in values.items()})
    return out


def combine_evals(results: dict[str, dict[str, float | int | None]]) -> dict[str, float | int | None]:
    """One eval's metrics over a mixture: each environment's under ``<metric>/<env>``, and the whole eval's
    (``reward_mean``, ``pass_at_k``, ``completion_len_mean`` weighted by each env's ``num_examples``; counts
    summed; ``k`` as is). With one environment, its results unchanged.

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
    out["num_examples"] = total
    out["reward_missing"] = sum(int(r["reward_missing"] or 0) for r in results.values())
    for env, r in results.items():
        out.update({env_metric(k, env): v for k, v in r.items() if k != "k"})
    return out
