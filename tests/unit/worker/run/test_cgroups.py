"""Per-run cgroups and the leftover finder (``worker/run/cgroups.py``) with real processes in real cgroups: the tests
run as root on a machine with writable cgroup hierarchies (v1 here, with a v2 hierarchy mounted too)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import wait_for
from worker.run import cgroups
from worker.run.procs import alive, session_members

THREE = "sleep 300 & setsid sleep 300 & sleep 300 & wait"
"""A shell with three children: two in its session, one that leaves it (``setsid``) but not its cgroup."""


def v2_mount() -> Path:
    """The cgroup v2 hierarchy of this machine: ``/sys/fs/cgroup`` itself, or ``/sys/fs/cgroup/unified`` (hybrid)."""
    return cgroups.MOUNT if (cgroups.MOUNT / "cgroup.controllers").is_file() else cgroups.MOUNT / "unified"


@pytest.fixture
def made() -> Iterator[list[cgroups.RunCgroup]]:
    """Cgroups a test made: whatever is left in them is killed and they are removed at the end."""
    found: list[cgroups.RunCgroup] = []
    yield found
    for cg in found:
        cgroups.end_run(cg, None, started_before=None)
        assert not cg.exists()


def new_run_id() -> int:
    return 10**9 + secrets.randbelow(10**9)


def start_in(cg: cgroups.RunCgroup | None, script: str) -> subprocess.Popen[bytes]:
    """``bash -c script`` as a session leader (as the supervisor is), joined to ``cg`` before exec."""
    return subprocess.Popen(
        ["bash", "-c", script], start_new_session=True, preexec_fn=cg.join if cg is not None else None
    )


def children(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return {int(p) for p in out.split()}


def test_a_run_cgroup_holds_every_process_and_ending_it_leaves_none(tmp_path: Path, made: list) -> None:
    run_id = new_run_id()
    cg, line = cgroups.prepare(run_id, tmp_path, None)
    assert cg is not None
    made.append(cg)
    assert cg.name == cgroups.name_of(run_id, tmp_path) and cg.name.startswith(f"asyncrl/run-{run_id}-")
    assert line == f"cgroup {cg.name} (no memory limit)"
    assert all(d.is_dir() for d in cg.dirs)
    shell = start_in(cg, THREE)
    pids = wait_for(lambda: len(p := cg.pids()) == 4 and p, 10, "the shell and its 3 sleeps in the cgroup")
    assert shell.pid in pids
    # the setsid one leaves the session (not the cgroup) once its setsid ran: until then it is a fourth member
    wait_for(lambda: len(session_members(shell.pid)) == 3, 10, "the setsid sleep out of the session")
    assert cgroups.of_process(shell.pid) == cg
    assert cgroups.of_process(os.getpid()) is None

    t0 = time.monotonic()
    killed = cgroups.end_run(cg, shell.pid, started_before=time.time())
    took = time.monotonic() - t0
    shell.wait()
    assert killed == pids
    assert not any(alive(p) for p in pids)
    assert not cg.exists()
    assert took < 2.0, took


def test_memory_limit_and_the_oom_kill_are_named(tmp_path: Path, made: list) -> None:
    cg, line = cgroups.prepare(new_run_id(), tmp_path, 0.25)
    assert cg is not None
    made.append(cg)
    assert line == f"cgroup {cg.name} (memory limit 0.25 GiB)"
    assert cg.memory_limit() == 2**28
    assert cg.oom_kills() == 0
    assert cgroups.oom_reason(cg, "trainer exited with code 1") == "trainer exited with code 1"  # no OOM: unchanged

    hog = subprocess.Popen(
        [sys.executable, "-c", "x = bytearray(512 * 2**20); import time; time.sleep(30)"], preexec_fn=cg.join
    )
    assert hog.wait(timeout=60) == -signal.SIGKILL
    assert cg.oom_kills() == 1
    assert cgroups.oom_reason(cg, "trainer exited with code -9 (log: t.log)") == (
        "out of memory: the kernel killed trainer (limit 0.25 GiB); trainer exited with code -9 (log: t.log)"
    )
    assert cgroups.oom_reason(cg, "RuntimeError: vLLM server exited with code -9 before it was ready") == (
        "out of memory: the kernel killed vLLM server (limit 0.25 GiB); "
        "RuntimeError: vLLM server exited with code -9 before it was ready"
    )
    assert cgroups.oom_reason(cg, "orchestrator exited with code 1") == (
        "out of memory: the kernel killed a process of the run (limit 0.25 GiB); orchestrator exited with code 1"
    )

    again, _ = cgroups.prepare(int(cg.name.split("-")[1]), tmp_path, 0.5)  # a new attempt: a fresh cgroup
    assert again == cg and cg.oom_kills() == 0 and cg.memory_limit() == 2**29


def test_a_cgroup_v2_hierarchy_tracks_and_kills_with_cgroup_kill(tmp_path: Path, made: list) -> None:
    mount = v2_mount()
    layout = cgroups.layout(mount)
    assert layout == cgroups.Layout(2, (mount,))
    cg = cgroups.for_run(new_run_id(), tmp_path, mount)
    cg.create()
    made.append(cg)
    shell = start_in(cg, THREE)
    pids = wait_for(lambda: len(p := cg.pids()) == 4 and p, 10, "4 processes in the v2 cgroup")
    assert cgroups.of_process(shell.pid, mount) == cg
    assert cgroups.end_run(cg, None, started_before=None) == pids
    shell.wait()
    assert not any(alive(p) for p in pids) and not cg.exists()


def test_without_cgroups_the_session_is_the_unit(tmp_path: Path) -> None:
    off = cgroups.prepare(1, tmp_path, 2, enabled=False)
    assert off == (None, "session of the supervisor (RUN_CGROUPS is off); launcher.memory_limit_gib 2 is not enforced")
    fake = tmp_path / "no-cgroups"
    fake.mkdir()
    assert cgroups.prepare(1, tmp_path, None, mount=fake) == (
        None,
        f"session of the supervisor (cgroups: no cgroup v1 memory or pids hierarchy and no cgroup v2 mount at {fake})",
    )

    shell = start_in(None, THREE)

    def settled() -> tuple[set[int], set[int]] | None:
        """(session members, children out of the session) once all 3 children exist and the setsid one left."""
        kids, members = children(shell.pid), session_members(shell.pid)
        return (members, kids - members) if len(kids) == 3 and len(members) == 3 else None

    members, escaped = wait_for(settled, 10, "the shell and 2 sleeps in its session, the setsid sleep out of it")
    try:
        assert cgroups.end_run(None, shell.pid, started_before=time.time()) == members
        shell.wait()
        assert not session_members(shell.pid)
        assert all(alive(p) for p in escaped)  # a process that left the session is out of reach without a cgroup
    finally:
        for pid in escaped:
            os.kill(pid, signal.SIGKILL)


def test_the_leftover_finder_leaves_a_process_that_started_after_the_run_ended() -> None:
    """Pid reuse: the session id recorded for an ended run may now name a later session. Its processes started after
    the run ended, so they are not the run's."""
    ended = time.time()
    time.sleep(0.3)  # well beyond the start-time estimate's error (cgroups.START_SLACK_S)
    later = start_in(None, "sleep 300 & sleep 300 & wait")
    members = wait_for(lambda: len(m := session_members(later.pid)) == 3 and m, 10, "a later session of 3")
    try:
        assert cgroups.leftovers(None, later.pid, started_before=ended) == set()
        assert cgroups.end_run(None, later.pid, started_before=ended) == set()
        assert session_members(later.pid) == members  # untouched
        assert cgroups.leftovers(None, later.pid, started_before=time.time()) == members
    finally:
        os.killpg(later.pid, signal.SIGKILL)
        later.wait()


def test_a_run_process_that_dropped_root_still_finds_and_reads_its_cgroup(tmp_path: Path, made: list) -> None:
    """The supervisor runs as ``RUN_USER``: it reads its cgroup (members, OOM kills, limit) without write access."""
    import pwd

    cg, _ = cgroups.prepare(new_run_id(), tmp_path, 0.5)
    assert cg is not None
    made.append(cg)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            cg.join()
            os.setgid(pwd.getpwnam("nobody").pw_gid)
            os.setuid(pwd.getpwnam("nobody").pw_uid)
            found = cgroups.of_process()
            seen = (found == cg, os.getpid() in found.pids() if found else False, found and found.memory_limit())
            os.write(write_end, repr((os.geteuid(), *seen, found and found.oom_kills())).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        got = f.read()
    os.waitpid(child, 0)
    assert got == repr((pwd.getpwnam("nobody").pw_uid, True, True, 2**29, 0))


def test_the_last_process_of_a_run_leaves_and_removes_its_cgroup(tmp_path: Path) -> None:
    """The supervisor's last act (as root): with no other process in the cgroup it leaves it and removes it."""
    cg, _ = cgroups.prepare(new_run_id(), tmp_path, None)
    assert cg is not None
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            cg.join()
            inside = cgroups.of_process() == cg
            os.write(write_end, repr((inside, cg.leave(), cgroups.of_process())).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        got = f.read()
    os.waitpid(child, 0)
    assert got == repr((True, True, None))
    assert not cg.exists()
