"""Helpers of the dashboard tests: log a test client in through the login form and read its CSRF token."""

from __future__ import annotations

import re
from typing import Any


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m, html[:500]
    return m.group(1)


def login(client: Any, token: str) -> str:
    """Log ``client`` in with ``token``; returns the new session's CSRF token."""
    client.cookies.clear()
    resp = client.post(
        "/login",
        data={"csrf": csrf_of(client.get("/login").text), "token": token, "next": "/runs"},
        follow_redirects=False,
    )
    assert resp.status_code == 303 and resp.headers["location"] == "/runs", resp.text
    cookie = resp.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie, cookie
    return csrf_of(client.get("/runs").text)
