"""A weight update on the colocated route (``cuda_ipc``), phase by phase, on one GPU, with both load paths.

One vLLM server for the Qwen3-0.6B shape, started as a run starts it (``worker.inference.server.server_command``:
bf16, CUDA graphs, ``gpu_memory_utilization`` 0.3, ``max_model_len`` 512). This process plays the trainer: it holds
the policy in one flat bf16 GPU buffer shared through a CUDA IPC handle (``worker/weight_sync/cuda_ipc.py``) and
publishes versions through the sequence of the orchestrator's ``InferenceClient.publish_weights`` (pause "keep" ->
load -> prefix-cache reset -> resume), each version alternately the base weights and a perturbed copy, so every load
changes the served policy. Per update: ``pause_s``, ``load_s`` (the ``/collective_rpc`` request; of it ``server_s``,
the worker's own time, and ``open_s``, opening the handle), ``reset_s``, ``resume_s``, ``total_s``.

Conditions, each with both load paths interleaved (``layerwise``: vLLM's layerwise ``reload_weights``; ``direct``:
the model's ``load_weights`` in place, what a GPU run now uses, ``worker.weight_sync.load``):

- ``idle``: nothing in flight (a synchronous run's update);
- ``decoding``: 16 prompts x 8 samples x 128 tokens in flight, the update 0.3 s into them (an async run's update),
  the pause with vLLM's default cache reset (``clear_cache=true``, what runs asked for before);
- ``decoding_no_clear``: as ``decoding``, the pause without it (``clear_cache=false``, what runs ask for now: the
  prefix-cache reset after the load stays);
- ``decoding_gpu_busy``: as ``decoding``, with a second process keeping the GPU busy with bf16 matmuls (a trainer
  step running beside the update).

Round trips of ``/health`` (the API server alone) and ``/is_paused`` (through the engine), idle and while decoding,
show which process delays a pause. Then a check that both paths serve the same policy: the served prompt log-probs of
a fixed sequence after loading the perturbed weights through each path (``max_abs_diff_layerwise_vs_direct``,
expected 0) and against the base (``moved_from_base``, expected > 0).

    python benchmarks/gpu/weight_update_bench.py --out OUT   # on the GPU machine, after one_gpu_rl.sh's setup
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CONDITIONS = ("idle", "decoding", "decoding_no_clear", "decoding_gpu_busy")
PATHS = ("layerwise", "direct")
PHASES = ("pause_s", "load_s", "server_s", "open_s", "reset_s", "resume_s", "total_s")
HOG = """
import os, sys, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
while not os.path.exists(sys.argv[1]):
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
"""
"""The second GPU process of ``decoding_gpu_busy``: bf16 matmuls back to back until its stop file appears."""


def median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def say(line: str) -> None:
    sys.stdout.write(f"[{time.strftime('%H:%M:%S')}] {line}\n")
    sys.stdout.flush()


def trainer_buffer(model: Path) -> tuple[tuple[Any, Any, Any], list[list[Any]], dict[str, Any]]:
    """``(base, perturbed, shared)``: ``model``'s weights, a perturbed copy and the buffer vLLM reads, each one flat
    bf16 GPU tensor in ``cuda_ipc``'s layout; the layout; the IPC description of ``shared``."""
    import torch
    from safetensors.torch import load_file

    from worker.weight_sync.cuda_ipc import export_handle, plan_layout, views

    state = {}
    for f in sorted(model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    layout, numel = plan_layout({n: list(t.shape) for n, t in state.items()}, torch.bfloat16)
    base = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    for (_, view), t in zip(views(base, layout), state.values(), strict=True):
        view.copy_(t)
    gen = torch.Generator(device="cuda").manual_seed(0)
    moved = base.clone()
    moved.add_(torch.randn(numel, generator=gen, device="cuda", dtype=torch.bfloat16), alpha=0.01)
    shared = base.clone()
    torch.cuda.synchronize()
    return (base, moved, shared), layout, export_handle(shared)


async def bench(url: str, model: Path, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from worker.inference.client import InferenceClient

    (base, moved, shared), layout, handle = trainer_buffer(model)
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 200, (40,), generator=rng).tolist() for _ in range(a.batch)]
    probe = torch.randint(10, 200, (96,), generator=rng).tolist()
    res: dict[str, Any] = {"updates": [], "conditions": {}}
    async with InferenceClient(url, read_timeout_s=300, max_retries=0) as client:

        async def publish(weights: Any, path: str, clear: bool = True) -> dict[str, Any]:
            shared.copy_(weights)
            torch.cuda.synchronize()
            meta = {"version": 0, "handle": handle, "tensors": layout, "layerwise": path == "layerwise"}

            # publish_weights' sequence, with the pause's cache reset chosen (``clear``: vLLM's default)
            t0 = time.monotonic()
            await client.pause("keep", clear_cache=clear)
            t1 = time.monotonic()
            info = await client.collective_rpc("update_weights_from_ipc", [meta], timeout_s=120)
            t2 = time.monotonic()
            await client.reset_prefix_cache()
            t3 = time.monotonic()
            await client.resume()
            t4 = time.monotonic()
            parts = {"pause_s": t1 - t0, "load_s": t2 - t1, "reset_s": t3 - t2, "resume_s": t4 - t3}
            info = {**info, **parts, "total_s": t4 - t0}
            return {
                "path": path,
                **{k: info[k] for k in ("pause_s", "load_s", "reset_s", "resume_s", "total_s")},
                "server_s": info.get("seconds"),
                "open_s": info.get("open_s"),
                "layerwise": info.get("layerwise"),
            }

        async def decode() -> int:
            outs = await asyncio.gather(
                *(client.generate(p, n=a.group, max_tokens=a.max_tokens, temperature=1.0) for p in prompts)
            )
            return sum(len(c.token_ids) for group in outs for c in group)

        async def latencies(decoding: bool) -> dict[str, float | None]:
            """Round trips of a route the API server answers alone (``/health``) and of one that asks the engine
            (``/is_paused``), idle or 0.3 s into a decoding batch: where a pause's time goes."""
            gen = asyncio.create_task(decode()) if decoding else None
            if gen is not None:
                await asyncio.sleep(a.into_s)
            health, engine = [], []
            for _ in range(10):
                t0 = time.monotonic()
                await client.health()
                t1 = time.monotonic()
                await client.is_paused()
                health.append(t1 - t0)
                engine.append(time.monotonic() - t1)
            if gen is not None:
                await gen
            return {
                "health_s_median": median(health),
                "health_s_max": max(health),
                "is_paused_s_median": median(engine),
                "is_paused_s_max": max(engine),
            }

        async def decode_plain() -> int:
            """The same batch without sampled-token log-probs (what they cost the server)."""
            body = {"n": a.group, "max_tokens": a.max_tokens, "temperature": 1.0, "return_token_ids": True}
            outs = await asyncio.gather(
                *(client._request("POST", "/v1/completions", json={**body, "prompt": p}) for p in prompts)
            )
            return sum(len(c["token_ids"]) for r in outs for c in r.json()["choices"])

        for path in PATHS:  # warm-up: first calls of each path (allocations, first RPC)
            await publish(base, path)
        res["round_trips"] = {"idle": await latencies(False), "decoding": await latencies(True)}
        say(json.dumps(res["round_trips"]))

        async def decode_seeded() -> int:
            """The same batch with a seed per request, as a run samples (``orchestrator.seeded_sampling``): vLLM draws
            each seeded request from its own generator."""
            outs = await asyncio.gather(
                *(
                    client.generate(p, n=a.group, max_tokens=a.max_tokens, temperature=1.0, seed=1000 + i)
                    for i, p in enumerate(prompts)
                )
            )
            return sum(len(c.token_ids) for group in outs for c in group)

        variants = (
            ("decode_alone", decode),
            ("decode_without_logprobs", decode_plain),
            ("decode_seeded", decode_seeded),
        )
        for name, fn in variants:
            rounds = []
            for _ in range(3):
                t0 = time.perf_counter()
                n_tok = await fn()
                rounds.append({"tokens": n_tok, "wall_s": time.perf_counter() - t0})
            res[name] = {"rounds": rounds, "tokens_per_s_median": median([r["tokens"] / r["wall_s"] for r in rounds])}
            say(f"{name}: {json.dumps(res[name])}")
        if a.py_spy:  # where the server's processes spend a decoding batch (collapsed stacks, both processes)
            gen = asyncio.ensure_future(asyncio.gather(*(decode() for _ in range(3))))
            await asyncio.sleep(a.into_s)
            spy = await asyncio.create_subprocess_exec(
                a.py_spy,
                "record",
                "--pid",
                str(a.server_pid),
                "--subprocesses",
                "--nonblocking",
                "--rate",
                "250",
                "--duration",
                "3",
                "--format",
                "raw",
                "--output",
                str(out / "py_spy_decoding.txt"),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            _, err = await spy.communicate()
            res["py_spy"] = {"rc": spy.returncode, "stderr": err.decode()[-500:]}
            await gen
        for cond in [c for c in CONDITIONS if c in a.conditions.split(",")]:
            hog, stop = None, out / f"stop-{cond}"
            if cond.endswith("gpu_busy"):
                hog = subprocess.Popen([sys.executable, "-c", HOG, str(stop)])
                await asyncio.sleep(3.0)  # its context and first matmuls
            try:
                for i in range(a.updates):
                    for path in PATHS if i % 2 == 0 else PATHS[::-1]:
                        gen = asyncio.create_task(decode()) if cond != "idle" else None
                        if gen is not None:
                            await asyncio.sleep(a.into_s)
                        weights = moved if i % 2 == 0 else base
                        row = {"condition": cond, "i": i, **await publish(weights, path, cond != "decoding_no_clear")}
                        if gen is not None:
                            row["decoded_tokens"] = await gen
                        res["updates"].append(row)
                        say(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
            finally:
                if hog is not None:
                    stop.write_text("")
                    hog.wait(timeout=60)
            res["conditions"][cond] = {
                path: {
                    f"{ph}_median": median(
                        [r[ph] for r in res["updates"] if r["condition"] == cond and r["path"] == path]
                    )
                    for ph in PHASES
                }
                for path in PATHS
            }
        # both paths serve the same policy: the perturbed weights through each, against each other and the base
        await publish(base, "direct")
        lp_base = await client.prompt_logprobs(probe, 1)
        await publish(moved, "layerwise")
        lp_layerwise = await client.prompt_logprobs(probe, 1)
        await publish(base, "direct")
        await publish(moved, "direct")
        lp_direct = await client.prompt_logprobs(probe, 1)
        res["same_policy"] = {
            "max_abs_diff_layerwise_vs_direct": max(abs(x - y) for x, y in zip(lp_layerwise, lp_direct, strict=True)),
            "moved_from_base": max(abs(x - y) for x, y in zip(lp_direct, lp_base, strict=True)),
            "probe_tokens": len(probe) - 1,
        }
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/weight_update_bench"))
    p.add_argument("--model-size", default="qwen3-0.6b")
    p.add_argument("--updates", type=int, default=6, help="updates per condition and load path")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--into-s", type=float, default=0.3, help="seconds into the decoding when the update starts")
    p.add_argument("--boot-timeout-s", type=float, default=240)
    p.add_argument(
        "--conditions", default=",".join(CONDITIONS), help="comma-separated subset of " + ", ".join(CONDITIONS)
    )
    p.add_argument("--py-spy", default="", help="py-spy binary: record the server's processes while a batch decodes")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)

    import torch

    from worker.inference.server import server_command, server_env, wait_ready
    from worker.policy.models import init_model
    from worker.run.procs import free_port, kill_group, spawn

    model = a.work / f"model-{a.model_size}"
    if not (model / "config.json").is_file():
        init_model(model, size=a.model_size, seed=0, overwrite=True)
    port = free_port()
    cmd = server_command(
        str(model), "127.0.0.1", port, max_model_len=512, dtype="bfloat16", extra_args=["--gpu-memory-utilization=0.3"]
    )
    log = a.out / "weight_update_bench_inference.log"
    proc = spawn(cmd, log, server_env())
    res: dict[str, Any] = {
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "server_command": " ".join(cmd[1:]),
    }
    try:
        a.server_pid = proc.pid
        res["server_boot_s"] = wait_ready(f"http://127.0.0.1:{port}", a.boot_timeout_s, proc, log)
        say(f"server ready in {res['server_boot_s']:.0f} s")
        res.update(asyncio.run(bench(f"http://127.0.0.1:{port}", model, a, a.out)))
    finally:
        kill_group(proc)
        (a.out / "gpu_weight_update.json").write_text(json.dumps(res, indent=1) + "\n")
    say(json.dumps({"conditions": res.get("conditions"), "same_policy": res.get("same_policy")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
