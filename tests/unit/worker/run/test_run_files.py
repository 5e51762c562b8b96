"""worker.run.run_files on real files: links anywhere on the way, special files, '..', and the fork copy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from worker.run.run_files import (
    RunFileMissing,
    RunFileRefused,
    copy_run_folder,
    is_run_file,
    list_run_folder,
    open_run_file,
    read_run_text,
)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "runs" / "7"
    (h / "r" / "logs").mkdir(parents=True)
    (h / "r" / "logs" / "trainer.log").write_text("line\n")
    (tmp_path / "secret").write_text("SECRET")
    return h


def test_regular_files_read_and_everything_else_refused(home: Path, tmp_path: Path) -> None:
    assert read_run_text(home, "r/logs/trainer.log") == "line\n"
    (home / "r" / "logs" / "link.log").symlink_to(tmp_path / "secret")
    os.mkfifo(home / "r" / "logs" / "fifo.log")
    (home / "r" / "up").symlink_to(tmp_path)
    cases = {
        "r/logs/link.log": "r/logs/link.log: is a symbolic link; run files are read only as regular files",
        "r/logs/fifo.log": "r/logs/fifo.log: is not a regular file",
        "r/logs": "r/logs: is not a regular file",
        "r/up/secret": "r/up: is a symbolic link; run files are read only as regular files",
        "r/logs/trainer.log/x": "r/logs/trainer.log: is not a folder",
        "../secret": "../secret: not a path inside the run's folder",
        "r/../../secret": "r/../../secret: not a path inside the run's folder",
        str(tmp_path / "secret"): f"{tmp_path / 'secret'}: not a path inside the run's folder",
    }
    for rel, reason in cases.items():
        with pytest.raises(RunFileRefused) as err:
            open_run_file(home, rel)
        assert str(err.value) == reason
        assert not is_run_file(home, rel)
    with pytest.raises(RunFileMissing, match=r"^r/logs/none.log: no such file$"):
        open_run_file(home, "r/logs/none.log")
    with pytest.raises(RunFileMissing, match=r"^the run's folder: no such folder$"):
        open_run_file(home.parent / "8", "r/logs/trainer.log")
    assert list_run_folder(home, "r/logs") == {"trainer.log": False}  # the link and the FIFO are left out
    assert list_run_folder(home, "r/none") == {}
    with pytest.raises(RunFileRefused):
        list_run_folder(home, "r/up")


def test_copy_links_regular_files_and_refuses_links(home: Path, tmp_path: Path) -> None:
    src = home / "r" / "checkpoints" / "step_2"
    (src / "trainer").mkdir(parents=True)
    (src / "trainer" / "state.bin").write_bytes(b"weights")
    (src / "trainer" / ".complete").write_text("")
    dst = tmp_path / "child" / "step_2"
    copy_run_folder(home, "r/checkpoints/step_2", dst)
    assert (dst / "trainer" / "state.bin").read_bytes() == b"weights"
    assert (dst / "trainer" / "state.bin").stat().st_ino == (src / "trainer" / "state.bin").stat().st_ino
    copy_run_folder(home, "r/checkpoints/step_2", tmp_path / "bytes", link=False)
    assert (tmp_path / "bytes" / "trainer" / "state.bin").stat().st_ino != (src / "trainer" / "state.bin").stat().st_ino
    (src / "orchestrator").symlink_to(tmp_path)  # a linked folder
    with pytest.raises(RunFileRefused, match=r"^r/checkpoints/step_2/orchestrator: is a symbolic link"):
        copy_run_folder(home, "r/checkpoints/step_2", tmp_path / "c2")
    (src / "orchestrator").unlink()
    (src / "trainer" / "extra.bin").symlink_to(tmp_path / "secret")  # a linked file
    with pytest.raises(RunFileRefused, match=r"^r/checkpoints/step_2/trainer/extra.bin: is a symbolic link"):
        copy_run_folder(home, "r/checkpoints/step_2", tmp_path / "c3")
    assert not any("SECRET" in p.read_text(errors="replace") for p in (tmp_path / "c3").rglob("*") if p.is_file())
