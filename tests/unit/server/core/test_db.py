"""``server.core.db.unavailable_line``: a database that does not open is one line naming ``DATABASE_URL`` and
what to do (the driver's messages below are psycopg's, as it words them)."""

from __future__ import annotations

import pytest
from sqlalchemy import make_url

from server.core.db import unavailable_line

URL = make_url("postgresql+psycopg://postgres:secret@127.0.0.1:5432/asyncrl")
AT = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: '


@pytest.mark.parametrize(
    ("reason", "line"),
    [
        pytest.param(
            AT + 'FATAL:  database "asyncrl" does not exist',
            '(database "asyncrl" does not exist): create it first (createdb -h 127.0.0.1 -p 5432 -U postgres asyncrl)',
            id="no-database",
        ),
        pytest.param(
            AT + 'FATAL:  password authentication failed for user "postgres"',
            '(password authentication failed for user "postgres"): check the user and password in DATABASE_URL',
            id="bad-password",
        ),
        pytest.param(
            AT + "Connection refused\n\tIs the server running on that host and accepting TCP/IP connections?",
            "(Connection refused): is Postgres running and reachable at 127.0.0.1:5432? start it or fix DATABASE_URL",
            id="host-down",
        ),
    ],
)
def test_a_database_that_does_not_open_is_one_line(reason: str, line: str) -> None:
    got = unavailable_line(URL, reason)
    assert got == "DATABASE_URL: cannot open postgresql+psycopg://postgres:***@127.0.0.1:5432/asyncrl " + line
    assert "\n" not in got and "secret" not in got
