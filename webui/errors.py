"""Error pages of the dashboard: a 4xx of a dashboard route reaches a browser as an HTML page in the site's
layout, with the status the REST API would answer (``server/errors.py`` for domain errors); other clients (the
TestClient, curl, htmx fragments) keep the API's JSON ``{"detail": …}``."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from fastapi.routing import APIRoute
from sqlmodel import Session
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.core.db import engine
from server.errors import DOMAIN_ERRORS, http_status
from webui import auth
from webui.page import POLL_S, is_fragment, templates


def wants_html(request: Request) -> bool:
    """True for a browser navigation or form post (``Accept`` names ``text/html``), not for htmx fragment
    requests or API clients."""
    return "text/html" in request.headers.get("accept", "") and not is_fragment(request)


def _back(request: Request) -> str:
    """Where the error page links back to: the referring page of this site, else the runs list."""
    referer = urlsplit(request.headers.get("referer", ""))
    if referer.netloc == request.url.netloc and referer.path.startswith("/") and referer.path != request.url.path:
        return referer.path + (f"?{referer.query}" if referer.query else "")
    return "/runs"


def error_status(err: Exception) -> tuple[int, str, dict[str, str] | None]:
    """(status, one-line message, headers) of an error a dashboard route raised, as the JSON API reports it."""
    if isinstance(err, StarletteHTTPException):
        return err.status_code, str(err.detail), dict(err.headers) if err.headers is not None else None
    if isinstance(err, RequestValidationError):
        first = err.errors()[0]
        return 422, f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}", None
    return http_status(err) or 500, str(err), None


def error_page(request: Request, code: int, message: str, headers: dict[str, str] | None = None) -> HTMLResponse:
    """The site's layout with the one-line ``message`` and a link back (status ``code``)."""
    web = auth.load(request)
    with Session(engine) as db:
        user = auth.principal(db, web)
    resp = templates.TemplateResponse(
        request,
        "error.html",
        {"user": user, "csrf": web.csrf, "poll_s": POLL_S, "code": code, "message": message, "back": _back(request)},
        status_code=code,
        headers=headers,
    )
    web.save(resp)
    return resp


HTML_ERRORS: tuple[type[Exception], ...] = (StarletteHTTPException, RequestValidationError, *DOMAIN_ERRORS)
"""What :class:`HTMLErrorRoute` turns into an error page (for a browser)."""


class HTMLErrorRoute(APIRoute):
    """A dashboard route whose 4xx errors reach a browser as an HTML page in the site's layout; other clients
    (the TestClient, curl, htmx fragments) keep the API's JSON ``{"detail": …}``."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except HTML_ERRORS as err:
                code, message, headers = error_status(err)
                if code < 400 or not wants_html(request):
                    raise
                return error_page(request, code, message, headers)

        return route
