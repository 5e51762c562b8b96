"""Progress of a run's processes and the hang watchdog that reads it.

Every run process keeps one progress record, ``<run_dir>/progress/<process>.json`` (:class:`ProgressRecorder`,
written atomically by a background thread every :data:`HEARTBEAT_S` seconds)::

    {"process": "orchestrator", "pid": 4242, "started": <first record, unix s>, "time": <heartbeat, unix s>,
     "progress_time": <last progress, unix s>,
     "counts": {"rollout_groups": 37, "batches": 3},            # what it has done so far
     "state": "waiting_for_policy", "state_since": <unix s>, "detail": {"version": 3},
     "calls": {"inference": {"in_flight": 4, "since": <oldest start, unix s>, "what": "POST /v1/completions"},
               "environment": {"in_flight": 2, "since": <unix s>, "what": "score"}}}

Progress is what moves a run forward: a trainer step, a rollout group scored, a batch written, an eval group done.
The inference server (vLLM) writes no record: it is seen through the orchestrator's calls to it and through a
``/health`` probe of the watchdog.

Who decides: the **supervisor** (the launcher's follow loop, ``worker.launchers.local``, which a service run's
supervisor runs; a local ``asyncrl rl`` runs the same loop). It is beside the run and sees the processes' records and
the inference server; the service sees only reports, so it gets the decision as a ``stalled`` engine event (forwarded
by ``worker.launchers.reporter``), fires the alert rules on it and, with ``watchdog.on_stall = "stop" | "restart"``,
stops or restarts the run through its normal stop and resume paths. (The service's own ``stall`` alert rule, "no metric
for N seconds", still covers a supervisor that is gone.)

:func:`classify` names the stalled component from the records alone (pure; unit-tested with hand-built records);
:class:`Watchdog` keeps the episode (one ``stalled`` event per episode, a ``progress_resumed`` event when progress
comes back).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from worker.run.rundir import atomic_write_text

HEARTBEAT_S = 1.0
"""Seconds between two writes of a process's progress record."""
NO_PROGRESS_FLOOR_S = 120.0
"""The least no-progress time derived from a run's step times (``watchdog.no_progress_s`` unset), in seconds."""
NO_PROGRESS_STEP_FACTOR = 10.0
"""A derived no-progress time is this many times the median trainer ``step_time_s`` (at least the floor)."""
PROGRESS_DIR = "progress"

Component = Literal["inference", "environment", "trainer", "orchestrator", "unknown"]
CallKind = Literal["inference", "environment"]


# ----------------------------------------------------------------------------- writing (run processes)


class ProgressRecorder:
    """The progress record of one process. Thread-safe; the asyncio code of the orchestrator and the trainer's loop
    call :meth:`tick`, :meth:`state` and :meth:`call`; a daemon thread writes the record every ``interval_s``.

    Nothing is written until :meth:`start` (``asyncrl eval`` and unit tests use the module's recorder unstarted).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.path: Path | None = None
        self.process = ""
        now = time.time()
        self.progress_time = self.started = now
        self.counts: dict[str, int] = {}
        self._state, self._state_since = "starting", now
        self._detail: dict[str, Any] = {}
        self._calls: dict[int, tuple[CallKind, str, float]] = {}
        self._next_call = 0
        self._stop = threading.Event()

    def start(self, run_dir: Path, process: str, interval_s: float = HEARTBEAT_S) -> None:
        """Write ``<run_dir>/progress/<process>.json`` now and every ``interval_s`` seconds from a daemon thread."""
        self.path, self.process = Path(run_dir) / PROGRESS_DIR / f"{process}.json", process
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.progress_time = self.started = time.time()
        self.write()

        def beat() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.write()
                except OSError:  # a full disk: the heartbeat stops, which the watchdog then reports
                    pass

        threading.Thread(target=beat, daemon=True, name="progress").start()

    def stop(self) -> None:
        self._stop.set()

    def finish(self) -> None:
        """The process is done (its main returned): write a last record in state ``exiting`` and stop the heartbeat.
        Interpreter shutdown (torch, the event loop, the HTTP pools) can outlast a no-progress time on a loaded
        machine while no thread writes the record; the watchdog takes ``exiting`` for what it is, not for frozen."""
        self.state("exiting")
        self._stop.set()
        try:
            self.write()
        except OSError:  # a full disk: the process ends anyway, and its exit code says how
            pass

    def tick(self, what: str, n: int = 1) -> None:
        """``n`` more of ``what`` done (``steps``, ``rollout_groups``, ``batches``, ``eval_groups``): progress."""
        with self._lock:
            self.counts[what] = self.counts.get(what, 0) + n
            self.progress_time = time.time()

    def state(self, state: str, **detail: Any) -> None:
        """What the process does now (``waiting_for_batch`` with ``step``, ``waiting_for_policy`` with ``version``,
        ``generating``, ``training``, ``eval``...); not progress by itself."""
        with self._lock:
            if (state, detail) != (self._state, self._detail):
                self._state, self._state_since, self._detail = state, time.time(), detail

    @contextmanager
    def call(self, kind: CallKind, what: str) -> Iterator[None]:
        """A call to inference or to the environment in flight for the body's duration."""
        with self._lock:
            key = self._next_call
            self._next_call += 1
            self._calls[key] = (kind, what, time.time())
        try:
            yield
        finally:
            with self._lock:
                self._calls.pop(key, None)

    def snapshot(self) -> dict[str, Any]:
        """The record as it would be written now."""
        with self._lock:
            calls: dict[str, dict[str, Any]] = {}
            for kind, what, since in self._calls.values():
                c = calls.setdefault(kind, {"in_flight": 0, "since": since, "what": what})
                c["in_flight"] += 1
                if since < c["since"]:
                    c["since"], c["what"] = since, what
            return {
                "process": self.process,
                "pid": os.getpid(),
                "started": self.started,
                "time": time.time(),
                "progress_time": self.progress_time,
                "counts": dict(self.counts),
                "state": self._state,
                "state_since": self._state_since,
                "detail": dict(self._detail),
                "calls": calls,
            }

    def write(self) -> None:
        """Write the record now (atomically); nothing before :meth:`start`.

        Raises:
            OSError: it cannot be written (``DiskFull`` on a full filesystem).
        """
        if self.path is not None:
            atomic_write_text(self.path, json.dumps(self.snapshot()))


recorder = ProgressRecorder()
"""This process's progress record (one per process: the trainer's or the orchestrator's)."""


def read_records(run_dir: Path) -> dict[str, dict[str, Any]]:
    """``{process: record}`` of every readable record in ``<run_dir>/progress/`` (a torn or missing one is left out)."""
    found: dict[str, dict[str, Any]] = {}
    folder = Path(run_dir) / PROGRESS_DIR
    if not folder.is_dir():
        return found
    for path in folder.glob("*.json"):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("process"), str):
            found[rec["process"]] = rec
    return found


# ----------------------------------------------------------------------------- deciding (the supervisor)


@dataclass(frozen=True)
class Stall:
    """What the watchdog found: the run made no progress for ``quiet_s`` seconds (``no_progress_s`` allowed)."""

    component: Component
    """The stalled component: what the others wait on."""
    waiting: str
    """The process that waits (``orchestrator``, ``trainer``) or ``""``."""
    reason: str
    """One line: who waits on what, since when."""
    quiet_s: float
    no_progress_s: float

    def event(self) -> dict[str, Any]:
        """The fields of the ``stalled`` event (``events.jsonl``)."""
        return {
            "process": "supervisor",
            "component": self.component,
            "waiting": self.waiting,
            "quiet_s": round(self.quiet_s, 1),
            "no_progress_s": round(self.no_progress_s, 1),
            "reason": self.reason,
        }


def last_progress(records: Mapping[str, Mapping[str, Any]], started: float) -> float:
    """The newest ``progress_time`` or ``started`` (a process's first record: its start-up is over) of ``records``, or
    ``started`` (the run's start) if later or there is none."""
    times = [
        float(r[key])
        for r in records.values()
        for key in ("progress_time", "started")
        if isinstance(r.get(key), int | float)
    ]
    return max([started, *times])


def classify(
    records: Mapping[str, Mapping[str, Any]],
    *,
    now: float,
    started: float,
    no_progress_s: float,
    inference_answers: bool | None = None,
    alive: Collection[str] | None = None,
) -> Stall | None:
    """Whether the run is stalled, and on what. None while some record made progress within ``no_progress_s`` of
    ``now`` (or the run started since, ``started``). Otherwise the first that applies, in this order:

    1. a process whose record (heartbeat) is older than ``no_progress_s``: that process is frozen (``trainer`` /
       ``orchestrator``);
    2. ``inference_answers`` is False (the watchdog's ``/health`` probe got no answer), or the orchestrator has had
       an inference request in flight for more than half of ``no_progress_s``: ``inference`` (the orchestrator waits
       on it);
    3. an environment call (reward, env turn) in flight for more than half of ``no_progress_s``: ``environment``.
       Half: the call that hangs may have started a little after the last progress (the next group's scoring), and a
       healthy call does not last half a no-progress time;
    4. the trainer waits for a batch: ``orchestrator``; the orchestrator waits for a policy version: ``trainer``;
    5. else ``unknown``, with each process's state.

    No verdict either while a process of ``alive`` has written no record yet: it is starting (loading the model,
    importing torch), which ``inference.startup_timeout_s`` and the process's own exit bound, not the watchdog; and
    while one's record still says ``starting`` (waiting for the server, the warm-up, a resume's weight load) only
    rules 1-3 apply: the other process waiting for it is no stall of its own; nor while the trainer's says ``held``
    (a ``ckpt.hold_at`` step: the run waits to be stopped). A record in state ``exiting`` (its
    main returned; :meth:`ProgressRecorder.finish`) is never frozen: the interpreter's shutdown writes no heartbeat.

    Args:
        records: ``{process: progress record}`` (:func:`read_records`).
        now, started: unix seconds.
        no_progress_s: seconds without progress that make a stall (> 0).
        inference_answers: the inference probe's answer (None: not probed).
        alive: the processes still running (None: all that wrote a record); the record of one that exited (the
            trainer after its last step, while the final eval runs) is old without anything being frozen.
    """
    quiet = now - last_progress(records, started)
    if quiet <= no_progress_s or any(
        name in (alive or ()) and name not in records for name in ("trainer", "orchestrator")
    ):
        return None

    def stall(component: Component, waiting: str, reason: str) -> Stall:
        return Stall(component, waiting, f"no progress for {quiet:.0f} s: {reason}", quiet, no_progress_s)

    for name in ("trainer", "orchestrator"):
        rec = records.get(name)
        if alive is not None and name not in alive:
            continue
        if rec is not None and rec.get("state") != "exiting" and now - float(rec.get("time", 0.0)) > no_progress_s:
            return stall(
                name,
                "",
                f"{name} (pid {rec.get('pid')}) has not written its progress for {now - float(rec['time']):.0f} s "
                "(frozen or stopped)",
            )
    orch = records.get("orchestrator", {})
    calls: Mapping[str, Mapping[str, Any]] = orch.get("calls") or {}
    inf = calls.get("inference")
    inf_age = now - float(inf["since"]) if inf else 0.0
    if inference_answers is False or (inf and inf_age > no_progress_s / 2):
        what = (
            f"{inf['in_flight']} request(s) in flight, the oldest ({inf['what']}) for {inf_age:.0f} s"
            if inf
            else "no request in flight"
        )
        probe = "; its /health does not answer" if inference_answers is False else ""
        return stall("inference", "orchestrator", f"inference not answering: orchestrator waits, {what}{probe}")
    env = calls.get("environment")
    if env and now - float(env["since"]) > no_progress_s / 2:
        return stall(
            "environment",
            "orchestrator",
            f"environment stuck: {env['in_flight']} call(s) in flight, the oldest ({env['what']}) for "
            f"{now - float(env['since']):.0f} s",
        )
    trainer = records.get("trainer", {})
    if any(r.get("state") == "starting" for r in (trainer, orch)):
        return None  # the other one waits for it to start: bounded by the start-up timeouts, not a stall
    if trainer.get("state") == "held":
        return None  # at a ckpt.hold_at step, its checkpoint complete: it waits to be stopped, by design
    if trainer.get("state") == "waiting_for_batch":
        step = (trainer.get("detail") or {}).get("step")
        return stall(
            "orchestrator",
            "trainer",
            f"trainer waiting for batch {step} for {now - float(trainer['state_since']):.0f} s; orchestrator "
            f"{orch.get('state', 'has no record')}",
        )
    if orch.get("state") == "waiting_for_policy":
        version = (orch.get("detail") or {}).get("version")
        return stall(
            "trainer",
            "orchestrator",
            f"orchestrator waiting for policy version {version} for {now - float(orch['state_since']):.0f} s; "
            f"trainer {trainer.get('state', 'has no record')}",
        )
    states = ", ".join(f"{n} {r.get('state')}" for n, r in sorted(records.items())) or "no process wrote a record"
    return stall("unknown", "", states)


def derived_no_progress_s(step_times: list[float]) -> float:
    """The no-progress time of a run with ``watchdog.no_progress_s`` unset: ``NO_PROGRESS_STEP_FACTOR`` times the
    median of its trainer ``step_time_s`` so far (seconds), at least ``NO_PROGRESS_FLOOR_S``."""
    if not step_times:
        return NO_PROGRESS_FLOOR_S
    return max(NO_PROGRESS_FLOOR_S, NO_PROGRESS_STEP_FACTOR * statistics.median(step_times))


class Watchdog:
    """The supervisor's episode keeper over :func:`classify`: :meth:`check` returns the event to write, if any:
    ``("stalled", fields)`` once when a stall starts, ``("progress_resumed", fields)`` when progress comes back after
    one."""

    def __init__(self, run_dir: Path, *, no_progress_s: float | None, started: float | None = None) -> None:
        self.run_dir, self.fixed_s = Path(run_dir), no_progress_s
        self.started = time.time() if started is None else started
        self.stalled: Stall | None = None

    def no_progress_s(self, step_times: list[float]) -> float:
        return self.fixed_s if self.fixed_s is not None else derived_no_progress_s(step_times)

    def check(
        self,
        *,
        now: float,
        step_times: list[float],
        inference_answers: bool | None = None,
        alive: Collection[str] | None = None,
    ) -> tuple[str, dict[str, Any]] | None:
        records = read_records(self.run_dir)
        limit = self.no_progress_s(step_times)
        found = classify(
            records,
            now=now,
            started=self.started,
            no_progress_s=limit,
            inference_answers=inference_answers,
            alive=alive,
        )
        if found is not None and self.stalled is None:
            self.stalled = found
            return "stalled", found.event()
        if found is None and self.stalled is not None:
            before, self.stalled = self.stalled, None
            return "progress_resumed", {
                "process": "supervisor",
                "component": before.component,
                "reason": f"progress again after the {before.component} stall",
            }
        return None

    def needs_probe(self, now: float, step_times: list[float]) -> bool:
        """Whether the run has been quiet for ``no_progress_s`` (then the inference probe is worth its request)."""
        quiet = now - last_progress(read_records(self.run_dir), self.started)
        return quiet > self.no_progress_s(step_times)
