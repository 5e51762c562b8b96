"""The fork tree of a run: its ancestors up to the first run forked from nothing, and every run forked from any of
them, with each fork's checkpoint step and config changes. Built from the ``forked``/``fork`` events that
``runs.fork`` records (a deleted run ends its branch)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from sqlmodel import Session, col, select

from server.models import ConfigRevision, Run, RunEvent, stored_id
from server.services import runs
from worker.dotted_keys import flatten
from worker.live_config import replay_in_effect

MAX_NODES = 500
"""The most runs one lineage lists (a bigger family is cut, ``truncated`` set)."""


class ForkChange(BaseModel):
    key: str
    """Dotted spec key."""
    parent: Any
    """Its value in the parent's config in effect at the fork step (None: absent)."""
    child: Any
    """Its value in the fork's spec (None: absent)."""


class LineageNode(BaseModel):
    id: int
    name: str
    status: str
    parent_id: int | None
    """The run it was forked from; None for the root (or when that run was deleted)."""
    step: int | None
    """The parent's checkpoint step the fork starts from (it trains from ``step + 1``); None for the root."""
    depth: int
    """0 for the root, parent's depth + 1 for a fork."""
    requested: dict[str, Any]
    """The changes the fork asked for (dotted key -> value), as recorded in its ``forked`` event."""
    changes: list[ForkChange]
    """Every spec key whose value differs between the parent's config in effect at the fork step (its spec with
    each live change its process had acknowledged by then: ``worker.live_config.replay_in_effect``, as
    ``runs.fork`` takes it) and the fork's spec (``name`` and ``output_dir`` left out), sorted by key."""
    children: list[int]
    """Ids of the runs forked from this one, oldest fork first."""


class Lineage(BaseModel):
    run_id: int
    """The run the tree was asked for."""
    root_id: int
    nodes: list[LineageNode]
    """Depth-first from the root, each fork's children oldest first (the order the tree is drawn in)."""
    truncated: bool = False


def _diff(parent: dict[str, Any], child: dict[str, Any]) -> list[ForkChange]:
    skip = {"name", "output_dir"}
    a = flatten({k: v for k, v in parent.items() if k not in skip})
    b = flatten({k: v for k, v in child.items() if k not in skip})
    return [
        ForkChange(key=k, parent=a.get(k), child=b.get(k))
        for k in sorted(set(a) | set(b))
        if json.dumps(a.get(k), sort_keys=True) != json.dumps(b.get(k), sort_keys=True)
    ]


def _events(session: Session, run_ids: list[int], kind: str) -> list[RunEvent]:
    return list(
        session.exec(
            select(RunEvent).where(col(RunEvent.run_id).in_(run_ids), RunEvent.kind == kind).order_by(col(RunEvent.id))
        ).all()
    )


def _forked_from(session: Session, run_id: int) -> RunEvent | None:
    rows = _events(session, [run_id], "forked")
    return rows[-1] if rows else None


def lineage(session: Session, run_id: int, *, max_nodes: int = MAX_NODES) -> Lineage:
    """The fork tree that holds run ``run_id``: up its ``forked`` events to the root, then down every ``fork`` event
    (breadth-first, at most ``max_nodes`` runs).

    Raises:
        RunNotFound: no run ``run_id``.
    """
    focus = runs.get(session, run_id)
    root, seen = focus, {run_id}
    while (up := _forked_from(session, stored_id(root))) is not None:
        parent = session.get(Run, up.data.get("parent_run_id"))
        if parent is None or stored_id(parent) in seen:  # deleted, or a cycle no fork can make: stop there
            break
        seen.add(stored_id(parent))
        root = parent
    members: dict[int, Run] = {stored_id(root): root}
    children: dict[int, list[int]] = {}
    level, truncated = [stored_id(root)], False
    while level and not truncated:
        nxt = []
        for ev in _events(session, level, "fork"):
            child = session.get(Run, ev.data.get("child_run_id"))
            if child is None or stored_id(child) in members:
                continue
            if len(members) >= max_nodes:
                truncated = True
                break
            members[stored_id(child)] = child
            children.setdefault(ev.run_id, []).append(stored_id(child))
            nxt.append(stored_id(child))
        level = nxt
    forked = {ev.run_id: ev for ev in _events(session, list(members), "forked")}  # newest per run (id order)
    revs: dict[int, list[ConfigRevision]] = {}
    for rev in session.exec(select(ConfigRevision).where(col(ConfigRevision.run_id).in_(list(members)))).all():
        revs.setdefault(rev.run_id, []).append(rev)
    nodes: list[LineageNode] = []

    def visit(run_id: int, parent_id: int | None, depth: int) -> None:
        run = members[run_id]
        ev = forked.get(run_id) if parent_id is not None else None
        step = int(ev.data["step"]) if ev is not None else None
        changes: list[ForkChange] = []
        if parent_id is not None and step is not None:
            parent = members[parent_id]
            done = sorted(revs.get(parent_id, []), key=lambda r: r.revision)
            changes = _diff(replay_in_effect(parent.spec, ((r.changes, r.applied) for r in done), step), run.spec)
        nodes.append(
            LineageNode(
                id=run_id,
                name=run.name,
                status=str(run.status),
                parent_id=parent_id,
                step=step,
                depth=depth,
                requested=dict(ev.data.get("changes") or {}) if ev is not None else {},
                changes=changes,
                children=children.get(run_id, []),
            )
        )
        for c in children.get(run_id, []):
            visit(c, run_id, depth + 1)

    visit(stored_id(root), None, 0)
    return Lineage(run_id=run_id, root_id=stored_id(root), nodes=nodes, truncated=truncated)
