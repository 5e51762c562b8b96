"""Whether the job broker answers and a worker on the control-plane queue answered lately, for ``/healthz``.

A worker consuming ``CELERY_QUEUE`` writes a heartbeat into the broker every ``WORKER_HEARTBEAT_S`` from its
consumer's timer (:class:`Heartbeat`, a Celery consumer step), so a beat means the loop that takes tasks runs and
reaches the broker:

- Redis: the key ``asyncrl:heartbeat:<CELERY_QUEUE>`` holding the worker's name, expiring after
  ``3 * WORKER_HEARTBEAT_S``; the key exists while a worker beat within that window.
- the embedded broker: the file ``.heartbeat-<CELERY_QUEUE>`` in its folder (the consumer never takes it: not
  a ``.msg`` file), fresh while its modification time is within the window.

The server reads it with one request (:func:`probe`): a ``GET`` with 0.5 s connect and read timeouts and no retry,
so ``/healthz`` answers within about a second even with Redis gone. What it reports names the broker's kind, host
and port, never its URL (no password).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import bootsteps
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from server.core.config import settings

logger = logging.getLogger(__name__)

TIMEOUT_S = 0.5
"""Connect and read timeout of one Redis request of the probe or a beat."""


def stale_s() -> float:
    """A worker that has not beaten for this long does not count (three beats missed)."""
    return 3 * settings.WORKER_HEARTBEAT_S


@dataclasses.dataclass(frozen=True)
class Probe:
    broker: str
    """``redis`` or ``embedded``."""
    broker_problem: str | None
    """One line without the ``broker:`` prefix, e.g. ``redis at 127.0.0.1:6390 does not answer``; None when fine."""
    worker: bool | None
    """A worker beat within :func:`stale_s`; None when the broker did not answer (unknown)."""


def _key() -> str:
    return f"asyncrl:heartbeat:{settings.CELERY_QUEUE}"


def _file() -> Path:
    return settings.ASYNCRL_HOME / "broker" / f".heartbeat-{settings.CELERY_QUEUE}"


@functools.cache
def _client(url: str) -> redis.Redis:
    """One pooled client per broker URL (redis-py reconnects a lost connection on the next request)."""
    return redis.Redis.from_url(
        url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S, retry=Retry(NoBackoff(), 0)
    )


def _redis_at(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"redis at {parts.path}"
    return f"redis at {parts.hostname or 'localhost'}:{parts.port or 6379}"


def probe() -> Probe:
    """Ask the broker for the heartbeat: one ``GET`` (Redis) or one ``stat`` (embedded)."""
    if settings.embedded_broker:
        folder = settings.ASYNCRL_HOME / "broker"
        if not (folder.is_dir() and os.access(folder, os.W_OK)):
            return Probe("embedded", "the embedded broker's folder is missing or not writable", None)
        try:
            age = time.time() - _file().stat().st_mtime
        except FileNotFoundError:
            return Probe("embedded", None, False)
        return Probe("embedded", None, age <= stale_s())
    url = settings.CELERY_BROKER_URL
    try:
        beat = _client(url).get(_key())
    except (RedisError, OSError):
        return Probe("redis", f"{_redis_at(url)} does not answer", None)
    return Probe("redis", None, beat is not None)


def beat(name: str) -> None:
    """Record that worker ``name`` answers now (the worker's side of :func:`probe`)."""
    if settings.embedded_broker:
        path = _file()
        path.write_text(name + "\n")  # rewritten in place: the modification time is the beat
        return
    _client(settings.CELERY_BROKER_URL).set(_key(), name, ex=max(1, round(stale_s())))


class Heartbeat(bootsteps.StartStopStep):
    """A consumer step: beat at start and every ``WORKER_HEARTBEAT_S`` on the consumer's timer, while this worker
    consumes ``CELERY_QUEUE`` (the export worker, on its own queue, does not beat)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.tref: Any = None

    def start(self, parent: Any) -> None:
        if settings.CELERY_QUEUE not in {queue.name for queue in parent.task_consumer.queues}:
            return
        name = parent.hostname
        self._beat(name)
        self.tref = parent.timer.call_repeatedly(settings.WORKER_HEARTBEAT_S, self._beat, (name,))

    def stop(self, parent: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None

    shutdown = stop

    @staticmethod
    def _beat(name: str) -> None:
        try:
            beat(name)
        except (RedisError, OSError) as err:  # the broker is down: no beat is the report; keep the timer
            logger.warning("heartbeat not written: %s", " ".join(str(err).split()) or type(err).__name__)
