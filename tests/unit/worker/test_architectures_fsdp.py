"""FSDP2 over every ``asyncrl model init --arch`` model: a trainer step on 2 gloo ranks equals the one-process step.

The decoder blocks FSDP2 shards one by one are the classes each model's ``_no_split_modules`` names
(``worker.trainer.dist.decoder_blocks``); this checks, per architecture (Qwen3-MoE's 3-D expert tensors, Gemma 3's
tied embedding among them), that sharding by them, with and without activation checkpointing, changes no metric and
no updated parameter. This file is also the script each side runs: plainly, and under
``torchrun --nproc-per-node 2``; all architectures in one launch.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from worker.policy.architectures import ARCHITECTURES  # noqa: E402

pytestmark = pytest.mark.serial  # gloo process groups: not beside the parallel pass
VOCAB = 320


def _batch() -> dict:
    """8 samples in 2 groups (shared prompts), packed into 3 micro-batches (rank 1 of 2 pads one pass)."""
    gen = torch.Generator().manual_seed(5)
    samples = []
    for g in range(2):
        prompt = torch.randint(3, VOCAB, (12,), generator=gen).tolist()
        for k in range(4):
            n = 10 + 7 * k + 3 * g
            samples.append(
                {
                    "input_ids": prompt + torch.randint(3, VOCAB, (n,), generator=gen).tolist(),
                    "loss_mask": [0] * 12 + [1] * n,
                    "sampling_logprobs": [0.0] * 12 + (-torch.rand(n, generator=gen) * 6).tolist(),
                    "advantage": [1.0, -0.5, 0.5, -1.0][k],
                    "temperature": 1.0,
                    "policy_span": [0, 0],
                    "group": g,
                    "prefix_len": 12,
                }
            )
    return {
        "step": 1,
        "num_samples": len(samples),
        "num_loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "micro_batches": [samples[:3], samples[3:5], samples[5:]],
    }


def _one_step(folder: Path, info: object, activation_checkpointing: bool) -> dict:
    from worker.policy.models import load_model
    from worker.spec import validate_spec
    from worker.trainer.dist import full_state_dict, grad_norm_value, prepare_model
    from worker.trainer.optim import build_optimizer
    from worker.trainer.train import train_step

    spec = validate_spec(
        "rl",
        {"model": {"name": str(folder)}, "orchestrator": {"seq_len": 96}, "trainer": {"optim": {"lr": 1e-3}}},
    )
    model = load_model(folder, dtype="float32").train()
    prepare_model(model, info, bf16=False, activation_checkpointing=activation_checkpointing)  # type: ignore[arg-type]
    opt = build_optimizer(model, spec.trainer.optim)
    metrics = train_step(model, _batch(), spec, step=1, info=info)  # type: ignore[arg-type]
    grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.trainer.optim.max_grad_norm))
    opt.step()
    return {"metrics": metrics, "grad_norm": grad_norm, "params": full_state_dict(model)}


def main() -> None:
    """``python test_architectures_fsdp.py --models DIR --out F [--ac]``: one step per architecture folder of DIR."""
    from worker.trainer.dist import setup

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ac", action="store_true", help="also with activation checkpointing")
    args = ap.parse_args()
    info = setup("cpu")
    results = {}
    for arch in ARCHITECTURES:
        results[arch] = _one_step(args.models / arch, info, False)
        if args.ac:
            results[f"{arch}+ac"] = _one_step(args.models / arch, info, True)
    if info.is_main:
        torch.save({"world_size": info.world_size, **results}, args.out)
    if info.sharded:
        torch.distributed.destroy_process_group()


def _run(models: Path, out: Path, nproc: int, *extra: str) -> dict:
    launcher = [] if nproc == 0 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *launcher, __file__, "--models", str(models), "--out", str(out), *extra]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=600)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    from worker.policy.models import init_model

    tmp = tmp_path_factory.mktemp("fsdp-archs")
    for arch in ARCHITECTURES:
        init_model(tmp / "models" / arch, arch=arch, seed=0)
    return _run(tmp / "models", tmp / "one.pt", 0), _run(tmp / "models", tmp / "two.pt", 2, "--ac")


def _assert_same(one: dict, two: dict, *, rtol: float, atol: float) -> None:
    for name in ("loss", "entropy", "mismatch_kl", "is_ratio", "masked_fraction"):
        assert math.isclose(one["metrics"][name], two["metrics"][name], rel_tol=rtol, abs_tol=atol), name
    assert math.isclose(one["grad_norm"], two["grad_norm"], rel_tol=rtol, abs_tol=atol)
    assert one["params"].keys() == two["params"].keys()
    for name, p in one["params"].items():
        torch.testing.assert_close(two["params"][name], p, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_fsdp2_two_ranks_equal_one_process(steps: tuple[dict, dict], arch: str) -> None:
    one, two = steps
    assert (one["world_size"], two["world_size"]) == (1, 2)
    _assert_same(one[arch], two[arch], rtol=1e-5, atol=1e-6)
    _assert_same(two[arch], two[f"{arch}+ac"], rtol=1e-6, atol=1e-7)


if __name__ == "__main__":
    main()
