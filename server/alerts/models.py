"""Tables of alerts and webhooks (created by ``migrations/versions/0003_alerts.py``) and their API shapes.

- ``alert_rules``: a rule (``worker/tracking/alert_rules.py``) for every run (``run_id`` null) or one run.
- ``alert_states``: per (rule, run): whether the rule holds now and the last step checked, so a rule fires
  once per episode, also across server restarts.
- ``alert_events``: each time a rule started holding (``fired``) or stopped (``cleared``).
- ``webhook_endpoints``: URL, encrypted secret (the server signs with it), event filter, payload format.
- ``webhook_deliveries``: one per (fired event, endpoint): body, idempotency key, attempts, outcome.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, RootModel, UrlConstraints
from pydantic import Field as PydanticField
from pydantic.config import JsonDict
from sqlalchemy import BigInteger, Boolean, Column, ForeignKey, Integer, Text
from sqlmodel import Field, SQLModel

from server.models import JSONType, _ts
from worker.tracking.alert_rules import EVENT_KINDS, AlertRule

T = TypeVar("T")


def _fk(table: str, nullable: bool = False) -> Any:
    return Field(
        default=None if nullable else ...,
        sa_column=Column(Integer, ForeignKey(f"{table}.id", ondelete="CASCADE"), nullable=nullable, index=True),
    )


class _Owned(SQLModel):
    """Columns of what a user adds (rules, webhook endpoints): on/off, by whom and when."""

    enabled: bool = Field(default=True, nullable=False)
    created_by: str = Field(max_length=128)
    created_at: datetime = _ts()


class AlertRuleRow(_Owned, table=True):
    __tablename__ = "alert_rules"
    id: int | None = Field(default=None, primary_key=True)
    run_id: int | None = _fk("runs", nullable=True)
    """Null: the rule applies to every run."""
    kind: str = Field(max_length=16)
    rule: dict[str, Any] = Field(sa_column=Column(JSONType, nullable=False))
    """The validated rule (``worker.tracking.alert_rules.AlertRule``) as JSON."""
    origin: str = Field(default="api", max_length=8)
    """``api`` or ``spec`` (from the run spec's ``alerts`` list)."""


class AlertState(SQLModel, table=True):
    __tablename__ = "alert_states"
    rule_id: int = Field(sa_column=Column(Integer, ForeignKey("alert_rules.id", ondelete="CASCADE"), primary_key=True))
    run_id: int = Field(sa_column=Column(Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True))
    holding: bool = Field(default=False, sa_column=Column(Boolean, nullable=False))
    last_step: int = Field(default=-1, sa_column=Column(BigInteger, nullable=False))
    """Newest step evaluated: replays and late points of older steps do not re-open an episode."""
    episodes: int = 0
    updated_at: datetime = _ts()


class AlertEvent(SQLModel, table=True):
    __tablename__ = "alert_events"
    id: int | None = Field(default=None, primary_key=True)
    rule_id: int | None = _fk("alert_rules", nullable=True)
    """Null: a built-in rule's event (``worker.tracking.alert_rules.BUILTIN_RULES``, its ``kind``)."""
    run_id: int = _fk("runs")
    kind: str = Field(max_length=16)
    state: str = Field(max_length=8)
    """``fired`` or ``cleared``."""
    step: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    message: str = Field(max_length=2000)
    data: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSONType, nullable=False))
    time: datetime = _ts()


class WebhookEndpoint(_Owned, table=True):
    __tablename__ = "webhook_endpoints"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=128)
    url: str = Field(max_length=2048)
    secret_encrypted: str = Field(sa_column=Column(Text, nullable=False))
    """Fernet token of the secret under a key derived from SECRET_KEY (the secret must be recoverable to sign)."""
    secret_prefix: str = Field(max_length=16)
    events: list[str] = Field(sa_column=Column(JSONType, nullable=False))
    format: str = Field(default="json", max_length=8)


class WebhookDelivery(SQLModel, table=True):
    __tablename__ = "webhook_deliveries"
    id: int | None = Field(default=None, primary_key=True)
    endpoint_id: int = _fk("webhook_endpoints")
    event_id: int = _fk("alert_events")
    idempotency_key: str = Field(max_length=64, unique=True)
    body: str = Field(sa_column=Column(Text, nullable=False))
    """Exactly the bytes sent (UTF-8), the same on every attempt."""
    status: str = Field(default="pending", max_length=10)
    """``pending`` (queued or between attempts), ``delivered`` or ``failed`` (attempts used up, or refused)."""
    attempts: int = 0
    status_code: int | None = None
    latency_ms: float | None = None
    last_error: str = Field(default="", max_length=2000)
    replays: int = 0
    created_at: datetime = _ts()
    updated_at: datetime = _ts()
    delivered_at: datetime | None = _ts(nullable=True)


# ----------------------------------------------------------------------------- API shapes


class _Public(BaseModel):
    """An API shape read from a table row."""

    model_config = ConfigDict(from_attributes=True)


class _OwnedPublic(_Public):
    enabled: bool
    created_by: str
    created_at: datetime


_RULE_EXAMPLE: JsonDict = {"kind": "threshold", "metric": "mismatch_kl", "op": ">", "value": 0.01, "window": 3}


class RuleIn(RootModel[AlertRule]):
    """One rule; ``kind`` picks its fields (``worker/tracking/alert_rules.py``)."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [_RULE_EXAMPLE, {"kind": "status", "statuses": ["failed"]}]}
    )


class RulePublic(_OwnedPublic):
    id: int
    run_id: int | None
    kind: str
    rule: dict[str, Any]
    origin: str


class RuleUpdate(BaseModel):
    """``PATCH /api/alerts/rules/{id}``: enable/disable, or replace the rule (e.g. a new threshold; same kind)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool | None = None
    rule: AlertRule | None = None


class AlertEventPublic(_Public):
    id: int
    rule_id: int | None
    """Null: a built-in rule (``worker.tracking.alert_rules.BUILTIN_RULES``)."""
    run_id: int
    kind: str
    state: str
    step: int | None
    message: str
    data: dict[str, Any]
    time: datetime


EventName = Literal[EVENT_KINDS]  # type: ignore[valid-type]  # mypy takes no Literal from a tuple; pydantic does


class EndpointCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = PydanticField("", max_length=128)
    url: Annotated[AnyHttpUrl, UrlConstraints(max_length=2048)]
    """At most 2048 characters (the column's size)."""
    secret: str | None = PydanticField(None, min_length=16, max_length=256)
    """Signing secret; default: one is generated and returned once, in this response."""
    events: list[EventName] = PydanticField(default_factory=lambda: list(EVENT_KINDS), min_length=1)
    """Rule kinds (and built-in ones, ``worker.tracking.alert_rules.BUILTIN_RULES``) whose firing is posted here."""
    format: Literal["json", "slack"] = "json"
    """``json``: the event as an object; ``slack``: ``{"text": "<message>"}`` (Slack/Mattermost incoming hooks)."""


class EndpointPublic(_OwnedPublic):
    id: int
    name: str
    url: str
    secret_prefix: str
    events: list[str]
    format: str


class EndpointCreated(EndpointPublic):
    secret: str
    """The signing secret; shown only in this response."""


class DeliveryPublic(_Public):
    id: int
    endpoint_id: int
    event_id: int
    idempotency_key: str
    status: str
    attempts: int
    status_code: int | None
    latency_ms: float | None
    last_error: str
    replays: int
    created_at: datetime
    updated_at: datetime
    delivered_at: datetime | None


class Page(BaseModel, Generic[T]):
    data: list[T]
    count: int
