"""What verifiers' agent harness needs on this machine: `uv` on PATH and the null harness's locked chat program.

Apart from `worker.orchestrator.harness` so that `worker.envs` can say whether a taskset with tools can run
(`Environment.unsupported`) without importing the harness runner. Why the lockfile: see `harness`'s docstring
("Offline").
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def harness_missing() -> str | None:
    """What the agent harness needs and this machine lacks (one line), or None.

    The null harness prepares its chat program with `uv` (a PEP 723 script); verifiers looks it up on PATH.
    """
    if find_uv() is None:
        return "the agent harness needs `uv` (pip install uv), which is not on PATH or next to this Python"
    return None


def find_uv() -> str | None:
    """Path of the `uv` executable on PATH or next to this Python, or None."""
    return shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))


def ensure_uv_on_path() -> None:
    """verifiers' subprocess runtime runs `uv` by name: put the one next to this Python on PATH if needed."""
    if shutil.which("uv") is None and (uv := find_uv()) is not None:
        os.environ["PATH"] = f"{Path(uv).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def lock_chat_program() -> Path:
    """Write verifiers' chat program (the null harness) to the path its subprocess runtime uses and lock its
    dependencies beside it (``<path>.lock``) unless a lockfile is there already; returns the program's path.
    A failed lock is logged (verifiers then resolves against the index itself) and not raised.

    Raises:
        RuntimeError: `uv` is not found (see `harness_missing`).
    """
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    lock = path.with_name(path.name + ".lock")
    if lock.is_file():
        return path
    if (uv := find_uv()) is None:
        raise RuntimeError(harness_missing())
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    result = subprocess.run(
        [uv, "lock", "--script", str(path), "-q", "--no-config"], capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        logger.warning("uv lock --script %s failed (harness setup will ask the index): %s", path, result.stderr[-500:])
    return path
