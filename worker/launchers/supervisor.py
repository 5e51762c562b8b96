"""Supervisor of one service-launched run: ``python -m worker.launchers.supervisor --home DIR``.

The Celery ``launch_run`` task starts it in its own session (process group) and records its pid. It

- holds an exclusive ``flock`` on ``<home>/supervisor.lock`` for its whole life, so at most one supervisor
  (and one set of run processes) exists per run, and a redelivered launch finds and adopts it;
- runs the run with the local launcher (``worker.launchers.local.launch_rl``; ``launch_sft`` for a
  ``kind = "sft"`` run: one process, the SFT trainer; ``launch_eval`` for an eval job), whose processes inherit its
  environment: ``ASYNCRL_RUN_ID``, ``ASYNCRL_RUN_TOKEN``, ``ASYNCRL_SERVER_URL`` and the worker's variables that
  :func:`worker.run.procs.run_environ` lets through (never the database or broker URL, the server's secret or
  another run's token);
- talks to the server over HTTP only, through :class:`worker.launchers.reporter.Reporter`: metrics, live config, status
  changes, and the final status, spooled in ``<home>/final.json`` before it is reported;
- turns SIGTERM (``asyncrl runs stop``) into a clean cancel: the launcher tears its processes down;
- is the hang watchdog's decider (``worker/tracking/progress.py``): the launcher's follow loop reads the processes'
  progress records and probes inference, and writes ``stalled`` / ``progress_resumed`` events, which the reporter
  forwards; the service fires the alert rules and applies ``watchdog.on_stall`` (``launch_rl(act_on_stall=False)``);
- inside a Slurm job (any kind of run), checkpoints and requeues before the time limit and resumes a requeued
  attempt (:mod:`worker.launchers.slurm_job`); in a root worker's job it stays root but gives the run directory to the
  run's uid first and then reads and writes it only as that uid (:func:`worker.run.procs.run_user_files`).

``--attempt N`` names the launch attempt (the id of the run event that last queued the run; the launch task passes
it): the spool records it, so a spool of an earlier attempt (before a resume) is never taken for this one's.

``<home>`` is ``<ASYNCRL_OUTPUT_DIR>/runs/<id>``; the run directory is ``<home>/<name>``; the files of the home
folder are named by :class:`worker.run.rundir.SupervisorHome`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import pwd
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import httpx

from worker.inference.model_info import seed_run_home
from worker.launchers import slurm_job
from worker.launchers.reporter import Reporter, report_timeout_s
from worker.run import cgroups
from worker.run.procs import (
    WORKER_CACHE_VARS,
    RunUser,
    alive,
    give_folder,
    give_to_run_user,
    run_environ,
    run_user_files,
)
from worker.run.rundir import SupervisorHome, describe_os_error, read_jsonl

logger = logging.getLogger("asyncrl.supervisor")


# ----------------------------------------------------------------------------- starting and stopping


def running_pid(home: Path) -> int | None:
    """Pid of the live supervisor holding ``home``'s lock, or None."""
    path = SupervisorHome(home).lock
    if not path.exists():
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = f.read().strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def run_env(run_id: int, token: str, server_url: str, allow: Collection[str] = ()) -> dict[str, str]:
    """The whole environment of a run's supervisor (and so of its processes): this process's variables that
    :func:`worker.run.procs.run_environ` lets through (``allow``: the worker's ``RUN_ENV_ALLOW``), plus the run id,
    the run token (never logged) and the server's URL."""
    ids = {"ASYNCRL_RUN_ID": str(run_id), "ASYNCRL_RUN_TOKEN": token, "ASYNCRL_SERVER_URL": server_url}
    return {**run_environ(os.environ, allow), **ids}


RUN_HOME_DIR = "user-home"
"""The ``HOME`` of a run that runs as its own uid (``RUN_UID_BASE``): a folder of the run's home folder, so its caches
are its own."""

DEFAULT_RUN_UID_BASE = 1_900_000_000
"""The ``RUN_UID_BASE`` of a root worker that sets neither ``RUN_USER`` nor ``RUN_UID_BASE``: run ``n`` runs as uid
``1_900_000_000 + n``, far above the accounts of any machine (distributions hand out uids below 65536; systemd's
dynamic and container ranges end below 2**31 - 1 but start far lower), so a root worker never runs a run as root."""


def run_user(name: str, *, run_id: int | None = None, uid_base: int = 0, home: Path | None = None) -> RunUser | None:
    """The account a run's processes run as: with ``uid_base`` (the worker's ``RUN_UID_BASE``), uid and gid
    ``uid_base + run_id`` (no account needed; ``HOME`` = ``<home>/user-home``), so that runs, of one user or of
    several, cannot read each other's environment (``/proc/<pid>/environ``: run token, vLLM key), signal or trace each
    other's processes, or read or write each other's files (:func:`give_home`); else the account ``name``. With neither, a root worker uses
    :data:`DEFAULT_RUN_UID_BASE` (never root), any other worker its own user (None).

    Raises:
        ValueError: no such account, it is root, the run's uid belongs to an account or passes 2**31 - 1, or this
            process is not root (only root may switch users).
    """
    if not name and not uid_base and os.geteuid() == 0:
        uid_base = DEFAULT_RUN_UID_BASE
    if uid_base:
        if run_id is None or home is None:
            raise ValueError("RUN_UID_BASE: a run's own uid needs its run id and home folder")
        uid = uid_base + run_id
        if uid > 2**31 - 1:
            raise ValueError(f"RUN_UID_BASE: run {run_id}'s uid {uid} passes 2147483647; lower RUN_UID_BASE")
        try:
            taken = pwd.getpwuid(uid).pw_name
        except KeyError:
            taken = None
        if taken is not None:
            raise ValueError(
                f"RUN_UID_BASE: run {run_id}'s uid {uid} belongs to the account {taken!r}; "
                "choose a base above every account of the worker"
            )
        if os.geteuid() != 0:
            raise ValueError(
                f"RUN_UID_BASE: the worker runs as uid {os.geteuid()}, not root: it cannot start runs as uid {uid}"
            )
        return RunUser(f"asyncrl-run-{run_id}", uid, uid, str(home / RUN_HOME_DIR))
    if not name:
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(f"RUN_USER: no user {name!r} on this worker") from None
    if entry.pw_uid == 0:
        raise ValueError(f"RUN_USER: {name!r} is root; name an unprivileged user")
    if os.geteuid() != 0:
        raise ValueError(f"RUN_USER: the worker runs as uid {os.geteuid()}, not root: it cannot start runs as {name!r}")
    return RunUser(name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


PYTHON_CHECK_TIMEOUT_S = 20.0
"""How long :func:`check_python` waits for the run user's ``import worker`` (~0.05 s on an idle machine)."""

_python_usable: set[tuple[str, int, int]] = set()
"""(Python, uid, gid) that :func:`check_python` saw work, in this process."""


def check_python(user: RunUser, python: str | None = None) -> None:
    """Check for real that ``user`` can run ``python`` (this worker's, by default) and import asyncrl: start
    ``python -c "import worker"`` as its uid and gid (no supplementary groups), in this process's working folder, with
    a run's environment. A success is remembered for the life of this process, a failure is checked again next time
    (the admin may have fixed it meanwhile).

    Raises:
        ValueError: it cannot; one line saying why and how to fix it (never run the run as anyone else instead).
    """
    python = python or sys.executable
    key = (python, user.uid, user.gid)
    if key in _python_usable:
        return
    env = {**run_environ(os.environ), "HOME": "/", "USER": user.name, "LOGNAME": user.name}
    why: str | None
    try:
        proc = subprocess.run(
            [python, "-c", "import worker"],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PYTHON_CHECK_TIMEOUT_S,
            user=user.uid,
            group=user.gid,
            extra_groups=[],
        )
        lines = proc.stderr.strip().splitlines()
        why = None if proc.returncode == 0 else (lines[-1] if lines else f"exit status {proc.returncode}")
    except subprocess.TimeoutExpired:
        why = f"import worker did not finish within {PYTHON_CHECK_TIMEOUT_S:g} s"
    except OSError as err:
        why = err.strerror or str(err)
    if why is None:
        _python_usable.add(key)
        return
    folder = folder_in_the_way(python, user.uid, user.gid)
    how = f"chmod o+x {folder}" if folder is not None else f"make {python} and its libraries readable by other users"
    raise ValueError(
        f"the run user {user.name} (uid {user.uid}) cannot run this worker's Python {python} ({why}): make it usable "
        f"by other users (e.g. `{how}`; scripts/setup.sh does) or set RUN_USER to an account that can"
    )


def check_run_user(user: RunUser, home: Path) -> None:
    """Before a run of ``user`` starts (here or as a Slurm job): it can run this worker's Python (:func:`check_python`)
    and enter the run's ``home`` folder.

    Raises:
        ValueError: it cannot; one line saying what to change.
    """
    check_python(user)
    if (folder := folder_in_the_way(str(home), user.uid, user.gid)) is not None:
        raise ValueError(
            f"the run user {user.name} (uid {user.uid}) cannot enter {folder}, above its home folder {home}: "
            f"`chmod o+x {folder}`, or set ASYNCRL_OUTPUT_DIR to a folder other users may enter"
        )


def folder_in_the_way(path: str, uid: int, gid: int) -> Path | None:
    """The first folder above ``path`` (as given, then with its links resolved) that ``uid``/``gid`` (without
    supplementary groups) may not enter, or None (folders that do not exist yet are not looked at)."""
    for chain in (Path(os.path.abspath(path)), Path(os.path.realpath(path))):
        for folder in reversed(chain.parents):
            try:
                st = os.stat(folder)
            except FileNotFoundError:  # made later, by this process
                break
            except OSError:
                return folder
            bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH
            if not st.st_mode & bit:
                return folder
    return None


def spec_model(spec: dict[str, Any]) -> str:
    """The spec's ``model.name`` (``""`` when it names none: an eval job of a run's weights)."""
    model = spec.get("model")
    return str(model.get("name", "")) if isinstance(model, dict) else ""


def give_home(home: Path, user: RunUser) -> None:
    """Make the run's home folder (spec, logs, run directory, a fork's copied checkpoint, the inputs copied from other
    runs: :mod:`worker.run.inputs`) the run user's, in the group of the folder that holds the homes
    (``<ASYNCRL_OUTPUT_DIR>/runs``: the server's, which reads them), with the home folder
    :data:`worker.run.procs.RUN_FOLDER_MODE`: another run's uid cannot enter it, so reads nothing in it
    (:func:`worker.run.procs.give_folder`: a hard-linked file is copied first)."""
    give_folder(home, user.uid, os.stat(home.parent).st_gid)


SLURM_HOME_MODE = 0o2751
"""Mode of the home folder of a root worker's Slurm run (:func:`open_slurm_home`): the worker's (root's), since the
job's root processes write their logs and spools in it; the server's group reads it; any uid may pass through it but
not list it."""


def open_slurm_home(home: Path) -> None:
    """Before a root worker's Slurm run is prepared: make its ``home`` folder if missing, the worker's, in the group of
    the folder that holds the homes (the server's; the set-group-id bit gives that group to what is made in it), mode
    :data:`SLURM_HOME_MODE`. The run's uid passes through it to what is given to it
    (:func:`worker.run.procs.give_folder`: its run directory, ``HOME`` and copied inputs); the files of the worker and
    of the job's root processes in it are written with no access for other uids (the spec and job script 0640, the
    job under ``umask 027``)."""
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, -1, os.stat(home.parent).st_gid)
    os.chmod(home, SLURM_HOME_MODE)


def detach(
    argv: list[str],
    env: dict[str, str],
    log: Path,
    user: RunUser | None = None,
    cgroup: cgroups.RunCgroup | None = None,
    on_exit: Callable[[int], object] | None = None,
) -> int:
    """Start ``argv`` in its own session (process group) with exactly ``env``, output appended to ``log``, as
    ``user`` when given (its uid, gid and no supplementary groups; ``HOME``, ``USER``, ``LOGNAME`` its own, none of
    :data:`WORKER_CACHE_VARS`), inside
    ``cgroup`` when given (it joins between fork and exec, before it drops root, so whatever it starts is in the
    cgroup too); returns its pid (= its process group and session id). The way a supervisor is started.
    ``on_exit(pid)`` is called in a thread of this process when it ends (while this process lives).

    Raises:
        OSError: ``argv`` cannot be started (e.g. ``user`` may not run the interpreter, the cgroup is gone).
    """
    if user is not None:
        env = {k: v for k, v in env.items() if k not in WORKER_CACHE_VARS}
        env = {**env, "HOME": user.home, "USER": user.name, "LOGNAME": user.name}
    switch: dict[str, Any] = {} if user is None else {"user": user.uid, "group": user.gid, "extra_groups": []}
    if cgroup is not None:
        target = cgroup

        def child_setup() -> None:  # between fork and exec, after setsid: join the cgroup as root, then drop root
            target.join()
            if user is not None:
                os.setgroups([])
                os.setgid(user.gid)
                os.setuid(user.uid)

        switch = {"preexec_fn": child_setup}
    with open(log, "ab") as out:
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **switch,
            )
        except subprocess.SubprocessError as err:  # preexec_fn failed: could not join the cgroup or drop root
            raise OSError(f"cannot start the supervisor in cgroup {cgroup.name if cgroup else None}: {err}") from None

    def reap() -> None:  # reap it if it ends while this process lives, then end what is left of the run
        proc.wait()
        if on_exit is not None:
            on_exit(proc.pid)

    threading.Thread(target=reap, daemon=True).start()
    return proc.pid


def start(
    home: Path,
    *,
    run_id: int,
    spec: dict[str, Any],
    token: str,
    server_url: str,
    resume: bool = False,
    attempt: int | None = None,
    allow_env: Collection[str] = (),
    user: RunUser | None = None,
    cgroup: cgroups.RunCgroup | None = None,
) -> int:
    """Write the spec and start a detached supervisor (``resume``: continue the run directory from its newest
    complete checkpoint; ``attempt``: see the module docstring; ``allow_env``: see :func:`run_env`; ``user``: run
    it, and so the run's processes, as that account, which then owns ``home``; ``cgroup``: the run's cgroup, made
    by :func:`worker.run.cgroups.prepare`, that it and every process of the run live in) with the environment
    :func:`run_env`; returns its pid (= its process group and session id). A final status spooled by an earlier
    supervisor of ``home`` is removed first. When it ends while this process lives, whatever is left of the run
    (its cgroup's and its session's processes) is killed and the cgroup removed (:func:`after_exit`).

    Raises:
        ValueError: ``user`` cannot run this Python (:func:`check_python`) or enter ``home``; nothing was started.
        OSError: the supervisor cannot be started.
    """
    if user is not None:
        check_run_user(user, home)
    files = SupervisorHome(home)
    files.write_spec(spec)
    files.final.unlink(missing_ok=True)
    if user is not None:
        files.log.touch()
        if Path(user.home).parent == home:  # a run's own uid: its HOME is a folder of its home folder
            Path(user.home).mkdir(exist_ok=True)
            seed_run_home(Path(user.home), spec_model(spec))
        give_home(home, user)
    argv = [
        sys.executable,
        "-m",
        "worker.launchers.supervisor",
        "--home",
        str(home),
        *(["--resume"] if resume else []),
        *(["--attempt", str(attempt)] if attempt is not None else []),
    ]
    env = run_env(run_id, token, server_url, allow_env)
    return detach(argv, env, files.log, user, cgroup, on_exit=lambda pid: after_exit(home, pid, cgroup))


def after_exit(home: Path, pid: int, cgroup: cgroups.RunCgroup | None) -> set[int]:
    """The supervisor ``pid`` of ``home`` has ended: kill what is left of its run (its cgroup's processes, its
    session's processes that started before now) and remove the cgroup; returns the pids killed. Does nothing while
    another supervisor holds ``home`` (a second start that found the lock taken exits at once)."""
    if running_pid(home) is not None:
        return set()
    killed = cgroups.end_run(cgroup, pid, started_before=time.time(), guard_cgroup=True)
    if killed:
        logger.warning("supervisor %d ended; killed %d processes it left: %s", pid, len(killed), sorted(killed))
    return killed


def terminate(pid: int, grace_s: float = 30.0, cgroup: cgroups.RunCgroup | None = None) -> set[int]:
    """SIGTERM the supervisor's process group, wait up to ``grace_s`` for it to end, then SIGKILL it and every
    process of its run that is left (``cgroup``'s, and the members of its session that started before this call)
    and remove ``cgroup``; returns the pids killed after the grace period."""
    t0 = time.time()
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    else:
        deadline = time.monotonic() + grace_s
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return cgroups.end_run(cgroup, pid, started_before=t0, guard_cgroup=True)


# ----------------------------------------------------------------------------- main


def _last_reason(run_dir: Path) -> str:
    events = read_jsonl(run_dir / "events.jsonl")
    return str(events[-1].get("reason", "")) if events else ""


def _end_processes(status: str, reason: str) -> tuple[str, str]:
    """Before the final report: kill every other process of this run still alive (in this supervisor's cgroup or
    session: whatever escaped the launcher's teardown), and name an OOM kill in a failure's reason."""
    unit = cgroups.of_process()
    me = os.getpid()
    left = cgroups.end_run(unit, me, started_before=None, exclude={me}, remove=False)
    if left:
        logger.warning("killed %d processes of the run left after the launcher: %s", len(left), sorted(left))
    if status == "failed":
        reason = cgroups.oom_reason(unit, reason)
    return status, reason


def prepare_resume(run_dir: Path, home: SupervisorHome) -> int | None:
    """Before a resumed attempt's reporter starts: cut the run directory back to its newest complete checkpoint
    (returned; None without one: the launcher then refuses ``--resume``) as the launcher would, and forward
    ``metrics.jsonl`` again from its start (ingestion is idempotent), as a requeued Slurm attempt does.

    Points the killed attempt wrote after the checkpoint and never sent (its supervisor died, or could not reach the
    server) are pruned before anything is sent: the server deleted those steps at resume and the resumed run measures
    them again; sent late they would be stored instead of the new measurements. The byte offset sent so far means
    nothing in the pruned file: read from it, it would skip or cut the lines the killed attempt had not sent.
    """
    from worker.run.checkpoint import resume_step
    from worker.run.rundir import RunDir

    run = RunDir(run_dir)
    with run_user_files():  # a root worker's Slurm job: as the run's uid, which owns the run directory
        step = resume_step(run) if run.config.exists() else None
        if step is not None:
            run.record_interrupted()  # a killed attempt's end, with the step it reached, before the pruning
            run.prune_after(step)
    home.forwarded_offset.unlink(missing_ok=True)
    return step


_terminated = threading.Event()
_terminated_at: list[float] = []
"""``time.monotonic()`` of the first SIGTERM: the end's steps are logged with the seconds since (Slurm SIGKILLs the
job's processes KillWait seconds after its SIGTERM)."""


def _on_sigterm(_signum: int, _frame: Any) -> None:
    _terminated.set()
    if not _terminated_at:
        _terminated_at.append(time.monotonic())
    raise KeyboardInterrupt


def _since_sigterm(what: str) -> None:
    if _terminated_at:
        logger.info("%s %.1f s after SIGTERM", what, time.monotonic() - _terminated_at[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.launchers.supervisor")
    p.add_argument("--home", type=Path, required=True)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--attempt", type=int, default=None, help="launch attempt, recorded in the final-status spool")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(
        logging.WARNING
    )  # a line per request (config polls every second) buries the log
    try:
        deadline_s = report_timeout_s()
    except ValueError as err:
        p.error(str(err))
    home = SupervisorHome(args.home)
    lock = open(home.lock, "a+")  # noqa: SIM115 - held open for the life of the process
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        logger.info("another supervisor holds %s; exiting", home.lock)
        return 0
    try:
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
    except OSError as err:  # a full disk: the lock is held all the same (the worker also knows the pid)
        logger.warning("could not write the pid into %s: %s", home.lock, err)
    signal.signal(signal.SIGTERM, _on_sigterm)

    from worker.spec import EvalSpec, RLSpec, SFTSpec, SpecError, validate_spec

    run_id = int(os.environ["ASYNCRL_RUN_ID"])
    client = httpx.Client(
        base_url=os.environ["ASYNCRL_SERVER_URL"],
        timeout=30.0,
        headers={"Authorization": f"Bearer {os.environ['ASYNCRL_RUN_TOKEN']}"},
    )
    data = json.loads(home.spec.read_text())
    spec = validate_spec(str(data.get("kind", "rl")), data)
    resume, attempt = args.resume, slurm_job.attempt()
    requeue: dict[str, Any] | None = None
    if attempt is not None:  # an SFT run or an eval job has no checkpoint on request: USR1 requeues at once
        checkpoint = isinstance(spec, RLSpec)
        slurm_job.on_time_limit(spec.run_dir, spec.launcher.slurm.signal_before_end_s, checkpoint=checkpoint)
    give_to_run_user(spec.run_dir)  # a root worker's job: the run directory is the run's uid's from here on
    if attempt:
        requeue = slurm_job.start_requeued(attempt, spec.run_dir, home, keep=isinstance(spec, EvalSpec))
        resume = requeue["resume_step"] is not None
    elif resume:
        try:
            prepare_resume(spec.run_dir, home)
        except OSError as err:  # the launcher meets it again when it prepares the run directory, and reports it
            logger.warning("could not prepare the resume of %s: %s", spec.run_dir, err)
    # made after start_requeued / prepare_resume: what events.jsonl holds now is of earlier attempts
    reporter = Reporter(client, run_id, spec.run_dir, home, attempt=args.attempt)
    reporter.requeue = requeue
    reporter.start()
    try:
        from worker.launchers.local import launch_eval, launch_rl, launch_sft

        slurm_job.check_run_as(spec.launcher.slurm.nodes)  # a root worker's job: never run the run as root
        with run_user_files():  # a root worker's job: the launcher touches the run directory as the run's uid
            if isinstance(spec, SFTSpec):
                summary = launch_sft(spec, resume=resume, quiet=True)
            elif isinstance(spec, EvalSpec):
                summary = launch_eval(spec, quiet=True)
            else:
                summary = launch_rl(spec, resume=resume, quiet=True, act_on_stall=False)  # the service acts on stalls
            status, reason = summary["status"], str(summary.get("reason") or _last_reason(spec.run_dir))
    except SpecError as err:
        status, reason = "failed", f"preflight: {err}"
    except slurm_job.RunAsError as err:
        status, reason = "failed", str(err)
    except KeyboardInterrupt:
        status, reason = "cancelled", "terminated"
    except OSError as err:  # preparing the run directory: a full disk, an output folder it may not write
        status, reason = "failed", f"launch: {describe_os_error(err)}"
    except Exception as err:  # reported to the server as the failure reason
        status, reason = "failed", f"{type(err).__name__}: {err}"
    _since_sigterm(f"the launcher ended ({status})")
    if attempt is not None and _terminated.is_set():  # Slurm's SIGTERM: scancel, time limit or requeue
        status, reason = slurm_job.end_status(attempt)  # requeued: no status, the next attempt reports
        _since_sigterm(f"Slurm says {status}")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    status, reason = _end_processes(status, reason)
    logger.info("run %d ended %s %s", run_id, status, reason)
    reporter.finish(status, reason, deadline_s)
    if (unit := cgroups.of_process()) is not None:  # the run's last process: leave and remove its cgroup (as root)
        unit.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
