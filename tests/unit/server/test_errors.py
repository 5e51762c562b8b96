"""The JSON body rule (``server/errors.py`` ``body_error``): 415 not JSON, 400 empty or unparsable, 422 wrong shape."""

from __future__ import annotations

from typing import Any

import pytest

from server.errors import body_error, is_json_type

BAD_JSON = {"loc": ("body", 1), "msg": "JSON decode error", "type": "json_invalid", "ctx": {"error": "Expecting value"}}
MISSING = {"loc": ("body",), "msg": "Field required", "type": "missing"}
NOT_OBJECT = {"loc": ("body",), "msg": "Input should be a valid dictionary", "type": "model_attributes_type"}
FIELD = {"loc": ("body", "points", 0, "step"), "msg": "Input should be a valid integer", "type": "int_type"}
QUERY = {"loc": ("query", "limit"), "msg": "Input should be less than or equal to 500", "type": "less_than_equal"}


@pytest.mark.parametrize(
    ("error", "ctype", "length", "expected"),
    [
        (NOT_OBJECT, "text/plain", "2", (415, "content-type 'text/plain': send the body as application/json")),
        (
            MISSING,
            "application/x-www-form-urlencoded; charset=utf-8",
            "0",
            (415, "content-type 'application/x-www-form-urlencoded': send the body as application/json"),
        ),
        (BAD_JSON, "application/json", "9", (400, "body: not valid JSON (Expecting value)")),
        (MISSING, "application/json", "0", (400, "body: empty: send a JSON object")),
        (MISSING, "", None, (400, "body: empty: send a JSON object")),
        (MISSING, "application/json", "4", (422, "body: expected a JSON object, got null")),
        (NOT_OBJECT, "application/json", "6", (422, "body: expected a JSON object")),
        (FIELD, "application/vnd.api+json", "40", (422, "body.points.0.step: Input should be a valid integer")),
        (QUERY, "text/plain", None, (422, "query.limit: Input should be less than or equal to 500")),
    ],
)
def test_body_error(error: dict[str, Any], ctype: str, length: str | None, expected: tuple[int, str]) -> None:
    assert body_error([error], ctype, length) == expected


def test_json_content_types() -> None:
    assert [is_json_type(t) for t in ("", "application/json", "Application/JSON; charset=utf-8", "a/b+json")] == [
        True
    ] * 4
    assert [is_json_type(t) for t in ("text/plain", "multipart/form-data; boundary=x", "application/jsonx")] == [
        False
    ] * 3
