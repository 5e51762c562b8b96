"""Model and tokenizer helpers: ``asyncrl model init`` backend and the loaders used by the run processes.

No machine here can download from a model hub, so :func:`init_model` builds a small random-init
model of one of the architectures of ``worker/policy/architectures.py`` (Qwen3 by default; Llama, Qwen2,
Qwen3-MoE, Gemma 3, Mistral, Phi-3, OLMo 2) plus a byte-level BPE tokenizer with very few merges (a
near-character vocabulary keeps character-level tasks such as reversal learnable) and a ChatML chat
template. The result is a normal ``save_pretrained`` directory that transformers and vLLM load by path.

torch/transformers/tokenizers are imported lazily so that importing this module stays cheap.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict

from worker.policy.architectures import DEFAULT_ARCH, build_config, check_arch

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHATML_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
"""Specials the BPE is trained with: ids 0-2, then the 256 byte symbols, then the merges."""
TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]
"""Delimiters of a tool call (Hermes/Qwen3 style); renderers' ``qwen3`` tool parser finds them by token id, so each
must be one token. Appended after the learned vocabulary, so every other token keeps the id it had before they
existed: the tiny model's reverse-text SFT is sensitive to which embedding row each character gets (seed 0 with
the ids shifted by these two reached a greedy reward of 0.570 after 240 SFT steps and stayed at loss ~1.1 for 400;
with these ids, 0.836)."""
SPECIAL_TOKENS = [*CHATML_TOKENS, *TOOL_CALL_TOKENS]
NUM_MERGES = 64
VOCAB_MULTIPLE = 64

CHATML_TEMPLATE = (
    "{%- set ns = namespace(first=0) %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- set ns.first = 1 %}"
    "{%- endif %}"
    "{{- '# Tools' }}"
    "{%- for tool in tools %}{%- set f = tool['function'] if tool['function'] is defined else tool %}"
    "{{- '\\n' + f['name'] + '(' + ((f['parameters'] or {}).get('properties') or {}) | list | join(', ') + ')' }}"
    "{%- if f['description'] %}{{- ': ' + f['description'] }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[ns.first:] %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}{%- set c = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>{\"name\": ' + c['name'] | tojson + ', \"arguments\": ' }}"
    "{{- c['arguments'] if c['arguments'] is string else c['arguments'] | tojson }}{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML. With ``tools`` (OpenAI function specs), the system turn lists them one per line as ``name(params):
description`` after the system message; an assistant turn's ``tool_calls`` follow its content as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the form renderers' ``qwen3`` parser reads); tool
results are ``tool`` turns."""


class _Size(TypedDict):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: NotRequired[int]
    """Per-head width; 64 where absent."""
    vocab_size: NotRequired[int]
    """Model vocabulary (embedding rows) where it is larger than the tokenizer's (padded to a multiple of 64 where
    absent): the tokenizer gets unreachable filler tokens up to it (:func:`pad_tokenizer_vocab`), so every id the
    model can sample decodes."""


# Architecture per size.
SIZES: dict[str, _Size] = {
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
    # Qwen3-0.6B's shape (its config.json on the hub: 28 layers, hidden 1024, 16 query / 8 KV heads of width 128,
    # MLP 3072, 151936 vocabulary rows, tied embeddings): 596M parameters, for GPU throughput measurements
    # (benchmarks/gpu/one_gpu_rl.py), not for learning. The tokenizer is still the byte-level one.
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "intermediate_size": 3072,
        "head_dim": 128,
        "vocab_size": 151936,
    },
}
Size = Literal["tiny", "small", "qwen3-0.6b"]


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
    """A byte-level BPE tokenizer: 3 ChatML specials, 256 byte symbols, at most ``num_merges`` merges, then the two
    tool-call delimiters (``TOOL_CALL_TOKENS``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(CHATML_TOKENS) + num_merges,
        min_frequency=2,
        special_tokens=CHATML_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed), trainer=trainer)
    tok.add_special_tokens(TOOL_CALL_TOKENS)  # after the learned ids (see TOOL_CALL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def init_model(
    out_dir: Path,
    size: Size = "tiny",
    seed: int = 0,
    *,
    overwrite: bool = False,
    arch: str = DEFAULT_ARCH,
    tied: bool | None = None,
) -> Path:
    """Build a random-init causal LM of architecture ``arch`` (``worker.policy.architectures.ARCHITECTURES``) and a
    byte-level tokenizer and save both to ``out_dir``.

    The vocabulary is padded to a multiple of 64; embeddings are tied as the family's small checkpoints are (or as
    ``tied`` says); eos is ``<|im_end|>``. The model is
    written to a temporary sibling directory and renamed into place, so ``out_dir`` is never half-written;
    an existing non-empty ``out_dir`` is replaced only with ``overwrite``. Returns ``out_dir``.

    Raises:
        ValueError: ``arch`` or ``size`` is unknown, or ``size`` is another architecture's shape (one line naming
            the allowed values).
        FileExistsError: ``out_dir`` is a file, or a non-empty directory and ``overwrite`` is False or it is
            not a model directory (no ``config.json``).
        NotADirectoryError: a parent of ``out_dir`` is a file.
        OSError: the parent directory cannot be created or written (e.g. PermissionError).
    """
    check_arch(arch)
    allowed = sizes_of(arch)
    if size not in allowed:
        raise ValueError(f"size: expected one of {', '.join(allowed)} for arch {arch}, got {size!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out_dir} exists and is not empty")
        if not (out_dir / "config.json").is_file():  # overwrite replaces a model, never some other folder
            raise FileExistsError(f"{out_dir} exists and is not a model directory (no config.json)")
    blocking = next((p for p in out_dir.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise NotADirectoryError(f"{blocking} is a file, so {out_dir} cannot be created")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model directory is an ordinary one
    try:
        _write_model(tmp, size, seed, arch, tied)
        readable(tmp)
        if out_dir.exists():  # empty, or replaced with overwrite: move it aside first, delete it after the rename
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            out_dir.rename(old / "model")
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left when something above failed
    return out_dir


def readable(folder: Path) -> None:
    """Give every file under ``folder`` the read bits the umask allows (``save_pretrained`` writes the weights file
    0600): a model made by one user (``docker compose exec`` as root) must load in a run that runs as its own uid.

    Raises:
        OSError: a file's mode cannot be changed (not its owner).
    """
    import os

    allowed = 0o444 & ~_umask()
    for path in [folder, *folder.rglob("*")]:
        mode = path.lstat().st_mode
        if path.is_symlink():
            continue
        extra = allowed | (allowed >> 2 & 0o111 if path.is_dir() else 0)  # folders: r and x
        if mode & extra != extra:
            os.chmod(path, (mode | extra) & 0o7777)


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_model(out_dir: Path, size: str, seed: int, arch: str = DEFAULT_ARCH, tied: bool | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    shape = SIZES[size]
    tokenizer = build_tokenizer(seed)
    vocab_size = shape.get("vocab_size")
    if vocab_size is None:
        vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    else:
        tokenizer = pad_tokenizer_vocab(tokenizer, vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    assert isinstance(eos_id, int) and isinstance(pad_id, int)  # one token each gives an int
    config = build_config(arch, dict(shape), vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=pad_id, tied=tied)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def sizes_of(arch: str) -> list[str]:
    """The ``SIZES`` an architecture is built in: ``tiny`` and ``small`` for every one, ``qwen3-0.6b`` for qwen3."""
    return [s for s in SIZES if arch == "qwen3" or not s.startswith("qwen3-")]


def pad_tokenizer_vocab(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> PreTrainedTokenizerBase:
    """``tokenizer`` (from :func:`build_tokenizer`) with filler tokens appended to its BPE vocabulary until it has
    ``vocab_size`` ids, so that every id a model with that many embedding rows can sample decodes to text.

    The fillers are distinct 2- and 3-symbol strings of the byte-level alphabet that no merge builds, so encoding
    any text gives the same ids as before; the specials keep their ids. Returns a new tokenizer.

    Raises:
        ValueError: ``vocab_size`` is smaller than the tokenizer's vocabulary or more than 2- and 3-symbol strings
            can fill.
    """
    import itertools
    import json

    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    for added in state["added_tokens"]:  # the tool-call delimiters sit after the BPE ids: keep them where they are
        vocab.setdefault(added["content"], added["id"])
    taken = set(vocab)
    next_id = len(tokenizer)
    if vocab_size < next_id:
        raise ValueError(f"vocab_size: expected at least the tokenizer's {next_id} ids, got {vocab_size}")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = ("".join(p) for n in (2, 3) for p in itertools.product(alphabet, repeat=n) if "".join(p) not in taken)
    for token in itertools.islice(fillers, vocab_size - next_id):
        vocab[token] = next_id
        next_id += 1
    if next_id != vocab_size:
        raise ValueError(f"vocab_size: at most {next_id} ids can be filled, got {vocab_size}")
    padded = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=tokenizer.model_max_length,
    )
    padded.chat_template = tokenizer.chat_template
    return padded


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


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_model(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """The cheap checks every command runs before starting work on a model; returns its tokenizer.

    A local directory must hold ``config.json`` that parses, weights (one of ``WEIGHT_FILES``; the headers of
    ``*.safetensors`` files are read, which finds truncated files), tokenizer files and a tokenizer with a chat
    template. The weights themselves are not loaded (seconds for large models).

    Raises:
        FileNotFoundError: local path missing, no weights or tokenizer files, or a hub name that cannot load.
        ValueError: not a model directory, config or tokenizer does not parse, or no chat template.
    """
    src = check_model_source(name_or_path)
    path = Path(src)
    if path.is_dir():
        if not any((path / f).is_file() for f in WEIGHT_FILES):
            raise FileNotFoundError(f"{path}: no model weights (expected one of {', '.join(WEIGHT_FILES)})")
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise FileNotFoundError(f"{path}: no tokenizer files (expected {' or '.join(TOKENIZER_FILES)})")
        from safetensors import SafetensorError, safe_open

        for weights in sorted(path.glob("*.safetensors")):
            try:
                with safe_open(str(weights), framework="pt") as f:  # the header only, no tensor data
                    f.keys()
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{path}: weights file {weights.name} does not load ({_first_line(e)})") from e
    import logging

    from transformers import AutoConfig  # after the file checks: a wrong path fails without the import

    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # a hub name without network: the error below says it in one line
    try:
        AutoConfig.from_pretrained(src)
    except OSError as e:
        raise FileNotFoundError(f"{src}: cannot load model config ({_first_line(e)})") from e
    except ValueError as e:
        raise ValueError(f"{src}: cannot load model config ({_first_line(e)})") from e
    finally:
        hub_log.setLevel(level)
    return load_tokenizer(src)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def load_model(name_or_path: str | Path, dtype: str | torch.dtype = "float32", **kwargs: Any) -> PreTrainedModel:
    """Load a causal LM by hub name or local path with ``AutoModelForCausalLM``.

    Raises:
        FileNotFoundError: local path missing, or the name cannot be resolved (no hub access here).
        ValueError: the path exists but is not a model directory, or its weights do not load.
    """
    import torch
    from transformers import AutoModelForCausalLM

    src = check_model_source(name_or_path)
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    from safetensors import SafetensorError

    try:
        return AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kwargs)
    except OSError as e:
        raise FileNotFoundError(f"{src}: cannot load model ({_first_line(e)})") from e
    except (SafetensorError, ValueError, RuntimeError) as e:  # truncated weights, shapes that do not match
        raise ValueError(f"{src}: cannot load model ({_first_line(e)})") from e


def parameter_counts(
    name_or_path: str | Path, lora_rank: int | None = None, lora_targets: list[str] | None = None
) -> tuple[int, int]:
    """``(all parameters, trained parameters)`` of the model, built from its config on the meta device (no weights
    read). With ``lora_rank`` the trained ones are the adapters, ``rank * (in + out)`` for every linear layer whose
    name is or ends with ``.<target>`` (PEFT's suffix matching), and they count in the total too.

    Raises:
        FileNotFoundError / ValueError: as :func:`load_model`.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = check_model_source(name_or_path)
    config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = sum(p.numel() for p in model.parameters())  # a tied lm_head counts once
    if lora_rank is None:
        return base, base
    targets = lora_targets or []
    adapters = sum(
        lora_rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith(f".{t}") for t in targets)
    )
    return base + adapters, adapters


def load_tokenizer(name_or_path: str | Path, **kwargs: Any) -> PreTrainedTokenizerBase:
    """Load a tokenizer by hub name or local path with ``AutoTokenizer``; it must have a chat template.

    Every prompt here is built with ``apply_chat_template``, so a tokenizer without one is refused at load.

    Raises:
        FileNotFoundError: as :func:`load_model`.
        ValueError: the path is not a model directory, the tokenizer files do not parse, or no chat template.
    """
    from transformers import AutoTokenizer

    src = check_model_source(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
    except OSError as e:
        raise FileNotFoundError(f"{src}: cannot load tokenizer ({_first_line(e)})") from e
    except Exception as e:  # tokenizers raises bare Exceptions for files that do not parse
        raise ValueError(f"{src}: cannot load tokenizer ({_first_line(e)})") from e
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{src}: tokenizer has no chat template (expected chat_template.jinja or 'chat_template' in "
            "tokenizer_config.json); prompts are built with it"
        )
    return tokenizer
