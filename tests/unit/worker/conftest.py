"""Fixtures of the engine's unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.run.rundir import RunDir


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    r = RunDir(tmp_path / "run")
    r.create()
    return r


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for this test (``tests.support.tmpfs``): a disk that really fills up."""
    from tests.support.tmpfs import mounted

    with mounted(tmp_path / "disk", "4m") as path:
        yield path
