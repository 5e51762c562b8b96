"""Dashboard sessions: log in with an API token, a signed cookie, CSRF tokens on every form.

The session cookie (``asyncrl_session``: httponly, ``SameSite=Strict``) holds an itsdangerous-signed mapping
``{"csrf": <random>, "sid": <random session id>}``; the server stores only the session id's sha256
(``dashboard_sessions``, ``server/services/tokens.py``) and looks it up on every request: logout deletes it and
revoking the token deletes its sessions, so the same cookie, replayed, gets the login page at once. Every POST form
carries the session's CSRF token in the field ``csrf``; :func:`check_csrf` refuses a POST whose field is missing or
differs (403). Who may write what: ``server/services/permissions.py`` (viewers and read tokens see pages without
write buttons and every write is refused with 403).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException, Request, Response
from itsdangerous import BadSignature, URLSafeTimedSerializer
from sqlmodel import Session

from server.core.config import settings
from server.services import tokens
from server.services.tokens import Principal

COOKIE = "asyncrl_session"
MAX_AGE_S = 7 * 24 * 3600
"""A session lasts a week from login."""


def _serializer() -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(settings.secret_key(), salt="asyncrl-webui-session")


@dataclass
class WebSession:
    """The browser's session: its CSRF token and, once logged in, the session id (``dashboard_sessions``)."""

    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    sid: str | None = None
    dirty: bool = True
    """True when the cookie must be (re)sent."""

    def save(self, response: Response) -> None:
        """Set the cookie on ``response`` if the session is new or changed."""
        if self.dirty:
            value = _serializer().dumps({"csrf": self.csrf, "sid": self.sid})
            response.set_cookie(
                COOKIE, value, max_age=MAX_AGE_S, httponly=True, samesite="strict", secure=False, path="/"
            )


def load(request: Request) -> WebSession:
    """The session of ``request``'s cookie, or a fresh anonymous one (bad or expired signature included)."""
    raw = request.cookies.get(COOKIE)
    if raw:
        try:
            data: Any = _serializer().loads(raw, max_age=MAX_AGE_S)
            sid = data.get("sid")
            return WebSession(csrf=str(data["csrf"]), sid=sid if isinstance(sid, str) else None, dirty=False)
        except (BadSignature, KeyError, TypeError, AttributeError):
            pass
    return WebSession()


def principal(session: Session, web: WebSession) -> Principal | None:
    """The logged-in principal, or None (not logged in, logged out, expired, or the token was revoked)."""
    return tokens.session_principal(session, web.sid) if web.sid else None


def check_csrf(web: WebSession, form: Any) -> None:
    """Raises HTTPException(403) unless the form's ``csrf`` field equals the session's token."""
    sent = form.get("csrf")
    if not isinstance(sent, str) or not secrets.compare_digest(sent, web.csrf):
        raise HTTPException(403, "csrf: missing or wrong form token; reload the page and try again")
