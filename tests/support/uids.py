"""What a run's own uid can reach, seen from outside: the uid of a process, and a probe that a test runs as that uid."""

from __future__ import annotations

import subprocess
from pathlib import Path

PROBE = """
import os, sys
for path in sys.argv[1:]:
    try:
        os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(1)
        print("read", path)
    except PermissionError:
        print("denied", path)
"""
"""``python -c PROBE PATH...``: prints ``read PATH`` or ``denied PATH`` for each path (a folder is listed)."""


def uid_of(pid: int) -> int | None:
    """The real uid of process ``pid``; None once it has ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


SH_PROBE = """
for p in "$@"; do
  if [ -d "$p" ]; then err=$(ls "$p" 2>&1 >/dev/null); else err=$(cat "$p" 2>&1 >/dev/null); fi
  case "$?:$err" in 0:*) echo read ;; *"Permission denied"*) echo denied ;; *) echo "error $err" ;; esac
done
"""
"""``sh -c SH_PROBE sh PATH...``: ``read`` (a folder is listed), ``denied`` or ``error ...`` for each path (a shell and
coreutils, which any uid may run: the venv's Python is not for a uid of the group of the folders above it)."""


def output_as(argv: list[str], uid: int, gid: int) -> list[str]:
    """The lines ``argv`` prints run on this machine as ``uid`` with ``gid`` and no supplementary groups, from ``/``."""
    out = subprocess.run(
        argv, user=uid, group=gid, extra_groups=[], capture_output=True, text=True, check=True, cwd="/"
    )
    return out.stdout.splitlines()


def probe_as(paths: list[Path], uid: int, gid: int) -> list[str]:
    """What ``uid`` with ``gid`` and no supplementary groups gets for each path on this machine (:data:`SH_PROBE`)."""
    return output_as(["/bin/sh", "-c", SH_PROBE, "sh", *map(str, paths)], uid, gid)
