"""Checkpoints: atomic parts, a completion rule, and the choice of where to resume.

A checkpoint of step k is ``checkpoints/step_k/`` with one part per process: ``trainer/`` (model
safetensors, optimizer, scheduler, step, RNG) and ``orchestrator/`` (step, data cursor, sampler
state). Each part is written into a hidden temporary folder, finished with a ``.complete`` marker,
then renamed into place, so a kill mid-write leaves only a temporary folder that resume ignores and
removes; a write that fails (a full disk: ``worker.run.rundir.DiskFull``) removes its temporary folder at once, and
the launcher removes incomplete step folders when the run ends. A step is complete when both parts are in place with
their markers.

This module is the layout and the rules and imports no torch (the server reads it). What needs torch,
writing and loading the ``trainer`` part (model, optimizer, scheduler, RNG states), is in
``worker/trainer/checkpointer.py``; the orchestrator writes its part in ``worker/orchestrator``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

from worker.run.rundir import COMPLETE_MARKER, RunDir, atomic_write_json, step_dirs, writing

if TYPE_CHECKING:
    from worker.spec import EvalSpec, RLSpec, SFTSpec

PARTS = ("trainer", "orchestrator")
logger = logging.getLogger(__name__)


def write_part(run: RunDir, step: int, part: str, write: Callable[[Path], None]) -> Path:
    """Write one checkpoint part atomically: ``write(tmp_dir)`` fills a temporary folder, then rename.

    A failed write removes the temporary folder, and the step folder when nothing else is in it, so the newest
    complete checkpoint stays the one resume takes; the part already in place (an earlier write of this step)
    stays until the new one is complete.

    Returns:
        The final part folder ``checkpoints/step_<step>/<part>``.

    Raises:
        DiskFull: the filesystem is full (``checkpoint step <step> (<part> part)`` and the file it failed at).
        Exception: whatever ``write`` raised, after the cleanup.
    """
    step_dir = run.checkpoint_dir(step)
    tmp = step_dir / f".{part}.tmp-{os.getpid()}"
    what = f"checkpoint step {step} ({part} part)"
    try:
        with writing(what, step_dir / part, partial=tmp):
            step_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            write(tmp)
            (tmp / COMPLETE_MARKER).write_text(str(step))
    except BaseException:
        try:
            step_dir.rmdir()  # only when empty: the other process's part (or its temporary folder) stays
        except OSError:
            pass
        raise
    final = step_dir / part
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def is_complete(step_dir: Path) -> bool:
    return all((step_dir / part / COMPLETE_MARKER).exists() for part in PARTS)


def complete_steps(run: RunDir) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    return sorted(n for n, p in step_dirs(run.checkpoints).items() if is_complete(p))


def resume_step(run: RunDir) -> int | None:
    """The newest complete checkpoint step, warning about newer incomplete ones (case C4).

    Incomplete newer step folders and temporary folders left by a kill are removed
    (:func:`remove_incomplete`), so the resumed run writes them anew.
    """
    return remove_incomplete(run)


def remove_incomplete(run: RunDir) -> int | None:
    """Remove what failed or killed checkpoint writes left: step folders newer than the newest complete checkpoint
    (each one logged as a warning) and temporary part folders inside the others; returns the newest complete step
    (None without one). Call it only while no process of the run writes checkpoints (before a launch, after one)."""
    complete = complete_steps(run)
    newest = complete[-1] if complete else None
    for n, p in sorted(step_dirs(run.checkpoints).items()):
        if newest is None or n > newest:
            logger.warning(
                "checkpoint step_%d is incomplete (parts: %s); ignoring it",
                n,
                (sorted(x.name for x in p.iterdir()) or "none") if p.is_dir() else "none",
            )
            shutil.rmtree(p, ignore_errors=True)
        else:
            for tmp in p.glob(".*.tmp-*"):
                shutil.rmtree(tmp, ignore_errors=True)
    return newest


def prune(run: RunDir, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (incomplete newer ones are kept)."""
    complete = complete_steps(run)
    for n in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(run.checkpoint_dir(n), ignore_errors=True)


REQUEST_FILE = "checkpoint_request.json"
"""In the run directory: ``{"step": n}`` asks trainer and orchestrator for a checkpoint at step n (preemption)."""


def request(run: RunDir, step: int) -> None:
    """Ask both processes for a checkpoint at ``step`` besides the periodic ones (they read it every step)."""
    atomic_write_json(run.root / REQUEST_FILE, {"step": step})


def due(run: RunDir, step: int, interval: int, hold_at: Collection[int] = ()) -> bool:
    """Whether ``step`` ends with a checkpoint: every ``interval`` steps (0 = never), a step the run holds at
    (``ckpt.hold_at``), or ``request``-ed."""
    if (interval and step % interval == 0) or step in hold_at:
        return True
    try:
        return int(json.loads((run.root / REQUEST_FILE).read_text())["step"]) == step
    except (OSError, ValueError, KeyError, TypeError):
        return False


def end_of_leg(start: int, max_steps: int, hold_at: Collection[int]) -> int:
    """The last step a process started (or resumed) at ``start`` runs: the first ``ckpt.hold_at`` step after
    ``start``, where the run holds until it is stopped, else ``max_steps``."""
    return min((s for s in hold_at if start < s < max_steps), default=max_steps)


HELD = "held"
"""The progress state (``worker/tracking/progress.py``) and ``events.jsonl`` event of a process that reached its
:func:`end_of_leg` before ``max_steps``: its checkpoint of that step is complete; it does nothing more until the run is
stopped (no stall)."""


def check_run_dir(spec: RLSpec | SFTSpec | EvalSpec, *, resume: bool = False, overwrite: bool = False) -> int | None:
    """Check that the run directory allows this start; creates and changes nothing.

    Returns the checkpoint step to resume from (with ``resume``), else None.

    Raises:
        SpecError: ``output_dir`` is a file or not writable; the run directory exists, not empty, without
            ``--resume`` or ``--overwrite`` (sft: ``--overwrite``); ``--resume`` without a run config or a complete
            checkpoint.
    """
    from worker.spec import EvalSpec, SpecError

    run = RunDir(spec.run_dir)
    out = Path(spec.output_dir or ".")
    if run.root.exists() and not run.root.is_dir():
        raise SpecError(f"name: {run.root} exists and is not a directory")
    if run.root.is_dir():  # prepared already (a Slurm job hands it to the run's uid inside a root-owned folder)
        if not os.access(run.root, os.W_OK | os.X_OK):
            raise SpecError(f"output_dir: cannot write the run directory {run.root} (permission denied)")
    else:
        existing = next(p for p in (out, *out.parents, Path(".")) if p.exists())  # Path(".") ends a relative path
        if not existing.is_dir():
            raise SpecError(f"output_dir: {existing} is a file, not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise SpecError(f"output_dir: cannot create run directories under {existing} (permission denied)")
    if resume:
        if isinstance(spec, EvalSpec):
            raise SpecError("--resume: an eval job has no checkpoints; submit it again")
        if not run.config.exists():
            hint = "pass --overwrite to start over" if run.root.exists() else "start it without --resume"
            raise SpecError(f"--resume: no run config at {run.config} ({hint})")
        step = resume_step(run)
        if step is None:
            raise SpecError(f"--resume: no complete checkpoint in {run.checkpoints} (start over with --overwrite)")
        if step >= spec.max_steps and _completed(run):
            raise SpecError(
                f"max_steps: the run completed at step {step} and max_steps is {spec.max_steps}: nothing "
                f"to resume (raise --max_steps to train further)"
            )
        return step
    if run.root.exists() and any(run.root.iterdir()) and not overwrite:  # empty: made for it (a root worker's job)
        raise SpecError(f"run directory {run.root} exists: pass --resume to continue it or --overwrite to replace it")
    return None


def _completed(run: RunDir) -> bool:
    """Whether the run's ``summary.json`` says it completed."""
    try:
        return json.loads(run.summary.read_text()).get("status") == "completed"
    except (OSError, ValueError, AttributeError):
        return False
