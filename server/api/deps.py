"""Shared route dependencies: one DB session per request and the authenticated principal (a viewer's or read token's
write is refused here; who may change what: ``server/services/permissions.py``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from sqlmodel import Session

from server.cli import CLI_USER_AGENT
from server.core.db import get_session
from server.services import permissions, tokens
from server.services.tokens import Principal

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""The only methods a viewer or a read token may use; every other route is a write."""

SessionDep = Annotated[Session, Depends(get_session)]


def current_principal(request: Request, session: SessionDep) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise HTTPException(
            401,
            "missing token: send 'Authorization: Bearer <token>' (asyncrl token create)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(
            401, "malformed Authorization header: expected 'Bearer <token>'", headers={"WWW-Authenticate": "Bearer"}
        )
    try:
        principal = tokens.authenticate(session, token.strip())
    except tokens.AuthError as err:
        raise HTTPException(401, str(err), headers={"WWW-Authenticate": "Bearer"}) from None
    if request.method not in READ_METHODS:
        permissions.require_write(principal)  # Forbidden -> 403 (server/errors.py)
    return principal


def current_user(principal: Annotated[Principal, Depends(current_principal)]) -> Principal:
    if principal.run_id is not None:
        raise HTTPException(403, f"a run token (run {principal.run_id}) cannot do this; use a user token")
    return principal


PrincipalDep = Annotated[Principal, Depends(current_principal)]
UserDep = Annotated[Principal, Depends(current_user)]


def client_surface(request: Request) -> str:
    """Where an API request comes from, as a stop's reason names it (``runs.STOP_SURFACES``): ``CLI`` for the
    ``asyncrl`` CLI (its ``User-Agent``), else ``API``."""
    return "CLI" if request.headers.get("user-agent", "").startswith(CLI_USER_AGENT) else "API"


SurfaceDep = Annotated[str, Depends(client_surface)]
