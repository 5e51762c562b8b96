"""The run directory: the one place the three processes of a run meet on disk.

```
outputs/<name>/
  config.json                 resolved spec (written by the launcher)
  events.jsonl                status transitions and notable events, one JSON object a line
  metrics.jsonl               one JSON object per (source, step): {"source", "step", "time", <name>: value, ...}
  logs/<process>.log          stdout/stderr of inference, orchestrator, trainer
  batches/step_<n>.json       orchestrator -> trainer: packed micro-batches for trainer step n
  rollouts/step_<n>.jsonl     every rollout of step n (group, task, completion, reward, advantage, policy span, token
                              ids, sampling log-probs and loss mask: ``Rollout.record``)
  weights/step_<n>/           trainer -> inference: policy version n (safetensors, STABLE marker last)
  checkpoints/step_<n>/{trainer,orchestrator}/   each part renamed into place, `.complete` marker inside
  policy_check/probe.json     trainer -> orchestrator: the served-policy check's probe tokens (``worker.orchestrator.policy_check``)
  policy_check/step_<n>.json  the trainer's log-probs of the probe under policy version n (0: the base), all kept
  progress/<process>.json     trainer, orchestrator: progress record rewritten every second (``worker.tracking.progress``)
  final/                      the trained model (save_pretrained), loadable by name-or-path code
  source/, model/             an eval job: the evaluated run's weights, the model folder made from them
  eval_tasks.jsonl            an eval job: one line per finished task, not evaluated again on resume
  summary.json
```

A run launched by the service lives in a home folder, ``<ASYNCRL_OUTPUT_DIR>/runs/<id>/``, beside the files of its
supervisor (``worker.launchers.supervisor``), which are for the supervisor and the worker only
(:class:`SupervisorHome`):

```
runs/<id>/
  spec.json                   the run's resolved spec (written by the launch task, read by the supervisor)
  supervisor.lock             flock held by the live supervisor for its whole life; holds its pid
  supervisor.log              the supervisor's stdout/stderr
  final.json                  the final status spooled before it is reported: {"status", "reason", "attempt", "pid",
                              "time", "delivered"}
  forwarded.offset            bytes of <name>/metrics.jsonl already sent to the server
  events.offset               bytes of <name>/events.jsonl already read for engine events to send to the server
  config_acks.offset          bytes of <name>/config_acks.jsonl already sent to the server
  job.sbatch, srun.log        Slurm: the job script, the log of ``srun`` inside an allocation
  slurm-<job>.out             Slurm: the job's own output (before the script redirects it)
  slurm/attempt-<n>/job.log   Slurm: the job script's log of attempt n (SLURM_RESTART_COUNT)
  <name>/                     the run directory (:class:`RunDir`)
```

Every file another process reads is written to a temporary name and renamed, so a reader sees either
nothing or the whole file (POSIX rename is atomic within one filesystem). The JSON-lines files are the exception:
they are only appended to, one whole line per ``write``, and readers take complete lines only.

A full disk: every write of the engine goes through :func:`writing`, which removes what the failed write left
half-done (a temporary file or folder) and turns the error of a full filesystem (``ENOSPC``, and the errors of
libraries that hide it, e.g. ``torch.save``'s) into :class:`DiskFull`, whose message names what was written, where,
and the free space. A run process that meets it writes a ``disk_full`` event and exits 1 (:func:`run_process`);
the launcher's failure reason carries that event's reason.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Literal, get_args

logger = logging.getLogger(__name__)
COMPLETE_MARKER = ".complete"
STABLE_MARKER = "STABLE"
_STEP_RE = re.compile(r"^step_(\d+)$")


DISK_FULL_FREE_BYTES = 2**20
"""A write that failed on a filesystem with less than this free (bytes, for unprivileged users) failed for want of
space, whatever the error says: ``torch.save`` answers a full disk with ``RuntimeError('... unexpected pos ...')``."""
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
_OS_ERROR_WORDS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EDQUOT: "disk quota exceeded",
}


def human_bytes(n: float) -> str:
    """``n`` bytes for people: ``0 B``, ``512 B``, ``1.0 KiB``, ``3.5 MiB``, ``12.0 GiB`` (binary units)."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def disk_space(path: Path) -> tuple[int, int]:
    """``(free, total)`` bytes of the filesystem holding ``path`` (or its nearest existing ancestor); ``free`` is
    what an unprivileged user may still write (``f_bavail``)."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    st = os.statvfs(existing)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


class DiskFull(OSError):
    """A write of the engine failed because the filesystem is full (``errno`` is ``ENOSPC``).

    Attributes:
        what: what was being written (``checkpoint step 4 (trainer part)``, ``policy version 3``, ``metrics.jsonl``).
        path: the file or folder the write failed at.
        free, total: bytes free and in all on its filesystem when the write failed.
    """

    def __init__(self, what: str, path: Path, free: int, total: int) -> None:
        self.what, self.path, self.free, self.total = what, Path(path), free, total
        message = f"disk full while writing {what} at {path} (free {human_bytes(free)} of {human_bytes(total)})"
        super().__init__(errno.ENOSPC, message, str(path))

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (an error crossing processes) with its own arguments
        return (DiskFull, (self.what, self.path, self.free, self.total))


def is_disk_full(err: BaseException, path: Path) -> bool:
    """Whether ``err``, raised by a write at ``path``, means the filesystem is full: an ``OSError`` with ``ENOSPC`` or
    ``EDQUOT`` (one with another ``errno`` is not), an error whose message says so (safetensors), or any other error
    while less than :data:`DISK_FULL_FREE_BYTES` are free there (``torch.save``)."""
    if isinstance(err, DiskFull):
        return True
    if isinstance(err, OSError) and err.errno is not None:  # the kernel said why: EACCES, EROFS, ... are not space
        return err.errno in _DISK_FULL_ERRNOS
    if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit: not a write error
        return False
    if any(text in str(err).lower() for text in _DISK_FULL_TEXT):
        return True
    try:
        return disk_space(path)[0] < DISK_FULL_FREE_BYTES
    except OSError:
        return False


def remove_path(path: Path) -> None:
    """Remove a file or a folder tree if it exists (errors ignored: it is cleanup)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def empty_folder(folder: Path) -> None:
    """Remove everything in ``folder`` (links themselves, never what they lead to) but keep the folder itself: a run
    directory that the run's uid owns in a home folder it may not write (a root worker's Slurm job). A missing folder
    is left missing.

    Raises:
        OSError: something in it cannot be removed.
    """
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _clear_frames(err: BaseException) -> None:
    """Clear the local variables of the finished frames in the tracebacks of ``err`` and the errors it chains."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


@contextmanager
def writing(what: str, path: Path, *, partial: Path | None = None) -> Iterator[None]:
    """The body writes ``what`` at ``path``. When it raises, ``partial`` (the temporary file or folder it was
    filling) is removed, and an error of a full filesystem (:func:`is_disk_full`) is raised as :class:`DiskFull`
    naming ``what`` and ``path`` (or the path a nested ``writing`` named, unless that is inside ``partial``); other
    errors pass unchanged.

    Raises:
        DiskFull: the filesystem is full.
    """
    try:
        yield
    except BaseException as err:
        full = is_disk_full(err, path)
        try:
            free, total = (err.free, err.total) if isinstance(err, DiskFull) else disk_space(path) if full else (0, 0)
        except OSError:
            free, total = 0, 0
        if full:  # a library's half-written file may still be open in a frame of the error (torch.save's writer):
            _clear_frames(err)  # close it, so that removing it gives its space back now
        if partial is not None:
            remove_path(partial)
        if not full:
            raise
        inner = err.path if isinstance(err, DiskFull) else path
        if partial is not None and inner.is_relative_to(partial):  # inside the temporary folder: name the real place
            inner = path
        raise DiskFull(what, inner, free, total) from err


LAUNCH_MIN_FREE_BYTES = 2**20
"""Free space a run needs before anything of its own counts: its spec, ``config.json``, the first log lines."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def launch_space(model_name: str) -> tuple[int, str]:
    """A lower bound on the bytes a run of ``model_name`` writes, and what it counts: :data:`LAUNCH_MIN_FREE_BYTES`
    plus, for a model in a local folder, the size of its weight files (``*.safetensors``, else ``*.bin``/``*.pt``),
    since every run that trains writes at least that much: the final model (``final/``, fp32, never smaller than the
    stored weights), and each published policy version and checkpoint. A hub name counts nothing beyond the minimum
    (its size is not known without the hub)."""
    folder = Path(model_name)
    try:
        files = [f for f in folder.iterdir() if f.is_file() and f.suffix in _WEIGHT_SUFFIXES] if folder.is_dir() else []
    except OSError:
        files = []
    preferred = [f for f in files if f.suffix == ".safetensors"] or files
    weights = sum(f.stat().st_size for f in preferred)
    if not weights:
        return LAUNCH_MIN_FREE_BYTES, f"{human_bytes(LAUNCH_MIN_FREE_BYTES)} for its spec, config and logs"
    return (
        LAUNCH_MIN_FREE_BYTES + weights,
        f"the {human_bytes(weights)} of {folder} weights for its final model, plus {human_bytes(LAUNCH_MIN_FREE_BYTES)}",
    )


def space_refusal(home: Path, model_name: str) -> str | None:
    """Why a run of ``model_name`` whose home folder is ``home`` cannot start for want of disk space
    (:func:`launch_space`), or None when its filesystem has room (or cannot be asked)."""
    try:
        free, total = disk_space(home)
    except OSError:
        return None
    need, what = launch_space(model_name)
    if free >= need:
        return None
    return (
        f"disk full: {human_bytes(free)} free of {human_bytes(total)} at {home}; the run needs at least "
        f"{human_bytes(need)} ({what})"
    )


def describe_os_error(err: OSError, path: Path | None = None) -> str:
    """One line for an ``OSError`` of a write at ``path`` (default: the error's own file name): ``disk full: no space
    left on device writing /x/spec.json (free 0 B of 1.0 MiB)``, ``read-only file system writing /x/spec.json``,
    ``permission denied writing /x``; the message of a :class:`DiskFull` as it is."""
    if isinstance(err, DiskFull):
        return str(err)
    where = path if path is not None else err.filename
    at = f" writing {where}" if where else ""
    if err.errno in _DISK_FULL_ERRNOS:
        space = ""
        if where:
            try:
                free, total = disk_space(Path(where))
                space = f" (free {human_bytes(free)} of {human_bytes(total)})"
            except OSError:
                pass
        words = "no space left on device" if err.errno == errno.ENOSPC else "disk quota exceeded"
        return f"disk full: {words}{at}{space}"
    words = _OS_ERROR_WORDS.get(err.errno or 0) or (err.strerror or str(err)).lower()
    return f"{words}{at}"


def atomic_write_text(path: Path, text: str, what: str | None = None, *, mode: int = 0o666) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder (made with ``mode`` less the umask,
    never through a symbolic link) and a rename; a failed write leaves neither the temporary file nor a changed
    ``path``.

    Raises:
        DiskFull: the filesystem is full (``what``, default the file's name, says what was written).
        OSError: any other failure to write.
    """
    atomic_write_bytes(path, text.encode(), what, mode=mode)


def atomic_write_bytes(path: Path, data: bytes, what: str | None = None, *, mode: int = 0o666) -> None:
    """:func:`atomic_write_text` of bytes (UTF-8 text already encoded). Errors: as :func:`atomic_write_text`."""
    with writing(what or path.name, path):
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(what or path.name, path, partial=tmp):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj))


def append_jsonl(path: Path, obj: dict[str, Any]) -> None:
    """Append one JSON line (:func:`append_jsonl_rows` of one row). Errors: as :func:`append_jsonl_rows`."""
    append_jsonl_rows(path, [obj])


def append_jsonl_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append one JSON line per row of ``rows`` in one ``write`` (a step's rollout records: one open and one write,
    not one per rollout); a single ``write`` on an O_APPEND file keeps concurrent writers' lines whole. A write the
    full disk cut short is taken back (the file is truncated to where the line began, unless another writer
    appended meanwhile), so no torn line is left for a later line to be glued to.

    Raises:
        DiskFull: the filesystem is full.
        OSError: any other failure to write.
    """
    append_jsonl_bytes(path, "".join(json.dumps(obj, allow_nan=True) + "\n" for obj in rows).encode())


def append_jsonl_bytes(path: Path, line: bytes) -> None:
    """Append ``line`` (whole JSON lines, each ending in a newline, encoded already) in one ``write``, as
    :func:`append_jsonl_rows` does. Errors: as :func:`append_jsonl_rows`."""
    with writing(path.name, path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
            if written < len(line):
                ours_end = os.lseek(fd, 0, os.SEEK_CUR)  # O_APPEND: just after the bytes this write added
                if written and os.fstat(fd).st_size == ours_end:
                    os.ftruncate(fd, ours_end - written)
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(line)} bytes", str(path))
        finally:
            os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete lines of a JSON-lines file (a torn last line from a kill is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_jsonl_after(
    path: Path, offset: int, opener: Callable[[Path], BinaryIO] = lambda p: open(p, "rb")
) -> tuple[list[dict[str, Any]], int]:
    """The complete lines of the JSON-lines file ``path`` after byte ``offset``, parsed, and the byte offset after
    the last of them (where the next call starts).

    A last line still being written (no newline yet) waits for the next call; a complete line that is not JSON is
    logged and skipped. A file shorter than ``offset`` was replaced (resume pruned it, a requeued attempt started
    over): it is read from the start. No file: ``([], offset)``. ``opener`` opens ``path`` (the service passes
    ``worker.run.run_files.open_run_file``, which refuses links).
    """
    try:
        with opener(path) as f:
            if f.seek(0, os.SEEK_END) < offset:
                offset = 0
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1
    rows = []
    for line in chunk[:end].splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s: skipped a line that is not JSON: %r", path, line[:200])
    return rows, offset + end


def read_offset(path: Path) -> int:
    """The byte offset a reader of :func:`read_jsonl_after` saved in ``path``: 0 when there is none, or it is not a
    number (a write cut short by a full disk), so the reader starts over (every reader's server side is
    idempotent)."""
    try:
        return max(int(path.read_text()), 0)
    except (OSError, ValueError):
        return 0


def step_dirs(folder: Path) -> dict[int, Path]:
    """``{n: folder/step_n}`` for every ``step_<n>`` entry of ``folder``."""
    if not folder.is_dir():
        return {}
    found = {}
    for entry in folder.iterdir():
        m = _STEP_RE.match(entry.name)
        if m:
            found[int(m.group(1))] = entry
    return found


class RunDir:
    """Paths of one run directory (no I/O in the constructor)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    config = property(lambda self: self.root / "config.json")
    events = property(lambda self: self.root / "events.jsonl")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    logs = property(lambda self: self.root / "logs")
    batches = property(lambda self: self.root / "batches")
    rollouts = property(lambda self: self.root / "rollouts")
    weights = property(lambda self: self.root / "weights")
    checkpoints = property(lambda self: self.root / "checkpoints")
    final = property(lambda self: self.root / "final")
    eval_source = property(lambda self: self.root / "source")
    """An eval job's copy of the weights it evaluates (``server.services.runs.attach_eval_source``)."""
    eval_model = property(lambda self: self.root / "model")
    """An eval job's model folder made from ``eval_source`` (``worker.evaluation.job_model``)."""
    eval_tasks = property(lambda self: self.root / "eval_tasks.jsonl")
    """An eval job's finished tasks, one line each, that a resumed attempt does not sample again
    (``worker.evaluation.run_job``)."""
    summary = property(lambda self: self.root / "summary.json")
    policy_check = property(lambda self: self.root / "policy_check")
    policy_check_probe = property(lambda self: self.policy_check / "probe.json")

    def policy_check_logprobs(self, version: int) -> Path:
        return self.policy_check / f"step_{version}.json"

    def batch(self, step: int) -> Path:
        return self.batches / f"step_{step}.json"

    def rollout_file(self, step: int) -> Path:
        return self.rollouts / f"step_{step}.jsonl"

    def weight_dir(self, version: int) -> Path:
        return self.weights / f"step_{version}"

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    def create(self) -> None:
        for folder in (self.logs, self.batches, self.rollouts, self.weights, self.checkpoints):
            folder.mkdir(parents=True, exist_ok=True)

    def log_metrics(self, source: str, step: int, values: dict[str, float | int | None]) -> None:
        append_jsonl(self.metrics, {"source": source, "step": step, "time": time.time(), **values})

    def log_event(self, kind: str, **fields: Any) -> None:
        append_jsonl(self.events, {"time": time.time(), "event": kind, **fields})

    def record_interrupted(self) -> dict[str, Any] | None:
        """Before a new attempt's ``starting`` event: when the previous attempt's lifecycle events
        (:data:`LIFECYCLE_EVENTS`) end in ``starting`` or ``running``, that attempt ended without recording its end (a
        ``kill -9`` of the whole process tree, a lost node, a power cut): write one :data:`INTERRUPTED` event for it.
        Call it before anything prunes ``metrics.jsonl`` (resume, requeue), so that ``step`` is the step it reached.

        Returns:
            The event's fields (``{"reason", "step", "attempt_started"}``: ``step`` the last step its trainer logged
            in ``metrics.jsonl``, None if none; ``attempt_started`` the time of its ``starting`` event, unix s, None
            if none), or None when nothing was written: no earlier attempt (a fresh run directory) or one that
            recorded its end (``completed``, ``failed``, ``cancelled``, or ``interrupted`` written already).

        Raises:
            OSError: the event cannot be written (:class:`DiskFull` when the filesystem is full).
        """
        lifecycle = [e for e in read_jsonl(self.events) if e.get("event") in LIFECYCLE_EVENTS]
        if not lifecycle or lifecycle[-1]["event"] not in ("starting", "running"):
            return None
        started = next((e.get("time") for e in reversed(lifecycle) if e["event"] == "starting"), None)
        steps = [r["step"] for r in read_jsonl(self.metrics) if r.get("source") in ("trainer", "sft") and "step" in r]
        step = max(steps, default=None)
        reached = f"it reached step {step}" if step is not None else "no step logged"
        fields = {
            "reason": f"the previous attempt ended without a final state (killed?); {reached}",
            "step": step,
            "attempt_started": started,
        }
        self.log_event(INTERRUPTED, **fields)
        return fields

    def remove_temporaries(self) -> list[Path]:
        """Remove the temporary files and folders (``.<name>.tmp-<pid>``) that failed or killed writes left in the run
        directory, its ``weights/`` (and each version folder) and ``batches/``; returns what was removed. Call it only
        while no process of the run writes (after its processes ended). Checkpoints: ``worker.run.checkpoint``."""
        folders = [self.root, self.weights, self.batches, *step_dirs(self.weights).values()]
        found = [tmp for folder in folders if folder.is_dir() for tmp in folder.glob(".*.tmp-*")]
        for tmp in found:
            remove_path(tmp)
        return found

    def latest_stable_weights(self) -> tuple[int, Path] | None:
        """Newest published policy version whose STABLE marker exists, or None."""
        ready = {n: p for n, p in step_dirs(self.weights).items() if (p / STABLE_MARKER).exists()}
        if not ready:
            return None
        n = max(ready)
        return n, ready[n]

    def prune_after(self, step: int) -> None:
        """Remove batches, weights, rollouts and metrics of steps after ``step`` (used by resume)."""
        for n, p in step_dirs(self.weights).items():
            if n > step:
                shutil.rmtree(p, ignore_errors=True)
        for folder in (self.batches, self.rollouts):
            for p in folder.glob("step_*"):
                m = re.match(r"step_(\d+)\.", p.name)
                if m and int(m.group(1)) > step:
                    p.unlink()
        if self.metrics.exists():
            kept = [r for r in read_jsonl(self.metrics) if r.get("step", 0) <= step]
            atomic_write_text(self.metrics, "".join(json.dumps(r) + "\n" for r in kept))


def record_disk_full(run: RunDir, process: str, err: DiskFull) -> None:
    """Log ``err`` and write the ``disk_full`` event of ``process`` into ``events.jsonl`` (the launcher's failure
    reason and the server's run events carry it). When even that line cannot be written, the launcher still finds
    the filesystem full and says so."""
    logger.error("%s: %s", process, err)
    try:
        run.log_event(
            "disk_full",
            process=process,
            reason=str(err),
            what=err.what,
            path=str(err.path),
            free=err.free,
            total=err.total,
        )
    except OSError as again:
        logger.error("%s: could not write the disk_full event either: %s", process, again)


def run_process(process: str, main: Callable[[], int], argv: list[str] | None = None) -> int:
    """Run the ``main`` of run process ``process`` (``trainer``, ``orchestrator``) and return its exit code; a
    :class:`DiskFull` it raises ends it with exit code 1 after :func:`record_disk_full` in the run directory named by
    ``--run-dir`` in ``argv`` (default ``sys.argv[1:]``), instead of a traceback."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--run-dir", type=Path)
    known, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        return main()
    except DiskFull as err:
        if known.run_dir is None:
            raise
        record_disk_full(RunDir(known.run_dir), process, err)
        return 1


EngineEventKind = Literal[
    "disk_full",
    "truncated",
    "policy_check_failed",
    "stalled",
    "progress_resumed",
    "eval_abandoned",
    "inference_resumed",
    "starved",
]
ENGINE_EVENTS: tuple[str, ...] = get_args(EngineEventKind)
"""Events of ``events.jsonl`` that the supervisor forwards to the server's run events (``worker.launchers.reporter``):
what a run process warns about (``truncated``, case C24) or died of (``disk_full``; ``policy_check_failed``, case C14,
either); the hang watchdog's ``stalled`` and ``progress_resumed`` (``worker/tracking/progress.py``, case C18) and an
abandoned eval (``eval_abandoned``, case C19); an inference server found left paused by a killed orchestrator and
resumed (``inference_resumed``); slow tasks left out of training by continuous admission (``starved``, case C26). The
launcher's own events (``starting``, ``running``, the final status) reach the server as status reports instead."""

ENDED = ("completed", "failed", "cancelled")
"""The launcher's last event of an attempt that recorded its end: the run's final status (with its ``reason``)."""
INTERRUPTED = "interrupted"
"""The event a new attempt writes, before its ``starting``, for a previous attempt whose events end without one of
:data:`ENDED` (killed with its launcher: :meth:`RunDir.record_interrupted`); fields ``reason``, ``step``,
``attempt_started``."""
LIFECYCLE_EVENTS = ("starting", "running", *ENDED, INTERRUPTED)
"""The launcher's events of ``events.jsonl`` that say where a run's lifecycle stands (the last one counts). They reach
the server as status reports, not as engine events."""

FINAL_STATUSES = frozenset(ENDED)
"""Statuses a supervisor spools in ``final.json``."""


class SupervisorHome:
    """Paths of a service-launched run's home folder (see the module docstring; no I/O in the constructor)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    spec = property(lambda self: self.root / "spec.json")
    lock = property(lambda self: self.root / "supervisor.lock")
    log = property(lambda self: self.root / "supervisor.log")
    final = property(lambda self: self.root / "final.json")
    forwarded_offset = property(lambda self: self.root / "forwarded.offset")
    events_offset = property(lambda self: self.root / "events.offset")
    config_acks_offset = property(lambda self: self.root / "config_acks.offset")
    job_script = property(lambda self: self.root / "job.sbatch")
    srun_log = property(lambda self: self.root / "srun.log")
    slurm_attempts = property(lambda self: self.root / "slurm")

    def run_dir(self, name: str) -> RunDir:
        return RunDir(self.root / name)

    def attempt_logs(self) -> list[Path]:
        """``slurm/attempt-<n>/job.log`` of every Slurm attempt so far, sorted by path."""
        return sorted(self.slurm_attempts.glob("attempt-*/job.log"))

    def write_spec(self, spec: dict[str, Any]) -> None:
        """Create the folder and write the run's resolved spec (the supervisor reads it), atomically, with no access for
        other uids (0640: the home of a root worker's Slurm run lets any uid pass, ``worker.launchers.supervisor``).

        Raises:
            OSError: it cannot be written (:class:`DiskFull` when the filesystem is full).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.spec, json.dumps(spec), what="the run's spec", mode=0o640)

    def write_final(self, final: dict[str, Any]) -> None:
        """Spool the final status (``{"status", "reason", "attempt", "pid", "time", "delivered"}``)."""
        atomic_write_json(self.final, final)

    def read_final(self, attempt: int | None) -> dict[str, Any] | None:
        """The final status a supervisor spooled for launch attempt ``attempt``, or None (no spool, an unreadable
        one, or one of another attempt)."""
        try:
            final = json.loads(self.final.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(final, dict) or final.get("attempt") != attempt or final.get("status") not in FINAL_STATUSES:
            return None
        return final
