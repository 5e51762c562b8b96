"""Sweeps: ordinary runs of one base spec with swept values, started ``max_parallel`` at a time and pruned on a metric.

A sweep spec (TOML or JSON; the CLI inlines a ``base = "path.toml"``)::

    name = "lr-temp"
    max_parallel = 4
    metric = "eval/reward_mean"        # <source>/<name> of a logged metric
    mode = "max"                       # or "min"
    [base]                             # the run spec every trial starts from
    ...
    [grid]                             # every combination of these values
    "trainer.optim.lr" = [1e-4, 3e-4]
    "orchestrator.temperature" = [0.7, 1.0]
    [random."trainer.optim.lr"]        # num_samples draws (per grid point), seeded
    low = 1e-5
    high = 1e-3
    log = true
    [pruning]
    rule = "successive_halving"        # or "median" (server/services/pruning.py)
    at_steps = [4]
    reduction_factor = 1.5

States (literal tables below). A sweep is ``running → completed | cancelled``. A trial is ``pending`` (no run yet)
``→ running`` (its run was created; the run's ``sweep`` event and ``sweep_trials.run_id`` point back at the sweep)
``→ waiting`` (held at a rung, ``held_step``) ``→ running`` (promoted: its run resumed) ``| pruned | finished``:
``pruned`` when a rung stopped it, ``finished`` when its run ended by itself.

:func:`tick` advances one sweep, a synchronous successive halving over the rungs (the pruning steps) in order:

1. trials whose run ended are ``finished``;
2. each trial's run is created with the rungs in its ``ckpt.hold_at`` (:func:`trial_run_data`): its trainer
   checkpoints at each rung and holds there (trains no further; the orchestrator runs its eval of that version and
   holds too, ``worker/run/checkpoint.end_of_leg``), so the step a trial is held at is the rung itself, however late the
   tick comes. At the first undecided rung ``s``, a running trial that logged the metric at ``s`` and has its
   complete checkpoint of ``s`` (or whose directory is not readable here: then on the metric alone) is *held*: its
   run, idle at ``s``, is stopped through the normal stop path (``runs.request_stop`` + ``stop_run``: the run ends
   ``cancelled`` with its checkpoints kept) and the trial is ``waiting`` (``held`` event on the run), which frees its
   slot for a pending trial. A run that does not hold at ``s`` (made before ``ckpt.hold_at``) takes part in the rung
   while it trains on;
3. the rung is decided once every trial reached it or ended before it (none pending, none running below it, none
   promoted at an earlier rung and not yet resumed), on each trial's value AT ``s`` (its last at or before ``s``, not
   later ones): the trials the rule names are ``pruned`` (``pruned`` event; a held run stays stopped with its
   checkpoints, resumable or forkable; a live one is stopped), the other held ones are promoted (``promoted`` event);
   then the next rung may be decided in the same tick;
4. a promoted trial whose stopped run has ended is resumed from its newest complete checkpoint through
   ``runs.resume`` (the same run: the trial keeps pointing at it; its metrics after that checkpoint are deleted and
   measured again) and is ``running`` again, on to the next rung or ``max_steps``; one whose run completed meanwhile
   (it reached ``max_steps`` before the stop) is ``finished``;
5. pending trials start while fewer than ``max_parallel`` runs are live (a held run counts until it has stopped; a
   resume takes a slot too);
6. the sweep completes when every trial is pruned or finished and no run is live.

Celery beat runs it for every running sweep with each reconcile (``server/jobs/tasks.py``); ``POST /api/sweeps`` runs the
first.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlmodel import Session, col, select

from server.jobs.celery_app import BrokerUnavailable, TaskName, enqueue
from server.models import TERMINAL, Metric, Run, RunStatus, Sweep, SweepStatus, SweepTrial, stored_id, utcnow
from server.services import capacity, job_groups, launch_checks, permissions, pruning, runs, spec_policy
from server.services.tokens import Principal
from worker.dotted_keys import DottedKeyError, closest, flatten, with_keys
from worker.run.checkpoint import complete_steps
from worker.run.rundir import RunDir
from worker.spec import SpecError, validate_spec
from worker.spec.trainer import MAX_HOLD_STEPS
from worker.tracking.alert_rules import METRICS, metric_hint, reports


class TrialStatus:
    pending = "pending"
    running = "running"
    waiting = "waiting"
    pruned = "pruned"
    finished = "finished"


T = TrialStatus
TRIAL_TRANSITIONS: dict[str, frozenset[str]] = {
    T.pending: frozenset({T.running}),
    T.running: frozenset({T.waiting, T.pruned, T.finished}),
    T.waiting: frozenset({T.running, T.pruned, T.finished}),
    T.pruned: frozenset(),
    T.finished: frozenset(),
}
SW = SweepStatus
SWEEP_TRANSITIONS: dict[SweepStatus, frozenset[SweepStatus]] = {
    SW.running: frozenset({SW.completed, SW.cancelled}),
    SW.completed: frozenset(),
    SW.cancelled: frozenset(),
}
MAX_TRIALS = 256
"""Most trials of one sweep (grid points x random samples)."""
MAX_PARALLEL = 64
NOT_SWEEPABLE = ("name", "kind", "output_dir", "launcher", "env", "monitor", "alerts")
"""Keys (and tables) a sweep never varies: the service sets the name and directory of each trial; the launcher,
environments and alerts are the sweep's fixed setting."""
_METRIC = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_./@-]+$")


class SweepNotFound(LookupError):
    pass


class RandomRange(BaseModel):
    """``[random."dotted.key"]``: a uniform draw in ``[low, high]`` (``log``: uniform in log space)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    low: float
    high: float
    log: bool = False
    integer: bool = False
    """Round each draw to the nearest integer (e.g. ``orchestrator.group_size``)."""


class PruningSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    rule: Literal["median", "successive_halving"]
    at_steps: list[int] = Field(min_length=1, max_length=MAX_HOLD_STEPS)
    """Trainer steps at which the rule decides (rungs); each trial's run holds at them (``ckpt.hold_at``)."""
    reduction_factor: float = Field(2.0, gt=1.0, le=100.0)
    """``successive_halving`` keeps ``ceil(n / reduction_factor)`` trials at each rung."""

    @field_validator("at_steps")
    @classmethod
    def _steps(cls, v: list[int]) -> list[int]:
        if any(s < 1 for s in v) or len(set(v)) != len(v):
            raise ValueError(f"expected distinct steps >= 1, got {v}")
        return sorted(v)


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field("sweep", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
    base: dict[str, Any]
    """The run spec every trial starts from (inline; the CLI reads a path)."""
    grid: dict[str, list[Any]] | None = None
    random: dict[str, RandomRange] | None = None
    num_samples: int = Field(1, ge=1, le=MAX_TRIALS)
    """Random draws per grid point (``random`` only)."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    max_parallel: int = 1
    metric: str = "eval/reward_mean"
    mode: Literal["max", "min"] = "max"
    pruning: PruningSpec | None = None


def _validation_line(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "sweep"
    if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:  # a mistyped top-level key
        close = closest(where, list(SweepSpec.model_fields))
        hint = f" (did you mean '{close}'?)" if close else ""
        return f"{where}: unknown sweep key{hint}; allowed: {', '.join(SweepSpec.model_fields)}"
    return f"{where}: {first['msg']}"


def sweepable_keys(base: dict[str, Any]) -> dict[str, Any]:
    """Dotted key -> resolved value of every key of the validated base spec a sweep may vary: scalar values (numbers,
    text, booleans, unset optionals) outside ``NOT_SWEEPABLE``.

    Raises:
        SpecError: the base spec is of another kind or invalid (``base.`` + the spec's own message).
    """
    if base.get("kind", "rl") != "rl":
        raise SpecError(f"base.kind: a sweep runs 'rl' runs; give an 'rl' spec as its base, got {base['kind']!r}")
    try:
        spec = validate_spec("rl", base)
    except SpecError as err:
        raise in_base(err) from None
    return flatten(spec.model_dump(mode="json"))


_NAMED = re.compile(r"^([\w.\[\]-]+): (.*)$", re.S)
_UNKNOWN = re.compile(r"^unknown key '([^']+)' (.*)$", re.S)  # worker.spec.loading.check_unknown_keys


def _key_and_message(text: str) -> tuple[str, str]:
    """A spec error split into the dotted key it names (``""``: none) and the rest: ``"trainer.optim.lr: Input should
    be greater than 0"`` and the loader's ``"unknown key 'trainer.optim.lrr' (did you mean ...)"`` alike."""
    if m := _UNKNOWN.match(text):
        return m.group(1), f"unknown key {m.group(2)}"
    if m := _NAMED.match(text):
        return m.group(1), m.group(2)
    return "", text


def _reworded(err: Exception, text: str) -> Exception:
    """``err``'s kind (a 422 ``SpecError`` or one of its kinds, a 403 ``Forbidden``) with the message ``text``."""
    return type(err)(text) if isinstance(err, SpecError | permissions.Forbidden) else SpecError(text)


def in_base(err: Exception) -> Exception:
    """An error of the base spec alone, named as the submitter wrote the key: ``base.<key>: ...`` (``base: ...`` for
    a message that names no key)."""
    key, message = _key_and_message(str(err))
    return _reworded(err, f"base.{key}: {message}" if key else f"base: {message}")


def in_trial(
    spec: SweepSpec, index: int, params: dict[str, Any], err: Exception, *, note: str | None = None
) -> Exception:
    """An error of trial ``index`` (swept values ``params``), named as the submitter wrote the key: ``grid.<key>: ...``
    or ``random.<key>: ...`` when the key it names is swept (its value is in the message), else ``base.<key>: ...
    (<note>)``, the note by default ``trial <index>: <swept values>`` (the base alone is valid: the trial's values
    made it fail); ``note=""`` for a check of the key's own value, which is the base's.
    """
    key, message = _key_and_message(str(err))
    swept = next((k for k in params if key == k or key.startswith(k + ".")), None)
    if swept is not None:
        return _reworded(err, f"{'random' if swept in (spec.random or {}) else 'grid'}.{key}: {message}")
    if note is None:
        note = f"trial {index}: " + ", ".join(f"{k} = {v!r}" for k, v in params.items())
    where = f"base.{key}" if key else "base"
    return _reworded(err, f"{where}: {message}" + (f" ({note})" if note else ""))


def _check_key(where: str, key: str, known: dict[str, Any]) -> None:
    top = key.split(".")[0]
    if key in known and top not in NOT_SWEEPABLE and not isinstance(known[key], list | dict):
        return
    if top in NOT_SWEEPABLE or (key in known and isinstance(known[key], list | dict)):
        raise SpecError(
            f"{where}.{key}: not sweepable (a sweep varies numbers, text or booleans of the run spec; "
            f"not {', '.join(NOT_SWEEPABLE)} or lists)"
        )
    below = sorted(k for k in known if k.startswith(key + "."))
    if below:
        raise SpecError(f"{where}.{key}: a table, not a value; sweep one of its keys such as {below[0]}")
    hint = closest(key, [k for k in known if k.split(".")[0] not in NOT_SWEEPABLE])
    raise SpecError(f"{where}.{key}: unknown spec key" + (f" (did you mean {hint!r}?)" if hint else ""))


def check_value_types(spec: SweepSpec, params: dict[str, Any], resolved: dict[str, Any]) -> None:
    """Refuse a number swept into a text key: the spec takes numbers as text (``--model.name 2024`` on the command
    line), so a ``random`` draw would make ``model.name = "0.84"``. Only numeric keys take a range or number values.

    Raises:
        SpecError: ``random.model.name: a text key; a random range draws numbers, so only numeric keys take one
            ...`` or ``grid.model.name: 0.5 is a number, but model.name takes text; ...``.
    """
    for key, value in params.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or not isinstance(resolved.get(key), str):
            continue
        if key in (spec.random or {}):
            raise SpecError(
                f"random.{key}: a text key; a random range draws numbers, so only numeric keys take one "
                "(sweep text with grid values)"
            )
        raise SpecError(f'grid.{key}: {value!r} is a number, but {key} takes text; give text values such as "{value}"')


def trial_params(spec: SweepSpec) -> list[dict[str, Any]]:
    """The swept values of every trial, in order: the grid's combinations (keys in the order given, the last varying
    fastest), each with ``num_samples`` seeded random draws when ``random`` is set."""
    grid = spec.grid or {}
    points = [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())] if grid else [{}]
    if not spec.random:
        return points
    rng = random.Random(spec.seed)
    out = []
    for point in points:
        for _ in range(spec.num_samples):
            draw: dict[str, Any] = {}
            for key, r in spec.random.items():
                x = math.exp(rng.uniform(math.log(r.low), math.log(r.high))) if r.log else rng.uniform(r.low, r.high)
                draw[key] = round(x) if r.integer else x
            out.append({**point, **draw})
    return out


@dataclass(frozen=True)
class Plan:
    spec: SweepSpec
    trials: list[dict[str, Any]]
    """Swept values of each trial."""


def plan(session: Session, data: dict[str, Any], *, owner: str, admin: bool) -> Plan:
    """Validate a sweep spec mapping of ``owner`` (``admin``: an admin's) and expand its trials; every trial's run spec
    is validated and given the check of submit and launch (``runs.check_allowed``) here, so a bad value is refused
    before anything is created.

    Raises:
        SpecError: one line naming the field: an unknown key (with the closest known one) or a non-sweepable one, an
            empty grid or value list, a random range with ``low > high`` (or ``log`` with ``low <= 0``), a range or
            number swept into a text key (:func:`check_value_types`), ``max_parallel < 1``, a pruning step at or
            beyond the base spec's ``max_steps``, too many trials, or a trial whose run spec is invalid, refused by
            the code policy or one the launch would refuse (``server.services.launch_checks``: LoRA targets,
            ``inference.urls`` that do not answer). Every key is named as the submitter wrote it (:func:`in_base`,
            :func:`in_trial`): ``grid.<key>: ...``, ``random.<key>: ...`` or ``base.<key>: ... (trial <i>: ...)``.
        permissions.Forbidden: ``base.launcher.slurm.allocation`` of a non-admin (``spec_policy``), or a trial's
            ``model.name`` inside another user's run folder (``runs.check_run_files_used``): ``base.model.name: ...``
            or ``grid.model.name: ...``.
    """
    mp = data.get("max_parallel", 1)
    if not isinstance(mp, int) or isinstance(mp, bool) or not 1 <= mp <= MAX_PARALLEL:
        raise SpecError(f"max_parallel: expected an integer from 1 to {MAX_PARALLEL}, got {mp!r}")
    if "grid" in data and isinstance(data["grid"], dict) and not data["grid"]:
        raise SpecError("grid: empty; give at least one dotted key with a list of values")
    if isinstance(data.get("base"), str):
        raise SpecError("base: expected the run spec as a table (the CLI reads base = 'path.toml' into it)")
    if isinstance(data.get("base"), dict) and "output_dir" in data["base"]:
        raise SpecError(f"base.{spec_policy.SERVICE_SETS_OUTPUT_DIR}")
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_validation_line(err)) from None
    if not spec.grid and not spec.random:
        raise SpecError("grid: missing; give a [grid] of dotted keys with values and/or a [random] of ranges")
    known = sweepable_keys(spec.base)
    for key, values in (spec.grid or {}).items():
        _check_key("grid", key, known)
        if not values:
            raise SpecError(f"grid.{key}: empty list; give at least one value")
        seen = [json.dumps(v, sort_keys=True) for v in values]
        dup = next((values[i] for i in range(len(seen)) if seen[i] in seen[:i]), None)
        if len(set(seen)) < len(seen):
            raise SpecError(f"grid.{key}: {dup!r} is listed twice; each value once (two trials would be the same)")
    for key, r in (spec.random or {}).items():
        _check_key("random", key, known)
        if r.low > r.high:
            raise SpecError(f"random.{key}: low {r.low} > high {r.high}; expected low <= high")
        if r.log and r.low <= 0:
            raise SpecError(f"random.{key}: log = true needs low > 0, got {r.low}")
    both = set(spec.grid or {}) & set(spec.random or {})
    if both:
        raise SpecError(f"random.{sorted(both)[0]}: also in grid; sweep a key one way")
    if not _METRIC.match(spec.metric):
        raise SpecError(f"metric: expected <source>/<name> such as eval/reward_mean, got {spec.metric!r}")
    source, name = spec.metric.split("/", 1)
    if source not in METRICS:
        raise SpecError(f"metric: unknown source {source!r} in {spec.metric!r}; expected one of {', '.join(METRICS)}")
    if not reports(source, name):
        raise SpecError(f"metric: {source} logs no {name!r}{metric_hint(name)}; it logs {', '.join(METRICS[source])}")
    max_steps = known["max_steps"]
    if spec.pruning and spec.pruning.at_steps[-1] >= max_steps:
        raise SpecError(f"pruning.at_steps: step {spec.pruning.at_steps[-1]} is not before base max_steps {max_steps}")
    count = math.prod(len(v) for v in (spec.grid or {}).values()) * (spec.num_samples if spec.random else 1)
    if count > MAX_TRIALS:  # counted before the product is made
        raise SpecError(f"grid: {count} trials (grid points x num_samples); at most {MAX_TRIALS}")
    params = trial_params(spec)
    trials = []
    for i, p in enumerate(params):
        try:
            run_spec = validate_spec("rl", with_keys(spec.base, p))
        except (SpecError, DottedKeyError) as err:
            raise in_trial(spec, i, p, err) from None
        check_value_types(spec, p, flatten(run_spec.model_dump(mode="json")))
        if spec.pruning and spec.pruning.at_steps[-1] >= run_spec.max_steps:  # a swept max_steps
            shown = ", ".join(f"{k} = {v!r}" for k, v in p.items())
            raise SpecError(
                f"pruning.at_steps: step {spec.pruning.at_steps[-1]} is not before max_steps {run_spec.max_steps} of "
                f"the trial ({shown})"
            )
        try:  # as the tick creates it: the rungs in ckpt.hold_at (with the base's own, at most MAX_HOLD_STEPS)
            run_spec = validate_spec("rl", trial_run_data(spec.model_dump(mode="json", exclude_none=True), p))
        except SpecError as err:
            raise in_trial(spec, i, p, err, note="with the rungs of pruning.at_steps added") from None
        try:  # the check of submit and launch: code, addresses, flags, and no other user's run folder
            runs.check_allowed(session, run_spec, owner=owner, admin=admin)
        except (SpecError, permissions.Forbidden) as err:  # a check of each key's own value
            raise in_trial(spec, i, p, err, note="") from None
        trials.append(run_spec)
    checked = launch_checks.distinct(trials)  # what the launch would refuse (LoRA targets, dead inference.urls)
    for i in checked:
        try:
            launch_checks.check(trials[i])
        except SpecError as err:  # one spec checked: the base's values
            raise in_trial(spec, i, params[i], err, note="" if len(checked) == 1 else None) from None
    return Plan(spec, params)


def create(session: Session, *, data: dict[str, Any], owner: str, admin: bool = False) -> Sweep:
    """Validate (:func:`plan`) and add a running sweep of ``owner`` with its pending trials; flushed, not committed.
    The caller commits, then calls :func:`tick` to start the first runs.

    Raises:
        SpecError: see :func:`plan`; or no worker can hold the base spec or a trial (``capacity.check_fits``):
            ``base.<key>: ...``, ``grid.<key>: ...`` (a swept value) or ``base.<key>: ... (trial <i>: ...)``.
        permissions.Forbidden: see :func:`plan`.
    """
    p = plan(session, data, owner=owner, admin=admin)
    try:
        capacity.check_fits(session, validate_spec("rl", p.spec.base))
    except SpecError as err:
        raise in_base(err) from None
    for i, params in enumerate(p.trials):  # a swept trainer.threads, launcher.local.*_gpus ... must fit a worker too
        trial = validate_spec("rl", with_keys(p.spec.base, params))
        try:
            capacity.check_fits(session, trial)
        except SpecError as err:
            raise in_trial(p.spec, i, params, err) from None
    sweep = Sweep(name=p.spec.name, owner=owner, spec=p.spec.model_dump(mode="json", exclude_none=True))
    session.add(sweep)
    session.flush()
    for i, params in enumerate(p.trials):
        session.add(SweepTrial(sweep_id=stored_id(sweep), index=i, params=params))
    session.flush()
    return sweep


def get(session: Session, sweep_id: int, *, lock: bool = False) -> Sweep:
    """The sweep (``lock``: ``SELECT ... FOR UPDATE`` until the transaction ends).

    Raises:
        SweepNotFound: no sweep with this id.
    """
    return job_groups.get(session, Sweep, sweep_id, lock=lock, missing=SweepNotFound, what="sweep")


def trials(session: Session, sweep_id: int) -> list[SweepTrial]:
    return job_groups.members(session, SweepTrial, sweep_id)


def list_sweeps(session: Session, *, offset: int = 0, limit: int = 50) -> tuple[list[Sweep], int]:
    return job_groups.page(session, Sweep, offset=offset, limit=limit)


def running_ids(session: Session) -> list[int]:
    return job_groups.running_ids(session, Sweep, SW.running)


def histories(session: Session, sweep: Sweep, ts: list[SweepTrial]) -> dict[int, list[tuple[int, float]]]:
    """Trial index -> the sweep metric of its run as ``(step, value)`` pairs, ascending (trials without a run or a
    point absent; non-finite values left out)."""
    source, name = sweep.spec["metric"].split("/", 1)
    by_run = {t.run_id: t.index for t in ts if t.run_id is not None}
    if not by_run:
        return {}
    rows = session.exec(
        select(Metric.run_id, Metric.step, Metric.value)
        .where(col(Metric.run_id).in_(list(by_run)), Metric.source == source, Metric.name == name)
        .order_by(col(Metric.step))
    ).all()
    out: dict[int, list[tuple[int, float]]] = {}
    for run_id, step, value in rows:
        if not math.isfinite(value):  # a NaN reward: no value to rank by
            continue
        out.setdefault(by_run[run_id], []).append((step, value))
    return out


def _move(trial: SweepTrial, to: str, reason: str) -> None:
    if to not in TRIAL_TRANSITIONS[trial.status]:
        raise runs.InvalidTransition(f"sweep trial {trial.index} is {trial.status}: cannot go to {to}")
    trial.status, trial.reason = to, reason


def _end(sweep: Sweep, to: SweepStatus, reason: str) -> None:
    if to not in SWEEP_TRANSITIONS[SweepStatus(sweep.status)]:
        raise runs.InvalidTransition(f"sweep {sweep.id} is {sweep.status}: cannot go to {to.value}")
    sweep.status, sweep.status_reason, sweep.updated_at, sweep.finished_at = to, reason, utcnow(), utcnow()


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _newest_checkpoint(run: Run) -> int | None:
    """The step of ``run``'s newest complete checkpoint (0: none yet), or None when its directory cannot be read
    here."""
    if not run.run_dir:
        return None
    try:
        return max(complete_steps(RunDir(run.run_dir)), default=0)
    except OSError:
        return None


def _hold_steps(run: Run) -> list[int]:
    """The steps ``run`` holds at (its spec's ``ckpt.hold_at``)."""
    return list(((run.spec or {}).get("ckpt") or {}).get("hold_at") or [])


def trial_run_data(spec: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The run spec mapping of a trial with swept values ``params``: the base with them set and, with pruning, the
    pruning steps added to ``ckpt.hold_at``, so the trial's trainer checkpoints at each rung and holds there: the
    step it is held at is the rung, whenever the tick sees it.

    Raises:
        DottedKeyError: a swept key goes through a value that is not a table (refused by :func:`plan` already).
    """
    data = with_keys(spec["base"], params)
    rungs = (spec.get("pruning") or {}).get("at_steps") or []
    if rungs:
        given = ((data.get("ckpt") or {}).get("hold_at")) or []
        data = with_keys(data, {"ckpt.hold_at": sorted({*given, *rungs})})
    return data


def _value_at(history: list[tuple[int, float]], step: int) -> float | None:
    """The trial's metric at rung ``step``: its last value at or before it (None: it logged none by then)."""
    upto = [v for s, v in history if s <= step]
    return upto[-1] if upto else None


def _shown(value: float | None) -> str:
    return "none" if value is None else _fmt(value)


def tick(session: Session, sweep_id: int) -> list[str]:
    """Advance sweep ``sweep_id`` one step (see the module docstring), commit, then enqueue the launches (new and
    resumed runs) and stops it decided. Returns one line per thing done. A sweep that is not running is left as it is.

    Raises:
        SweepNotFound: no such sweep.
    """
    from worker.launchers.supervisor import running_pid

    sweep = get(session, sweep_id, lock=True)
    if sweep.status != SW.running:
        session.rollback()
        return []
    ts = trials(session, sweep_id)
    run_of = {t.index: job_groups.run_of(session, t) for t in ts}
    done: list[str] = []
    launches: list[int] = []
    stops: list[int] = []

    def ended(t: SweepTrial) -> bool:
        run = run_of[t.index]
        return run is None or RunStatus(run.status) in TERMINAL

    for t in ts:
        if t.status == T.running and ended(t):
            run = run_of[t.index]
            _move(t, T.finished, f"run {run.status}" if run is not None else "run deleted")
            session.add(t)
    spec = sweep.spec
    hist = histories(session, sweep, ts)
    rule: dict[str, Any] = spec.get("pruning") or {}
    for step in rule.get("at_steps", []):
        if step in sweep.decided:
            continue
        blocked = False
        for t in ts:
            run = run_of[t.index]
            if t.status == T.pending or (t.status == T.waiting and t.held_step != step):
                blocked = True  # not started yet, or promoted at an earlier rung and not yet resumed
            if t.status != T.running or ended(t) or run is None:
                continue
            newest = _newest_checkpoint(run)
            if not pruning.reached(hist.get(t.index, []), step):
                blocked = True
            elif step not in _hold_steps(run):
                pass  # a run that does not hold at the rung (made before ckpt.hold_at): it takes part as it trains on
            elif newest is None or newest >= step:  # held at the rung by its trainer: stopped, resumed if promoted
                value = _value_at(hist[t.index], step)
                reason = f"held at step {step} until the rung is decided: {spec['metric']} {_shown(value)}"
                _move(t, T.waiting, reason)
                t.held_step = step
                session.add(t)
                locked = runs.get(session, stored_id(run), lock=True)
                runs.record_event(session, locked, "held", reason=reason, sweep_id=sweep_id, step=step, value=value)
                if runs.request_stop(session, locked, by=f"sweep {sweep_id} ({reason})"):
                    stops.append(stored_id(locked))
                done.append(f"trial {t.index} (run {run.id}): {reason}")
            else:
                blocked = True  # its checkpoint of the rung is being written
        if blocked:
            break
        taking = {t.index: hist[t.index] for t in ts if t.status != T.pruned and t.index in hist}
        if rule["rule"] == "median":
            chosen = pruning.median_stopping(taking, step, spec["mode"])
        else:
            chosen = pruning.successive_halving(taking, step, spec["mode"], rule["reduction_factor"])
        pruned = promoted = 0
        for t in ts:
            if t.status not in (T.running, T.waiting) or t.index not in hist:
                continue
            run = run_of[t.index]
            assert run is not None  # running or waiting: it has a run
            at = _value_at(hist[t.index], step) if pruning.reached(hist[t.index], step) else None
            if t.index in chosen and at is not None:
                reason = f"pruned at step {step} by {rule['rule']}: {spec['metric']} {_fmt(at)}"
                held = t.status == T.waiting
                _move(t, T.pruned, reason)
                t.pruned_step, t.held_step = step, None
                session.add(t)
                locked = runs.get(session, stored_id(run), lock=True)
                runs.record_event(session, locked, "pruned", reason=reason, sweep_id=sweep_id, step=step, value=at)
                if not held and not ended(t) and runs.request_stop(session, locked, by=f"sweep {sweep_id} ({reason})"):
                    stops.append(stored_id(locked))
                pruned += 1
                done.append(f"trial {t.index} (run {run.id}): {reason}")
            elif t.status == T.waiting and t.held_step == step:
                reason = f"promoted at step {step} by {rule['rule']}: {spec['metric']} {_shown(at)}"
                t.reason = reason
                session.add(t)
                locked = runs.get(session, stored_id(run), lock=True)
                runs.record_event(session, locked, "promoted", reason=reason, sweep_id=sweep_id, step=step, value=at)
                promoted += 1
                done.append(f"trial {t.index} (run {run.id}): {reason}")
        sweep.decided = [*sweep.decided, step]
        done.append(f"rung {step} decided: {pruned} pruned, {promoted} promoted")
    live = sum(1 for t in ts if t.status != T.pending and not ended(t))  # a stopping run holds its slot
    for t in ts:  # promoted trials continue from their checkpoint once their stopped run has ended
        if t.status != T.waiting or t.held_step not in sweep.decided or not ended(t):
            continue
        run = run_of[t.index]
        if run is None or run.status == RunStatus.completed:  # it reached max_steps before the stop
            _move(t, T.finished, f"run {run.status}" if run is not None else "run deleted")
            t.held_step = None
            session.add(t)
            continue
        if live >= spec["max_parallel"] or running_pid(Path(run.run_dir).parent) is not None:
            continue  # no slot yet, or its supervisor is still exiting: next tick
        locked = runs.get(session, stored_id(run), lock=True)
        try:
            from_step = runs.resume(session, locked, by=f"sweep {sweep_id}")
        except runs.InvalidTransition as err:  # e.g. its checkpoints were removed meanwhile
            _move(t, T.finished, f"not resumed after step {t.held_step}: {err}"[:2000])
            t.held_step = None
            session.add(t)
            done.append(f"trial {t.index} (run {run.id}): {t.reason}")
            continue
        reason = f"resumed from checkpoint step {from_step} after the rung at step {t.held_step}"
        _move(t, T.running, reason)
        t.held_step = None
        session.add(t)
        launches.append(stored_id(locked))
        live += 1
        done.append(f"trial {t.index} (run {run.id}): {reason}")
    admin = job_groups.owner_is_admin(session, sweep.owner)
    for t in ts:
        if t.status != T.pending or live >= spec["max_parallel"]:
            continue
        data = trial_run_data(spec, t.params)
        data["name"] = f"{sweep.name}-{t.index}"
        try:
            new = runs.create(session, data=data, owner=sweep.owner, admin=admin)
        except SpecError as err:  # e.g. the owner's queue is full: tried again next tick
            sweep.status_reason = f"trial {t.index} waits: {err}"[:2000]
            break
        shown = ", ".join(f"{k} = {v!r}" for k, v in t.params.items())
        runs.record_event(
            session,
            new,
            "sweep",
            reason=f"trial {t.index} of sweep {sweep_id}: {shown}",
            sweep_id=sweep_id,
            trial=t.index,
            params=t.params,
        )
        t.run_id = stored_id(new)
        _move(t, T.running, "")
        run_of[t.index] = new
        session.add(t)
        launches.append(stored_id(new))
        live += 1
        done.append(f"trial {t.index}: run {new.id} created")
    if all(t.status in (T.pruned, T.finished) for t in ts) and all(ended(t) for t in ts):
        b = best(sweep, ts, hist)
        reason = (
            "no trial logged " + spec["metric"]
            if b is None
            else (f"best: trial {b.index} (run {b.run_id}) {spec['metric']} {_fmt(b.value)} at step {b.step}")
        )
        _end(sweep, SW.completed, reason)
        done.append(f"sweep completed: {reason}")
    sweep.updated_at = utcnow()
    session.add(sweep)
    session.commit()
    refused = []
    for run_id in launches:
        try:
            runs.enqueue_launch(session, run_id)
        except BrokerUnavailable as err:  # that trial's run failed; the others are still tried
            refused.append(err)
    for run_id in stops:
        enqueue(TaskName.stop_run, run_id)
    if refused:
        raise refused[0]
    return done


@dataclass(frozen=True)
class Best:
    index: int
    run_id: int | None
    params: dict[str, Any]
    step: int
    value: float


def best(sweep: Sweep, ts: list[SweepTrial], hist: dict[int, list[tuple[int, float]]]) -> Best | None:
    """The trial with the best single value of the sweep metric so far (``mode``), with that value and its step; the
    lower trial index of equal ones. None before any trial logged the metric."""
    out: Best | None = None
    mode = sweep.spec["mode"]
    for t in ts:
        b = pruning.best_value(hist.get(t.index, []), mode)
        if b is None:
            continue
        if out is None or (b[1] > out.value if mode == "max" else b[1] < out.value):
            out = Best(t.index, t.run_id, t.params, b[0], b[1])
    return out


def stop_by(session: Session, sweep_id: int, user: Principal, *, via: str = "API") -> Sweep:
    """``user`` (the owner or an admin) cancels the sweep from the surface ``via`` (``runs.STOP_SURFACES``): no more
    trials start, and its live runs are stopped through the normal stop path (checkpoints kept; their reason
    ``stopped by <user> via <surface> (sweep <id>)``); committed, then the stops are enqueued.

    Raises:
        SweepNotFound, Forbidden, InvalidTransition: the sweep has ended.
    """
    sweep = get(session, sweep_id, lock=True)
    permissions.require_owner(user, sweep.owner, f"sweep {sweep_id}", "stop it")
    _end(sweep, SW.cancelled, f"stopped by {user.name} via {via}")
    session.add(sweep)
    live = [run for t in trials(session, sweep_id) if (run := job_groups.run_of(session, t)) is not None]
    stops = job_groups.request_stops(session, live, by=f"{user.name} via {via} (sweep {sweep_id})")
    session.commit()
    for run_id in stops:
        enqueue(TaskName.stop_run, run_id)
    return sweep


def public(session: Session, sweep: Sweep) -> dict[str, Any]:
    """The sweep as the API and the dashboard show it: its spec, trials (swept values, run id and status, last and best
    value of the metric, pruned step) and the best so far."""
    ts = trials(session, stored_id(sweep))
    hist = histories(session, sweep, ts)
    mode = sweep.spec["mode"]
    rows = []
    for t in ts:
        run = job_groups.run_of(session, t)
        h = hist.get(t.index, [])
        top = pruning.best_value(h, mode)
        rows.append(
            {
                "index": t.index,
                "params": t.params,
                "status": t.status,
                "reason": t.reason,
                "pruned_step": t.pruned_step,
                "held_step": t.held_step,
                "run_id": t.run_id,
                "run_status": run.status if run is not None else None,
                "last": {"step": h[-1][0], "value": h[-1][1]} if h else None,
                "best": {"step": top[0], "value": top[1]} if top else None,
            }
        )
    b = best(sweep, ts, hist)
    return {
        **job_groups.summary_fields(sweep),
        "metric": sweep.spec["metric"],
        "mode": mode,
        "decided_steps": sweep.decided,
        "trials": rows,
        "best": None
        if b is None
        else {"trial": b.index, "run_id": b.run_id, "params": b.params, "step": b.step, "value": b.value},
    }
