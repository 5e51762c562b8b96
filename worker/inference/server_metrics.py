"""vLLM's own metrics of a run's inference servers: why rollouts are slow, as the run's ``vllm`` metrics.

While a run runs, its orchestrator reads every inference server's Prometheus endpoint (``GET /metrics``, with the
run's API key) every :data:`SAMPLE_INTERVAL_S` seconds (:class:`ServerMetricsSampler`) and logs, with each step, the
source ``vllm`` at the orchestrator's step, computed over the samples taken since the previous step:

| name | unit | vLLM series (older name) | per step |
|---|---|---|---|
| ``kv_cache_usage`` | fraction 0-1 | ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc``) | highest sample |
| ``requests_running`` | requests | ``vllm:num_requests_running`` | highest sample |
| ``requests_waiting`` | requests | ``vllm:num_requests_waiting`` | highest sample |
| ``preemptions`` | requests | ``vllm:num_preemptions_total`` (``vllm:num_preemptions``) | increase over the step |
| ``prefix_cache_hit_rate`` | fraction 0-1 | ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (``vllm:gpu_prefix_cache_*``) | hits / queries over the step; null when none |

The highest sample, not the mean: a KV cache that was full or a queue that formed at any moment of the step is what
slowed it. A step that took no sample of its own (shorter than the interval) repeats the newest sample's gauges. With
several inference replicas each sample adds the servers up first (``kv_cache_usage``: the fullest server's;
``requests_*``: the sum over servers), and each replica's own values are logged as ``<name>/r<i>`` (the gauges and
``preemptions``; ``worker.tracking.alert_rules.PER_REPLICA_METRICS``). Counters count from each server's first sample
in this process (a shared server's earlier traffic is not the run's).

A sample never fails the run: a server that does not answer, answers an error, or exports no KV-cache gauge (started
with ``--disable-log-stats``) is warned about once and left out of that sample; with no sample at all the step logs no
``vllm`` row. On a server shared by several runs (``inference.url``) the gauges are the server's, other runs' requests
included.

Only the lines of the series above go through ``prometheus_client``'s text parser: vLLM's whole answer (~50 KB,
mostly histograms) took ~50 ms of parse time on the 2-core box, the selected lines ~1 ms.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from worker.inference.client import InferenceClient

logger = logging.getLogger("asyncrl.inference.server_metrics")

SAMPLE_INTERVAL_S = 1.0
"""Seconds between two samples of every server (one ~50 KB answer each, built by vLLM's API server)."""
KV_CACHE_USAGE = "kv_cache_usage"
REQUESTS_RUNNING = "requests_running"
REQUESTS_WAITING = "requests_waiting"
PREEMPTIONS = "preemptions"
PREFIX_CACHE_HIT_RATE = "prefix_cache_hit_rate"
METRICS = (KV_CACHE_USAGE, REQUESTS_RUNNING, REQUESTS_WAITING, PREEMPTIONS, PREFIX_CACHE_HIT_RATE)
"""Every name this module logs, as the source ``vllm`` (``worker.tracking.alert_rules.METRICS``)."""
PER_REPLICA = (KV_CACHE_USAGE, REQUESTS_RUNNING, REQUESTS_WAITING, PREEMPTIONS)
"""The names also logged per replica, as ``<name>/r<i>``, by a run of several inference servers."""

SERIES: dict[str, tuple[str, ...]] = {
    KV_CACHE_USAGE: ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    REQUESTS_RUNNING: ("vllm:num_requests_running",),
    REQUESTS_WAITING: ("vllm:num_requests_waiting",),
    PREEMPTIONS: ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
}
"""Field of :class:`Reading` -> the vLLM sample names it is read from, newest vLLM's first (the first one present
wins)."""
_LINE_STARTS = tuple(f"{name}{c}" for names in SERIES.values() for name in names for c in "{ ")


@dataclass(frozen=True)
class Reading:
    """One sample of one server: gauges now, counters since the server started. Several engines of one server
    (data parallel: label ``engine``) add up; ``kv_cache_usage`` is the fullest engine's."""

    kv_cache_usage: float
    requests_running: float = 0.0
    requests_waiting: float = 0.0
    preemptions: float = 0.0
    prefix_cache_hits: float = 0.0
    prefix_cache_queries: float = 0.0


def parse(text: str) -> Reading | None:
    """The :class:`Reading` of a vLLM ``/metrics`` answer (Prometheus text format), or None when it holds no KV-cache
    gauge (vLLM's stats are off). A series missing from the answer reads 0.

    Raises:
        ValueError: a selected line is not valid Prometheus text.
    """
    selected = "\n".join(line for line in text.splitlines() if line.startswith(_LINE_STARTS))
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(selected + "\n"):
        for sample in family.samples:
            values.setdefault(sample.name, []).append(sample.value)

    def read(field: str) -> list[float] | None:
        return next((values[name] for name in SERIES[field] if name in values), None)

    kv = read(KV_CACHE_USAGE)
    if kv is None:
        return None
    return Reading(
        kv_cache_usage=max(kv),
        **{field: sum(read(field) or [0.0]) for field in SERIES if field != KV_CACHE_USAGE},
    )


def _increase(new: Reading, old: Reading, field: str) -> float:
    """How much counter ``field`` grew from ``old`` to ``new``; a counter that went down (the server restarted)
    counts from 0."""
    now, before = getattr(new, field), getattr(old, field)
    return float(now - before if now >= before else now)


class ServerMetricsSampler:
    """Samples every server of a run (:meth:`run`, a task of the orchestrator) and gives each step its metrics
    (:meth:`take`); see the module docstring.

    Args:
        clients: one client per inference server, replica order (their API key is sent with each sample).
        interval_s: seconds between two samples.
    """

    def __init__(self, clients: Sequence[InferenceClient], interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.clients = list(clients)
        self.interval_s = interval_s
        self._samples: list[list[Reading | None]] = []
        """Samples since the last :meth:`take`: one reading per server (None: not read)."""
        self._newest: list[Reading | None] | None = None
        self._counted: list[Reading | None] = [None] * len(self.clients)
        """Per server, the reading its counters were last counted up to (its first reading at first)."""
        self._warned: set[str] = set()

    async def run(self) -> None:
        """Sample every ``interval_s`` seconds, until cancelled."""
        while True:
            await self.sample()
            await asyncio.sleep(self.interval_s)

    async def sample(self) -> None:
        """Read every server once, together; a sample where no server was read is not kept."""
        readings = list(await asyncio.gather(*(self._read(i, c) for i, c in enumerate(self.clients))))
        if any(r is not None for r in readings):
            self._samples.append(readings)
            self._newest = readings

    async def _read(self, index: int, client: InferenceClient) -> Reading | None:
        try:
            reading = parse(await client.prometheus_text())
        except Exception as e:  # a failed sample never fails the run: warned once, left out
            self._warn_once(client.base_url, f"not read ({type(e).__name__}: {e})")
            return None
        if reading is None:
            self._warn_once(client.base_url, "has no KV-cache gauge (vLLM started with --disable-log-stats?)")
            return None
        if self._counted[index] is None:
            self._counted[index] = reading
        return reading

    def _warn_once(self, url: str, what: str) -> None:
        if url not in self._warned:
            self._warned.add(url)
            logger.warning("vLLM metrics of %s/metrics %s; the run goes on without them", url, what)

    def take(self) -> dict[str, float | int | None]:
        """This step's metrics (module docstring), over the samples since the previous call; {} before any sample."""
        samples = self._samples or ([self._newest] if self._newest is not None else [])
        self._samples = []
        if not samples:
            return {}
        out: dict[str, float | int | None] = {
            KV_CACHE_USAGE: max(max(r.kv_cache_usage for r in s if r is not None) for s in samples),
            REQUESTS_RUNNING: int(max(sum(r.requests_running for r in s if r is not None) for s in samples)),
            REQUESTS_WAITING: int(max(sum(r.requests_waiting for r in s if r is not None) for s in samples)),
        }
        grown = {PREEMPTIONS: 0.0, "prefix_cache_hits": 0.0, "prefix_cache_queries": 0.0}
        per_server: list[float | None] = []
        for i in range(len(self.clients)):
            newest = next((s[i] for s in reversed(samples) if s[i] is not None), None)
            counted = self._counted[i]
            if newest is None or counted is None:
                per_server.append(None)
                continue
            for field in grown:
                grown[field] += _increase(newest, counted, field)
            per_server.append(_increase(newest, counted, PREEMPTIONS))
            self._counted[i] = newest
        out[PREEMPTIONS] = int(grown[PREEMPTIONS])
        queries = grown["prefix_cache_queries"]
        out[PREFIX_CACHE_HIT_RATE] = grown["prefix_cache_hits"] / queries if queries > 0 else None
        if len(self.clients) > 1:
            for i, preempted in enumerate(per_server):
                own = [r for s in samples if (r := s[i]) is not None]  # None: replica i was not read this step
                out[f"{KV_CACHE_USAGE}/r{i}"] = max(r.kv_cache_usage for r in own) if own else None
                out[f"{REQUESTS_RUNNING}/r{i}"] = int(max(r.requests_running for r in own)) if own else None
                out[f"{REQUESTS_WAITING}/r{i}"] = int(max(r.requests_waiting for r in own)) if own else None
                out[f"{PREEMPTIONS}/r{i}"] = None if preempted is None else int(preempted)
        return out
