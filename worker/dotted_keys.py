"""Dotted spec keys (``"trainer.optim.lr"``): the one place that reads, sets and flattens them.

A spec is nested tables (``{"trainer": {"optim": {"lr": 1e-4}}}``); people name one value by its dotted key. The
CLI's ``--trainer.optim.lr 5e-5`` overrides, a fork's ``changes``, a live-config revision and the dashboard's
forms all go through :func:`with_keys`; replaying a run's config revisions is :func:`replay`.

Imports nothing of asyncrl: the spec module and the server both use it.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterable, Mapping
from typing import Any


def closest(name: str, known: Iterable[str], *, cutoff: float = 0.85) -> str | None:
    """The known name closest to a mistyped one, or None when none is close: ``difflib.get_close_matches`` with
    ratio >= ``cutoff`` (0.85 for long dotted names, which share their prefixes; the spec's unknown keys, one part of
    a dotted key, take 0.5). The one matcher of every "did you mean" hint: spec keys, live keys, metric names."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` with :func:`closest`, or ``""`` when none is close."""
    close = closest(name, known)
    return f" (did you mean {close!r}?)" if close is not None else ""


class DottedKeyError(ValueError):
    """A dotted key that cannot be set. ``key`` is the key, the message the reason only: callers prefix the key as
    the user wrote it (``--a..b``, ``changes.a..b``)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(reason)
        self.key = key


def get_key(data: Mapping[str, Any], key: str) -> Any:
    """``data["a"]["b"]`` for ``key = "a.b"``.

    Raises:
        KeyError: a part of the key is missing.
    """
    node: Any = data
    for part in key.split("."):
        node = node[part]
    return node


def with_keys(data: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``data`` with each ``{"dotted.key": value}`` of ``changes`` set; missing tables are created.

    Raises:
        DottedKeyError: a key with an empty part (``"a..b"``: "expected a dotted key such as trainer.optim.lr"),
            or one that goes through a value that is not a table ("max_steps is not a table").
    """
    out = copy.deepcopy(dict(data))
    for dotted, value in changes.items():
        parts = dotted.split(".")
        if not all(parts):
            raise DottedKeyError(dotted, "expected a dotted key such as trainer.optim.lr")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise DottedKeyError(dotted, f"{'.'.join(parts[: i + 1])} is not a table")
            node = child
        node[parts[-1]] = value
    return out


def replay(spec: Mapping[str, Any], revisions: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The spec mapping once each revision's ``changes`` (oldest first) is applied: the live values of a run.

    Args:
        spec: the run's resolved spec as stored (``config.json``, ``Run.spec``).
        revisions: the changes of each config revision, ``{"trainer.optim.lr": 5e-5}``, oldest first.
    """
    out = copy.deepcopy(dict(spec))
    for changes in revisions:
        out = with_keys(out, changes)
    return out


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables as ``{"a.b": value}`` (an empty table stays a value)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
