"""Per-run cgroups: every process of a service-launched run in one cgroup, killed and removed when the run ends.

A root worker whose machine has writable cgroup hierarchies gives each run a cgroup ``<parent>/run-<id>-<tag>``
(``<tag>``: 8 hex digits of the SHA-256 of the run's home folder, so two services on one machine never share a
name; ``<parent>`` is ``asyncrl``). The worker creates it before it starts the run's supervisor, and the supervisor
joins it between fork and exec (:meth:`RunCgroup.join`), so every process of the run — vLLM's EngineCore, torchrun's
ranks, anything that calls ``setsid`` — is in it and cannot leave it (the run's user may not write any other
cgroup's ``cgroup.procs``). An optional memory limit (``launcher.memory_limit_gib``) caps the run as a whole; when
the kernel's OOM killer ends one of its processes the cgroup's ``oom_kill`` counter rises (:meth:`RunCgroup.oom_kills`)
and the run's failure reason says so (:func:`oom_reason`).

Two layouts are supported (:func:`layout`):

- cgroup v1 (and hybrid machines): one directory per hierarchy among ``memory``, ``pids`` and ``freezer``
  mounted at ``/sys/fs/cgroup/<name>``; ``memory.limit_in_bytes``, the ``oom_kill`` line of
  ``memory.oom_control``; killing freezes the group first (``freezer.state``) so nothing forks meanwhile;
- cgroup v2 (``/sys/fs/cgroup`` itself is ``cgroup2``): one directory; ``memory.max``, the ``oom_kill`` line of
  ``memory.events``; killing writes ``cgroup.kill`` (Linux 5.14+), else signals members until none is left.

Where neither is writable (not root, a read-only ``/sys/fs/cgroup``) :class:`Unavailable` says why, and the run's
unit is the supervisor's session: it is started with ``start_new_session``, so the session id of every process of
the run is the supervisor's pid (its children lead their own process groups inside that session, see
:mod:`worker.run.procs`); a process that calls ``setsid`` itself escapes that unit, which is why cgroups come first.

:func:`end_run` is the one way a run's processes are ended (the supervisor's exit, a stop, reconcile of a vanished
supervisor, reconcile of an ended run's leftovers); :func:`leftovers` finds them, with a guard against pid reuse:
a process that started after the run ended (or after the given time) is never taken for one of its processes.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from worker.run.procs import alive, session_members, started_at

MOUNT = Path("/sys/fs/cgroup")
"""Where the cgroup hierarchies are mounted (v1: one folder per hierarchy; v2: the unified hierarchy itself)."""
PARENT = "asyncrl"
"""Folder, in every hierarchy, that holds the runs' cgroups."""
V1_HIERARCHIES = ("memory", "pids", "freezer")
"""The v1 hierarchies a run's cgroup is made in (those mounted); ``memory`` or ``pids`` must be among them."""
_NAME = re.compile(r"^run-(\d+)-([0-9a-f]{8})$")
GIB = 2**30
START_SLACK_S = 0.05
"""Error of a process start time (:func:`worker.run.procs.started_at`: ``/proc/uptime`` and start ticks are in 1/100 s):
a process counts as started before a time when its estimate is at most this much later."""


class Unavailable(RuntimeError):
    """This machine has no cgroup hierarchy this process may write; the message says why (one line)."""


@dataclass(frozen=True)
class Layout:
    """The writable cgroup hierarchies of this machine."""

    version: int
    """1 or 2."""
    roots: tuple[Path, ...]
    """v1: the mounted hierarchies of :data:`V1_HIERARCHIES` (``/sys/fs/cgroup/memory`` ...); v2: the mount."""


def _sigkill(pids: Iterable[int]) -> set[int]:
    """SIGKILL each of ``pids``; the ones that still existed."""
    sent = set()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            sent.add(pid)
        except ProcessLookupError:
            pass
    return sent


def layout(mount: Path = MOUNT, *, writable: bool = True) -> Layout:
    """The hierarchies a run's cgroup is made in (``writable`` False: those a run's own processes read theirs from,
    whoever they run as).

    Raises:
        Unavailable: no v1 ``memory``/``pids`` hierarchy and no v2 mount under ``mount``, or not writable by this
            process (e.g. ``cgroups: /sys/fs/cgroup/memory is not writable by uid 1000``).
    """
    v1 = tuple(mount / name for name in V1_HIERARCHIES if (mount / name / "cgroup.procs").is_file())
    if any(root.name in ("memory", "pids") for root in v1):
        found = Layout(1, v1)
    elif (mount / "cgroup.controllers").is_file():
        found = Layout(2, (mount,))
    else:
        raise Unavailable(f"cgroups: no cgroup v1 memory or pids hierarchy and no cgroup v2 mount at {mount}")
    for root in found.roots if writable else ():
        parent = root / PARENT
        if not os.access(parent if parent.is_dir() else root, os.W_OK):
            raise Unavailable(f"cgroups: {parent if parent.is_dir() else root} is not writable by uid {os.geteuid()}")
    return found


def name_of(run_id: int, home: Path) -> str:
    """The cgroup name of run ``run_id`` whose home folder is ``home``: ``asyncrl/run-<id>-<tag>``."""
    tag = hashlib.sha256(str(Path(home).resolve()).encode()).hexdigest()[:8]
    return f"{PARENT}/run-{run_id}-{tag}"


def _read_int(path: Path, key: str | None = None) -> int | None:
    """The number in ``path`` (``max`` -> None), or in its line ``key N``; None when absent."""
    try:
        text = path.read_text()
    except OSError:
        return None
    if key is None:
        value = text.strip()
        return None if value == "max" else int(value)
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return None


@dataclass(frozen=True)
class RunCgroup:
    """The cgroup of one run, in every hierarchy of a :class:`Layout` (it may not exist yet, or any more)."""

    name: str
    """Relative to each hierarchy's root, e.g. ``asyncrl/run-12-1a2b3c4d``."""
    layout: Layout

    @property
    def dirs(self) -> tuple[Path, ...]:
        """Its folder in each hierarchy."""
        return tuple(root / self.name for root in self.layout.roots)

    @property
    def _memory(self) -> Path | None:
        if self.layout.version == 2:
            return self.dirs[0]
        return next((d for d, r in zip(self.dirs, self.layout.roots, strict=True) if r.name == "memory"), None)

    def exists(self) -> bool:
        return any(d.is_dir() for d in self.dirs)

    def create(self, memory_limit_bytes: int | None = None) -> None:
        """Make its folders (existing ones are kept) and set the memory limit (None: no limit).

        Raises:
            Unavailable: a folder cannot be made, or a limit is asked for and this machine cannot set one (no
                memory controller here, or it cannot be enabled for the runs' parent).
            OSError: writing the limit failed (e.g. below what its processes already use).
        """
        for root, folder in zip(self.layout.roots, self.dirs, strict=True):
            try:
                if self.layout.version == 2:
                    _enable_v2_controllers(root, folder)
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise Unavailable(f"cgroups: cannot create {folder}: {err.strerror or err}") from None
        if memory_limit_bytes is None:
            return
        memory = self._memory
        if memory is None or not (memory / _limit_file(self.layout.version)).exists():
            raise Unavailable(f"cgroups: no memory controller for {self.name}: a memory limit cannot be set")
        (memory / _limit_file(self.layout.version)).write_text(str(memory_limit_bytes))
        # a hard limit: no swap beyond it where swap is accounted
        if self.layout.version == 1 and (memory / "memory.memsw.limit_in_bytes").exists():
            (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_limit_bytes))
        if self.layout.version == 2 and (memory / "memory.swap.max").exists():
            (memory / "memory.swap.max").write_text("0")

    def join(self, pid: int = 0) -> None:
        """Move process ``pid`` (0: the calling process) into it, in every hierarchy.

        Raises:
            OSError: the folder is gone, or this process may not move ``pid``.
        """
        for folder in self.dirs:
            (folder / "cgroup.procs").write_text(str(pid))

    def pids(self) -> set[int]:
        """Processes in it now (the union over its hierarchies; empty when it does not exist)."""
        found: set[int] = set()
        for folder in self.dirs:
            try:
                found.update(int(x) for x in (folder / "cgroup.procs").read_text().split())
            except OSError:
                continue
        return found

    def memory_limit(self) -> int | None:
        """Its memory limit in bytes, None without one (or without a memory controller)."""
        memory = self._memory
        if memory is None:
            return None
        value = _read_int(memory / _limit_file(self.layout.version))
        return None if value is None or value >= 2**62 else value

    def oom_kills(self) -> int:
        """Processes of it the kernel's OOM killer has killed since it was made (0 without a memory controller)."""
        memory = self._memory
        if memory is None:
            return 0
        if self.layout.version == 2:
            return _read_int(memory / "memory.events", "oom_kill") or 0
        return _read_int(memory / "memory.oom_control", "oom_kill") or 0

    def kill(
        self, *, exclude: Collection[int] = (), started_before: float | None = None, timeout_s: float = 10.0
    ) -> set[int]:
        """SIGKILL every process in it but ``exclude`` and those that started after ``started_before`` (seconds
        since the epoch; None: all) until none is left or ``timeout_s`` has passed (v1: frozen first, so none forks
        meanwhile; v2: ``cgroup.kill``; both only when none is spared); returns the pids it signalled."""
        killed: set[int] = set()
        spare = bool(exclude) or started_before is not None
        freezer = next((d for d, r in zip(self.dirs, self.layout.roots, strict=True) if r.name == "freezer"), None)
        if self.layout.version == 2 and not spare and (self.dirs[0] / "cgroup.kill").exists():
            killed |= {p for p in self.pids() if alive(p)}  # a zombie (an unreaped supervisor) is killed already
            try:
                (self.dirs[0] / "cgroup.kill").write_text("1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        while True:
            targets = {
                p
                for p in self.pids()
                if p not in exclude
                and alive(p)
                and (
                    started_before is None or ((t := started_at(p)) is not None and t <= started_before + START_SLACK_S)
                )
            }
            if not targets or time.monotonic() > deadline:
                return killed
            frozen = freezer is not None and not spare and _set_freezer(freezer, "FROZEN")
            killed |= _sigkill(targets)
            if frozen and freezer is not None:
                _set_freezer(freezer, "THAWED")
            time.sleep(0.02)

    def leave(self) -> bool:
        """Move the calling process (the supervisor, last of its run) to the runs' parent cgroup and remove this one
        when nothing else is in it; returns whether it was removed. Needs root (a run user may not write the parent):
        otherwise the worker removes it (:func:`end_run`)."""
        try:
            for root in self.layout.roots:
                (root / PARENT / "cgroup.procs").write_text("0")
        except OSError:
            return False
        return not self.pids() and self.remove(timeout_s=1.0)

    def remove(self, timeout_s: float = 5.0) -> bool:
        """Remove its folders (a folder with processes cannot be removed: kill them first); returns whether none is
        left. The runs' parent folder is kept."""
        deadline = time.monotonic() + timeout_s
        for folder in self.dirs:
            while folder.is_dir():
                try:
                    folder.rmdir()
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while its last processes exit
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.05)
        return True


def _limit_file(version: int) -> str:
    return "memory.max" if version == 2 else "memory.limit_in_bytes"


def _set_freezer(folder: Path, state: str, timeout_s: float = 2.0) -> bool:
    """Set a v1 freezer's state and wait until it is reached; returns whether it was."""
    try:
        (folder / "freezer.state").write_text(state)
    except OSError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (folder / "freezer.state").read_text().strip() == state:
                return True
        except OSError:
            return False
        time.sleep(0.01)
    return False


def _enable_v2_controllers(root: Path, folder: Path) -> None:
    """Enable the memory and pids controllers on the way from ``root`` down to ``folder``'s parent, where the
    hierarchy offers them (a refusal, e.g. a parent with processes of its own, leaves the run without a limit)."""
    parent = folder.parent
    chain = [parent, *parent.parents]
    for node in reversed([p for p in chain if p == root or root in p.parents]):
        node.mkdir(exist_ok=True)
        offered = (node / "cgroup.controllers").read_text().split()
        enabled = (node / "cgroup.subtree_control").read_text().split()
        for controller in ("memory", "pids"):
            if controller in offered and controller not in enabled:
                try:
                    (node / "cgroup.subtree_control").write_text(f"+{controller}")
                except OSError:
                    pass


def for_run(run_id: int, home: Path, mount: Path = MOUNT) -> RunCgroup:
    """Run ``run_id``'s cgroup on this machine (it may not exist).

    Raises:
        Unavailable: see :func:`layout`.
    """
    return RunCgroup(name_of(run_id, home), layout(mount))


def of_process(pid: int | str = "self", mount: Path = MOUNT) -> RunCgroup | None:
    """The run cgroup process ``pid`` is in (read from ``/proc/<pid>/cgroup``), None when it is in none (or the
    process is gone, or this machine has no usable hierarchy)."""
    try:
        found = layout(mount, writable=False)
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except (Unavailable, OSError):
        return None
    wanted = {root.name for root in found.roots} if found.version == 1 else {""}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (set(controllers.split(",")) & wanted or controllers in wanted) and (
            path.startswith(f"/{PARENT}/") and _NAME.match(path.rsplit("/", 1)[1])
        ):
            return RunCgroup(path.lstrip("/"), found)
    return None


def leftovers(cgroup: RunCgroup | None, session: int | None, *, started_before: float | None) -> set[int]:
    """Processes of a run: those in ``cgroup`` and those in the session ``session`` (its supervisor's pid), leaving
    out any that started after ``started_before`` (seconds since the epoch; None: no guard) — a reused pid is not
    a process of the run."""
    found = set(cgroup.pids()) if cgroup is not None else set()
    if session is not None:
        found |= session_members(session)
    if started_before is None:
        return {p for p in found if alive(p)}
    return {p for p in found if (t := started_at(p)) is not None and t <= started_before + START_SLACK_S and alive(p)}


def end_run(
    cgroup: RunCgroup | None,
    session: int | None,
    *,
    started_before: float | None,
    exclude: Collection[int] = (),
    guard_cgroup: bool = False,
    remove: bool = True,
    timeout_s: float = 10.0,
) -> set[int]:
    """SIGKILL every process of a run (:func:`leftovers`) but ``exclude`` and, with ``remove``, remove its cgroup
    once it is empty; returns the pids signalled. The time guard ``started_before`` applies to session members, and
    with ``guard_cgroup`` to members of ``cgroup`` too: a caller that does not hold the run's row lock (the
    supervisor's reaper, ``stop``) must spare the supervisor of a new attempt that a resume may have started in the
    same cgroup meanwhile."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        if cgroup is not None:
            killed |= cgroup.kill(
                exclude=exclude,
                started_before=started_before if guard_cgroup else None,
                timeout_s=max(0.0, deadline - time.monotonic()),
            )
        rest = leftovers(None, session, started_before=started_before) - set(exclude)
        killed |= _sigkill(rest)
        if not rest or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    # spared (a newer attempt's) processes keep the cgroup; killed ones still exiting do not (remove waits for them)
    if remove and cgroup is not None and not exclude and not {p for p in cgroup.pids() if alive(p)} - killed:
        cgroup.remove()
    return killed


_SIGKILLED = re.compile(r"(?:^|: )([A-Za-z][\w ]*?) exited with code -9\b")


def oom_reason(cgroup: RunCgroup | None, reason: str, *, before: int = 0) -> str:
    """``reason`` with what the OOM killer did first when ``cgroup``'s ``oom_kill`` counter is above ``before``:
    ``out of memory: the kernel killed trainer (limit 3 GiB); trainer exited with code -9 (log: ...)`` (the process
    named when ``reason`` says it exited with code -9, i.e. by SIGKILL, else ``a process of the run``); ``reason``
    unchanged otherwise."""
    if cgroup is None or cgroup.oom_kills() <= before:
        return reason
    limit = cgroup.memory_limit()
    what = f"limit {limit / GIB:g} GiB" if limit is not None else "no limit of the run's own"
    found = _SIGKILLED.search(reason)
    victim = found.group(1) if found else "a process of the run"
    return f"out of memory: the kernel killed {victim} ({what})" + (f"; {reason}" if reason else "")


def prepare(
    run_id: int, home: Path, memory_limit_gib: float | None, *, enabled: bool = True, mount: Path = MOUNT
) -> tuple[RunCgroup | None, str]:
    """Make run ``run_id``'s cgroup for a new supervisor (processes left in it by an earlier attempt are killed and
    the folder made anew, so its ``oom_kill`` counter starts at 0) with the memory limit; returns it, or None when
    the supervisor's session is the unit (``enabled`` False: the worker's ``RUN_CGROUPS`` setting; or
    :class:`Unavailable`), and one line saying which, for the run's events and the worker's log, e.g.
    ``cgroup asyncrl/run-3-1a2b3c4d (memory limit 3 GiB)`` or ``session of the supervisor (cgroups: ... not
    writable by uid 1000); launcher.memory_limit_gib 3 is not enforced``."""
    limit = None if memory_limit_gib is None else int(memory_limit_gib * GIB)
    unenforced = f"; launcher.memory_limit_gib {memory_limit_gib:g} is not enforced" if limit is not None else ""
    if not enabled:
        return None, f"session of the supervisor (RUN_CGROUPS is off){unenforced}"
    try:
        cgroup = for_run(run_id, home, mount)
    except Unavailable as err:
        return None, f"session of the supervisor ({err}){unenforced}"
    if cgroup.exists():
        end_run(cgroup, None, started_before=None)
    try:
        try:
            cgroup.create(limit)
        except Unavailable as err:
            if limit is None:
                raise
            cgroup.create(None)  # tracked and killed as one, without the limit
            return cgroup, f"cgroup {cgroup.name} ({err}){unenforced}"
    except (Unavailable, OSError) as err:
        cgroup.remove()
        why = str(err) if isinstance(err, Unavailable) else f"cgroups: {err}"
        return None, f"session of the supervisor ({why}){unenforced}"
    return cgroup, f"cgroup {cgroup.name} (" + (
        f"memory limit {memory_limit_gib:g} GiB)" if limit else "no memory limit)"
    )
