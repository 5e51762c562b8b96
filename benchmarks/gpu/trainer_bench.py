"""GPU trainer benchmark: one RL step on 16k packed tokens of a random-init Qwen3-0.6B-shaped model.

The model is built locally from its shape (no hub, no tokenizer): vocab 151936, hidden 1024, 28 layers,
16 query / 8 KV heads of dim 128, MLP 3072, tied embeddings (596M parameters).

asyncrl cells run the trainer's real step on one GPU: ``worker.trainer.dist.setup("cuda")`` (a one-rank
NCCL group), ``prepare_model`` (FSDP2 ``fully_shard`` per block + root, bf16 params/compute, fp32
reduction, fp32 master weights), ``worker.trainer.train.train_step`` (the ``dppo_kl`` loss on per-sample
temperature-scaled log-probs from the fused chunked LM head; a one-sample row runs SDPA ``is_causal``
whatever the attention setting), ``clip_grad_norm_``, AdamW step. To measure an older trainer on the same
machine, put its ``worker/`` first on ``PYTHONPATH`` (``git archive <commit> worker``) and pick another
``--result-name``. Grid: attention ``sdpa`` (dense
packed mask) or ``flex_attention`` (block mask) x activation checkpointing off/on x batch shape
``packed`` (16 samples of 1024 tokens, 256 prompt + 768 completion, one 16384-token row) or ``single``
(one 16384-token sample); plus flex attention cells with ``trainer.compile`` (each decoder block compiled); plus
``loop`` cells: the batch of ``benchmarks/gpu/one_gpu_rl.py``'s RL loop (16 prompts of 64 tokens x 8 completions of
128, each group's prompt shared, packed by the orchestrator's ``pack_shared_prompt`` into micro-batches of at most
``--seq-len`` tokens), the bench side of ``trainer_inloop_vs_bench``.
SFT cells (SFT at >= the RL trainer's tokens/s) run the SFT trainer's loss on the same row and model setup:
``worker.trainer.sft.sft_loss`` (packed forward, fused LM head, cross-entropy on the completion tokens), the same
backward, ``clip_grad_norm_`` and AdamW; named ``sft ...`` like the asyncrl cell they mirror.

Baseline cells: plain transformers, bf16 weights, SDPA (``is_causal``, no mask), one 16384-token
sequence, chunked log-probs (``selective_log_softmax``), mean NLL, AdamW; checkpointing off/on.

Each cell: ``--warmup`` steps, then ``--steps`` timed steps (CUDA-synchronised); tokens/s = tokens /
step seconds (median); MFU = ``worker.trainer.dist.flops_per_step`` / step seconds / 989e12; peak
memory = ``torch.cuda.max_memory_allocated`` over the timed steps.

Run (GPU machine): ``python benchmarks/gpu/trainer_bench.py [--steps 5] [--warmup 2] [--out DIR] [--only CELLS]
[--profile CELLS]`` (``--profile``: one extra step of each named cell under ``torch.profiler``, its top ops to DIR).
"""

from __future__ import annotations

import argparse
import gc
import random
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_support as C  # noqa: E402

QWEN3_0_6B = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TOKENS = 16384
SHAPES = {"packed": (16, 256), "single": (1, 0), "loop": (128, 64)}
"""Batch shape: (samples in the 16k row, prompt tokens of each); ``loop`` is the RL loop's batch instead (:func:`loop_batch`)."""
LOOP = {"prompts": 16, "group": 8, "prompt_tokens": 64, "completion_tokens": 128}
"""The batch of ``benchmarks/gpu/one_gpu_rl.py``'s loop (16 tasks x 8 samples x 128 tokens; a random-init model rarely
samples EOS, so completions run to ``max_tokens``), packed as the orchestrator packs it."""


def rl_batch(shape: str, seed: int) -> dict[str, Any]:
    """One micro-batch of ``TOKENS`` tokens: random ids, loss on the completions, random sampling logprobs."""
    n, prompt = SHAPES[shape]
    rng = random.Random(seed)
    length = TOKENS // n
    samples = [
        {
            "input_ids": [rng.randrange(QWEN3_0_6B["vocab_size"]) for _ in range(length)],
            "loss_mask": [0] * prompt + [1] * (length - prompt),
            "sampling_logprobs": [0.0] * prompt + [-3 * rng.random() for _ in range(length - prompt)],
            "advantage": rng.choice([-1.0, 1.0]),
            "temperature": 1.0,
            "policy_span": [0, 0],
        }
        for _ in range(n)
    ]
    return {"step": 1, "num_samples": n, "num_loss_tokens": n * (length - prompt), "micro_batches": [samples]}


def loop_batch(seq_len: int, seed: int) -> dict[str, Any]:
    """The RL loop's step batch (``LOOP``): each group's prompt shared (``orchestrator.share_prompt``, on by default)
    and the samples packed into micro-batches of at most ``seq_len`` tokens by the orchestrator's own
    ``pack_step`` path (``worker.orchestrator.packing.pack_shared_prompt``)."""
    from worker.orchestrator.packing import pack_shared_prompt, prompt_keys

    rng = random.Random(seed)
    p, c = LOOP["prompt_tokens"], LOOP["completion_tokens"]
    samples = []
    for g in range(LOOP["prompts"]):
        prompt = [rng.randrange(QWEN3_0_6B["vocab_size"]) for _ in range(p)]
        for _ in range(LOOP["group"]):
            samples.append(
                {
                    "input_ids": prompt + [rng.randrange(QWEN3_0_6B["vocab_size"]) for _ in range(c)],
                    "loss_mask": [0] * p + [1] * c,
                    "sampling_logprobs": [0.0] * p + [-3 * rng.random() for _ in range(c)],
                    "advantage": rng.choice([-1.0, 1.0]),
                    "temperature": 1.0,
                    "policy_span": [0, 0],
                    "group": g,
                    "prefix_len": p,
                }
            )
    lengths = [len(s["input_ids"]) for s in samples]
    bins = pack_shared_prompt(lengths, [p] * len(samples), prompt_keys(samples), seq_len)
    return {
        "step": 1,
        "num_samples": len(samples),
        "num_loss_tokens": len(samples) * c,
        "micro_batches": [[samples[i] for i in b] for b in bins],
    }


def build_model(attention: str, dtype: Any) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_0_6B, attn_implementation=attention)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.train()
    return model


def timed(step_fn: Any, warmup: int, steps: int) -> tuple[list[float], float]:
    """Run ``step_fn`` warmup + steps times; the timed steps' seconds and their peak memory in GiB."""
    import torch

    for _ in range(warmup):
        step_fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step_fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, torch.cuda.max_memory_allocated() / 2**30


def profile_step(step_fn: Any, path: Path) -> None:
    """One ``step_fn`` under ``torch.profiler``: the 30 ops with the most self CUDA time, then the 40 with the most
    CPU time (host work: launches, syncs, Python), as tables in ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_fn()
        torch.cuda.synchronize()
    ops = prof.key_averages()
    path.write_text(
        ops.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
        + "\n\n"
        + ops.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70)
    )


def asyncrl_cell(
    info: Any,
    attention: str,
    ac: bool,
    shape: str,
    warmup: int,
    steps: int,
    profile_to: Path | None = None,
    compile: bool = False,
    loss: str = "rl",
    seq_len: int = TOKENS,
) -> dict[str, Any]:
    """One cell of the asyncrl trainer: ``loss`` "rl" (``train_step``, the run's ``dppo_kl`` loss) or "sft"
    (``sft_loss`` on the same row, backward scaled as the SFT trainer does)."""
    import torch

    from worker.spec import validate_spec
    from worker.trainer.dist import grad_norm_value, prepare_model
    from worker.trainer.optim import build_optimizer
    from worker.trainer.packed import micro_batch_tensors
    from worker.trainer.sft import sft_loss
    from worker.trainer.train import train_step

    spec = validate_spec(
        "rl",
        {
            "model": {"name": "random-qwen3-0.6b", "dtype": "bfloat16"},
            "orchestrator": {"seq_len": max(TOKENS, seq_len)},
            "trainer": {"device": "cuda", "attention": attention, "activation_checkpointing": ac, "compile": compile},
        },
    )
    model = build_model(attention, torch.float32)  # fp32 master weights
    n_params = sum(p.numel() for p in model.parameters())
    prepare_model(model, info, bf16=True, activation_checkpointing=ac, compile=compile)
    opt = build_optimizer(model, spec.trainer.optim)
    batch = loop_batch(seq_len, seed=0) if shape == "loop" else rl_batch(shape, seed=0)
    rows = [micro_batch_tensors(mb) for mb in batch["micro_batches"]]
    pairs = sum(r.attended_pairs for r in rows)
    tokens = sum(int(r.input_ids.shape[1]) for r in rows)
    norms: list[float] = []
    losses: list[float] = []

    samples = batch["micro_batches"][0]

    def step() -> None:
        if loss == "sft":
            value = sft_loss(
                model, samples, batch["num_loss_tokens"], info, autocast=not info.sharded, compiled=compile
            )
            (value * info.loss_scale).backward()
            losses.append(float(value.detach()))
        else:
            losses.append(train_step(model, batch, spec, step=1, info=info)["loss"])
        norms.append(grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)

    times, mem = timed(step, warmup, steps)
    if profile_to:
        profile_step(step, profile_to)
    return {
        "n_params": n_params,
        "attended_pairs": pairs,
        "tokens": tokens,
        "micro_batches": [int(r.input_ids.shape[1]) for r in rows],
        "times": times,
        "peak_memory_gib": mem,
        "grad_norm_first": norms[0],
        "loss_first": losses[0],
    }


def baseline_cell(ac: bool, warmup: int, steps: int, profile_to: Path | None = None) -> dict[str, Any]:
    import torch

    from worker.spec import OptimConfig
    from worker.trainer.logprobs import selective_log_softmax
    from worker.trainer.optim import build_optimizer

    model = build_model("sdpa", torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.config.use_cache = False
    if ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = build_optimizer(model, OptimConfig())
    ids = torch.tensor([rl_batch("single", seed=0)["micro_batches"][0][0]["input_ids"]], device="cuda")

    def step() -> None:
        logits = model(input_ids=ids).logits[0, :-1]
        loss = -selective_log_softmax(logits, ids[0, 1:]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times, mem = timed(step, warmup, steps)
    if profile_to:
        profile_step(step, profile_to)
    return {"n_params": n_params, "attended_pairs": TOKENS * (TOKENS + 1) // 2, "times": times, "peak_memory_gib": mem}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="also copy the result JSON here (e.g. $OUT)")
    ap.add_argument("--only", default="", help="comma-separated cell names to run (default: all)")
    ap.add_argument("--profile", default="", help="comma-separated cell names to profile one step of (into --out)")
    ap.add_argument("--result-name", default="gpu_trainer", help="benchmarks/results/<name>.json")
    ap.add_argument(
        "--seq-len", type=int, default=8192, help="micro-batch capacity of the loop cells (one_gpu_rl.py's --seq-len)"
    )
    args = ap.parse_args()

    import torch
    from transformers import Qwen3Config

    from worker.trainer.dist import flops_per_step, peak_flops, setup

    started = time.time()
    info = setup("cuda")
    machine = {
        **C.machine_facts(),
        "gpu": torch.cuda.get_device_name(0),
        "gpu_count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
    }
    peak = peak_flops(info.device)
    config = Qwen3Config(**QWEN3_0_6B)
    cells_spec = (
        [
            (f"{kind} {att} ac={int(ac)} {shape}", kind, att, ac, shape, False)
            for kind in ("asyncrl", "sft")
            for shape in ("packed", "single")
            for att in ("sdpa", "flex_attention")
            for ac in (False, True)
        ]
        + [
            (f"{kind} flex_attention ac={int(ac)} {shape} compile", kind, "flex_attention", ac, shape, True)
            for kind in ("asyncrl", "sft")
            for shape in ("packed", "single")
            for ac in (False, True)
        ]
        + [(f"baseline sdpa ac={int(ac)} single", "baseline", "sdpa", ac, "single", False) for ac in (False, True)]
        + [
            (f"asyncrl {att} ac=0 loop{' compile' if comp else ''}", "asyncrl", att, False, "loop", comp)
            for att in ("sdpa", "flex_attention")
            for comp in (False, True)
            if comp is False or att == "flex_attention"
        ]
    )
    wanted = {w for w in args.only.split(",") if w}
    cells = []
    for name, kind, att, ac, shape, comp in cells_spec:
        if wanted and name not in wanted:
            continue
        C.say(f"[bench] {name} ...")
        prof = None
        if name in args.profile.split(",") and args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            prof = args.out / ("profile_" + name.replace(" ", "_").replace("=", "") + ".txt")
        try:
            if kind in ("asyncrl", "sft"):
                r = asyncrl_cell(
                    info,
                    att,
                    ac,
                    shape,
                    args.warmup,
                    args.steps,
                    prof,
                    comp,
                    "sft" if kind == "sft" else "rl",
                    seq_len=args.seq_len,
                )
            else:
                r = baseline_cell(ac, args.warmup, args.steps, prof)
        except Exception as e:  # noqa: BLE001 - a failing cell is recorded, the others still run
            traceback.print_exc()
            cells.append({"name": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
            gc.collect()
            torch.cuda.empty_cache()
            continue
        gc.collect()
        torch.cuda.empty_cache()
        step_s = C.median(r["times"])
        tokens = r.get("tokens", TOKENS)
        flops = flops_per_step(config, r["n_params"], tokens, r["attended_pairs"])
        cell = {
            "name": name,
            "kind": kind,
            "attention": att,
            "activation_checkpointing": ac,
            "shape": shape,
            "compile": comp,
            "loss_first": r.get("loss_first"),
            "grad_norm_first": r.get("grad_norm_first"),
            "samples": SHAPES[shape][0],
            "tokens": tokens,
            "micro_batches": r.get("micro_batches"),
            "step_s_median": step_s,
            "step_s_all": r["times"],
            "tokens_per_s": tokens / step_s,
            "mfu": flops / step_s / peak if peak else None,
            "flops_per_step": flops,
            "peak_memory_gib": r["peak_memory_gib"],
            "n_params": r["n_params"],
        }
        cells.append(cell)
        C.say(
            f"[bench] {name}: {cell['tokens_per_s']:.0f} tok/s, MFU {cell['mfu'] or 0:.3f}, "
            f"{cell['peak_memory_gib']:.1f} GiB, {step_s:.3f} s/step"
        )
    payload = {
        "command": "python3 " + shlex.join(sys.argv),
        "setup": {
            "model": "random-init Qwen3-0.6B shape",
            "config": QWEN3_0_6B,
            "tokens_per_step": TOKENS,
            "loss": "dppo_kl",
            "optimizer": "AdamW",
            "steps": args.steps,
            "warmup": args.warmup,
            "peak_flops": peak,
            "mfu_formula": flops_per_step.__doc__.split("\n\n")[1].strip(),
        },
        "cells": cells,
    }
    out = C.write_result(args.result_name, payload, quick=False, started=started, machine=machine)
    table = C.md_table(
        ["cell", "attention", "act. ckpt", "compile", "batch", "s/step", "tokens/s", "MFU", "peak mem GiB"],
        [
            [
                c["name"].split(" ")[0],
                c.get("attention", ""),
                "on" if c.get("activation_checkpointing") else "off",
                "on" if c.get("compile") else "off",
                c.get("shape", ""),
                round(c["step_s_median"], 3),
                round(c["tokens_per_s"]),
                f"{100 * c['mfu']:.1f} %" if c.get("mfu") else "-",
                round(c["peak_memory_gib"], 1),
            ]
            if "error" not in c
            else [c["name"], "", "", "", "", "", "", c["error"][:80], ""]
            for c in cells
        ],
    )
    C.finish(out, table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / out.name).write_text(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
