"""Trainer tokens/s of ``train_step`` + optimizer step on synthetic batches shaped like the RL batches.

Each step is what the trainer process does per batch minus file I/O and weight publishing:
``worker.trainer.train.train_step`` (forward, temperature-scaled logprobs, ``dppo_kl`` loss,
backward over every packed micro-batch), ``clip_grad_norm_``, ``AdamW.step``, ``zero_grad``.

Batches: 64 samples (8 prompts x 8 samples) of real reverse-text prompts (chat-templated token ids
of train tasks) plus a completion of ``len(answer) + 1`` random tokens, i.e. the length a correct
reversal + ``<|im_end|>`` has (~64 tokens a sample in all, ~4.1k a batch), packed first-fit-decreasing
(``worker.orchestrator.packing.pack``) into micro-batches of ``orchestrator.seq_len`` 256 or 1024 tokens, exactly
as the orchestrator packs them. Sampling logprobs are random in [-3, 0), advantages +-1.

Grid: seq_len {256, 1024} x torch threads {1, 2} x {fp32, bf16 autocast, fp32 with shared-prompt packing
(``worker.orchestrator.packing.pack_shared_prompt``: each prompt once per chunk of its 8 samples)} (``model.dtype`` =
"bfloat16" turns on ``torch.autocast("cpu", bfloat16)`` in ``train_step``; master weights stay fp32).
Per cell: ``--warmup`` steps (at most 1 for bf16), then ``--steps`` timed steps (``--bf16-steps``
for bf16 cells); tokens/s = batch tokens / step seconds,
median over steps. The model is the tiny Qwen3 (random init: speed does not depend on the weights).

Run: ``.venv/bin/python benchmarks/trainer_throughput.py [--quick]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402


def synthetic_batch(tokenizer, seq_len: int, seed: int, prompts: int = 8, group: int = 8, share: bool = False) -> dict:
    from worker.orchestrator.packing import pack, pack_shared_prompt
    from worker.orchestrator.prompts import prompt_ids

    rng = random.Random(seed)
    env = C.bench_env(C.TMP / "tiny-init")  # rl.toml's prompts (the model path is not read)
    vocab = len(tokenizer)
    samples = []
    for i in range(prompts):
        task = env.task(seed * prompts + i)
        p = prompt_ids(tokenizer, env.prompt_messages(task))
        n_completion = len(tokenizer.encode(task.data.answer, add_special_tokens=False)) + 1
        for _ in range(group):
            c = [rng.randrange(vocab) for _ in range(n_completion)]
            samples.append(
                {
                    "input_ids": p + c,
                    "loss_mask": [0] * len(p) + [1] * len(c),
                    "sampling_logprobs": [0.0] * len(p) + [-3 * rng.random() for _ in c],
                    "advantage": rng.choice([-1.0, 1.0]),
                    "temperature": 1.0,
                    "policy_span": [0, 0],
                    **({"group": i, "prefix_len": len(p)} if share else {}),
                }
            )
    lengths = [len(s["input_ids"]) for s in samples]
    if share:  # as the orchestrator packs with orchestrator.share_prompt (the default)
        bins = pack_shared_prompt(lengths, [s["prefix_len"] for s in samples], [s["group"] for s in samples], seq_len)
    else:
        bins = pack(lengths, seq_len)
    return {
        "step": 1,
        "num_samples": len(samples),
        "num_loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "micro_batches": [[samples[i] for i in b] for b in bins],
    }


def run_cell(
    model_dir: Path, tokenizer, seq_len: int, threads: int, dtype: str, warmup: int, steps: int, share: bool = False
) -> dict:
    import torch

    from worker.policy.models import load_model
    from worker.trainer.optim import build_optimizer
    from worker.trainer.train import train_step

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    spec = C.rl_spec(model_dir, "bench-trainer", [("model.dtype", dtype), ("orchestrator.seq_len", str(seq_len))])
    model = load_model(str(model_dir), dtype="float32", attn_implementation="sdpa")
    model.train()
    opt = build_optimizer(model, spec.trainer.optim)
    times, tokens = [], []
    for k in range(warmup + steps):
        batch = synthetic_batch(tokenizer, seq_len, seed=k, share=share)
        t0 = time.perf_counter()
        n_tok = train_step(model, batch, spec, step=1)["trained_tokens"]  # tokens in the packed rows
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.trainer.optim.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if k >= warmup:
            times.append(dt)
            tokens.append(n_tok)
    tps = [n / t for n, t in zip(tokens, times, strict=True)]
    return {
        "seq_len": seq_len,
        "threads": threads,
        "dtype": dtype,
        "shared_prompt": share,
        "micro_batches": len(batch["micro_batches"]),
        "tokens_per_step_mean": sum(tokens) / len(tokens),
        "step_s_median": C.median(times),
        "samples_per_s_median": C.median([batch["num_samples"] / t for t in times]),
        "tokens_per_s_median": C.median(tps),
        "tokens_per_s_min": min(tps),
        "tokens_per_s_max": max(tps),
        "steps": steps,
        "warmup": warmup,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="0 warm-up + 1 timed step per cell")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per cell (default 10; quick 1)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per cell (default 2; quick 0)")
    ap.add_argument("--bf16-steps", type=int, default=None, help="timed steps of bf16 cells (default 5; quick 1)")
    args = ap.parse_args()
    steps = args.steps or (1 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 2)
    bf16_steps = args.bf16_steps or (1 if args.quick else 5)

    started = time.time()
    machine = C.machine_facts()
    from worker.policy.models import init_model, load_tokenizer

    model_dir = C.TMP / "tiny-init"
    if not (model_dir / "config.json").is_file():
        init_model(model_dir, size="tiny", seed=0)
    tokenizer = load_tokenizer(model_dir)

    cells = []
    for seq_len in (256, 1024):
        for threads in (1, 2):
            for dtype, share in (("float32", False), ("bfloat16", False), ("float32", True)):
                n = bf16_steps if dtype == "bfloat16" else steps
                cell = run_cell(
                    model_dir,
                    tokenizer,
                    seq_len,
                    threads,
                    dtype,
                    min(warmup, 1) if dtype == "bfloat16" else warmup,
                    n,
                    share,
                )
                C.say(
                    f"[bench] seq_len {seq_len} threads {threads} {dtype} shared_prompt={share}: "
                    f"{cell['tokens_per_s_median']:.0f} tok/s ({cell['step_s_median']:.2f}s/step)"
                )
                cells.append(cell)

    def fp32(c: dict) -> dict:
        return next(
            x
            for x in cells
            if x["seq_len"] == c["seq_len"]
            and x["threads"] == c["threads"]
            and x["dtype"] == "float32"
            and not x["shared_prompt"]
        )

    for c in cells:  # samples/s against fp32 with every prompt laid out (64 samples a step in every cell)
        c["speed_vs_fp32"] = c["samples_per_s_median"] / fp32(c)["samples_per_s_median"]
    bf16_ratios = [c["speed_vs_fp32"] for c in cells if c["dtype"] == "bfloat16"]
    share_ratios = [c["speed_vs_fp32"] for c in cells if c["shared_prompt"]]
    payload = {
        "setup": {
            "model": "tiny Qwen3 (hidden 256, 4 layers), random init",
            "samples_per_batch": 64,
            "loss": "dppo_kl",
            "optimizer": "AdamW",
            "steps": steps,
            "bf16_steps": bf16_steps,
            "warmup": warmup,
        },
        "cells": cells,
        "bf16_speed_vs_fp32_median": C.median(bf16_ratios),
        "shared_prompt_speed_vs_full_median": C.median(share_ratios),
        "finding": (
            f"bf16 autocast runs at {C.median(bf16_ratios):.2f}x the fp32 speed on this CPU "
            f"(<1 = slower); shared-prompt packing at {C.median(share_ratios):.2f}x (fp32, samples/s)."
        ),
    }
    out = C.write_result("trainer_throughput", payload, quick=args.quick, started=started, machine=machine)
    table = C.md_table(
        [
            "seq_len",
            "threads",
            "dtype",
            "prompt layout",
            "micro-batches",
            "packed tokens/step",
            "s/step (median)",
            "samples/s",
            "tokens/s (median)",
            "vs fp32 full (samples/s)",
        ],
        [
            [
                c["seq_len"],
                c["threads"],
                "bf16 autocast" if c["dtype"] == "bfloat16" else "fp32",
                "shared" if c["shared_prompt"] else "full",
                c["micro_batches"],
                round(c["tokens_per_step_mean"]),
                round(c["step_s_median"], 3),
                round(c["samples_per_s_median"], 1),
                round(c["tokens_per_s_median"]),
                f"{c['speed_vs_fp32']:.2f}x",
            ]
            for c in cells
        ],
    )
    return C.finish(out, table)


if __name__ == "__main__":
    sys.exit(main())
