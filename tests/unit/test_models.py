"""``asyncrl model init`` backend: a tiny random Qwen3 + byte-level tokenizer that transformers loads."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from worker.envs.sentences import make_sentence
from worker.models import SPECIAL_TOKENS, init_model, load_model, load_tokenizer


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
