"""``asyncrl model init`` backend: a tiny random Qwen3 + byte-level tokenizer that transformers loads."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

import worker.policy.models
from worker.envs.sentences import make_sentence
from worker.policy.models import SPECIAL_TOKENS, check_model, init_model, load_model, load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0)


def test_loads_in_transformers(model_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert isinstance(model, Qwen3ForCausalLM)
    cfg = AutoConfig.from_pretrained(model_dir)
    assert (
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.max_position_embeddings,
    ) == (256, 4, 4, 2, 64, 768, 1024)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.vocab_size % 64 == 0
    assert 2e6 < sum(p.numel() for p in model.parameters()) < 5e6
    ids = torch.tensor([[1, 50, 60, 70]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 4, cfg.vocab_size) and torch.isfinite(logits).all()


def test_helpers_load_and_are_deterministic(model_dir: Path, tmp_path: Path) -> None:
    model = load_model(model_dir, "float32")
    assert model.dtype == torch.float32
    assert load_model(str(model_dir), torch.bfloat16).dtype == torch.bfloat16
    again = init_model(tmp_path / "again", seed=0)
    m2 = load_model(again)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values(), strict=True))
    assert load_tokenizer(again).get_vocab() == load_tokenizer(model_dir).get_vocab()


def test_tokenizer_small_vocab_and_specials(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert 256 + len(SPECIAL_TOKENS) < len(tok) <= 256 + len(SPECIAL_TOKENS) + 64
    assert len(tok) <= cfg["vocab_size"] < len(tok) + 64
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    for s in SPECIAL_TOKENS:
        assert len(tok.encode(s, add_special_tokens=False)) == 1
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id == cfg["eos_token_id"]


def test_tokenizer_round_trips_bytes_exactly(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    rng = random.Random(0)
    texts = [make_sentence(rng) for _ in range(200)]
    texts += [
        "",
        " ",
        "  two  spaces ",
        "\n\ttabs\r\n",
        "12 + 345 = 357",
        "-7 * 8 = -56",
        "Ünïcödé — ß ∑ 😀 中文",
        ".tsed olleH",
        "<|im_start|> not special at encode?",
        "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(300)),
    ]
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False)
        assert tok.decode(ids) == t, t
    # a near-character vocabulary: sentences are not much shorter in tokens than in characters
    s = texts[:200]
    ratio = sum(len(tok.encode(t, add_special_tokens=False)) for t in s) / sum(len(t) for t in s)
    assert ratio > 0.5


def test_chat_template_renders_chatml(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    msgs = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "Abc de."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nReverse the text.<|im_end|>\n<|im_start|>user\nAbc de.<|im_end|>\n<|im_start|>assistant\n"
    )
    no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_gen == text.removesuffix("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(msgs + [{"role": "assistant", "content": ".ed cbA"}], tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tok.eos_token_id) == 3


def test_small_size_and_bad_size(tmp_path: Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(init_model(tmp_path / "small", size="small"))
    assert cfg.hidden_size == 512 and cfg.num_hidden_layers == 8
    with pytest.raises(ValueError, match="size"):
        init_model(tmp_path / "x", size="huge")  # type: ignore[arg-type]


def test_clear_errors_for_bad_paths(tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_tokenizer(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_model(tmp_path / "empty")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="file.txt"):
        load_tokenizer(tmp_path / "file.txt")


# ----------------------------------------------------------------------------- init_model keeps what is stored


def test_init_refuses_existing_dir_and_overwrite_replaces(tmp_path: Path) -> None:
    out = tmp_path / "m"
    init_model(out, seed=0)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match=f"^{out} exists and is not empty$"):
        init_model(out, seed=1)
    assert (out / "model.safetensors").read_bytes() == before
    assert init_model(out, seed=1, overwrite=True) == out
    assert (out / "model.safetensors").read_bytes() != before
    assert load_model(out).config.vocab_size % 64 == 0
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary folder left beside it
    assert out.stat().st_mode & 0o777 == 0o755


def test_init_never_replaces_other_things(tmp_path: Path) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a model directory"):
        init_model(folder, overwrite=True)
    assert (folder / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        init_model(tmp_path / "file", overwrite=True)
    with pytest.raises(NotADirectoryError, match=f"{tmp_path / 'file'} is a file"):
        init_model(tmp_path / "file" / "sub")
    assert (tmp_path / "file").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "notes"]


def test_init_failure_leaves_nothing_half_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(out_dir: Path, *args: object) -> None:  # noqa: ARG001 - _write_model's signature
        (out_dir / "config.json").write_text("{}")  # half-way through saving
        raise RuntimeError("disk full")

    monkeypatch.setattr(worker.policy.models, "_write_model", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        init_model(tmp_path / "new")
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text('{"kept": true}')
    with pytest.raises(RuntimeError, match="disk full"):
        init_model(old, overwrite=True)
    assert json.loads((old / "config.json").read_text()) == {"kept": True}
    assert [p.name for p in tmp_path.iterdir()] == ["old"]


# ----------------------------------------------------------------------------- check_model: cheap checks, clear errors


def _broken_copy(model_dir: Path, tmp_path: Path, name: str, remove: list[str]) -> Path:
    out = tmp_path / name
    shutil.copytree(model_dir, out)
    for f in remove:
        (out / f).unlink()
    return out


def test_check_model_returns_a_chat_tokenizer(model_dir: Path) -> None:
    tok = check_model(model_dir)
    assert tok.chat_template == load_tokenizer(model_dir).chat_template
    assert tok.eos_token == "<|im_end|>"


def test_check_model_names_what_is_missing(model_dir: Path, tmp_path: Path) -> None:
    assert not json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    no_chat = _broken_copy(model_dir, tmp_path, "no_chat", ["chat_template.jinja"])
    for load in (check_model, load_tokenizer):
        with pytest.raises(ValueError, match=f"^{no_chat}: tokenizer has no chat template \\(expected chat_template"):
            load(no_chat)
    no_weights = _broken_copy(model_dir, tmp_path, "no_weights", ["model.safetensors"])
    with pytest.raises(
        FileNotFoundError, match=f"^{no_weights}: no model weights \\(expected one of model.safetensors"
    ):
        check_model(no_weights)
    no_tok = _broken_copy(model_dir, tmp_path, "no_tok", ["tokenizer.json", "tokenizer_config.json"])
    with pytest.raises(FileNotFoundError, match=f"^{no_tok}: no tokenizer files"):
        check_model(no_tok)
    bad_cfg = _broken_copy(model_dir, tmp_path, "bad_cfg", [])
    (bad_cfg / "config.json").write_text("{not json")
    with pytest.raises(FileNotFoundError, match=f"^{bad_cfg}: cannot load model config \\(OSError: "):
        check_model(bad_cfg)
    bad_tok = _broken_copy(model_dir, tmp_path, "bad_tok", [])
    (bad_tok / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=f"^{bad_tok}: cannot load tokenizer \\("):
        check_model(bad_tok)
    with pytest.raises(FileNotFoundError, match="model path does not exist"):
        check_model(tmp_path / "nope")
    truncated = _broken_copy(model_dir, tmp_path, "truncated", [])
    weights = (model_dir / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(
        ValueError,
        match=f"^{truncated}: weights file model.safetensors does not load \\("
        "SafetensorError: .*file not fully covered",
    ):
        check_model(truncated)
    with pytest.raises(ValueError, match=f"^{truncated}: cannot load model \\("):
        load_model(truncated)


def test_pad_tokenizer_vocab_keeps_every_encoding_and_decodes_every_id() -> None:
    from worker.policy.models import SIZES, build_tokenizer, pad_tokenizer_vocab

    base = build_tokenizer(0)
    size = SIZES["qwen3-0.6b"]["vocab_size"]  # type: ignore[typeddict-item]  # present for this size
    padded = pad_tokenizer_vocab(base, size)
    assert (len(base), len(padded)) == (325, 151936)
    text = "Reverse 'abc 123 + 45' <tool_call>x</tool_call><|im_end|>"
    assert padded(text).input_ids == base(text).input_ids  # fillers are unreachable: no merge builds them
    messages = [{"role": "user", "content": "hello"}]
    assert padded.apply_chat_template(messages, add_generation_prompt=True) == base.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert [padded.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 323, 324]
    fillers = [padded.convert_ids_to_tokens(i) for i in (325, 100_000, 151_935)]
    assert all(isinstance(t, str) and len(t) in (2, 3) for t in fillers)  # every id the model samples decodes
    assert len(set(padded.get_vocab().values())) == size
    with pytest.raises(ValueError, match="vocab_size: expected at least the tokenizer's 325 ids, got 100"):
        pad_tokenizer_vocab(base, 100)


def test_a_made_model_is_readable_by_other_users(tmp_path: Path) -> None:
    """``save_pretrained`` writes the weights 0600; a model made by one user (compose: root) is the base of runs that
    run as their own uid, so every file gets the read bits the umask allows (``readable``)."""
    import os
    import stat

    from worker.policy.models import init_model

    old = os.umask(0o022)
    try:
        model = init_model(tmp_path / "m", size="tiny", seed=0)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in model.iterdir()}
    assert modes["model.safetensors"] & 0o044 == 0o044, modes
    assert all(m & 0o044 == 0o044 for m in modes.values()), modes
    assert stat.S_IMODE(model.stat().st_mode) & 0o055 == 0o055
