"""Model and tokenizer helpers: ``asyncrl model init`` backend and the loaders used by the run processes.

No machine here can download from a model hub, so :func:`init_model` builds a small random-init
Qwen3 model plus a byte-level BPE tokenizer with very few merges (a near-character vocabulary keeps
character-level tasks such as reversal learnable) and a ChatML chat template. The result is a
normal ``save_pretrained`` directory that transformers and vLLM load by path.

torch/transformers/tokenizers are imported lazily so that importing this module stays cheap.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
NUM_MERGES = 64
VOCAB_MULTIPLE = 64

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Architecture per size. head_dim is fixed at 64.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 768,
    },
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1536,
    },
}


def _training_corpus(seed: int, n_lines: int = 20_000) -> list[str]:
    """Text the tokenizer's merges are learned from: numbers and arithmetic-like strings only.

    Letters are left out on purpose, so every letter stays its own token: reversing text is then a
    per-token operation the tiny model can learn (with 64 merges learned over made-up sentences, a
    160-step SFT warm-up reached a greedy reverse-text reward of 0.348; with letters unmerged, 0.402).
    Digits, operators and spaces get the merges, which shortens arithmetic prompts.
    """
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.6:
            a, b = rng.randint(0, 9999), rng.randint(0, 9999)
            op = rng.choice("+-*/")
            lines.append(f"{a} {op} {b} = " + str(rng.randint(-99999, 99999)))
        else:
            lines.append(" ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(2, 10))))
    return lines


def build_tokenizer(seed: int = 0, num_merges: int = NUM_MERGES) -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer: 256 byte symbols + 3 specials + at most ``num_merges`` merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(SPECIAL_TOKENS) + num_merges,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def init_model(out_dir: Path, size: Literal["tiny", "small"] = "tiny", seed: int = 0) -> Path:
    """Build a random-init Qwen3ForCausalLM and a byte-level tokenizer and save both to ``out_dir``.

    The vocabulary is padded to a multiple of 64; embeddings are tied; eos is ``<|im_end|>``.
    Returns ``out_dir``.

    Raises:
        ValueError: if ``size`` is unknown.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if size not in SIZES:
        raise ValueError(f"size: expected one of {sorted(SIZES)}, got {size!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(seed)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    config = Qwen3Config(
        vocab_size=vocab_size,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **SIZES[size],
    )
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def check_model_source(name_or_path: str | Path) -> str:
    """Validate a local model path; leave hub names alone. Returns the string to pass to from_pretrained."""
    s = str(name_or_path)
    p = Path(s).expanduser()
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise ValueError(f"{p}: not a model directory (no config.json)")
        return str(p)
    looks_local = isinstance(name_or_path, Path) or s.startswith(("/", ".", "~")) or s.count("/") > 1
    if looks_local:
        raise FileNotFoundError(f"{p}: model path does not exist")
    return s


def load_model(name_or_path: str | Path, dtype: str | torch.dtype = "float32", **kwargs: Any) -> PreTrainedModel:
    """Load a causal LM by hub name or local path with ``AutoModelForCausalLM``.

    Raises:
        FileNotFoundError: local path missing, or the name cannot be resolved (no hub access here).
        ValueError: the path exists but is not a model directory.
    """
    import torch
    from transformers import AutoModelForCausalLM

    src = check_model_source(name_or_path)
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    try:
        return AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kwargs)
    except OSError as e:
        raise FileNotFoundError(f"{src}: cannot load model ({e.__class__.__name__}: {str(e).splitlines()[0]})") from e


def load_tokenizer(name_or_path: str | Path, **kwargs: Any) -> PreTrainedTokenizerBase:
    """Load a tokenizer by hub name or local path with ``AutoTokenizer``.

    Raises:
        FileNotFoundError / ValueError: as :func:`load_model`.
    """
    from transformers import AutoTokenizer

    src = check_model_source(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(src, **kwargs)
    except OSError as e:
        raise FileNotFoundError(
            f"{src}: cannot load tokenizer ({e.__class__.__name__}: {str(e).splitlines()[0]})"
        ) from e
