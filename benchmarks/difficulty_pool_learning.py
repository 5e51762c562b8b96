"""Learning check of the ``difficulty_pool`` curriculum on reverse-text: standard vs difficulty_pool.

One SFT warm-up checkpoint (the demo's: ``asyncrl model init`` tiny, seed 0, then ``configs/reverse_text/sft.toml``,
240 steps; built once under ``results/tmp/difficulty_pool/`` or given with ``--sft-model``), then one RL run per
variant with the demo's RL settings (``configs/reverse_text/rl.toml``: 160 steps, 8 tasks x 8 rollouts, T = 1.5,
cosine lr 1.5e-4, ``dppo_kl``, ``max_async_level`` 1, the same seed) through the local launcher
(``worker.launchers.local.launch_rl``, no service). Only the curriculum differs between the runs, plus two settings
every run shares so that the comparison is fair and pass-rate pools can matter:

- ``env.args.num_train`` (default 256): a finite taskset with stable task indices (``difficulty_pool`` needs one;
  the demo's train split is endless, where no task is ever seen twice). The standard curriculum reads it in a
  reshuffled order per pass, ``difficulty_pool`` draws from the same 256 tasks by pool weight.
- ``orchestrator.eval.interval`` (default 20, the demo 40): more intermediate points on the held-out curve.

The held-out eval is the demo's: the first 64 tasks of the eval split (never a train sentence), one sample each at
T = 1.5, at policy version 0 (the SFT model) and every ``interval`` steps; ``reward_mean`` is the LCS-ratio reward.

Variants (``--variants``): ``standard``; ``difficulty_pool`` (the defaults: ``pass_threshold`` 1.0, i.e. a
rollout passes only with a perfect reversal); ``difficulty_pool_t<X>`` (the defaults with ``pass_threshold`` X, e.g.
``difficulty_pool_t0.5``: reverse-text rewards are partial-credit LCS ratios and at T = 1.5 almost no rollout is
perfect, so with 1.0 every seen task lands in the hard pool).

Recorded per variant: the eval curve, the wall time of the RL run, the first eval step reaching ``--target`` (the
demo's held-out reward on a fresh clone, 0.602) and the first reaching the standard run's final reward, and per step
the train reward and the pool sizes (``pool_size_unseen|hard|normal|easy`` of the orchestrator's metrics).

The SFT stage, then the RL runs together, hold ``/tmp/asyncrl-heavy.lock`` (``fcntl.flock``) while they run, so the
script itself must not be wrapped in ``flock`` on that file.

Run: ``.venv/bin/python benchmarks/difficulty_pool_learning.py [--quick] [--steps 160] [--num-train 256]
[--variants standard,difficulty_pool,difficulty_pool_t0.5] [--sft-model DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

NAME = "difficulty_pool_learning"
WORK = C.TMP / "difficulty_pool"
LOCK = Path("/tmp/asyncrl-heavy.lock")
POOLS = ("unseen", "hard", "normal", "easy")
DEMO_TARGET = 0.602
"""The demo's held-out reward after RL on a fresh clone (README: 0.378 -> 0.602 in 395 s)."""


@contextlib.contextmanager
def heavy_lock(what: str) -> Iterator[None]:
    """Hold the machine-wide heavy-job lock for one stage (waits for other heavy runs)."""
    with LOCK.open("a") as f:
        t0 = time.time()
        fcntl.flock(f, fcntl.LOCK_EX)
        C.say(f"[bench] {what}: lock after {time.time() - t0:.0f}s wait")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sft_checkpoint(steps: int | None, threads: int) -> tuple[Path, dict[str, Any]]:
    """The demo's SFT warm-up (``init_model`` tiny seed 0, then ``sft.toml``; ``threads`` torch threads), built once
    under ``WORK/sft``; (final dir, ``run_sft``'s summary)."""
    run = WORK / "sft"
    if (run / "summary.json").is_file() and (run / "final" / "config.json").is_file():
        return run / "final", json.loads((run / "summary.json").read_text())
    from worker.policy.models import init_model
    from worker.spec import load_spec_data, validate_spec
    from worker.trainer.sft import run_sft

    overrides = [("output_dir", str(WORK)), ("name", "sft"), ("threads", str(threads))]
    if steps:
        overrides.append(("max_steps", str(steps)))
    with heavy_lock("SFT"):
        base = init_model(WORK / "model", size="tiny", seed=0, overwrite=True)
        spec = validate_spec("sft", load_spec_data([C.CONFIGS / "sft.toml"], [("model.name", str(base)), *overrides]))
        sft = run_sft(spec, overwrite=True)
    C.say(f"[bench] SFT done in {sft['wall_s']}s: greedy eval reward {sft['eval_reward_greedy']:.3f}")
    return Path(sft["final"]), sft


def variant_overrides(variant: str) -> list[tuple[str, str]]:
    """The curriculum keys of a variant name (module docstring).

    Raises:
        SystemExit: an unknown variant (exit 2).
    """
    if variant == "standard":
        return [("orchestrator.curriculum.type", "standard")]
    if variant == "difficulty_pool":
        return [("orchestrator.curriculum.type", "difficulty_pool")]
    if variant.startswith("difficulty_pool_t"):
        threshold = variant.removeprefix("difficulty_pool_t")
        return [
            ("orchestrator.curriculum.type", "difficulty_pool"),
            ("orchestrator.curriculum.pass_threshold", threshold),
        ]
    C.say(f"--variants: unknown variant {variant!r}; allowed: standard, difficulty_pool, difficulty_pool_t<threshold>")
    raise SystemExit(2)


class LockOnce:
    """The heavy-job lock for the RL runs: taken by the first run launched, held until the ``with`` block ends (one
    hold for all runs: released in between, a queue of other jobs could take it); never taken when every run is
    re-read (``--reuse-runs``)."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.held = False

    def take(self) -> None:
        if not self.held:
            self.stack.enter_context(heavy_lock("RL runs"))
            self.held = True

    def __enter__(self) -> LockOnce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


def run_variant(
    model: Path,
    variant: str,
    args: argparse.Namespace,
    lock: LockOnce,
    keys: list[tuple[str, str]] | None = None,
    runs_dir: Path | None = None,
) -> dict[str, Any]:
    """One RL run from ``model`` (``lock`` taken first) with the variant's keys (``keys``, default
    ``variant_overrides(variant)``) under ``runs_dir`` (default ``WORK/runs``); its eval curve, wall time, per-step
    pool sizes and per-version weight update seconds."""
    from worker.launchers.local import launch_rl
    from worker.spec import load_spec_data, validate_spec

    overrides = [
        ("model.name", str(model)),
        ("output_dir", str(runs_dir or WORK / "runs")),
        ("name", variant),
        ("max_steps", str(args.steps)),
        ("env.args.num_train", str(args.num_train)),
        ("orchestrator.eval.interval", str(args.eval_interval)),
        *[(kv.split("=", 1)[0], kv.split("=", 1)[-1]) for kv in args.set],  # e.g. trainer.device=cuda
        *(variant_overrides(variant) if keys is None else keys),
    ]
    spec = validate_spec("rl", load_spec_data([C.CONFIGS / "rl.toml"], overrides))
    done = spec.run_dir / "summary.json"
    if args.reuse_runs and done.is_file():  # a finished run of an earlier invocation (same settings)
        summary = json.loads(done.read_text())
        wall = summary["wall_s"]
    else:
        lock.take()
        t0 = time.time()
        summary = launch_rl(spec, overwrite=True, quiet=True)
        wall = time.time() - t0
    rows = C.read_metrics(spec.run_dir)
    evals = sorted((r for r in rows if r["source"] == "eval"), key=lambda r: r["step"])
    orch = sorted((r for r in rows if r["source"] == "orchestrator"), key=lambda r: r["step"])
    updates = [r["weight_update_s"] for r in rows if r["source"] == "inference" and "weight_update_s" in r]
    per_step = [
        {
            "step": r["step"],
            "reward_mean": round(r["reward_mean"], 4),
            **{p: r[f"pool_size_{p}"] for p in POOLS if f"pool_size_{p}" in r},
        }
        for r in orch
    ]
    curve = [{"step": r["step"], "reward_mean": round(r["reward_mean"], 4), "pass_at_k": r["pass_at_k"]} for r in evals]
    C.say(
        f"[bench] {variant}: {summary['status']} in {wall:.0f}s; eval "
        + ", ".join(f"{e['step']}:{e['reward_mean']:.3f}" for e in curve)
    )
    return {
        "status": summary["status"],
        "reason": summary.get("reason", ""),
        "overrides": dict(overrides[3:]),
        "wall_s": round(wall, 1),
        "rl_wall_s": summary["wall_s"],
        "eval": curve,
        "eval_first": curve[0]["reward_mean"] if curve else None,
        "eval_last": curve[-1]["reward_mean"] if curve else None,
        "train_reward_last20": round(sum(r["reward_mean"] for r in orch[-20:]) / max(1, len(orch[-20:])), 4),
        "mismatch_kl": summary["mismatch_kl"],
        "weight_update_s_median": round(C.median(updates), 4) if updates else None,
        "weight_updates": len(updates),
        "per_step": per_step,
    }


def first_reaching(curve: list[dict[str, Any]], target: float | None) -> int | None:
    """The first eval step (after step 0) whose held-out reward is >= ``target``; None if none is."""
    if target is None:
        return None
    return next((e["step"] for e in curve if e["step"] > 0 and e["reward_mean"] >= target), None)


def pools_at(per_step: list[dict[str, Any]], step: int) -> str:
    row = next((r for r in per_step if r["step"] == step), None)
    if row is None or "unseen" not in row:
        return "-"
    return "/".join(str(row[p]) for p in POOLS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--num-train", type=int, default=256)
    ap.add_argument("--eval-interval", type=int, default=20)
    ap.add_argument("--variants", default="standard,difficulty_pool,difficulty_pool_t0.5")
    ap.add_argument("--target", type=float, default=DEMO_TARGET)
    ap.add_argument("--sft-model", type=Path, default=None, help="an SFT'd checkpoint to start from (default: build)")
    ap.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: sft.toml's 240)")
    ap.add_argument(
        "--sft-threads", type=int, default=1, help="SFT torch threads (sft.toml: 2; 2 stall on a busy 2-core box)"
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra RL spec override, for every run"
    )
    ap.add_argument("--reuse-runs", action="store_true", help="read finished runs of an earlier invocation")
    ap.add_argument("--quick", action="store_true", help="6 RL steps, 10 SFT steps: checks the script only")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.eval_interval, args.sft_steps = 6, 3, args.sft_steps or 10
        global WORK
        WORK = C.TMP / "difficulty_pool_quick"
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        variant_overrides(v)  # bad names fail before anything runs
    started, machine = time.time(), C.machine_facts()
    if args.sft_model is not None:
        model = args.sft_model.resolve()
        summary_file = model.parent / "summary.json"
        sft = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    else:
        model, sft = sft_checkpoint(args.sft_steps, args.sft_threads)
    C.say(f"[bench] SFT checkpoint {model} (greedy eval reward {sft.get('eval_reward_greedy')})")
    runs: dict[str, dict[str, Any]] = {}
    code = 0
    with LockOnce() as lock:
        for v in variants:  # the result file is rewritten after every run, so a cut-short session keeps what ran
            runs[v] = run_variant(model, v, args, lock)
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
    standard_final = runs["standard"]["eval_last"] if "standard" in runs else None
    for r in runs.values():
        r["first_step_reaching_target"] = first_reaching(r["eval"], args.target)
        r["first_step_reaching_standard_final"] = first_reaching(r["eval"], standard_final)
    steps = sorted({e["step"] for r in runs.values() for e in r["eval"]})
    headers = [
        "curriculum",
        *[f"eval @{s}" for s in steps],
        f"first step >= {args.target}",
        "first step >= standard's final",
        "RL wall s",
        "pools u/h/n/e @ steps 40, 80, end",
    ]
    rows = []
    for v, r in runs.items():
        by = {e["step"]: e["reward_mean"] for e in r["eval"]}
        pool_cells = ", ".join(pools_at(r["per_step"], s) for s in (40, 80, args.steps))
        rows.append(
            [
                v,
                *[by.get(s, "-") for s in steps],
                r["first_step_reaching_target"] or "not reached",
                r["first_step_reaching_standard_final"] or "not reached",
                r["wall_s"],
                pool_cells,
            ]
        )
    path = C.write_result(
        NAME,
        {
            "sft_model": str(model),
            "sft": {k: v for k, v in sft.items() if isinstance(v, (int, float, str))},
            "steps": args.steps,
            "num_train": args.num_train,
            "eval_interval": args.eval_interval,
            "eval_num_examples": 64,
            "target": args.target,
            "runs": runs,
        },
        quick=args.quick,
        started=started,
        machine=machine,
    )
    return C.finish(path, C.md_table(headers, rows))


if __name__ == "__main__":
    raise SystemExit(main())
