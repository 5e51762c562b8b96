"""Which attention path moves the served-policy check's probe log-probs (a version-0 check once failed by 0.95 nats).

Builds the 0.6B-shape model (``worker.policy.models.init_model``), prepares it as the RL trainer does (one-rank FSDP2,
bf16 params and compute, compiled blocks, ``trainer.attention = "flex_attention"``) and computes the log-probs of a
few probe-like sequences (a chat prompt, then random completion tokens; lengths below and above flex attention's 128-
token block) through each attention implementation the trainer's forward can take, against an fp32 SDPA reference
(no compile, no FSDP). Run on the GPU machine after ``source benchmarks/gpu/device-env.sh``::

    python3 benchmarks/gpu/probe_attention.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch


def logprobs(
    model: torch.nn.Module, seqs: list[list[int]], starts: list[int], device: str, **kwargs: Any
) -> list[list[float]]:
    """As ``worker.orchestrator.policy_check.probe_logprobs``, with extra forward ``kwargs``."""
    out = []
    model.eval()
    with torch.no_grad():
        for seq, start in zip(seqs, starts, strict=True):
            ids = torch.tensor([seq], device=device)
            logits = model(input_ids=ids, **kwargs).logits[0].float()  # [L, vocab]
            lp = torch.log_softmax(logits[start - 1 : len(seq) - 1], dim=-1)
            out.append(lp.gather(1, ids[0, start:].unsqueeze(1)).squeeze(1).tolist())
    return out


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Max |a - b| over every token (``worker.orchestrator.policy_check.max_abs_diff`` without its imports: the GPU
    machine runs this before asyncrl's own dependencies are unpacked)."""
    return max(abs(u - v) for x, y in zip(a, b, strict=True) for u, v in zip(x, y, strict=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, default=Path("/tmp/probe_attention/model"))
    p.add_argument("--size", default="qwen3-0.6b", help="init_model size (tiny: try the script on a CPU)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--paths", default="now,hf_flex,hf_flex_forced,sdpa", help="attention paths to run, in order")
    p.add_argument("--tag", default="", help="suffix of the JSON file's name")
    a = p.parse_args()
    from transformers import AutoTokenizer

    from worker.policy.models import init_model, load_model
    from worker.trainer.dist import prepare_model, setup
    from worker.trainer.packed import FLEX_OR_CAUSAL

    t0 = time.time()
    if not (a.model / "config.json").is_file():
        init_model(a.model, size=a.size, seed=0, overwrite=True)
    tok = AutoTokenizer.from_pretrained(a.model)
    g = torch.Generator().manual_seed(0)
    seqs, starts = [], []
    for text, completion in [
        ("abc def ghi", 16),
        ("The quick brown fox jumps over the lazy dog.", 16),
        ("Reverse the text character by character: Mira sold twelve lanterns to the bakers of Olen.", 16),
        ("Mira", 160),
    ]:
        msgs = [{"role": "user", "content": text}]
        encoded: Any = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = [int(x) for x in (encoded["input_ids"] if hasattr(encoded, "keys") else encoded)]
        starts.append(len(ids))
        seqs.append(ids + torch.randint(0, len(tok), (completion,), generator=g).tolist())
    res: dict[str, Any] = {"lengths": [len(s) for s in seqs], "model_s": time.time() - t0}

    ref_model = load_model(a.model, dtype="float32", attn_implementation="sdpa").to(a.device)
    ref = logprobs(ref_model, seqs, starts, device=a.device)
    del ref_model
    info = setup(a.device)
    model = load_model(a.model, dtype="float32", attn_implementation="flex_attention")
    prepare_model(model, info, bf16=True, activation_checkpointing=False, compile=a.compile)
    rows: dict[str, Any] = {}
    paths = {
        "now": ("trainer_now (FLEX_OR_CAUSAL: SDPA is_causal)", FLEX_OR_CAUSAL, {}),
        "hf_flex": ("hf_flex_attention (the old version-0 path)", "flex_attention", {}),
        "hf_flex_forced": (
            "hf_flex_attention FORCE_USE_FLEX_ATTENTION",
            "flex_attention",
            {"FORCE_USE_FLEX_ATTENTION": True},
        ),
        "sdpa": ("sdpa", "sdpa", {}),
    }
    for name, impl, kwargs in [paths[x] for x in a.paths.split(",")]:
        model.config._attn_implementation = impl
        t = time.time()
        extra = {"kernel_options": kwargs} if kwargs else {}
        try:
            lps = logprobs(model, seqs, starts, device=a.device, **extra)
            rows[name] = {
                "max_abs_diff_vs_fp32_sdpa": max_abs_diff(lps, ref),
                "per_sequence": [max_abs_diff([x], [y]) for x, y in zip(lps, ref, strict=True)],
                "s": time.time() - t,
            }
        except Exception as e:  # noqa: BLE001  # a kernel that does not run is a result too
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        sys.stdout.write(f"{name}: {rows[name]}\n")
    model.config._attn_implementation = FLEX_OR_CAUSAL
    res.update(
        rows=rows,
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        wall_s=time.time() - t0,
    )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"probe_attention{a.tag}.json").write_text(json.dumps(res, indent=1))
    sys.stdout.write(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
