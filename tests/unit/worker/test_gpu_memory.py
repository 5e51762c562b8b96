"""The GPU memory split of a colocated run (issue 20's bad input): ``trainer.gpu_memory_fraction`` +
``inference.gpu_memory_utilization`` at most 1 on a shared GPU, and a trainer state that cannot fit its share refused
with the numbers (``worker.launchers.capacity.check_trainer_memory``, ``worker.policy.models.parameter_counts``)."""

from __future__ import annotations

import pytest

from worker.launchers.capacity import check_trainer_memory
from worker.policy.models import init_model, load_model, parameter_counts
from worker.spec import SpecError, validate_spec

GIB = 2**30
H200 = int(139.8 * GIB)


def spec(**trainer: object) -> object:
    return validate_spec("rl", {"model": {"name": "m"}, "trainer": {"device": "cuda", **trainer}})


def test_a_split_over_the_whole_gpu_is_refused_only_when_the_gpu_is_shared() -> None:
    with pytest.raises(ValueError, match=r"0.8 \+ inference.gpu_memory_utilization 0.3 = 1.1 of the GPU"):
        spec(gpu_memory_fraction=0.8)
    assert spec(gpu_memory_fraction=0.7).colocated  # 0.7 + 0.3 = 1: allowed
    apart = validate_spec(
        "rl",
        {
            "model": {"name": "m"},
            "trainer": {"device": "cuda", "gpu_memory_fraction": 0.9},
            "launcher": {"local": {"inference_gpus": [0], "trainer_gpus": [1]}},
        },
    )
    assert not apart.colocated
    assert not validate_spec("rl", {"model": {"name": "m"}, "trainer": {"gpu_memory_fraction": 0.9}}).colocated  # cpu


def test_a_0_6b_model_needs_16_bytes_per_trained_parameter() -> None:
    params = 596_049_920  # Qwen3-0.6B shape
    # 16 B x 596.0M = 9.54e9 B = 8.88 GiB; a 0.05 share of 139.8 GiB is 6.99 GiB
    with pytest.raises(SpecError) as err:
        check_trainer_memory(spec(gpu_memory_fraction=0.05), params=params, trained_params=params, gpu_bytes=H200)
    assert str(err.value) == (
        "trainer.gpu_memory_fraction: the trainer needs at least 8.9 GiB per GPU (596M parameters, 596M trained: 16 B "
        "each for fp32 weights, gradients and AdamW moments, 4 B per frozen one) but its share is 0.05 of the GPU's "
        "139.8 GiB = 7.0 GiB"
    )
    check_trainer_memory(spec(gpu_memory_fraction=0.07), params=params, trained_params=params, gpu_bytes=H200)
    # no fraction: what vLLM leaves on the shared GPU (1 - 0.3 = 0.7 of 139.8 GiB)
    check_trainer_memory(spec(), params=params, trained_params=params, gpu_bytes=H200)
    # LoRA: the frozen base at 4 B (2.2 GiB) fits a 0.02 share (2.8 GiB) that full fine-tuning would not
    check_trainer_memory(spec(gpu_memory_fraction=0.02), params=params, trained_params=10_000_000, gpu_bytes=H200)


def test_parameter_counts_from_the_config_match_the_loaded_model(tmp_path) -> None:
    model_dir = init_model(tmp_path / "m", size="tiny", seed=0)
    loaded = load_model(model_dir)
    total = sum(p.numel() for p in loaded.parameters())
    assert parameter_counts(model_dir) == (total, total)
    cfg = loaded.config
    q_out = cfg.num_attention_heads * cfg.head_dim
    adapters = cfg.num_hidden_layers * 8 * (cfg.hidden_size + q_out)  # rank 8 on every q_proj
    assert parameter_counts(model_dir, 8, ["q_proj"]) == (total + adapters, adapters)
