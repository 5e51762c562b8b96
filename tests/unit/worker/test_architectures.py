"""The architecture matrix on the trainer: every ``asyncrl model init --arch`` model through the real trainer code.

For each architecture of ``worker.policy.architectures`` (tied and untied embeddings, Qwen3-MoE's router, Gemma 3's
and Mistral's sliding windows shorter than the rows), a tiny random-init model written by ``init_model`` and loaded by
path, then, in this process on CPU, fp32:
- the trainer's log-probs (packed forward + fused LM head, several samples in one row, a shared prompt among them)
  equal a plain transformers forward's ``log_softmax`` of each sample run alone, within 1e-5;
- SFT: two AdamW steps of ``sft_loss`` on one repeated row; the loss is finite and goes down;
- RL: one ``train_step`` on a hand-made on-policy batch: gradients reach every parameter (the MoE router's too),
  ``mismatch_kl`` is ~0; a LoRA step on ``o_proj`` starts at the base model and trains the adapters only.
Plus the refusals: an unknown ``--arch``, a model the trainer cannot train.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.policy.architectures import ARCHITECTURES
from worker.policy.models import init_model, load_model
from worker.spec import LoraConfig, OptimConfig, validate_spec
from worker.trainer.dist import (
    DistInfo,
    check_trainable,
    decoder_blocks,
    on_disk_names,
    prepare_model,
    tied_output_keys,
    weights_state_dict,
)
from worker.trainer.logprobs import fused_logprob_entropy
from worker.trainer.lora import wrap
from worker.trainer.optim import build_optimizer
from worker.trainer.packed import ArchitectureError, forward_hidden, micro_batch_tensors
from worker.trainer.sft import sft_loss
from worker.trainer.train import train_step

ARCHS = list(ARCHITECTURES)
VOCAB = 320  # ids below the tokenizer's size (specials, bytes, merges)
PROMPT = 20
"""Prompt length of the RL samples; with completions of 14-30 tokens the rows are longer than the 32-position
sliding window of gemma3 and mistral, so the packed mask must apply it."""


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: init_model(root / arch, arch=arch, seed=0) for arch in ARCHS}


def _model(model_dirs: dict[str, Path], arch: str) -> torch.nn.Module:
    model = load_model(model_dirs[arch], dtype="float32")
    model.train()
    prepare_model(model, DistInfo(), bf16=False, activation_checkpointing=False)
    return model


def _samples(model: torch.nn.Module) -> list[dict]:
    """Two groups of two on-policy samples (sampling log-probs from a plain HF forward), a shared prompt in each."""
    gen = torch.Generator().manual_seed(1)
    samples = []
    for g in range(2):
        prompt = torch.randint(3, VOCAB, (PROMPT,), generator=gen).tolist()
        for k in range(2):
            ids = prompt + torch.randint(3, VOCAB, (14 + 8 * k + 4 * g,), generator=gen).tolist()
            samples.append(
                {
                    "input_ids": ids,
                    "loss_mask": [0] * PROMPT + [1] * (len(ids) - PROMPT),
                    "sampling_logprobs": [0.0] + _hf_logprobs(model, ids).tolist(),
                    "advantage": [1.0, -1.0][k] * (1 + g),
                    "temperature": 1.0,
                    "policy_span": [0, 0],
                    "group": g,
                    "prefix_len": PROMPT,
                }
            )
    return samples


@torch.no_grad()
def _hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of a plain HF forward of ``ids`` alone, at tokens 1..L-1: ``[L-1]`` float64."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()  # [L-1, vocab]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_every_architecture_is_built_with_its_own_class(model_dirs: dict[str, Path]) -> None:
    import json

    tied = set()
    for arch, folder in model_dirs.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"][0].lower().startswith(arch.replace("_", "")), config["architectures"]
        if config["tie_word_embeddings"]:
            tied.add(arch)
    assert tied == {"qwen2", "qwen3", "gemma3"}  # and the other five untied


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_logprobs_equal_a_plain_forward(model_dirs: dict[str, Path], arch: str) -> None:
    model = _model(model_dirs, arch)
    assert len(decoder_blocks(model)) == model.config.num_hidden_layers
    assert tied_output_keys(model) == ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    samples = _samples(model)
    t = micro_batch_tensors(samples)  # one row: the followers reuse their leader's prompt
    assert len(t.spans) == 4 and t.input_ids.shape[1] < sum(len(s["input_ids"]) for s in samples)
    worst = 0.0
    with torch.no_grad():
        hidden, weight = forward_hidden(model, t, autocast=False)  # [T, D], [vocab, D]
        for rows, s in zip(t.rows, samples, strict=True):
            lp, _ = fused_logprob_entropy(t.sample_logits(hidden, rows), weight, torch.tensor(s["input_ids"][1:]))
            worst = max(worst, float((lp.double() - _hf_logprobs(model, s["input_ids"])).abs().max()))
    print(f"{arch}: trainer vs HF log-probs max |diff| {worst:.2e}")  # noqa: T201
    assert worst <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_sft_two_steps_lower_the_loss(model_dirs: dict[str, Path], arch: str) -> None:
    model = _model(model_dirs, arch)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (40,), generator=gen).tolist()
    row = {"input_ids": ids, "loss_mask": [0] * 10 + [1] * 30}
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    losses = []
    for _ in range(3):  # two steps, then the loss after them
        loss = sft_loss(model, [row, row], n_tokens=2 * 29, info=DistInfo(), autocast=False)
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"{arch}: SFT losses {[round(x, 4) for x in losses]}")  # noqa: T201
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] > losses[1] > losses[2]
    assert losses[0] == pytest.approx(math.log(model.config.vocab_size), rel=0.1)  # random init: near uniform


def _batch(samples: list[dict]) -> dict:
    return {
        "step": 1,
        "num_samples": len(samples),
        "num_loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "micro_batches": [samples[:2], samples[2:]],
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_rl_step_reaches_every_parameter(model_dirs: dict[str, Path], arch: str) -> None:
    model = _model(model_dirs, arch)
    spec = validate_spec("rl", {"model": {"name": "unused"}, "orchestrator": {"seq_len": 128}})
    metrics = train_step(model, _batch(_samples(model)), spec, step=1)  # type: ignore[arg-type]
    print(f"{arch}: RL step 1 loss {metrics['loss']:.4f} mismatch_kl {metrics['mismatch_kl']:.1e}")  # noqa: T201
    assert math.isfinite(metrics["loss"]) and metrics["mismatch_kl"] <= 1e-6
    assert metrics["mismatch_kl_on_policy"] == metrics["mismatch_kl"]
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().max() > 0]
    assert missing == []
    if model.config.model_type == "qwen3_moe":
        routers = [n for n, _ in model.named_parameters() if n.endswith("mlp.gate.weight")]
        assert len(routers) == model.config.num_hidden_layers  # each checked above: its gradient is non-zero


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_step_starts_at_the_base_and_trains_adapters_only(model_dirs: dict[str, Path], arch: str) -> None:
    spec = validate_spec("rl", {"model": {"name": "unused"}, "orchestrator": {"seq_len": 128}})
    base = _model(model_dirs, arch)
    samples = _samples(base)
    full = train_step(base, _batch(samples), spec, step=1)  # type: ignore[arg-type]
    model = load_model(model_dirs[arch], dtype="float32").train()
    wrap(model, LoraConfig(rank=4, target_modules=["o_proj"]))
    prepare_model(model, DistInfo(), bf16=False, activation_checkpointing=False)
    lora = train_step(model, _batch(samples), spec, step=1)  # type: ignore[arg-type]
    assert lora["loss"] == pytest.approx(full["loss"], rel=1e-5, abs=1e-7)
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {n for n, p in model.named_parameters() if "lora_" in n}
    assert len(grads) == 2 * model.config.num_hidden_layers


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
def test_on_disk_names_are_what_save_pretrained_writes(model_dirs: dict[str, Path], arch: str) -> None:
    """The trainer holds Qwen3-MoE's experts fused (``experts.gate_up_proj``); ``on_disk_names`` gives the
    checkpoint's per-expert tensors, bit for bit; a model without a conversion keeps its names."""
    from safetensors.torch import load_file

    model = load_model(model_dirs[arch], dtype="float32")
    state = weights_state_dict(model)
    on_disk = on_disk_names(model, state)
    assert on_disk.keys() == load_file(model_dirs[arch] / "model.safetensors").keys()
    saved = load_file(model_dirs[arch] / "model.safetensors")
    assert all(torch.equal(on_disk[k], saved[k]) for k in saved)
    assert (on_disk.keys() != state.keys()) == (arch == "qwen3_moe")


def test_unknown_arch_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "model", "init", "--out", str(tmp_path / "m"), "--arch", "gpt2"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: --arch: expected one of llama, qwen2, qwen3, qwen3_moe, gemma3, mistral, phi3, olmo2, got 'gpt2'"
    )
    assert not (tmp_path / "m").exists()


def test_model_init_arch_and_tie_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from worker.cli import main

    assert main(["model", "init", "--out", str(tmp_path / "g"), "--arch", "gemma3", "--untied"]) == 0
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    assert (config["model_type"], config["tie_word_embeddings"]) == ("gemma3_text", False)
    assert main(["model", "init", "--out", str(tmp_path / "l"), "--arch", "llama", "--size", "qwen3-0.6b"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("error: --size: expected one of tiny, small for arch llama, got 'qwen3-0.6b'")
    )
    assert not (tmp_path / "l").exists()


def test_sft_dry_run_refuses_an_untrainable_architecture(
    model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Gemma 2 (logit soft-cap 30): ``asyncrl sft --dry-run`` names it in one line, before any weights load."""
    import shutil

    import transformers

    from worker.cli import main

    config = transformers.Gemma2Config(
        vocab_size=384,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        eos_token_id=2,
        pad_token_id=0,
    )
    folder = tmp_path / "gemma2"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for f in model_dirs["llama"].iterdir():  # the tokenizer files
        if "token" in f.name or f.name.startswith("chat_template"):
            shutil.copy(f, folder)
    toml = str(Path(__file__).resolve().parents[3] / "configs" / "reverse_text" / "sft.toml")
    argv = ["sft", "@", toml, "--model.name", str(folder), "--output_dir", str(tmp_path / "run"), "--dry-run"]
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        "error: model.name: gemma2: config.final_logit_softcapping = 30.0 transforms the logits after the output "
        "projection, which the trainer's fused LM head does not do"
    )
    assert not (tmp_path / "run").exists()


def _meta(config_class: str, **keys: object) -> torch.nn.Module:
    import transformers

    config = getattr(transformers, config_class)(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, **keys
    )
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_a_logit_soft_cap_is_refused_in_one_line() -> None:
    model = _meta("Gemma3TextConfig", num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0)
    with pytest.raises(ArchitectureError) as err:
        check_trainable(model)
    assert str(err.value) == (
        "gemma3_text: config.final_logit_softcapping = 30.0 transforms the logits after the output projection, "
        "which the trainer's fused LM head does not do"
    )


def test_a_model_without_decoder_blocks_is_refused_in_one_line() -> None:
    model = _meta("LlamaConfig")
    model._no_split_modules = []  # this instance only
    with pytest.raises(ArchitectureError, match=r"^llama: the model class names no decoder block"):
        check_trainable(model)


def test_an_unknown_attention_layer_type_is_refused() -> None:
    model = _meta("Qwen3Config", num_key_value_heads=1, head_dim=16)
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ArchitectureError, match=r"^qwen3: attention layer types \['linear_attention'\]"):
        check_trainable(model)
