"""Submit refuses what the launch would (``server.services.launch_checks``): an SFT run's missing, empty or malformed
data file, LoRA targets that match no layer of a local model, ``inference.urls`` that do not answer. Each is one
422 line naming the key, and nothing is added; the same spec with the fault fixed is queued."""

from __future__ import annotations

import http.server
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import BAD_MODEL, SFT_ROW, free_port, sft_data, spec


def run_count(client: Any, auth: dict[str, str]) -> int:
    return int(client.get("/api/runs", params={"limit": 1}, headers=auth).json()["count"])


def refused(client: Any, auth: dict[str, str], body: dict[str, Any]) -> str:
    """The 422 detail of submitting ``body``; asserts nothing was added."""
    before = run_count(client, auth)
    resp = client.post("/api/runs", json=body, headers=auth)
    assert resp.status_code == 422, resp.text
    assert run_count(client, auth) == before
    return str(resp.json()["detail"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.policy.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "base", size="tiny", seed=0)


def test_sft_data_faults_are_refused_at_submit(client: Any, auth: dict[str, str]) -> None:
    root = os.environ["ASYNCRL_OUTPUT_DIR"]
    sft_data()  # the data folder exists: a root this server sees
    missing = f"{root}/data/nope.jsonl"
    assert refused(client, auth, spec(kind="sft", data={"path": missing})) == (
        f"data.path: {missing} does not exist (expected a .jsonl or .parquet file or a datasets folder)"
    )
    empty = sft_data("empty.jsonl", rows=[])
    assert refused(client, auth, spec(kind="sft", data={"path": empty})) == f"data.path: {empty} is empty (no rows)"
    no_assistant = sft_data("no-assistant.jsonl", rows=[SFT_ROW, {"messages": [{"role": "user", "content": "ab"}]}])
    assert refused(client, auth, spec(kind="sft", data={"path": no_assistant})) == (
        "data.path: row 2 has no assistant turn to train on (roles: ['user'])"
    )
    body = spec(kind="sft", data={"path": sft_data(), "eval_path": no_assistant})
    assert refused(client, auth, body) == "data.eval_path: row 2 has no assistant turn to train on (roles: ['user'])"
    resp = client.post("/api/runs", json=spec(kind="sft", data={"path": sft_data()}), headers=auth)
    assert resp.status_code == 201, resp.text


def test_lora_targets_of_a_local_model_are_checked_at_submit(
    client: Any, auth: dict[str, str], model_dir: Path
) -> None:
    leaves = "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"
    body = spec(model={"name": str(model_dir)}, trainer={"lora": {"rank": 4, "target_modules": ["q_prj", "v_proj"]}})
    assert refused(client, auth, body) == (
        f"trainer.lora.target_modules: ['q_prj'] match no linear layer of qwen3 (its linear layers: {leaves})"
    )
    body = spec(kind="sft", model={"name": str(model_dir)}, data={"path": sft_data()}, lora={"target_modules": ["x"]})
    assert refused(client, auth, body) == (
        f"lora.target_modules: ['x'] match no linear layer of qwen3 (its linear layers: {leaves})"
    )
    body = spec(model={"name": str(model_dir)}, trainer={"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}})
    resp = client.post("/api/runs", json=body, headers=auth)
    assert resp.status_code == 201, resp.text


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def healthy() -> Iterator[str]:
    """A server that answers ``GET /health`` with 200: its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent() -> Iterator[str]:
    """A server that accepts connections and never answers: its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.mark.timing  # the whole submit within 3 s: it took 4.7 s beside pass 1's 4 processes and the fuzz
def test_dead_inference_urls_are_refused_at_submit_within_2_s(
    client: Any, auth: dict[str, str], healthy: str, silent: str
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    for urls, bad in (([healthy, dead], 1), ([silent, healthy, dead], 0)):
        t0 = time.monotonic()
        detail = refused(client, auth, spec(inference={"urls": urls}))
        assert time.monotonic() - t0 < 3.0  # one 2 s deadline for all servers, plus the request
        assert detail == f"inference.urls.{bad}: {urls[bad]} does not answer GET /health within 2 s"
    resp = client.post("/api/runs", json=spec(inference={"urls": [healthy]}), headers=auth)
    assert resp.status_code == 201, resp.text


def test_launch_page_and_asyncrl_submit_refuse_a_dead_inference_url(
    web: tuple[Any, str], live_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dashboard's Launch page marks the key's line; ``asyncrl submit`` prints the 422 line and exits 2."""
    from worker.cli import main

    dead = f"http://127.0.0.1:{free_port()}"
    text = f'name = "dead-url"\nmax_steps = 3\n[model]\nname = "{BAD_MODEL}"\n[inference]\nurls = ["{dead}"]\n'
    client, csrf = web
    resp = client.post("/launch", data={"csrf": csrf, "spec": text})
    line = f"inference.urls.0: {dead} does not answer GET /health within 2 s"
    assert resp.status_code == 422 and f'id="spec-error">{line}' in resp.text, resp.text
    (tmp_path / "rl.toml").write_text(text)
    code = main(["token", "create", "--name", "submit-dead-url"])
    token = capsys.readouterr().out.strip()
    assert code == 0
    code = main(["submit", str(tmp_path / "rl.toml"), "--url", live_server, "--token", token])
    assert (code, capsys.readouterr().err.strip()) == (2, f"error: 422: {line}")
