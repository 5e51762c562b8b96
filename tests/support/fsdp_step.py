"""One RL trainer step on a tiny random Qwen3, as a script: run plainly, or under ``torchrun`` for FSDP2.

``python tests/support/fsdp_step.py --out F [--device cpu|cuda] [--variants float32,bfloat16,float32+ac]``
writes, from rank 0, ``torch.save({variant: {"metrics", "grad_norm", "params", "world_size"}})`` to ``F``:
per variant (compute dtype, ``+ac`` activation checkpointing, ``+flex`` flex attention, ``+compile`` compiled blocks) the step's metrics, the gradient norm
before clipping and the full updated parameters. ``tests/unit/worker/trainer/test_dist.py`` (also ``-m gpu``) compare a
one-process run with a two-rank ``torchrun`` run. Not a test module itself (pytest does not collect it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.models import tiny_qwen3  # noqa: E402
from worker.spec import validate_spec  # noqa: E402
from worker.trainer.dist import (  # noqa: E402
    full_state_dict,
    grad_norm_value,
    iter_full_weights,
    prepare_model,
    setup,
    weight_shapes,
)
from worker.trainer.optim import build_optimizer  # noqa: E402
from worker.trainer.train import train_step  # noqa: E402

VOCAB = 300


def batch() -> dict:
    """12 samples in 2 groups of 6, packed into 3 micro-batches of uneven sizes (rank 1 of 2 pads one pass)."""
    gen = torch.Generator().manual_seed(3)
    samples = []
    for g, p_len in enumerate((9, 5)):
        prompt = torch.randint(0, VOCAB, (p_len,), generator=gen).tolist()
        for k in range(6):
            n = 2 + (k * 3 + g) % 7
            c = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
            samples.append(
                {
                    "input_ids": prompt + c,
                    "loss_mask": [0] * p_len + [1] * n,
                    "sampling_logprobs": [0.0] * p_len + (-torch.rand(n, generator=gen) * 3).tolist(),
                    "advantage": [-1.0, 0.5, 1.5, -1.0, 0.25, 2.0][k],
                    "temperature": [1.0, 1.5][g],
                    "policy_span": [0, 0],
                }
            )
    bins = [samples[0:5], samples[5:7], samples[7:12]]
    return {
        "step": 1,
        "num_samples": len(samples),
        "num_loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "micro_batches": bins,
    }


def one_step(
    info, dtype: str, activation_checkpointing: bool, device: str, attention: str = "sdpa", compile: bool = False
) -> dict:
    """Build the model (seed 0), run ``train_step``, clip, AdamW step; the result (full params on rank 0)."""
    spec = validate_spec(
        "rl",
        {
            "model": {"name": "unused", "dtype": dtype},
            "orchestrator": {"seq_len": 64},
            "trainer": {"device": device, "optim": {"lr": 1e-3, "max_grad_norm": 0.01}},
        },
    )
    model = tiny_qwen3(attention=attention).train()
    prepare_model(
        model, info, bf16=dtype == "bfloat16", activation_checkpointing=activation_checkpointing, compile=compile
    )
    opt = build_optimizer(model, spec.trainer.optim)
    metrics = train_step(model, batch(), spec, step=1, info=info)
    grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.trainer.optim.max_grad_norm))
    opt.step()
    one_by_one = {name: t.cpu().clone() for name, t in iter_full_weights(model)}  # every rank: a gather per tensor
    return {
        "metrics": metrics,
        "grad_norm": grad_norm,
        "params": full_state_dict(model),
        "one_by_one": one_by_one,
        "shapes": dict(weight_shapes(model)),
        "world_size": info.world_size,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--variants",
        default="float32",
        help="comma-separated dtypes with options: float32, bfloat16+ac (checkpointing), bfloat16+flex",
    )
    args = ap.parse_args()
    info = setup(args.device)
    results = {}
    for v in args.variants.split(","):
        dtype, *extra = v.split("+")
        attention = "flex_attention" if "flex" in extra else "sdpa"
        results[v] = one_step(info, dtype, "ac" in extra, args.device, attention, "compile" in extra)
    if info.is_main:
        torch.save(results, args.out)
    if info.sharded:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
