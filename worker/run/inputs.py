"""Files a run starts from that lie in another run's folder: copied into its own home by the worker before it starts.

A root worker runs each run as its own uid, and a run's home folder (``<ASYNCRL_OUTPUT_DIR>/runs/<id>``) is that uid's
and the server's group's only (``worker.launchers.supervisor.give_home``): another run's uid cannot enter it. A run
that starts from another run's files would therefore not read them where they are: a pipeline stage from the stage
before's ``final/`` weights, an RL run from an SFT run's final weights, a fork or an eval job whose base model is such
a folder (``model.name``), an SFT run whose ``data.path`` / ``data.eval_path`` is another run's file.

So before the run's processes start, the worker (the privileged side, in ``server.jobs.tasks.launch``) copies each
such path into ``<home>/inputs/<key>/<its name>`` the way the service reads a run's files (``worker.run.run_files``:
regular files and real folders only, never through a symbolic link), and starts the run with that path in its spec;
the stored spec keeps the path its user gave. A copy made for an earlier attempt is kept: a resumed run reads what its
first attempt read, even once the other run is deleted. The copy is made in a folder of the service's (beside the
homes, where no run may write) and then moved into the home through folder descriptors opened without following
links, so nothing the run's uid left in its home can turn the worker's writes elsewhere.

Which run may use which run's files is decided at submit (``server.services.runs.check_run_files_used``: its owner or
an admin) and again at launch; the caller also passes that rule as ``may_use``, asked here for the run a path leads to
at the moment it is copied (links resolved then, and the copy made from that resolved place), so a link swapped after
the launch's check cannot bring another user's files in.
"""

from __future__ import annotations

import copy
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from worker.run.run_files import RunFileError, copy_run_folder, is_run_file, open_run_file

COPIED_KEYS = ("model.name", "data.path", "data.eval_path")
"""Spec keys whose path, when inside another run's folder, is copied into the run's home (``data.*``: SFT runs)."""
INPUTS_DIR = "inputs"
"""The folder of a run's home holding what it reads of other runs: ``inputs/<key>/<name>``."""
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class InputCopyError(ValueError):
    """A path a run starts from cannot be copied into its home; ``str()`` is one line naming the spec key."""


def other_run_path(value: str, runs_root: Path, run_id: int) -> tuple[Path, PurePosixPath] | None:
    """``(that run's home, the path relative to it)`` when ``value`` (a path; relative ones are taken from this
    process's working folder, as the run's processes take them) lies, links resolved, inside a folder of
    ``runs_root`` (``<ASYNCRL_OUTPUT_DIR>/runs``) other than run ``run_id``'s own; None otherwise (a hub id, a model
    outside the run folders, the run's own files)."""
    if not value:
        return None
    root = os.path.realpath(runs_root)
    rel = os.path.relpath(os.path.realpath(os.path.join(os.getcwd(), value)), root)
    if rel == os.curdir or rel.startswith(os.pardir):
        return None
    parts = PurePosixPath(rel).parts
    if len(parts) < 2 or parts[0] == str(run_id):
        return None
    return Path(root, parts[0]), PurePosixPath(*parts[1:])


def copy_inputs(
    spec: dict[str, Any],
    home: Path,
    *,
    run_id: int,
    runs_root: Path,
    link: bool,
    may_use: Callable[[int], bool] = lambda _: True,
) -> dict[str, Any]:
    """The spec to start run ``run_id`` (home folder ``home``) with: ``spec`` with each of :data:`COPIED_KEYS` that
    names a path in another run's folder (:func:`other_run_path`) replaced by its copy ``<home>/inputs/<key>/<name>``
    (an absolute path), made now unless an earlier attempt made it. ``link``: hard-link the files of a copied folder
    where the filesystem allows (a worker that runs every run as itself; a run of its own uid gets copies: its home is
    given to it). ``may_use(other_run_id)``: whether this run's owner may use that run's files (default: any).

    Raises:
        InputCopyError: a path cannot be copied (missing, a symbolic link or special file in it, a link where
            ``inputs`` should be), or it leads into a run folder ``may_use`` refuses; one line naming the key.
    """
    out = copy.deepcopy(spec)
    for key in COPIED_KEYS:
        section, field = key.split(".")
        value = (spec.get(section) or {}).get(field)
        if not isinstance(value, str) or (found := other_run_path(value, runs_root, run_id)) is None:
            continue
        source, rel = found
        if not (source.name.isdigit() and may_use(int(source.name))):
            raise InputCopyError(
                f"{key}: {value} now leads into the folder of run {source.name}, which is not the owner's to use"
            )
        try:
            _copy_in(source, rel, home, key, staging_in=Path(os.path.realpath(runs_root)), link=link)
        except (RunFileError, OSError) as err:
            raise InputCopyError(
                f"{key}: {value} (run {source.name}'s {rel}) cannot be copied into the run's folder: {err}"
            ) from None
        out[section][field] = os.path.abspath(home / INPUTS_DIR / key / rel.name)
    return out


def _copy_in(source: Path, rel: PurePosixPath, home: Path, key: str, *, staging_in: Path, link: bool) -> None:
    """Copy ``source/rel`` (a run's file or folder) to ``home/inputs/<key>/<rel.name>`` unless it is there already."""
    home.mkdir(parents=True, exist_ok=True)  # a run submitted by path: its home is made at its first launch
    fd = _inputs_folder(home, key)
    try:
        try:
            st = os.stat(rel.name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            return  # an earlier attempt's copy
        if st is not None:  # a link or special file the run left there: not followed, replaced
            os.unlink(rel.name, dir_fd=fd)
        staging = Path(tempfile.mkdtemp(prefix=f".inputs-{home.name}-", dir=staging_in))
        try:
            made = staging / rel.name
            if is_run_file(source, rel):
                with open_run_file(source, rel) as src, open(made, "xb") as dst:
                    shutil.copyfileobj(src, dst)
            else:
                copy_run_folder(source, rel, made, link=link)
            os.rename(made, rel.name, dst_dir_fd=fd)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        os.close(fd)


def _inputs_folder(home: Path, key: str) -> int:
    """A descriptor of ``home/inputs/<key>``, made if missing, no component below ``home`` a symbolic link."""
    fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in (INPUTS_DIR, key):
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            child = os.open(name, _DIR, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd
