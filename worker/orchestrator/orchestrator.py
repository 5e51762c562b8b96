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
  With ``orchestrator.admission = "continuous"`` it keeps ``groups_in_flight()`` groups running instead and each step's
  batch takes the first groups to finish (``admission.py``: chunks of tasks, seeds, stale drops, checkpoint cursor).
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
- **eval**: held-out reward and pass@k at the start, every ``eval.interval`` steps and at the end; the eval of step
  n is of policy version n (it waits for the trainer's version n: the version served when batch n is written is
  older, up to ``max_async_level`` behind, so evals would land at steps 8/18/28 of an interval of 10).
- **server metrics**: samples vLLM's own ``/metrics`` of every inference server each second (KV-cache use, running and
  waiting requests, preemptions, prefix-cache hits) and logs them with each step as the ``vllm`` metrics
  (``worker/inference/server_metrics.py``); a failed sample is warned about once and never fails the run.
- **replicas** (``inference.replicas`` / ``inference.urls``, one ``--inference-url`` each): a ``ReplicaPool``
  (``worker/inference/pool.py``) routes each rollout group to one replica, publishes each version to all of them and
  drops / takes back a lost one; one URL: the single client, as above.

Run as ``python -m worker.orchestrator --run-dir DIR --inference-url URL [--inference-url URL2 ...] [--resume-step K]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from worker.envs import Environment
from worker.inference.client import InferenceClient, InferenceError
from worker.inference.pool import Loader, Replica, ReplicaPool
from worker.inference.server import seeded
from worker.inference.server_metrics import ServerMetricsSampler
from worker.inference.warmup import warm_up
from worker.live_config import LiveConfig
from worker.orchestrator import advantages, heap
from worker.orchestrator.admission import CONTINUOUS_SEED, AdmissionQueue, Start, group_start_version
from worker.orchestrator.batch import Batch, TrainSample, encode_batch
from worker.orchestrator.batcher import Rollout, batch_groups, batch_metrics, encode_records
from worker.orchestrator.data import request_seed
from worker.orchestrator.eval import evaluate
from worker.orchestrator.gates import GatedStep, fill_batch, group_rejects
from worker.orchestrator.harness import HarnessRunner, serving_tools
from worker.orchestrator.mixture import EnvMixture, combine_evals, env_step_metrics
from worker.orchestrator.packing import pack, pack_shared_prompt, prompt_keys
from worker.orchestrator.policy_check import (
    LORA_UNSUPPORTED,
    CheckResult,
    PolicyCheckFailed,
    Probe,
    compare,
    default_tolerance,
    max_abs_diff,
    read_base_served_diff,
    read_logprobs,
    read_probe,
    write_base_served_diff,
)
from worker.orchestrator.policy_check import applies as policy_check_applies
from worker.orchestrator.rollouts import rollout_group
from worker.orchestrator.scoring import SCORE_PROCESS_MIN_ROLLOUTS, ScoreProcess
from worker.orchestrator.staleness import min_start_version
from worker.policy.lora_adapters import ADAPTER_CONFIG, adapters_in_use, lora_adapter_name
from worker.run.checkpoint import HELD, end_of_leg, write_part
from worker.run.checkpoint import due as checkpoint_due
from worker.run.rundir import RunDir, append_jsonl_bytes, atomic_write_bytes, read_jsonl
from worker.spec import OrchestratorConfig, RLSpec
from worker.tracking import progress
from worker.tracking.system_metrics import ProcessSampler
from worker.weight_sync import TEST_SKIP_LOAD_VAR

T = TypeVar("T")
TRUNCATED_WARN_FRACTION = 0.5
"""Above this fraction of a step's rollouts stopped at ``max_tokens``, the orchestrator warns (case C24)."""
STARVED_GEN_TIME_RATIO = 0.75
"""Below this ``trained_gen_time_ratio`` in a step where continuous admission dropped stale groups, the orchestrator
warns that slow tasks are being starved (case C26: slow tasks 6x slower, none trained, the ratio ~0.3; healthy
steps read ~1)."""
logger = logging.getLogger("asyncrl.orchestrator")
_STEP_SPEC: contextvars.ContextVar[RLSpec] = contextvars.ContextVar("asyncrl_step_spec")
"""The spec a step's rollout tasks were requested with (set in the context of each step's task)."""


class Orchestrator:
    pool: ReplicaPool | None = None
    """Several inference replicas (``worker/inference/pool.py``); None: one server, ``self.client`` alone."""

    def __init__(self, spec: RLSpec, run: RunDir, inference_url: str | list[str], start_step: int) -> None:
        from transformers import AutoTokenizer

        self.spec, self.run, self.start_step = spec, run, start_step
        self.end = end_of_leg(start_step, spec.max_steps, spec.ckpt.hold_at)
        """The last step this process runs: ``max_steps``, or the ``ckpt.hold_at`` step it holds at."""
        self.system = ProcessSampler()  # CPU % and RSS of this process, logged each step
        self.seeded_requests = seeded(spec.orchestrator.seeded_sampling)
        """Whether vLLM requests carry seeds (``orchestrator.seeded_sampling``; unset: with vLLM's CPU build only)."""
        inf = spec.inference
        urls = [inference_url] if isinstance(inference_url, str) else list(inference_url)
        inference_url = urls[0]
        clients = [
            InferenceClient(
                url,
                connect_timeout_s=inf.connect_timeout_s,
                read_timeout_s=inf.read_timeout_s,
                max_retries=inf.max_retries,
            )
            for url in urls
        ]
        self.client = clients[0]
        self.pool = ReplicaPool(clients, run, version=start_step) if len(clients) > 1 else None
        self.server_metrics = ServerMetricsSampler(clients)
        """Samples vLLM's own metrics of every inference server; each step logs them (``vllm``)."""
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
        self.harnesses: dict[str, HarnessRunner] = {}
        """Runs rollouts of tasksets with tools through verifiers' agent harness, one runner per inference replica by
        its client's ``base_url`` (one limit of ``harness.max_concurrent`` rollouts for all; a tool rollout's turns go
        to the replica its group runs on); empty for other tasksets."""
        if any(e.train.needs_harness for e in self.sampler.envs):
            first = HarnessRunner(spec.model.name, urls[0], spec.orchestrator.harness)
            runners = [first, *(first.on(url) for url in urls[1:])]
            self.harnesses = {c.base_url: runner for c, runner in zip(clients, runners, strict=True)}
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
        self.admission: AdmissionQueue[tuple[int, int], list[Rollout]] | None = None
        """``admission = "continuous"``: the slots and the ready queue (``admission.py``); None: ``step`` admission."""
        if spec.orchestrator.admission == "continuous":
            self.admission = AdmissionQueue(spec.orchestrator.groups_in_flight(), next_step=start_step + 1)
        self._admission_changed = asyncio.Event()
        """Set when a continuous-admission group finishes (a slot freed, the ready queue grew) or fails."""
        self._admission_wait = 0.0
        """Seconds the continuous producer waited at the start gate since the last batch was taken."""
        self._admission_error: BaseException | None = None
        self._admission_dropped: dict[int, list[list[Rollout]]] = {}  # step -> its stale-dropped groups (C26)
        """Stale groups each step's batch dropped from the ready queue, until the main loop logs them."""
        self._step_specs: dict[int, RLSpec] = {}
        self._evaluated = {
            r["step"] for r in read_jsonl(run.metrics) if r["source"] == "eval" and r["step"] <= start_step
        }
        """Policy versions already evaluated: a second eval of the same weights is skipped (its metric key would
        collide with the first's, and with seeded sampling it would give the same numbers)."""
        self._truncation_warned = False
        self._starvation_warned = False
        self._policy_check_warned: set[int] = set()
        """Versions whose failed served-policy check was warned about already (``on_fail = "warn"``); -1: the skip of a
        LoRA run targeting lm_head."""
        self._policy_check_failure: tuple[int, str] | None = None
        """The (version, reason) of the last failed served-policy check, until :meth:`fail_policy_check` sees it."""
        self._base_served_diff: float | None = None
        """Max |served - trainer| on the base weights (version 0) on this hardware: an unset tolerance is set from it
        (:meth:`policy_check_tolerance`); None until measured (:meth:`measure_base_served`) or read back."""
        self._base_served_measured = False
        self.live = LiveConfig(run.root, "orchestrator", start_step=start_step)
        self.scoring: ScoreProcess | None = None
        """Scores single-turn training groups in a worker process (``scoring.py``); None: in this process (steps of
        fewer than ``SCORE_PROCESS_MIN_ROLLOUTS`` rollouts). Started by ``main_loop``."""
        self.weight_sync = None
        """Loads versions the trainer sends over the weight-sync process group (None: filesystem only)."""
        if spec.trainer.weight_sync.kind in ("process_group", "cuda_ipc"):
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

    async def load_policy(self, path: Path, version: int) -> dict[str, float]:
        """Pause (in-flight requests kept), load weights in place, reset prefix cache, resume.

        Returns the ``inference`` metrics of the update, wall seconds as the orchestrator saw them:
        ``weight_update_s`` (pause -> resume; with replicas until every replica acked) and, when the reply has them
        (:meth:`InferenceClient.publish_weights`; with replicas the first acked replica's), its parts
        ``weight_update_pause_s`` (until the engine stopped: it finishes the step it is in),
        ``weight_update_load_s`` (the load itself, request included), ``weight_update_reset_s`` (the prefix-cache
        reset) and ``weight_update_resume_s``; ``weight_update_worker_s``: the load as the vLLM worker timed it, where
        its reply says (the in-place routes).

        A LoRA policy version (``path`` holds ``adapter_config.json``: ``[trainer.lora]``) is loaded as vLLM adapter
        ``lora_adapter_name(run, version)`` instead, and rollouts from then on name it as their ``model``; adapters
        older than the newest ``adapters_in_use(max_async_level)`` are unloaded (``worker/policy/lora_adapters.py``:
        running rollouts may still name the others). With the test-only ``ASYNCRL_TEST_SKIP_WEIGHT_LOAD`` in the
        orchestrator's environment an adapter is not loaded and rollouts keep naming the model served before (case
        C14 for LoRA; a full-weight load is skipped by the server: ``worker.weight_sync.load.TEST_SKIP_LOAD_VAR``). A full model folder (a LoRA run's version 0 on a shared server) is
        loaded in place and rollouts name the base model.
        """
        adapter = lora_adapter_name(self.run.root, version) if (path / ADAPTER_CONFIG).is_file() else None
        load: Callable[[Path], Awaitable[dict[str, Any]]] | None
        if adapter is not None and os.environ.get(TEST_SKIP_LOAD_VAR):  # test only (case C14 for LoRA)
            adapter = self.client.model  # the adapter never reaches inference: rollouts keep naming the old model

            async def load(folder: Path) -> dict[str, Any]:  # noqa: ARG001
                return {}

        elif adapter is not None:

            async def load(folder: Path) -> dict[str, Any]:
                return await self.client.load_lora_adapter(adapter, folder)

        else:
            load = self.weight_sync.load if self.weight_sync is not None else None
        if self.pool is not None:
            info = await self.pool.publish(path, version, self._loader(adapter, load))
        else:
            info = await self.client.publish_weights(path, load=load)
        async with self._version_changed:
            if self.pool is not None:
                self.pool.model = adapter  # every replica's requests name it
            else:
                self.client.model = adapter  # None: the server's base model
            for harness in self.harnesses.values():
                harness.adapter = adapter
            self.policy_version = version
            self._version_changed.notify_all()
        if adapter is not None and adapter not in self._adapters:  # a resume may load the last version again
            self._adapters.append(adapter)
            while len(self._adapters) > adapters_in_use(self.spec.orchestrator.max_async_level):
                old = self._adapters.pop(0)
                for client in [self.client] if self.pool is None else [r.client for r in self.pool.healthy()]:
                    try:
                        await client.unload_lora_adapter(old)
                    except InferenceError as e:  # the run goes on; the server keeps one more small adapter
                        logger.warning("could not unload LoRA adapter %s: %s", old, e)
        out = {"weight_update_s": float(info["total_s"])}
        for part in ("pause_s", "load_s", "reset_s", "resume_s"):
            if isinstance(info.get(part), int | float):
                out[f"weight_update_{part}"] = float(info[part])
        if isinstance(info.get("seconds"), int | float):  # the load as the vLLM worker timed it (no HTTP, no RPC)
            out["weight_update_worker_s"] = float(info["seconds"])
        return out

    @staticmethod
    def _loader(adapter: str | None, load: Callable[[Path], Awaitable[dict[str, Any]]] | None) -> Loader:
        """Each replica's ``load`` of a version (``ReplicaPool.publish``): its own LoRA adapter load, the test-only
        skip, or an in-place load by path (the spec allows only the filesystem weight sync with replicas)."""
        if adapter is None or load is None:
            return lambda client: load

        def loader(client: InferenceClient) -> Callable[[Path], Awaitable[dict[str, Any]]]:
            if os.environ.get(TEST_SKIP_LOAD_VAR):
                return load

            async def load_on(folder: Path) -> dict[str, Any]:
                return await client.load_lora_adapter(adapter, folder)

            return load_on

        return loader

    async def watch_weights(self) -> None:
        while True:
            latest = self.run.latest_stable_weights()
            if latest is not None and latest[0] > self.policy_version:
                version, path = latest
                base = await self.measure_base_served()  # inference still serves the base weights
                self.fail_policy_check(0)
                update = await self.load_policy(path, version)
                checked = await self.check_policy(version)
                replicas = self.pool.metrics() if self.pool is not None else {}
                self.run.log_metrics("inference", version, {**update, **checked, **base, **replicas})
                self.fail_policy_check(version)
                logger.info(
                    "policy version %d loaded in %.2fs (pause %.3fs, load %.3fs)",
                    version,
                    update["weight_update_s"],
                    update.get("weight_update_pause_s", float("nan")),
                    update.get("weight_update_load_s", float("nan")),
                )
            await asyncio.sleep(0.05)

    def policy_check_tolerance(self) -> float:
        """``orchestrator.policy_check.tolerance``, or when unset
        :func:`worker.orchestrator.policy_check.default_tolerance` of the served-vs-trainer diff on the base weights
        (measured by this run, or stored by the attempt before)."""
        check = self.spec.orchestrator.policy_check
        if check.tolerance is not None:
            return check.tolerance
        if self._base_served_diff is None:
            self._base_served_diff = read_base_served_diff(self.run)
        return default_tolerance(self.spec.model.dtype, self._base_served_diff)

    async def measure_base_served(self) -> dict[str, float | int | None]:
        """Once per fresh run, as soon as the trainer fixed its probe and while inference still serves the base weights
        (before it loads the first version the trainer changed: the versions before the probe's batch are the base),
        ask inference (every healthy replica) for the probe's log-probs and compare them with the trainer's base
        log-probs: the hardware's own served-vs-trainer noise, stored in ``step_0.json``, from which an unset
        tolerance is set (:meth:`policy_check_tolerance`). Checked like a version (``compare`` at version 0): a served
        base farther than the tolerance (at most ``TOLERANCE_CEILING``) fails there. Returns
        ``policy_check_base_max_abs_diff`` for the next version's metrics row ({} when nothing was measured)."""
        check = self.spec.orchestrator.policy_check
        if self._base_served_measured or self.start_step > 0 or not policy_check_applies(self.spec):
            return {}
        probe, base = read_probe(self.run), read_logprobs(self.run, 0)
        if probe is None or base is None:
            return {}
        self._base_served_measured = True
        if read_base_served_diff(self.run) is not None:  # an orchestrator restarted within the attempt measured it
            return {}
        t0 = time.monotonic()
        clients = [self.client] if self.pool is None else [r.client for r in self.pool.healthy()]
        answers: list[list[list[float]]] = []
        for client in clients:
            try:
                answers.append(await self._probe_logprobs(client, probe))
            except InferenceError as e:
                logger.warning("policy check of the base weights on %s skipped: %s", client.base_url, e)
        if not answers:
            return {}
        worst = max(answers, key=lambda a: max_abs_diff(a, base))
        diff = max_abs_diff(worst, base)
        write_base_served_diff(self.run, diff)
        self._base_served_diff = diff
        tolerance = self.policy_check_tolerance()
        logger.info(
            "policy check tolerance %g (%s): served-vs-trainer diff on the base weights %.3g",
            tolerance,
            "orchestrator.policy_check.tolerance" if check.tolerance is not None else "set from it",
            diff,
        )
        result = compare(0, worst, base, base, tolerance=tolerance, base_updates=check.base_updates)
        self._checked(0, result, tolerance, t0)
        return {"policy_check_base_max_abs_diff": diff}

    @staticmethod
    async def _probe_logprobs(client: InferenceClient, probe: Probe) -> list[list[float]]:
        """The served log-probs of the probe's completion tokens (one request per sequence)."""
        return await asyncio.gather(
            *(client.prompt_logprobs(s, i) for s, i in zip(probe.sequences, probe.completion_start, strict=True))
        )

    async def check_policy(self, version: int, wait_s: float = 0.0) -> dict[str, float | int | None]:
        """The served-policy check of ``version``, just loaded (``[orchestrator.policy_check]``,
        ``worker/orchestrator/policy_check.py``): inference's log-probs of the trainer's probe against the trainer's
        under ``version`` and under the base. Returns its metrics (``policy_check_max_abs_diff``,
        ``policy_moved_from_base``; none when the check is off or the trainer has fixed no probe yet); a failure is
        logged as a ``policy_check_failed`` event and kept for :meth:`fail_policy_check`. ``wait_s``: how long to wait
        for the trainer's log-probs of ``version`` (a resume's version is written by the trainer after it starts).

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
        t0 = time.monotonic()
        tolerance = self.policy_check_tolerance()
        if self.pool is not None:
            return await self._check_replicas(version, probe, trainer, base, tolerance, check.base_updates)
        try:
            served = await self._probe_logprobs(self.client, probe)
        except InferenceError as e:  # a server that died fails the run through its rollouts; this check only warns
            logger.warning("policy check of version %d skipped: inference did not answer the probe: %s", version, e)
            return {}
        result = compare(version, served, trainer, base, tolerance=tolerance, base_updates=check.base_updates)
        return self._checked(version, result, tolerance, t0)

    async def _check_replicas(
        self,
        version: int,
        probe: Probe,
        trainer: list[list[float]],
        base: list[list[float]],
        tolerance: float,
        base_updates: int,
    ) -> dict[str, float | int | None]:
        """The served-policy check on every replica that acked ``version``: one ``compare`` each; the failure of the
        first replica that fails is the run's; metrics: the worst replica's, ``policy_check_max_abs_diff/r<i>`` of
        each and ``policy_check_replica_max_abs_diff`` = max over probe tokens and replicas of |served_i - served_0|."""
        t0 = time.monotonic()
        acked = [r for r in (self.pool.healthy() if self.pool is not None else []) if r.version == version]

        async def served(replica: Replica) -> list[list[float]] | None:
            try:
                return await self._probe_logprobs(replica.client, probe)
            except InferenceError as e:
                logger.warning("policy check of version %d on replica %s skipped: %s", version, replica.name, e)
                return None

        answers = [(r, a) for r, a in zip(acked, await asyncio.gather(*(served(r) for r in acked)), strict=True) if a]
        if not answers:
            return {}
        results = [
            (r, compare(version, a, trainer, base, tolerance=tolerance, base_updates=base_updates)) for r, a in answers
        ]
        failed = [  # the reason names the replica that serves another policy
            replace(res, reason=f"{res.reason} (inference replica {r.name} at {r.url})")
            for r, res in results
            if res.reason is not None
        ]
        worst = failed[0] if failed else max((res for _, res in results), key=lambda res: res.max_abs_diff)
        metrics = self._checked(version, worst, tolerance, t0)
        for r, res in results:
            metrics[f"policy_check_max_abs_diff/{r.name}"] = res.max_abs_diff
        metrics["policy_check_replica_max_abs_diff"] = max(max_abs_diff(a, answers[0][1]) for _, a in answers)
        return metrics

    def _checked(self, version: int, result: CheckResult, tolerance: float, t0: float) -> dict[str, float | int | None]:
        """Log the served-policy check ``result`` of ``version``; its failure becomes an event and is kept for
        :meth:`fail_policy_check`. Returns its metrics."""
        check = self.spec.orchestrator.policy_check
        logger.info(
            "policy check of version %d: max |served - trainer| %.3g, moved from base %s (tolerance %g) in %.3fs",
            version,
            result.max_abs_diff,
            result.moved_from_base,
            tolerance,
            time.monotonic() - t0,
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
        return {**result.metrics(), "policy_check_tolerance": tolerance}

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
        if self.policy_version < version:
            progress.recorder.state("waiting_for_policy", version=version)
        async with self._version_changed:
            await self._version_changed.wait_for(lambda: self.policy_version >= version)
        progress.recorder.state("generating")
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ rollouts

    def _seed(self, *where: int) -> int | None:
        """The request seed of a place in the run (``data.request_seed``), None when requests are not seeded."""
        return request_seed(self.spec.seed, *where) if self.seeded_requests else None

    async def rollout_group(self, index: int, seed: int | None, env: int = 0) -> list[Rollout]:
        orch = self.spec.orchestrator
        max_len = min(orch.seq_len, self.spec.inference.max_model_len)

        def on(client: InferenceClient, version: Callable[[], int]) -> Awaitable[list[Rollout]]:
            return rollout_group(
                client,
                self.tokenizer,
                self.sampler.envs[env].train,
                index,
                harness=self.harnesses.get(client.base_url),
                n=orch.group_size,
                max_tokens=orch.max_tokens,
                temperature=orch.temperature,
                policy_version=version,
                max_len=max_len,
                # harness: no new model turn once a call's context leaves less than max_tokens of max_len (a longer
                # sample is dropped by build_batch as dropped_overlong)
                max_total_tokens=max(1, max_len - orch.max_tokens),
                seed=seed,
                scorer=scorer,
            )

        scorer = None
        if self.scoring is not None:
            name = self.sampler.envs[env].train.id

            def scorer(texts: list[str]) -> Awaitable[list[float | None] | None]:
                assert self.scoring is not None
                return self.scoring.score(env, "train", index, texts, name)

        if self.pool is None:
            group = await on(self.client, lambda: self.policy_version)
        else:  # the whole group (every turn of a multi-turn rollout) on one replica, under the version it acked

            async def work(replica: Replica) -> list[Rollout]:
                done = await on(
                    replica.client, lambda: self.policy_version if replica.version is None else replica.version
                )
                ReplicaPool.count_tokens(replica, sum(len(r.completion_ids) for r in done))
                return done

            group = await self.pool.run_on(work)
        for r in group:
            r.env = self.sampler.envs[env].config.name
        progress.recorder.tick("rollout_groups")
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

    async def score_step(
        self, step: int, groups: list[list[Rollout]], orch: OrchestratorConfig, rejected: list[list[Rollout]]
    ) -> tuple[list[TrainSample], dict[str, Any]]:
        """Step ``step``'s training samples and orchestrator metrics: ``build_batch`` (then ``env_step_metrics``) a
        slice of groups at a time (:func:`slices`), back to the event loop between slices."""
        samples: list[TrainSample] = []
        for lo, hi in slices(groups):
            samples += batch_groups(step, groups[lo:hi], orch, self.advantage, first=lo)
            await asyncio.sleep(0)
        metrics = batch_metrics(step, groups, rejected)
        metrics.update(env_step_metrics(step, groups, samples, self.sampler.names))
        return samples, metrics

    def observe_step(self, step: int, orch: OrchestratorConfig) -> dict[str, Any]:
        """Feed every group step ``step`` started to the curriculum (in step order); its curriculum and gate metrics."""
        gated = self._gated.pop(step)
        started = [(task, [r.reward for r in group]) for task, group in gated.started]
        metrics = self.sampler.observe(step, started, orch.curriculum)
        if self.admission is not None:
            metrics["admission_dropped_stale_groups"] = len(self._admission_dropped.pop(step))
        return {**metrics, **(gated.metrics() if orch.gates else {})}

    async def produce(self) -> None:
        if self.admission is not None:
            await self.produce_continuous(self.admission)
            return
        for step in range(self.start_step + 1, self.end + 1):
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

    async def produce_continuous(self, queue: AdmissionQueue[tuple[int, int], list[Rollout]]) -> None:
        """``admission = "continuous"`` (``admission.py``): keep ``queue``'s slots full under the start gate, and hand
        each step the first ``batch_size`` fresh groups to finish (``self._steps``, in step order)."""
        running: set[asyncio.Task[None]] = set()
        contexts = [contextvars.copy_context()]  # the spec groups start with, from the step boundary on

        async def run(start: Start[tuple[int, int]]) -> None:
            version = self.policy_version
            env, index = start.task
            group = await self.rollout_group(index, self._seed(CONTINUOUS_SEED, start.position), env)
            queue.finish(start, group, group_start_version([r.policy_span for r in group], version))
            self._admission_changed.set()

        def ended(task: asyncio.Task[None]) -> None:
            running.discard(task)
            if not task.cancelled() and task.exception() is not None:
                self._admission_error = task.exception()
                self._admission_changed.set()

        async def starter() -> None:
            while queue.next_step <= self.end:
                orch = self._spec.orchestrator
                gate = min_start_version(queue.next_step, orch.max_async_level, orch.max_off_policy_steps)
                if self.policy_version < gate:
                    self._admission_wait += await self.wait_for_version(gate)
                    continue
                if not queue.free():
                    self._admission_changed.clear()
                    await self._admission_changed.wait()
                    continue
                if queue.needs_chunk():  # keyed by the step filling: its checkpoint's cursor (admission.py)
                    first = self.sampler.position
                    places = (CONTINUOUS_SEED, first)
                    queue.add_chunk(
                        first, self.sampler.take(queue.next_step, orch.batch_size, 0, orch.curriculum, places)
                    )
                start = queue.start()
                assert start is not None  # a slot is free and the chunk has tasks
                task = asyncio.create_task(run(start), context=contexts[0].copy())  # one context per group
                running.add(task)
                task.add_done_callback(ended)

        async def take(step: int) -> tuple[list[list[Rollout]], float, float]:
            t0, orch = time.perf_counter(), self._step_specs[step].orchestrator
            while (taken := queue.take(step, orch.batch_size, orch.max_off_policy_steps)) is None:
                if self._admission_error is not None:
                    raise self._admission_error
                self._admission_changed.clear()
                await self._admission_changed.wait()
            groups = [f.group for f in taken.groups]
            self._gated[step] = GatedStep(kept=groups, started=[(f.start.task, f.group) for f in taken.groups])
            self._admission_dropped[step] = [f.group for f in taken.stale]
            waited, self._admission_wait = self._admission_wait, 0.0
            return groups, waited, time.perf_counter() - t0

        async def steps() -> None:
            for step in range(self.start_step + 1, self.end + 1):
                # step boundary: live config revisions apply to every group started and every batch from this step on
                self.spec, _ = self.live.apply(self._spec, step)
                self._step_specs[step] = self._spec
                queue.slots = self._spec.orchestrator.groups_in_flight()
                context = contextvars.copy_context()
                context.run(_STEP_SPEC.set, self._spec)
                contexts[0] = context
                self._admission_changed.set()  # the slots may have grown
                self._steps[step] = task = asyncio.create_task(take(step))
                await task  # the main loop gets its batch (or its error, which ends this producer too)

        starting = asyncio.create_task(starter())
        try:
            await until(steps(), starting)
        finally:
            for task in [starting, *running]:  # the groups no batch needs (or the run ended)
                task.cancel()

    @staticmethod
    async def _timed(coro: Any, waited: float) -> tuple[Any, float, float]:
        t0 = time.perf_counter()
        result = await coro
        return result, waited, time.perf_counter() - t0

    # ------------------------------------------------------------------ batches

    def pack_step(self, step: int, samples: list[TrainSample]) -> Batch:
        """Step ``step``'s batch: ``samples`` packed into micro-batches of at most ``orchestrator.seq_len`` tokens
        (``pack_shared_prompt`` with ``share_prompt``, else ``pack``)."""
        orch = self.spec.orchestrator
        lengths = [len(s["input_ids"]) for s in samples]
        if orch.share_prompt:
            prefix_lens = [s.get("prefix_len", 0) for s in samples]
            bins = pack_shared_prompt(lengths, prefix_lens, prompt_keys(samples), orch.seq_len)
        else:
            bins = pack(lengths, orch.seq_len)
        return {
            "step": step,
            "num_samples": len(samples),
            "num_loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
            "micro_batches": [[samples[i] for i in b] for b in bins],
        }

    async def write_step(self, step: int, batch: Batch) -> None:
        """Hand step ``step``'s batch to the trainer (``batches/step_<step>.json``, as
        ``worker.orchestrator.batch.write_batch`` writes it): encoded a part at a time on the event loop
        (``worker.orchestrator.batch.encode_batch``), the write in a thread."""
        parts = []
        for part in encode_batch(batch):
            parts.append(part)
            await asyncio.sleep(0)
        await asyncio.to_thread(atomic_write_bytes, self.run.batch(step), b"".join(parts))

    async def write_rollouts(self, step: int, groups: list[list[Rollout]]) -> None:
        """The step's rollout records (``Rollout.record``, ``group`` each one's group index) in one append to
        ``rollouts/step_<step>.jsonl``: encoded a slice of groups at a time on the event loop (:func:`slices`), the
        write in a thread."""
        lines = []
        for lo, hi in slices(groups):
            lines.append(encode_records([r.record(step, g) for g in range(lo, hi) for r in groups[g]]))
            await asyncio.sleep(0)
        await asyncio.to_thread(append_jsonl_bytes, self.run.rollout_file(step), b"".join(lines))

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

    def warn_starved(self, step: int, ratio: float, dropped_groups: int) -> None:
        """Case C26: when continuous admission dropped stale groups in step ``step`` and the trained rollouts took less
        than ``STARVED_GEN_TIME_RATIO`` of the generation time of all finished ones (those dropped included), a console
        warning and a ``starved`` event; once, and again only after it recovered."""
        if not dropped_groups or not ratio < STARVED_GEN_TIME_RATIO:  # NaN: nothing measured
            if ratio >= STARVED_GEN_TIME_RATIO:
                self._starvation_warned = False
            return
        if self._starvation_warned:
            return
        self._starvation_warned = True
        reason = (
            f"step {step}: the trained rollouts took {ratio:.2f}x the generation time of all finished ones and "
            f"{dropped_groups} group(s) were dropped as stale: slow tasks are being left out of training; raise "
            f'orchestrator.max_off_policy_steps or use orchestrator.admission = "step"'
        )
        logger.warning("%s", reason)
        self.run.log_event(
            "starved", step=step, trained_gen_time_ratio=ratio, dropped_groups=dropped_groups, reason=reason
        )

    # ------------------------------------------------------------------ evals

    async def run_eval(self) -> dict[str, float | int | None] | None:
        """Evaluate the policy version inference serves now (``eval`` metrics at that version); None when that
        version was evaluated already, or when the eval took longer than ``orchestrator.eval.timeout_s``: it is then
        cancelled and an ``eval_abandoned`` event says so (version, eval groups done of those asked), case C19."""
        ev = self.spec.orchestrator.eval
        version = self.policy_version
        if version in self._evaluated:
            logger.info("eval at policy version %d: done already, skipped", version)
            return None
        self._evaluated.add(version)
        results: dict[str, dict[str, float | int | None]] = {}
        done_before, t0 = progress.recorder.counts.get("eval_groups", 0), time.monotonic()
        progress.recorder.state("eval", version=version)
        try:
            async with asyncio.timeout(ev.timeout_s):
                for env in self.sampler.envs:  # each environment of a mixture on its own eval split

                    def run(client: InferenceClient, env: Any = env) -> Awaitable[dict[str, float | int | None]]:
                        return evaluate(
                            client,
                            env.eval,
                            self.tokenizer,
                            num_examples=ev.num_examples,
                            temperature=ev.temperature,
                            max_tokens=self.spec.orchestrator.max_tokens,
                            max_len=min(self.spec.orchestrator.seq_len, self.spec.inference.max_model_len),
                            pass_k=ev.pass_k,
                            pass_threshold=ev.pass_threshold,
                            num_samples=ev.num_samples,
                            harness=self.harnesses.get(client.base_url),
                            seed=self._seed(-1, version),  # -1: eval requests never share a seed with a training step's
                        )

                    if self.pool is None:
                        results[env.config.name] = await run(self.client)
                    else:  # one replica per environment's eval (a lost one: the eval again on another)
                        results[env.config.name] = await self.pool.run_on(partial(_on_client, run))
        except TimeoutError:
            asked = ev.num_examples * len(self.sampler.envs)  # each eval split has them (checked at launch)
            done = progress.recorder.counts.get("eval_groups", 0) - done_before
            reason = (
                f"eval at policy version {version} abandoned after {time.monotonic() - t0:.1f} s "
                f"(orchestrator.eval.timeout_s = {ev.timeout_s:g}): {done} of {asked} eval groups done, no eval metrics"
            )
            logger.warning("%s", reason)
            self.run.log_event(
                "eval_abandoned",
                process="orchestrator",
                step=version,
                groups_done=done,
                groups_asked=asked,
                timeout_s=ev.timeout_s,
                reason=reason,
            )
            return None
        finally:
            progress.recorder.state("generating")
        result = combine_evals(results)
        self.run.log_metrics("eval", version, result)
        logger.info("eval at policy version %d: %s", version, result)
        return result

    # ------------------------------------------------------------------ main loop

    async def main_loop(self) -> None:
        """The run: :meth:`run_steps`, with the shared tool servers of its tasksets running (``serving_tools``)."""
        async with serving_tools([e for m in self.sampler.envs for e in (m.train, m.eval)]):
            await self.run_steps()

    async def run_steps(self) -> None:
        spec = self.spec
        clients = [self.client] if self.pool is None else [r.client for r in self.pool.replicas]
        orch = spec.orchestrator
        if orch.batch_size * orch.group_size >= SCORE_PROCESS_MIN_ROLLOUTS and not all(
            e.train.is_multi_turn for e in self.sampler.envs
        ):
            self.scoring = ScoreProcess([(c.id, dict(c.args)) for c in spec.envs], spec.seed)
        await asyncio.gather(*(c.wait_ready(spec.inference.startup_timeout_s) for c in clients))
        # a server left paused by an orchestrator killed mid weight update (its resume never came) would hold every
        # request of this one forever: resumed once no update can still own the pause
        for client, resumed in zip(
            clients, await asyncio.gather(*(c.resume_if_left_paused() for c in clients)), strict=True
        ):
            if resumed:
                logger.warning("inference server %s was left paused; resumed it", client.base_url)
                self.run.log_event(
                    "inference_resumed",
                    process="orchestrator",
                    url=client.base_url,
                    reason=f"{client.base_url} was left paused (an orchestrator killed mid weight update?): resumed",
                )
        # first-time costs of a fresh server paid now, not inside the step a weight update waits for (case C25)
        # no pause cycle on a server the run did not start (inference.url(s)): it would pause other runs' requests
        prompt = self.tokenizer.encode("Warm up the server, please.")
        cycle = spec.inference.url is None and not spec.inference.urls
        for client, warm in zip(
            clients,
            await asyncio.gather(*(warm_up(c, prompt, seed=spec.seed, pause_cycle=cycle) for c in clients)),
            strict=True,
        ):
            logger.info("inference warm-up of %s in %.2fs: %s", client.base_url, warm["total_s"], warm)
        if self.weight_sync is not None and spec.trainer.weight_sync.kind == "process_group":
            # the vLLM workers join the trainer's group (warning + filesystem on failure)
            await self.weight_sync.join(spec.inference.startup_timeout_s, start_step=self.start_step)
        if self.start_step > 0:
            trainer_part = self.run.checkpoint_dir(self.start_step) / "trainer"
            if (trainer_part / "adapter").is_dir():  # a LoRA checkpoint: its adapter (worker/trainer/checkpointer.py)
                trainer_part = trainer_part / "adapter"
            update = await self.load_policy(trainer_part, self.start_step)
            # the served-policy check of the resumed version, before the first rollout (the trainer writes its
            # log-probs once it loaded the checkpoint, when the attempt before had not)
            checked = await self.check_policy(self.start_step, wait_s=spec.inference.startup_timeout_s)
            if not any(
                r["source"] == "inference" and r["step"] == self.start_step for r in read_jsonl(self.run.metrics)
            ):
                # the attempt before stopped ahead of loading it: this load is version start_step's update
                self.run.log_metrics("inference", self.start_step, {**update, **checked})
            self.fail_policy_check(self.start_step)
        elif (spec.inference.url is not None or spec.inference.urls) and Path(spec.model.name).is_dir():
            await self.load_policy(Path(spec.model.name), 0)  # a shared server may hold another run's weights
        if self.start_step == 0:
            await self.run_eval()
        watcher = asyncio.create_task(self.watch_weights())
        sampler = asyncio.create_task(self.server_metrics.run())  # never ends, never fails (server_metrics.py)
        if self.pool is not None:  # a lost replica is dropped, a returning one taken back; none left: the run fails
            pool_watch = asyncio.create_task(self.pool.watch())
            watcher = asyncio.create_task(_both(watcher, pool_watch))
        producer = asyncio.create_task(self.produce())
        try:
            for step in range(self.start_step + 1, self.end + 1):
                while step not in self._steps:
                    await asyncio.sleep(0.01)
                    raise_failed(producer, watcher)
                t0 = time.perf_counter()
                groups, wait_for_policy, generation_s = await until(self._steps.pop(step), watcher)
                gen_s = time.perf_counter() - t0
                step_spec = self._step_specs.pop(step)
                # finished, never trained: gate-rejected groups and (continuous admission) stale-dropped ones (C26)
                rejected = [*self._gated[step].dropped(), *self._admission_dropped.get(step, [])]
                # a step's CPU work (advantages, records) in slices on the event loop, not in a thread: a CPU-bound
                # thread makes the loop wait up to the GIL's switch interval (5 ms) after each of its syscalls, and a
                # rollout task's step took 0.4 s at 4,096 rollouts in flight (benchmarks/README.md section 11)
                samples, metrics = await self.score_step(step, groups, step_spec.orchestrator, rejected)
                metrics.update(self.observe_step(step, step_spec.orchestrator))  # before the trainer sees the batch
                # the batch packed and encoded on the loop, written in a thread; the step's records go out in one write
                await self.write_step(step, self.pack_step(step, samples))
                progress.recorder.tick("batches")
                await self.write_rollouts(step, groups)
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
                        **self.system.sample(),
                    },
                )
                if served := self.server_metrics.take():
                    self.run.log_metrics("vllm", step, served)
                self.warn_truncated(step, metrics["truncated_fraction"], step_spec.orchestrator.max_tokens)
                self.warn_starved(
                    step, metrics["trained_gen_time_ratio"], int(metrics.get("admission_dropped_stale_groups", 0))
                )
                heap.after_step(step)  # the full garbage collections, at a step's end (heap.py)
                if checkpoint_due(self.run, step, spec.ckpt.interval, spec.ckpt.hold_at):
                    self.save_state(step)
                ev = step_spec.orchestrator.eval
                if ev.interval and step % ev.interval == 0 and step < self.end:
                    await until(self.wait_for_version(step), watcher)  # version `step`, not the older one served now
                    await self.run_eval()
            await until(self.wait_for_version(self.end), watcher)
            await self.run_eval()  # at max_steps, or at a hold step: a sweep's rung has its eval/ value
            if self.end < spec.max_steps:  # ckpt.hold_at: nothing more until the run is stopped
                progress.recorder.state(HELD, step=self.end)
                self.run.log_event(HELD, process="orchestrator", step=self.end, reason="held until stopped")
                await until(asyncio.Event().wait(), watcher)
        finally:
            for task in (watcher, sampler, producer, *self._steps.values()):
                task.cancel()
            if self.scoring is not None:
                self.scoring.close()
            if self.pool is not None:
                self.run.log_event("inference_replicas", process="orchestrator", replicas=self.pool.summary())
                await self.pool.aclose()
            else:
                await self.client.aclose()


ROLLOUTS_PER_SLICE = 256
"""Rollouts the orchestrator batches or encodes between two returns to the event loop (256: ~5 ms of
``batch_groups`` or of records, so a step's 2,048 rollouts never hold the loop long: ``benchmarks/README.md``
section 11)."""


def slices(groups: Sequence[Sequence[Any]], size: int = ROLLOUTS_PER_SLICE) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of ``groups``, in order and covering them, each of whole groups holding at least ``size``
    rollouts (the last one may hold fewer)."""
    out, lo, count = [], 0, 0
    for i, group in enumerate(groups):
        count += len(group)
        if count >= size:
            out.append((lo, i + 1))
            lo, count = i + 1, 0
    if lo < len(groups):
        out.append((lo, len(groups)))
    return out


def _on_client(work: Callable[[InferenceClient], Awaitable[T]], replica: Replica) -> Awaitable[T]:
    return work(replica.client)


async def _both(*tasks: asyncio.Task[Any]) -> None:
    """Run background ``tasks`` as one: the first error of one cancels the others and is raised."""
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


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
    parser.add_argument(
        "--inference-url", required=True, action="append", help="the inference server; once per replica"
    )
    parser.add_argument("--resume-step", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run = RunDir(args.run_dir)
    spec = RLSpec.model_validate_json(run.config.read_text())
    orchestrator = Orchestrator(spec, run, args.inference_url, args.resume_step)
    progress.recorder.start(run.root, "orchestrator")
    heap.settle()
    try:
        asyncio.run(orchestrator.main_loop())
    except (InferenceError, PolicyCheckFailed) as err:
        run.log_event("failed", process="orchestrator", reason=str(err))
        logger.error("%s", err)
        return 1
    finally:
        progress.recorder.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
