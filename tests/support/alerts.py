"""Helpers of the alert tests: a real HTTP webhook receiver on 127.0.0.1, runs without a launch, metric posts."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.server import free_port, run_token_headers, spec, wait_for


@dataclass
class Received:
    time: float
    key: str
    signature: str
    body: bytes


@dataclass
class Receiver:
    """A threaded HTTP server recording every POST. It answers the codes queued in ``codes`` first (then 200),
    sleeps ``delays`` (one per request, in order) before answering, and keeps one body per ``Idempotency-Key``
    (``bodies``): a repeated key is answered 200 and not recorded again, as a deduplicating receiver does."""

    port: int = field(default_factory=free_port)
    codes: list[int] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)
    requests: list[Received] = field(default_factory=list)
    bodies: dict[str, bytes] = field(default_factory=dict)
    arrived: threading.Event = field(default_factory=threading.Event)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                key = self.headers.get("Idempotency-Key", "")
                receiver.requests.append(
                    Received(time.monotonic(), key, self.headers.get("X-Asyncrl-Signature", ""), body)
                )
                receiver.arrived.set()
                if receiver.delays:
                    time.sleep(receiver.delays.pop(0))
                code = 200 if key in receiver.bodies or not receiver.codes else receiver.codes.pop(0)
                if code == 200:
                    receiver.bodies.setdefault(key, body)
                try:
                    self.send_response(code)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:  # the sender is gone (killed mid-request)
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Close the listening socket: connections are refused until ``start`` again."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def signed_ok(secret: str, req: Received, tolerance_s: float = 300) -> bool:
    """Check ``X-Asyncrl-Signature: t=<unix>,v1=<hex hmac-sha256(secret, f"{t}.{body}")>`` independently."""
    fields = dict(part.split("=", 1) for part in req.signature.split(","))
    t = fields["t"]
    expected = hmac.new(secret.encode(), f"{t}.".encode() + req.body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, fields["v1"]) and abs(time.time() - int(t)) < tolerance_s


def new_run(**overrides: Any) -> int:
    """A queued run added through the service with no launch enqueued (alerts only need the row)."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.services import runs

    with Session(engine) as s:
        run = runs.create(s, data=spec(**overrides), owner="test")
        s.commit()
        return int(run.id)  # type: ignore[arg-type]


def post_metrics(client: Any, run_id: int, name: str, values: dict[int, float], source: str = "trainer") -> None:
    """Post ``{step: value}`` of one metric through the real ingest API with the run's token."""
    points = [{"source": source, "step": s, "name": name, "value": v, "time": time.time()} for s, v in values.items()]
    resp = client.post(
        f"/api/runs/{run_id}/metrics",
        content=json.dumps({"points": points}),
        headers={**run_token_headers(run_id), "Content-Type": "application/json"},
    )
    assert resp.status_code == 200, resp.text


def alert_events(client: Any, auth: dict[str, str], run_id: int) -> list[tuple[str, str, int | None]]:
    """(kind, state, step) of the run's alert events, oldest first."""
    data = client.get("/api/alerts/events", params={"run_id": run_id}, headers=auth).json()["data"]
    return [(e["kind"], e["state"], e["step"]) for e in reversed(data)]


def deliveries(client: Any, auth: dict[str, str], endpoint_id: int) -> list[dict[str, Any]]:
    """The endpoint's delivery log, oldest first."""
    return list(reversed(client.get(f"/api/webhooks/{endpoint_id}/deliveries", headers=auth).json()["data"]))


def fire_once(client: Any, auth: dict[str, str]) -> int:
    """A run whose ``loss > 1`` rule fires at step 1."""
    run_id = new_run()
    resp = client.post(
        f"/api/runs/{run_id}/alerts/rules",
        headers=auth,
        json={"kind": "threshold", "metric": "loss", "op": ">", "value": 1.0},
    )
    assert resp.status_code == 201, resp.text
    post_metrics(client, run_id, "loss", {1: 5.0})
    return run_id


def delivered(client: Any, auth: dict[str, str], endpoint_id: int, n: int, timeout: float = 60) -> list[dict[str, Any]]:
    return list(
        wait_for(
            lambda: (
                (d := deliveries(client, auth, endpoint_id))
                and len(d) == n
                and all(x["status"] == "delivered" for x in d)
                and d
            ),
            timeout,
            f"{n} delivered",
        )
    )
