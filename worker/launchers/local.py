"""Local launcher: the three processes of an RL run as children of this process.

``launch_rl`` checks the spec against the world first (model loads, environment imports, prompts fit
``seq_len``) and only then creates the run directory, so bad input leaves nothing behind. It starts
inference (unless ``inference.url`` names a running server), trainer and orchestrator, prints one
line per step from ``metrics.jsonl``, and ends the run when trainer and orchestrator have exited:
``completed`` when both exit 0, ``failed`` with the process, exit code, cause (its ``failed`` or ``disk_full``
event, or a full disk found after it exited) and log path otherwise. Any exit tears the other processes down, and
what failed writes left half-done (incomplete checkpoint steps, temporary folders) is removed. Each process leads its own process group (vLLM's EngineCore is in the
inference group), and every group is SIGKILLed when this process dies, even by SIGKILL (``worker.procs.spawn``).
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
from typing import Any

from worker.checkpoint import remove_incomplete, resume_step
from worker.procs import free_port, kill_group, spawn
from worker.rundir import (
    DISK_FULL_FREE_BYTES,
    RunDir,
    atomic_write_json,
    disk_space,
    human_bytes,
    read_jsonl,
    read_jsonl_after,
)
from worker.spec import EnvConfig, RLSpec, SFTSpec, SpecError

logger = logging.getLogger("asyncrl.launcher")
PROCESSES = ("inference", "trainer", "orchestrator")


def preflight(spec: RLSpec) -> None:
    """Check what the schema cannot: the model loads, the environment imports, prompts fit, plugin functions
    (``type = "custom"``) import and take their registry's arguments.

    Cheap (no weights loaded, no process started, nothing written); ``asyncrl rl --dry-run`` runs it too.

    Raises:
        SpecError: one line naming the field.
    """
    from worker.models import check_model

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

    from worker.envs import EnvironmentLoadError, env_error_field, load_environment
    from worker.orchestrator.prompts import prompt_ids

    longest = 0
    for i, cfg in enumerate(spec.envs):  # every environment of a mixture (``[[env]]``: keys ``env.<i>.id``)
        prefix = "env." if isinstance(spec.env, EnvConfig) else f"env.{i}."
        try:
            env = load_environment(cfg.id, split="train", seed=spec.seed, **cfg.args)
        except (EnvironmentLoadError, TypeError, ValueError) as err:
            raise SpecError(f"{env_error_field(err, prefix)}: {err}") from None
        if env.unsupported:
            raise SpecError(f"{prefix}id: {env.unsupported}")
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


def check_run_dir(spec: RLSpec | SFTSpec, *, resume: bool = False, overwrite: bool = False) -> int | None:
    """Check that the run directory allows this start; creates and changes nothing.

    Returns the checkpoint step to resume from (with ``resume``), else None.

    Raises:
        SpecError: ``output_dir`` is a file or not writable; the run directory exists without ``--resume`` or
            ``--overwrite`` (sft: ``--overwrite``); ``--resume`` without a run config or a complete checkpoint.
    """
    run = RunDir(spec.run_dir)
    out = Path(spec.output_dir or ".")
    existing = next(p for p in (out, *out.parents, Path(".")) if p.exists())  # Path(".") ends a relative path
    if not existing.is_dir():
        raise SpecError(f"output_dir: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpecError(f"output_dir: cannot create run directories under {existing} (permission denied)")
    if run.root.exists() and not run.root.is_dir():
        raise SpecError(f"name: {run.root} exists and is not a directory")
    if resume:
        if not run.config.exists():
            hint = "pass --overwrite to start over" if run.root.exists() else "start it without --resume"
            raise SpecError(f"--resume: no run config at {run.config} ({hint})")
        step = resume_step(run)
        if step is None:
            raise SpecError(f"--resume: no complete checkpoint in {run.checkpoints} (start over with --overwrite)")
        if step >= spec.max_steps and _completed(run):
            raise SpecError(
                f"max_steps: the run completed at step {step} and max_steps is {spec.max_steps}: nothing "
                f"to resume (raise --max_steps to train further)"
            )
        return step
    if run.root.exists() and not overwrite:
        hint = (
            "pass --resume to continue it or --overwrite to replace it"
            if spec.kind == "rl"
            else ("pass --overwrite to replace it")
        )
        raise SpecError(f"run directory {run.root} exists: {hint}")
    return None


def _completed(run: RunDir) -> bool:
    """Whether the run's ``summary.json`` says it completed."""
    try:
        return json.loads(run.summary.read_text()).get("status") == "completed"
    except (OSError, ValueError, AttributeError):
        return False


def prepare_run_dir(spec: RLSpec, *, resume: bool, overwrite: bool) -> tuple[RunDir, int | None]:
    """Create (or, with ``resume``, reopen) the run directory; returns it and the resume step.

    Raises:
        SpecError: the directory exists without ``--resume``/``--overwrite``, or nothing to resume.
    """
    run = RunDir(spec.run_dir)
    step = check_run_dir(spec, resume=resume, overwrite=overwrite)
    if step is not None:
        run.prune_after(step)
    elif run.root.exists():
        shutil.rmtree(run.root)
    run.create()
    atomic_write_json(run.config, json.loads(spec.model_dump_json()))
    return run, step


def _step_line(step: int, max_steps: int, orch: dict[str, Any], trainer: dict[str, Any]) -> str:
    def f(d: dict[str, Any], key: str, fmt: str) -> str:
        value = d.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "-"

    return (
        f"step {step:>4}/{max_steps} | reward {f(orch, 'reward_mean', '.3f')} | loss {f(trainer, 'loss', '+.4f')}"
        f" | mismatch_kl {f(trainer, 'mismatch_kl', '.1e')} | stale {f(orch, 'staleness_mean', '.1f')}"
        f"/{f(orch, 'staleness_max', 'd')} drop {f(orch, 'dropped_stale', 'd')}"
        f" | wait_for_batch {f(trainer, 'wait_for_batch_s', '.2f')}s wait_for_policy {f(orch, 'wait_for_policy_s', '.2f')}s"
        f" | {f(trainer, 'tokens_per_s', '.0f')} tok/s"
    )


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


def launch_rl(spec: RLSpec, *, resume: bool = False, overwrite: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Run an RL spec to its end with local processes; returns the summary (also in ``summary.json``) with the
    reason of a failed or cancelled end (``reason``, "" when completed; not in the file).

    Raises:
        SpecError: bad input found before anything was started (nothing is left on disk).
    """
    check_run_dir(spec, resume=resume, overwrite=overwrite)  # cheapest first
    preflight(spec)
    run, start = prepare_run_dir(spec, resume=resume, overwrite=overwrite)
    t_start = time.time()
    run.log_event("starting", resume_step=start)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    say = (lambda msg: None) if quiet else (lambda msg: print(msg, flush=True))  # noqa: T201 - console output
    status, reason = "failed", ""
    try:
        url = spec.inference.url
        orchestrator_env = None  # a server named by inference.url: the worker's ASYNCRL_INFERENCE_API_KEY, if any
        if url is None:
            from worker.inference.auth import API_KEY_VAR, new_api_key
            from worker.inference.server import run_server_command, server_env, wait_ready

            key = new_api_key()  # this run's server only: every route but /health needs it (worker.inference.auth)
            orchestrator_env = {**os.environ, API_KEY_VAR: key}

            port = spec.inference.port or free_port()
            url = f"http://{spec.inference.host}:{port}"
            cmd = run_server_command(spec, spec.inference.host, port, require_key=True)
            env = server_env(
                gpu_env(spec.launcher.local.inference_gpus), api_key=key, lora=spec.trainer.lora is not None
            )
            procs["inference"] = spawn(cmd, run.logs / "inference.log", env)
            say(f"starting vLLM at {url} (log: {run.logs / 'inference.log'})")
            from rich.console import Console

            with Console(stderr=True, quiet=quiet).status("waiting for vLLM to load the model (20-80 s on CPU)"):
                booted = wait_ready(
                    url, spec.inference.startup_timeout_s, procs["inference"], run.logs / "inference.log"
                )
            say(f"vLLM ready in {booted:.0f}s")
        resume_args = ["--resume-step", str(start)] if start else []
        procs["trainer"] = spawn(
            trainer_command(spec, run, resume_args), run.logs / "trainer.log", gpu_env(spec.launcher.local.trainer_gpus)
        )
        procs["orchestrator"] = spawn(
            [
                sys.executable,
                "-m",
                "worker.orchestrator",
                "--run-dir",
                str(run.root),
                "--inference-url",
                url,
                *resume_args,
            ],
            run.logs / "orchestrator.log",
            orchestrator_env,
        )
        run.log_event("running", inference_url=url, pids={k: p.pid for k, p in procs.items()})
        say(f"run {spec.name}: {run.root} (resume from step {start})" if start else f"run {spec.name}: {run.root}")
        status, reason = _follow(spec, run, procs, say, start or 0)
    except KeyboardInterrupt:
        status, reason = "cancelled", "interrupted"
    except Exception as err:  # the run is failed with the reason, whatever broke
        status, reason = "failed", f"{type(err).__name__}: {err}"
    finally:
        for proc in procs.values():
            kill_group(proc)
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


CONSOLE_WARNINGS = ("truncated", "policy_check_failed")
"""Engine events (``events.jsonl``) the local launcher prints as they come: a warn-only policy check or a step of
truncated rollouts would otherwise be seen only in the files."""


def _follow(
    spec: RLSpec, run: RunDir, procs: dict[str, subprocess.Popen[bytes]], say: Any, start: int
) -> tuple[str, str]:
    printed = start
    events_offset = run.events.stat().st_size if run.events.exists() else 0
    warned_offset = events_offset
    evals_said = sum(1 for r in read_jsonl(run.metrics) if r["source"] == "eval")  # a resumed run's earlier evals
    while True:
        events, warned_offset = read_jsonl_after(run.events, warned_offset)
        for e in events:  # what a run process warns about reaches the console too, not only events.jsonl
            if e.get("event") in CONSOLE_WARNINGS:
                say(f"warning: {e.get('reason', e['event'])}")
        rows = read_jsonl(run.metrics)
        by = {(r["source"], r["step"]): r for r in rows}
        while ("trainer", printed + 1) in by:
            printed += 1
            say(_step_line(printed, spec.max_steps, by.get(("orchestrator", printed), {}), by[("trainer", printed)]))
        evals = [r for r in rows if r["source"] == "eval"]
        for r in evals[evals_said:]:
            say(f"eval at policy version {r['step']}: reward {r['reward_mean']:.3f} pass@{r['k']} {r['pass_at_k']:.3f}")
        evals_said = len(evals)
        for name, proc in procs.items():
            code = proc.poll()
            if code is not None and code != 0:
                cause = _failure_cause(run, name, events_offset)
                return "failed", (
                    f"{name} exited with code {code}{': ' + cause if cause else ''} (log: {run.logs / (name + '.log')})"
                )
            if code is not None and name == "inference":
                return "failed", f"inference exited (log: {run.logs / 'inference.log'})"
        if all(procs[n].poll() == 0 for n in ("trainer", "orchestrator")):
            return "completed", ""
        time.sleep(0.5)
