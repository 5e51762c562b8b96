"""A simulated OpenAI-compatible inference server for load tests of the orchestrator (``orchestrator_scale.py``).

It answers the routes the orchestrator's client (``worker/inference/client.py``) calls, in the shape vLLM's
OpenAI server gives them, without a model:

- ``POST /v1/completions``: ``n`` choices, each with ``token_ids`` (``return_token_ids``), ``logprobs`` (``tokens``
  as ``token_id:<id>`` (``return_tokens_as_token_ids``), ``token_logprobs``, ``top_logprobs`` holding the sampled
  token (``logprobs = 0``), ``text_offset``), ``text``, ``finish_reason`` (``stop`` or ``length``), ``stop_reason``;
  ``prompt_logprobs`` when asked (``[None, {str(id): {"logprob", "rank", "decoded_token"}}, ...]``); ``usage``.
  The reply comes after ``ttft_ms + per_token_ms * L`` (L: the longest completion of the request) times a
  log-normal jitter, while the server holds the request as vLLM would.
- ``/health``, ``/v1/models``, ``/pause``, ``/resume``, ``/is_paused``, ``/reset_prefix_cache``,
  ``/collective_rpc`` (a weight load that takes ``load_ms``), ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``;
  ``GET /sim/stats``: requests and completions served, and the completions in flight now and at most
  (``inflight_max``), plus their time-average and the server's CPU seconds (``cpu_s``) since the last
  ``POST /sim/stats/reset``.

Completion lengths are log-normal around ``len_mean`` (sigma ``len_sigma``), cut to ``max_tokens`` (then
``finish_reason`` is ``length``). Token ids are drawn from ``[vocab_low, vocab_high)`` (default: the printable
bytes of the tiny model's byte-level vocabulary), logprobs from ``-Exp(1)``; both come from pools drawn once
at start (seeded), so the server spends its CPU on HTTP and JSON as a real server does, not on random numbers.
While paused (``/pause?mode=keep``) no reply is sent: requests in flight wait for ``/resume``.

Run: ``python benchmarks/sim_inference.py --port 8100 [--ttft-ms 50 --per-token-ms 10 --len-mean 48 ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

POOL = 1 << 16
"""Size of the pre-drawn pools of token ids and logprobs (a completion is a slice at a random offset)."""


@dataclass
class SimConfig:
    """The simulated server's latency and length distributions (ms, tokens)."""

    ttft_ms: float = 50.0
    per_token_ms: float = 10.0
    jitter_sigma: float = 0.3
    """Sigma of the log-normal factor (median 1) on each request's latency."""
    len_mean: float = 48.0
    """Median completion length in tokens (log-normal), before the ``max_tokens`` cut."""
    len_sigma: float = 0.5
    vocab_low: int = 32
    vocab_high: int = 127
    load_ms: float = 100.0
    """Seconds of a simulated weight load (``/collective_rpc``, ``/v1/load_lora_adapter``), in ms."""
    model: str = "sim-model"
    seed: int = 0


@dataclass
class SimState:
    config: SimConfig
    rng: random.Random = field(init=False)
    ids: list[int] = field(init=False)
    lps: list[float] = field(init=False)
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    requests: int = 0
    completions: int = 0
    inflight: int = 0
    inflight_max: int = 0
    area: float = 0.0
    """Integral of ``inflight`` over time since ``since`` (completion-seconds)."""
    since: float = field(default_factory=time.monotonic)
    cpu_since: float = field(default_factory=time.process_time)
    """The server's CPU seconds at the last stats reset."""
    last: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        c = self.config
        self.rng = random.Random(c.seed)
        self.ids = [self.rng.randrange(c.vocab_low, c.vocab_high) for _ in range(2 * POOL)]
        self.lps = [-self.rng.expovariate(1.0) for _ in range(2 * POOL)]
        self.resumed.set()

    def add_inflight(self, k: int) -> None:
        now = time.monotonic()
        self.area += self.inflight * (now - self.last)
        self.last = now
        self.inflight += k
        self.inflight_max = max(self.inflight_max, self.inflight)

    def length(self, max_tokens: int) -> tuple[int, str]:
        c = self.config
        n = max(1, round(c.len_mean * math.exp(self.rng.gauss(0.0, c.len_sigma))))
        return (max_tokens, "length") if n >= max_tokens else (n, "stop")

    def choice(self, index: int, max_tokens: int) -> dict[str, Any]:
        n, finish = self.length(max_tokens)
        at = self.rng.randrange(POOL)
        ids, lps = self.ids[at : at + n], self.lps[at : at + n]
        tokens = [f"token_id:{t}" for t in ids]
        return {
            "index": index,
            "text": "".join(chr(t) for t in ids),
            "logprobs": {
                "text_offset": list(range(n)),
                "token_logprobs": lps,
                "tokens": tokens,
                "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps, strict=True)],
            },
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": ids,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
        }


def make_app(config: SimConfig) -> Starlette:
    """The Starlette app of one simulated server (module docstring)."""
    state = SimState(config)

    async def completions(request: Request) -> Response:
        body = json.loads(await request.body())
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            return JSONResponse({"error": {"message": "prompt: expected a non-empty list of token ids"}}, 400)
        n, max_tokens = int(body.get("n", 1)), int(body.get("max_tokens", 16))
        state.requests += 1
        state.add_inflight(n)
        try:
            choices = [state.choice(i, max_tokens) for i in range(n)]
            if body.get("prompt_logprobs") is not None:
                rows: list[Any] = [None]
                rows += [{str(t): {"logprob": -1.0, "rank": 1, "decoded_token": chr(t % 128)}} for t in prompt[1:]]
                choices[0]["prompt_logprobs"] = rows
            longest = max(len(c["token_ids"]) for c in choices)
            jitter = math.exp(state.rng.gauss(0.0, config.jitter_sigma))
            await asyncio.sleep((config.ttft_ms + config.per_token_ms * longest) * jitter / 1000.0)
            await state.resumed.wait()  # paused with requests kept: they answer after resume
        finally:
            state.add_inflight(-n)
        state.completions += n
        generated = sum(len(c["token_ids"]) for c in choices)
        out = {
            "id": f"cmpl-{state.requests}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or config.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": generated,
                "total_tokens": len(prompt) + generated,
            },
        }
        return Response(json.dumps(out), media_type="application/json")

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": config.model, "object": "model"}]})

    async def pause(_: Request) -> Response:
        state.resumed.clear()
        return JSONResponse({"status": "paused"})

    async def resume(_: Request) -> Response:
        state.resumed.set()
        return JSONResponse({"status": "resumed"})

    async def is_paused(_: Request) -> Response:
        return JSONResponse({"is_paused": not state.resumed.is_set()})

    async def reset_prefix_cache(_: Request) -> Response:
        return JSONResponse({"success": True})

    async def collective_rpc(_: Request) -> Response:
        await asyncio.sleep(config.load_ms / 1000.0)
        return JSONResponse({"results": [{"tensors": 0, "seconds": config.load_ms / 1000.0, "tied": False}]})

    async def lora(_: Request) -> Response:
        await asyncio.sleep(config.load_ms / 1000.0)
        return Response("Success", media_type="text/plain")

    async def stats(_: Request) -> Response:
        state.add_inflight(0)
        span = max(state.last - state.since, 1e-9)
        return JSONResponse(
            {
                "requests": state.requests,
                "completions": state.completions,
                "inflight": state.inflight,
                "inflight_max": state.inflight_max,
                "inflight_mean": state.area / span,
                "window_s": span,
                "cpu_s": time.process_time() - state.cpu_since,
            }
        )

    async def reset_stats(_: Request) -> Response:
        state.add_inflight(0)
        state.area, state.since, state.inflight_max = 0.0, state.last, state.inflight
        state.cpu_since = time.process_time()
        return JSONResponse({"reset": True})

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health),
            Route("/v1/models", models),
            Route("/pause", pause, methods=["POST"]),
            Route("/resume", resume, methods=["POST"]),
            Route("/is_paused", is_paused),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            Route("/collective_rpc", collective_rpc, methods=["POST"]),
            Route("/v1/load_lora_adapter", lora, methods=["POST"]),
            Route("/v1/unload_lora_adapter", lora, methods=["POST"]),
            Route("/sim/stats", stats),
            Route("/sim/stats/reset", reset_stats, methods=["POST"]),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/sim_inference.py")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    defaults = SimConfig()
    for name in ("ttft_ms", "per_token_ms", "jitter_sigma", "len_mean", "len_sigma", "load_ms"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    for name in ("vocab_low", "vocab_high", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    args = p.parse_args(argv)
    if args.host != "127.0.0.1":
        p.error(f"--host: the simulated server listens on 127.0.0.1 only, got {args.host!r}")
    config = SimConfig(**{k: v for k, v in vars(args).items() if k in SimConfig.__dataclass_fields__})
    import uvicorn

    uvicorn.run(make_app(config), host=args.host, port=args.port, log_level="warning", access_log=False, backlog=8192)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
