"""What a run's own uid can reach, seen from outside: the uid of a process, and a probe that a test runs as that uid."""

from __future__ import annotations

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
