"""Child processes of a run: start in their own process group, die with their parent, stop as a group."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
from pathlib import Path

PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (PR_SET_PDEATHSIG, Linux); exits at
    once if the parent (pid ``parent``, default the current one) is already gone."""
    parent = os.getppid() if parent is None else parent
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:
        os._exit(0)


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own process group with stdout+stderr appended to ``log_path``.

    The child gets SIGTERM when this process dies (PR_SET_PDEATHSIG), so a killed launcher or test
    runner leaves no orphan. ``env`` replaces the environment when given (else it is inherited).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        parent = os.getpid()

        def child_setup() -> None:  # runs in the child between fork and exec
            die_with_parent(parent)
            os.setpgrp()

        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=child_setup, cwd=os.getcwd()
        )


def kill_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``grace_s``; reaps the leader."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
