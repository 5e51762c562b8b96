"""Weight update per policy version, LoRA adapter vs full weights, on one vLLM server with ``--enable-lora``.

The ``tiny`` model (``asyncrl model init``: hidden 256, 4 layers, fp32) served with LoRA on (rank 8, as
``worker.inference.server.lora_args``), then ``R`` versions per route after one warm-up each:

- **full**: the trainer side writes ``weights/step_n/model.safetensors`` (+ STABLE, renamed into place, as
  ``publish_weights``) of freshly perturbed weights; the orchestrator side runs ``publish_weights(path)``: pause(keep)
  -> ``update_weights_from_path`` -> reset prefix cache -> resume.
- **lora**: the trainer side writes the PEFT adapter (``publish_adapter``: adapter_config.json +
  adapter_model.safetensors, perturbed A and B of all 7 projections, rank 8); the orchestrator side runs
  ``publish_weights(path, load=load_lora_adapter)``: pause(keep) -> ``/v1/load_lora_adapter`` -> reset -> resume.

Per version: ``publish_s`` (trainer write), ``update_s`` (pause -> load -> resume), ``first_token_s`` (one 1-token
request naming the new version: vLLM may read an adapter at its first request) and ``total_s`` (their sum).
Medians are reported.

Run: ``.venv/bin/python benchmarks/lora_weight_update.py [--rounds R]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402

RANK = 8


async def _measure(url: str, model_dir: Path, work: Path, rounds: int) -> dict:
    import torch

    from worker.inference.client import InferenceClient
    from worker.policy.lora_adapters import lora_adapter_name
    from worker.policy.models import load_model
    from worker.run.rundir import RunDir
    from worker.spec import LoraConfig
    from worker.trainer.lora import wrap
    from worker.weight_sync.publish import publish_adapter, publish_weights

    run = RunDir(work / "run")
    run.create()
    full = load_model(model_dir)
    lora_model = load_model(model_dir)
    adapter = wrap(lora_model, LoraConfig(rank=RANK))
    keys = ("publish_s", "update_s", "first_token_s", "total_s")
    results: dict[str, dict] = {route: {k: [] for k in keys} for route in ("full", "lora")}
    version = 0
    async with InferenceClient(url, read_timeout_s=600, max_retries=0) as client:

        async def first_token(model: str | None) -> float:
            client.model = model
            t0 = time.perf_counter()
            await client.generate([1, 42, 71], n=1, max_tokens=1, temperature=1.0)
            return time.perf_counter() - t0

        for r in range(rounds + 1):  # round 0 is warm-up
            for route in ("full", "lora"):
                version += 1
                g = torch.Generator().manual_seed(version)
                with torch.no_grad():
                    for p in (full if route == "full" else lora_model).parameters():
                        if route == "full" or p.requires_grad:
                            p.add_(1e-3 * torch.randn(p.shape, generator=g))
                t0 = time.perf_counter()
                if route == "full":
                    path = publish_weights(full, run, version, keep_versions=4)
                    publish_s = time.perf_counter() - t0
                    info = await client.publish_weights(path)
                    first = await first_token(None)
                else:
                    path = publish_adapter(adapter, run, version, keep_versions=4)
                    publish_s = time.perf_counter() - t0
                    name = lora_adapter_name(run.root, version)

                    async def load(folder: Path, name: str = name) -> dict:
                        return await client.load_lora_adapter(name, folder)

                    info = await client.publish_weights(path, load=load)
                    first = await first_token(name)
                    if version > 4:
                        await client.unload_lora_adapter(lora_adapter_name(run.root, version - 4))
                if r:
                    row = results[route]
                    row["publish_s"].append(publish_s)
                    row["update_s"].append(info["total_s"])
                    row["first_token_s"].append(first)
                    row["total_s"].append(publish_s + info["total_s"] + first)
        files = {
            route: sum(f.stat().st_size for f in run.weight_dir(v).iterdir())
            for route, v in (("full", version - 1), ("lora", version))
        }
    for route, row in results.items():
        for key in keys:
            row[f"{key}_median"] = round(C.median(row[key]), 4)
            row[key] = [round(x, 4) for x in row[key]]
        row["version_bytes"] = files[route]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    started, machine = time.time(), C.machine_facts()

    from worker.inference.server import start_server, stop_server, wait_ready
    from worker.policy.models import init_model
    from worker.run.procs import free_port

    work = C.TMP / "lora_weight_update"
    model_dir = init_model(work / "model", size="tiny", seed=0, overwrite=True)
    port = free_port()
    log = work / "server.log"
    proc = start_server(str(model_dir), "127.0.0.1", port, log_path=log, max_model_len=512, lora_rank=RANK)
    url = f"http://127.0.0.1:{port}"
    try:
        boot = wait_ready(url, timeout_s=600, proc=proc, log_path=log)
        C.say(f"[bench] server (LoRA on) up in {boot:.0f}s")
        res = asyncio.run(_measure(url, model_dir, work, args.rounds))
    finally:
        stop_server(proc)
    C.say(f"[bench] {res}")
    payload = {"setup": {"rounds": args.rounds, "model": "tiny", "lora_rank": RANK, "dtype": "float32"}, **res}
    out = C.write_result("lora_weight_update", payload, quick=False, started=started, machine=machine)
    rows = [
        [
            route,
            round(r["version_bytes"] / 2**20, 2),
            round(r["publish_s_median"] * 1000, 1),
            round(r["update_s_median"] * 1000, 1),
            round(r["first_token_s_median"] * 1000, 1),
            round(r["total_s_median"] * 1000, 1),
        ]
        for route, r in res.items()
    ]
    table = C.md_table(
        ["route", "version MiB", "trainer publish ms", "pause->load->resume ms", "first token ms", "total ms (median)"],
        rows,
    )
    return C.finish(out, table)


if __name__ == "__main__":
    sys.exit(main())
