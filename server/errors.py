"""Domain errors -> HTTP status: the one table the REST API (``install``: FastAPI exception handlers) and the
dashboard (``webui/errors.py``: HTML error pages and inline errors) both read.

A service raises a domain error with a one-line message naming the problem; the surface answers with the
status below and ``{"detail": "<message>"}``. A subclass takes its nearest listed base's status
(``RunNotLive`` is an ``InvalidTransition``: 409; ``RevisionNotFound`` a ``RunNotFound``: 404;
``LiveConfigError`` a ``SpecError``: 422). The body of a JSON route that does not validate is 415 (not JSON), 400
(empty or unparsable) or 422 (wrong shape, naming the field): :func:`body_error`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from server.alerts.webhooks import NotFound, StillRetrying, UnsafeURL
from server.jobs.celery_app import BrokerUnavailable
from server.services.metric_export import MetricNotFound
from server.services.permissions import Forbidden, RunTokenExpired
from server.services.pipelines import PipelineNotFound
from server.services.rollouts import BadRolloutId, RolloutNotFound
from server.services.runs import InvalidTransition, RunNotFound
from server.services.spec_policy import AddressNotAllowed
from server.services.sweeps import SweepNotFound
from worker.spec import SpecError
from worker.spec.loading import MAX_SPEC_BYTES
from worker.spec.user_code import CodeNotAllowed

HTTP_STATUS: dict[type[Exception], int] = {
    SpecError: 422,  # an invalid spec, change or argument; the message starts with the dotted key
    CodeNotAllowed: 422,  # a submitted spec names code the admin does not allow (env.id, harness id, import paths)
    AddressNotAllowed: 422,  # a submitted spec's inference.url is not loopback or an allowed host
    UnsafeURL: 422,  # a webhook URL the SSRF guard refuses
    RunTokenExpired: 401,  # a run token writing after its run ended
    Forbidden: 403,  # not the run's owner or an admin, a viewer's write (server/services/permissions.py)
    RunNotFound: 404,
    SweepNotFound: 404,
    PipelineNotFound: 404,
    MetricNotFound: 404,  # an export of a metric none of its runs has
    RolloutNotFound: 404,  # no such rollout in the run, or a rollout id of another run
    BadRolloutId: 422,  # a rollout id that is not <run>-<step>-<line>
    NotFound: 404,  # alert rule, webhook endpoint or delivery
    InvalidTransition: 409,  # a state change the run's state does not allow
    StillRetrying: 409,  # a replay of a delivery still being retried
    BrokerUnavailable: 503,  # the broker did not take a task (a run whose launch it refused is failed)
}
DOMAIN_ERRORS = tuple(HTTP_STATUS)
"""The classes of :data:`HTTP_STATUS`, for ``except DOMAIN_ERRORS``."""


def http_status(err: BaseException) -> int | None:
    """The HTTP status of a domain error (its nearest class listed in :data:`HTTP_STATUS`), None for any other."""
    for cls in type(err).__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return None


async def _domain_error(_request: Request, err: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(err)}, status_code=http_status(err) or 500)


def install(app: FastAPI) -> None:
    """Answer every domain error of :data:`HTTP_STATUS` with its status and ``{"detail": str(err)}``."""
    for cls in HTTP_STATUS:
        app.add_exception_handler(cls, _domain_error)


class SpecForm(NamedTuple):
    field: str
    """The form field that carries the spec text."""
    content_types: tuple[str, ...]
    """Body types that carry it (other bodies of the route keep ``MAX_BODY_BYTES``)."""


SPEC_FORMS: dict[tuple[str, str], SpecForm] = {
    ("POST", "/api/runs"): SpecForm("file", ("multipart/form-data",)),
    ("POST", "/api/sweeps"): SpecForm("file", ("multipart/form-data",)),
    ("POST", "/api/pipelines"): SpecForm("file", ("multipart/form-data",)),
    ("POST", "/launch"): SpecForm("spec", ("application/x-www-form-urlencoded", "multipart/form-data")),
}
"""Routes that take a spec as a file upload (the API's ``SubmittedSpec``) or pasted text (the dashboard's Launch
form): the spec text may be up to :data:`MAX_SPEC_BYTES`, whatever ``MAX_BODY_BYTES`` is, and a larger one is a 413
naming the field (:func:`spec_too_large`)."""


def spec_too_large(field: str) -> str:
    """The 413 line of a spec text over :data:`MAX_SPEC_BYTES` in form field ``field``."""
    return f"{field}: larger than {MAX_SPEC_BYTES} bytes ({MAX_SPEC_BYTES // 1024} KiB)"


def is_json_type(content_type: str) -> bool:
    """Whether a ``Content-Type`` header names JSON (``application/json``, ``*+json``) or is absent (read as JSON)."""
    ctype = content_type.split(";")[0].strip().lower()
    return not ctype or ctype == "application/json" or ctype.endswith("+json")


def body_error(errors: list[dict[str, Any]], content_type: str, content_length: str | None) -> tuple[int, str]:
    """(status, one-line detail) of a request whose validation failed with pydantic ``errors`` (FastAPI's
    ``RequestValidationError.errors()``): the JSON body rule of ``server/main.py``'s docstring. Errors outside the body
    (path, query) are 422 naming the parameter."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    in_body = bool(loc) and loc[0] == "body"
    if in_body and not is_json_type(content_type):
        return 415, f"content-type {content_type.split(';')[0].strip()!r}: send the body as application/json"
    if first.get("type") == "json_invalid":
        return 400, f"body: not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})"
    if in_body and len(loc) == 1 and first.get("type") == "missing":
        if content_length in (None, "0"):
            return 400, "body: empty: send a JSON object"
        return 422, "body: expected a JSON object, got null"
    if in_body and len(loc) == 1 and first.get("type") in {"model_attributes_type", "dict_type", "model_type"}:
        return 422, "body: expected a JSON object"
    return 422, f"{'.'.join(str(p) for p in loc)}: {first['msg']}"


NUL = "\x00"


def nul_error(value: Any, where: str = "body") -> str | None:
    """The one-line refusal of the first NUL character (``\\x00``) in a parsed body, a form or a spec, searched
    depth-first through its keys and strings; None without one. Neither database can keep it the same way (SQLite
    stores it, Postgres refuses it), so every surface refuses it before anything is stored, naming the field:
    ``env.args: key 'a\\x00b' contains a NUL character`` or ``name: contains a NUL character``. ``where``: the dotted
    name of ``value`` (``body``: the top level, left out of the names below it)."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if NUL in item:
                return f"{path}: contains a NUL character (\\x00), which cannot be stored"
        elif isinstance(item, dict):
            for key in item:
                if NUL in str(key):
                    return f"{path}: key {str(key)!r} contains a NUL character (\\x00), which cannot be stored"
            stack.extend((v, str(k) if path == "body" else f"{path}.{k}") for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None
