"""The run directory: the one place the three processes of a run meet on disk.

```
outputs/<name>/
  config.json                 resolved spec (written by the launcher)
  events.jsonl                status transitions and notable events, one JSON object a line
  metrics.jsonl               one JSON object per (source, step): {"source", "step", "time", <name>: value, ...}
  logs/<process>.log          stdout/stderr of inference, orchestrator, trainer
  batches/step_<n>.json       orchestrator -> trainer: packed micro-batches for trainer step n
  rollouts/step_<n>.jsonl     every rollout of step n (prompt, completion, reward, advantage, policy span)
  weights/step_<n>/           trainer -> inference: policy version n (safetensors, STABLE marker last)
  checkpoints/step_<n>/{trainer,orchestrator}/   each part renamed into place, `.complete` marker inside
  final/                      the trained model (save_pretrained), loadable by name-or-path code
  summary.json
```

A run launched by the service lives in a home folder, ``<ASYNCRL_OUTPUT_DIR>/runs/<id>/``, beside the files of its
supervisor (``worker.supervisor``), which are for the supervisor and the worker only (:class:`SupervisorHome`):

```
runs/<id>/
  spec.json                   the run's resolved spec (written by the launch task, read by the supervisor)
  supervisor.lock             flock held by the live supervisor for its whole life; holds its pid
  supervisor.log              the supervisor's stdout/stderr
  final.json                  the final status spooled before it is reported: {"status", "reason", "attempt", "pid",
                              "time", "delivered"}
  forwarded.offset            bytes of <name>/metrics.jsonl already sent to the server
  config_acks.offset          bytes of <name>/config_acks.jsonl already sent to the server
  job.sbatch, srun.log        Slurm: the job script, the log of ``srun`` inside an allocation
  slurm-<job>.out             Slurm: the job's own output (before the script redirects it)
  slurm/attempt-<n>/job.log   Slurm: the job script's log of attempt n (SLURM_RESTART_COUNT)
  <name>/                     the run directory (:class:`RunDir`)
```

Every file another process reads is written to a temporary name and renamed, so a reader sees either
nothing or the whole file (POSIX rename is atomic within one filesystem). The JSON-lines files are the exception:
they are only appended to, one whole line per ``write``, and readers take complete lines only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

logger = logging.getLogger(__name__)
COMPLETE_MARKER = ".complete"
STABLE_MARKER = "STABLE"
_STEP_RE = re.compile(r"^step_(\d+)$")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj))


def append_jsonl(path: Path, obj: dict[str, Any]) -> None:
    """Append one JSON line; a single ``write`` on an O_APPEND file keeps concurrent writers' lines whole."""
    line = (json.dumps(obj, allow_nan=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
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
    ``worker.run_files.open_run_file``, which refuses links).
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
    """The byte offset a reader of :func:`read_jsonl_after` saved in ``path`` (0 when there is none)."""
    return int(path.read_text()) if path.exists() else 0


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
    summary = property(lambda self: self.root / "summary.json")

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


FINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})
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
        """Create the folder and write the run's resolved spec (the supervisor reads it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.spec.write_text(json.dumps(spec))

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
