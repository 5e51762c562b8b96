"""Publishing a policy version as files (``worker/weight_sync/publish.py``: ``publish_weights``)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.support.models import tiny_qwen3
from worker.rundir import STABLE_MARKER, RunDir
from worker.weight_sync.publish import publish_weights

# ----------------------------------------------------------------------------- weights


def test_publish_weights_tied(run: RunDir) -> None:
    model = tiny_qwen3(tie=True)
    final = publish_weights(model, run, 1, keep_versions=2)
    assert final == run.weight_dir(1)
    assert sorted(p.name for p in final.iterdir()) == [STABLE_MARKER, "model.safetensors"]
    assert (final / STABLE_MARKER).read_text() == "1"
    weights = load_file(final / "model.safetensors")
    assert "lm_head.weight" not in weights
    assert torch.equal(weights["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert set(weights) == set(model.state_dict()) - {"lm_head.weight"}
    assert run.latest_stable_weights() == (1, final)
    assert not [p for p in run.weights.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_publish_weights_untied_keeps_lm_head(run: RunDir) -> None:
    model = tiny_qwen3(tie=False)
    weights = load_file(publish_weights(model, run, 3, keep_versions=1) / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], model.lm_head.weight)


def test_publish_weights_keeps_newest_versions(run: RunDir) -> None:
    model = tiny_qwen3()
    for v in range(1, 6):
        publish_weights(model, run, v, keep_versions=2)
    assert sorted(p.name for p in run.weights.iterdir()) == ["step_4", "step_5"]
    publish_weights(model, run, 6, keep_versions=3)
    assert sorted(p.name for p in run.weights.iterdir()) == ["step_4", "step_5", "step_6"]
