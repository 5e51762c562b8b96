"""The simulated OpenAI-compatible inference server of the benchmarks (``benchmarks/sim_inference.py``) as an ASGI app
for tests: vLLM's answer shapes (token ids, logprobs) with configured latencies and lengths, no model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

SIM = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_inference.py"


def sim_app(**config: Any) -> Any:
    """The simulated server's app for ``SimConfig(**config)`` (e.g. ``ttft_ms``, ``per_token_ms``, ``len_mean``)."""
    spec = importlib.util.spec_from_file_location("sim_inference", SIM)
    assert spec is not None and spec.loader is not None
    sim = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sim  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(sim)
    return sim.make_app(sim.SimConfig(**config))
