"""The API key of a run's vLLM server, on every route.

vLLM's own ``--api-key`` (``VLLM_API_KEY``) guards only the paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` (``GUARDED_PREFIX`` in ``vllm/entrypoints/serve/middleware/authenticate.py``, vllm 0.31): the dev routes
that ``VLLM_SERVER_DEV_MODE=1`` opens (``/collective_rpc``, ``/pause``, ``/resume``, ``/update_weights``,
``/reset_prefix_cache``, ``/sleep``, ...) stay open to anyone who can reach the port. :class:`RequireApiKey` is added
to the server with ``--middleware`` (``worker.inference.server.server_command``) and refuses every request but
``GET /health`` (the readiness probe) without ``Authorization: Bearer <key>``, the key being
``ASYNCRL_INFERENCE_API_KEY`` of the server's environment (never its command line, which other users can read in
``/proc``). Clients (``worker.inference.client.InferenceClient``, verifiers' ``TrainClient``) send the same variable.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

API_KEY_VAR = "ASYNCRL_INFERENCE_API_KEY"
"""The variable holding a vLLM server's API key: in the server's environment (what it accepts) and its clients'."""
OPEN_PATHS = frozenset({"/health"})
"""Paths answered without the key (``GET`` only): the readiness probe (``worker.inference.server.wait_ready``)."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


def new_api_key() -> str:
    """A fresh random key (43 URL-safe characters, 256 bits) for one run's server."""
    return secrets.token_urlsafe(32)


def key_header(key: str | None = None) -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}`` for ``key`` (default: ``ASYNCRL_INFERENCE_API_KEY``), ``{}`` when none."""
    key = key if key is not None else os.environ.get(API_KEY_VAR, "")
    return {"Authorization": f"Bearer {key}"} if key else {}


class RequireApiKey:
    """Pure ASGI middleware: every HTTP or websocket request except ``GET /health`` needs the bearer key (401
    otherwise, a JSON ``{"error": ...}`` body).

    Raises:
        RuntimeError: at start, when ``ASYNCRL_INFERENCE_API_KEY`` is empty (the server refuses to start open).
    """

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get(API_KEY_VAR, "")
        if not key:
            raise RuntimeError(f"{API_KEY_VAR} is empty: the inference server will not start without an API key")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _allowed(self, scope: Scope) -> bool:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope.get("method") in ("GET", "HEAD") and path in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return secrets.compare_digest(hashlib.sha256(given.strip().encode()).digest(), self._digest)
        return False

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": f"missing or wrong API key (Authorization: Bearer ${API_KEY_VAR})"}).encode()
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
