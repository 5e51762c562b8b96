"""Users, bearer tokens and dashboard sessions.

- Users (``users``) have a role (:class:`~server.models.Role`); what each role may do is decided in
  ``server/services/permissions.py``.
- User tokens (``asr_<random>``) are created by ``asyncrl token create``; only their sha256 is stored. A token
  stands for the user of its ``name``.
- Run tokens (``asr_run_<id>_<hmac>``) are derived from the server secret, the run id and the run's random
  ``token_nonce`` (stored with the run), so a redelivered launch hands the processes the same token, and the token of
  a deleted run opens no later run (ids are never reused either: ``migrations/versions/0006_run_ids_never_reused.py``).
  They write only to their run, and only while it is live (``permissions.require_run``).
- Dashboard sessions (``dashboard_sessions``): a random id in the signed cookie, its sha256 stored; logout deletes
  the row, revoking a token deletes its rows, so an old cookie opens nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta

from sqlmodel import Session, col, delete, func, select

from server.core.config import settings
from server.models import ApiToken, DashboardSession, Role, Run, User, check_label, stored_id, utcnow

MAX_USER_NAME = 128
"""The longest user (token) name: ``users.name`` holds 128 characters."""

_RUN_TOKEN = re.compile(r"^asr_run_(\d+)_([0-9a-f]{64})$")


class AuthError(Exception):
    """Missing, malformed, unknown or revoked token."""


@dataclass(frozen=True)
class Principal:
    name: str
    run_id: int | None = None
    """Set for run tokens: the only run this principal may write to."""
    read_only: bool = False
    """Read tokens (scope ``read``) and viewers: every request other than GET/HEAD/OPTIONS is refused with 403."""
    role: Role = Role.member
    """The user's role (run tokens: ``member``; they are checked by their ``run_id``)."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


SCOPES = ("write", "read")
ROLES = tuple(r.value for r in Role)


def _role(role: str) -> Role:
    if role not in ROLES:
        raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {role!r}")
    return Role(role)


def user(session: Session, name: str) -> User | None:
    return session.exec(select(User).where(User.name == name)).first()


def ensure_user(session: Session, name: str, role: str | None = None) -> User:
    """The user called ``name``, created if new: with ``role``, or by default ``admin`` for the installation's first
    user (the quick start's ``asyncrl token create --name me`` can then do everything) and ``member`` after that.

    Raises:
        ValueError: ``role`` is not a role, or differs from the existing user's (changing a role is ``set_role``).
    """
    wanted = _role(role) if role is not None else None
    row = user(session, name)
    if row is not None:
        if wanted is not None and wanted != row.role:
            raise ValueError(
                f"role: user {name!r} is already {row.role}; change a role with "
                f"`asyncrl token role --name {name} --role {wanted.value}`"
            )
        return row
    if wanted is None:
        wanted = Role.admin if session.exec(select(func.count()).select_from(User)).one() == 0 else Role.member
    row = User(name=name, role=wanted)
    session.add(row)
    session.flush()
    return row


def set_role(session: Session, *, name: str, role: str) -> User:
    """Give the user ``name`` the role ``role`` (effective on their next request, dashboard sessions included).

    Raises:
        ValueError: no such user, or ``role`` is not a role.
    """
    wanted = _role(role)
    row = user(session, name)
    if row is None:
        raise ValueError(f"name: no user called {name!r}")
    row.role = wanted
    session.add(row)
    session.flush()
    return row


def create(session: Session, *, name: str, scope: str = "write", role: str | None = None) -> tuple[ApiToken, str]:
    """A new user token of the user ``name`` (created if new, see :func:`ensure_user`); returns the row and the
    plain token (shown once, never stored).

    Raises:
        ValueError: ``name`` empty, longer than 128 characters, with a control character or surrounding spaces
            (``models.check_label``); ``scope`` is not one of ``SCOPES``, or ``role`` as in :func:`ensure_user`.
    """
    if check_label(name, "name", MAX_USER_NAME) != name:
        raise ValueError(f"name: no leading or trailing spaces, got {name!r}")
    if scope not in SCOPES:
        raise ValueError(f"scope: expected one of {', '.join(SCOPES)}, got {scope!r}")
    ensure_user(session, name, role)
    plain = "asr_" + secrets.token_urlsafe(32)
    row = ApiToken(name=name, token_hash=hash_token(plain), prefix=plain[:10], scope=scope)
    session.add(row)
    session.flush()
    return row, plain


def revoke(session: Session, *, name: str) -> int:
    """Revoke every live token called ``name`` and end their dashboard sessions; returns how many tokens."""
    rows = session.exec(select(ApiToken).where(ApiToken.name == name, col(ApiToken.revoked_at).is_(None))).all()
    for row in rows:
        row.revoked_at = utcnow()
        session.add(row)
    ids = [row.id for row in rows]
    if ids:
        session.exec(delete(DashboardSession).where(col(DashboardSession.token_id).in_(ids)))
    session.flush()
    return len(rows)


def run_token(run: Run) -> str:
    """The run token of ``run``: ``asr_run_<id>_<hex HMAC-SHA256 of the id and the run's token_nonce>``."""
    return _run_token(stored_id(run), run.token_nonce)


def _run_token(run_id: int, nonce: str) -> str:
    mac = hmac.new(settings.secret_key().encode(), f"run-token:{run_id}:{nonce}".encode(), hashlib.sha256).hexdigest()
    return f"asr_run_{run_id}_{mac}"


def _principal(token: ApiToken, owner: User | None) -> Principal:
    role = Role(owner.role) if owner is not None else Role.viewer  # a token without a user reads only
    return Principal(name=token.name, read_only=token.scope == "read" or role == Role.viewer, role=role)


def _user_token(session: Session, token_hash: str) -> tuple[ApiToken, User | None] | None:
    found = session.exec(
        select(ApiToken, User)
        .join(User, col(User.name) == col(ApiToken.name), isouter=True)
        .where(ApiToken.token_hash == token_hash)
    ).first()
    return (found[0], found[1]) if found is not None else None


def authenticate(session: Session, token: str) -> Principal:
    """The principal a bearer token stands for.

    Raises:
        AuthError: unknown, malformed or revoked token.
    """
    m = _RUN_TOKEN.match(token)
    if m:
        run_id = int(m.group(1))
        # the nonce alone: a Run loaded here would sit in the session and hide a later locked read's fresh row
        nonce = session.exec(select(Run.token_nonce).where(Run.id == run_id)).first() if run_id <= 2**31 - 1 else None
        if nonce is None or not hmac.compare_digest(token, _run_token(run_id, nonce)):
            raise AuthError("invalid token")
        return Principal(name=f"run-{run_id}", run_id=run_id)
    found = _user_token(session, hash_token(token))
    if found is None:
        raise AuthError("invalid token")
    row, owner = found
    if row.revoked_at is not None:
        raise AuthError(f"token '{row.name}' was revoked")
    return _principal(row, owner)


# ----------------------------------------------------------------------------- dashboard sessions


def start_session(session: Session, token: str, *, max_age_s: float) -> tuple[Principal, str]:
    """Log in with a user token: a new dashboard session lasting ``max_age_s``; returns the principal and the
    session id for the cookie (only its sha256 is stored). Expired sessions of every user are removed here.

    Raises:
        AuthError: unknown, revoked or run token.
    """
    who = authenticate(session, token)
    if who.run_id is not None:
        raise AuthError("a run token cannot log in; use a user token (asyncrl token create)")
    row = session.exec(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).one()
    sid = secrets.token_urlsafe(32)
    now = utcnow()
    session.exec(delete(DashboardSession).where(col(DashboardSession.expires_at) < now))
    session.add(
        DashboardSession(
            id_hash=hash_token(sid),
            token_id=stored_id(row),
            created_at=now,
            expires_at=now + timedelta(seconds=max_age_s),
        )
    )
    session.flush()
    return who, sid


def session_principal(session: Session, sid: str) -> Principal | None:
    """The principal of a live dashboard session, or None (logged out, expired, or its token revoked)."""
    found = session.exec(
        select(ApiToken, User)
        .join(DashboardSession, col(DashboardSession.token_id) == col(ApiToken.id))
        .join(User, col(User.name) == col(ApiToken.name), isouter=True)
        .where(DashboardSession.id_hash == hash_token(sid), col(DashboardSession.expires_at) > utcnow())
    ).first()
    if found is None or found[0].revoked_at is not None:
        return None
    return _principal(found[0], found[1])


def end_session(session: Session, sid: str) -> None:
    """Log out: the session's row goes, so its cookie (or a copy of it) opens nothing."""
    session.exec(delete(DashboardSession).where(col(DashboardSession.id_hash) == hash_token(sid)))
    session.flush()
