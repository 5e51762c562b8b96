"""SFT data (issue 22): the same rows from JSONL, Parquet and a ``datasets`` folder give the same samples; prompt /
completion pairs are chat rows; a multi-turn row trains every assistant turn; the epoch order and its data cursor;
the packed fused-head SFT loss equals the per-sample cross-entropy of plain logits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.support.models import tiny_qwen3
from worker.policy.models import build_tokenizer
from worker.spec import SpecError
from worker.trainer.dist import DistInfo
from worker.trainer.sft import sft_loss
from worker.trainer.sft_data import DataCursor, EpochOrder, read_rows, tokenize_rows

TOK = build_tokenizer(seed=0)
ROWS = [
    {"messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}]},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "niaga"},
        ]
    },
]


def _masked_text(sample: dict[str, list[int]]) -> str:
    return TOK.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"], strict=True) if m])


def test_jsonl_parquet_and_datasets_folder_give_the_same_samples(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")  # a blank line is no row
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    DatasetDict({"train": Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    samples = [
        tokenize_rows(TOK, read_rows(str(tmp_path / name), "data.path", "train"), "data.path")
        for name in ("rows.jsonl", "rows.parquet", "dd", "ds")
    ]
    assert samples[0] == samples[1] == samples[2] == samples[3]
    single, multi = samples[0]
    assert TOK.decode(single["input_ids"]) == "<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\ncba<|im_end|>"
    assert _masked_text(single) == "cba<|im_end|>"
    # multi-turn: both assistant turns train, nothing else (system, users, the scaffold)
    assert _masked_text(multi) == "yo<|im_end|>niaga<|im_end|>"
    edges = [i for i in range(1, len(multi["loss_mask"])) if multi["loss_mask"][i] != multi["loss_mask"][i - 1]]
    assert len(edges) == 3  # on, off, on: the sample ends with the last assistant turn's <|im_end|>
    with pytest.raises(SpecError, match=r"^data\.split: .*dd has splits \['train'\], not 'test'$"):
        read_rows(str(tmp_path / "dd"), "data.path", "test")


def test_prompt_completion_pairs_are_one_user_and_one_assistant_turn() -> None:
    pairs = [
        {"prompt": "abc", "completion": "cba"},
        {"prompt": [{"role": "user", "content": "abc"}], "completion": [{"role": "assistant", "content": "cba"}]},
    ]
    a, b = tokenize_rows(TOK, pairs, "data.path")
    (chat,) = tokenize_rows(TOK, ROWS[:1], "data.path")
    assert a == b == chat
    with pytest.raises(
        SpecError, match=r"^data\.eval_path: row 2 has no assistant turn to train on \(roles: \['user'\]\)$"
    ):
        tokenize_rows(TOK, [pairs[0], {"prompt": "abc", "completion": []}], "data.eval_path")


def test_epoch_order_walks_across_epoch_ends_and_resumes_from_its_cursor() -> None:
    plain = EpochOrder(5, seed=0, shuffle=False)
    assert plain.take(DataCursor(), 3) == ([0, 1, 2], DataCursor(0, 3))
    assert plain.take(DataCursor(0, 3), 4) == ([3, 4, 0, 1], DataCursor(1, 2))
    assert plain.take(DataCursor(0, 0), 11) == ([0, 1, 2, 3, 4] * 2 + [0], DataCursor(2, 1))
    shuffled = EpochOrder(5, seed=7, shuffle=True)
    e0, e1 = (list(np.random.default_rng([7, e]).permutation(5)) for e in (0, 1))
    assert e0 != e1 and sorted(e0) == sorted(e1) == [0, 1, 2, 3, 4]
    stream, cursor = shuffled.take(DataCursor(), 8)
    assert stream == e0 + e1[:3] and cursor == DataCursor(1, 3)
    # a fresh order (a resumed process) continues from the cursor with the same rows
    again, cursor2 = EpochOrder(5, seed=7, shuffle=True).take(DataCursor(1, 3), 4)
    assert again == e1[3:] + list(np.random.default_rng([7, 2]).permutation(5))[:2] and cursor2 == DataCursor(2, 2)


def test_packed_sft_loss_is_the_mean_token_cross_entropy_of_each_sample_alone() -> None:
    model = tiny_qwen3(seed=3).train()
    samples = [
        {"input_ids": [5, 17, 42, 9, 81, 2], "loss_mask": [0, 0, 1, 1, 1, 1]},
        {"input_ids": [11, 12, 13, 14], "loss_mask": [0, 1, 0, 1]},
    ]
    n_tokens = 6  # loss tokens of the step: 4 + 2
    with torch.no_grad():
        packed = float(sft_loss(model, samples, n_tokens, DistInfo(), autocast=False))
        total = 0.0
        for s in samples:  # reference: full logits of the sample alone, cross-entropy on its masked targets
            logits = model(input_ids=torch.tensor([s["input_ids"]])).logits[0, :-1]
            nll = torch.nn.functional.cross_entropy(logits, torch.tensor(s["input_ids"][1:]), reduction="none")
            total += float(nll[torch.tensor(s["loss_mask"][1:], dtype=torch.bool)].sum())
    assert packed == pytest.approx(total / n_tokens, rel=1e-5)


def test_greedy_eval_puts_the_prompts_on_the_model_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``device = "cuda"`` SFT crashed at its first eval: the prompts stayed on the CPU. On a meta-device model
    the tensors ``generate`` receives are on ``meta`` (the model's device), left-padded to the longest prompt."""
    from worker.envs import load_environment
    from worker.orchestrator.prompts import prompt_ids
    from worker.trainer.sft import greedy_eval

    with torch.device("meta"):
        model = tiny_qwen3(seed=0)
    seen: dict[str, torch.Tensor] = {}

    class Generated(Exception):
        pass

    def generate(**kwargs: torch.Tensor) -> None:
        seen.update(input_ids=kwargs["input_ids"], attention_mask=kwargs["attention_mask"])
        raise Generated

    monkeypatch.setattr(model, "generate", generate)
    env = load_environment("reverse_text", split="eval", seed=0)
    with pytest.raises(Generated):
        greedy_eval(model, TOK, env, num_examples=3)
    lengths = [len(prompt_ids(TOK, env.prompt_messages(env.task(i)))) for i in range(3)]
    assert seen["input_ids"].device.type == "meta" and seen["attention_mask"].device.type == "meta"
    assert tuple(seen["input_ids"].shape) == (3, max(lengths))


def test_message_content_must_be_a_string_or_null_beside_tool_calls() -> None:
    from worker.trainer.sft_data import row_messages

    call = {"id": "c0", "type": "function", "function": {"name": "reverse", "arguments": "{}"}}
    row = {
        "messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    }
    messages, _ = row_messages(row, "data.path", 0)
    assert messages[1] == {"role": "assistant", "tool_calls": [call]}
    bad = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": None}]}
    with pytest.raises(SpecError, match=r"^data.path: row 4 message 2 content is NoneType; expected a string"):
        row_messages(bad, "data.path", 4)
    empty = {"prompt": "ab", "completion": " "}
    with pytest.raises(SpecError, match=r"^data.path: row 3 message 2 is an empty assistant turn; expected text"):
        row_messages(empty, "data.path", 3)


@pytest.mark.parametrize(
    ("key", "override", "expected"),
    [
        (
            "seed",
            {"seed": 1},
            "seed: 1 differs from 0 of checkpoint step 4 (the data order would change); resume with seed = 0",
        ),
        (
            "data.shuffle",
            {"data": {"shuffle": False, "batch_size": 4}},
            "data.shuffle: False differs from True of "
            "checkpoint step 4 (the data order would change); resume with data.shuffle = true",
        ),
        (
            "data.batch_size",
            {"data": {"batch_size": 2}},
            "data.batch_size: 2 differs from 4 of checkpoint step 4 "
            "(the data order would change); resume with data.batch_size = 4",
        ),
    ],
)
def test_resume_with_another_data_order_is_refused_naming_the_key(
    tmp_path: Path, key: str, override: dict[str, object], expected: str
) -> None:
    """A resume whose seed, data.shuffle or data.batch_size differs from the checkpoint's would silently train on
    other rows after the cursor: refused, naming the key; the same spec resumes at the stored cursor."""
    from worker.run.rundir import RunDir
    from worker.spec import SFTSpec
    from worker.trainer.sft import _read_data_cursor, _write_data_cursor

    base = {"model": {"name": "m"}, "data": {"batch_size": 4, "shuffle": True}}
    run = RunDir(tmp_path / "run")
    run.create()
    _write_data_cursor(run, 4, DataCursor(1, 16), 24, SFTSpec.model_validate(base))
    assert _read_data_cursor(run, 4, 24, SFTSpec.model_validate(base)) == DataCursor(1, 16)
    with pytest.raises(SpecError) as err:
        _read_data_cursor(run, 4, 24, SFTSpec.model_validate({**base, **override}))
    assert str(err.value) == expected and str(err.value).startswith(f"{key}: ")


def test_launcher_preflight_checks_rows_without_tokenizing(tmp_path: Path) -> None:
    """The local launcher's ``sft_preflight(tokenize=False)`` checks each row's structure (what the service checks at
    submit) and leaves tokenizing to the trainer, so the rows are tokenized once: no samples, no ``seq_len`` check."""
    from worker.policy.models import init_model
    from worker.spec import validate_spec
    from worker.trainer.sft import sft_preflight

    model = init_model(tmp_path / "model", size="tiny", seed=0)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    data = {"name": "s", "model": {"name": str(model)}, "data": {"path": str(tmp_path / "rows.jsonl")}, "seq_len": 8}
    spec = validate_spec("sft", {**data, "output_dir": str(tmp_path / "out")})
    with pytest.raises(SpecError, match=r"^seq_len: 8 tokens cannot hold a \d+-token example"):
        sft_preflight(spec)
    checked = sft_preflight(spec, tokenize=False)
    assert (checked.train, checked.held_out, checked.tokenizer.name_or_path) == ([], [], str(model))
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"prompt": "a", "completion": []}))
    with pytest.raises(SpecError, match=r"^data\.path: row 2 has no assistant turn to train on \(roles: \['user'\]\)$"):
        sft_preflight(spec, tokenize=False)
