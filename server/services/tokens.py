"""Bearer tokens.

- User tokens (``asr_<random>``) are created by ``asyncrl token create``; only their sha256 is stored.
- Run tokens (``asr_run_<id>_<hmac>``) are derived from the server secret and the run id, so a redelivered
  launch hands the processes the same token and nothing about them is stored. They write only to their run.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from sqlmodel import Session, col, select

from server.core.config import settings
from server.models import ApiToken, utcnow

_RUN_TOKEN = re.compile(r"^asr_run_(\d+)_([0-9a-f]{64})$")


class AuthError(Exception):
    """Missing, malformed, unknown or revoked token."""


@dataclass(frozen=True)
class Principal:
    name: str
    run_id: int | None = None
    """Set for run tokens: the only run this principal may write to."""
    read_only: bool = False
    """Read tokens (scope ``read``): every request other than GET/HEAD/OPTIONS is refused with 403."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


SCOPES = ("write", "read")


def create(session: Session, *, name: str, scope: str = "write") -> tuple[ApiToken, str]:
    """A new user token; returns the row and the plain token (shown once, never stored).

    Raises:
        ValueError: ``scope`` is not one of ``SCOPES``.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope: expected one of {', '.join(SCOPES)}, got {scope!r}")
    plain = "asr_" + secrets.token_urlsafe(32)
    row = ApiToken(name=name, token_hash=hash_token(plain), prefix=plain[:10], scope=scope)
    session.add(row)
    session.flush()
    return row, plain


def revoke(session: Session, *, name: str) -> int:
    """Revoke every live token called ``name``; returns how many."""
    rows = session.exec(select(ApiToken).where(ApiToken.name == name, col(ApiToken.revoked_at).is_(None))).all()
    for row in rows:
        row.revoked_at = utcnow()
        session.add(row)
    session.flush()
    return len(rows)


def run_token(run_id: int) -> str:
    mac = hmac.new(settings.secret_key().encode(), f"run-token:{run_id}".encode(), hashlib.sha256).hexdigest()
    return f"asr_run_{run_id}_{mac}"


def authenticate(session: Session, token: str) -> Principal:
    """The principal a bearer token stands for.

    Raises:
        AuthError: unknown, malformed or revoked token.
    """
    m = _RUN_TOKEN.match(token)
    if m:
        run_id = int(m.group(1))
        if not hmac.compare_digest(token, run_token(run_id)):
            raise AuthError("invalid token")
        return Principal(name=f"run-{run_id}", run_id=run_id)
    row = session.exec(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).first()
    if row is None:
        raise AuthError("invalid token")
    if row.revoked_at is not None:
        raise AuthError(f"token '{row.name}' was revoked")
    return Principal(name=row.name, read_only=row.scope == "read")
