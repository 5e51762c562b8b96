"""Orchestrator process: environments -> rollouts -> rewards -> advantages -> packed batches.

One asyncio process wiring single-purpose parts (prime-rl's orchestrator shape):

- **producer**: for step n, waits until inference serves policy version
  >= n - 1 - min(max_async_level, max_off_policy_steps) (the start gate of ``staleness.py``; the wait is
  ``wait_for_policy``; 0 async levels = on-policy), then starts the step's groups by the environment's
  rollout path (``rollouts.py``).
  Step n takes the next B = batch_size tasks of the data order after the cursor, which each checkpoint
  saves (``data.TaskSampler``), so a resumed or forked run continues right after its parent's tasks.
  A ``difficulty_pool`` curriculum draws them by each task's pass rate instead (``curriculum.py``); with gates, a
  rejected group is replaced by a group of one of the step's spare tasks (``gates.py``).
- **group rollout**: one vLLM request with ``n = group_size`` on the chat-templated prompt ids; the
  completion token ids and sampled-token logprobs come from vLLM (never re-tokenized); rewards come
  from the environment's own reward functions; the request records the policy-version span
  ``[v_start, v_end]`` it ran under.
- **batcher** (main loop, in step order): drops rollouts whose lag ``(n - 1) - v_start`` exceeds
  ``max_off_policy_steps`` (``staleness.py``) and groups with zero advantage, packs samples into micro-batches of at
  most ``seq_len`` tokens, writes ``batches/step_n.json``, logs metrics and rollouts, checkpoints.
- **weight watcher**: when the trainer publishes a newer version, pause inference (in-flight
  requests kept), load the weights in place (by path, or received over the weight-sync process group:
  ``worker/weight_sync/load.py``), reset the prefix cache, resume.
- **eval**: held-out reward and pass@k at the start, every ``eval.interval`` steps and at the end.

Run as ``python -m worker.orchestrator --run-dir DIR --inference-url URL [--resume-step K]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from worker.batch import TrainSample, write_batch
from worker.checkpoint import due as checkpoint_due
from worker.checkpoint import write_part
from worker.envs import Environment
from worker.inference.client import InferenceClient, InferenceError
from worker.live_config import LiveConfig
from worker.lora_adapters import ADAPTER_CONFIG, adapters_in_use, lora_adapter_name
from worker.orchestrator import advantages
from worker.orchestrator.batcher import Rollout, build_batch
from worker.orchestrator.data import request_seed
from worker.orchestrator.eval import evaluate
from worker.orchestrator.gates import GatedStep, fill_batch, group_rejects
from worker.orchestrator.harness import HarnessRunner
from worker.orchestrator.mixture import EnvMixture, combine_evals, env_step_metrics
from worker.orchestrator.rollouts import rollout_group
from worker.orchestrator.staleness import min_start_version
from worker.packing import pack, pack_shared_prompt, prompt_keys
from worker.policy_check import (
    DEFAULT_TOLERANCE,
    LORA_UNSUPPORTED,
    PolicyCheckFailed,
    compare,
    read_logprobs,
    read_probe,
)
from worker.policy_check import applies as policy_check_applies
from worker.rundir import RunDir, append_jsonl, read_jsonl
from worker.spec import OrchestratorConfig, RLSpec

T = TypeVar("T")
TRUNCATED_WARN_FRACTION = 0.5
"""Above this fraction of a step's rollouts stopped at ``max_tokens``, the orchestrator warns (case C24)."""
logger = logging.getLogger("asyncrl.orchestrator")
_STEP_SPEC: contextvars.ContextVar[RLSpec] = contextvars.ContextVar("asyncrl_step_spec")
"""The spec a step's rollout tasks were requested with (set in the context of each step's task)."""


class Orchestrator:
    def __init__(self, spec: RLSpec, run: RunDir, inference_url: str, start_step: int) -> None:
        from transformers import AutoTokenizer

        self.spec, self.run, self.start_step = spec, run, start_step
        inf = spec.inference
        self.client = InferenceClient(
            inference_url,
            connect_timeout_s=inf.connect_timeout_s,
            read_timeout_s=inf.read_timeout_s,
            max_retries=inf.max_retries,
        )
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model.name)
        self.sampler = EnvMixture.load(
            spec.envs,
            run.checkpoint_dir(start_step) / "orchestrator",
            step=start_step,
            seed=spec.seed,
            batch_size=spec.orchestrator.batch_size,
            curriculum=spec.orchestrator.curriculum,
            max_async_level=spec.orchestrator.max_async_level,
        )
        """The run's environments (``[[env]]``: a mixture) and each step's (env, task index) pairs, from the data
        cursors (and curriculum state) of the checkpoint resumed from."""
        self.train_env: Environment = self.sampler.envs[0].train
        self.eval_env: Environment = self.sampler.envs[0].eval
        self.harness: HarnessRunner | None = (
            HarnessRunner(spec.model.name, inference_url, spec.orchestrator.harness)
            if any(e.train.needs_harness for e in self.sampler.envs)
            else None
        )
        """Runs rollouts of tasksets with tools through verifiers' agent harness (None for other tasksets)."""
        self._gated: dict[int, GatedStep[tuple[int, int], list[Rollout]]] = {}
        """Every group each step started (rejected ones too) and its gate counts, until the main loop observes it."""
        self.advantage = advantages.make_advantage(spec.orchestrator.advantage, env=spec.envs[0].name)
        advantages.restore_state(self.advantage, run.checkpoint_dir(start_step) / "orchestrator")
        """The run's advantage (``rae``: baselines carried across steps), restored from the checkpoint resumed from."""
        self.policy_version = start_step
        self._version_changed = asyncio.Condition()
        self._adapters: list[str] = []
        """A LoRA run's adapters loaded on the server, oldest first (at most ``adapters_in_use`` are kept)."""
        self._steps: dict[int, asyncio.Task[tuple[list[list[Rollout]], float, float]]] = {}
        self._step_specs: dict[int, RLSpec] = {}
        self._evaluated = {
            r["step"] for r in read_jsonl(run.metrics) if r["source"] == "eval" and r["step"] <= start_step
        }
        """Policy versions already evaluated: a second eval of the same weights is skipped (its metric key would
        collide with the first's, and with seeded sampling it would give the same numbers)."""
        self._truncation_warned = False
        self._policy_check_warned: set[int] = set()
        """Versions whose failed served-policy check was warned about already (``on_fail = "warn"``); -1: the LoRA skip."""
        self._policy_check_failure: tuple[int, str] | None = None
        """The (version, reason) of the last failed served-policy check, until :meth:`fail_policy_check` sees it."""
        self.live = LiveConfig(run.root, "orchestrator", start_step=start_step)
        self.weight_sync = None
        """Loads versions the trainer sends over the weight-sync process group (None: filesystem only)."""
        if spec.trainer.weight_sync.kind == "process_group":
            from worker.weight_sync.load import WeightReceiver

            self.weight_sync = WeightReceiver(self.client, run, spec.trainer.weight_sync)

    @property
    def spec(self) -> RLSpec:
        """The spec in effect. Inside a step's rollout tasks: the one that step was requested with, so a live
        config revision applied for a later step never changes rollouts already requested (their
        ``temperature`` record stays the one they were sampled at)."""
        return _STEP_SPEC.get(self._spec)

    @spec.setter
    def spec(self, value: RLSpec) -> None:
        self._spec = value

    # ------------------------------------------------------------------ policy versions

    async def load_policy(self, path: Path, version: int) -> float:
        """Pause (in-flight requests kept), load weights in place, reset prefix cache, resume; seconds.

        A LoRA policy version (``path`` holds ``adapter_config.json``: ``[trainer.lora]``) is loaded as vLLM adapter
        ``lora_adapter_name(run, version)`` instead, and rollouts from then on name it as their ``model``; adapters
        older than the newest ``adapters_in_use(max_async_level)`` are unloaded (``worker/lora_adapters.py``: running
        rollouts may still name the others). A full model folder (a LoRA run's version 0 on a shared server) is
        loaded in place and rollouts name the base model.
        """
        adapter = lora_adapter_name(self.run.root, version) if (path / ADAPTER_CONFIG).is_file() else None
        load: Callable[[Path], Awaitable[dict[str, Any]]] | None
        if adapter is not None:

            async def load(folder: Path) -> dict[str, Any]:
                return await self.client.load_lora_adapter(adapter, folder)

        else:
            load = self.weight_sync.load if self.weight_sync is not None else None
        info = await self.client.publish_weights(path, load=load)
        async with self._version_changed:
            self.client.model = adapter  # None: the server's base model
            if self.harness is not None:
                self.harness.adapter = adapter
            self.policy_version = version
            self._version_changed.notify_all()
        if adapter is not None and adapter not in self._adapters:  # a resume may load the last version again
            self._adapters.append(adapter)
            while len(self._adapters) > adapters_in_use(self.spec.orchestrator.max_async_level):
                old = self._adapters.pop(0)
                try:
                    await self.client.unload_lora_adapter(old)
                except InferenceError as e:  # the run goes on; the server keeps one more small adapter
                    logger.warning("could not unload LoRA adapter %s: %s", old, e)
        return float(info["total_s"])

    async def watch_weights(self) -> None:
        while True:
            latest = self.run.latest_stable_weights()
            if latest is not None and latest[0] > self.policy_version:
                version, path = latest
                seconds = await self.load_policy(path, version)
                checked = await self.check_policy(version)
                self.run.log_metrics("inference", version, {"weight_update_s": seconds, **checked})
                self.fail_policy_check(version)
                logger.info("policy version %d loaded in %.2fs", version, seconds)
            await asyncio.sleep(0.05)

    async def check_policy(self, version: int, wait_s: float = 0.0) -> dict[str, float | int | None]:
        """The served-policy check of ``version``, just loaded (``[orchestrator.policy_check]``,
        ``worker/policy_check.py``): inference's log-probs of the trainer's probe against the trainer's under
        ``version`` and under the base. Returns its metrics (``policy_check_max_abs_diff``, ``policy_moved_from_base``;
        none when the check is off or the trainer has fixed no probe yet); a failure is logged as a
        ``policy_check_failed`` event and kept for :meth:`fail_policy_check`. ``wait_s``: how long to wait for the
        trainer's log-probs of ``version`` (a resume's version is written by the trainer after it starts).

        An unanswered probe request skips the check of that version with a warning (the rollouts' own requests fail
        the run when inference is gone).
        """
        check = self.spec.orchestrator.policy_check
        self._policy_check_failure = None
        if check.enabled and not policy_check_applies(self.spec) and -1 not in self._policy_check_warned:
            self._policy_check_warned.add(-1)  # said once
            logger.warning("%s", LORA_UNSUPPORTED)
        probe = read_probe(self.run) if policy_check_applies(self.spec) else None
        if probe is None:
            return {}
        deadline = time.monotonic() + wait_s
        trainer = read_logprobs(self.run, version)
        while trainer is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            trainer = read_logprobs(self.run, version)
        base = read_logprobs(self.run, 0)
        if trainer is None or base is None:
            logger.warning("policy check of version %d skipped: the trainer wrote no log-probs of it", version)
            return {}
        try:
            served = await asyncio.gather(
                *(
                    self.client.prompt_logprobs(s, i)
                    for s, i in zip(probe.sequences, probe.completion_start, strict=True)
                )
            )
        except InferenceError as e:  # a server that died fails the run through its rollouts; this check only warns
            logger.warning("policy check of version %d skipped: inference did not answer the probe: %s", version, e)
            return {}
        tolerance = check.tolerance or DEFAULT_TOLERANCE[self.spec.model.dtype]
        result = compare(version, served, trainer, base, tolerance=tolerance, base_updates=check.base_updates)
        logger.info(
            "policy check of version %d: max |served - trainer| %.3g, moved from base %s (tolerance %g)",
            version,
            result.max_abs_diff,
            result.moved_from_base,
            tolerance,
        )
        if result.reason is not None and version not in self._policy_check_warned:
            self._policy_check_warned.add(version)
            self.run.log_event(
                "policy_check_failed",
                process="orchestrator",
                step=version,
                max_abs_diff=result.max_abs_diff,
                moved_from_base=result.moved_from_base,
                tolerance=tolerance,
                on_fail=check.on_fail,
                reason=result.reason,
            )
            logger.warning("%s", result.reason)
            self._policy_check_failure = (version, result.reason)
        return result.metrics()

    def fail_policy_check(self, version: int) -> None:
        """Raise the failure :meth:`check_policy` found for ``version`` (after its metrics were logged), unless
        ``orchestrator.policy_check.on_fail`` is ``warn``.

        Raises:
            PolicyCheckFailed: the served policy is not the published one.
        """
        failure = self._policy_check_failure
        if failure is not None and failure[0] == version and self.spec.orchestrator.policy_check.on_fail == "fail":
            raise PolicyCheckFailed(failure[1])

    async def wait_for_version(self, version: int) -> float:
        t0 = time.perf_counter()
        async with self._version_changed:
            await self._version_changed.wait_for(lambda: self.policy_version >= version)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ rollouts

    def _seed(self, *where: int) -> int | None:
        """The request seed of a place in the run (``data.request_seed``), None with ``seeded_sampling`` off."""
        return request_seed(self.spec.seed, *where) if self.spec.orchestrator.seeded_sampling else None

    async def rollout_group(self, index: int, seed: int | None, env: int = 0) -> list[Rollout]:
        orch = self.spec.orchestrator
        max_len = min(orch.seq_len, self.spec.inference.max_model_len)
        group = await rollout_group(
            self.client,
            self.tokenizer,
            self.sampler.envs[env].train,
            index,
            harness=self.harness,
            n=orch.group_size,
            max_tokens=orch.max_tokens,
            temperature=orch.temperature,
            policy_version=lambda: self.policy_version,
            max_len=max_len,
            # harness: no new model turn once a call's context leaves less than max_tokens of max_len (a longer
            # sample is dropped by build_batch as dropped_overlong)
            max_total_tokens=max(1, max_len - orch.max_tokens),
            seed=seed,
        )
        for r in group:
            r.env = self.sampler.envs[env].config.name
        return group

    async def generate_step(
        self, step: int, indices: list[tuple[int, int]], spares: list[tuple[int, int]] | None = None
    ) -> list[list[Rollout]]:
        """The step's groups, one per (env, task index) of ``indices``; with gates, rejected groups are replaced by
        groups of the ``spares`` (``gates.fill_batch``; spare j is requested as slot ``len(indices) + j``)."""
        groups = (self.rollout_group(index, self._seed(step, slot), env) for slot, (env, index) in enumerate(indices))
        done = list(await asyncio.gather(*groups))
        orch = self.spec.orchestrator
        if not orch.gates:
            self._gated[step] = GatedStep(kept=done, started=list(zip(indices, done, strict=True)))
            return done

        def start(j: int, task: tuple[int, int]) -> Awaitable[list[Rollout]]:
            return self.rollout_group(task[1], self._seed(step, len(indices) + j), task[0])

        self._gated[step] = gated = await fill_batch(
            indices, done, spares or [], group_rejects(orch.gates, orch.advantage), start
        )
        return gated.kept

    def observe_step(self, step: int, orch: OrchestratorConfig) -> dict[str, Any]:
        """Feed every group step ``step`` started to the curriculum (in step order); its curriculum and gate metrics."""
        gated = self._gated.pop(step)
        started = [(task, [r.reward for r in group]) for task, group in gated.started]
        metrics = self.sampler.observe(step, started, orch.curriculum)
        return {**metrics, **(gated.metrics() if orch.gates else {})}

    async def produce(self) -> None:
        for step in range(self.start_step + 1, self.spec.max_steps + 1):
            orch = self.spec.orchestrator  # the gate: min(max_async_level, max_off_policy_steps) (case C23)
            waited = await self.wait_for_version(
                min_start_version(step, orch.max_async_level, orch.max_off_policy_steps)
            )
            # step boundary: live config revisions apply to every rollout, batch and eval of this step on
            self.spec, _ = self.live.apply(self._spec, step)
            self._step_specs[step] = self._spec
            context = contextvars.copy_context()
            context.run(_STEP_SPEC.set, self._spec)
            orch = self._spec.orchestrator
            spares = orch.max_resample if orch.gates else 0
            indices = self.sampler.take(step, orch.batch_size, spares, orch.curriculum)
            self._steps[step] = asyncio.create_task(
                self._timed(self.generate_step(step, indices[: orch.batch_size], indices[orch.batch_size :]), waited),
                context=context,
            )

    @staticmethod
    async def _timed(coro: Any, waited: float) -> tuple[Any, float, float]:
        t0 = time.perf_counter()
        result = await coro
        return result, waited, time.perf_counter() - t0

    # ------------------------------------------------------------------ batches

    def write_step(self, step: int, samples: list[TrainSample]) -> None:
        orch = self.spec.orchestrator
        lengths = [len(s["input_ids"]) for s in samples]
        if orch.share_prompt:
            prefix_lens = [s.get("prefix_len", 0) for s in samples]
            bins = pack_shared_prompt(lengths, prefix_lens, prompt_keys(samples), orch.seq_len)
        else:
            bins = pack(lengths, orch.seq_len)
        write_batch(
            self.run.batch(step),
            {
                "step": step,
                "num_samples": len(samples),
                "num_loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
                "micro_batches": [[samples[i] for i in b] for b in bins],
            },
        )

    def save_state(self, step: int) -> None:
        """The orchestrator part of checkpoint ``step``: the data cursor after the step's tasks (``TaskSampler``) and the
        advantage's state after scoring the step (``advantage_state.json``, stateful types only)."""

        def write(folder: Path) -> None:
            self.sampler.write_state(folder, step)
            advantages.write_state(self.advantage, folder)

        write_part(self.run, step, "orchestrator", write)

    def warn_truncated(self, step: int, fraction: float, max_tokens: int) -> None:
        """Case C24: when more than ``TRUNCATED_WARN_FRACTION`` of a step's rollouts hit ``max_tokens``, a console
        warning and a ``truncated`` event in ``events.jsonl``; once, and again only after it fell back below. (An
        alert rule on ``truncated_fraction`` does the same for the service.)"""
        if fraction <= TRUNCATED_WARN_FRACTION:
            self._truncation_warned = False
            return
        if self._truncation_warned:
            return
        self._truncation_warned = True
        reason = (
            f"step {step}: {fraction:.0%} of the rollouts stopped at orchestrator.max_tokens = {max_tokens} "
            f"(above {TRUNCATED_WARN_FRACTION:.0%}): their answers are cut; raise max_tokens"
        )
        logger.warning("%s", reason)
        self.run.log_event("truncated", step=step, fraction=fraction, max_tokens=max_tokens, reason=reason)

    # ------------------------------------------------------------------ evals

    async def run_eval(self) -> dict[str, float | int | None] | None:
        """Evaluate the policy version inference serves now (``eval`` metrics at that version); None when that
        version was evaluated already."""
        ev = self.spec.orchestrator.eval
        version = self.policy_version
        if version in self._evaluated:
            logger.info("eval at policy version %d: done already, skipped", version)
            return None
        self._evaluated.add(version)
        results = {}
        for env in self.sampler.envs:  # each environment of a mixture on its own eval split
            results[env.config.name] = await evaluate(
                self.client,
                env.eval,
                self.tokenizer,
                num_examples=ev.num_examples,
                temperature=ev.temperature,
                max_tokens=self.spec.orchestrator.max_tokens,
                max_len=min(self.spec.orchestrator.seq_len, self.spec.inference.max_model_len),
                pass_k=ev.pass_k,
                pass_threshold=ev.pass_threshold,
                harness=self.harness,
                seed=self._seed(-1, version),  # -1: eval requests never share a seed with a training step's
            )
        result = combine_evals(results)
        self.run.log_metrics("eval", version, result)
        logger.info("eval at policy version %d: %s", version, result)
        return result

    # ------------------------------------------------------------------ main loop

    async def main_loop(self) -> None:
        spec = self.spec
        await self.client.wait_ready(spec.inference.startup_timeout_s)
        if self.weight_sync is not None:  # the vLLM workers join the trainer's group (warning + filesystem on failure)
            await self.weight_sync.join(spec.inference.startup_timeout_s, start_step=self.start_step)
        if self.start_step > 0:
            trainer_part = self.run.checkpoint_dir(self.start_step) / "trainer"
            if (trainer_part / "adapter").is_dir():  # a LoRA checkpoint: its adapter (worker/trainer/checkpointer.py)
                trainer_part = trainer_part / "adapter"
            seconds = await self.load_policy(trainer_part, self.start_step)
            # the served-policy check of the resumed version, before the first rollout (the trainer writes its
            # log-probs once it loaded the checkpoint, when the attempt before had not)
            checked = await self.check_policy(self.start_step, wait_s=spec.inference.startup_timeout_s)
            if not any(
                r["source"] == "inference" and r["step"] == self.start_step for r in read_jsonl(self.run.metrics)
            ):
                # the attempt before stopped ahead of loading it: this load is version start_step's update
                self.run.log_metrics("inference", self.start_step, {"weight_update_s": seconds, **checked})
            self.fail_policy_check(self.start_step)
        elif spec.inference.url is not None and Path(spec.model.name).is_dir():
            await self.load_policy(Path(spec.model.name), 0)  # a shared server may hold another run's weights
        if self.start_step == 0:
            await self.run_eval()
        watcher = asyncio.create_task(self.watch_weights())
        producer = asyncio.create_task(self.produce())
        try:
            for step in range(self.start_step + 1, spec.max_steps + 1):
                while step not in self._steps:
                    await asyncio.sleep(0.01)
                    raise_failed(producer, watcher)
                t0 = time.perf_counter()
                groups, wait_for_policy, generation_s = await until(self._steps.pop(step), watcher)
                gen_s = time.perf_counter() - t0
                step_spec = self._step_specs.pop(step)
                rejected = self._gated[step].dropped()  # gate-rejected groups: finished, never trained
                samples, metrics = build_batch(step, groups, step_spec.orchestrator, self.advantage, rejected)
                metrics.update(self.observe_step(step, step_spec.orchestrator))  # before the trainer sees the batch
                metrics.update(env_step_metrics(step, groups, samples, self.sampler.names))
                self.write_step(step, samples)
                for group in groups:
                    for r in group:
                        append_jsonl(self.run.rollout_file(step), r.record(step))
                n_tokens = sum(len(r.completion_ids) for g in groups for r in g)
                self.run.log_metrics(
                    "orchestrator",
                    step,
                    {
                        **metrics,
                        "wait_for_policy_s": wait_for_policy,
                        "rollout_tokens": n_tokens,
                        "generation_s": generation_s,
                        "rollout_tokens_per_s": n_tokens / generation_s if generation_s > 0 else 0.0,
                        "batch_wait_s": gen_s,
                        "policy_version": self.policy_version,
                        "temperature": step_spec.orchestrator.temperature,
                    },
                )
                self.warn_truncated(step, metrics["truncated_fraction"], step_spec.orchestrator.max_tokens)
                if checkpoint_due(self.run, step, spec.ckpt.interval):
                    self.save_state(step)
                ev = step_spec.orchestrator.eval
                if ev.interval and step % ev.interval == 0 and step < spec.max_steps:
                    await self.run_eval()
            await until(self.wait_for_version(spec.max_steps), watcher)
            await self.run_eval()
        finally:
            for task in (watcher, producer, *self._steps.values()):
                task.cancel()
            await self.client.aclose()


def raise_failed(*tasks: asyncio.Task[Any]) -> None:
    """Raise the error of the first of ``tasks`` that ended with one (a task that ended cleanly is fine)."""
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]  # checked not None on the line above


async def until(aw: Awaitable[T], *watched: asyncio.Task[Any]) -> T:
    """``await aw``, unless one of the ``watched`` background tasks (the weight watcher) fails first: then its error
    is raised here and ``aw`` is cancelled, so a failed weight update ends the run instead of hanging it.

    Raises:
        Exception: the first error of a watched task, or of ``aw``.
    """
    main = asyncio.ensure_future(aw)
    pending: set[asyncio.Future[Any]] = {main, *watched}
    while True:
        raise_failed(*watched)
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if main in done:
            return main.result()
        if any(t.exception() is not None for t in done if not t.cancelled()):
            main.cancel()
            raise_failed(*watched)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.orchestrator")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--inference-url", required=True)
    parser.add_argument("--resume-step", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run = RunDir(args.run_dir)
    spec = RLSpec.model_validate_json(run.config.read_text())
    orchestrator = Orchestrator(spec, run, args.inference_url, args.resume_step)
    try:
        asyncio.run(orchestrator.main_loop())
    except (InferenceError, PolicyCheckFailed) as err:
        run.log_event("failed", process="orchestrator", reason=str(err))
        logger.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
