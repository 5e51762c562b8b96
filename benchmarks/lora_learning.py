"""Learning check of LoRA RL on reverse-text: LoRA vs full fine-tuning, same steps, same start.

The setting is the difficulty_pool check's (``difficulty_pool_learning.py``): the demo's SFT warm-up (built once under
``results/tmp/difficulty_pool/sft``, shared with that check), then one RL run per variant with the demo's RL settings
(160 steps, 8 tasks x 8 rollouts, T = 1.5, ``dppo_kl``, ``max_async_level`` 1, the same seed, num_train 256, eval of the
64 held-out tasks every 20 steps). Only the trainer differs:

- ``full``: full fine-tuning at the demo's lr (cosine, peak 1.5e-4);
- ``lora_r<rank>_lr<lr>`` (default ``lora_r16_lr1.5e-3``): ``[trainer.lora]`` with that rank, alpha = 2 * rank, every
  linear layer of the blocks targeted, dropout 0, at peak lr ``lr``. LoRA wants a higher lr than full fine-tuning: about
  10x is the optimum reported by Schulman et al., "LoRA Without Regret" (Thinking Machines, 2025), which also found
  low ranks enough for RL.

Recorded per variant: the eval curve, the gain over the SFT model (last eval minus the eval at version 0; the
bar is >= +0.10), ``mismatch_kl`` (bar <= 1e-3), and the median per-version weight update (pause -> load -> resume, the
orchestrator's ``weight_update_s``): the adapter's for LoRA, the full weights' for ``full``.

Run: ``.venv/bin/python benchmarks/lora_learning.py [--variants full,lora_r16_lr1.5e-3] [--steps 160] [--quick]``
(holds ``/tmp/asyncrl-heavy.lock`` while it trains; do not wrap it in ``flock``).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402
import difficulty_pool_learning as D  # noqa: E402

NAME = "lora_learning"
GAIN_BAR = 0.10
MISMATCH_BAR = 1e-3
LORA_VARIANT = re.compile(r"lora_r(\d+)_lr([0-9.e-]+)")


def variant_keys(variant: str) -> list[tuple[str, str]]:
    """The trainer keys of a variant name (module docstring).

    Raises:
        SystemExit: an unknown variant (exit 2).
    """
    if variant == "full":
        return []
    m = LORA_VARIANT.fullmatch(variant)
    if m is None:
        C.say(f"--variants: unknown variant {variant!r}; allowed: full, lora_r<rank>_lr<lr> (e.g. lora_r16_lr1.5e-3)")
        raise SystemExit(2)
    rank, lr = m.groups()
    return [
        ("trainer.lora.rank", rank),
        ("trainer.lora.alpha", str(2 * int(rank))),
        ("trainer.optim.lr", lr),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--num-train", type=int, default=256)
    ap.add_argument("--eval-interval", type=int, default=20)
    ap.add_argument("--variants", default="full,lora_r16_lr1.5e-3")
    ap.add_argument("--sft-threads", type=int, default=1)
    ap.add_argument("--reuse-runs", action="store_true", help="read finished runs of an earlier invocation")
    ap.add_argument("--quick", action="store_true", help="6 RL steps, 10 SFT steps: checks the script only")
    args = ap.parse_args()
    args.set = []
    sft_steps = None
    if args.quick:
        args.steps, args.eval_interval, sft_steps = 6, 3, 10
        D.WORK = C.TMP / "difficulty_pool_quick"
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        variant_keys(v)  # bad names fail before anything runs
    started, machine = time.time(), C.machine_facts()
    model, sft = D.sft_checkpoint(sft_steps, args.sft_threads)
    runs: dict[str, dict[str, Any]] = {}
    with D.LockOnce() as lock:
        for v in variants:  # the result file is rewritten after every run
            runs[v] = D.run_variant(model, v, args, lock, keys=variant_keys(v), runs_dir=D.WORK / "lora_runs")
            code = report(runs, model, sft, args, started, machine)
    return code


def report(
    runs: dict[str, dict[str, Any]],
    model: Path,
    sft: dict[str, Any],
    args: argparse.Namespace,
    started: float,
    machine: dict[str, Any],
) -> int:
    """Write the result file and print the table for the runs done so far."""
    rows = []
    for v, r in runs.items():
        r["gain"] = round(r["eval_last"] - r["eval_first"], 4) if r["eval"] else None
        rows.append(
            [
                v,
                r["eval_first"],
                r["eval_last"],
                r["gain"],
                "yes" if r["gain"] is not None and r["gain"] >= GAIN_BAR else "no",
                f"{r['mismatch_kl']:.2e}" if r["mismatch_kl"] is not None else "-",
                r["weight_update_s_median"],
                r["rl_wall_s"],
            ]
        )
    headers = [
        "variant",
        "eval @0 (SFT)",
        f"eval @{args.steps}",
        "gain",
        f">= +{GAIN_BAR}",
        "mismatch_kl (last steps)",
        "weight update s (median)",
        "RL wall s",
    ]
    path = C.write_result(
        NAME,
        {
            "sft_model": str(model),
            "sft": {k: v for k, v in sft.items() if isinstance(v, (int, float, str))},
            "steps": args.steps,
            "num_train": args.num_train,
            "eval_interval": args.eval_interval,
            "eval_num_examples": 64,
            "gain_bar": GAIN_BAR,
            "mismatch_bar": MISMATCH_BAR,
            "runs": runs,
        },
        quick=args.quick,
        started=started,
        machine=machine,
    )
    return C.finish(path, C.md_table(headers, rows))


if __name__ == "__main__":
    raise SystemExit(main())
