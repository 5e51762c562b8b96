"""A small filesystem that really fills up: a tmpfs mounted for one test (root only: ``mount -t tmpfs``).

``mounted(path, size)`` mounts it (and unmounts it, lazily, at the end); ``fill(path)`` writes a filler file until
the kernel answers ``ENOSPC`` and returns it (delete it to give the space back).
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def mounted(path: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount`` syntax: ``1m``, ``64m``) at ``path`` for the ``with`` block."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(path: Path, leave: int = 0) -> Path:
    """Fill the filesystem holding folder ``path`` until fewer than ``leave`` bytes (rounded to pages) are free;
    returns the filler file. With ``leave=0`` the last write got ``ENOSPC``."""
    filler = path / ".filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            st = os.statvfs(path)
            free = st.f_bavail * st.f_frsize
            if leave and free <= leave:
                return filler
            chunk = min(1 << 20, free - leave) if leave else 1 << 20
            try:
                os.write(fd, b"\0" * max(chunk, 4096))
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
                return filler
    finally:
        os.close(fd)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
