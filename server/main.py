"""The FastAPI app: ``/api`` JSON routes, ``/healthz``, Prometheus ``/metrics``, OpenAPI at ``/docs``.

Errors are JSON ``{"detail": "<one line naming the problem>"}`` with a 4xx status: 400 unparsable body,
401/403 token problems, 404 unknown run, 409 impossible state change, 413 body too large, 422 invalid
field (spec errors name the dotted key; a value the database cannot hold, e.g. an integer beyond its
column, is 422 too). Domain errors of the services get their status from ``server/errors.py``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from sqlalchemy import text
from sqlalchemy.exc import DataError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.main import api_router
from server.core.config import settings
from server.core.db import engine
from server.core.telemetry import PrometheusMiddleware, exposition
from server.errors import install as install_error_handlers
from webui.main import router as webui_router


class BodyTooLarge(HTTPException):
    """413 raised while a body streams in; an HTTPException so FastAPI's body parsing re-raises it instead of
    turning it into 400 "There was an error parsing the body" (routes with a pydantic body model)."""


class LimitBodySize:
    """Refuse request bodies over ``max_bytes`` with 413, by Content-Length or while streaming."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(413, self._detail())
            return message

        try:
            await self.app(scope, limited, send)
        except BodyTooLarge:
            await self._refuse(scope, receive, send)

    def _detail(self) -> str:
        return f"body: larger than {self.max_bytes} bytes"

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse({"detail": self._detail()}, status_code=413)
        await response(scope, receive, send)


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
    )
    app.include_router(api_router, prefix="/api")
    app.include_router(webui_router)  # the dashboard: /runs, /launch, /compare, /alerts, /login

    install_error_handlers(app)  # domain errors -> their status (server/errors.py)

    @app.exception_handler(DataError)
    async def _bad_value(_request: Request, err: DataError) -> JSONResponse:
        # a client value the database cannot hold (e.g. an integer beyond its column): bad input, not a crash
        first = str(getattr(err, "orig", err)).splitlines()[0]
        return JSONResponse({"detail": f"a value is out of range for the database: {first}"}, status_code=422)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0]
        detail = f"{_loc(first['loc'])}: {first['msg']}"
        if first.get("type") == "json_invalid":
            detail = f"body: not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})"
        simple = [{"loc": _loc(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors[:20]]
        return JSONResponse({"detail": detail, "errors": simple}, status_code=422)

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict[str, str]:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return {"status": "ok", "database": engine.dialect.name}

    @app.get("/metrics", tags=["ops"], include_in_schema=False)
    def prometheus_metrics() -> Response:
        """Prometheus scrape endpoint (see ``server.core.telemetry``)."""
        return Response(exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(LimitBodySize, max_bytes=settings.MAX_BODY_BYTES)
    app.add_middleware(PrometheusMiddleware)  # outermost: counts 413s too
    return app


app = create_app()
