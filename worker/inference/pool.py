"""Several inference servers (replicas) behind one orchestrator: routing, policy-version publishing, loss and return.

A run with ``inference.replicas = N > 1`` (the launcher starts N servers) or ``inference.urls`` (N running servers)
gives its orchestrator one :class:`ReplicaPool` of N :class:`Replica` (one :class:`InferenceClient` each):

- **routing**: a unit of work (one rollout group: one request with ``n = group_size``, or every turn of a multi-turn
  rollout, so its prefix stays in one server's cache) is leased to the healthy replica with the fewest outstanding
  leases (least outstanding requests; ties: the lowest index);
- **versions**: :meth:`ReplicaPool.publish` publishes a policy version to every healthy replica in parallel
  (pause -> load -> reset prefix cache -> resume on each: ``InferenceClient.publish_weights``); from its start no
  work is leased to a replica until that replica has acked the version (its load returned), so no rollout starts on
  weights older than the newest published;
- **loss**: a replica whose request fails and whose ``/health`` does not answer is dropped (an ``inference_replica_lost``
  event naming it, the ``replicas_healthy`` metric) and the work is retried on another replica; the run goes on while
  one replica is left, and fails (:class:`InferenceError`) when none is;
- **return**: :meth:`ReplicaPool.watch` probes dropped replicas; one that answers again loads the current version first
  and is then taken back (an ``inference_replica_back`` event).

Per-replica counters (:meth:`ReplicaPool.metrics`): ``requests_in_flight/r<i>``, ``rollout_groups/r<i>`` (work units
served), ``tokens_per_s/r<i>`` (completion tokens over the seconds since the previous report) and
``weight_update_s/r<i>`` (and the served-policy check's ``policy_check_max_abs_diff/r<i>``), logged with the run's
``inference`` metrics (``worker.tracking.alert_rules.PER_REPLICA_METRICS``). A single server (``replicas = 1``) never
uses this module: the orchestrator talks to its one client as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from worker.inference.client import InferenceClient, InferenceError
from worker.run.rundir import RunDir

T = TypeVar("T")
logger = logging.getLogger("asyncrl.inference.pool")

HEALTH_MISSES = 2
"""Unanswered ``/health`` probes in a row (each waits ``inference.connect_timeout_s``) that drop a replica: one slow
answer of a busy CPU server is not a loss."""

Loader = Callable[[InferenceClient], Callable[[Path], Awaitable[dict[str, Any]]] | None]
"""Given a replica's client, the ``load`` of ``InferenceClient.publish_weights`` for it (None: update weights by path)."""


@dataclass
class Replica:
    """One inference server of the pool and its counters."""

    index: int
    client: InferenceClient
    version: int | None = None
    """The policy version this replica acked last (None: none since it joined or came back)."""
    healthy: bool = True
    in_flight: int = 0
    """Work units leased to it now."""
    served: int = 0
    """Work units it completed."""
    tokens: int = 0
    """Completion tokens it generated (counted by the caller: :meth:`ReplicaPool.count_tokens`)."""
    weight_update_s: float | None = None
    """Wall seconds of its last publish (pause to resume)."""
    misses: int = 0
    """``/health`` probes of :meth:`ReplicaPool.watch` in a row it did not answer."""
    acked: list[int] = field(default_factory=list)
    """Every policy version it acked, in order (a version it loaded again on its return: once more)."""
    _tokens_reported: int = field(default=0, repr=False)
    _reported_at: float = field(default_factory=time.monotonic, repr=False)

    @property
    def name(self) -> str:
        return f"r{self.index}"

    @property
    def url(self) -> str:
        return self.client.base_url


class ReplicaPool:
    """N inference servers behind one orchestrator (see the module docstring).

    Args:
        clients: one client per server, index order = replica order (N >= 1).
        run: where ``inference_replica_lost`` / ``inference_replica_back`` events are written.
        version: the policy version every replica serves at the start (the run's start step).
        health_interval_s: seconds between the health probes of :meth:`watch`.
    """

    def __init__(
        self, clients: Sequence[InferenceClient], run: RunDir, *, version: int = 0, health_interval_s: float = 1.0
    ) -> None:
        if not clients:
            raise ValueError("clients: expected at least one inference client")
        self.replicas = [Replica(i, c, version=version) for i, c in enumerate(clients)]
        self.run = run
        self.version = version
        """The newest policy version being published (or published): work is leased only to replicas that acked it."""
        self.health_interval_s = health_interval_s
        self._changed = asyncio.Condition()
        self._path: Path | None = None
        self._loader: Loader | None = None
        self._publishing = asyncio.Lock()

    # ------------------------------------------------------------------ state

    @property
    def model(self) -> str | None:
        return self.replicas[0].client.model

    @model.setter
    def model(self, value: str | None) -> None:
        for r in self.replicas:
            r.client.model = value

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def _ready(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r.version == self.version]

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def drop(self, replica: Replica, reason: str) -> None:
        """Take ``replica`` out of routing: an ``inference_replica_lost`` event naming it (index and URL).

        Raises:
            InferenceError: no healthy replica is left (the run cannot go on).
        """
        if replica.healthy:
            replica.healthy = False
            replica.version = None  # it loads the current version before it is taken back
            left = len(self.healthy())
            msg = (
                f"inference replica {replica.name} ({replica.url}) lost: {reason}; {left} of {len(self.replicas)} left"
            )
            logger.warning("%s", msg)
            self.run.log_event(
                "inference_replica_lost",
                process="orchestrator",
                replica=replica.index,
                url=replica.url,
                replicas_healthy=left,
                reason=msg,
            )
            await self._notify()
        if not self.healthy():
            raise InferenceError(f"every inference replica is lost (last: {replica.name} at {replica.url}: {reason})")

    # ------------------------------------------------------------------ routing

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[Replica]:
        """The healthy replica that acked the current version with the fewest outstanding leases (waits for one).

        Raises:
            InferenceError: no healthy replica is left.
        """
        async with self._changed:
            while not self._ready():
                if not self.healthy():
                    raise InferenceError("every inference replica is lost")
                await self._changed.wait()
            replica = min(self._ready(), key=lambda r: (r.in_flight, r.index))
            replica.in_flight += 1
        try:
            yield replica
        finally:
            replica.in_flight -= 1

    async def run_on(self, work: Callable[[Replica], Awaitable[T]]) -> T:
        """``await work(replica)`` on a leased replica; when it fails with :class:`InferenceError` and the replica's
        ``/health`` does not answer, the replica is dropped and ``work`` is run again on another one.

        Raises:
            InferenceError: the work failed on a replica that is still healthy (a real error, e.g. HTTP 400), or every
                replica is lost.
        """
        while True:
            async with self.lease() as replica:
                try:
                    result = await work(replica)
                except InferenceError as err:
                    if await replica.client.health():
                        raise
                    await self.drop(replica, str(err))
                    continue
                replica.served += 1
                return result

    @staticmethod
    def count_tokens(replica: Replica, tokens: int) -> None:
        """Add ``tokens`` completion tokens to ``replica``'s count (its ``tokens_per_s``)."""
        replica.tokens += tokens

    # ------------------------------------------------------------------ versions

    async def publish(self, path: Path, version: int, loader: Loader) -> dict[str, Any]:
        """Publish policy version ``version`` (weights folder ``path``) to every healthy replica in parallel; from the
        start no work is leased to a replica before it acked ``version``. A replica that fails and does not answer
        ``/health`` is dropped; the others go on.

        Returns:
            The first acked replica's load reply with ``total_s`` = the wall seconds until every replica acked, and
            ``acked`` = the indices of the replicas that acked.

        Raises:
            InferenceError: a healthy replica refused the load, or no replica is left.
        """
        async with self._publishing:
            self._path, self._loader = path, loader
            self.version = version
            t0 = time.monotonic()
            targets = self.healthy()
            results = await asyncio.gather(*(self._publish_one(r, path, version, loader) for r in targets))
            acked = [r.index for r, info in zip(targets, results, strict=True) if info is not None]
            if not acked:
                raise InferenceError(f"policy version {version}: no inference replica acked it")
            first = next(info for info in results if info is not None)
            return {**first, "total_s": time.monotonic() - t0, "acked": acked}

    async def _publish_one(self, replica: Replica, path: Path, version: int, loader: Loader) -> dict[str, Any] | None:
        try:
            info = await replica.client.publish_weights(path, load=loader(replica.client))
        except InferenceError as err:
            if await replica.client.health():
                raise
            await self.drop(replica, f"publishing policy version {version}: {err}")
            return None
        replica.weight_update_s = float(info["total_s"])
        replica.version = version
        replica.acked.append(version)
        await self._notify()
        return info

    async def watch(self) -> None:
        """Forever: probe every replica's ``/health`` each ``health_interval_s``; drop a healthy one that does not
        answer; take back a dropped one that answers, after it loaded the current version (an
        ``inference_replica_back`` event)."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            for replica in self.replicas:
                answers = await replica.client.health()
                replica.misses = 0 if answers else replica.misses + 1
                if replica.healthy and replica.misses >= HEALTH_MISSES:
                    await self.drop(replica, f"GET /health did not answer {HEALTH_MISSES} probes in a row")
                elif not replica.healthy and answers:
                    await self._take_back(replica)

    async def _take_back(self, replica: Replica) -> None:
        async with self._publishing:
            try:
                if self._path is not None and self._loader is not None:
                    info = await replica.client.publish_weights(self._path, load=self._loader(replica.client))
                    replica.weight_update_s = float(info["total_s"])
            except InferenceError as err:
                logger.warning(
                    "inference replica %s answers but did not load version %d: %s", replica.name, self.version, err
                )
                return
            replica.version, replica.healthy = self.version, True
            replica.acked.append(self.version)
        msg = f"inference replica {replica.name} ({replica.url}) is back at policy version {self.version}"
        logger.info("%s", msg)
        self.run.log_event(
            "inference_replica_back", process="orchestrator", replica=replica.index, url=replica.url, reason=msg
        )
        await self._notify()

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, float | int | None]:
        """Per-replica metrics now (``<name>/r<i>``: ``worker.tracking.alert_rules.PER_REPLICA_METRICS``) and
        ``replicas_healthy``; ``tokens_per_s`` counts the completion tokens since the previous call."""
        now = time.monotonic()
        out: dict[str, float | int | None] = {"replicas_healthy": len(self.healthy())}
        for r in self.replicas:
            elapsed = now - r._reported_at
            out[f"requests_in_flight/{r.name}"] = r.in_flight
            out[f"rollout_groups/{r.name}"] = r.served
            out[f"tokens_per_s/{r.name}"] = (r.tokens - r._tokens_reported) / elapsed if elapsed > 0 else 0.0
            out[f"weight_update_s/{r.name}"] = r.weight_update_s
            r._tokens_reported, r._reported_at = r.tokens, now
        return out

    def summary(self) -> list[dict[str, Any]]:
        """Each replica's index, URL, health, work units served, completion tokens and acked versions."""
        return [
            {
                "replica": r.index,
                "url": r.url,
                "healthy": r.healthy,
                "rollout_groups": r.served,
                "tokens": r.tokens,
                "acked": list(r.acked),
            }
            for r in self.replicas
        ]

    async def aclose(self) -> None:
        for r in self.replicas:
            await r.client.aclose()
