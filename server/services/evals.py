"""Eval jobs of a run's weights: checks and copies at submit, one-click evals of a checkpoint, eval reward over steps.

An eval job (``kind = "eval"``, ``worker.spec.EvalSpec``) evaluates a model path, or the weights of a training run of
the service (``model.run``): its checkpoint ``model.step``, or its final weights (``final/``) when the step is unset.
At submit ``runs.create`` checks the source run (``runs.resolve_eval_source``: it exists, is a training run, its owner
or an admin asks, the checkpoint is complete / the final weights exist) and sets ``model.name`` and ``model.dtype`` to
the source run's base model; after the row exists (``runs.attach_eval_source``) it copies the weight files of that
checkpoint (or of ``final/``) into the job's ``<run_dir>/source/`` (``worker.run.run_files``: no link followed, bytes
copied, never hard-linked: the job's uid owns its copy) and records an ``evaluation`` event on the source run (job id,
step). This module holds what builds on that: the one-click eval of a checkpoint (:func:`evaluate_checkpoint`) and eval
reward over checkpoints (:func:`evals_of`). The job's process turns ``source/`` into a model folder and evaluates it
(``worker/evaluation.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session, col, select

from server.models import Metric, Role, Run, RunEvent, stored_id
from server.services import permissions, runs
from server.services.runs import EVAL_EVENT, TRAINING_KINDS
from server.services.tokens import Principal
from worker.spec import SpecError

CHART_METRICS = ("reward_mean", "pass_at_k", "completion_len_mean")
"""Metrics of an eval job shown per checkpoint (each environment's ``<name>/<env>`` too)."""


def checkpoint_spec(source: Run, step: int) -> dict[str, Any]:
    """The eval job the run page's "Evaluate" button submits for checkpoint ``step`` of ``source``: its environments,
    seed and eval settings (an RL run's ``orchestrator.eval`` and ``max_tokens``; an SFT run's ``eval_examples``,
    greedy, as its own held-out reward)."""
    spec = source.spec
    settings: dict[str, Any]
    if source.kind == "rl":
        orch = spec.get("orchestrator") or {}
        ev = orch.get("eval") or {}
        settings = {
            k: ev[k] for k in ("num_examples", "temperature", "pass_k", "pass_threshold", "num_samples") if k in ev
        }
        if "max_tokens" in orch:
            settings["max_tokens"] = orch["max_tokens"]
    else:
        settings = {"temperature": 0.0}
        if "eval_examples" in spec:
            settings["num_examples"] = spec["eval_examples"]
    name = f"{source.name[:80]}-eval-{step}"
    return {
        "kind": "eval",
        "name": name,
        "seed": spec.get("seed", 0),
        "model": {"run": stored_id(source), "step": step},
        "env": spec.get("env") or {},
        "eval": settings,
    }


def evaluate_checkpoint(session: Session, run_id: int, user: Principal, *, step: int) -> Run:
    """``user`` evaluates checkpoint ``step`` of run ``run_id`` in one click: an eval job of :func:`checkpoint_spec`
    created (``runs.create``) and committed, then its launch queued. The one path of the API's and the dashboard's
    "Evaluate".

    Raises:
        RunNotFound: no such run. Forbidden: not its owner or an admin, or a viewer / read token.
        SpecError: not a training run, no complete checkpoint at ``step``, or the job is refused at submit.
    """

    source = runs.get(session, run_id)
    permissions.require_write(user)
    if source.kind not in TRAINING_KINDS:
        raise SpecError(f"step: run {run_id} is an {source.kind!r} run; it has no checkpoints to evaluate")
    job = runs.create(session, data=checkpoint_spec(source, step), owner=user.name, admin=user.role == Role.admin)
    session.commit()
    runs.enqueue_launch(session, stored_id(job))
    return job


@dataclass(frozen=True)
class EvalPoint:
    """One eval job of a run's weights."""

    run_id: int
    step: int | None
    """The evaluated checkpoint's step; None: the final weights."""
    x: int
    """Where it is drawn, the step its metrics are stored at (``worker.evaluation.job_step``): ``step``, or the source
    run's ``max_steps`` for its final weights (the job's ``model.final_step``)."""
    status: str
    metrics: dict[str, float]
    """The job's finite ``eval`` metrics (empty until it completed)."""


def evals_of(session: Session, run: Run) -> list[EvalPoint]:
    """The eval jobs of ``run``'s weights that still exist (its ``evaluation`` events), by step then job id."""
    events = session.exec(
        select(RunEvent)
        .where(RunEvent.run_id == stored_id(run), RunEvent.kind == EVAL_EVENT)
        .order_by(col(RunEvent.id))
    ).all()
    steps = {int(e.data["eval_run_id"]): e.data.get("step") for e in events if "eval_run_id" in e.data}
    if not steps:
        return []
    jobs = {stored_id(j): j for j in session.exec(select(Run).where(col(Run.id).in_(list(steps)))).all()}
    rows = session.exec(select(Metric).where(col(Metric.run_id).in_(list(jobs)), Metric.source == "eval")).all()
    values: dict[int, dict[str, float]] = {}
    for m in rows:  # a non-finite value (stored as logged) is not drawn: JSON has no NaN
        if m.name.split("/")[0] in CHART_METRICS and math.isfinite(m.value):
            values.setdefault(m.run_id, {})[m.name] = m.value
    last = int(run.spec.get("max_steps", 0))
    points = []
    for jid, job in jobs.items():
        step = steps[jid]
        final = (job.spec.get("model") or {}).get("final_step")  # where the job stored its metrics
        x = int(step) if step is not None else int(final) if final is not None else last
        points.append(EvalPoint(jid, step, x, str(job.status), values.get(jid, {})))
    return sorted(points, key=lambda p: (p.x, p.run_id))
