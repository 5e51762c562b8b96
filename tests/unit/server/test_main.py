"""The app's routes (``server/main.py``): every handler is a plain ``def``."""

from __future__ import annotations

import inspect

from fastapi.routing import APIRoute

from server.main import app


def test_no_route_handler_runs_on_the_event_loop() -> None:
    """An ``async def`` handler runs its (blocking) database calls on the event loop: one request waiting for a lock
    (``server.core.db.serialize``) there stalled every other request, the holder of the lock included (8 concurrent
    submissions hung until the client timed out). Bodies and forms are read by async dependencies instead."""
    routes = [r for r in app.routes if isinstance(r, APIRoute)]
    assert len(routes) > 40
    on_loop = sorted(f"{sorted(r.methods)} {r.path}" for r in routes if inspect.iscoroutinefunction(r.endpoint))
    assert on_loop == []
