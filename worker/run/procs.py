"""Child processes of a run: start in their own process group, die with their parent, stop as a group.

A child started by :func:`spawn` leads a new process group; whatever it starts (vLLM's API server starts its
EngineCore, and so on) stays in that group. When the parent dies — even by SIGKILL — the whole group is killed:

- a *watchdog* (a few lines of Python, one per group) sits in the group and blocks on a pipe whose only write end is
  held by the parent. When the parent is gone the kernel closes that end, the read returns end-of-file, and the
  watchdog sends SIGKILL to its group (itself included). It ignores SIGTERM, so :func:`kill_group`'s SIGTERM still
  gives the others their grace period; the SIGKILL that follows ends it too.
- the leader itself also gets SIGKILL from the kernel when its parent dies (``PR_SET_PDEATHSIG``), in case the
  watchdog is not there (not started yet, or killed).

SIGKILL, not SIGTERM: a vLLM API server that got SIGTERM once hung in its shutdown with its EngineCore defunct,
keeping the port; a run whose launcher is gone has nobody to report to, and checkpoints are written atomically.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunUser:
    """The unprivileged account a root worker runs a run's processes as (the worker's ``RUN_USER``, or the run's own
    uid under ``RUN_UID_BASE``)."""

    name: str
    uid: int
    gid: int
    home: str


PR_SET_PDEATHSIG = 1
WATCHDOG = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "fd = int(sys.argv[1])\n"
    "while os.read(fd, 1):\n"
    "    pass\n"
    "os.killpg(0, signal.SIGKILL)\n"
)
"""The watchdog's program: end-of-file on fd ``argv[1]`` (the parent is gone) -> SIGKILL to its process group."""
_watchdogs: dict[int, tuple[subprocess.Popen[bytes], int]] = {}
"""Leader pid -> (its watchdog, the write end of the watchdog's pipe held by this process)."""
_lock = threading.Lock()


RUN_ENV_NAMES = frozenset(
    {
        *("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "XDG_CACHE_HOME"),
        *("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV"),
        *("LD_LIBRARY_PATH", "LD_PRELOAD", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE"),
        *("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"),
        *(
            "OMP_NUM_THREADS",
            "MKL_NUM_THREADS",
            "OPENBLAS_NUM_THREADS",
            "NUMEXPR_NUM_THREADS",
            "TOKENIZERS_PARALLELISM",
        ),
        *("ASYNCRL_REPORT_TIMEOUT_S", "ASYNCRL_INFERENCE_API_KEY", "ASYNCRL_LAUNCHER", "CC", "CXX"),
    }
)
"""Variables a run's processes get from the worker's environment by name (see :func:`run_environ`)."""
RUN_ENV_PREFIXES = (
    *("LC_", "VLLM_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "KMP_", "MKL_", "OMP_"),
    *("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TRITON_", "UV_", "SLURM_", "CCL_", "ONEDNN_", "DNNL_", "XLA_"),
)
"""Variables with these prefixes pass too (threading, vLLM, torch, CUDA/NCCL, the Hugging Face cache, uv, Slurm),
unless their name looks like a credential (:data:`SECRET_MARKS`)."""
SECRET_MARKS = ("SECRET", "PASSWORD", "PASSWD", "TOKEN", "CREDENTIAL", "_KEY")
"""A prefix-matched name containing one of these (``HF_TOKEN``) does not pass unless listed by name."""
NEVER_PASSED = frozenset(
    {
        *("DATABASE_URL", "CELERY_BROKER_URL", "SECRET_KEY", "ASYNCRL_HOME"),
        *("ASYNCRL_RUN_ID", "ASYNCRL_RUN_TOKEN", "ASYNCRL_SERVER_URL"),
    }
)
"""The service's database and broker URLs, its secret (and ``ASYNCRL_HOME``, where its generated secret file lies)
and any run's identity: never passed, whatever is allowed; the launcher sets the run's own identity itself."""


WORKER_CACHE_VARS = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT"})
"""Cache folders of the worker's user (torch sets ``TORCHINDUCTOR_CACHE_DIR`` in the environment of a process that
compiled once, e.g. ``/tmp/torchinductor_root``) that a run started as another user does not inherit: it could not
write them (vLLM's engine failed with ``PermissionError`` on its first step), and a compile cache shared by runs would
let one run put code into another's. Its caches go under its ``HOME`` and ``/tmp/torchinductor_<its USER>``."""

RUN_AS_VAR = "ASYNCRL_RUN_AS"
"""Set (``<uid>:<gid>:<name>:<HOME>``) in a Slurm job that a root worker submitted (``deploy/slurm/rl.sbatch.j2``):
the job's supervisor runs as the job's user (root: it starts job steps and requeues the job), and every process of
the run it starts, here or on another node, drops to that uid and gid first (:func:`run_as_argv`)."""


def run_as(environ: Mapping[str, str] | None = None) -> tuple[int, int, str, str] | None:
    """``(uid, gid, name, HOME)`` of :data:`RUN_AS_VAR` in ``environ`` (default this process's), None when unset."""
    value = (os.environ if environ is None else environ).get(RUN_AS_VAR)
    if not value:
        return None
    uid, gid, name, home = value.split(":", 3)
    return int(uid), int(gid), name, home


def run_as_argv(environ: Mapping[str, str] | None = None) -> list[str]:
    """The argv prefix that runs a command as :data:`RUN_AS_VAR`'s uid and gid with no supplementary groups (util-linux
    ``setpriv``; the parent-death signal :func:`spawn` set is kept), with ``HOME``, ``USER`` and ``LOGNAME`` its own and
    neither :data:`RUN_AS_VAR` nor :data:`WORKER_CACHE_VARS` in its environment: the identity a root worker's local run
    has (``worker.launchers.supervisor.detach``). ``[]`` when the variable is unset (the command runs as this process's
    user)."""
    identity = run_as(environ)
    if identity is None:
        return []
    uid, gid, name, home = identity
    unset = [arg for var in (RUN_AS_VAR, *sorted(WORKER_CACHE_VARS)) for arg in ("-u", var)]
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--pdeathsig=keep",
        "--",
        "env",
        *unset,
        f"HOME={home}",
        f"USER={name}",
        f"LOGNAME={name}",
    ]


def give_tree(root: Path, uid: int, gid: int) -> None:
    """Make ``root`` and everything under it (links themselves, never what they point to) owned by ``uid``/``gid``.

    A file with other hard links (a fork's checkpoint, linked from its parent's by ``worker.run.run_files``, or one the
    run linked itself) is first replaced by a copy of its own: changing the owner of the shared inode would give the
    run's uid the other names' file to rewrite. A tree the run's uid already owns (a relaunch) may change while it is
    walked, so the walk goes through folder descriptors, nothing is opened through a symbolic link, and the copy is made
    under a name nobody can guess beside the file: nothing the run planted leads these (root) writes elsewhere."""
    if (os.lstat(root).st_uid, os.lstat(root).st_gid) != (uid, gid):
        os.lchown(root, uid, gid)
    for _, folders, files, dir_fd in os.fwalk(root, follow_symlinks=False):
        for name in folders + files:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            copied = stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and _own_copy(name, dir_fd, st)
            if copied or (st.st_uid, st.st_gid) != (uid, gid):
                os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)


def _own_copy(name: str, dir_fd: int, st: os.stat_result) -> bool:
    """Replace the hard-linked regular file ``name`` of the folder ``dir_fd`` (``st``: its ``lstat``) by a copy of its
    own (permission bits and times kept); False when it is no longer that file (replaced meanwhile: left as it is)."""
    try:
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    with os.fdopen(src, "rb") as source:
        opened = os.fstat(src)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            return False
        tmp = f".{name}.own-{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(tmp, flags, 0o600, dir_fd=dir_fd), "wb") as copy:
            os.set_blocking(src, True)
            shutil.copyfileobj(source, copy)
            os.fchmod(copy.fileno(), st.st_mode & 0o777)  # never set-user-id: the copy is root's until it is given
            os.utime(copy.fileno(), ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return True


RUN_FOLDER_MODE = 0o2750
"""Mode of a folder given to a run's uid (:func:`give_folder`): that uid reads and writes it, the folder's group (the
server's) reads it, and the set-group-id bit gives what the run makes there that group too; no other uid may enter."""


def give_folder(folder: Path, uid: int, group: int) -> None:
    """Make ``folder`` and everything under it owned by ``uid`` in the group ``group`` (:func:`give_tree`), the folder
    itself :data:`RUN_FOLDER_MODE`: a run's home folder (a local run of a root worker), or the run directory, ``HOME``
    and copied inputs of a Slurm run of a root worker, whose home stays the worker's."""
    give_tree(folder, uid, group)
    os.chmod(folder, RUN_FOLDER_MODE)


def give_to_run_user(root: Path) -> None:
    """Inside a Slurm job of a root worker (:data:`RUN_AS_VAR`; nothing otherwise), before anything of this attempt
    touches the run directory ``root``: make it if missing and, unless it is the run's already (an earlier attempt
    gave it), :func:`give_folder` it to the run's uid in the group of the home folder above it (the server's). From
    then on this root supervisor touches it only inside :func:`run_user_files`."""
    if (identity := run_as()) is None:
        return
    root.mkdir(exist_ok=True)
    if os.lstat(root).st_uid != identity[0]:  # only the worker could write in it so far: nothing of the run's is in it
        give_folder(root, identity[0], os.stat(root.parent).st_gid)


_SETGROUPS_SYSCALL = {"x86_64": 116, "aarch64": 159}
"""``setgroups`` by its number: the kernel's call changes the calling thread's groups only (glibc's wrapper changes
every thread's)."""


def _thread_groups(libc: ctypes.CDLL, groups: list[int]) -> None:
    number = _SETGROUPS_SYSCALL.get(os.uname().machine)
    if number is None:
        raise OSError(f"run_user_files: no setgroups system call number known for {os.uname().machine}")
    array = (ctypes.c_uint * max(len(groups), 1))(*groups)
    if libc.syscall(number, len(groups), array) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setgroups of this thread: {os.strerror(err)}")


@contextmanager
def run_user_files() -> Iterator[None]:
    """Inside a Slurm job of a root worker (:data:`RUN_AS_VAR`; nothing otherwise): while the block runs, the calling
    thread's file accesses are checked as the run's uid and gid, with no supplementary groups (Linux ``setfsuid``,
    ``setfsgid`` and ``setgroups`` of this thread; the threads it starts meanwhile inherit it). The root supervisor
    keeps its other powers (signals, and the programs it starts, ``srun`` and ``setpriv``, run as root again), but
    what it reads, writes, makes or removes in the run directory, which the run's uid owns, is done as that uid: a
    symbolic or hard link the run planted there leads it nowhere the run could not go itself. Blocks nest.

    Raises:
        OSError: the thread's file identity cannot be changed (the block does not run).
    """
    identity = run_as()
    if identity is None:
        yield
        return
    uid, gid = identity[0], identity[1]
    libc = ctypes.CDLL(None, use_errno=True)
    groups = os.getgroups()
    _thread_groups(libc, [])
    old_gid, old_uid = libc.setfsgid(gid), libc.setfsuid(uid)
    try:
        if (libc.setfsuid(-1), libc.setfsgid(-1)) != (uid, gid):  # -1 changes nothing and returns the current ids
            raise OSError(f"run_user_files: cannot take uid {uid} and gid {gid} for this thread's file accesses")
        yield
    finally:
        libc.setfsuid(old_uid)
        libc.setfsgid(old_gid)
        _thread_groups(libc, groups)


def run_environ(environ: Mapping[str, str], allow: Collection[str] = ()) -> dict[str, str]:
    """The part of ``environ`` a service-launched run's processes may see: :data:`RUN_ENV_NAMES`, names with a
    :data:`RUN_ENV_PREFIXES` prefix that do not look like a credential, and the names in ``allow`` (the
    worker's ``RUN_ENV_ALLOW``); never :data:`NEVER_PASSED`."""

    def passes(name: str) -> bool:
        if name in NEVER_PASSED:
            return False
        if name in RUN_ENV_NAMES or name in allow:
            return True
        return name.startswith(RUN_ENV_PREFIXES) and not any(mark in name.upper() for mark in SECRET_MARKS)

    return {name: value for name, value in environ.items() if passes(name)}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie, state ``Z``/``X`` in ``/proc/<pid>/stat``, has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # ESRCH: it was reaped between the open and the read
        return False
    return state not in {"Z", "X"}


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (PR_SET_PDEATHSIG, Linux); exits at
    once if the parent (pid ``parent``, default the current one) is already gone. Note: "parent" is the thread
    that forked this process; call :func:`spawn` from a thread that lives as long as the child should."""
    parent = os.getppid() if parent is None else parent
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:
        os._exit(0)


def live_processes() -> dict[int, tuple[int, int, str]]:
    """Live (not zombie) processes of this machine, read from ``/proc`` (Linux): pid -> (process group id,
    session id, command line with spaces between its arguments). A process that exits while it is read is left
    out."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] not in {"Z", "X"}:
            found[int(entry.name)] = (int(fields[2]), int(fields[3]), cmdline)
    return found


def boot_time() -> float:
    """When this machine booted, in seconds since the epoch, to 1/100 s: now minus ``/proc/uptime`` (both clocks
    read now, so a wall clock set since the boot moves it along)."""
    return time.time() - float(Path("/proc/uptime").read_text().split()[0])


def started_at(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (:func:`boot_time` + field 22 of
    ``/proc/<pid>/stat``; to about 1/50 s), None when it is gone. Compared with a run's end time it tells a reused
    pid from a process of the run."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22; fields[0] is field 3 (state)


def session_members(session: int) -> set[int]:
    """Live (not zombie) processes whose session id is ``session`` (a supervisor's pid: every process of its
    run that did not call ``setsid`` itself)."""
    return {pid for pid, (_, sid, _) in live_processes().items() if sid == session}


OOM_SCORE_ADJ = 500
"""What a started process adds to its OOM-kill score (``/proc/self/oom_score_adj``; a process may raise its own,
and its children inherit it): when a run's memory limit is reached the kernel kills one of the run's workers
(vLLM, trainer, orchestrator), not the supervisor that started them (whose RSS is of the same size: it imports
the launcher), which lives to report the OOM kill as the run's failure reason."""


def prefer_for_oom_kill() -> None:
    """Raise this process's OOM-kill score by :data:`OOM_SCORE_ADJ` (nothing where ``/proc`` lacks the file)."""
    try:  # plain os calls: this runs in a forked child before exec
        fd = os.open("/proc/self/oom_score_adj", os.O_RDWR)
        try:
            now = int(os.read(fd, 16).strip() or 0)
            os.write(fd, str(min(1000, now + OOM_SCORE_ADJ)).encode())
        finally:
            os.close(fd)
    except (OSError, ValueError):
        pass


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as the leader of a new process group with stdout+stderr appended to ``log_path``, plus the
    group's watchdog (module docstring): when this process dies, by any signal, the whole group gets SIGKILL.
    ``env`` replaces the environment when given (else it is inherited). Inside a Slurm job of a root worker
    (:data:`RUN_AS_VAR`) ``cmd`` runs as the run's uid (:func:`run_as_argv`; an ``srun`` of a job step is left as it
    is: ``worker.launchers.slurm_layout.Layout.srun`` puts the drop on the node). Stop it with :func:`kill_group`.

    Raises:
        OSError: ``cmd`` cannot be started (the watchdog is not started then).
    """
    if cmd[:1] != ["srun"]:
        cmd = [*run_as_argv(), *cmd]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        parent = os.getpid()

        def child_setup() -> None:  # runs in the child between fork and exec
            die_with_parent(parent, signal.SIGKILL)
            os.setpgrp()
            prefer_for_oom_kill()

        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=child_setup, cwd=os.getcwd()
        )
    read_end, write_end = os.pipe()  # both close-on-exec: only the watchdog gets the read end (pass_fds)
    try:
        watchdog = subprocess.Popen(
            [sys.executable, "-S", "-c", WATCHDOG, str(read_end)],
            pass_fds=(read_end,),
            process_group=proc.pid,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        os.close(write_end)
        kill_group(proc)
        raise
    finally:
        os.close(read_end)
    with _lock:
        _watchdogs[proc.pid] = (watchdog, write_end)
    return proc


def kill_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``grace_s``; reaps the leader and its watchdog."""
    kill_groups([proc], grace_s)


def kill_groups(procs: Collection[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM every process group of ``procs`` at once, then SIGKILL what is left of them ``grace_s`` later (one grace
    for all: a run's three groups or a service's two end within ``grace_s``, not one grace after another); reaps
    each leader and its watchdog."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        with _lock:
            entry = _watchdogs.pop(proc.pid, None)
        if entry is not None:
            watchdog, write_end = entry
            os.close(write_end)
            watchdog.wait()
