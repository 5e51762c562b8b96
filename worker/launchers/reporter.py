"""What a run's supervisor tells the server, over HTTP only (``/api/runs/{id}/...`` with the run token).

- :class:`MetricsForwarder` sends new lines of ``metrics.jsonl`` to ``POST /api/runs/{id}/metrics``. The file is the
  spool: while the server is down the rows wait there and are sent when it is back; ingestion is idempotent, so a
  replay adds nothing. The byte offset sent so far is kept in ``<home>/forwarded.offset``.
- :class:`EventsForwarder` sends the run processes' events of ``events.jsonl`` that people need to see
  (:data:`worker.run.rundir.ENGINE_EVENTS`: ``disk_full``, ``truncated``, ``policy_check_failed``) to
  ``POST /api/runs/{id}/events``; its offset is kept in ``<home>/events.offset`` and the server records an event
  once (its kind and time are its key).
- :class:`ConfigBridge` carries live config: new revisions from the server into ``live_config.jsonl``, and the
  processes' acks from ``config_acks.jsonl`` back to the server.
- :class:`Reporter` runs both in a background thread, reports ``running`` and status changes to
  ``POST /api/runs/{id}/status``, and at the end spools the final status in ``<home>/final.json`` before reporting
  it, retrying for at most ``ASYNCRL_REPORT_TIMEOUT_S`` seconds (default 60): a status the server did not take is
  delivered later by the worker (``server.jobs.tasks.reconcile``, or a redelivered launch), which reads the spool.

A full disk does not stop the reporting: an offset that cannot be saved stays in memory (a restarted supervisor
sends again from the last saved one; the server ignores what it has), and a final status that cannot be spooled is
still reported.

In a root worker's Slurm job the supervisor is root and the run directory its run's uid's: every read or write of it
here is done as that uid (``worker.run.procs.run_user_files``); the offsets and the spool, in the worker's home
folder, as root.

Nothing here imports the server: the API is the only contract.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from worker.run.procs import run_user_files
from worker.run.rundir import ENGINE_EVENTS, SupervisorHome, atomic_write_text, read_jsonl_after, read_offset

logger = logging.getLogger("asyncrl.supervisor")
REPORT_TIMEOUT_ENV = "ASYNCRL_REPORT_TIMEOUT_S"
REPORT_TIMEOUT_S = 60.0
"""Default bound (seconds) on retrying the final report while the server is unreachable."""


def report_timeout_s(environ: dict[str, str] | None = None) -> float:
    """``ASYNCRL_REPORT_TIMEOUT_S`` (seconds, > 0), default :data:`REPORT_TIMEOUT_S`.

    Raises:
        ValueError: not a positive number (the message names the variable).
    """
    raw = (os.environ if environ is None else environ).get(REPORT_TIMEOUT_ENV, "")
    if not raw:
        return REPORT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{REPORT_TIMEOUT_ENV}: expected a positive number of seconds, got {raw!r}")
    return value


def rows_to_points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``metrics.jsonl`` rows ``{"source", "step", "time", <name>: value}`` → API points (numbers only)."""
    points = []
    for row in rows:
        for name, value in row.items():
            if name in {"source", "step", "time"} or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            points.append(
                {
                    "source": row["source"],
                    "step": row["step"],
                    "name": name,
                    "value": float(value),
                    "time": row.get("time", 0.0),
                }
            )
    return points


def save_offset(path: Path, offset: int) -> None:
    """Keep the byte offset a forwarder has sent up to (atomically: a failed write leaves the previous value); a
    failure to write it (a full disk) is logged, not raised: the offset stays in memory and a restarted supervisor
    sends again from the saved one, which the server ignores (ingestion is idempotent)."""
    try:
        atomic_write_text(path, str(offset))
    except OSError as err:
        logger.warning("could not save the offset %d in %s: %s", offset, path, err)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (the server stores JSON, which has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def row_to_event(row: dict[str, Any]) -> dict[str, Any]:
    """An ``events.jsonl`` line ``{"time", "event", "reason", "process"?, <field>: value}`` → the API's engine event
    ``{"event", "time", "reason", "process", "data": {<field>: value}}``."""
    data = {k: v for k, v in row.items() if k not in {"event", "time", "reason", "process"}}
    time_s = row.get("time")
    return {
        "event": row["event"],
        "time": float(time_s) if isinstance(time_s, int | float) and math.isfinite(time_s) else 0.0,
        "reason": str(row.get("reason", ""))[:2000],
        "process": str(row["process"])[:32] if row.get("process") else None,
        "data": _finite(data),
    }


class EventsForwarder:
    """Send the engine events (:data:`worker.run.rundir.ENGINE_EVENTS`) among the new complete lines of
    ``events.jsonl`` to the server; the byte offset read so far is kept in ``offset_path``. An event sent twice (a
    restart between the post and the offset) is recorded once: the server keys it by kind and time. A batch the
    server refuses as invalid (422) is logged and skipped, so one bad line cannot hold back the later ones."""

    def __init__(
        self, client: httpx.Client, run_id: int, events_path: Path, offset_path: Path, batch_events: int = 200
    ) -> None:
        self.client, self.run_id, self.path, self.offset_path = client, run_id, events_path, offset_path
        self.batch_events = batch_events
        self.offset = read_offset(offset_path)

    def send_once(self) -> int:
        """Send the engine events written since the offset; returns how many were sent. Raises httpx errors (the
        caller retries later; the offset moves only after every batch was answered)."""
        with run_user_files():
            rows, new_offset = read_jsonl_after(self.path, self.offset)
        events = [row_to_event(r) for r in rows if r.get("event") in ENGINE_EVENTS]
        for i in range(0, len(events), self.batch_events):
            batch = events[i : i + self.batch_events]
            resp = self.client.post(f"/api/runs/{self.run_id}/events", json={"events": batch})
            if resp.status_code == 422:
                logger.warning("engine events refused: %s %s", resp.status_code, resp.text[:300])
            else:
                resp.raise_for_status()
        if new_offset != self.offset:
            self.offset = new_offset
            save_offset(self.offset_path, new_offset)
        return len(events)


class MetricsForwarder:
    """Send new complete lines of ``metrics.jsonl`` to the server; the byte offset sent so far is kept in
    ``offset_path`` so a restarted supervisor resumes where it stopped."""

    def __init__(
        self, client: httpx.Client, run_id: int, metrics_path: Path, offset_path: Path, batch_points: int = 5000
    ) -> None:
        self.client, self.run_id, self.path, self.offset_path = client, run_id, metrics_path, offset_path
        self.batch_points = batch_points
        self.offset = read_offset(offset_path)

    def pending(self) -> tuple[list[dict[str, Any]], int]:
        """Rows after the offset (complete lines only) and the offset after them."""
        with run_user_files():
            return read_jsonl_after(self.path, self.offset)

    def send_once(self) -> int:
        """Send what is pending; returns points sent. A batch the server finds too large (413: more points or bytes
        than it takes in one request, e.g. the backlog after an outage or a resume's replay) is sent again in halves,
        and later batches are no larger. Raises httpx errors (the caller retries later)."""
        rows, new_offset = self.pending()
        points = rows_to_points(rows)
        i = 0
        while i < len(points):
            batch = points[i : i + self.batch_points]
            # json.dumps writes NaN/Infinity (the server stores them); httpx's json= refuses non-finite floats
            resp = self.client.post(
                f"/api/runs/{self.run_id}/metrics",
                content=json.dumps({"points": batch}),
                headers={"Content-Type": "application/json"},
            )
            if resp.status_code == 413 and len(batch) > 1:
                self.batch_points = len(batch) // 2
                logger.info(
                    "server took no batch of %d metric points; sending %d at once", len(batch), self.batch_points
                )
                continue
            resp.raise_for_status()
            i += len(batch)
        if new_offset != self.offset:
            self.offset = new_offset
            save_offset(self.offset_path, new_offset)
        return len(points)


class ConfigBridge:
    """Live config between the server and the run directory (the processes never talk to the server).

    ``sync()`` appends revisions the server has after the newest one in ``live_config.jsonl`` (so none is
    missed or written twice), then posts the new lines of ``config_acks.jsonl``; the byte offset of acks sent is
    kept in ``offset_path``, like :class:`MetricsForwarder`'s, once the new acks are all posted (acks are
    idempotent, so the replay after a failure part-way is harmless). An ack the server refuses with 404/422 (e.g. a
    revision written by ``asyncrl config set``, unknown to the server) is logged and skipped.
    """

    def __init__(self, client: httpx.Client, run_id: int, run_dir: Path, offset_path: Path) -> None:
        self.client, self.run_id, self.run_dir, self.offset_path = client, run_id, run_dir, offset_path
        self.offset = read_offset(offset_path)

    def sync(self) -> None:
        """One round trip each way. Raises httpx errors (the caller retries later; nothing is lost)."""
        from worker.live_config import ACKS_FILE, append_revision, read_revisions

        with run_user_files():
            if not (self.run_dir / "config.json").exists():
                return  # the launcher has not created the run directory yet; revisions wait on the server
            last = max((int(r["revision"]) for r in read_revisions(self.run_dir)), default=0)
        resp = self.client.get(f"/api/runs/{self.run_id}/config", params={"after": last})
        resp.raise_for_status()
        with run_user_files():
            for rev in resp.json()["data"]:
                append_revision(self.run_dir, rev["revision"], rev["changes"])
            acks, end = read_jsonl_after(self.run_dir / ACKS_FILE, self.offset)
        for ack in acks:
            resp = self.client.post(
                f"/api/runs/{self.run_id}/config/{ack['revision']}/ack",
                json={"process": ack["process"], "step": ack["step"]},
            )
            if resp.status_code in (404, 422):
                logger.warning("config ack %s refused: %s %s", ack, resp.status_code, resp.text[:300])
            else:
                resp.raise_for_status()
        if end != self.offset:
            self.offset = end
            save_offset(self.offset_path, end)


class Reporter(threading.Thread):
    """Background loop: forward metrics and the ``running`` event every ``interval_s``, backing off while
    the server is unreachable. ``finish()`` spools, flushes and reports the final status (retrying for a while).

    Only events of this attempt count: ``events.jsonl`` is append-only and keeps the events of earlier attempts
    (a resumed run's has their ``running``), so the reporter reads it from ``events_offset``, its size in bytes
    when the reporter was made (make it once the run directory is ready for this attempt, before the launcher
    starts).
    """

    def __init__(
        self,
        client: httpx.Client,
        run_id: int,
        run_dir: Path,
        home: SupervisorHome,
        interval_s: float = 1.0,
        attempt: int | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.client, self.run_id, self.run_dir, self.interval_s = client, run_id, run_dir, interval_s
        self.home, self.attempt = home, attempt
        events = run_dir / "events.jsonl"
        self.events_offset = events.stat().st_size if events.exists() else 0
        self.forwarder = MetricsForwarder(client, run_id, run_dir / "metrics.jsonl", home.forwarded_offset)
        self.events = EventsForwarder(client, run_id, events, home.events_offset)
        self.config = ConfigBridge(client, run_id, run_dir, home.config_acks_offset)
        self.reported_running = False
        self.requeue: dict[str, Any] | None = None
        """A ``requeued`` report still to send (before any metric of the new attempt)."""
        self._done = threading.Event()

    def attempt_events(self) -> list[dict[str, Any]]:
        """Events of ``events.jsonl`` written since the reporter was made (all of them when the file was replaced by
        a shorter one, e.g. a requeued attempt started over); complete lines only."""
        with run_user_files():
            return read_jsonl_after(self.run_dir / "events.jsonl", self.events_offset)[0]

    def status(self, status: str, reason: str = "") -> bool:
        """Report a status; False when the server refuses the transition (409), or the run token because the
        run has ended (401, e.g. it was stopped: its token no longer writes)."""
        resp = self.client.post(f"/api/runs/{self.run_id}/status", json={"status": status, "reason": reason[:2000]})
        if resp.status_code == 401:  # the run has ended (its token no longer writes): retrying cannot help
            logger.warning("status %s refused: %s", status, resp.text[:300])
            return False
        if resp.status_code == 409:  # a later state (e.g. cancelled by stop), or still queued (launch not committed)
            return False
        resp.raise_for_status()
        return True

    def _send_requeue(self) -> None:
        if self.requeue is not None:
            resp = self.client.post(f"/api/runs/{self.run_id}/requeued", json=self.requeue)
            if resp.status_code == 409:  # the run ended meanwhile (e.g. stopped): nothing to continue
                logger.warning("requeued report refused: %s", resp.text[:300])
            else:
                resp.raise_for_status()
            self.requeue = None

    def _tick(self) -> None:
        self._send_requeue()
        if not self.reported_running and any(e.get("event") == "running" for e in self.attempt_events()):
            # refused while the run is still queued: a redelivered launch adopts this supervisor later
            self.reported_running = self.status("running")
        self.forwarder.send_once()
        self.events.send_once()
        self._sync_config()

    def _sync_config(self) -> None:
        """``ConfigBridge.sync``; a revision that cannot be written into the run directory (a full disk) is logged and
        fetched again next time (httpx errors are raised as before)."""
        try:
            self.config.sync()
        except OSError as err:
            logger.warning("live config: %s; retrying later", err)

    def run(self) -> None:
        backoff = self.interval_s
        while not self._done.wait(backoff):
            try:
                self._tick()
                backoff = self.interval_s
            except httpx.HTTPError as err:
                backoff = min(backoff * 2, 30.0)
                logger.warning(
                    "server unreachable (%s); metrics and config acks stay spooled in %s, retry in %.0fs",
                    err,
                    self.forwarder.path,
                    backoff,
                )

    def finish(self, status: str | None, reason: str, deadline_s: float = REPORT_TIMEOUT_S) -> bool:
        """Spool ``status`` in ``home/final.json``, send what is pending, then report ``status`` (None: report no
        status, e.g. a requeued Slurm job). Retries with exponential backoff (1 s doubling, at most 10 s apart)
        while the server is unreachable or answers an error other than 409, for at most ``deadline_s`` seconds; returns whether the
        server took the status (the spool then says ``"delivered": true``). A status not taken stays spooled for
        ``server.jobs.tasks.reconcile`` or a redelivered launch."""
        from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

        self._done.set()
        if self.is_alive():
            self.join()
        final = {
            "status": status,
            "reason": reason[:2000],
            "attempt": self.attempt,
            "pid": os.getpid(),
            "time": time.time(),
            "delivered": False,
        }
        if status is not None:
            self._spool(final)

        def report() -> bool:
            if status == "completed" and not self.reported_running:
                self.reported_running = self.status("running")
            self._send_requeue()
            self.forwarder.send_once()
            self.events.send_once()  # before the final status: then the run token no longer writes
            self._sync_config()
            return self.status(status, reason) if status is not None else False

        try:
            taken = Retrying(
                stop=stop_after_delay(deadline_s),
                wait=wait_exponential(multiplier=1, max=10),
                retry=retry_if_exception_type(httpx.HTTPError),
                reraise=True,
                before_sleep=lambda rs: logger.warning(
                    "final report: %s; retrying", rs.outcome.exception() if rs.outcome else "?"
                ),
            )(report)
        except httpx.HTTPError as err:
            logger.error(
                "could not report %s to the server within %.0fs (%s); spooled in %s for the worker",
                status,
                deadline_s,
                err,
                self.home.final,
            )
            return False
        if taken:
            self._spool({**final, "delivered": True})
        elif status is not None:
            logger.warning("the server refused %s (409); it stays spooled in %s", status, self.home.final)
        return taken

    def _spool(self, final: dict[str, Any]) -> None:
        """Spool ``final`` in ``home/final.json``; a failure (a full disk) is logged: the status is still reported."""
        try:
            self.home.write_final(final)
        except OSError as err:
            logger.error("could not spool the final status in %s (%s); reporting it anyway", self.home.final, err)
