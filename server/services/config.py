"""Live config revisions of a run: create (validated, numbered per run), list, acknowledge.

The whitelist and value checks live in ``worker/live_config.py`` (shared with ``asyncrl config set``); here
they run against the run's stored spec with every earlier revision applied. The run's row lock
(``SELECT … FOR UPDATE``) serialises concurrent changes, so each gets the next number.
"""

from __future__ import annotations

from typing import Any

from sqlmodel import Session, col, select

from server.models import TERMINAL, ConfigRevision, Run, RunStatus, stored_id
from server.services import capacity, runs
from server.services.runs import InvalidTransition, RunNotFound
from worker.dotted_keys import replay, with_keys
from worker.live_config import LIVE_KEYS, live_values, validate_changes
from worker.spec import SpecError, validate_spec


class RunNotLive(InvalidTransition):
    """The run has ended: its config no longer changes (HTTP 409)."""


class RevisionNotFound(RunNotFound):
    """No such revision of this run (HTTP 404)."""


def revisions(session: Session, run_id: int, *, after: int = 0) -> list[ConfigRevision]:
    """Revisions of ``run_id`` numbered above ``after``, oldest first."""
    stmt = (
        select(ConfigRevision)
        .where(ConfigRevision.run_id == run_id, col(ConfigRevision.revision) > after)
        .order_by(col(ConfigRevision.revision))
    )
    return list(session.exec(stmt).all())


def current(session: Session, run: Run) -> tuple[list[ConfigRevision], dict[str, Any]]:
    """All revisions of ``run`` (oldest first) and every live key's value once they are applied (none for an SFT
    run)."""
    rows = revisions(session, stored_id(run))
    if run.kind != "rl":  # an SFT run has no live keys (its supervisor still polls this)
        return rows, {}
    return rows, live_values(replay(run.spec, (rev.changes for rev in rows)))


def in_effect(session: Session, run: Run) -> dict[str, Any]:
    """Every live key's value as the run's processes have taken it up (``runs.spec_in_effect``: only acknowledged
    revisions count); differs from :func:`current`'s values while a revision is pending, or forever when the run
    ended before a process applied it. None for an SFT run (no live keys)."""
    if run.kind != "rl":
        return {}
    return live_values(runs.spec_in_effect(session, run))


def state(row: ConfigRevision, run: Run) -> str:
    """Where revision ``row`` of ``run`` stands, one line: ``in effect`` (every process that applies one of its keys
    acknowledged it), ``pending`` (the run is live and a process has not yet reached its next step boundary) or
    ``not applied: the run ended first (<process>, …)`` (the run ended before that process applied it: nothing
    trained with it; a resume of a failed or cancelled run applies it at its first step, which the text says)."""
    owners = sorted({LIVE_KEYS[k] for k in row.changes if k in LIVE_KEYS})
    missing = [p for p in owners if p not in row.applied]
    if not missing:
        return "in effect"
    status = RunStatus(run.status)
    if status not in TERMINAL:
        return "pending" if len(missing) == len(owners) else f"pending ({', '.join(missing)})"
    later = "; a resume applies it" if status in runs.RESUMABLE else ""
    return f"not applied: the run ended first ({', '.join(missing)}){later}"


def create(session: Session, run_id: int, changes: Any, *, by: str) -> ConfigRevision:
    """Validate ``changes`` and add the run's next revision (plus a ``config_revision`` event). Flushes only:
    the caller commits. On error nothing is added.

    Raises:
        RunNotFound: no such run.
        RunNotLive: the run is completed, failed or cancelled.
        SpecError: an SFT run (live config is for RL runs), empty changes, a non-live key (the message lists the live keys), a value the schema
            refuses (the message starts with the dotted key), or a ``batch_size``/``group_size`` whose step no
            declared worker holds (``capacity.check_fits``).
    """
    run = runs.get(session, run_id, lock=True)
    status = RunStatus(run.status)
    if status in TERMINAL:
        raise RunNotLive(
            f"run {run_id} is {status.value}: config changes only while it is queued, starting, running or paused"
        )
    if run.kind != "rl":
        raise SpecError(f"kind: live config changes apply to 'rl' runs; run {run_id} is an {run.kind!r} run")
    existing = revisions(session, run_id)
    spec = replay(run.spec, (rev.changes for rev in existing))
    normalised = validate_changes(spec, changes)
    if {"orchestrator.batch_size", "orchestrator.group_size"} & set(normalised):  # a larger step must still fit
        capacity.check_fits(session, validate_spec("rl", with_keys(spec, normalised)))
    number = (existing[-1].revision if existing else 0) + 1
    row = ConfigRevision(run_id=run_id, revision=number, changes=normalised, created_by=by)
    session.add(row)
    runs.record_event(
        session, run, "config_revision", reason=f"revision {number} by {by}", revision=number, changes=normalised
    )
    session.flush()
    return row


def ack(session: Session, run_id: int, revision: int, *, process: str, step: int) -> ConfigRevision:
    """Record that ``process`` runs with ``revision`` from ``step`` on (and a ``config_applied`` event).

    A repeat with the same step changes nothing; a different step (a resumed run re-did the steps after its
    checkpoint) replaces it.

    Raises:
        RunNotFound: no such run.
        RevisionNotFound: the run has no such revision.
        SpecError: ``process`` applies none of the revision's keys.
    """
    run = runs.get(session, run_id)
    row = session.exec(
        select(ConfigRevision)
        .where(ConfigRevision.run_id == run_id, ConfigRevision.revision == revision)
        .with_for_update()
    ).first()
    if row is None:
        raise RevisionNotFound(f"run {run_id} has no config revision {revision}")
    owners = sorted({LIVE_KEYS[k] for k in row.changes if k in LIVE_KEYS})
    if process not in owners:
        raise SpecError(f"process: revision {revision} is applied by {', '.join(owners)}, not {process!r}")
    if row.applied.get(process) == step:
        return row
    row.applied = {**row.applied, process: step}  # a new dict: SQLAlchemy sees the change
    session.add(row)
    runs.record_event(
        session,
        run,
        "config_applied",
        reason=f"revision {revision} in effect for {process} from step {step}",
        revision=revision,
        process=process,
        step=step,
    )
    session.flush()
    return row
