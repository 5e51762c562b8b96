"""Slurm launcher: a run as a Slurm job, controlled with Slurm's own commands (no accounting database).

Every kind of run goes this one way: an RL run, an SFT run and an eval job (``kind = "rl" | "sft" | "eval"``) with
``launcher.kind = "slurm"`` become the same job script, whose supervisor runs the kind's local launcher.

- ``render`` fills ``deploy/slurm/rl.sbatch.j2`` from the run spec. On one node the job runs the run's supervisor
  (``worker.launchers.supervisor``: the local launcher's code path, reporting to the server); on several nodes (RL runs
  only) it splits them between inference and trainer (torchrun c10d rendezvous on the first trainer node).
- ``submit`` creates the job with ``sbatch --parsable`` (the job id is the run's launcher handle), or, when the spec
  names an ``allocation``, starts the script as a step of that job with ``srun --jobid=<id> --overlap`` (the handle
  is ``<job>.<step>``). A run's job is named ``asyncrl-run-<id>`` and works in the run's home folder, which is how
  ``find`` recognises it after a redelivered launch.
- ``state`` reads ``scontrol show job`` / ``squeue`` (``None`` once Slurm forgot the job); ``cancel`` is ``scancel``.

Requeue (``scontrol requeue``, or USR1 before the time limit): Slurm kills the job and starts it again with
``SLURM_RESTART_COUNT`` + 1; the supervisor then resumes from the newest complete checkpoint by itself.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from worker.inference.model_info import seed_run_home
from worker.run.checkpoint import complete_steps
from worker.run.procs import RunUser, give_folder, run_environ
from worker.run.rundir import SupervisorHome, atomic_write_text
from worker.spec import EvalSpec, RLSpec, SFTSpec

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "rl.sbatch.j2"
LIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SUSPENDED",
        "STOPPED",
        "PREEMPTED",
        "SIGNALING",
        "STAGE_OUT",
    }
)
"""Job states in which the run goes on (or will start again)."""
COMMAND_TIMEOUT_S = 30.0
JobSpec = RLSpec | SFTSpec | EvalSpec
"""A spec the Slurm launcher submits: any kind of run (SFT runs and eval jobs on one node)."""
KIND_NAMES = {"rl": "RL run", "sft": "SFT run", "eval": "eval job"}
JOB_UMASK = "0027"
"""The umask of a root worker's job (the job script sets it; Slurm makes the job's output file with it): what its root
processes and the run's uid make gives no access to other uids (``worker.launchers.supervisor.SLURM_HOME_MODE``)."""


class SlurmError(RuntimeError):
    """A Slurm command failed; the message is Slurm's own (stderr), one line."""


@dataclass(frozen=True)
class JobState:
    state: str
    """``JobState`` (``RUNNING``, ``PENDING``, ``COMPLETED``, ``CANCELLED``, ``FAILED``, ``TIMEOUT``, ...)."""
    reason: str
    restarts: int
    exit_code: str
    nodes: str = ""
    """``NodeList``: the job's nodes as a Slurm hostlist (``asrl-n[1-3]``; "" before it has any)."""

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


def job_name(run_id: int) -> str:
    return f"asyncrl-run-{run_id}"


def slurm_command(argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run a Slurm command (with the environment ``env``, default this process's); returns stdout.

    Raises:
        SlurmError: non-zero exit, with the command's stderr joined into one line.
    """
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=env)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]}: not found (is Slurm installed on this worker?)") from None
    if proc.returncode != 0:
        message = " ".join(proc.stderr.split()) or f"exit code {proc.returncode}"
        raise SlurmError(message)
    return proc.stdout


def render(
    spec: JobSpec,
    *,
    home: Path,
    name: str,
    resume: bool = False,
    python: str = sys.executable,
    workdir: Path | None = None,
    user: RunUser | None = None,
) -> str:
    """The job script of ``spec`` (text); ``home`` holds the run directory, logs and the supervisor's files;
    ``name`` is the job name. ``resume``: start from the newest complete checkpoint (an eval job continues after the
    tasks it recorded either way). ``user`` (a root worker's run user, ``worker.launchers.supervisor.run_user``): the
    script sets ``worker.run.procs.RUN_AS_VAR``, so every process of the run runs as its uid and gid."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE.parent),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
    )
    env.filters["quote"] = lambda value: shlex.quote(str(value))
    run = SupervisorHome(home).run_dir(spec.name)
    steps = complete_steps(run) if resume else []
    return env.get_template(TEMPLATE.name).render(
        spec=spec,
        s=spec.launcher.slurm,
        kind=KIND_NAMES[spec.kind],
        name=spec.name,
        job_name=name,
        home=home,
        run_dir=run.root,
        python=python,
        workdir=workdir or Path.cwd(),
        resume=resume,
        resume_arg=f" --resume-step {steps[-1]}" if steps else "",
        user=user,
        run_as=None if user is None else f"{user.uid}:{user.gid}:{user.name}:{user.home}",
        umask=JOB_UMASK,
    )


def find(run_id: int, home: Path, allocation: str | None = None) -> str | None:
    """The handle of this run's live job if one exists, else None: a job named ``asyncrl-run-<id>`` whose working
    folder is ``home`` (another service's run with the same id has another home), or, inside ``allocation``, a
    step of that name.

    Raises:
        SlurmError: squeue failed (e.g. not installed, controller down).
    """
    if allocation is not None:
        return _step(allocation, job_name(run_id))
    out = slurm_command(["squeue", "-h", "-n", job_name(run_id), "-o", "%i %Z"])
    for line in out.splitlines():
        job, _, workdir = line.strip().partition(" ")
        if Path(workdir) == home:
            return job
    return None


def _step(allocation: str, name: str) -> str | None:
    """``<job>.<step>`` of the step called ``name`` in job ``allocation``, or None."""
    for line in slurm_command(["squeue", "-h", "-s", "-j", allocation, "-o", "%i %j"]).splitlines():
        step, _, step_name = line.strip().partition(" ")
        if step_name == name:
            return step
    return None


def submit(
    spec: JobSpec,
    *,
    run_id: int,
    home: Path,
    env: dict[str, str],
    resume: bool = False,
    user: RunUser | None = None,
) -> str:
    """Write ``<home>/job.sbatch`` and submit it; returns the launcher handle (``<job>``, or ``<job>.<step>``
    inside an ``allocation``). The job's environment is ``env`` (``worker.launchers.supervisor.run_env``: run id, token,
    server URL) over the variables of this process that ``worker.run.procs.run_environ`` lets through (no database or
    broker URL, no server secret); it is not written into the script. ``user``: the run's processes run as its uid
    (:func:`render`); its ``HOME`` (a folder of ``home``) is made and given to it here
    (``worker.run.procs.give_folder``), while ``home`` itself, where the job's root processes write their logs, stays
    this process's (``worker.launchers.supervisor.open_slurm_home``); the job script is written 0640 and the job runs
    under :data:`JOB_UMASK`.

    Raises:
        SlurmError: Slurm refused it (e.g. ``sbatch: error: invalid partition specified: nope``); nothing is queued.
            A partition with fewer nodes than ``launcher.slurm.nodes`` is refused before ``sbatch`` (which would
            queue it for ever, or fail with a message naming no key): ``launcher.slurm.nodes: ...``.
    """
    slurm = spec.launcher.slurm
    if slurm.nodes > 1 and slurm.allocation is None:
        check_partition_nodes(slurm.partition, slurm.nodes)
    home.mkdir(parents=True, exist_ok=True)
    if user is not None and Path(user.home).parent == home:  # a run's own uid: its HOME is a folder of its home
        Path(user.home).mkdir(exist_ok=True)
        seed_run_home(Path(user.home), spec.model.name)
        give_folder(Path(user.home), user.uid, os.stat(home).st_gid)
    script = SupervisorHome(home).job_script
    atomic_write_text(script, render(spec, home=home, name=job_name(run_id), resume=resume, user=user), mode=0o640)
    full_env = {**run_environ(os.environ), **env}
    if user is not None:  # the job's own output file (slurm-<job>.out), made by Slurm: no access for other uids
        full_env["SLURM_UMASK"] = JOB_UMASK
    if slurm.allocation is None:
        return slurm_command(["sbatch", "--parsable", str(script)], env=full_env).strip().split(";")[0]
    return _start_step(slurm.allocation, run_id, home, script, full_env)


def check_partition_nodes(partition: str | None, nodes: int) -> None:
    """Refuse a job of ``nodes`` nodes on a partition (None: the cluster's default) that has fewer.

    Raises:
        SlurmError: ``launcher.slurm.nodes: partition <p> has <n> nodes, asked for <nodes>`` (one line), or sinfo
            failed (e.g. ``invalid partition specified``).
    """
    argv = ["sinfo", "-h", "-o", "%P %D"] + (["-p", partition] if partition else [])
    sizes: dict[str, int] = {}
    for line in slurm_command(argv).splitlines():  # a partition's nodes in several states come as several lines
        part, size = line.split()
        if partition or part.endswith("*"):  # without one: the default partition, starred by sinfo
            sizes[part.rstrip("*")] = sizes.get(part.rstrip("*"), 0) + int(size)
    if partition and not sizes:
        raise SlurmError(f"launcher.slurm.partition: this cluster has no partition {partition}")
    if sizes and max(sizes.values()) < nodes:  # several partitions: the job runs in one of them
        largest = max(sizes, key=lambda part: sizes[part])
        raise SlurmError(f"launcher.slurm.nodes: partition {largest} has {sizes[largest]} nodes, asked for {nodes}")


def _start_step(allocation: str, run_id: int, home: Path, script: Path, env: dict[str, str]) -> str:
    """Run ``script`` as a step of job ``allocation``; returns ``<job>.<step>`` once Slurm lists the step."""
    name = job_name(run_id)
    srun_log = SupervisorHome(home).srun_log
    with open(os.open(srun_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640), "ab") as log:
        proc = subprocess.Popen(
            [
                "srun",
                f"--jobid={allocation}",
                "--overlap",
                "--nodes=1",
                "--ntasks=1",
                f"--job-name={name}",
                f"--chdir={home}",
                "bash",
                str(script),
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    while time.monotonic() < deadline:
        if (step := _step(allocation, name)) is not None:
            return step
        if proc.poll() is not None:
            text = srun_log.read_text(errors="replace").strip().splitlines()
            raise SlurmError(text[-1] if text else f"srun exited with code {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise SlurmError(f"srun --jobid={allocation}: no step {name} after {COMMAND_TIMEOUT_S:.0f}s")


def state(handle: str) -> JobState | None:
    """The job's (or step's) state from ``scontrol``/``squeue``; None once Slurm no longer knows it.

    Raises:
        SlurmError: Slurm could not be asked (not installed, controller down).
    """
    try:
        if "." in handle:  # a step inside an allocation: live while squeue lists it
            steps = slurm_command(["squeue", "-h", "-s", "-j", handle.split(".")[0], "-o", "%i"]).split()
            return JobState("RUNNING", "", 0, "") if handle in steps else None
        out = slurm_command(["scontrol", "show", "job", "-o", handle])
    except SlurmError as err:
        if "Invalid job id" in str(err):
            return None
        raise
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return JobState(
        state=fields.get("JobState", "UNKNOWN"),
        reason=fields.get("Reason", ""),
        restarts=int(fields.get("Restarts", "0")),
        exit_code=fields.get("ExitCode", ""),
        nodes="" if fields.get("NodeList", "(null)") == "(null)" else fields["NodeList"],
    )


LOST_STATES = ("DOWN", "FAIL", "DRAIN", "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN")
"""Parts of a node's ``State`` (``scontrol show node``: ``DOWN``, ``IDLE+DRAIN``, ``ALLOCATED*``...) that say it no
longer runs its part of a job; a trailing ``*`` (not responding) says it too."""


def lost_nodes_of(scontrol_nodes: str) -> dict[str, str]:
    """The nodes of ``scontrol show node -o <nodes>`` output that are lost (:data:`LOST_STATES`): node name ->
    ``"<State>: <Reason>"`` (``"DOWN: test"``; the state alone without a reason), in the output's order."""
    lost = {}
    for line in scontrol_nodes.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        name, node_state = fields.get("NodeName"), fields.get("State", "")
        if name and (node_state.endswith("*") or any(part in node_state for part in LOST_STATES)):
            # the last field, spaces and all, then who set it and when: "Reason=test [root@2026-12-04T03:50:00]"
            reason = re.sub(r"\s*\[[^\]]*\]$", "", line.split("Reason=", 1)[1].strip()) if "Reason=" in line else ""
            lost[name] = f"{node_state}: {reason}" if reason else node_state
    return lost


def lost_nodes(nodelist: str) -> dict[str, str]:
    """The nodes of the Slurm hostlist ``nodelist`` (``asrl-n[1-3]``) that are down, drained, failed or not
    responding (:func:`lost_nodes_of`); {} when every node is up.

    Raises:
        SlurmError: scontrol failed (controller down, unknown node).
    """
    return lost_nodes_of(slurm_command(["scontrol", "show", "node", "-o", nodelist])) if nodelist else {}


def cancel(handle: str, *, wait_s: float = 60.0) -> None:
    """``scancel`` the job (or step) and wait up to ``wait_s`` until it has left the live states.

    Raises:
        SlurmError: scancel failed for another reason than the job having ended already.
    """
    try:
        slurm_command(["scancel", handle])
    except SlurmError as err:
        if "Invalid job id" not in str(err) and "already completing or completed" not in str(err):
            raise
    deadline = time.monotonic() + wait_s
    while (current := state(handle)) is not None and current.live and time.monotonic() < deadline:
        time.sleep(0.2)
