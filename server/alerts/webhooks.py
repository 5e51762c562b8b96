"""Webhook endpoints and deliveries.

- **SSRF guard** (``check_url``): the URL's host is resolved and every address checked, at creation and again
  before each attempt. Link-local (169.254/16, fe80::/10) and cloud metadata (169.254.169.254, fd00:ec2::254,
  100.100.100.200, metadata.google.internal) are refused unless listed in ``WEBHOOK_ALLOW_HOSTS``; loopback,
  unspecified, private and shared-address-space (100.64.0.0/10) addresses unless listed there or the admin set
  ``WEBHOOK_ALLOW_PRIVATE``. IPv6 forms that embed an IPv4 address (IPv4-mapped, NAT64, 6to4, Teredo,
  IPv4-compatible) are judged by that address too. Redirects are not followed.
- **Delivery errors** (``last_error``): a receiver's answer body is kept (its first 200 characters) only from a
  public address, never from an internal one (loopback, private, link-local: the guard let it through by a
  setting); the whole error is shown to the endpoint's owner and admins, others see only ``HTTP <code>`` or the
  error's kind (:func:`public_delivery`).
- **Secret**: stored encrypted (Fernet, key derived from SECRET_KEY) because the server must sign with it; the
  API shows it once, at creation, and a prefix after. It is never logged.
- **Signature**: ``X-Asyncrl-Signature: t=<unix s>,v1=<hex HMAC-SHA256(secret, f"{t}.{body}")>``.
- **Idempotency**: each delivery has an ``Idempotency-Key`` header, the same on every retry, redelivery and
  replay; a receiver that dedups on it sees each event once, even when a worker is killed mid-request.
- **Retries**: the Celery task retries a failed attempt (non-2xx, connection error) after
  ``min(WEBHOOK_BACKOFF_BASE_S * 2**(attempts-1), WEBHOOK_BACKOFF_MAX_S)`` seconds, up to
  ``WEBHOOK_MAX_ATTEMPTS`` attempts. ``delivered`` is committed before the task is acked, and a redelivered task
  whose delivery is no longer ``pending`` does nothing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import time
import uuid
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from cryptography.fernet import Fernet
from sqlalchemy import event
from sqlalchemy.orm import Session as OrmSession
from sqlmodel import Session, col, func, select

from server.alerts.models import (
    AlertEvent,
    DeliveryPublic,
    EndpointCreate,
    EndpointPublic,
    WebhookDelivery,
    WebhookEndpoint,
)
from server.core.config import settings
from server.core.db import serialize
from server.jobs.celery_app import TaskName, enqueue
from server.models import Run, utcnow
from worker.spec import SpecError

logger = logging.getLogger("asyncrl.webhooks")
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.google.internal."})
METADATA_IPS = frozenset(
    {
        ipaddress.ip_address("169.254.169.254"),
        ipaddress.ip_address("fd00:ec2::254"),
        ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud, in the shared address space below
    }
)
SHARED_ADDRESS_SPACE = ipaddress.ip_network("100.64.0.0/10")
"""RFC 6598 carrier-grade NAT space (neither private nor global to ``ipaddress``): internal to a provider."""
SIGNATURE_HEADER = "X-Asyncrl-Signature"


MAX_ENDPOINTS_PER_USER = 20
"""Webhook endpoints one user may add: every alert event is posted to each endpoint whose filter matches."""


class UnsafeURL(ValueError):
    """A webhook URL the SSRF guard refuses; the message starts with ``url:``."""


class NotFound(LookupError):
    pass


class StillRetrying(RuntimeError):
    """A replay of a delivery that has not ended yet (``pending``: its retry chain is still running)."""


SECRET_PREFIX_CHARS = 4
"""Characters of a signing secret shown after creation (enough to tell secrets apart, too few to guess one)."""


def redact_url(url: str) -> str:
    """``scheme://host[:port]/…`` without path, query or credentials (for read-only tokens: the URL may be the
    credential, as with Slack incoming webhooks)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}/…"


def public_endpoint(row: WebhookEndpoint, *, read_only: bool) -> EndpointPublic:
    """The endpoint as shown to a principal: URL redacted for ``read_only`` (all but its owner and admins:
    ``permissions.owns``), secret prefix at most 4 characters."""
    shown = EndpointPublic.model_validate(row)
    shown.secret_prefix = shown.secret_prefix[:SECRET_PREFIX_CHARS]
    if read_only:
        shown.url = redact_url(shown.url)
    return shown


def redact_error(error: str) -> str:
    """What a delivery's ``last_error`` shows to users other than its endpoint's owner and admins: ``HTTP 500``
    without the answer, the kind of a connection error (``ConnectError``), or that the SSRF guard refused it."""
    if error.startswith("HTTP "):
        return error.split(":", 1)[0].split(" (", 1)[0]
    if error.startswith("url: "):
        return "refused by the SSRF guard"
    head, colon, _ = error.partition(":")
    if not colon:  # a fixed message of ours, e.g. "endpoint disabled"
        return error
    return head if head.isidentifier() else "error"


def public_delivery(row: WebhookDelivery, *, read_only: bool) -> DeliveryPublic:
    """A delivery as shown to a principal: ``last_error`` whole (at most 2000 characters, an answer body at most
    200) to its endpoint's owner and admins, :func:`redact_error` for ``read_only`` (everyone else)."""
    shown = DeliveryPublic.model_validate(row)
    if read_only:
        shown.last_error = redact_error(shown.last_error)
    return shown


NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
"""The well-known NAT64 prefix (RFC 6052 section 2.1): the last 32 bits are the IPv4 address."""
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
"""Deprecated IPv4-compatible addresses ``::a.b.c.d`` (RFC 4291 section 2.5.5.1); ``::`` and ``::1`` are not."""


def embedded_ipv4(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries, which a host on the path may route to: IPv4-mapped
    ``::ffff:a.b.c.d`` (``ipv4_mapped``), NAT64 ``64:ff9b::a.b.c.d``, 6to4 ``2002:AABB:CCDD::/48``
    (``sixtofour``), Teredo ``2001:0::/32`` (``teredo``: server and client) and IPv4-compatible ``::a.b.c.d``.
    Empty for an IPv4 address or a plain IPv6 one."""
    if isinstance(ip, ipaddress.IPv4Address):
        return []
    found = [ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())]
    if ip in NAT64 or (ip in IPV4_COMPATIBLE and int(ip) > 1):
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return [v4 for v4 in found if v4 is not None]


def _refusal(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why the guard refuses ``ip`` itself (not what it embeds), or None."""
    if ip in METADATA_IPS:
        return "a cloud metadata address (allow it in WEBHOOK_ALLOW_HOSTS)"
    if ip.is_link_local:
        return "a link-local address (allow it in WEBHOOK_ALLOW_HOSTS)"
    if settings.WEBHOOK_ALLOW_PRIVATE:
        return None
    if ip.is_loopback or ip.is_unspecified:
        return f"a loopback address ({_PRIVATE_SETTINGS})"
    if ip.is_private:
        return f"a private address ({_PRIVATE_SETTINGS})"
    if ip in SHARED_ADDRESS_SPACE:
        return f"a shared address space address, 100.64.0.0/10 ({_PRIVATE_SETTINGS})"
    return None


_PRIVATE_SETTINGS = "allowed only with WEBHOOK_ALLOW_PRIVATE or in WEBHOOK_ALLOW_HOSTS"


def _internal(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``ip`` (or an IPv4 address it embeds) is not a public address: its answers stay with admins."""
    return any(not a.is_global or a in SHARED_ADDRESS_SPACE for a in (ip, *embedded_ipv4(ip)))


def check_url(url: str) -> bool:
    """Resolve ``url``'s host and refuse it if any address is link-local or cloud metadata (unless allow-listed in
    ``WEBHOOK_ALLOW_HOSTS``), or loopback/unspecified/private/shared unless ``WEBHOOK_ALLOW_PRIVATE`` or
    allow-listed. An IPv6 address that embeds IPv4 addresses (:func:`embedded_ipv4`) is judged by those. Returns
    whether any address it resolves to is internal (not public): its answer bodies are not kept.

    Raises:
        UnsafeURL: one line starting with ``url:`` naming the host and the reason (also when it does not resolve),
            e.g. ``url: 2002:a9fe:a9fe:: resolves to 2002:a9fe:a9fe:: (IPv4 169.254.169.254), a cloud metadata
            address (allow it in WEBHOOK_ALLOW_HOSTS)``.
    """
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme not in {"http", "https"} or not host:
        raise UnsafeURL(f"url: expected an http(s) URL with a host, got {url!r}")
    allowed = {h.lower() for h in settings.WEBHOOK_ALLOW_HOSTS}
    if host in METADATA_HOSTS and host not in allowed:
        raise UnsafeURL(f"url: {host} is a cloud metadata service (allow it in WEBHOOK_ALLOW_HOSTS)")
    try:
        infos = socket.getaddrinfo(
            host, parts.port or (443 if parts.scheme == "https" else 80), type=socket.SOCK_STREAM
        )
    except (socket.gaierror, UnicodeError) as err:
        raise UnsafeURL(f"url: host {host} does not resolve ({err})") from None
    ips = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    internal = any(_internal(ip) for ip in ips)
    if host in allowed:
        return internal
    for ip in ips:
        embedded: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = list(embedded_ipv4(ip))
        for judged in embedded or [ip]:  # the outer prefix (e.g. 2001::/23) says nothing of the target
            if str(judged) in allowed:
                continue
            reason = _refusal(judged)
            if reason is not None:
                shown = f"{ip} (IPv4 {judged})" if judged is not ip else str(ip)
                raise UnsafeURL(f"url: {host} resolves to {shown}, {reason}")
    return internal


# ----------------------------------------------------------------------------- secrets and signatures


def _fernet() -> Fernet:
    key = hashlib.sha256(b"asyncrl webhook secrets\0" + settings.secret_key().encode()).digest()
    return Fernet(base64.urlsafe_b64encode(key))


def reveal_secret(endpoint: WebhookEndpoint) -> str:
    """The endpoint's plain signing secret (decrypted with the key derived from SECRET_KEY)."""
    return _fernet().decrypt(endpoint.secret_encrypted.encode()).decode()


def signature(secret: str, body: bytes, timestamp: int) -> str:
    """Value of the ``X-Asyncrl-Signature`` header for ``body`` sent at ``timestamp`` (unix seconds)."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(secret: str, body: bytes, header: str, tolerance_s: float = 300.0) -> bool:
    """Receiver side: whether ``header`` signs ``body`` with ``secret`` and its time is within ``tolerance_s``."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    if not fields.get("t", "").isdigit() or abs(time.time() - int(fields["t"])) > tolerance_s:
        return False
    return hmac.compare_digest(signature(secret, body, int(fields["t"])), header)


# ----------------------------------------------------------------------------- endpoints


def create_endpoint(session: Session, body: EndpointCreate, *, by: str) -> tuple[WebhookEndpoint, str]:
    """Add an endpoint; returns it and its plain secret (given or generated). Flushes only.

    Raises:
        UnsafeURL: the SSRF guard refuses the URL.
        SpecError: ``by`` has ``MAX_ENDPOINTS_PER_USER`` endpoints already (every alert is posted to each).
    """
    url = str(body.url)
    check_url(url)
    serialize(session, f"asyncrl:webhook-endpoints:{by}")
    n = int(
        session.exec(select(func.count()).select_from(WebhookEndpoint).where(WebhookEndpoint.created_by == by)).one()
    )
    if n >= MAX_ENDPOINTS_PER_USER:
        raise SpecError(
            f"webhooks: {by} has {n} webhook endpoints, the most one user may add ({MAX_ENDPOINTS_PER_USER})"
        )
    secret = body.secret or f"whsec_{secrets.token_urlsafe(24)}"
    row = WebhookEndpoint(
        name=body.name or urlsplit(url).hostname or "",
        url=url,
        secret_encrypted=_fernet().encrypt(secret.encode()).decode(),
        secret_prefix=secret[:SECRET_PREFIX_CHARS],
        events=list(body.events),
        format=body.format,
        created_by=by,
    )
    session.add(row)
    session.flush()
    return row, secret


def get_endpoint(session: Session, endpoint_id: int) -> WebhookEndpoint:
    """Raises: NotFound."""
    row = session.get(WebhookEndpoint, endpoint_id) if 0 < endpoint_id < 2**31 else None
    if row is None:
        raise NotFound(f"webhook endpoint {endpoint_id} not found")
    return row


def list_endpoints(session: Session) -> list[WebhookEndpoint]:
    """Every endpoint, oldest first."""
    return list(session.exec(select(WebhookEndpoint).order_by(col(WebhookEndpoint.id))).all())


# ----------------------------------------------------------------------------- deliveries


def deliveries(
    session: Session, endpoint: WebhookEndpoint, *, offset: int = 0, limit: int = 100
) -> tuple[list[WebhookDelivery], int]:
    """The delivery log of ``endpoint``, newest first; returns (page, total)."""
    where = WebhookDelivery.endpoint_id == endpoint.id
    total = session.exec(select(func.count()).select_from(WebhookDelivery).where(where)).one()
    rows = session.exec(
        select(WebhookDelivery).where(where).order_by(col(WebhookDelivery.id).desc()).offset(offset).limit(limit)
    ).all()
    return list(rows), int(total)


def _payload(endpoint: WebhookEndpoint, ev: AlertEvent, run: Run, key: str) -> str:
    if endpoint.format == "slack":
        return json.dumps({"text": f"[asyncrl] run {run.id} ({run.name}): {ev.message}"})
    return json.dumps(
        {
            "id": key,
            "event": ev.kind,
            "state": ev.state,
            "alert_event_id": ev.id,
            "rule_id": ev.rule_id,
            "run": {"id": run.id, "name": run.name, "status": str(run.status)},
            "step": ev.step,
            "message": ev.message,
            "data": ev.data,
            "time": ev.time.isoformat(),
        },
        sort_keys=True,
    )


def fan_out(session: Session, ev: AlertEvent, run: Run) -> list[WebhookDelivery]:
    """A pending delivery of fired event ``ev`` to every enabled endpoint whose filter has its kind; each is
    enqueued after the session's next commit. Flushes only."""
    endpoints = session.exec(select(WebhookEndpoint).where(col(WebhookEndpoint.enabled))).all()
    assert ev.id is not None  # flushed by the caller
    rows = []
    for endpoint in endpoints:
        if ev.kind not in endpoint.events:
            continue
        assert endpoint.id is not None  # a stored row
        key = uuid.uuid4().hex
        row = WebhookDelivery(
            endpoint_id=endpoint.id, event_id=ev.id, idempotency_key=key, body=_payload(endpoint, ev, run, key)
        )
        session.add(row)
        rows.append(row)
    session.flush()
    session.info.setdefault("asyncrl_deliveries", []).extend(r.id for r in rows)
    return rows


def replay(session: Session, delivery_id: int) -> WebhookDelivery:
    """Send a delivery again (same body and idempotency key, attempts start over); enqueued after the commit.

    Raises:
        NotFound: no such delivery.
        StillRetrying: the delivery is still ``pending`` (a second chain would share its attempt budget).
    """
    row = session.get(WebhookDelivery, delivery_id, with_for_update=True) if 0 < delivery_id < 2**31 else None
    if row is None:
        raise NotFound(f"delivery {delivery_id} not found")
    if row.status == "pending":
        raise StillRetrying(
            f"delivery {delivery_id} is still being retried (attempt {row.attempts} of "
            f"{settings.WEBHOOK_MAX_ATTEMPTS}); replay it once it has ended"
        )
    row.status, row.attempts, row.replays, row.updated_at = "pending", 0, row.replays + 1, utcnow()
    session.add(row)
    session.flush()
    session.info.setdefault("asyncrl_deliveries", []).append(row.id)
    return row


@event.listens_for(OrmSession, "after_commit")
def _enqueue_after_commit(session: OrmSession) -> None:
    ids = session.info.pop("asyncrl_deliveries", [])
    for delivery_id in ids:
        try:
            enqueue(TaskName.deliver_webhook, delivery_id)
        except Exception as err:  # the row stays pending; a replay sends it
            logger.error("could not enqueue delivery %s: %s", delivery_id, err)


@event.listens_for(OrmSession, "after_rollback")
def _forget_after_rollback(session: OrmSession) -> None:
    session.info.pop("asyncrl_deliveries", None)


def requeue_stuck(session: Session, now: datetime | None = None) -> list[int]:
    """Pending deliveries untouched for longer than any retry waits (``2 * WEBHOOK_BACKOFF_MAX_S +
    WEBHOOK_TIMEOUT_S``): their task was lost (enqueueing failed after the commit, or the broker lost it). They
    are enqueued again after the caller's commit (a duplicate send carries the same key). Returns their ids."""
    cutoff = (now or utcnow()) - timedelta(seconds=2 * settings.WEBHOOK_BACKOFF_MAX_S + settings.WEBHOOK_TIMEOUT_S)
    stmt = select(WebhookDelivery.id).where(
        WebhookDelivery.status == "pending", col(WebhookDelivery.updated_at) < cutoff
    )
    ids = [i for i in session.exec(stmt.order_by(col(WebhookDelivery.id)).limit(1000)).all() if i is not None]
    session.info.setdefault("asyncrl_deliveries", []).extend(ids)
    return ids


def backoff_s(attempts: int) -> float:
    """Seconds before the next try after ``attempts`` failed ones."""
    return float(min(settings.WEBHOOK_BACKOFF_BASE_S * 2 ** (attempts - 1), settings.WEBHOOK_BACKOFF_MAX_S))


def _finish(session: Session, row: WebhookDelivery, **fields: Any) -> None:
    for name, value in fields.items():
        setattr(row, name, value)
    row.updated_at = utcnow()
    session.add(row)
    session.commit()


def attempt(session: Session, delivery_id: int) -> tuple[str, float | None]:
    """One attempt of a pending delivery: returns (outcome, seconds until the next try or None).

    Outcomes: ``skipped`` (missing, or no longer pending: a redelivered task after success), ``delivered``,
    ``retry``, ``failed`` (refused by the SSRF guard, endpoint gone or disabled, or attempts used up).
    The attempt count is committed before the request; the outcome right after it.
    """
    row = session.get(WebhookDelivery, delivery_id)
    if row is None or row.status != "pending":
        return f"skipped: delivery {delivery_id} is {row.status if row else 'gone'}", None
    endpoint = session.get(WebhookEndpoint, row.endpoint_id)
    if endpoint is None or not endpoint.enabled:
        _finish(session, row, status="failed", last_error="endpoint disabled")
        return f"failed: delivery {delivery_id}: endpoint disabled", None
    try:
        internal = check_url(endpoint.url)
    except UnsafeURL as err:
        _finish(session, row, status="failed", last_error=str(err))
        return f"failed: delivery {delivery_id}: {err}", None
    url, secret, body, key = endpoint.url, reveal_secret(endpoint), row.body.encode(), row.idempotency_key
    _finish(session, row, attempts=row.attempts + 1)
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": key,
        "User-Agent": "asyncrl-webhooks/1",
        SIGNATURE_HEADER: signature(secret, body, int(time.time())),
    }
    start, code, error = time.perf_counter(), None, ""
    try:
        resp = httpx.post(
            url, content=body, headers=headers, timeout=settings.WEBHOOK_TIMEOUT_S, follow_redirects=False
        )
        code = resp.status_code
        if not 200 <= code < 300:  # an internal service's answer is not kept: it could be anything of it
            error = f"HTTP {code}" + (" (body not kept: an internal address)" if internal else f": {resp.text[:200]}")
    except httpx.HTTPError as err:
        error = f"{type(err).__name__}: {err}"[:2000]
    latency = round((time.perf_counter() - start) * 1000, 2)
    session.refresh(row)
    if not error:
        _finish(
            session, row, status="delivered", status_code=code, latency_ms=latency, last_error="", delivered_at=utcnow()
        )
        return f"delivered: delivery {delivery_id} attempt {row.attempts} HTTP {code}", None
    done = row.attempts >= settings.WEBHOOK_MAX_ATTEMPTS
    _finish(
        session, row, status="failed" if done else row.status, status_code=code, latency_ms=latency, last_error=error
    )
    if done:
        return f"failed: delivery {delivery_id} after {row.attempts} attempts: {error}", None
    return f"retry: delivery {delivery_id} attempt {row.attempts}: {error}", backoff_s(row.attempts)
