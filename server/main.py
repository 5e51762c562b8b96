"""The FastAPI app: ``/api`` JSON routes, ``/healthz``, Prometheus ``/metrics``, OpenAPI at ``/docs`` (Swagger UI
served from this app, no CDN).

Errors are JSON ``{"detail": "<one line naming the problem>"}`` with a 4xx status: 401/403 token problems, 404
unknown run, 409 impossible state change, 413 body too large, and for the body of every JSON route one rule
(``server/errors.py`` :func:`body_error`):

| the body                                                   | status | detail starts with          |
|------------------------------------------------------------|--------|-----------------------------|
| sent with a content type other than JSON                   | 415    | ``content-type '...':``     |
| empty, or not JSON (does not parse, not UTF-8)             | 400    | ``body: empty`` / ``body: not valid JSON`` |
| JSON of the wrong shape (not an object, a field invalid)   | 422    | ``body:`` / the field's dotted name |
| a NUL character (``\\u0000``) in any key or string          | 422    | the field's dotted name     |

A spec error names the dotted spec key (422); a value the database cannot hold, e.g. an integer beyond its column,
is 422 too; so is a JSON body nested deeper than 32 levels (``LimitJsonDepth``). Domain errors of the services get
their status from ``server/errors.py``.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qsl

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from sqlalchemy import text
from sqlalchemy.exc import DataError, OperationalError
from sqlmodel import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.deps import current_principal
from server.api.main import api_router
from server.core import health
from server.core.config import settings
from server.core.db import engine
from server.core.telemetry import PrometheusMiddleware, exposition
from server.errors import SPEC_FORMS, body_error, is_json_type, nul_error, spec_too_large
from server.errors import install as install_error_handlers
from webui.main import router as webui_router
from worker.spec import MAX_DEPTH
from worker.spec.loading import MAX_SPEC_BYTES


class BodyTooLarge(HTTPException):
    """413 raised while a body streams in; an HTTPException so FastAPI's body parsing re-raises it instead of
    turning it into 400 "There was an error parsing the body" (routes with a pydantic body model)."""


SPEC_FORM_SLACK = 64 * 1024
"""Bytes a spec form may carry beyond the spec text: multipart boundaries and part headers, the CSRF token, the
chosen config."""


class LimitBodySize:
    """Refuse request bodies over ``max_bytes`` with 413, by Content-Length or while streaming. The body of a spec
    form (``server.errors.SPEC_FORMS``) has its own limit instead: the spec text's ``MAX_SPEC_BYTES`` (three times
    that when URL-encoded, ``%XX`` per byte) plus :data:`SPEC_FORM_SLACK`, refused naming the form field; the route
    checks the text itself to the byte."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def limit(self, scope: Scope) -> tuple[int, str]:
        """(largest body, the 413 line) of a request."""
        form = SPEC_FORMS.get((scope["method"], scope["path"]))
        ctype = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        if form is not None and ctype in form.content_types:
            encoded = 3 if ctype == "application/x-www-form-urlencoded" else 1
            return encoded * MAX_SPEC_BYTES + SPEC_FORM_SLACK, spec_too_large(form.field)
        return self.max_bytes, f"body: larger than {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, detail = self.limit(scope)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            await self._refuse(scope, receive, send, detail)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                raise BodyTooLarge(413, detail)
            return message

        try:
            await self.app(scope, limited, send)
        except BodyTooLarge:
            await self._refuse(scope, receive, send, detail)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, detail: str) -> None:
        response = JSONResponse({"detail": detail}, status_code=413)
        await response(scope, receive, send)


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """Deepest nesting of ``[`` and ``{`` in a JSON text, brackets inside strings skipped, without parsing it
    (linear time, no recursion)."""
    depth = deepest = 0
    for b in _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKET):
        depth += 1 if b in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


FORM_TYPE = "application/x-www-form-urlencoded"


class LimitJsonDepth:
    """Refuse JSON request bodies (``application/json``, ``*+json`` or no content type) nested deeper than
    ``max_depth`` with 422 ``body: nested deeper than 32 levels``, before a route parses them: Python's JSON parser
    runs out of recursion on deeply nested input. Sits inside :class:`LimitBodySize` (the body is bounded).

    The same pass refuses a NUL character (``\\u0000`` in JSON, ``%00`` in a form) in any key or string of a JSON
    body or an url-encoded form (the dashboard's), with 422 naming the field or key (``server.errors.nul_error``):
    SQLite would store it and Postgres refuse it, so no route ever sees one."""

    def __init__(self, app: ASGIApp, max_depth: int) -> None:
        self.app, self.max_depth = app, max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctype = dict(scope.get("headers", [])).get(b"content-type", b"").decode("latin-1")
        form = ctype.split(";")[0].strip().lower() == FORM_TYPE
        if (
            scope["type"] != "http"
            or scope["method"] not in ("POST", "PUT", "PATCH")
            or not (is_json_type(ctype) or form)
        ):
            await self.app(scope, receive, send)
            return
        chunks, message = [], await receive()
        while message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
            message = await receive()
        body = b"".join(chunks)
        detail = None
        if not form and json_depth(body) > self.max_depth:
            detail = f"body: nested deeper than {self.max_depth} levels"
        elif not form and b"\\u0000" in body:
            try:
                detail = nul_error(json.loads(body))
            except ValueError:  # not JSON: the route answers 400
                pass
        elif form and b"%00" in body:
            fields: dict[str, Any] = {}
            for key, value in parse_qsl(body.decode("latin-1"), keep_blank_values=True):
                fields.setdefault(key, value)
            detail = nul_error(fields)
        if detail is not None:
            await JSONResponse({"detail": detail}, status_code=422)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _route_id(route: APIRoute) -> str:
    return f"{route.tags[0]}-{route.name}" if route.tags else route.name


def _loc(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(p) for p in loc)


def create_app() -> FastAPI:
    app = FastAPI(
        title="asyncrl",
        version="0.1.0",
        generate_unique_id_function=_route_id,
        description="Experiment service for asynchronous RL post-training of language models.",
        docs_url=None,  # FastAPI's own /docs and /redoc load their scripts from a CDN: blank offline
        redoc_url=None,
    )

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        """Swagger UI of ``/openapi.json`` with its assets served here (``webui.site.STATIC``, pinned)."""
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} API",
            swagger_js_url="/static/swagger-ui-bundle.js",
            swagger_css_url="/static/swagger-ui.css",
            swagger_favicon_url="/static/swagger-ui-favicon.png",
        )

    app.include_router(api_router, prefix="/api")
    app.include_router(webui_router)  # the dashboard: /runs, /launch, /compare, /alerts, /login

    install_error_handlers(app)  # domain errors -> their status (server/errors.py)

    @app.exception_handler(DataError)
    async def _bad_value(_request: Request, err: DataError) -> JSONResponse:
        # a client value the database cannot hold (e.g. an integer beyond its column): bad input, not a crash
        first = str(getattr(err, "orig", err)).splitlines()[0]
        return JSONResponse({"detail": f"a value is out of range for the database: {first}"}, status_code=422)

    @app.exception_handler(OperationalError)
    async def _write_failed(_request: Request, err: OperationalError) -> JSONResponse:
        # the database refused or lost the request (SQLite's disk full at the commit, Postgres gone): nothing of it
        # was stored; /healthz says degraded until a commit succeeds again (server/core/health.py)
        cause = " ".join(str(getattr(err, "orig", err)).split()) or type(err).__name__
        detail = f"database: the request was not stored: {cause}"
        health.write_failed(detail)
        return JSONResponse({"detail": detail}, status_code=503)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = list(err.errors())
        status, detail = body_error(
            errors, request.headers.get("content-type", ""), request.headers.get("content-length")
        )
        simple = [{"loc": _loc(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors[:20]]
        return JSONResponse({"detail": detail, "errors": simple}, status_code=status)

    @app.get(
        "/healthz",
        tags=["ops"],
        responses={503: {"description": "degraded: the last write failed or the broker does not answer (``reason``)"}},
    )
    def healthz() -> Any:
        """``ok`` while the database answers and writes work, the broker answers and a worker answered lately;
        else ``degraded`` with a one-line ``reason``: 503 for the database and the broker (requests would fail),
        200 for a missing worker (``server/core/health.py``)."""
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        status, body = health.report(engine.dialect.name)
        return JSONResponse(body, status)

    @app.get("/metrics", tags=["ops"], include_in_schema=False)
    def prometheus_metrics(request: Request) -> Response:
        """Prometheus scrape endpoint (see ``server.core.telemetry``): the control plane to anyone; the live runs'
        metrics (ids, owners, environments, values) only with a user token (a read token will do) in
        ``Authorization: Bearer``: a bad token is 401, a run token 403 (it reaches only its own run)."""
        runs = False
        if request.headers.get("authorization"):
            with Session(engine) as session:
                principal = current_principal(request, session)
            if principal.run_id is not None:
                raise HTTPException(403, f"a run token (run {principal.run_id}) cannot read /metrics; use a user token")
            runs = True
        return Response(exposition(runs=runs), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(LimitJsonDepth, max_depth=MAX_DEPTH)  # inside LimitBodySize: reads a bounded body
    app.add_middleware(LimitBodySize, max_bytes=settings.MAX_BODY_BYTES)
    app.add_middleware(PrometheusMiddleware)  # outermost: counts 413s too
    return app


app = create_app()
