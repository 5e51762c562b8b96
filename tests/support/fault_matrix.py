"""The cells of the fault matrix (issue 16): one real RL run through a :class:`tests.support.faults.Stack`, and each
process of the run and each service of the stack killed with SIGKILL while it trains.

- Service cells (``worker``, ``api``, ``postgres``, ``redis``): SIGKILL to the service's main process, ``down_s``
  seconds down, a restart on the same port and data; the run must go on with the same processes, and every metric
  point its processes wrote must reach the database once recovered. *Detected*: the first sign of the outage (the
  supervisor's ``server unreachable``, the worker's lost broker connection); *recovered*: all points written so far
  are stored and, for the worker and Redis, a reconcile task ran again.
- Process cells (``trainer``, ``orchestrator``, ``inference``, ``supervisor``): SIGKILL to the process one step after
  a complete checkpoint; the run must be marked ``failed`` (by its supervisor, or by the worker's reconcile for the
  supervisor itself), no process of it may be left, and ``POST /resume`` continues it from the checkpoint.
  *Steps lost*: trainer steps written after that checkpoint (the resumed run trains them again).

For every cell: *points lost* counts metric points of ``metrics.jsonl`` missing in the database or stored with
another value; *points duplicated* counts points written to ``metrics.jsonl`` more than once (the database key is
``(run, source, step, name)``, so a second write is a conflicting measurement). At the end the run must be
``completed`` with the stored points equal to ``metrics.jsonl``: every trainer step once.

Used by ``tests/e2e/service/test_fault_matrix.py`` (asserts) and ``benchmarks/fault_matrix.py`` (writes the table).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.faults import Stack, run_processes, wait_until
from worker.launchers.reporter import rows_to_points
from worker.launchers.supervisor import running_pid
from worker.run.checkpoint import complete_steps
from worker.run.procs import alive
from worker.run.rundir import RunDir, read_jsonl

SERVICES = ("worker", "api", "postgres", "redis")
PROCESSES = ("trainer", "orchestrator", "inference", "supervisor")
Key = tuple[str, int, str]


@dataclass
class Cell:
    """One measured cell (seconds from the SIGKILL; None where there is nothing to measure)."""

    target: str
    fault: str
    detect_s: float | None
    detected_by: str
    recover_s: float
    """Service: restart command -> every point written so far stored (and, for the worker and Redis, a reconcile task
    run). Process: resume request -> the resumed run's first new trainer step stored (a whole launch: vLLM, trainer
    and orchestrator start again)."""
    step_at_kill: int
    steps_lost: int
    points_lost: int
    points_duplicated: int
    processes_left: int
    outcome: str


def _same(a: float, b: float | None) -> bool:
    return b is not None and (a == b or (math.isnan(a) and math.isnan(b)))


class FaultMatrix:
    """One run of ``spec`` on ``stack`` and the cells run on it, in order (see the module docstring)."""

    def __init__(
        self,
        stack: Stack,
        token: str,
        spec: dict[str, Any],
        *,
        down_s: float = 5.0,
        say: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.stack, self.spec, self.down_s, self.say = stack, spec, down_s, say
        self.client = stack.client(token)
        self.cells: list[Cell] = []
        self.run: dict[str, Any] = {}
        self.resume_step = 0
        self.mark = 0
        """Trainer step at the end of the previous cell: the next one waits for new steps after it."""

    # ------------------------------------------------------------------ reading the run

    @property
    def rd(self) -> RunDir:
        return RunDir(self.run["run_dir"])

    @property
    def home(self) -> Path:
        return Path(self.run["run_dir"]).parent

    def api(self) -> dict[str, Any]:
        resp = self.client.get(f"/api/runs/{self.run['id']}")
        resp.raise_for_status()
        return dict(resp.json())

    def status(self) -> str | None:
        """The run's status, None while the API cannot answer."""
        try:
            return str(self.api()["status"])
        except httpx.HTTPError:
            return None

    def trainer_step(self) -> int:
        return max((r["step"] for r in read_jsonl(self.rd.metrics) if r["source"] == "trainer"), default=0)

    def written(self) -> tuple[dict[Key, float], int]:
        """Points of ``metrics.jsonl``: key -> value, and how many points were written in all."""
        points = rows_to_points(read_jsonl(self.rd.metrics))
        return {(p["source"], p["step"], p["name"]): p["value"] for p in points}, len(points)

    def stored(self) -> dict[Key, float | None]:
        rows = self.stack.query("SELECT source, step, name, value FROM metrics WHERE run_id = %s", self.run["id"])
        return {(source, int(step), name): value for source, step, name, value in rows}

    def missing(self, written: dict[Key, float]) -> list[Key]:
        """Keys of ``written`` not stored, or stored with another value."""
        stored = self.stored()
        return [k for k, v in written.items() if not _same(v, stored.get(k, None))]

    def duplicated(self) -> int:
        points = rows_to_points(read_jsonl(self.rd.metrics))
        counts = Counter((p["source"], p["step"], p["name"]) for p in points)
        return sum(n - 1 for n in counts.values())

    def running_event(self) -> dict[str, Any]:
        return [e for e in read_jsonl(self.rd.events) if e["event"] == "running"][-1]

    def events(self) -> list[dict[str, Any]]:
        return list(self.client.get(f"/api/runs/{self.run['id']}/events", params={"limit": 500}).json()["data"])

    # ------------------------------------------------------------------ the run

    def submit(self, timeout: float = 600) -> None:
        """Submit the run and wait until it trains (its first trainer step stored)."""
        resp = self.client.post("/api/runs", json=self.spec)
        assert resp.status_code == 201, resp.text
        self.run = resp.json()
        wait_until(
            lambda: self.status() == "running" and self.trainer_step() >= 1, timeout, "the run training", self.log()
        )
        self.run = self.api()
        self.mark = self.trainer_step()
        self.say(f"run {self.run['id']} training (step {self.mark})")

    def log(self) -> Path:
        return self.home / "supervisor.log"

    def wait_new_steps(self, n: int, timeout: float = 300) -> None:
        wait_until(lambda: self.trainer_step() >= self.mark + n, timeout, f"{n} trainer steps after {self.mark}")

    def finish(self, timeout: float = 900) -> dict[str, Any]:
        """Wait for the run to complete; returns its summary: status, stored vs written points, steps, processes."""
        run = wait_until(
            lambda: (r := self._api_or_none()) and r["status"] in {"completed", "failed", "cancelled"} and r,
            timeout,
            "the run ended",
            self.log(),
        )
        sup = int(run["launcher_handle"])
        wait_until(lambda: running_pid(self.home) is None and not alive(sup), 60, "the supervisor exited")
        left = self._left(sup)
        written, n_written = self.written()
        stored = self.stored()
        steps = sorted(r["step"] for r in read_jsonl(self.rd.metrics) if r["source"] == "trainer")
        return {
            "status": run["status"],
            "reason": run["status_reason"],
            "points_written": n_written,
            "points_stored": len(stored),
            "points_lost": len(self.missing(written)),
            "points_extra": len(set(stored) - set(written)),
            "points_duplicated": n_written - len(written),
            "trainer_steps": steps,
            "processes_left": len(left),
            "statuses": [e["to_status"] for e in self.events() if e["kind"] == "status"],
        }

    def _api_or_none(self) -> dict[str, Any] | None:
        try:
            return self.api()
        except httpx.HTTPError:
            return None

    def _left(self, supervisor_pid: int, timeout: float = 15) -> dict[int, str]:
        """Processes of the run still alive once ``timeout`` passed or none is left."""
        deadline = time.monotonic() + timeout
        while (left := run_processes(self.home, supervisor_pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    # ------------------------------------------------------------------ service cells

    def service_cell(self, name: str) -> Cell:
        """SIGKILL the service ``name`` (one of :data:`SERVICES`) while the run trains, restart it after ``down_s``."""
        st = self.stack
        service = {"worker": st.worker, "api": st.api, "postgres": st.pg, "redis": st.redis}[name]
        self.wait_new_steps(2)
        sup, pids = int(self.run["launcher_handle"]), self.running_event()["pids"]
        step_at_kill = self.trainer_step()
        sup_log, worker_log = self.log(), st.worker.log
        sup_off, worker_off = sup_log.stat().st_size, worker_log.stat().st_size
        signs = {
            "api": (sup_log, sup_off, "server unreachable", "supervisor: server unreachable"),
            "postgres": (sup_log, sup_off, "server unreachable", "supervisor: server unreachable"),
            "redis": (worker_log, worker_off, "Connection to broker lost", "worker: connection to broker lost"),
        }
        t0 = time.monotonic()
        had = service.crash()
        detect_s, detected_by = None, "nothing depends on it mid-run"
        while time.monotonic() < t0 + self.down_s:
            if detect_s is None and name in signs:
                path, offset, text, detected_by = signs[name]
                if text in _read_from(path, offset):
                    detect_s = time.monotonic() - t0
            time.sleep(0.05)
        left = sorted(p for p in had if alive(p))
        service.kill_9()  # what outlived its main process (a finding: counted in processes_left)
        restart_off = worker_log.stat().st_size
        t_up = time.monotonic()
        if name == "worker":
            st.start_worker()
        else:
            service.start()
        if detect_s is None and name in signs:  # seen only once it is back (e.g. the worker reconnecting)
            path, offset, text, detected_by = signs[name]
            if text in _read_from(path, offset):
                detected_by += " (logged at reconnect)"
        written, _ = self.written()

        def recovered() -> bool:
            if name in {"worker", "redis"} and "asyncrl.reconcile" not in _succeeded(worker_log, restart_off):
                return False
            return not self.missing(written)

        try:
            wait_until(recovered, 120, f"{name}: points written before the restart stored")
        except TimeoutError:
            pass
        recover_s = time.monotonic() - t_up
        lost = len(self.missing(written))
        self.wait_new_steps(1 + step_at_kill - self.mark)
        now = self.api()
        same = (
            now["status"] == "running" and int(now["launcher_handle"]) == sup and self.running_event()["pids"] == pids
        )
        self.mark = self.trainer_step()
        cell = Cell(
            target=name,
            fault=f"kill -9, restart after {self.down_s:.0f} s",
            detect_s=_round(detect_s),
            detected_by=detected_by,
            recover_s=round(recover_s, 1),
            step_at_kill=step_at_kill,
            steps_lost=0 if same else -1,
            points_lost=lost,
            points_duplicated=self.duplicated(),
            processes_left=len(left),
            outcome="run went on with the same processes" if same else f"run {now['status']}: processes changed",
        )
        self._record(cell)
        return cell

    # ------------------------------------------------------------------ process cells

    def process_cell(self, name: str) -> Cell:
        """SIGKILL the run's process ``name`` (one of :data:`PROCESSES`) one step after a complete checkpoint newer
        than the last resume, wait for the run to be ``failed`` and for its processes to be gone, resume it."""

        def after_checkpoint() -> bool:
            if self.trainer_step() >= self.spec["max_steps"]:
                raise AssertionError(f"{name}: the run reached max_steps before the cell; give it more steps")
            steps = [s for s in complete_steps(self.rd) if s > self.resume_step]
            return bool(steps) and self.trainer_step() > steps[-1]

        wait_until(after_checkpoint, 300, f"{name}: a trainer step after a new complete checkpoint", self.log())
        sup = int(self.api()["launcher_handle"])
        pid = sup if name == "supervisor" else int(self.running_event()["pids"][name])
        step_at_kill = self.trainer_step()
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        failed = wait_until(
            lambda: (r := self._api_or_none()) and r["status"] in {"failed", "completed", "cancelled"} and r,
            120,
            f"{name}: the run marked ended",
            self.log(),
        )
        detect_s = time.monotonic() - t0
        assert failed["status"] == "failed", failed
        by = "worker reconcile" if name == "supervisor" else "supervisor"
        reason = short(str(failed["status_reason"]))
        wait_until(lambda: running_pid(self.home) is None and not alive(sup), 60, f"{name}: the supervisor exited")
        left = self._left(sup)
        last = self.trainer_step()
        t_resume = time.monotonic()
        resp = self.client.post(f"/api/runs/{self.run['id']}/resume")
        assert resp.status_code == 200, resp.text
        self.resume_step = [e for e in self.events() if e["kind"] == "resumed"][-1]["data"]["step"]
        back = self.resume_step

        def trained_again() -> bool:
            steps = self.stack.query(
                "SELECT max(step) FROM metrics WHERE run_id = %s AND source = 'trainer'", self.run["id"]
            )
            return self.status() == "running" and (steps[0][0] or 0) > back

        wait_until(trained_again, 600, f"{name}: the resumed run training", self.log())
        recover_s = time.monotonic() - t_resume
        written, _ = self.written()
        lost = len(self.missing({k: v for k, v in written.items() if k[1] <= back}))
        self.run = self.api()
        self.mark = self.trainer_step()
        cell = Cell(
            target=name,
            fault="kill -9, then resume",
            detect_s=_round(detect_s),
            detected_by=f"{by}: {reason}",
            recover_s=round(recover_s, 1),
            step_at_kill=step_at_kill,
            steps_lost=last - back,
            points_lost=lost,
            points_duplicated=self.duplicated(),
            processes_left=len(left),
            outcome=f"run failed; resumed from checkpoint step {back}",
        )
        self._record(cell)
        return cell

    def _record(self, cell: Cell) -> None:
        self.cells.append(cell)
        self.say(str(asdict(cell)))


def short(reason: str) -> str:
    """A failure reason without the log path and the log lines it quotes."""
    return reason.splitlines()[0].split(" (log: ")[0].split("; last lines")[0][:100]


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _read_from(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _succeeded(log: Path, offset: int) -> str:
    """Lines of a Celery worker log after ``offset`` that say a task succeeded."""
    return "\n".join(line for line in _read_from(log, offset).splitlines() if "succeeded in" in line)


def table(cells: list[Cell], final: dict[str, Any]) -> str:
    """The README's fault-matrix table (markdown) from measured cells and the run's end."""

    def s(x: float | None) -> str:
        return "—" if x is None else f"{x:.1f} s" if x >= 1 else f"{x * 1000:.0f} ms"

    lines = [
        "| killed | fault | time to detect (by) | recovered in | steps lost | points lost / duplicated | processes left | outcome |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c.target} | {c.fault} | {s(c.detect_s)} ({short(c.detected_by)}) | {s(c.recover_s)} | {c.steps_lost} | "
            f"{c.points_lost} / {c.points_duplicated} | {c.processes_left} | {c.outcome} |"
        )
    steps = final["trainer_steps"]
    lines.append(
        f"| (the run, at its end) | — | — | — | — | {final['points_lost']} / {final['points_duplicated']} "
        f"({final['points_stored']} stored = {final['points_written']} written) | {final['processes_left']} | "
        f"{final['status']}: trainer steps 1–{steps[-1] if steps else 0}, each once |"
    )
    return "\n".join(lines)
