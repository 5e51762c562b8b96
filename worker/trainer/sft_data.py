"""SFT rows: read a JSONL / Parquet file or a ``datasets`` folder, check every row, tokenize it with the assistant-only
loss mask, and the seeded epoch order with its data cursor (what an SFT checkpoint stores to resume exactly).

A row is ``{"messages": [...], "tools": [...]?}`` (OpenAI chat messages) or ``{"prompt": P, "completion": C}``
where ``P`` is text (one user turn) or a list of messages and ``C`` text (one assistant turn) or a list of messages.
Each row is rendered by the model's chat template as the RL rollouts render it
(:func:`sft_conversation_sample`): the loss mask is 1 on every assistant turn's tokens (multi-turn rows
train each of them), 0 on everything else.

No torch here: ``asyncrl sft --dry-run`` reads and checks the rows before any weights load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.orchestrator.prompts import prompt_ids
from worker.spec import SpecError


def sft_sample(tokenizer: Any, messages: list[dict[str, Any]], answer: str) -> dict[str, list[int]]:
    """Token ids of prompt + answer + end-of-turn, with the loss mask on the answer tokens."""
    prompt = prompt_ids(tokenizer, messages)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    completion = tokenizer.encode(answer, add_special_tokens=False) + [end]
    return {"input_ids": prompt + completion, "loss_mask": [0] * len(prompt) + [1] * len(completion)}


def sft_conversation_sample(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> dict[str, list[int]]:
    """Token ids of a whole conversation (OpenAI chat messages, assistant tool calls included) rendered as the
    RL rollouts render it (renderers' `DefaultRenderer`: the model's chat template with `tools`, as verifiers'
    TrainClient uses it), cut after the last assistant turn's end-of-turn token. The loss mask is 1 on what the
    model samples in a rollout: each assistant turn's tokens after its ``<|im_start|>assistant\\n`` opener up to and
    including its ``<|im_end|>``; system, user and tool turns and the template scaffold are 0.

    Raises:
        ValueError: no assistant message, or the template renders a conversation prefix differently from the
            start of the whole conversation (then rollouts and SFT would see different tokens).
    """
    from renderers import DefaultRenderer

    renderer = DefaultRenderer(tokenizer)
    full = renderer.render_ids(messages, tools=tools)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mask = [0] * len(full)
    end = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = renderer.render_ids(messages[:i], tools=tools, add_generation_prompt=True)
        if full[: len(prefix)] != prefix:
            raise ValueError(f"chat template: the conversation up to message {i} does not render as a prefix of it")
        end = full.index(end_id, len(prefix)) + 1
        mask[len(prefix) : end] = [1] * (end - len(prefix))
    if end == 0:
        raise ValueError("sft conversation: no assistant message to train on")
    return {"input_ids": full[:end], "loss_mask": mask[:end]}


ROW_FORMS = "expected {'messages': [...]} with an assistant message, or {'prompt': ..., 'completion': ...}"


def read_rows(path: str, field: str, split: str) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl`` / ``.parquet`` file or a ``datasets`` folder (``save_to_disk``), as dicts.

    Args:
        path: the file or folder.
        field: the spec key that named it (``data.path``, ``data.eval_path``), for error messages.
        split: the split taken from a folder that holds a ``DatasetDict``.

    Raises:
        SpecError: ``<field>: ...`` when the path does not exist, is of another kind, does not parse (the JSONL
            line is named), or holds no rows.
    """
    p = Path(path)
    if not p.exists():
        raise SpecError(f"{field}: {path} does not exist (expected a .jsonl or .parquet file or a datasets folder)")
    if not (p.is_dir() or p.is_file()):  # a FIFO, socket or device: opening it could block or never end
        raise SpecError(f"{field}: {path} is not a regular file or a folder (expected a .jsonl or .parquet file)")
    rows: list[dict[str, Any]]
    if p.is_dir():
        rows = _dataset_rows(p, field, split)
    elif p.suffix == ".jsonl":
        rows = []
        with p.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as err:
                    raise SpecError(f"{field}: {path} line {line_no} is not JSON ({err})") from None
                rows.append(row)
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds for a broken file
            raise SpecError(f"{field}: {path} does not read as Parquet ({type(err).__name__}: {err})") from None
    else:
        raise SpecError(f"{field}: {path}: expected a .jsonl or .parquet file or a datasets folder (save_to_disk)")
    if not rows:
        raise SpecError(f"{field}: {path} is empty (no rows)")
    return rows


def _dataset_rows(p: Path, field: str, split: str) -> list[dict[str, Any]]:
    from datasets import Dataset, DatasetDict, load_from_disk

    try:
        ds = load_from_disk(str(p))
    except (FileNotFoundError, ValueError) as err:
        raise SpecError(f"{field}: {p} is no datasets folder (save_to_disk): {err}") from None
    if isinstance(ds, DatasetDict):
        if split not in ds:
            key = "data.split" if field == "data.path" else "data.eval_split"
            raise SpecError(f"{key}: {p} has splits {sorted(ds)}, not {split!r}")
        ds = ds[split]
    assert isinstance(ds, Dataset)
    return [dict(r) for r in ds]


def row_messages(row: Any, field: str, index: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A row as ``(messages, tools)``: prompt/completion pairs become a user turn (text prompt) and an assistant
    turn (text completion).

    Raises:
        SpecError: ``<field>: row <index> ...`` (rows and messages count from 1: row 1 is the first row; blank
            JSONL lines are no rows) when the row has neither form, a message is not ``{"role": ..., "content": ...}``,
            a message's content is not a string (None only beside ``tool_calls``), an assistant turn is empty, or no
            message is the assistant's.
    """
    if not isinstance(row, dict):
        raise SpecError(f"{field}: row {index} is {type(row).__name__}, not an object; {ROW_FORMS}")
    if "messages" in row and row["messages"] is not None:
        messages = row["messages"]
    elif "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        messages = [
            *([{"role": "user", "content": prompt}] if isinstance(prompt, str) else (prompt or [])),
            *([{"role": "assistant", "content": completion}] if isinstance(completion, str) else (completion or [])),
        ]
    else:
        raise SpecError(f"{field}: row {index} has keys {sorted(row)}; {ROW_FORMS}")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise SpecError(f"{field}: row {index}: messages must be a list of {{'role': ..., 'content': ...}} objects")
    for j, m in enumerate(messages, start=1):
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise SpecError(
                f"{field}: row {index} message {j} content is {type(content).__name__}; expected a string "
                "(or null in an assistant message with tool_calls)"
            )
        if m["role"] == "assistant" and isinstance(content, str) and not content.strip() and not m.get("tool_calls"):
            raise SpecError(f"{field}: row {index} message {j} is an empty assistant turn; expected text to train on")
    if not any(m["role"] == "assistant" for m in messages):
        raise SpecError(
            f"{field}: row {index} has no assistant turn to train on (roles: {[m['role'] for m in messages]})"
        )
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # Parquet fills absent keys with None
    tools = row.get("tools") or None
    return messages, tools


def check_rows(rows: list[dict[str, Any]], field: str) -> None:
    """The structure of every row (:func:`row_messages`) without tokenizing it: what the service checks at submit
    and the local launcher before the trainer (which tokenizes) starts.

    Raises:
        SpecError: ``<field>: row <index> ...``, as :func:`row_messages`.
    """
    for i, row in enumerate(rows, start=1):
        row_messages(row, field, i)


def tokenize_rows(tokenizer: Any, rows: list[dict[str, Any]], field: str) -> list[dict[str, list[int]]]:
    """Every row as ``{"input_ids", "loss_mask"}`` (``sft_conversation_sample``).

    Raises:
        SpecError: a row is malformed (``row_messages``) or the chat template renders it inconsistently.
    """
    out = []
    for i, row in enumerate(rows, start=1):
        messages, tools = row_messages(row, field, i)
        try:
            out.append(sft_conversation_sample(tokenizer, messages, tools))
        except ValueError as err:
            raise SpecError(f"{field}: row {i}: {err}") from None
    return out


@dataclass(frozen=True)
class DataCursor:
    """Where the next step's rows start: ``offset`` rows into epoch ``epoch`` (each epoch a seeded permutation)."""

    epoch: int = 0
    offset: int = 0

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}


class EpochOrder:
    """The training order of ``n`` rows: epoch ``e`` is ``numpy.random.default_rng([seed, e]).permutation(n)``
    with ``shuffle``, else ``0..n-1``; ``take`` walks it from a cursor across epoch ends."""

    def __init__(self, n: int, seed: int, shuffle: bool) -> None:
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._cache: dict[int, np.ndarray] = {}

    def epoch(self, e: int) -> np.ndarray:
        if e not in self._cache:
            self._cache = {
                e: np.random.default_rng([self.seed, e]).permutation(self.n) if self.shuffle else np.arange(self.n)
            }
        return self._cache[e]

    def take(self, cursor: DataCursor, count: int) -> tuple[list[int], DataCursor]:
        """The next ``count`` row indices from ``cursor`` and the cursor after them."""
        out: list[int] = []
        epoch, offset = cursor.epoch, cursor.offset
        while len(out) < count:
            order = self.epoch(epoch)
            k = min(count - len(out), self.n - offset)
            out.extend(int(i) for i in order[offset : offset + k])
            offset += k
            if offset == self.n:
                epoch, offset = epoch + 1, 0
        return out, DataCursor(epoch, offset)
