"""The argument parser of every ``asyncrl`` command (``worker/cli.py``, and the control plane's ``server/cli.py``):
a bad argument is one ``error:`` line and exit code 2, like every other bad input of the command line."""

from __future__ import annotations

import argparse
from typing import NoReturn

from worker.spec import SpecError


class ArgParser(argparse.ArgumentParser):
    """argparse whose errors raise :class:`SpecError` (one ``error:`` line, exit 2) instead of printing usage."""

    def error(self, message: str) -> NoReturn:
        raise SpecError(f"{self.prog}: {message}")
