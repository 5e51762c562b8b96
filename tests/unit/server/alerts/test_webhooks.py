"""What a webhook delivery's error shows to users other than its endpoint's owner and admins, and which targets
count as internal (their answer bodies are not kept)."""

from __future__ import annotations

import ipaddress

import pytest

from server.alerts.webhooks import _internal, redact_error


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        ("HTTP 500: {'db': 'postgresql://admin:pw@db'}", "HTTP 500"),
        ("HTTP 404 (body not kept: an internal address)", "HTTP 404"),
        ("ConnectError: [Errno 111] Connection refused to 10.1.2.3:8080", "ConnectError"),
        (
            "url: hooks.example resolves to 10.0.0.1, a private address (allowed only with ...)",
            "refused by the SSRF guard",
        ),
        ("endpoint disabled", "endpoint disabled"),
        ("", ""),
    ],
)
def test_redact_error(error: str, shown: str) -> None:
    assert redact_error(error) == shown


@pytest.mark.parametrize(
    ("ip", "internal"),
    [
        ("127.0.0.1", True),
        ("10.0.0.1", True),
        ("100.64.0.1", True),
        ("169.254.169.254", True),
        ("::1", True),
        ("fd00::1", True),
        ("::ffff:10.0.0.1", True),
        ("2002:a01:203::1", True),  # 6to4 around 10.1.2.3
        ("8.8.8.8", False),
        ("2606:4700::1111", False),
    ],
)
def test_internal_addresses(ip: str, internal: bool) -> None:
    assert _internal(ipaddress.ip_address(ip)) is internal
