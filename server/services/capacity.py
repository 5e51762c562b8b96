"""Worker capacity and concurrent-run limits.

Each Celery worker declares what its machine holds when it starts (``publish``: a ``worker_capacity`` row under
its name, ``WORKER_NAME`` or the host name; ``WORKER_CORES`` / ``WORKER_MEMORY_GIB`` / ``WORKER_GPUS`` override
what it detects). A submitted spec must fit at least one declared worker (``check``); with none declared (embedded
mode before its worker started, or tests), the capacity of this machine under the same settings is used.

A launch waits while the run's owner has ``MAX_RUNS_PER_USER`` launched live runs or the launching worker has
``MAX_RUNS_PER_WORKER`` live local ones (``wait_reason``); the run stays ``queued`` with the reason, and
``server.jobs.tasks.start_waiting`` launches the waiting runs, oldest first, when a run ends and on every reconcile.
"""

from __future__ import annotations

import functools
import socket
from typing import Any

from sqlalchemy import func
from sqlmodel import Session, col, select

from server.core.config import settings
from server.core.db import serialize
from server.models import Run, RunStatus, WorkerCapacity, utcnow
from worker.launchers.capacity import Capacity, check, detect
from worker.spec import EvalSpec, RLSpec, SFTSpec, SpecError

LIVE = (RunStatus.starting, RunStatus.running, RunStatus.paused)
WAITING = "waiting for a slot: "
"""Start of the ``status_reason`` of a queued run held back by a concurrency limit."""
WORKER_FULL = f"{WAITING}worker "
"""Start of the reason of a run held back by ``MAX_RUNS_PER_WORKER`` (no later local run starts on that worker either:
``server.jobs.tasks.start_waiting`` stops there)."""


def worker_name() -> str:
    return settings.WORKER_NAME or socket.gethostname()


_detected = functools.cache(detect)
"""The machine does not change while the process runs (``detect`` may start ``nvidia-smi``)."""


def local() -> Capacity:
    """This machine's capacity with the ``WORKER_*`` settings applied."""
    found = _detected()
    return Capacity(
        cores=settings.WORKER_CORES or found.cores,
        memory_gib=settings.WORKER_MEMORY_GIB or found.memory_gib,
        gpus=found.gpus if settings.WORKER_GPUS is None else settings.WORKER_GPUS,
    )


def publish(session: Session, name: str, cap: Capacity) -> None:
    """Record (or replace) worker ``name``'s capacity. Flushes only."""
    row = session.get(WorkerCapacity, name) or WorkerCapacity(name=name, cores=0, memory_gib=0, gpus=0)
    row.cores, row.memory_gib, row.gpus, row.updated_at = cap.cores, cap.memory_gib, cap.gpus, utcnow()
    session.add(row)
    session.flush()


def declared(session: Session) -> list[Capacity]:
    """The capacities workers declared, largest first (GPUs, cores, memory); ``[local()]`` when none did."""
    rows = session.exec(select(WorkerCapacity)).all()
    caps = [Capacity(cores=r.cores, memory_gib=r.memory_gib, gpus=r.gpus) for r in rows]
    return sorted(caps, key=lambda c: (c.gpus, c.cores, c.memory_gib), reverse=True) or [local()]


def check_fits(session: Session, spec: RLSpec | SFTSpec | EvalSpec) -> None:
    """Refuse a spec no declared worker can hold.

    Raises:
        SpecError: the largest worker's reason, e.g. ``trainer.threads: 1000 exceeds the worker's capacity (2 cores,
            7.7 GiB, 0 GPUs): at most 2``.
    """
    errors = []
    for cap in declared(session):
        try:
            check(spec, cap)
            return
        except SpecError as err:
            errors.append(err)
    raise errors[0]


def lock_launches(session: Session) -> None:
    """Serialize launch decisions until the transaction ends (Postgres advisory lock; SQLite writes one at a time),
    so that two workers launching at once cannot both take the last slot."""
    serialize(session, "asyncrl:launches")


def wait_reason(session: Session, run: Run, *, worker: str | None) -> str | None:
    """Why ``run`` may not start now (``waiting for a slot: ...``), None when a slot is free. ``worker``: the
    launching worker for a local run (None for Slurm, whose processes do not run on the worker).

    Runs start in submission (id) order: a free slot goes to the older runs that may take it first, so ``run`` waits
    while the older runs that compete for its slots fill them: every older queued, not launched run of its owner
    (waiting or with its launch task still on its way: submitted at once, the tasks may come in any order) for the
    owner's slots, and on ``worker`` also the older runs of other owners that wait for a slot (not their own limit).
    """
    reason = _limit_reason(session, run, worker)
    if reason is not None:
        return reason
    not_launched = (col(Run.status) == RunStatus.queued.value, col(Run.launcher_handle).is_(None), col(Run.id) < run.id)
    mine = session.exec(select(Run.id).where(*not_launched, Run.owner == run.owner).order_by(col(Run.id))).all()
    if len(mine) >= settings.MAX_RUNS_PER_USER - _live_of(session, run.owner):
        return f"{WAITING}run {mine[0]} of {run.owner} waits for one first"
    if worker is None:
        return None
    full = (
        select(Run.owner)
        .where(col(Run.status).in_([s.value for s in LIVE]), col(Run.launcher).is_not(None))
        .group_by(col(Run.owner))
        .having(func.count() >= settings.MAX_RUNS_PER_USER)
    )
    others = select(Run.id, Run.owner).where(
        *_waiting(), col(Run.id) < run.id, Run.owner != run.owner, col(Run.owner).not_in(full)
    )
    older = sorted([(i, run.owner) for i in mine] + [(i, o) for i, o in session.exec(others).all() if i is not None])
    if older and len(older) >= settings.MAX_RUNS_PER_WORKER - _live_on(session, worker):
        first, owner = older[0]
        return f"{WAITING}run {first} of {owner} waits for one first"
    return None


def _live_of(session: Session, owner: str) -> int:
    """Launched live runs of ``owner`` (what ``MAX_RUNS_PER_USER`` counts)."""
    stmt = (
        select(func.count())
        .select_from(Run)
        .where(col(Run.status).in_([s.value for s in LIVE]), col(Run.launcher).is_not(None), Run.owner == owner)
    )
    return int(session.exec(stmt).one())


def _live_on(session: Session, worker: str) -> int:
    """Live local runs of ``worker`` (what ``MAX_RUNS_PER_WORKER`` counts)."""
    stmt = (
        select(func.count())
        .select_from(Run)
        .where(col(Run.status).in_([s.value for s in LIVE]), Run.launcher == "local", Run.worker == worker)
    )
    return int(session.exec(stmt).one())


def _limit_reason(session: Session, run: Run, worker: str | None) -> str | None:
    n = _live_of(session, run.owner)
    if n >= settings.MAX_RUNS_PER_USER:
        return f"{WAITING}{run.owner} has {n} live runs (MAX_RUNS_PER_USER = {settings.MAX_RUNS_PER_USER})"
    if worker is None:
        return None
    n = _live_on(session, worker)
    if n >= settings.MAX_RUNS_PER_WORKER:
        return f"{WORKER_FULL}{worker} runs {n} live runs (MAX_RUNS_PER_WORKER = {settings.MAX_RUNS_PER_WORKER})"
    return None


def _waiting() -> tuple[Any, ...]:
    """Where-clauses of the queued runs held back by a limit."""
    return (
        col(Run.status) == RunStatus.queued.value,
        col(Run.launcher_handle).is_(None),
        col(Run.status_reason).startswith(WAITING),
    )


def waiting_runs(session: Session) -> list[int]:
    """Ids of queued runs held back by a limit, oldest first."""
    stmt = select(Run.id).where(*_waiting()).order_by(col(Run.id))
    return [i for i in session.exec(stmt).all() if i is not None]
