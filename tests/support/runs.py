"""Short reverse-text runs on the tiny random model: their specs, and readers of their results (run directory
and API). Used by the end-to-end tests (``tests/e2e``)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.server import STATE, wait_for
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import RLSpec, load_spec_data, validate_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "reverse_text"


def rl_spec(model: Path, url: str, out: Path, name: str, **overrides: Any) -> RLSpec:
    """The shipped reverse-text RL config, pointed at ``model`` and the shared server, with overrides."""
    pairs = [
        ("model.name", str(model)),
        ("inference.url", url),
        ("output_dir", str(out)),
        ("name", name),
        ("orchestrator.eval.num_examples", "32"),
        ("orchestrator.eval.interval", "0"),
    ]
    pairs += [(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in overrides.items()]
    return validate_spec("rl", load_spec_data([CONFIGS / "rl.toml"], pairs))  # type: ignore[return-value]


def by_source(run: RunDir, source: str) -> list[dict[str, Any]]:
    return sorted((r for r in read_jsonl(run.metrics) if r["source"] == source), key=lambda r: r["step"])


def real_spec(model: Path, name: str, max_steps: int) -> dict[str, Any]:
    """The shipped reverse-text RL config on the tiny model, small and short."""
    return load_spec_data(
        [CONFIGS / "rl.toml"],
        [
            ("name", name),
            ("max_steps", str(max_steps)),
            ("model.name", str(model)),
            ("orchestrator.batch_size", "4"),
            ("orchestrator.group_size", "4"),
            ("orchestrator.max_tokens", "16"),
            ("orchestrator.eval.interval", "0"),
            ("orchestrator.eval.num_examples", "8"),
            ("ckpt.interval", "0"),
            ("trainer.scheduler.warmup_steps", "0"),
        ],
    )


def small_spec(model: Path, name: str, max_steps: int) -> dict[str, Any]:
    return load_spec_data(
        [CONFIGS / "rl.toml"],
        [
            ("name", name),
            ("max_steps", str(max_steps)),
            ("model.name", str(model)),
            ("orchestrator.batch_size", "4"),
            ("orchestrator.group_size", "4"),
            ("orchestrator.max_tokens", "16"),
            ("orchestrator.eval.interval", "0"),
            ("orchestrator.eval.num_examples", "8"),
            ("ckpt.interval", "2"),
            ("trainer.scheduler.warmup_steps", "0"),
            ("trainer.scheduler.type", "constant"),
            ("trainer.optim.lr", "1e-4"),
        ],
    )


def run_of(client: Any, auth: dict[str, str], run_id: int) -> dict[str, Any]:
    return dict(client.get(f"/api/runs/{run_id}", headers=auth).json())


def trainer_steps(client: Any, auth: dict[str, str], run_id: int) -> list[int]:
    loss = client.get(f"/api/runs/{run_id}/metrics", params={"name": "loss"}, headers=auth).json()
    return [step for s in loss["series"] if s["source"] == "trainer" for step in s["step"]]


def ended(client: Any, auth: dict[str, str], run_id: int, timeout: float = 400) -> dict[str, Any]:
    return wait_for(
        lambda: (r := run_of(client, auth, run_id))["status"] in {"completed", "failed", "cancelled"} and r,
        timeout,
        f"run {run_id} ended",
    )


SHARED_CACHE_VAR = "ASYNCRL_TEST_CACHE"
"""A folder that ``scripts/test.sh`` makes for one run of its passes (and removes at its end): every pytest process
of the run, both xdist workers of the real-run pass included, keeps there what :func:`multiturn_run` made once. Unset
(a pytest of one's own), the session's state directory (``tests.support.server.STATE``) serves alone."""

CODE_DIGEST_PATHS = ("worker", "configs")
"""Folders whose ``.py`` and ``.toml`` files make a cached run: a change in any of them is another cache key."""


def model_digest(model: Path) -> str:
    """SHA-256 over a model folder's files (relative names and bytes): two folders that ``init_model`` wrote with
    the same size and seed have the same digest."""
    h = hashlib.sha256()
    for f in sorted(p for p in model.rglob("*") if p.is_file()):
        h.update(f.relative_to(model).as_posix().encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


def code_digest() -> str:
    """SHA-256 over the names and bytes of the ``.py`` and ``.toml`` files of :data:`CODE_DIGEST_PATHS`, as they are
    now: a run cached under another digest was made by other code or configs and is never reused."""
    repo = CONFIGS.parents[1]
    h = hashlib.sha256()
    for top in CODE_DIGEST_PATHS:
        for f in sorted(p for p in (repo / top).rglob("*") if p.suffix in (".py", ".toml") and p.is_file()):
            h.update(f.relative_to(repo).as_posix().encode() + b"\0")
            h.update(f.read_bytes())
    return h.hexdigest()


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing) for the block: one process at a time, across the
    xdist workers."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def multiturn_run(model: Path, run_dir: Path, *, max_steps: int = 2) -> RunDir:
    """A real short multi-turn RL run (``reverse_twice``: the environment answers the model's first turn) of the
    tiny ``model`` written into ``run_dir``, with its own vLLM server (``launch_rl``); 2 groups of 2 rollouts a step,
    16 tokens a turn, 2 eval examples at the start and end. Used by the rollout browser tests.

    Once per run of ``scripts/test.sh`` (:data:`SHARED_CACHE_VAR`; else once per session) and inputs: a later call,
    in this process or another (the two rollout-browser files run in either xdist worker), with a model of the same
    files (:func:`model_digest`), the same ``max_steps`` and the same worker code and configs (:func:`code_digest`)
    gets a copy of the first call's run directory (its ``config.json`` names the first call's ``run_dir``), not a
    second identical run (its own vLLM server: ~1 min of the real-run pass). A second process that asks while the
    first makes it waits for it (:func:`file_lock`).

    Raises:
        AssertionError: the run did not complete.
    """
    shared = os.environ.get(SHARED_CACHE_VAR)
    cache = Path(shared) if shared else STATE / "multiturn-runs"
    cache.mkdir(parents=True, exist_ok=True)
    key = f"{model_digest(model)[:16]}-{code_digest()[:16]}-{max_steps}"
    kept = cache / key / "run"
    with file_lock(cache / f"{key}.lock"):
        if kept.is_dir():
            shutil.copytree(kept, run_dir, dirs_exist_ok=True)
            return RunDir(run_dir)
        from worker.launchers.local import launch_rl

        pairs = [
            ("model.name", str(model)),
            ("output_dir", str(run_dir.parent)),
            ("name", run_dir.name),
            ("max_steps", str(max_steps)),
            ("env.id", "reverse_twice"),
            ("orchestrator.batch_size", "2"),
            ("orchestrator.group_size", "2"),
            ("orchestrator.max_tokens", "16"),
            ("orchestrator.eval.num_examples", "2"),
            ("orchestrator.eval.interval", "0"),
            ("ckpt.interval", "0"),
        ]
        spec = validate_spec("rl", load_spec_data([CONFIGS / "rl.toml"], pairs))
        summary = launch_rl(spec, quiet=True)  # type: ignore[arg-type]
        assert summary["status"] == "completed", summary
        partial = cache / key / ".run.partial"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(run_dir, partial)
        partial.rename(kept)  # complete or absent: a copy is taken only of a whole run directory
    return RunDir(run_dir)


def asyncrl_eval(
    model: Path, env: dict[str, Any], settings: dict[str, Any], out: Path, seed: int = 0, url: str | None = None
) -> dict[str, Any]:
    """What ``asyncrl eval`` measures of ``model`` on ``env`` (``{"id", "args"}``) with an eval job's ``settings``
    (``num_examples``, ``temperature``, ``max_tokens``): its ``--out`` JSON. The reference an eval job of the service
    must equal. With ``url``: ``asyncrl eval --url`` on a running vLLM server of ``model`` (one server for several
    references: :func:`eval_server`), else ``--model`` (it starts a server of its own)."""
    import subprocess
    import sys

    served = ["--url", url, "--tokenizer", str(model)] if url is not None else ["--model", str(model)]
    argv = [*served, "--env", env["id"], "--env-args", json.dumps(env.get("args", {}))]
    argv += ["--seed", str(seed), "--num-examples", str(settings["num_examples"])]
    argv += ["--temperature", str(settings["temperature"]), "--max-tokens", str(settings["max_tokens"])]
    repo = CONFIGS.parents[1]
    cmd = [sys.executable, "-m", "worker.cli", "eval", *argv, "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=repo, stdout=subprocess.DEVNULL)
    return dict(json.loads(out.read_text()))


@contextmanager
def eval_server(model: Path, settings: dict[str, Any], log_dir: Path) -> Iterator[str]:
    """A vLLM server of ``model`` started as ``asyncrl eval --model`` starts its own (``worker.evaluation.run_evals``:
    ``max_model_len = max(512, 4 * max_tokens)``, the other arguments ``start_server``'s defaults); yields its URL
    for :func:`asyncrl_eval` ``url=``, stopped on exit."""
    from tests.support.vllm import serving

    with serving(model, log_dir, max_model_len=max(512, 4 * settings["max_tokens"])) as server:
        yield server.url
