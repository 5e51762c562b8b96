"""Supervisor of one service-launched run: ``python -m worker.supervisor --home DIR``.

The Celery ``launch_run`` task starts it in its own session (process group) and records its pid. It

- holds an exclusive ``flock`` on ``<home>/supervisor.lock`` for its whole life, so at most one supervisor
  (and one set of run processes) exists per run, and a redelivered launch finds and adopts it;
- runs the run with the local launcher (``worker.launchers.local.launch_rl``), whose processes inherit
  ``ASYNCRL_RUN_ID``, ``ASYNCRL_RUN_TOKEN`` and ``ASYNCRL_SERVER_URL``;
- forwards ``metrics.jsonl`` to ``POST /api/runs/{id}/metrics`` (the file is the spool: while the server is
  down the rows wait there and are sent when it is back; ingestion is idempotent, so a replay adds nothing)
  and reports status changes to ``POST /api/runs/{id}/status``;
- turns SIGTERM (``asyncrl runs stop``) into a clean cancel: the launcher tears its processes down;
- writes its final status to ``<home>/final.json`` (the spool) before reporting it, and retries the report for at
  most ``ASYNCRL_REPORT_TIMEOUT_S`` seconds (default 60): a status the server did not take is delivered later by
  the worker (``worker.tasks.reconcile``, or a redelivered launch), which reads the spool.

``--attempt N`` names the launch attempt (the id of the run event that last queued the run; the launch task passes
it): the spool records it, so a spool of an earlier attempt (before a resume) is never taken for this one's.

``<home>`` is ``<ASYNCRL_OUTPUT_DIR>/runs/<id>``; the run directory is ``<home>/<name>``; the files of the home
folder are named by :class:`worker.rundir.SupervisorHome`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from worker.rundir import SupervisorHome, read_jsonl_after, read_offset

logger = logging.getLogger("asyncrl.supervisor")
REPORT_TIMEOUT_ENV = "ASYNCRL_REPORT_TIMEOUT_S"
REPORT_TIMEOUT_S = 60.0
"""Default bound (seconds) on retrying the final report while the server is unreachable."""


# ----------------------------------------------------------------------------- starting and stopping


def running_pid(home: Path) -> int | None:
    """Pid of the live supervisor holding ``home``'s lock, or None."""
    path = SupervisorHome(home).lock
    if not path.exists():
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = f.read().strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def run_env(run_id: int, token: str, server_url: str) -> dict[str, str]:
    """The variables a supervisor needs: run id, run token (never logged) and the server's URL."""
    return {"ASYNCRL_RUN_ID": str(run_id), "ASYNCRL_RUN_TOKEN": token, "ASYNCRL_SERVER_URL": server_url}


def start(
    home: Path,
    *,
    run_id: int,
    spec: dict[str, Any],
    token: str,
    server_url: str,
    resume: bool = False,
    attempt: int | None = None,
) -> int:
    """Write the spec and start a detached supervisor (``resume``: continue the run directory from its newest
    complete checkpoint; ``attempt``: see the module docstring); returns its pid (= its process group id). A final
    status spooled by an earlier supervisor of ``home`` is removed first."""
    files = SupervisorHome(home)
    files.write_spec(spec)
    files.final.unlink(missing_ok=True)
    env = {**os.environ, **run_env(run_id, token, server_url)}
    with open(files.log, "ab") as log:
        argv = [
            sys.executable,
            "-m",
            "worker.supervisor",
            "--home",
            str(home),
            *(["--resume"] if resume else []),
            *(["--attempt", str(attempt)] if attempt is not None else []),
        ]
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    threading.Thread(target=proc.wait, daemon=True).start()  # reap it if it ends while this process lives
    return proc.pid


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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in {"Z", "X"}


def terminate(pid: int, grace_s: float = 30.0) -> None:
    """SIGTERM the supervisor's process group, wait up to ``grace_s`` for it to end, then SIGKILL it."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ----------------------------------------------------------------------------- talking to the server


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
        return read_jsonl_after(self.path, self.offset)

    def send_once(self) -> int:
        """Send what is pending; returns points sent. Raises httpx errors (the caller retries later)."""
        rows, new_offset = self.pending()
        points = rows_to_points(rows)
        for i in range(0, len(points), self.batch_points):
            batch = points[i : i + self.batch_points]
            # json.dumps writes NaN/Infinity (the server stores them); httpx's json= refuses non-finite floats
            resp = self.client.post(
                f"/api/runs/{self.run_id}/metrics",
                content=json.dumps({"points": batch}),
                headers={"Content-Type": "application/json"},
            )
            resp.raise_for_status()
        if new_offset != self.offset:
            self.offset = new_offset
            self.offset_path.write_text(str(new_offset))
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

        if not (self.run_dir / "config.json").exists():
            return  # the launcher has not created the run directory yet; revisions wait on the server
        last = max((int(r["revision"]) for r in read_revisions(self.run_dir)), default=0)
        resp = self.client.get(f"/api/runs/{self.run_id}/config", params={"after": last})
        resp.raise_for_status()
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
            self.offset_path.write_text(str(end))


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
        self.config = ConfigBridge(client, run_id, run_dir, home.config_acks_offset)
        self.reported_running = False
        self.requeue: dict[str, Any] | None = None
        """A ``requeued`` report still to send (before any metric of the new attempt)."""
        self._done = threading.Event()

    def attempt_events(self) -> list[dict[str, Any]]:
        """Events of ``events.jsonl`` written since the reporter was made (all of them when the file was replaced by
        a shorter one, e.g. a requeued attempt started over); complete lines only."""
        return read_jsonl_after(self.run_dir / "events.jsonl", self.events_offset)[0]

    def status(self, status: str, reason: str = "") -> bool:
        """Report a status; False when the server refuses the transition (409)."""
        resp = self.client.post(f"/api/runs/{self.run_id}/status", json={"status": status, "reason": reason[:2000]})
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
        self.config.sync()

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
        ``worker.tasks.reconcile`` or a redelivered launch."""
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
            self.home.write_final(final)

        def report() -> bool:
            if status == "completed" and not self.reported_running:
                self.reported_running = self.status("running")
            self._send_requeue()
            self.forwarder.send_once()
            self.config.sync()
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
            self.home.write_final({**final, "delivered": True})
        elif status is not None:
            logger.warning("the server refused %s (409); it stays spooled in %s", status, self.home.final)
        return taken


# ----------------------------------------------------------------------------- main


def _last_reason(run_dir: Path) -> str:
    from worker.rundir import read_jsonl

    events = read_jsonl(run_dir / "events.jsonl")
    return str(events[-1].get("reason", "")) if events else ""


_terminated = threading.Event()


def _on_sigterm(_signum: int, _frame: Any) -> None:
    _terminated.set()
    raise KeyboardInterrupt


# ----------------------------------------------------------------------------- inside a Slurm job


def _slurm_attempt() -> int | None:
    """``SLURM_RESTART_COUNT`` (0 on the first attempt) when this supervisor runs as a Slurm job, else None."""
    if os.environ.get("ASYNCRL_LAUNCHER") != "slurm" or "SLURM_JOB_ID" not in os.environ:
        return None
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def _slurm_requeued(attempt: int) -> bool:
    """After SIGTERM: whether Slurm requeued the job (its restart count went past this attempt) rather than
    cancelled it (``scancel`` leaves the count alone)."""
    from worker.launchers.slurm import SlurmError, state

    try:
        current = state(os.environ["SLURM_JOB_ID"])
    except SlurmError as err:
        logger.warning("cannot ask Slurm whether the job was requeued: %s", err)
        return False
    return current is not None and current.restarts > attempt


def _prepare_requeued(run_dir: Path, home: SupervisorHome) -> int | None:
    """A requeued attempt: keep the run directory up to its newest complete checkpoint (returned) or, without one,
    start over; the metrics forwarder replays from the start (ingestion is idempotent)."""
    from worker.checkpoint import resume_step
    from worker.rundir import RunDir

    run = RunDir(run_dir)
    step = resume_step(run) if run.config.exists() else None
    if step is None:
        shutil.rmtree(run.root, ignore_errors=True)
    else:
        run.prune_after(step)
    home.forwarded_offset.unlink(missing_ok=True)
    return step


def _checkpoint_then_requeue(run_dir: Path, wait_s: float) -> None:
    """USR1 (the job's time limit is near): ask trainer and orchestrator for a checkpoint two steps after the
    orchestrator's last step, wait up to ``wait_s`` for it to be complete, then ``scontrol requeue`` the job (the
    next attempt resumes from the newest complete checkpoint)."""
    from worker.checkpoint import complete_steps, request
    from worker.rundir import RunDir, read_jsonl

    run = RunDir(run_dir)
    last = max((r["step"] for r in read_jsonl(run.metrics) if r.get("source") == "orchestrator"), default=0)
    step = last + 2  # the orchestrator may be writing step last + 1 already
    request(run, step)
    logger.info("USR1: checkpoint requested at step %d", step)
    deadline = time.monotonic() + wait_s
    while step not in complete_steps(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    job = os.environ["SLURM_JOB_ID"]
    logger.info(
        "checkpoint step %d %s; requeueing job %s",
        step,
        "complete" if step in complete_steps(run) else "not complete in time",
        job,
    )
    subprocess.run(["scontrol", "requeue", job], check=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.supervisor")
    p.add_argument("--home", type=Path, required=True)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--attempt", type=int, default=None, help="launch attempt, recorded in the final-status spool")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        deadline_s = report_timeout_s()
    except ValueError as err:
        p.error(str(err))
    home = SupervisorHome(args.home)
    lock = open(home.lock, "a+")  # noqa: SIM115 - held open for the life of the process
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        logger.info("another supervisor holds %s; exiting", home.lock)
        return 0
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    signal.signal(signal.SIGTERM, _on_sigterm)

    from worker.spec import RLSpec, SpecError, validate_spec

    run_id = int(os.environ["ASYNCRL_RUN_ID"])
    client = httpx.Client(
        base_url=os.environ["ASYNCRL_SERVER_URL"],
        timeout=30.0,
        headers={"Authorization": f"Bearer {os.environ['ASYNCRL_RUN_TOKEN']}"},
    )
    spec = validate_spec("rl", json.loads(home.spec.read_text()))
    assert isinstance(spec, RLSpec)
    resume, attempt = args.resume, _slurm_attempt()
    requeue: dict[str, Any] | None = None
    if attempt is not None:
        wait_s = max(10.0, spec.launcher.slurm.signal_before_end_s - 10.0)
        signal.signal(
            signal.SIGUSR1,
            lambda *_: threading.Thread(
                target=_checkpoint_then_requeue, args=(spec.run_dir, wait_s), daemon=True
            ).start(),
        )
    if attempt:
        step = _prepare_requeued(spec.run_dir, home)
        resume = step is not None
        requeue = {"restarts": attempt, "resume_step": step, "job": os.environ["SLURM_JOB_ID"]}
        logger.info(
            "Slurm attempt %d of job %s: %s",
            attempt,
            os.environ["SLURM_JOB_ID"],
            f"resuming from checkpoint step {step}" if resume else "no complete checkpoint, starting over",
        )
    # made after _prepare_requeued: what events.jsonl holds now is of earlier attempts
    reporter = Reporter(client, run_id, spec.run_dir, home, attempt=args.attempt)
    reporter.requeue = requeue
    reporter.start()
    try:
        from worker.launchers.local import launch_rl

        summary = launch_rl(spec, resume=resume, quiet=True)
        status, reason = summary["status"], _last_reason(spec.run_dir)
    except SpecError as err:
        status, reason = "failed", f"preflight: {err}"
    except KeyboardInterrupt:
        status, reason = "cancelled", "terminated"
    except Exception as err:  # reported to the server as the failure reason
        status, reason = "failed", f"{type(err).__name__}: {err}"
    if attempt is not None and _terminated.is_set():  # Slurm's SIGTERM: scancel, time limit or requeue
        job = os.environ["SLURM_JOB_ID"]
        requeued = _slurm_requeued(attempt)
        status, reason = (
            (None, f"Slurm job {job} requeued")
            if requeued
            else ("cancelled", f"Slurm job {job} terminated (scancel or time limit)")
        )  # requeued: the next attempt reports
    logger.info("run %d ended %s %s", run_id, status, reason)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    reporter.finish(status, reason, deadline_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
