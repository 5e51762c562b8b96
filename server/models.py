"""Tables and API shapes of the control plane.

Tables (``table=True``): runs, run_events, metrics, config_revisions, users, api_tokens, dashboard_sessions,
worker_capacity; the alert and webhook tables
are in ``server/alerts/models.py``, which imports this module (never the reverse): whoever needs every table on
``SQLModel.metadata`` imports both (``migrations/env.py``). Alembic migrations in ``migrations/`` create them;
``tests/service/test_migrations.py`` fails when these and the migrations drift.
"""

from __future__ import annotations

import enum
import json
import secrets
import unicodedata
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import BaseModel, field_validator
from pydantic import Field as PydanticField
from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, SQLModel

from worker.run.rundir import EngineEventKind

JSONType = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Keyed(Protocol):
    @property
    def id(self) -> int | None: ...


def stored_id(row: _Keyed) -> int:
    """The primary key of a table row the database has given one (loaded, or added and flushed). The tables
    declare ``id: int | None`` because a row has none before its first flush.

    Raises:
        ValueError: the row was never flushed.
    """
    if row.id is None:
        raise ValueError(f"{type(row).__name__} has no id yet: flush the session first")
    return row.id


def _run_fk() -> Column[int]:
    return Column(Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False, index=True)


class UTCDateTime(TypeDecorator[datetime]):
    """``timestamp with time zone`` that always loads as an aware UTC datetime: SQLite (embedded mode) stores no
    zone and hands back naive values, which must not meet aware ones (``utcnow() - created_at``)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def _ts(nullable: bool = False) -> Any:
    return Field(default_factory=utcnow if not nullable else lambda: None, sa_type=UTCDateTime(), nullable=nullable)


class RunStatus(enum.StrEnum):
    queued = "queued"
    starting = "starting"
    running = "running"
    paused = "paused"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL = frozenset({RunStatus.completed, RunStatus.failed, RunStatus.cancelled})


# ----------------------------------------------------------------------------- runs


MAX_TAG_LEN = 64
MAX_TAGS = 32
MAX_NOTES = 20_000
MAX_GROUP_LEN = 128


def check_label(value: str, field: str, max_len: int) -> str:
    """``value`` stripped of surrounding spaces, when it has no control character and 1..``max_len`` characters.

    Raises:
        ValueError: naming ``field``: a control character (Unicode category ``C*``: ``\\n``, ``\\t``, zero-width
            ...), empty, or too long.
    """
    bad = next((c for c in value if unicodedata.category(c).startswith("C")), None)
    if bad is not None:
        raise ValueError(f"{field}: control character {bad!r} not allowed (printable text only)")
    text = value.strip()
    if not text or len(text) > max_len:
        raise ValueError(f"{field}: expected 1 to {max_len} characters, got {len(text)}")
    return text


class RunBase(SQLModel):
    name: str = Field(max_length=128, index=True)
    kind: str = Field(default="rl", max_length=16)


def new_token_nonce() -> str:
    """A random value stored with each run and signed into its run token (``server.services.tokens.run_token``)."""
    return secrets.token_hex(16)


class Run(RunBase, table=True):
    __tablename__ = "runs"
    __table_args__ = {"sqlite_autoincrement": True}  # ids are never reused (Postgres: a sequence never goes back)
    id: int | None = Field(default=None, primary_key=True)
    token_nonce: str = Field(default_factory=new_token_nonce, max_length=64)
    """Random per run, signed into its run token: a token of a deleted run never opens a later run."""
    status: RunStatus = Field(default=RunStatus.queued, sa_type=String(16), index=True)
    status_reason: str = Field(default="", max_length=2000)
    spec: dict[str, Any] = Field(sa_column=Column(JSONType, nullable=False))
    spec_hash: str = Field(max_length=64)
    """sha256 of the resolved spec as canonical JSON."""
    owner: str = Field(max_length=128)
    """Name of the token that submitted the run."""
    launcher: str | None = Field(default=None, max_length=16)
    launcher_handle: str | None = Field(default=None, max_length=256)
    """Local: pid (= process group) of the run's supervisor; Slurm: job id."""
    worker: str | None = Field(default=None, max_length=255)
    """Name of the worker that launched the run (``server.services.capacity.worker_name``): its live local runs
    count against ``MAX_RUNS_PER_WORKER``."""
    run_dir: str = Field(max_length=1024)
    created_at: datetime = _ts()
    updated_at: datetime = _ts()
    started_at: datetime | None = _ts(nullable=True)
    finished_at: datetime | None = _ts(nullable=True)
    tags: list[str] = Field(default_factory=list, sa_column=Column(JSONType, nullable=False, server_default="[]"))
    """Labels to find the run by (``RunUpdate``: each 1-64 printable characters, at most ``MAX_TAGS``, no repeats)."""
    notes: str = Field(default="", sa_column=Column(Text, nullable=False, server_default=""))
    """Free text its owner keeps about it (Markdown is shown as typed)."""
    group: str | None = Field(default=None, max_length=128, index=True)
    """A name runs that belong together share (seeds of one config, a study); filterable like tags."""


class RunPublic(RunBase):
    id: int
    status: RunStatus
    status_reason: str
    spec: dict[str, Any]
    spec_hash: str
    owner: str
    launcher: str | None
    launcher_handle: str | None
    worker: str | None
    run_dir: str
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    tags: list[str]
    notes: str
    group: str | None
    step: int | None = None
    """The newest step the run's trainer reported; ``None`` before its first and for an eval job."""


class RunsPublic(SQLModel):
    data: list[RunPublic]
    count: int


class ForkRequest(BaseModel):
    """``POST /api/runs/{id}/fork``: a new run from a checkpoint of this one, with spec changes."""

    model_config = {"extra": "forbid"}
    step: int | None = PydanticField(default=None, ge=0, le=2**62)
    """Checkpoint step to start from; default the newest complete one."""
    changes: dict[str, Any] = PydanticField(default_factory=dict, max_length=200)
    """Dotted spec key -> new value, e.g. ``{"trainer.optim.lr": 5e-5, "max_steps": 40}``."""
    name: str | None = PydanticField(default=None, min_length=1, max_length=128)
    """Name of the new run; default the parent's."""


class RunUpdate(BaseModel):
    """``PATCH /api/runs/{id}``: the run's tags, notes and group; a field left out stays as it is."""

    model_config = {"extra": "forbid"}
    tags: list[str] | None = PydanticField(default=None, max_length=MAX_TAGS)
    """The whole new tag list (replaces the old one); repeats are dropped, order kept."""
    notes: str | None = PydanticField(default=None, max_length=MAX_NOTES)
    group: str | None = None
    """The run's group; ``""`` or null clears it."""

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if (i := next((i for i, t in enumerate(value) if "," in t), None)) is not None:
            raise ValueError(f"tags[{i}]: ',' not allowed (the dashboard separates tags with commas)")
        return list(dict.fromkeys(check_label(t, f"tags[{i}]", MAX_TAG_LEN) for i, t in enumerate(value)))

    @field_validator("notes")
    @classmethod
    def _notes(cls, value: str | None) -> str | None:
        bad = next((c for c in value or "" if unicodedata.category(c) == "Cc" and c not in "\n\r\t"), None)
        if bad is not None:
            raise ValueError(f"notes: control character {bad!r} not allowed (text, newlines and tabs only)")
        return value

    @field_validator("group")
    @classmethod
    def _group(cls, value: str | None) -> str | None:
        return check_label(value, "group", MAX_GROUP_LEN) if value and value.strip() else None


class RunLogs(BaseModel):
    run_id: int
    process: str
    path: str
    lines: list[str]
    """The last ``tail`` lines of the log, oldest first."""


class StatusReport(SQLModel):
    """A status change reported by the run's own processes (or an operator)."""

    status: RunStatus
    reason: str = Field(default="", max_length=2000)


class WorkerCapacity(SQLModel, table=True):
    """The capacity a worker declared when it started (``worker/launchers/capacity.py``); submitted specs must fit
    one."""

    __tablename__ = "worker_capacity"
    name: str = Field(primary_key=True, max_length=255)
    """The worker's name (``WORKER_NAME``, default its host name)."""
    cores: int
    memory_gib: float
    gpus: int
    updated_at: datetime = _ts()


# ----------------------------------------------------------------------------- events


class RunEvent(SQLModel, table=True):
    __tablename__ = "run_events"
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(sa_column=_run_fk())
    time: datetime = _ts()
    kind: str = Field(default="status", max_length=32)
    from_status: str | None = Field(default=None, max_length=16)
    to_status: str | None = Field(default=None, max_length=16)
    reason: str = Field(default="", max_length=2000)
    data: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSONType, nullable=False))


class RunEventPublic(SQLModel):
    id: int
    run_id: int
    time: datetime
    kind: str
    from_status: str | None
    to_status: str | None
    reason: str
    data: dict[str, Any]


class RunEventsPublic(SQLModel):
    data: list[RunEventPublic]
    count: int


# ----------------------------------------------------------------------------- metrics


class Metric(SQLModel, table=True):
    """One scalar of one process at one step. The primary key is the idempotency key."""

    __tablename__ = "metrics"
    __table_args__ = (
        Index("ix_metrics_series", "run_id", "name", "step"),
        Index("ix_metrics_latest", "run_id", "source", "name", "step"),  # the newest point of each series, one probe
    )
    run_id: int = Field(sa_column=Column(Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True))
    source: str = Field(primary_key=True, max_length=32)
    step: int = Field(sa_column=Column(BigInteger, primary_key=True))
    name: str = Field(primary_key=True, max_length=128)
    value: float = Field(sa_column=Column(Float, nullable=False))
    time: float = Field(sa_column=Column(Float, nullable=False))
    """Unix seconds when the process measured it."""


class EngineEvent(BaseModel):
    """One event a run's process wrote into ``events.jsonl`` (``worker.launchers.reporter.EventsForwarder`` sends
    them)."""

    event: EngineEventKind
    time: float = PydanticField(ge=0, le=1e11, allow_inf_nan=False)
    """Unix seconds when the process wrote it; with ``event`` the key that records it once."""
    reason: str = PydanticField("", max_length=2000)
    process: str | None = PydanticField(None, min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_.-]+$")
    data: dict[str, Any] = PydanticField(default_factory=dict)
    """The event's other fields (``step``, ``path``, ``free``, ...): JSON without NaN or infinities."""

    @field_validator("data")
    @classmethod
    def _json(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            text = json.dumps(value, allow_nan=False)
        except ValueError:
            raise ValueError("data: NaN and infinities are not JSON; send null") from None
        if len(text) > 8192:
            raise ValueError(f"data: at most 8192 bytes of JSON, got {len(text)}")
        return value


class EngineEvents(BaseModel):
    events: list[EngineEvent] = PydanticField(max_length=500)


class MetricPoint(BaseModel):
    source: str = PydanticField(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_.-]+$")
    """Process that measured it: ``trainer``, ``orchestrator``, ``eval``, ..."""
    step: int = PydanticField(ge=0, le=2**62)
    name: str = PydanticField(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_./@-]+$")
    value: float
    """Non-finite values (NaN, inf) are stored and come back as null."""
    time: float = PydanticField(ge=0)
    """Unix seconds."""


class MetricBatch(BaseModel):
    points: list[MetricPoint]


class MetricIngestResult(SQLModel):
    received: int
    inserted: int


class MetricSeries(SQLModel):
    source: str
    total: int
    """Points of this series after ``since_step`` before downsampling."""
    step: list[int]
    value: list[float | None]
    """Non-finite values (NaN, inf) come back as null."""
    time: list[float]


class MetricSeriesPublic(SQLModel):
    name: str
    series: list[MetricSeries]


# ----------------------------------------------------------------------------- config revisions


class ConfigRevision(SQLModel, table=True):
    __tablename__ = "config_revisions"
    __table_args__ = (UniqueConstraint("run_id", "revision"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(sa_column=_run_fk())
    revision: int
    changes: dict[str, Any] = Field(sa_column=Column(JSONType, nullable=False))
    """Dotted live key -> new value."""
    applied: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSONType, nullable=False))
    """Process name -> step the revision took effect at."""
    created_by: str = Field(max_length=128)
    created_at: datetime = _ts()


# ----------------------------------------------------------------------------- users, tokens, sessions


class Role(enum.StrEnum):
    """What a user may do (``server/services/permissions.py``): an admin changes every run, a member submits runs
    and changes its own, a viewer reads."""

    admin = "admin"
    member = "member"
    viewer = "viewer"


class User(SQLModel, table=True):
    """A person (or service account) the tokens called ``name`` stand for; runs name it as their ``owner``."""

    __tablename__ = "users"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=128, unique=True)
    role: str = Field(default=Role.member, max_length=8)
    """A :class:`Role` value."""
    created_at: datetime = _ts()


class ApiToken(SQLModel, table=True):
    """A user's bearer token. Only its sha256 is stored; the plain token is shown once, at creation."""

    __tablename__ = "api_tokens"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=128, index=True)
    """The user (``users.name``) the token stands for."""
    token_hash: str = Field(max_length=64, unique=True)
    prefix: str = Field(max_length=16)
    """First characters of the token, to tell tokens apart in listings."""
    scope: str = Field(default="write", max_length=8, sa_column_kwargs={"server_default": "write"})
    """``write`` (read and write) or ``read`` (GET only: dashboards, monitoring)."""
    created_at: datetime = _ts()
    revoked_at: datetime | None = _ts(nullable=True)


class DashboardSession(SQLModel, table=True):
    """A logged-in dashboard session: the cookie carries a random id, only its sha256 is stored here. Logout deletes
    the row, revoking the token deletes the token's rows: the cookie then opens nothing."""

    __tablename__ = "dashboard_sessions"
    id_hash: str = Field(max_length=64, primary_key=True)
    token_id: int = Field(
        sa_column=Column(Integer, ForeignKey("api_tokens.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    created_at: datetime = _ts()
    expires_at: datetime = Field(sa_type=UTCDateTime(), nullable=False)


# ----------------------------------------------------------------------------- sweeps


class SweepStatus(enum.StrEnum):
    running = "running"
    completed = "completed"
    cancelled = "cancelled"


class Sweep(SQLModel, table=True):
    """A sweep (``server/services/sweeps.py``): ordinary runs of one base spec with swept values, pruned on a metric."""

    __tablename__ = "sweeps"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=128, index=True)
    owner: str = Field(max_length=128)
    status: SweepStatus = Field(default=SweepStatus.running, sa_type=String(16), index=True)
    status_reason: str = Field(default="", max_length=2000)
    spec: dict[str, Any] = Field(sa_column=Column(JSONType, nullable=False))
    """The validated sweep spec (base spec inline)."""
    decided: list[int] = Field(default_factory=list, sa_column=Column(JSONType, nullable=False))
    """Pruning steps (rungs) already decided."""
    created_at: datetime = _ts()
    updated_at: datetime = _ts()
    finished_at: datetime | None = _ts(nullable=True)


class SweepTrial(SQLModel, table=True):
    """One point of a sweep: its swept values and, once started, the run that trains it (the run's pointer back)."""

    __tablename__ = "sweep_trials"
    __table_args__ = (UniqueConstraint("sweep_id", "index"),)
    id: int | None = Field(default=None, primary_key=True)
    sweep_id: int = Field(
        sa_column=Column(Integer, ForeignKey("sweeps.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    index: int
    params: dict[str, Any] = Field(sa_column=Column(JSONType, nullable=False))
    """Dotted spec key -> value of this trial."""
    run_id: int | None = Field(
        default=None, sa_column=Column(Integer, ForeignKey("runs.id", ondelete="SET NULL"), nullable=True, index=True)
    )
    status: str = Field(default="pending", max_length=16)
    """``server.services.sweeps.TrialStatus``."""
    pruned_step: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    held_step: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    """The rung (trainer step) a ``waiting`` trial is held at until the rung is decided; None otherwise."""
    reason: str = Field(default="", max_length=2000)


# ----------------------------------------------------------------------------- pipelines


class PipelineStatus(enum.StrEnum):
    running = "running"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"


class Pipeline(SQLModel, table=True):
    """A pipeline (``server/services/pipelines.py``): stages run one after another, each an ordinary run that starts
    from an earlier stage's final weights."""

    __tablename__ = "pipelines"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=128, index=True)
    owner: str = Field(max_length=128)
    status: PipelineStatus = Field(default=PipelineStatus.running, sa_type=String(16), index=True)
    status_reason: str = Field(default="", max_length=2000)
    spec: dict[str, Any] = Field(sa_column=Column(JSONType, nullable=False))
    """The validated pipeline spec (each stage's base spec inline)."""
    created_at: datetime = _ts()
    updated_at: datetime = _ts()
    finished_at: datetime | None = _ts(nullable=True)


class PipelineStage(SQLModel, table=True):
    """One stage of a pipeline and, once started, the run that does it (the run's ``pipeline`` event points back)."""

    __tablename__ = "pipeline_stages"
    __table_args__ = (UniqueConstraint("pipeline_id", "index"),)
    id: int | None = Field(default=None, primary_key=True)
    pipeline_id: int = Field(
        sa_column=Column(Integer, ForeignKey("pipelines.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    index: int
    kind: str = Field(max_length=16)
    run_id: int | None = Field(
        default=None, sa_column=Column(Integer, ForeignKey("runs.id", ondelete="SET NULL"), nullable=True, index=True)
    )
    status: str = Field(default="pending", max_length=16)
    """``server.services.pipelines.StageStatus``."""
    reason: str = Field(default="", max_length=2000)
