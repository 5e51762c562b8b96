"""The agent harness's chat program prepares without the package index once its lockfile exists.

verifiers runs ``uv sync --script <program>`` with ``UV_OFFLINE=false`` for every new runtime; without a lockfile
uv asks the index each time. `lock_chat_program` writes the lockfile beside the program; then the same command
succeeds with every outside connection refused (a proxy on a closed local port), from uv's cache.
"""

from __future__ import annotations

import os
import subprocess

from worker.orchestrator.harness_runtime import find_uv, lock_chat_program


def test_chat_program_prepares_offline_after_lock() -> None:
    path = lock_chat_program()
    assert path.is_file() and path.with_name(path.name + ".lock").is_file()
    uv = find_uv()
    assert uv is not None
    sync = [uv, "sync", "--script", str(path), "-q", "--no-config"]  # verifiers' own command (runtimes/base.py)
    subprocess.run(sync, check=True, timeout=300)  # fills uv's cache on a fresh machine (index reachable once)
    closed = "http://127.0.0.1:9"
    env = {**os.environ, "UV_OFFLINE": "false", "HTTPS_PROXY": closed, "HTTP_PROXY": closed, "ALL_PROXY": closed}
    done = subprocess.run(sync, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = subprocess.run(
        [uv, "python", "find", "--script", str(path), "--no-config"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode == 0 and found.stdout.strip().endswith("/bin/python"), found.stderr
