"""Publishing a policy version as files (``worker/weight_sync/publish.py``: ``publish_weights``), also on a full disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.models import tiny_qwen3
from tests.support.tmpfs import fill, free_bytes
from worker.run.rundir import STABLE_MARKER, DiskFull, RunDir, human_bytes
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


def test_publish_weights_on_a_full_disk_leaves_no_half_written_version(disk: Path) -> None:
    run = RunDir(disk / "run")
    run.create()
    model = tiny_qwen3()
    first = publish_weights(model, run, 1, keep_versions=3)
    fill(disk, leave=200 * 1024)  # less than one version (0.4 MiB)
    free = free_bytes(disk)
    with pytest.raises(DiskFull) as info:
        publish_weights(model, run, 2, keep_versions=3)
    # safetensors removes its own half-written file: what stays free is what did not suffice
    assert str(info.value) == (
        f"disk full while writing policy version 2 at {run.weight_dir(2)} (free {human_bytes(free)} of 4.0 MiB)"
    )
    assert sorted(p.name for p in run.weights.iterdir()) == ["step_1"]  # no step_2, no temporary folder
    assert free_bytes(disk) == free
    assert run.latest_stable_weights() == (1, first)
    weights = load_file(first / "model.safetensors")
    assert torch.equal(weights["model.embed_tokens.weight"], model.model.embed_tokens.weight)
