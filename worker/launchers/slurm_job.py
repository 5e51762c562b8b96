"""Inside a Slurm job: what the run's supervisor does about time limits, requeues and ``scancel``.

The job script (``deploy/slurm/rl.sbatch.j2``, rendered by :mod:`worker.launchers.slurm`) runs
``python -m worker.launchers.supervisor`` and passes it USR1 and TERM. Then

- USR1 (``--signal=B:USR1@<signal_before_end_s>``: the time limit is near): :func:`on_time_limit` asks trainer and
  orchestrator for a checkpoint, waits for it, then ``scontrol requeue``s the job;
- a requeued job starts again with ``SLURM_RESTART_COUNT`` + 1: :func:`start_requeued` keeps the run directory up
  to its newest complete checkpoint (or starts over without one) and says what to report as ``requeued``;
- TERM (``scancel``, the time limit, or the requeue itself): :func:`end_status` tells a requeue (the next attempt
  reports) from a cancel;
- in a job of a root worker (``worker.run.procs.RUN_AS_VAR``) the supervisor runs as root and every process of the run
  as the run's uid: :func:`check_run_as` first makes sure that this works on every node of the job.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from worker.launchers.slurm import SlurmError, lost_nodes, state
from worker.run.checkpoint import complete_steps, request, resume_step
from worker.run.procs import run_as, run_as_argv, run_user_files
from worker.run.rundir import RunDir, SupervisorHome, empty_folder, read_jsonl

logger = logging.getLogger("asyncrl.supervisor")


def attempt() -> int | None:
    """``SLURM_RESTART_COUNT`` (0 on the first attempt) when this supervisor runs as a Slurm job, else None."""
    if os.environ.get("ASYNCRL_LAUNCHER") != "slurm" or "SLURM_JOB_ID" not in os.environ:
        return None
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def on_time_limit(run_dir: Path, signal_before_end_s: int, *, checkpoint: bool = True) -> None:
    """Make USR1 start :func:`checkpoint_then_requeue` in a thread, waiting for the checkpoint up to 10 s less
    than the ``signal_before_end_s`` seconds the time limit leaves (at least 10 s). Without ``checkpoint`` (an SFT
    run, which checkpoints at its ``ckpt.interval`` only, or an eval job, which records each task as it finishes) USR1
    requeues the job at once (:func:`requeue`)."""
    wait_s = max(10.0, signal_before_end_s - 10.0)
    target, args = (checkpoint_then_requeue, (run_dir, wait_s)) if checkpoint else (requeue, ())
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=target, args=args, daemon=True).start())


def requeue() -> None:
    """``scontrol requeue`` this job (``SLURM_JOB_ID``); the next attempt resumes what the run kept on disk."""
    job = os.environ["SLURM_JOB_ID"]
    logger.info("USR1: requeueing job %s", job)
    subprocess.run(["scontrol", "requeue", job], check=False)


def checkpoint_then_requeue(run_dir: Path, wait_s: float) -> None:
    """USR1 (the job's time limit is near): ask trainer and orchestrator for a checkpoint two steps after the
    orchestrator's last step, wait up to ``wait_s`` for it to be complete, then ``scontrol requeue`` the job (the
    next attempt resumes from the newest complete checkpoint)."""
    run = RunDir(run_dir)
    with run_user_files():  # a root worker's job: as the run's uid, which owns the run directory
        last = max((r["step"] for r in read_jsonl(run.metrics) if r.get("source") == "orchestrator"), default=0)
        step = last + 2  # the orchestrator may be writing step last + 1 already
        request(run, step)
        logger.info("USR1: checkpoint requested at step %d", step)
        deadline = time.monotonic() + wait_s
        while step not in complete_steps(run) and time.monotonic() < deadline:
            time.sleep(0.5)
        done = step in complete_steps(run)
    job = os.environ["SLURM_JOB_ID"]
    logger.info("checkpoint step %d %s; requeueing job %s", step, "complete" if done else "not complete in time", job)
    subprocess.run(["scontrol", "requeue", job], check=False)


def prepare_requeued(run_dir: Path, home: SupervisorHome, *, keep: bool = False) -> int | None:
    """A requeued attempt: keep the run directory up to its newest complete checkpoint (returned) or, without one,
    start over (``keep``: an eval job's directory is kept whole: the weights it evaluates and the tasks it recorded);
    the metrics forwarder replays from the start (ingestion is idempotent)."""
    run = RunDir(run_dir)
    with run_user_files():  # a root worker's job: as the run's uid, which owns the run directory
        step = resume_step(run) if run.config.exists() else None
        if step is not None or keep:  # an attempt lost with its node: its end, with the step it reached, before pruning
            run.record_interrupted()
        if step is not None:
            run.prune_after(step)
        elif not keep:
            empty_folder(run.root)
    home.forwarded_offset.unlink(missing_ok=True)
    return step


def start_requeued(restarts: int, run_dir: Path, home: SupervisorHome, *, keep: bool = False) -> dict[str, Any]:
    """Attempt ``restarts`` (> 0) of the job: :func:`prepare_requeued` (``keep``: as there), then the body of the
    ``requeued`` report (``{"restarts", "resume_step", "job"}``; ``resume_step`` None: the run starts over, or an
    eval job goes on after the tasks it recorded)."""
    step = prepare_requeued(run_dir, home, keep=keep)
    job = os.environ["SLURM_JOB_ID"]
    logger.info(
        "Slurm attempt %d of job %s: %s",
        restarts,
        job,
        f"resuming from checkpoint step {step}" if step is not None else "no complete checkpoint, starting over",
    )
    return {"restarts": restarts, "resume_step": step, "job": job}


def end_status(restarts: int) -> tuple[str | None, str]:
    """The status and reason to report after Slurm's SIGTERM in attempt ``restarts``: none when the job was requeued
    (the next attempt reports), else ``failed`` naming the lost nodes when a node of the job is down, drained or not
    responding (Slurm ends the job on the loss of a node: ``lost node asrl-n3 (DOWN: test)``) or the job ended
    ``NODE_FAIL`` (a node that is back already), else ``cancelled`` (``scancel`` or the time limit)."""
    job = os.environ["SLURM_JOB_ID"]
    try:
        lost = lost_nodes(os.environ.get("SLURM_JOB_NODELIST", ""))
    except SlurmError as err:
        logger.warning("cannot ask Slurm for the state of the job's nodes: %s", err)
        lost = {}
    why = "; ".join(f"lost node {node} ({what})" for node, what in lost.items())
    try:
        current = state(job)
    except SlurmError as err:
        logger.warning("cannot ask Slurm whether the job was requeued: %s", err)
        current = None
    if current is not None and current.restarts > restarts:  # requeued (scancel leaves the count alone)
        return None, f"Slurm job {job} requeued" + (f" after it {why}" if why else "")
    if current is not None and current.state == "NODE_FAIL":  # the node may be back already (ReturnToService=2)
        why = why or "lost a node (NODE_FAIL)"
    if why:
        return "failed", f"Slurm job {job} {why}"
    return "cancelled", f"Slurm job {job} terminated (scancel or time limit)"


class RunAsError(RuntimeError):
    """The run's processes cannot be started as its uid on a node of the job (one line); the run fails, never runs
    as root."""


RUN_AS_CHECK_TIMEOUT_S = 60.0


def run_as_check_command(nodes: int, environ: dict[str, str] | None = None) -> list[str]:
    """The command :func:`check_run_as` runs: ``id -u`` through :func:`worker.run.procs.run_as_argv`, here on one node,
    else once on each of the job's ``nodes`` nodes as a step (``--overlap``, beside the batch step)."""
    env = os.environ if environ is None else environ
    probe = [*run_as_argv(env), "id", "-u"]
    if nodes == 1:
        return probe
    return [
        "srun",
        f"--jobid={env['SLURM_JOB_ID']}",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        f"--nodelist={env['SLURM_JOB_NODELIST']}",
        "--overlap",
        "--job-name=run-as-check",
        *probe,
    ]


def check_run_as(nodes: int) -> None:
    """In a job of a root worker (``worker.run.procs.RUN_AS_VAR`` set; otherwise nothing): check for real, on each of
    the job's ``nodes`` nodes, that a command started as the run's uid runs as that uid.

    Raises:
        RunAsError: ``cannot run the run's processes as uid <uid> on <node(s)>: <why>; install util-linux (setpriv)
            there, the run never runs as root``.
    """
    identity = run_as()
    if identity is None:
        return
    uid = identity[0]
    where = f"the {nodes} nodes of job {os.environ.get('SLURM_JOB_ID', '?')}" if nodes > 1 else os.uname().nodename
    try:
        proc = subprocess.run(
            run_as_check_command(nodes),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_AS_CHECK_TIMEOUT_S,
        )
        out = proc.stdout.split()
        why = None
        if proc.returncode != 0 or out != [str(uid)] * nodes:
            why = " ".join(proc.stderr.split()) or f"exit status {proc.returncode}, uid {' '.join(out) or 'none'}"
    except FileNotFoundError as err:
        why = f"{err.filename}: not found"
    except subprocess.TimeoutExpired:
        why = f"no answer within {RUN_AS_CHECK_TIMEOUT_S:g} s"
    if why is not None:
        raise RunAsError(
            f"cannot run the run's processes as uid {uid} on {where}: {why}; "
            "install util-linux (setpriv) there, the run never runs as root"
        )
