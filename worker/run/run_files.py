"""Reading a run's files safely: the one way the service (API, dashboard, Celery tasks) opens, lists or copies a file
of a run's home folder (``<ASYNCRL_OUTPUT_DIR>/runs/<id>/``, the run directory inside it).

A run's processes own their run directory, so anything in it may have been replaced by them: a symbolic link to
the server's secret key, a FIFO that blocks a reader, a folder where a file was. Every path is therefore walked one
component at a time from the home folder with ``O_NOFOLLOW`` (a symbolic link anywhere below the home is refused,
parents included, and no ``..`` is accepted, so the result stays inside it), and only regular files are read. The
home folder itself is made by the service in a folder the run cannot write, so it is trusted (it may be reached
through links an administrator made, e.g. ``ASYNCRL_OUTPUT_DIR`` on another disk).

Errors name the path relative to the home folder, never an absolute server path.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO must not hang the reader


class RunFileError(OSError):
    """A file of a run cannot be read; ``str()`` is one line naming the path relative to the run's home."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class RunFileMissing(RunFileError, FileNotFoundError):
    """The file (or a folder on its way) does not exist (yet)."""


class RunFileRefused(RunFileError, PermissionError):
    """The path is not a plain file of the run: a symbolic link (the file or a folder on its way), not a regular
    file, or a path leaving the home folder."""


def _parts(rel: str | PurePosixPath) -> list[str]:
    path = PurePosixPath(rel)
    parts = list(path.parts)
    if path.is_absolute() or not parts or any(p in (".", "..") for p in parts):
        raise RunFileRefused(f"{rel}: not a path inside the run's folder")
    return parts


def _refusal(err: OSError, shown: str, *, what: str) -> RunFileError:
    if err.errno == errno.ENOENT:
        return RunFileMissing(f"{shown}: no such {what}")
    if err.errno == errno.ELOOP:
        return RunFileRefused(f"{shown}: is a symbolic link; run files are read only as regular files")
    if err.errno == errno.ENOTDIR:
        return RunFileRefused(f"{shown}: is not a folder")
    return RunFileRefused(f"{shown}: cannot be read ({os.strerror(err.errno or 0)})")


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


@contextmanager
def _folder_fd(home: Path, parts: list[str]) -> Iterator[int]:
    """An fd of the folder ``home/parts...``, every component opened with ``O_NOFOLLOW``."""
    try:
        fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise _refusal(err, "the run's folder", what="folder") from None
    try:
        for i, name in enumerate(parts):
            try:
                child = os.open(name, _DIR, dir_fd=fd)
            except OSError as err:
                if err.errno == errno.ENOTDIR and _is_link(name, fd):  # O_DIRECTORY is checked before O_NOFOLLOW
                    err = OSError(errno.ELOOP, "")
                raise _refusal(err, "/".join(parts[: i + 1]), what="folder") from None
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def open_run_file(home: str | Path, rel: str | PurePosixPath) -> BinaryIO:
    """Open ``home/rel`` for binary reading, where ``home`` is the run's home folder and ``rel`` a relative path
    (e.g. ``"<name>/logs/trainer.log"``).

    Raises:
        RunFileMissing: the file or a folder on its way does not exist.
        RunFileRefused: ``rel`` is absolute or has ``.``/``..``, or the file or a folder on its way is a symbolic
            link, or the file is not a regular file (a folder, FIFO, socket, device).
    """
    parts = _parts(rel)
    with _folder_fd(Path(home), parts[:-1]) as parent:
        try:
            fd = os.open(parts[-1], _FILE, dir_fd=parent)
        except OSError as err:
            raise _refusal(err, str(rel), what="file") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RunFileRefused(f"{rel}: is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_run_text(home: str | Path, rel: str | PurePosixPath, *, max_bytes: int = 64 << 20) -> str:
    """The text of ``home/rel`` (undecodable bytes replaced; at most ``max_bytes`` bytes read).

    Raises:
        RunFileMissing, RunFileRefused: as :func:`open_run_file`.
    """
    with open_run_file(home, rel) as f:
        return f.read(max_bytes).decode(errors="replace")


def list_run_folder(home: str | Path, rel: str | PurePosixPath) -> dict[str, bool]:
    """``{name: is_folder}`` of the real files and folders in ``home/rel`` (symbolic links, FIFOs and other
    special entries are left out). A missing folder: ``{}``.

    Raises:
        RunFileRefused: ``rel`` or a folder on its way is a symbolic link or not a folder.
    """
    try:
        with _folder_fd(Path(home), _parts(rel)) as fd, os.scandir(fd) as it:
            return {
                e.name: e.is_dir(follow_symlinks=False)
                for e in it
                if e.is_dir(follow_symlinks=False) or e.is_file(follow_symlinks=False)
            }
    except RunFileMissing:
        return {}


def is_run_file(home: str | Path, rel: str | PurePosixPath) -> bool:
    """Whether ``home/rel`` is a regular file reached without any symbolic link."""
    try:
        open_run_file(home, rel).close()
    except RunFileError:
        return False
    return True


def _link(name: str, dir_fd: int, dst: Path, opened: os.stat_result) -> bool:
    """Hard-link ``name`` (in ``dir_fd``) to ``dst`` when it is still the regular file ``opened`` (a swap after the
    check leaves nothing linked); False when it cannot be linked (another filesystem, no permission)."""
    try:
        os.link(name, dst, src_dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    st = os.stat(dst, follow_symlinks=False)
    if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (opened.st_dev, opened.st_ino):
        return True
    dst.unlink()
    return False


def copy_run_folder(
    home: str | Path,
    rel: str | PurePosixPath,
    dst: Path,
    *,
    link: bool = True,
    keep: Callable[[PurePosixPath], bool] | None = None,
) -> None:
    """Copy the folder ``home/rel`` to ``dst`` (created; it must not exist), hard-linking each file when ``link``
    (and the filesystem allows), else copying its bytes. Only real folders and regular files are copied; with
    ``keep``, only the files whose path relative to ``home/rel`` it accepts (the folders are all made).

    Raises:
        RunFileMissing: the folder does not exist.
        RunFileRefused: the folder, a folder on its way or anything inside it is a symbolic link or a special file
            (nothing is copied through a link: the check is made on the opened file).
    """
    rel = PurePosixPath(rel)
    dst.mkdir(parents=True)
    with _folder_fd(Path(home), _parts(rel)) as top:
        for folder, names, files, dfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
            inside = PurePosixPath(rel, folder)
            target = dst / folder
            for name in names:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    raise RunFileRefused(
                        f"{inside / name}: is a symbolic link; run files are copied only as regular files"
                    )
                (target / name).mkdir()
            for name in files:
                if keep is not None and not keep(PurePosixPath(folder, name)):
                    continue
                try:
                    fd = os.open(name, _FILE, dir_fd=dfd)
                except OSError as err:
                    raise _refusal(err, str(inside / name), what="file") from None
                with os.fdopen(fd, "rb") as src:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise RunFileRefused(f"{inside / name}: is not a regular file")
                    if link and _link(name, dfd, target / name, os.fstat(fd)):
                        continue
                    os.set_blocking(fd, True)
                    with open(target / name, "wb") as out:
                        shutil.copyfileobj(src, out)
