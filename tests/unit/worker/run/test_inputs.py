"""What a run starts from in another run's folder is copied into its own home before it starts
(``worker.run.inputs``): the spec it is launched with names the copy, the stored spec is left as it was."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest

from worker.run.inputs import InputCopyError, copy_inputs, other_run_path


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    """``<outputs>/runs`` with run 3's final weights (a folder) and an SFT data file."""
    root = tmp_path / "outputs" / "runs"
    final = root / "3" / "sft" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text('{"model_type": "qwen3"}')
    (final / "model.safetensors").write_bytes(b"weights of run 3")
    (root / "3" / "sft" / "rows.jsonl").write_text('{"prompt": "a"}\n')
    return root


def test_other_run_path_names_the_run_folder_and_the_path_in_it(runs_root: Path, tmp_path: Path) -> None:
    final = str(runs_root / "3" / "sft" / "final")
    assert other_run_path(final, runs_root, 5) == (runs_root / "3", PurePosixPath("sft/final"))
    assert other_run_path(final, runs_root, 3) is None  # its own files
    assert other_run_path(str(runs_root / "3"), runs_root, 5) is None  # a home itself: no run's input
    assert other_run_path(str(tmp_path / "models" / "tiny"), runs_root, 5) is None
    assert other_run_path("Qwen/Qwen3-0.6B", runs_root, 5) is None  # a hub id
    assert other_run_path("", runs_root, 5) is None
    (tmp_path / "alias").symlink_to(runs_root / "3" / "sft")  # judged with links resolved
    assert other_run_path(str(tmp_path / "alias" / "final"), runs_root, 5) == (
        runs_root / "3",
        PurePosixPath("sft/final"),
    )


def test_another_runs_folder_and_file_are_copied_in_and_the_launched_spec_names_the_copies(runs_root: Path) -> None:
    final = runs_root / "3" / "sft" / "final"
    spec = {
        "kind": "sft",
        "model": {"name": str(final), "dtype": "float32"},
        "data": {"path": str(runs_root / "3" / "sft" / "rows.jsonl"), "eval_path": ""},
    }
    home = runs_root / "5"
    launched = copy_inputs(spec, home, run_id=5, runs_root=runs_root, link=False)
    model = home / "inputs" / "model.name" / "final"
    rows = home / "inputs" / "data.path" / "rows.jsonl"
    assert launched == {
        **spec,
        "model": {**spec["model"], "name": str(model)},
        "data": {**spec["data"], "path": str(rows)},
    }
    assert spec["model"]["name"] == str(final)  # the stored spec is not changed
    assert (model / "model.safetensors").read_bytes() == b"weights of run 3"
    assert (model / "model.safetensors").stat().st_ino != (final / "model.safetensors").stat().st_ino
    assert rows.read_text() == '{"prompt": "a"}\n'
    assert sorted(p.name for p in runs_root.iterdir()) == ["3", "5"]  # no staging folder left

    (final / "model.safetensors").write_bytes(b"rewritten later")  # a resumed run reads what its first attempt read
    assert copy_inputs(spec, home, run_id=5, runs_root=runs_root, link=False) == launched
    assert (model / "model.safetensors").read_bytes() == b"weights of run 3"


def test_a_spec_naming_no_other_runs_files_is_launched_as_stored(runs_root: Path, tmp_path: Path) -> None:
    spec = {"kind": "rl", "model": {"name": str(tmp_path / "models" / "tiny")}}
    assert copy_inputs(spec, runs_root / "5", run_id=5, runs_root=runs_root, link=True) == spec
    assert not (runs_root / "5").exists()


def test_a_link_in_the_source_is_refused_naming_the_key(runs_root: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret_key"
    secret.write_text("server secret")
    final = runs_root / "3" / "sft" / "final"
    (final / "tokenizer.json").symlink_to(secret)  # planted by run 3's processes
    spec = {"kind": "rl", "model": {"name": str(final)}}
    with pytest.raises(InputCopyError, match=r"^model\.name: .*final \(run 3's sft/final\) cannot be copied into the "):
        copy_inputs(spec, runs_root / "5", run_id=5, runs_root=runs_root, link=False)
    assert not (runs_root / "5" / "inputs" / "model.name" / "final").exists()
    assert sorted(p.name for p in runs_root.iterdir()) == ["3", "5"]  # the staging folder removed


def test_links_the_run_left_in_its_own_home_are_never_followed(runs_root: Path, tmp_path: Path) -> None:
    """A resumed run's uid owned its home: a link it put where the copy goes is replaced, not written through; an
    ``inputs`` that is a link fails the launch and nothing is written where it points."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    spec = {"kind": "rl", "model": {"name": str(runs_root / "3" / "sft" / "final")}}
    home = runs_root / "5"
    (home / "inputs" / "model.name").mkdir(parents=True)
    (home / "inputs" / "model.name" / "final").symlink_to(elsewhere)
    copy_inputs(spec, home, run_id=5, runs_root=runs_root, link=False)
    copied = home / "inputs" / "model.name" / "final"
    assert not copied.is_symlink() and (copied / "config.json").exists() and os.listdir(elsewhere) == []

    home = runs_root / "6"
    home.mkdir()
    (home / "inputs").symlink_to(elsewhere)
    with pytest.raises(InputCopyError, match=r"^model\.name: "):
        copy_inputs(spec, home, run_id=6, runs_root=runs_root, link=False)
    assert os.listdir(elsewhere) == []


def test_a_link_that_now_leads_to_a_run_the_owner_may_not_use_is_refused_at_the_copy(
    runs_root: Path, tmp_path: Path
) -> None:
    """The launch's owner check ran; then the user's link was turned to run 3's weights. The copy asks again, for
    the run the link leads to now, and copies nothing."""
    mine = tmp_path / "models" / "mine"
    mine.mkdir(parents=True)
    (mine / "config.json").write_text("{}")
    link = tmp_path / "models" / "swap"
    link.symlink_to(mine)  # what the checks saw: a folder outside the run folders
    spec = {"kind": "rl", "model": {"name": str(link)}}
    home = runs_root / "5"
    asked: list[int] = []

    def may_use(run_id: int) -> bool:
        asked.append(run_id)
        return run_id != 3

    assert copy_inputs(spec, home, run_id=5, runs_root=runs_root, link=False, may_use=may_use) == spec
    link.unlink()
    link.symlink_to(runs_root / "3" / "sft" / "final")  # swapped after the check
    with pytest.raises(InputCopyError) as err:
        copy_inputs(spec, home, run_id=5, runs_root=runs_root, link=False, may_use=may_use)
    assert str(err.value) == f"model.name: {link} now leads into the folder of run 3, which is not the owner's to use"
    assert asked == [3] and not (home / "inputs").exists()
