"""What every dashboard page shares: the templates, the ``Page`` of a request (session, web session, user) and
the dependencies the pages take (``SessionDep``, ``page``). The dashboard's own; it uses no ``server/api``
module."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from sqlmodel import Session
from starlette.datastructures import FormData

from server.core.db import engine
from server.models import utcnow
from server.services import permissions
from server.services.tokens import Principal
from webui import auth

HERE = Path(__file__).resolve().parent
POLL_S = 3
"""Seconds between live updates of a page's fragments."""

templates = Jinja2Templates(directory=HERE / "templates")


def age(when: datetime) -> str:
    """How long ago ``when`` was, coarse: ``42s``, ``7m``, ``3h``, ``2d``."""
    s = max(0, int((utcnow() - when).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def duration(seconds: float) -> str:
    """``seconds`` as ``42s``, ``7m 05s``, ``3h 02m`` or ``2d 04h`` (rounded down to the second)."""
    s = max(0, int(seconds))
    for big, small, size, sub in (("d", "h", 86400, 3600), ("h", "m", 3600, 60), ("m", "s", 60, 1)):
        if s >= size:
            return f"{s // size}{big} {(s % size) // sub:02d}{small}"
    return f"{s}s"


templates.env.filters["age"] = age
templates.env.filters["duration"] = duration


def db_session() -> Iterator[Session]:
    """One database session per request."""
    with Session(engine) as session:
        yield session


SessionDep = Annotated[Session, Depends(db_session)]


def is_fragment(request: Request) -> bool:
    """True for an htmx request (it swaps in a fragment, not a whole page)."""
    return request.headers.get("hx-request") == "true"


@dataclass
class Page:
    request: Request
    db: Session
    web: auth.WebSession
    user: Principal | None

    def render(self, name: str, code: int = 200, **values: Any) -> HTMLResponse:
        resp = templates.TemplateResponse(
            self.request, name, {"user": self.user, "csrf": self.web.csrf, "poll_s": POLL_S, **values}, status_code=code
        )
        self.web.save(resp)
        return resp

    def redirect(self, url: str) -> RedirectResponse:
        resp = RedirectResponse(url, status_code=303)
        self.web.save(resp)
        return resp

    def need_user(self) -> Principal:
        """The logged-in principal; otherwise a 303 to the login page (which returns here afterwards)."""
        if self.user is None:
            target = self.request.url.path + (f"?{self.request.url.query}" if self.request.url.query else "")
            raise HTTPException(303, "log in first", headers={"Location": "/login?" + urlencode({"next": target})})
        return self.user

    def form(self, posted: FormData, *, write: bool = True) -> FormData:
        """The POSTed form (``FormDep``) after the CSRF check (and, for ``write``, ``permissions.require_write``).
        Raises 403."""
        auth.check_csrf(self.web, posted)
        if write:
            permissions.require_write(self.need_user())
        return posted


async def posted_form(request: Request) -> FormData:
    """The request's form, read on the event loop; the handler that takes it (``FormDep``) is a plain ``def``,
    which FastAPI runs in its thread pool. A form handler must not be ``async``: its database calls would block the
    event loop, and a request waiting there for a lock (``server.core.db.serialize``) would stall every other
    request, the one holding the lock included."""
    return await request.form()


FormDep = Annotated[FormData, Depends(posted_form)]


def page(request: Request, db: SessionDep) -> Page:
    web = auth.load(request)
    return Page(request, db, web, auth.principal(db, web))
