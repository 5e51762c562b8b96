"""Fixtures of the engine's unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.rundir import RunDir


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    r = RunDir(tmp_path / "run")
    r.create()
    return r
