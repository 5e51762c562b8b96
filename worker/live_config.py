"""Live config: the spec keys that may change while a run is running, and how a change reaches the processes.

A change is a numbered **revision** ``{"revision": n, "changes": {"trainer.optim.lr": 5e-5, ...}}``. The
server (``PATCH /api/runs/{id}/config``) or ``asyncrl config set RUN_DIR key=value`` validates it with
:func:`validate_changes`; then it travels through two JSON-lines files of the run directory:

```
live_config.jsonl   {"revision", "changes", "time"}             appended by the supervisor (from the server)
                                                                or by `asyncrl config set` (local runs)
config_acks.jsonl   {"revision", "process", "step", "time"}     appended by the process that applied it
```

Each process (:class:`LiveConfig`) reads new lines at every step boundary, applies the keys it owns
(:data:`LIVE_KEYS`) to its spec and acknowledges the first step the new values are in effect for. On
resume a process re-reads the whole file, so the live file, not the checkpoint, decides the values: a
revision acknowledged at a step the checkpoint already covers is applied again silently; one acknowledged
at a later (pruned, re-done) step is acknowledged again at the step it now takes effect at.

This module imports nothing heavy (no torch, vllm, fastapi): the server validates changes with it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from worker.dotted_keys import did_you_mean, get_key, replay, with_keys
from worker.run.rundir import ENDED, LIFECYCLE_EVENTS, append_jsonl, read_jsonl, read_jsonl_after
from worker.spec import RLSpec, SpecError, parse_override_value, validate_spec

logger = logging.getLogger("asyncrl.live_config")

LIVE_KEYS: dict[str, str] = {
    "trainer.optim.lr": "trainer",
    "orchestrator.temperature": "orchestrator",
    "orchestrator.max_tokens": "orchestrator",
    "orchestrator.max_off_policy_steps": "orchestrator",
    "orchestrator.eval.interval": "orchestrator",
    "orchestrator.group_size": "orchestrator",
    "orchestrator.batch_size": "orchestrator",
    "trainer.loss.kl_tau": "trainer",
    "trainer.loss.mask_low": "trainer",
    "trainer.loss.mask_high": "trainer",
    "trainer.loss.epsilon": "trainer",
    "trainer.loss.band": "trainer",
    **{f"orchestrator.curriculum.weights.{pool}": "orchestrator" for pool in ("hard", "normal", "easy", "unseen")},
}
"""Dotted spec key -> the process that applies it (at its next step boundary).

Why each is safe to change between steps: the learning rate moves the schedule's base (:func:`set_base_lr`);
sampling keys, ``group_size`` and ``batch_size`` apply to the rollouts requested from the next step on (the data
cursor advances by the ``batch_size`` in effect, so a resume repeats no task: ``worker/orchestrator/data.py``); the
loss's KL weight and mask bounds (``kl_tau``, ``mask_low``/``mask_high`` of ``dppo_kl``, ``epsilon`` of ``ipo``,
``band`` of ``icepop``) are read by every step's loss; a ``difficulty_pool`` curriculum's pool weights are read by
every step's draw (``worker/orchestrator/curriculum.py``). A loss key exists only for its loss type, a weight only for
``difficulty_pool``; on a run of another type it is refused naming the table's ``type``."""

LIVE_CONFIG_FILE = "live_config.jsonl"
ACKS_FILE = "config_acks.jsonl"


class LiveConfigError(SpecError):
    """A change that cannot be made live; one line naming the key (a ``SpecError``: HTTP 422, CLI exit 2)."""


def validate_changes(spec: dict[str, Any], changes: Any) -> dict[str, Any]:
    """Check ``changes`` against the whitelist and the spec schema (applied to a copy of ``spec``, the run's
    resolved spec with earlier revisions applied), so cross-checks hold too (e.g. ``orchestrator.max_tokens``
    below ``inference.max_model_len``).

    Returns:
        The changes with values as the schema normalises them (``"0.5"`` -> ``0.5``), in the given key order.

    Raises:
        LiveConfigError: empty changes, a key that is not live (the message lists the live keys), or a loss key of
            another loss type than the run's.
        SpecError: a value the schema refuses; the message starts with the dotted key.
    """
    if not isinstance(changes, dict) or not changes:
        raise LiveConfigError(
            f'changes: expected at least one live key, e.g. {{"trainer.optim.lr": 5e-05}} '
            f"(live keys: {', '.join(LIVE_KEYS)})"
        )
    for key in changes:
        if key not in LIVE_KEYS:
            raise LiveConfigError(
                f"{key}: not a live key{did_you_mean(key, LIVE_KEYS)}; only these change while a run is live: "
                f"{', '.join(LIVE_KEYS)}"
            )
        if isinstance(changes[key], bool):  # pydantic would read true as 1
            raise LiveConfigError(f"{key}: expected a number, got {changes[key]!r}")
    current = json.loads(validate_spec("rl", spec).model_dump_json())  # every table written out, loss type included
    now = live_values(current)
    for key in changes:
        if now[key] is None:  # a field of another type (kl_tau on an ipo loss, a pool weight of "standard")
            parent = key.rsplit(".", 1)[0]
            while "." in parent and not _has_table(current, parent):
                parent = parent.rsplit(".", 1)[0]  # the nearest table the run has: the one whose type decides
            raise LiveConfigError(
                f"{key}: not a field of this run's {parent} (type {get_key(current, parent + '.type')!r}); the run's "
                f"live keys: {', '.join(k for k in LIVE_KEYS if now[k] is not None)}"
            )
    resolved = validate_spec("rl", with_keys(current, changes))
    data = json.loads(resolved.model_dump_json())
    return {key: get_key(data, key) for key in changes}


def _has_table(data: dict[str, Any], key: str) -> bool:
    try:
        return isinstance(get_key(data, key), dict)
    except KeyError:
        return False


def live_values(spec: dict[str, Any]) -> dict[str, Any]:
    """The current value of every live key in a resolved spec mapping (missing tables: the schema default); None for
    a key the run's tables do not have (a loss key of another loss type)."""
    data = json.loads(validate_spec("rl", spec).model_dump_json())
    values: dict[str, Any] = {}
    for key in LIVE_KEYS:
        try:
            values[key] = get_key(data, key)
        except KeyError:
            values[key] = None
    return values


def applied_changes(changes: dict[str, Any], applied: dict[str, int], step: int | None = None) -> dict[str, Any]:
    """The keys of one revision that were in effect at ``step``: those whose process (:data:`LIVE_KEYS`) acknowledged
    the revision at a step ``<= step`` (``applied``: process -> first step it ran with the revision; ``step`` None:
    at any step, i.e. in effect by the run's end). A key whose process never acknowledged it (the run ended or was
    stopped first, or the checkpoint is older than the acknowledgement) is left out: it never trained anything.

    Example: ``{"trainer.optim.lr": 5e-5, "orchestrator.temperature": 1.2}`` acknowledged ``{"trainer": 7}``, at
    step 6 -> ``{}``, at step 7 -> ``{"trainer.optim.lr": 5e-5}`` (the orchestrator never took the temperature)."""
    out = {}
    for key, value in changes.items():
        at = applied.get(LIVE_KEYS.get(key, ""))
        if at is not None and (step is None or int(at) <= step):
            out[key] = value
    return out


def replay_in_effect(
    spec: dict[str, Any], revisions: Iterable[tuple[dict[str, Any], dict[str, int]]], step: int | None = None
) -> dict[str, Any]:
    """The spec mapping as it was in effect at ``step`` (None: at the run's end): each revision's
    ``(changes, applied)``, oldest first, contributes only its keys acknowledged by then (:func:`applied_changes`).
    A fork from checkpoint ``step`` continues from this spec, not from the submitted one; a compare shows it."""
    return replay(spec, (applied_changes(changes, applied, step) for changes, applied in revisions))


def read_revisions(run_dir: Path) -> list[dict[str, Any]]:
    """Every revision line of ``<run_dir>/live_config.jsonl``, in file order."""
    return read_jsonl(Path(run_dir) / LIVE_CONFIG_FILE)


def append_revision(run_dir: Path, revision: int, changes: dict[str, Any]) -> None:
    """Append one revision line (a single O_APPEND write: a reader never sees half of it)."""
    append_jsonl(Path(run_dir) / LIVE_CONFIG_FILE, {"revision": revision, "changes": changes, "time": time.time()})


def set_local(run_dir: Path, assignments: list[str]) -> dict[str, Any]:
    """``asyncrl config set``: validate ``key=value`` pairs against the run's ``config.json`` with all earlier
    revisions applied, and append them as the next revision (numbered under an exclusive lock of the file).

    Returns:
        The revision line written (``{"revision", "changes", "time"}``).

    Raises:
        SpecError: no run config in ``run_dir``, a run that ended (its last lifecycle event in ``events.jsonl`` is
            completed, failed or cancelled), an assignment without ``=``, a non-live key or a bad value.
    """
    run_dir = Path(run_dir)
    config = run_dir / "config.json"
    if not config.is_file():
        raise SpecError(f"run directory {run_dir}: no config.json (start the run first)")
    lifecycle = [e["event"] for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") in LIFECYCLE_EVENTS]
    if lifecycle and lifecycle[-1] in ENDED:
        raise SpecError(
            f"run directory {run_dir}: the run is {lifecycle[-1]}: config changes only while it runs "
            "(resume it first: asyncrl rl ... --resume)"
        )
    changes: dict[str, Any] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SpecError(f"expected key=value, got {item!r}")
        changes[key.strip()] = parse_override_value(raw.strip(), key.strip())
    with open(config) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two writers never pick the same number
        revisions = read_revisions(run_dir)
        spec = replay(json.loads(config.read_text()), (r["changes"] for r in revisions))
        normalised = validate_changes(spec, changes)
        number = max((int(r["revision"]) for r in revisions), default=0) + 1
        append_revision(run_dir, number, normalised)
    return {"revision": number, "changes": normalised}


def set_base_lr(optimizer: Any, scheduler: Any, lr: float) -> None:
    """Make ``lr`` the base learning rate of a ``LambdaLR``-scheduled torch optimizer, in place.

    The schedule continues from the new base: at scheduler step t the lr is ``lr * factor(t)`` (a warm-up
    or decay goes on where it is, scaled), and the optimizer's current lr is set to ``lr * factor(t)`` for
    the coming step. Works for any scheduler with ``base_lrs``, ``lr_lambdas`` and ``last_epoch``.
    """
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)


class LiveConfig:
    """One process's view of ``live_config.jsonl``: remembers its byte offset and applies new revisions.

    Args:
        run_dir: the run directory.
        process: ``trainer`` or ``orchestrator``; only keys :data:`LIVE_KEYS` gives to it are applied.
        start_step: the checkpoint step a resumed process starts after (0 for a fresh run).
    """

    def __init__(self, run_dir: Path, process: str, start_step: int = 0) -> None:
        self.run_dir, self.process, self.start_step = Path(run_dir), process, start_step
        self.path = self.run_dir / LIVE_CONFIG_FILE
        self.offset = 0
        self.covered = {
            int(a["revision"])
            for a in read_jsonl(self.run_dir / ACKS_FILE)
            if a.get("process") == process and int(a.get("step", 0)) <= start_step
        }
        """Revisions acknowledged at a step the checkpoint covers: applied again on resume, not acknowledged."""

    def new_revisions(self) -> list[dict[str, Any]]:
        """Complete lines after the offset (a line still being written waits for the next call)."""
        rows, self.offset = read_jsonl_after(self.path, self.offset)
        return rows

    def apply(self, spec: RLSpec, step: int) -> tuple[RLSpec, dict[str, Any]]:
        """At the boundary before ``step``: apply new revisions' keys of this process to ``spec``.

        Each applied revision is acknowledged in ``config_acks.jsonl`` with ``step`` (the first step run with
        its values) and logged in one line. A revision the schema refuses (a hand-edited file) is logged and
        skipped, never acknowledged.

        Returns:
            The spec to use from ``step`` on (``spec`` itself when nothing changed) and the changes applied.
        """
        applied: dict[str, Any] = {}
        for rev in self.new_revisions():
            mine = {k: v for k, v in rev.get("changes", {}).items() if LIVE_KEYS.get(k) == self.process}
            if not mine:
                continue
            try:
                spec = validate_spec("rl", with_keys(json.loads(spec.model_dump_json()), mine))
            except SpecError as err:
                logger.error("live config revision %s refused: %s", rev.get("revision"), err)
                continue
            applied.update(mine)
            revision = int(rev["revision"])
            if revision in self.covered:
                logger.info("live config revision %d re-applied on resume: %s", revision, mine)
                continue
            append_jsonl(
                self.run_dir / ACKS_FILE,
                {"revision": revision, "process": self.process, "step": step, "time": time.time()},
            )
            logger.info("live config revision %d in effect from step %d: %s", revision, step, mine)
        return spec, applied
