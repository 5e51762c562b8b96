"""Supervisor of one service-launched run: ``python -m worker.supervisor --home DIR``.

The Celery ``launch_run`` task starts it in its own session (process group) and records its pid. It

- holds an exclusive ``flock`` on ``<home>/supervisor.lock`` for its whole life, so at most one supervisor
  (and one set of run processes) exists per run, and a redelivered launch finds and adopts it;
- runs the run with the local launcher (``worker.launchers.local.launch_rl``), whose processes inherit its
  environment: ``ASYNCRL_RUN_ID``, ``ASYNCRL_RUN_TOKEN``, ``ASYNCRL_SERVER_URL`` and the worker's variables that
  :func:`worker.procs.run_environ` lets through (never the database or broker URL, the server's secret or
  another run's token);
- talks to the server over HTTP only, through :class:`worker.reporter.Reporter`: metrics, live config, status
  changes, and the final status, spooled in ``<home>/final.json`` before it is reported;
- turns SIGTERM (``asyncrl runs stop``) into a clean cancel: the launcher tears its processes down;
- inside a Slurm job, checkpoints and requeues before the time limit and resumes a requeued attempt
  (:mod:`worker.launchers.slurm_job`).

``--attempt N`` names the launch attempt (the id of the run event that last queued the run; the launch task passes
it): the spool records it, so a spool of an earlier attempt (before a resume) is never taken for this one's.

``<home>`` is ``<ASYNCRL_OUTPUT_DIR>/runs/<id>``; the run directory is ``<home>/<name>``; the files of the home
folder are named by :class:`worker.rundir.SupervisorHome`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import pwd
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from worker.launchers import slurm_job
from worker.procs import alive, run_environ
from worker.reporter import Reporter, report_timeout_s
from worker.rundir import SupervisorHome, describe_os_error, read_jsonl

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
    :func:`worker.procs.run_environ` lets through (``allow``: the worker's ``RUN_ENV_ALLOW``), plus the run id,
    the run token (never logged) and the server's URL."""
    ids = {"ASYNCRL_RUN_ID": str(run_id), "ASYNCRL_RUN_TOKEN": token, "ASYNCRL_SERVER_URL": server_url}
    return {**run_environ(os.environ, allow), **ids}


@dataclass(frozen=True)
class RunUser:
    """The unprivileged account a root worker runs a run's processes as (the worker's ``RUN_USER``)."""

    name: str
    uid: int
    gid: int
    home: str


def run_user(name: str) -> RunUser | None:
    """The account ``name`` (None for ``""``: the worker's own user).

    Raises:
        ValueError: no such account, it is root, or this process is not root (only root may switch users).
    """
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


def give_home(home: Path, user: RunUser) -> None:
    """Make the run's home folder (spec, logs, run directory, a fork's copied checkpoint) the run user's."""
    for path in (home, *home.rglob("*")):
        os.lchown(path, user.uid, user.gid)


def detach(argv: list[str], env: dict[str, str], log: Path, user: RunUser | None = None) -> int:
    """Start ``argv`` in its own session (process group) with exactly ``env``, output appended to ``log``, as
    ``user`` when given (its uid, gid and no supplementary groups; ``HOME``, ``USER``, ``LOGNAME`` its own); returns
    its pid (= its process group id). The way a supervisor is started.

    Raises:
        OSError: ``argv`` cannot be started (e.g. ``user`` may not run the interpreter).
    """
    if user is not None:
        env = {**env, "HOME": user.home, "USER": user.name, "LOGNAME": user.name}
    switch: dict[str, Any] = {} if user is None else {"user": user.uid, "group": user.gid, "extra_groups": []}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **switch,
        )
    threading.Thread(target=proc.wait, daemon=True).start()  # reap it if it ends while this process lives
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
) -> int:
    """Write the spec and start a detached supervisor (``resume``: continue the run directory from its newest
    complete checkpoint; ``attempt``: see the module docstring; ``allow_env``: see :func:`run_env`; ``user``: run
    it, and so the run's processes, as that account, which then owns ``home``) with the environment
    :func:`run_env`; returns its pid (= its process group id). A final status spooled by an earlier supervisor of
    ``home`` is removed first.

    Raises:
        OSError: the supervisor cannot be started (e.g. ``user`` may not run this Python).
    """
    files = SupervisorHome(home)
    files.write_spec(spec)
    files.final.unlink(missing_ok=True)
    if user is not None:
        files.log.touch()
        give_home(home, user)
    argv = [
        sys.executable,
        "-m",
        "worker.supervisor",
        "--home",
        str(home),
        *(["--resume"] if resume else []),
        *(["--attempt", str(attempt)] if attempt is not None else []),
    ]
    return detach(argv, run_env(run_id, token, server_url, allow_env), files.log, user)


def terminate(pid: int, grace_s: float = 30.0) -> None:
    """SIGTERM the supervisor's process group, wait up to ``grace_s`` for it to end, then SIGKILL it."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ----------------------------------------------------------------------------- main


def _last_reason(run_dir: Path) -> str:
    events = read_jsonl(run_dir / "events.jsonl")
    return str(events[-1].get("reason", "")) if events else ""


_terminated = threading.Event()


def _on_sigterm(_signum: int, _frame: Any) -> None:
    _terminated.set()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.supervisor")
    p.add_argument("--home", type=Path, required=True)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--attempt", type=int, default=None, help="launch attempt, recorded in the final-status spool")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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

    from worker.spec import RLSpec, SpecError, validate_spec

    run_id = int(os.environ["ASYNCRL_RUN_ID"])
    client = httpx.Client(
        base_url=os.environ["ASYNCRL_SERVER_URL"],
        timeout=30.0,
        headers={"Authorization": f"Bearer {os.environ['ASYNCRL_RUN_TOKEN']}"},
    )
    spec = validate_spec("rl", json.loads(home.spec.read_text()))
    assert isinstance(spec, RLSpec)
    resume, attempt = args.resume, slurm_job.attempt()
    requeue: dict[str, Any] | None = None
    if attempt is not None:
        slurm_job.on_time_limit(spec.run_dir, spec.launcher.slurm.signal_before_end_s)
    if attempt:
        requeue = slurm_job.start_requeued(attempt, spec.run_dir, home)
        resume = requeue["resume_step"] is not None
    # made after start_requeued: what events.jsonl holds now is of earlier attempts
    reporter = Reporter(client, run_id, spec.run_dir, home, attempt=args.attempt)
    reporter.requeue = requeue
    reporter.start()
    try:
        from worker.launchers.local import launch_rl

        summary = launch_rl(spec, resume=resume, quiet=True)
        status, reason = summary["status"], str(summary.get("reason") or _last_reason(spec.run_dir))
    except SpecError as err:
        status, reason = "failed", f"preflight: {err}"
    except KeyboardInterrupt:
        status, reason = "cancelled", "terminated"
    except OSError as err:  # preparing the run directory: a full disk, an output folder it may not write
        status, reason = "failed", f"launch: {describe_os_error(err)}"
    except Exception as err:  # reported to the server as the failure reason
        status, reason = "failed", f"{type(err).__name__}: {err}"
    if attempt is not None and _terminated.is_set():  # Slurm's SIGTERM: scancel, time limit or requeue
        status, reason = slurm_job.end_status(attempt)  # requeued: no status, the next attempt reports
    logger.info("run %d ended %s %s", run_id, status, reason)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    reporter.finish(status, reason, deadline_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
