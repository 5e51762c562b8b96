"""vLLM's model-class facts: looked up once per worker, copied into a run's own HOME, never read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.inference import model_info
from worker.inference.model_info import architectures, cache_root, cached_architectures, seed_run_home, warm

ENTRY = "vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json"


def _entry(folder: Path, arch: str = "Qwen3ForCausalLM", name: str = ENTRY) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps({"hash": "abc", "modelinfo": {"architecture": arch, "supports_pp": True}}))
    return path


def _model(tmp: Path, archs: object) -> Path:
    folder = tmp / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": archs}))
    return folder


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"VLLM_CACHE_ROOT": "/c/v", "XDG_CACHE_HOME": "/x"}, "/c/v"),
        ({"XDG_CACHE_HOME": "/x"}, "/x/vllm"),
        ({"HOME": "/h"}, "~/.cache/vllm"),
        ({"VLLM_CACHE_ROOT": "", "XDG_CACHE_HOME": ""}, "~/.cache/vllm"),
    ],
)
def test_cache_root_is_where_vllm_puts_it(environ: dict[str, str], expected: str) -> None:
    assert cache_root(environ) == Path(expected).expanduser()


def test_architectures_of_a_local_folder_only(tmp_path: Path) -> None:
    assert architectures(str(_model(tmp_path, ["Qwen3ForCausalLM", "../x", 3]))) == ["Qwen3ForCausalLM"]
    assert architectures("Qwen/Qwen3-0.6B") == []
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert architectures(str(tmp_path / "bad")) == []


def test_seed_copies_the_workers_entries_and_no_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker_cache = tmp_path / "worker-cache"
    _entry(worker_cache / "modelinfos")
    secret = tmp_path / "secret"
    secret.write_text("the worker's secret")
    os.symlink(secret, worker_cache / "modelinfos" / "link.json")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(worker_cache))
    warmed: list[list[str]] = []
    monkeypatch.setattr(model_info, "warm", warmed.append)
    home = tmp_path / "run-home"
    home.mkdir()

    assert seed_run_home(home, str(_model(tmp_path, ["Qwen3ForCausalLM"]))) == 1
    copied = home / ".cache" / "vllm" / "modelinfos"
    assert sorted(p.name for p in copied.iterdir()) == [ENTRY]
    assert json.loads((copied / ENTRY).read_text())["modelinfo"]["architecture"] == "Qwen3ForCausalLM"
    assert warmed == []  # the worker had the architecture: no inspection


def test_seed_inspects_a_missing_architecture_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker_cache = tmp_path / "worker-cache"
    _entry(worker_cache / "modelinfos")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(worker_cache))
    warmed: list[list[str]] = []

    def fake_warm(archs: list[str]) -> None:
        warmed.append(archs)
        _entry(worker_cache / "modelinfos", "LlamaForCausalLM", "vllm-model_executor-models-llama-Llama.json")

    monkeypatch.setattr(model_info, "warm", fake_warm)
    home = tmp_path / "run-home"
    assert seed_run_home(home, str(_model(tmp_path, ["LlamaForCausalLM"]))) == 2
    assert warmed == [["LlamaForCausalLM"]]
    assert cached_architectures(home / ".cache" / "vllm" / "modelinfos") == {"Qwen3ForCausalLM", "LlamaForCausalLM"}


def test_seed_with_no_worker_cache_copies_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "none"))
    monkeypatch.setattr(model_info, "warm", lambda archs: None)
    assert seed_run_home(tmp_path / "home", "Qwen/Qwen3-0.6B") == 0
    assert not (tmp_path / "home").exists()


def test_warm_has_vllm_write_the_entry_it_later_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real inspection (vLLM imported in subprocesses, ~20 s): the entry :func:`warm` has vLLM write is the one
    vLLM's registry then reads instead of inspecting again (its inspection subprocess made to fail); an architecture
    vLLM does not know is left out."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    warm(["Qwen3ForCausalLM", "NoSuchForCausalLM"])
    assert cached_architectures(tmp_path / "cache" / "modelinfos") == {"Qwen3ForCausalLM"}
    check = (
        "from vllm.model_executor.models import registry\n"
        "def refuse(fn):\n"
        "    raise SystemExit('inspected again: the cache was not used')\n"
        "registry._run_in_subprocess = refuse\n"
        "print(registry.ModelRegistry.models['Qwen3ForCausalLM'].inspect_model_cls().architecture)\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "Qwen3ForCausalLM"
