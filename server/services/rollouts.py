"""The rollout browser: a run's rollouts as its orchestrator recorded them (``rollouts/step_<n>.jsonl``,
``worker.orchestrator.batcher.Rollout.record``), listed by step, group, environment and policy-version span, one
rollout's tokens, and the same task across runs.

| what                       | function          | read                                                      |
|----------------------------|-------------------|-----------------------------------------------------------|
| steps with rollouts        | ``rollout_steps`` | the ``rollouts`` folder                                   |
| one step's first records   | ``rollouts``      | one file (the run page's panel, ``GET …/rollouts``)       |
| filtered, paged summaries  | ``browse``        | the files of the steps asked for (all: newest first)      |
| one rollout's tokens       | ``rollout``       | the file of the step its id names                         |

A rollout's id is ``<run>-<step>-<line>`` (``line``: its 0-based line in the step's file; lines are only appended,
so an id stays valid), so an id names its run and an id of another run is refused, never answered from this run's
file. Files are read through ``worker.run.run_files`` (regular files inside the run's home, no symbolic links), at most
``MAX_ROLLOUT_BYTES`` of each. Tokens are decoded with the run's tokenizer (``model.name``) when it is a local
model folder; otherwise ``text`` is None and the page shows ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from server.models import Run, stored_id
from server.services.runs import run_file, run_home
from worker.run.run_files import RunFileMissing, list_run_folder, open_run_file

_ROLLOUT_FILE = re.compile(r"^step_(\d+)\.jsonl$")
_ROLLOUT_ID = re.compile(r"([0-9]{1,10})-([0-9]{1,18})-([0-9]{1,9})")
MAX_ROLLOUT_BYTES = 64 << 20
"""The most of one ``rollouts/step_<n>.jsonl`` file read for a page or an answer."""
MAX_PAGE = 200
"""The most rollouts one page of ``browse`` holds."""
ROLLOUT_FIELDS = ("advantage",)
"""Keys every shown rollout record has, numeric (the run page and the API read them)."""
TRUNCATED = "length"
"""The ``finish_reason`` of a rollout cut at ``max_tokens`` (vLLM's)."""


class RolloutNotFound(LookupError):
    """No rollout with this id in this run (the id names another run, a step without rollouts or a line past the
    file's end)."""


class BadRolloutId(ValueError):
    """The id is not ``<run>-<step>-<line>``."""


def rollout_id(run_id: int, step: int, line: int) -> str:
    return f"{run_id}-{step}-{line}"


def parse_rollout_id(rid: str, run_id: int) -> tuple[int, int]:
    """``(step, line)`` of rollout ``rid`` of run ``run_id``.

    Raises:
        BadRolloutId: ``rid`` is not ``<run>-<step>-<line>`` (whole numbers).
        RolloutNotFound: ``rid`` names another run.
    """
    m = _ROLLOUT_ID.fullmatch(rid)
    if m is None:
        raise BadRolloutId(f"rid: expected <run>-<step>-<line> (whole numbers, e.g. {run_id}-1-0), got {rid[:40]!r}")
    owner, step, line = (int(x) for x in m.groups())
    if owner != run_id:
        raise RolloutNotFound(f"rid: rollout {rid} is of run {owner}, not of run {run_id}")
    return step, line


def rollout_steps(run: Run) -> list[int]:
    """Steps with a ``rollouts/step_<n>.jsonl`` regular file in the run directory, ascending.

    Raises:
        RunFileRefused: ``rollouts`` (or the run directory) is a symbolic link or not a folder.
    """
    found = list_run_folder(run_home(run), run_file(run, "rollouts"))
    return sorted(int(m.group(1)) for name, d in found.items() if not d and (m := _ROLLOUT_FILE.match(name)))


def _good(rec: Any) -> bool:
    return isinstance(rec, dict) and all(
        isinstance(rec.get(k), int | float) and not isinstance(rec.get(k), bool) for k in ROLLOUT_FIELDS
    )


def _read_step(run: Run, step: int) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """The step's good records with their line numbers, and how many lines were bad (not a JSON object with the
    ``ROLLOUT_FIELDS``; a torn last line included). No file: nothing.

    Raises:
        RunFileRefused: the file or a folder on its way is a symbolic link or not a regular file.
    """
    try:
        f = open_run_file(run_home(run), run_file(run, "rollouts", f"step_{step}.jsonl"))
    except RunFileMissing:
        return [], 0
    good: list[tuple[int, dict[str, Any]]] = []
    skipped = 0
    with f:
        for line, raw in enumerate(f.read(MAX_ROLLOUT_BYTES).split(b"\n")):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except ValueError:  # not JSON, or not UTF-8
                rec = None
            if _good(rec):
                good.append((line, rec))
            else:
                skipped += 1
    return good, skipped


@dataclass(frozen=True)
class Rollouts:
    step: int | None
    """The step shown (None: the run wrote no rollouts yet)."""
    records: list[dict[str, Any]]
    skipped: int
    """Lines of the file (among those read) that were not a JSON object with the ``ROLLOUT_FIELDS``."""


def rollouts(run: Run, *, step: int | None = None, limit: int = 20) -> Rollouts:
    """The first ``limit`` rollout records of ``step`` (default: the newest step with rollouts) as the orchestrator
    wrote them, each with its ``id``. A line that is not a JSON object with a numeric ``advantage`` is skipped and
    counted (a torn last line included). No file: no records.

    Raises:
        RunFileRefused: the file or a folder on its way is a symbolic link or not a regular file.
    """
    if step is None:
        steps = rollout_steps(run)
        if not steps:
            return Rollouts(None, [], 0)
        step = steps[-1]
    good, skipped = _read_step(run, step)
    records = [{"id": rollout_id(stored_id(run), step, line), **rec} for line, rec in good[:limit]]
    return Rollouts(step, records, skipped)


def summary(run_id: int, step: int, line: int, rec: dict[str, Any]) -> dict[str, Any]:
    """What the browser's table shows of one record (no token lists)."""
    span = rec.get("policy_span") or [None, None]
    return {
        "id": rollout_id(run_id, step, line),
        "step": step,
        "group": rec.get("group"),
        "env": rec.get("env", ""),
        "task": rec.get("task"),
        "role": rec.get("role"),
        "policy_span": span,
        "reward": rec.get("reward"),
        "advantage": rec.get("advantage"),
        "completion_len": rec.get("completion_len"),
        "finish_reason": rec.get("finish_reason"),
        "truncated": rec.get("finish_reason") == TRUNCATED,
        "dropped": rec.get("dropped"),
        "completion": rec.get("completion", ""),
    }


@dataclass(frozen=True)
class Filters:
    """What ``browse`` keeps (None: anything)."""

    step: int | None = None
    group: int | None = None
    env: str | None = None
    policy_version: int | None = None
    """Rollouts whose policy-version span ``[start, end]`` holds this version."""
    task: str | None = None
    """Exact task key."""

    def keeps(self, rec: dict[str, Any]) -> bool:
        span = rec.get("policy_span") or []
        return (
            (self.group is None or rec.get("group") == self.group)
            and (self.env is None or rec.get("env", "") == self.env)
            and (self.task is None or str(rec.get("task")) == self.task)
            and (
                self.policy_version is None
                or (
                    len(span) == 2
                    and all(isinstance(v, int) for v in span)
                    and span[0] <= self.policy_version <= span[1]
                )
            )
        )


@dataclass(frozen=True)
class BrowsePage:
    total: int
    """Rollouts that pass the filters."""
    offset: int
    items: list[dict[str, Any]]
    """``summary`` of each rollout of the page, steps newest first, lines in file order."""
    steps: list[int]
    """Every step with rollouts (ascending), for the step filter."""
    envs: list[str] = field(default_factory=list)
    """Environments seen in the steps read."""
    skipped: int = 0
    """Bad lines in the files read."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """The page's records as written (token lists included), each with its ``id``, aligned with ``items``."""


def browse(run: Run, filters: Filters, *, offset: int = 0, limit: int = 50) -> BrowsePage:
    """The rollouts of ``run`` that pass ``filters``, ``limit`` from ``offset`` (steps newest first).

    Raises:
        ValueError: ``limit`` outside 1..``MAX_PAGE`` or ``offset`` negative (named).
        RunFileRefused: a rollouts file or folder is a symbolic link or not a regular file/folder.
    """
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit: expected 1..{MAX_PAGE}, got {limit}")
    if offset < 0:
        raise ValueError(f"offset: expected 0 or more, got {offset}")
    steps = rollout_steps(run)
    read = [filters.step] if filters.step is not None else steps[::-1]
    kept: list[tuple[dict[str, Any], dict[str, Any]]] = []
    envs: set[str] = set()
    skipped = 0
    run_id = stored_id(run)
    for step in read:
        good, bad = _read_step(run, step)
        skipped += bad
        for line, rec in good:
            envs.add(str(rec.get("env", "")))
            if filters.keeps(rec):
                kept.append((summary(run_id, step, line, rec), rec))
    return BrowsePage(
        total=len(kept),
        offset=offset,
        items=[item for item, _ in kept[offset : offset + limit]],
        steps=steps,
        envs=sorted(e for e in envs if e),
        skipped=skipped,
        records=[{"id": item["id"], **rec} for item, rec in kept[offset : offset + limit]],
    )


@lru_cache(maxsize=8)
def _tokenizer(path: str, mtime_ns: int) -> Any:  # noqa: ARG001 (mtime_ns: a changed folder is loaded again)
    from worker.policy.models import load_tokenizer

    return load_tokenizer(path)


def run_tokenizer(run: Run) -> Any | None:
    """The run's tokenizer (``model.name``) when it is a local model folder that loads; else None (ids shown).
    Cached per folder and modification time."""
    name = (run.spec.get("model") or {}).get("name")
    if not isinstance(name, str) or not Path(name).is_dir():
        return None
    try:
        return _tokenizer(name, Path(name).stat().st_mtime_ns)
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Turn:
    """A run of consecutive completion tokens of one kind: ``model`` (sampled, trained on) or ``env`` (an
    environment/tool turn, masked out of the loss)."""

    kind: str
    tokens: list[dict[str, Any]]
    """Each ``{"index", "id", "text", "logprob", "entropy", "masked"}``; ``index`` in the completion, ``logprob``
    the recorded sampling log-prob (nats; None on environment tokens), ``entropy`` None unless recorded."""


@dataclass(frozen=True)
class RolloutView:
    summary: dict[str, Any]
    prompt: list[dict[str, Any]]
    """Prompt tokens, each ``{"index", "id", "text"}``."""
    turns: list[Turn]
    decoded: bool
    """Whether ``text`` comes from the run's tokenizer (False: ids only)."""
    record: dict[str, Any]


def _text(tokenizer: Any | None, token_id: int) -> str | None:
    return None if tokenizer is None else str(tokenizer.decode([token_id]))


def rollout(run: Run, rid: str, *, tokenizer: Any | None = None) -> RolloutView:
    """Rollout ``rid`` of ``run`` with its tokens: the prompt, then the completion split into model and env turns by
    its recorded ``completion_mask`` (1: sampled, 0: masked). A record written before token fields were recorded
    has no turns.

    Raises:
        BadRolloutId: ``rid`` is malformed. RolloutNotFound: it names another run, or no such line.
        RunFileRefused: the step's file is a symbolic link or not a regular file.
    """
    run_id = stored_id(run)
    step, line = parse_rollout_id(rid, run_id)
    good, _ = _read_step(run, step)
    rec = next((r for n, r in good if n == line), None)
    if rec is None:
        raise RolloutNotFound(f"rid: run {run_id} has no rollout {rid}")
    ids = list(rec.get("completion_ids") or [])
    lps = list(rec.get("completion_logprobs") or [None] * len(ids))
    mask = list(rec.get("completion_mask") or [1] * len(ids))
    ents = list(rec.get("completion_entropy") or [None] * len(ids))
    turns: list[Turn] = []
    for i, (tok, lp, m, ent) in enumerate(zip(ids, lps, mask, ents, strict=False)):
        kind = "model" if m else "env"
        token = {
            "index": i,
            "id": tok,
            "text": _text(tokenizer, tok),
            "logprob": lp if m else None,
            "entropy": ent if m else None,
            "masked": not m,
        }
        if turns and turns[-1].kind == kind:
            turns[-1].tokens.append(token)
        else:
            turns.append(Turn(kind, [token]))
    prompt = [{"index": i, "id": t, "text": _text(tokenizer, t)} for i, t in enumerate(rec.get("prompt_ids") or [])]
    return RolloutView(summary(run_id, step, line, rec), prompt, turns, tokenizer is not None, rec)


def same_task(run: Run, task: str, *, limit: int = MAX_PAGE) -> list[dict[str, Any]]:
    """Every rollout of ``run`` on task key ``task`` (steps newest first), at most ``limit``: one side of the
    side-by-side view.

    Raises:
        RunFileRefused: a rollouts file or folder is a symbolic link or not a regular file/folder.
    """
    return browse(run, Filters(task=task), limit=limit).items
