"""Async client of the inference server: generation with token ids + sampled-token logprobs, and the
pause / update-weights / resume cycle that publishes a new policy version to vLLM (the HTTP calls of weight
sync; both ends are in ``worker/weight_sync/``: ``publish.py`` draws the whole path).

Every call is bounded: connect (connection-pool wait included) and socket-read timeouts, a hard per-attempt deadline
(``connect_timeout_s + read_timeout_s``), and at most ``max_retries`` retries with exponential backoff
(tenacity). Network failures that survive the retries raise :class:`InferenceError` with one line naming
the URL, the route and what happened (``ConnectTimeout``, ``ReadTimeout``, ``ConnectError``, ``HTTP 503``, ...).

The transport is aiohttp (two sessions: the generation routes and the rest, ``GENERATION_ROUTES``). It replaced httpx
(``benchmarks/README.md``, section 11, session 17): with 256 completions of n = 16 in flight the client process spent
2.6-2.7 ms of CPU per request with httpx (httpcore's pool scans every connection for every queued request on each
request and release, and with 64 of 256 connections kept alive it opens and closes sockets all the time) and 0.68-0.73
ms with aiohttp (``benchmarks/client_transport.py``); the orchestrator's event loop at 4,096 rollouts in flight went
from 0.56-0.58 to 0.24-0.25 ms of CPU per rollout (``benchmarks/orchestrator_scale.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import msgspec
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from worker.inference.auth import key_header
from worker.tracking import progress

RETRY_STATUS = frozenset({502, 503, 504})
GENERATION_ROUTES = frozenset({"/v1/completions"})
"""Routes that generate (held for seconds, up to ``GENERATION_CONNECTIONS`` at once); every other request (pause,
resume, ``/collective_rpc``, prefix-cache reset, adapters, health, models) goes through a pool of its own, so a weight
update never waits for a connection behind hundreds of rollouts (measured with 4,096 in flight: pause -> resume
0.12-0.83 s with one shared 256-connection pool, ``benchmarks/orchestrator_scale.py``)."""
GENERATION_CONNECTIONS = 256
CONTROL_CONNECTIONS = 8
KEEPALIVE_S = 4.0
"""An idle connection is closed after this long: under the 5 s after which vLLM's uvicorn closes it
(``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), so a request is not sent on a connection the server is closing."""


class InferenceError(RuntimeError):
    """The inference server could not be reached or answered with an error."""


@dataclass(frozen=True, slots=True)
class Reply:
    """One answer of the inference server: its status and whole body (read before the connection went back to the
    pool)."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body parsed as JSON; ``ValueError`` when it is not JSON."""
        return json.loads(self.content)


class _RetryableStatus(Exception):
    def __init__(self, response: Reply):
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


_RETRIED = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError, _RetryableStatus)
"""What an attempt is retried on: connect errors and timeouts, connections the server closed, truncated bodies, the
per-attempt deadline, HTTP 502/503/504. Other ``aiohttp.ClientError`` (an invalid URL) are not."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion: token ids and the logprob of each sampled token under the (temperature-
    scaled, top-p filtered) distribution it was sampled from."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class _Logprobs(msgspec.Struct):
    token_logprobs: list[float]


class _Choice(msgspec.Struct):
    index: int
    token_ids: list[int]
    logprobs: _Logprobs
    finish_reason: str | None = None


class _Completions(msgspec.Struct):
    """The fields of vLLM's ``/v1/completions`` answer that :meth:`InferenceClient.generate` reads; the others
    (``tokens``, ``top_logprobs``, ``text_offset``, ``text``, ``usage``) are skipped by the decoder, never built."""

    choices: list[_Choice]


_COMPLETIONS = msgspec.json.Decoder(_Completions)


def _describe(exc: BaseException, connect_s: float = 0.0, read_s: float = 0.0) -> str:
    """One line: what failed, in the words of the timeout or error class (``ConnectTimeout``, ``ReadTimeout``,
    ``ConnectError``, ``HTTP <status>``, the per-attempt deadline, else the exception's class and first line)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # the TCP connect, or the wait for a pooled connection
        return f"ConnectTimeout: no connection within {connect_s:g}s"
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return f"ReadTimeout: no response within {read_s:g}s"
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, unreachable, unknown host
        return f"ConnectError: {exc}"
    if isinstance(exc, _RetryableStatus):
        return f"HTTP {exc.response.status_code}: {exc.response.text[:200]!r}"
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return f"timed out (attempt deadline {connect_s + read_s:g}s)"
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}{': ' + msg if msg else ''}"


class InferenceClient:
    """Client of one vLLM OpenAI server started by :mod:`worker.inference.server`.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
        connect_timeout_s: TCP connect (and connection-pool) timeout per attempt.
        read_timeout_s: read timeout per attempt; with a non-streamed completion this bounds the whole
            generation of one request.
        max_retries: retries after the first attempt on connection errors, timeouts and HTTP 502/503/504.
        backoff_s / max_backoff_s: exponential backoff between attempts (``backoff_s * 2**k``, capped).
        model: model name sent with completions; None lets the server use the model it serves.
        api_key: the server's API key, sent as ``Authorization: Bearer``; None: ``$ASYNCRL_INFERENCE_API_KEY`` (the
            run's key, ``worker.inference.auth``), nothing when that is unset.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        model: str | None = None,
        api_key: str | None = None,
    ):
        if max_retries < 0:
            raise ValueError(f"max_retries: expected >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.model = model
        self._headers = key_header(api_key)  # default: $ASYNCRL_INFERENCE_API_KEY (worker.inference.auth)
        self._timeout = self._timeouts(read_timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: aiohttp.ClientSession | None = None
        """GENERATION_ROUTES; made on the first request, in the event loop that runs it (aiohttp binds a session
        to one loop; the orchestrator builds its client before its loop starts)."""
        self._control: aiohttp.ClientSession | None = None
        """Every other route."""

    # ------------------------------------------------------------------ plumbing
    def max_total_s(self, read_timeout_s: float | None = None) -> float:
        """Upper bound of one call's wall time: every attempt at its deadline plus every backoff."""
        per_attempt = self.connect_timeout_s + (read_timeout_s or self.read_timeout_s)
        backoff = sum(min(self.backoff_s * 2**k, self.max_backoff_s) for k in range(self.max_retries))
        return (self.max_retries + 1) * per_attempt + backoff

    def _timeouts(self, read_s: float) -> aiohttp.ClientTimeout:
        """``connect``: the wait for a pooled connection and the TCP connect; ``sock_read``: any gap in the answer
        (with a non-streamed completion, the whole generation). The per-attempt deadline bounds the rest."""
        c = self.connect_timeout_s
        return aiohttp.ClientTimeout(total=None, connect=c, sock_connect=c, sock_read=read_s, ceil_threshold=c + read_s)

    def _session(self, generation: bool) -> aiohttp.ClientSession:
        """The running loop's session for a generation route (``generation``) or any other; both made at first use."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._http is None or self._control is None:
            self._loop = loop  # a new loop (or the first): sessions of a closed loop are dropped, not reused

            def session(connections: int) -> aiohttp.ClientSession:
                return aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=connections, keepalive_timeout=KEEPALIVE_S),
                    headers=self._headers,
                    timeout=self._timeout,
                    cookie_jar=aiohttp.DummyCookieJar(),
                    json_serialize_bytes=msgspec.json.encode,
                )

            self._http, self._control = session(GENERATION_CONNECTIONS), session(CONTROL_CONNECTIONS)
        return self._http if generation else self._control

    async def _request(
        self,
        method: str,
        route: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        read_timeout_s: float | None = None,
        retries: int | None = None,
    ) -> Reply:
        read = read_timeout_s or self.read_timeout_s
        timeout = self._timeout if read == self.read_timeout_s else self._timeouts(read)
        deadline = self.connect_timeout_s + read
        attempts = (self.max_retries if retries is None else retries) + 1
        http = self._session(route in GENERATION_ROUTES)
        url = self.base_url + route

        async def attempt() -> Reply:
            async with asyncio.timeout(deadline):
                async with http.request(method, url, json=json, params=params, timeout=timeout) as response:
                    r = Reply(response.status, await response.read())
            if r.status_code in RETRY_STATUS:
                raise _RetryableStatus(r)
            return r

        n = 0
        with progress.recorder.call("inference", f"{method} {route}"):
            try:
                async for a in AsyncRetrying(
                    stop=stop_after_attempt(attempts),
                    wait=wait_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
                    retry=retry_if_exception(lambda e: isinstance(e, _RETRIED)),
                    reraise=True,
                ):
                    with a:
                        n += 1
                        r = await attempt()
            except _RETRIED as e:
                raise InferenceError(
                    f"{method} {self.base_url}{route}: {_describe(e, self.connect_timeout_s, read)} after {n} attempt(s)"
                ) from e
            except aiohttp.ClientError as e:  # e.g. invalid URL: not retried
                raise InferenceError(f"{method} {self.base_url}{route}: {_describe(e)}") from e
        if r.status_code >= 400:
            raise InferenceError(f"{method} {self.base_url}{route}: HTTP {r.status_code}: {r.text[:300]!r}")
        return r

    async def aclose(self) -> None:
        """Close both sessions (their connections); a later request opens new ones."""
        sessions = [x for x in (self._http, self._control) if x is not None]
        self._http = self._control = self._loop = None
        for x in sessions:
            await x.close()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        prompt_ids: list[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> list[Completion]:
        """Sample ``n`` completions of the token-id prompt ``prompt_ids``.

        Returns, per completion, the sampled token ids and their logprobs exactly as vLLM computed them
        (``--logprobs-mode processed_logprobs``: after temperature and top-p), never re-tokenized.
        """
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": -1,
            "min_p": 0.0,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if self.model is not None:
            body["model"] = self.model
        if seed is not None:
            body["seed"] = seed
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        route = "/v1/completions"
        content = (await self._request("POST", route, json=body)).content
        try:  # msgspec decodes only the fields used (a 16-sample answer: ~5x faster than json + dict walking)
            out = []
            for c in sorted(_COMPLETIONS.decode(content).choices, key=lambda c: c.index):
                ids, lps = c.token_ids, c.logprobs.token_logprobs
                if len(ids) != len(lps):
                    raise ValueError(f"{len(ids)} token ids but {len(lps)} logprobs")
                out.append(Completion(token_ids=ids, logprobs=lps, finish_reason=c.finish_reason or ""))
        except (msgspec.DecodeError, ValueError) as e:
            raise InferenceError(f"POST {self.base_url}{route}: unexpected response ({e!r})") from e
        return out

    async def prompt_logprobs(self, token_ids: list[int], start: int) -> list[float]:
        """The served policy's log-probs of ``token_ids[start:]``, each given the tokens before it, at temperature 1
        (vLLM's ``prompt_logprobs``: log_softmax of the raw logits; ``max_tokens`` 1, the sampled token ignored).
        Names ``self.model`` (a LoRA run's current adapter) when set.

        Returns:
            ``len(token_ids) - start`` floats (nats), for ``1 <= start < len(token_ids)``.

        Raises:
            InferenceError: the request failed, or the answer has no log-prob for a token.
        """
        body: dict[str, Any] = {"prompt": list(token_ids), "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        if self.model is not None:
            body["model"] = self.model
        route = "/v1/completions"
        data = (await self._request("POST", route, json=body)).json()
        try:
            rows = data["choices"][0]["prompt_logprobs"]  # [None, {str(id): {"logprob": ...}, ...}, ...] per token
            return [float(rows[i][str(token_ids[i])]["logprob"]) for i in range(start, len(token_ids))]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise InferenceError(f"POST {self.base_url}{route}: unexpected prompt_logprobs ({e!r})") from e

    # ------------------------------------------------------------------ weight updates
    async def pause(self, mode: Literal["keep", "wait", "abort"] = "keep", *, clear_cache: bool = False) -> None:
        """Stop scheduling. ``keep`` (default) freezes in-flight requests; they continue after resume.

        ``clear_cache``: vLLM also resets its caches once the engine stopped (its default). Off here: a weight update
        resets the prefix cache after the load (:meth:`publish_weights`), so that reset was done twice. Without it the
        bench's pause with 128 sequences decoding went from 0.29 s to 0.19 s median (0.6B shape, H100,
        ``benchmarks/results/gpu_weight_update.json``); the async RL loop's pause stayed near 0.28 s, most of it spent
        while vLLM serves the decoding batch, not in the reset (``docs/gpu.md``).
        """
        await self._request("POST", "/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    @asynccontextmanager
    async def paused(self, mode: Literal["keep", "wait", "abort"] = "keep") -> AsyncIterator[None]:
        """``pause(mode)`` on entry, ``resume()`` on exit, also when the pause itself failed: a pause that timed out
        on this side (read timeout) may have paused the server, which would then stay paused for every client of it.

        Raises:
            InferenceError: the pause or the body failed (that error, with the resume's failure, if any, as a note),
                or only the resume failed.
        """
        try:
            await self.pause(mode)
            yield
        except BaseException as err:
            try:
                await self.resume()
            except InferenceError as resume_err:
                err.add_note(f"and the resume after it failed: {resume_err}")
            raise
        await self.resume()

    async def is_paused(self) -> bool:
        return bool((await self._request("GET", "/is_paused")).json()["is_paused"])

    async def resume_if_left_paused(self, grace_s: float = 30.0, poll_s: float = 0.5) -> bool:
        """Resume a server that stays paused for ``grace_s`` seconds; True when this call resumed it.

        A client killed between its pause and its resume (kill -9 of an orchestrator mid weight update) leaves
        the server paused, and every request to it then waits forever. A weight update pauses for well under a
        second on the sizes measured here (``weight_update_s``), so a pause that outlives ``grace_s`` has no owner.

        Raises:
            InferenceError: ``/is_paused`` or ``/resume`` failed.
        """
        deadline = time.monotonic() + grace_s
        while await self.is_paused():
            if time.monotonic() >= deadline:
                await self.resume()
                return True
            await asyncio.sleep(poll_s)
        return False

    async def update_weights(self, path: str | Path, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Load every ``*.safetensors`` in directory ``path`` (as seen by the server) into the running model.

        Returns the worker's reply (tensor count, seconds, whether the tied lm_head was re-packed).
        """
        route = "/collective_rpc"
        body = {"method": "update_weights_from_path", "args": [str(path)]}
        r = await self._request("POST", route, json=body, read_timeout_s=timeout_s)
        try:
            return r.json()["results"][0]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise InferenceError(f"POST {self.base_url}{route}: unexpected response {r.text[:200]!r}") from e

    async def load_lora_adapter(self, name: str, path: str | Path) -> dict[str, Any]:
        """Load the PEFT adapter in directory ``path`` (as seen by the server) under model name ``name``
        (vLLM's ``/v1/load_lora_adapter``; the server runs with ``--enable-lora`` and
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). Requests naming ``name`` as their ``model`` then sample under it.
        Idempotent: the request sets ``load_inplace`` (vLLM's ``LoadLoRAAdapterRequest``; without it a second load of a
        name is a 400 "has already been loaded"), so a retried POST, or a resumed run whose server still holds the
        name, replaces the adapter instead of failing. Returns ``{"adapter": name, "seconds": ...}``.

        Raises:
            InferenceError: the server refused it (e.g. a rank above ``--max-lora-rank``, a bad adapter folder).
        """
        t0 = time.monotonic()
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}
        try:
            await self._request("POST", "/v1/load_lora_adapter", json=body)
        except InferenceError as e:  # vLLM's message hides the path (<path>): say which adapter it was
            raise InferenceError(f"LoRA adapter {name} from {path} not loaded: {e}") from e
        return {"adapter": name, "seconds": time.monotonic() - t0}

    async def unload_lora_adapter(self, name: str) -> None:
        """Remove adapter ``name`` from the server (``/v1/unload_lora_adapter``).

        Raises:
            InferenceError: the server refused it (e.g. no adapter of that name).
        """
        await self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    async def collective_rpc(self, method: str, args: list[Any], *, timeout_s: float | None = None) -> dict[str, Any]:
        """Call ``method(*args)`` of the worker extension on every vLLM worker; the first worker's reply.

        Never retried (a repeated collective call would wait for peers that already left).
        """
        route = "/collective_rpc"
        r = await self._request(
            "POST", route, json={"method": method, "args": args}, read_timeout_s=timeout_s, retries=0
        )
        try:
            return r.json()["results"][0]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise InferenceError(f"POST {self.base_url}{route}: unexpected response {r.text[:200]!r}") from e

    async def reset_prefix_cache(self, *, reset_running_requests: bool = True) -> bool:
        """Drop cached KV blocks computed with old weights.

        With ``reset_running_requests`` (default) requests frozen by ``pause("keep")`` are preempted and
        recomputed with the new weights when generation resumes; otherwise the reset fails (returns
        False) while any request holds KV blocks.
        """
        r = await self._request(
            "POST",
            "/reset_prefix_cache",
            params={"reset_running_requests": str(reset_running_requests).lower()},
        )
        return bool(r.json().get("success", False))

    async def publish_weights(
        self, path: str | Path, load: Callable[[Path], Awaitable[dict[str, Any]]] | None = None
    ) -> dict[str, Any]:
        """pause(keep) → update_weights (or ``await load(path)``) → reset_prefix_cache → resume (:meth:`paused`: resume
        also on failure, the pause's included).

        Returns the load's reply plus the wall seconds of each part as this client saw them: ``pause_s`` (until the
        engine stopped: it finishes the step it is in first), ``load_s``, ``reset_s``, ``resume_s`` and ``total_s``.
        """
        t0 = time.monotonic()
        async with self.paused("keep"):  # resumed also when the pause timed out here after the server paused
            t_paused = time.monotonic()
            info = await (load(Path(path)) if load is not None else self.update_weights(path))
            t_loaded = time.monotonic()
            if not await self.reset_prefix_cache():
                raise InferenceError(f"POST {self.base_url}/reset_prefix_cache: server reported success=false")
            t_reset = time.monotonic()
        t_end = time.monotonic()
        parts = {
            "pause_s": t_paused - t0,
            "load_s": t_loaded - t_paused,
            "reset_s": t_reset - t_loaded,
            "resume_s": t_end - t_reset,
        }
        return {**info, **parts, "total_s": t_end - t0}

    # ------------------------------------------------------------------ liveness
    async def served_model(self) -> str:
        """Name (``--model`` path or HF name) of the model the server serves, from ``/v1/models``."""
        r = await self._request("GET", "/v1/models")
        try:
            return str(r.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise InferenceError(f"GET {self.base_url}/v1/models: unexpected response {r.text[:200]!r}") from e

    async def health(self) -> bool:
        """True when ``/health`` answers 200 within the connect timeout; never raises for network errors."""
        timeout = aiohttp.ClientTimeout(total=self.connect_timeout_s)
        try:
            async with self._session(False).get(self.base_url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def prometheus_text(self) -> str:
        """The server's own Prometheus metrics (``GET /metrics``, text format), in one attempt bounded by the connect
        timeout plus 5 s; not a progress call (a scrape is no work the run waits on).

        Raises:
            InferenceError: no answer, or an answer other than 200.
        """
        timeout = aiohttp.ClientTimeout(total=self.connect_timeout_s + 5.0)
        try:
            async with self._session(False).get(self.base_url + "/metrics", timeout=timeout) as r:
                body = await r.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise InferenceError(f"GET {self.base_url}/metrics: {_describe(e, self.connect_timeout_s, 5.0)}") from e
        if r.status != 200:
            raise InferenceError(f"GET {self.base_url}/metrics: HTTP {r.status}: {body[:200]!r}")
        return body

    async def wait_ready(self, timeout_s: float = 180.0, poll_s: float = 0.5) -> float:
        """Wait until :meth:`health` is True; return seconds waited or raise InferenceError after ``timeout_s``."""
        t0 = time.monotonic()
        while True:
            if await self.health():
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise InferenceError(f"GET {self.base_url}/health: not ready after {timeout_s:.0f}s")
            await asyncio.sleep(poll_s)
