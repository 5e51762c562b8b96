"""``InferenceClient.generate`` reads vLLM's ``/v1/completions`` answer (token ids, sampled-token logprobs, finish
reason) with msgspec, skipping the fields it does not use; and the simulated server of
``benchmarks/sim_inference.py`` answers in that shape."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.support.simulated_server import sim_app
from worker.inference.client import Completion, InferenceClient, InferenceError


def _choice(index: int, ids: list[int], lps: list[float] | None, finish: str) -> dict[str, Any]:
    """One choice as vLLM 0.31 gives it with logprobs 0, return_token_ids and return_tokens_as_token_ids."""
    tokens = [f"token_id:{t}" for t in ids]
    return {
        "index": index,
        "text": "".join(chr(t) for t in ids),
        "logprobs": None
        if lps is None
        else {
            "text_offset": list(range(len(ids))),
            "token_logprobs": lps,
            "tokens": tokens,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=False)],
        },
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": ids,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }


def _generate(reply: dict[str, Any] | None = None, app: Any = None, **kw: Any) -> tuple[list[Completion], list[Any]]:
    """``generate([1, 2, 3], **kw)`` against ``app`` (default: one route answering ``reply``) served by uvicorn;
    the completions and the bodies the server received."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tests.support.uvicorn_thread import serve

    sent: list[Any] = []

    async def completions(request: Request) -> JSONResponse:
        sent.append(await request.json())
        return JSONResponse(reply)

    async def go(url: str) -> list[Completion]:
        async with InferenceClient(url, max_retries=0) as client:
            return await client.generate([1, 2, 3], temperature=1.0, **kw)

    with serve(app or Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])) as url:
        return asyncio.run(go(url)), sent


def test_generate_reads_ids_logprobs_and_finish_in_index_order() -> None:
    reply = {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "m",
        "choices": [
            _choice(1, [70, 71], [-0.5, -0.25], "stop"),
            _choice(0, [65, 66, 67], [-1.0, -2.0, -3.0], "length"),
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }
    out, sent = _generate(reply, n=2, max_tokens=3)
    assert out == [
        Completion(token_ids=[65, 66, 67], logprobs=[-1.0, -2.0, -3.0], finish_reason="length"),
        Completion(token_ids=[70, 71], logprobs=[-0.5, -0.25], finish_reason="stop"),
    ]
    assert sent[0]["prompt"] == [1, 2, 3] and sent[0]["n"] == 2 and sent[0]["logprobs"] == 0


@pytest.mark.parametrize(
    ("choice", "says"),
    [
        (_choice(0, [65, 66], None, "stop"), "Expected `object`, got `null` - at `$.choices[0].logprobs`"),
        (_choice(0, [65, 66], [-1.0], "stop"), "2 token ids but 1 logprobs"),
        ({**_choice(0, [65], [-1.0], "stop"), "token_ids": ["A"]}, "Expected `int`, got `str`"),
    ],
)
def test_generate_refuses_an_answer_it_cannot_train_on(choice: dict[str, Any], says: str) -> None:
    with pytest.raises(
        InferenceError, match=r"POST http://127\.0\.0\.1:\d+/v1/completions: unexpected response"
    ) as err:
        _generate({"choices": [choice]}, n=1, max_tokens=2)
    assert says in str(err.value)


def test_simulated_server_answers_as_vllm_with_its_lengths() -> None:
    fixed = {"ttft_ms": 0.0, "per_token_ms": 0.0, "jitter_sigma": 0.0, "len_mean": 5.0, "len_sigma": 0.0}
    out, _ = _generate(app=sim_app(**fixed), n=3, max_tokens=10)  # every completion 5 tokens: stopped
    assert [(len(c.token_ids), len(c.logprobs), c.finish_reason) for c in out] == [(5, 5, "stop")] * 3
    assert all(32 <= t < 127 for c in out for t in c.token_ids)
    assert all(lp <= 0.0 for c in out for lp in c.logprobs)
    out, _ = _generate(app=sim_app(**fixed), n=2, max_tokens=4)  # cut at max_tokens
    assert [(len(c.token_ids), c.finish_reason) for c in out] == [(4, "length")] * 2


def test_a_weight_update_does_not_wait_behind_a_full_generation_pool() -> None:
    """256 completions held open by a real HTTP server fill the generation pool; pause, ``/collective_rpc``, prefix
    reset and resume still go through at once (their own pool), and the held completions then finish."""
    import time

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tests.support.uvicorn_thread import serve

    held = 256
    release = asyncio.Event()
    arrived: list[float] = []
    loop_of_server: list[asyncio.AbstractEventLoop] = []

    async def completions(_: Request) -> JSONResponse:
        loop_of_server[:1] = [asyncio.get_running_loop()]
        arrived.append(time.monotonic())
        await release.wait()
        return JSONResponse({"choices": [_choice(0, [5], [-0.5], "length")]})

    async def control(_: Request) -> JSONResponse:
        return JSONResponse({"results": [{"tensors": 0}], "is_paused": False, "success": True})

    routes = [Route("/v1/completions", completions, methods=["POST"])] + [
        Route(p, control, methods=["GET", "POST"])
        for p in ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache")
    ]

    async def go() -> tuple[dict[str, Any], int]:
        async with InferenceClient(url, max_retries=0, read_timeout_s=30) as client:
            rollouts = [
                asyncio.create_task(client.generate([1, 2], n=1, max_tokens=1, temperature=1.0))
                for _ in range(held + 8)
            ]
            while len(arrived) < held:  # the generation pool is full; 8 more wait for a connection
                await asyncio.sleep(0.01)
            update = await asyncio.wait_for(client.publish_weights("/weights/step_1"), timeout=5)
            in_flight_during_update = len(arrived)
            loop_of_server[0].call_soon_threadsafe(release.set)
            done = await asyncio.gather(*rollouts)
            assert len(done) == held + 8
            return update, in_flight_during_update

    with serve(Starlette(routes=routes)) as url:
        update, in_flight = asyncio.run(go())
    assert in_flight == held  # the update went through while every generation connection was taken
    assert update["total_s"] < 5


def _recording_app(statuses: list[int]) -> tuple[Any, list[tuple[str, str, int]]]:
    """Every route of the client: answers the next of ``statuses`` (200 once they run out) and records (route,
    ``Authorization`` header, client port) per request."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen: list[tuple[str, str, int]] = []

    async def route(request: Request) -> JSONResponse:
        assert request.client is not None
        seen.append((request.url.path, request.headers.get("authorization", ""), request.client.port))
        status = statuses.pop(0) if statuses else 200
        body = {"choices": [_choice(0, [5], [-0.5], "length")], "is_paused": False, "success": True}
        return JSONResponse(body if status == 200 else {"error": "busy"}, status_code=status)

    paths = ("/v1/completions", "/pause", "/resume", "/is_paused", "/reset_prefix_cache", "/health")
    return Starlette(routes=[Route(p, route, methods=["GET", "POST"]) for p in paths]), seen


def test_http_503_is_retried_and_reported_with_its_body_after_the_last_attempt() -> None:
    from tests.support.uvicorn_thread import serve

    async def go(url: str, retries: int) -> list[Completion]:
        async with InferenceClient(url, max_retries=retries, backoff_s=0.01) as client:
            return await client.generate([1, 2], n=1, max_tokens=1, temperature=1.0)

    statuses = [503, 503]  # two refusals, then an answer: the third attempt of 3 gets it
    app, seen = _recording_app(statuses)
    with serve(app) as url:
        assert asyncio.run(go(url, retries=2)) == [Completion(token_ids=[5], logprobs=[-0.5], finish_reason="length")]
    assert len(seen) == 3 and statuses == []

    statuses = [503, 503, 503]  # more refusals than attempts (2)
    app, seen = _recording_app(statuses)
    with serve(app) as url, pytest.raises(InferenceError) as err:
        asyncio.run(go(url, retries=1))
    assert str(err.value) == f'POST {url}/v1/completions: HTTP 503: \'{{"error":"busy"}}\' after 2 attempt(s)'
    assert len(seen) == 2 and statuses == [503]


def test_the_key_goes_with_every_route_and_connections_are_kept_alive_across_event_loops() -> None:
    """``api_key`` on generation and control routes alike; sequential calls share one kept-alive connection per
    pool; the same client (built outside any loop, as the orchestrator builds it) serves a second ``asyncio.run``
    after ``aclose`` in the first, on new connections."""
    from tests.support.uvicorn_thread import serve

    app, seen = _recording_app([])
    client = InferenceClient("http://unset", max_retries=0, api_key="k-123")

    async def calls() -> None:
        for _ in range(3):
            await client.generate([1, 2], n=1, max_tokens=1, temperature=1.0)
        await client.pause()
        assert not await client.is_paused()
        await client.resume()
        assert await client.health()
        await client.aclose()

    with serve(app) as url:
        client.base_url = url
        asyncio.run(calls())
        first = list(seen)
        asyncio.run(calls())
    routes = ["/v1/completions"] * 3 + ["/pause", "/is_paused", "/resume", "/health"]
    assert [r for r, _, _ in seen] == routes * 2
    assert [a for _, a, _ in seen] == ["Bearer k-123"] * 14
    ports = [p for _, _, p in first]
    assert len(set(ports[:3])) == 1 and len(set(ports[3:])) == 1 and ports[0] != ports[3]  # one per pool
    assert not set(ports) & {p for _, _, p in seen[7:]}  # the second loop's connections are new ones
