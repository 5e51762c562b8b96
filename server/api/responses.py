"""The OpenAPI side of the error table: how a route declares the statuses its domain errors map to
(``server/errors.py`` ``HTTP_STATUS`` answers them), so routes of one kind document them one way.

A route that creates something (``POST`` answering 201 with the new object) is declared with :func:`creates`:
``422`` for input the service refuses (the message names the field) and, where the path names a parent that may not
exist, ``404``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter


def error_responses(*, invalid: str, not_found: str | None = None) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route: ``422: invalid`` and, when given, ``404: not_found`` (their descriptions)."""
    out: dict[int | str, dict[str, Any]] = {404: {"description": not_found}} if not_found else {}
    out[422] = {"description": invalid}
    return out


def creates(
    router: APIRouter, path: str, model: type[Any], *, invalid: str, not_found: str | None = None, **extra: Any
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``router.post(path)`` of a route that creates a ``model``: status 201, and :func:`error_responses`;
    ``extra`` goes to ``router.post`` (``openapi_extra``)."""
    return router.post(
        path,
        status_code=201,
        response_model=model,
        responses=error_responses(invalid=invalid, not_found=not_found),
        **extra,
    )


def spec_body(example: dict[str, Any], file_description: str) -> dict[str, Any]:
    """``openapi_extra=`` of a route that takes a submitted spec (``SubmittedSpec``): a JSON object (``example``) or a
    TOML/JSON file upload in the multipart field ``file`` (``file_description``)."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"type": "object"}, "example": example},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["file"],
                        "properties": {"file": {"type": "string", "format": "binary", "description": file_description}},
                    }
                },
            },
        }
    }
