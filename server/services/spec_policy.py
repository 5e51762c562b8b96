"""What a spec submitted to the service may name, beyond what the schema checks: code and addresses.

A local ``asyncrl rl`` runs its user's own code on its user's machine; a spec submitted to the service runs on a
shared worker, so it may name only

- code the admin allows: every import path of the spec (``env.id``, ``orchestrator.harness.id``, future custom
  losses, advantages, gates) goes through the one rule :func:`worker.spec.user_code.check_import_path` with the
  setting ``ALLOWED_CODE_PACKAGES``;
- an ``inference.url`` on the worker itself (loopback) or a host in ``INFERENCE_ALLOW_HOSTS``: the run sends
  weight updates and requests there.

:func:`check` runs at submit (``runs.create``: the API, the dashboard's launch form, fork) and again at launch
(``worker.tasks.launch``: a spec stored before a rule or a setting changed).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection
from urllib.parse import urlsplit

from server.core.config import settings
from worker.spec import RLSpec, SFTSpec, SpecError
from worker.spec.user_code import check_spec_code


class AddressNotAllowed(SpecError):
    """A spec names a network address the service does not let a run reach (one line naming the key)."""


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_inference_url(url: str | None, allowed_hosts: Collection[str]) -> None:
    """Refuse an ``inference.url`` whose host is not loopback (``localhost``, ``127.0.0.0/8``, ``::1``) or one of
    ``allowed_hosts``. Names are not resolved: a name is allowed only when listed.

    Raises:
        AddressNotAllowed: ``inference.url: 'http://10.0.0.5:8000' is not allowed in a run submitted to the
            service; allowed: a loopback address (127.0.0.1, localhost, ::1) or a host in INFERENCE_ALLOW_HOSTS
            (none)``.
    """
    if url is None:
        return
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
    except ValueError:
        host, parts = "", None
    if parts is not None and parts.scheme in {"http", "https"} and host:
        if _loopback(host) or host in {h.lower() for h in allowed_hosts}:
            return
    listed = ", ".join(sorted(allowed_hosts)) or "none"
    raise AddressNotAllowed(
        f"inference.url: {url!r} is not allowed in a run submitted to the service; allowed: an http(s) URL of a "
        f"loopback address (127.0.0.1, localhost, ::1) or of a host in INFERENCE_ALLOW_HOSTS ({listed})"
    )


def check(spec: RLSpec | SFTSpec) -> None:
    """Refuse a validated spec that names code or an address the service does not allow (see the module docstring).

    Raises:
        CodeNotAllowed: an import path not allowed (names its key).
        AddressNotAllowed: ``inference.url`` not loopback or allowed.
    """
    check_spec_code(spec, settings.ALLOWED_CODE_PACKAGES)
    if isinstance(spec, RLSpec):
        check_inference_url(spec.inference.url, settings.INFERENCE_ALLOW_HOSTS)
