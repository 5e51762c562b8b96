"""Latency of one in-place weight update into a running vLLM server: filesystem vs process group (gloo on CPU).

For each model size (``tiny``: hidden 256, 4 layers; ``small``: hidden 512, 8 layers; ``asyncrl model init``,
fp32) one vLLM server is started on it (``worker.inference.server.start_server``, 1 OMP thread, as runs do),
then ``R`` updates per route, each with freshly perturbed weights (so every load really changes the model),
after one warm-up update per route:

- **filesystem**: the trainer side writes ``weights/step_n/model.safetensors`` (+ STABLE, renamed into place,
  as ``publish_weights``), then the orchestrator side runs ``publish_weights(path)``: pause(keep) ->
  ``update_weights_from_path`` -> reset prefix cache -> resume.
- **process_group**: ``WeightSender.publish`` (trainer rank 0, in a thread: writes ``group.json``, broadcasts
  the buckets, waits for the acknowledgement) while the orchestrator side runs ``publish_weights(path,
  load=WeightReceiver.load)``: pause(keep) -> ``update_weights_from_group`` (receive + load) -> reset -> resume.

Per update two times are recorded: ``update_s`` = pause -> load -> resume as the orchestrator sees it
(``publish_weights``' ``total_s``), and ``end_to_end_s`` = from the trainer starting to publish the version
until vLLM serves it (includes the safetensors write, resp. the metadata write and the broadcast), and ``worker_s`` = the vLLM
worker's own time in the RPC (read or receive, plus the layerwise reload). The
orchestrator's 50 ms polling of ``weights/`` is not included (the same for both routes). Medians are reported.

Run: ``.venv/bin/python benchmarks/weight_update.py [--quick] [--rounds R] [--sizes tiny,small]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as C  # noqa: E402


def _perturbed_states(model_dir: Path, rounds: int) -> list[dict]:
    """``rounds`` weight sets: the model's HF-named weights (tied lm_head left out) plus small noise each."""
    import torch

    from worker.policy.models import load_model

    model = load_model(model_dir)
    base = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        base.pop("lm_head.weight", None)
    out = []
    for r in range(rounds):
        g = torch.Generator().manual_seed(100 + r)
        out.append({k: (v + 1e-3 * torch.randn(v.shape, generator=g)).contiguous() for k, v in base.items()})
    return out


async def _measure(url: str, model_dir: Path, work: Path, rounds: int, bucket_mb: int) -> dict:
    import torch

    from worker.inference.client import InferenceClient
    from worker.run.rundir import STABLE_MARKER, RunDir
    from worker.spec import WeightSyncConfig
    from worker.weight_sync.load import WeightReceiver
    from worker.weight_sync.publish import WeightSender, write_version

    states = _perturbed_states(model_dir, 2 * (rounds + 1))
    n_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    run = RunDir(work / "run")
    run.create()
    cfg = WeightSyncConfig(kind="process_group", bucket_mb=bucket_mb, timeout_s=300)
    results: dict[str, dict] = {
        "filesystem": {"update_s": [], "end_to_end_s": [], "worker_s": []},
        "process_group": {"update_s": [], "end_to_end_s": [], "worker_s": [], "buckets": None},
    }
    version = 0
    async with InferenceClient(url, read_timeout_s=600, max_retries=0) as client:
        sender = WeightSender(run, cfg, torch.device("cpu"), workers=1, join_timeout_s=120)
        receiver = WeightReceiver(client, run, cfg)
        if not await receiver.join(wait_s=30):
            raise RuntimeError("the vLLM workers did not join the weight-sync group")
        for r in range(rounds + 1):  # round 0 is warm-up
            version += 1
            t0 = time.perf_counter()
            write_version(run, version, states[2 * r], None)
            info = await client.publish_weights(run.weight_dir(version))
            e2e = time.perf_counter() - t0
            if r:
                results["filesystem"]["update_s"].append(info["total_s"])
                results["filesystem"]["end_to_end_s"].append(e2e)
                results["filesystem"]["worker_s"].append(info["seconds"])

            version += 1
            t0 = time.perf_counter()
            pub = asyncio.create_task(asyncio.to_thread(sender.publish, states[2 * r + 1], version, 10**9))
            while not (run.weight_dir(version) / STABLE_MARKER).exists():
                await asyncio.sleep(0.001)
            info = await client.publish_weights(run.weight_dir(version), load=receiver.load)
            await pub
            e2e = time.perf_counter() - t0
            if info.get("route") != "process_group" or sender.failed:
                raise RuntimeError(f"the group update fell back to the filesystem: {sender.failed}")
            if r:
                results["process_group"]["update_s"].append(info["total_s"])
                results["process_group"]["end_to_end_s"].append(e2e)
                results["process_group"]["worker_s"].append(info["seconds"])
                results["process_group"]["buckets"] = info["buckets"]
        await client.publish_weights(model_dir)  # leave the server as it started
    for route in results.values():
        for key in ("update_s", "end_to_end_s", "worker_s"):
            route[f"{key}_median"] = round(C.median(route[key]), 4)
            route[key] = [round(x, 4) for x in route[key]]
    return {"weight_bytes": n_bytes, "tensors": len(states[0]), "bucket_mb": bucket_mb, **results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, tiny only")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--bucket-mb", type=int, default=256)
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    sizes = ["tiny"] if args.quick else [s for s in args.sizes.split(",") if s]
    started, machine = time.time(), C.machine_facts()

    from worker.inference.server import start_server, stop_server, wait_ready
    from worker.policy.models import init_model
    from worker.run.procs import free_port

    per_size = {}
    for size in sizes:
        work = C.TMP / f"weight_update-{size}"
        model_dir = init_model(work / "model", size=size, seed=0, overwrite=True)
        port = free_port()
        log = work / "server.log"
        proc = start_server(str(model_dir), "127.0.0.1", port, log_path=log, max_model_len=512, dtype="float32")
        url = f"http://127.0.0.1:{port}"
        try:
            boot = wait_ready(url, timeout_s=600, proc=proc, log_path=log)
            C.say(f"[bench] {size}: server up in {boot:.0f}s")
            per_size[size] = asyncio.run(_measure(url, model_dir, work, rounds, args.bucket_mb))
        finally:
            stop_server(proc)
        C.say(f"[bench] {size}: {per_size[size]}")

    payload = {"setup": {"rounds": rounds, "server_omp_threads": 1, "dtype": "float32"}, "sizes": per_size}
    out = C.write_result("weight_update", payload, quick=args.quick, started=started, machine=machine)
    rows = []
    for size, res in per_size.items():
        fs, pg = res["filesystem"], res["process_group"]
        for route, r in (("filesystem", fs), (f"process group (gloo, {pg['buckets']} bucket(s))", pg)):
            rows.append(
                [
                    size,
                    round(res["weight_bytes"] / 2**20, 1),
                    route,
                    round(r["worker_s_median"] * 1000),
                    round(r["update_s_median"] * 1000),
                    round(r["end_to_end_s_median"] * 1000),
                ]
            )
    table = C.md_table(
        [
            "model",
            "weights MiB",
            "route",
            "worker read/receive+load ms",
            "pause->load->resume ms (median)",
            "trainer publish -> served ms (median)",
        ],
        rows,
    )
    return C.finish(out, table)


if __name__ == "__main__":
    sys.exit(main())
