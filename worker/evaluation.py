"""``asyncrl eval``: held-out reward and pass@k of a model path or of a running vLLM server.

A taskset with tools runs through verifiers' agent harness (`worker.orchestrator.harness.HarnessRunner`, default
`[orchestrator.harness]` settings), as in RL: the model's tool calls are executed by verifiers and the finished
conversation is scored by the task's own rewards. The server must then offer ``/inference/v1/generate`` (ours
started with ``--enable-scale-out``; `start_server` does that where vLLM has it).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from worker.envs import load_environment
from worker.inference.client import InferenceClient
from worker.orchestrator.eval import evaluate
from worker.spec import EnvConfig


def env_of_spec(envs: list[EnvConfig], name: str | None, spec_path: str) -> EnvConfig:
    """The environment of a run spec that ``asyncrl eval --spec SPEC [--env NAME]`` evaluates: the one named
    ``name`` (an ``[[env]]`` mixture member's ``name``; its ``id`` and ``args`` are used), or the spec's only one
    when ``name`` is None.

    Raises:
        SpecError: ``--env: no environment named 'x' in SPEC; its environments: a, b`` (also when ``name`` is None
            and the spec has several).
    """
    from worker.spec import SpecError

    names = ", ".join(e.name or e.id for e in envs)
    if name is None:
        if len(envs) == 1:
            return envs[0]
        raise SpecError(f"--env: {spec_path} has several environments; name one of them: {names}")
    for env in envs:
        if env.name == name:
            return env
    raise SpecError(f"--env: no environment named {name!r} in {spec_path}; its environments: {names}")


def run_eval(
    *,
    model: str | None,
    url: str | None,
    tokenizer: str | None,
    env_id: str,
    env_args: dict[str, Any],
    num_examples: int,
    temperature: float,
    max_tokens: int,
    pass_k: int,
    seed: int,
    adapter: Path | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` (a vLLM server is started for it and stopped after) or the server at ``url``.

    With ``adapter`` (a PEFT LoRA folder, e.g. ``asyncrl export --adapter-only``; needs ``model``, its base), the
    server runs with LoRA enabled up to the adapter's rank, loads it as ``ADAPTER_NAME``, and every eval request names
    it, as a LoRA run's rollouts name their policy version.

    Returns:
        The result of :func:`worker.orchestrator.eval.evaluate` plus ``model`` and ``env``.

    Raises:
        SpecError: neither or both of ``model`` and ``url``; ``adapter`` with ``url``, or a folder without
            ``adapter_config.json`` (or with a rank vLLM does not serve); a model or tokenizer that fails
            :func:`worker.models.check_model` / ``load_tokenizer`` (no chat template...); an environment that
            does not load, or that the orchestrator cannot run (`Environment.unsupported`, e.g. tools without
            ``uv``). All are checked before a server starts.
    """
    from worker.envs import EnvironmentLoadError, env_error_field
    from worker.models import check_model, load_tokenizer
    from worker.procs import free_port
    from worker.spec import SpecError

    if (model is None) == (url is None):
        raise SpecError("eval: give exactly one of --model and --url")
    lora_rank = None if adapter is None else adapter_rank(adapter, served_by_url=url is not None)
    try:
        tok = check_model(model) if model is not None else None
    except (FileNotFoundError, ValueError) as err:
        raise SpecError(f"--model: {err}") from None
    if tokenizer is not None:
        try:
            tok = load_tokenizer(tokenizer)
        except (FileNotFoundError, ValueError) as err:
            raise SpecError(f"--tokenizer: {err}") from None
    try:
        env = load_environment(env_id, split="eval", seed=seed, **env_args)
    except (EnvironmentLoadError, TypeError, ValueError) as err:
        raise SpecError(f"{env_error_field(err, '--env-')}: {err}") from None
    if env.unsupported is not None:
        raise SpecError(f"--env: {env.unsupported}")
    proc = None
    if url is None:
        from worker.inference.auth import API_KEY_VAR, new_api_key
        from worker.inference.server import start_server, wait_ready

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(tempfile.gettempdir()) / f"asyncrl-eval-{port}.log"
        key = os.environ[API_KEY_VAR] = new_api_key()  # our clients (and the harness's) read it from here
        proc = start_server(
            str(model),
            port=port,
            log_path=log,
            max_model_len=max(512, 4 * max_tokens),
            api_key=key,
            lora_rank=lora_rank,
        )
        wait_ready(url, 300, proc, log)
    try:

        async def go() -> dict[str, Any]:
            async with InferenceClient(url) as client:
                if adapter is not None:
                    await client.load_lora_adapter(ADAPTER_NAME, adapter.resolve())
                    client.model = ADAPTER_NAME
                served_tok = tok
                if served_tok is None:  # --url without --tokenizer: the server's model names it
                    served = await client.served_model()
                    try:
                        served_tok = load_tokenizer(served)
                    except (FileNotFoundError, ValueError) as err:
                        raise SpecError(f"--tokenizer: needed for the server's model {served!r} ({err})") from None
                harness = None
                if env.needs_harness:
                    from worker.orchestrator.harness import HarnessRunner
                    from worker.spec import HarnessConfig

                    template = tokenizer or (str(model) if model is not None else await client.served_model())
                    harness = HarnessRunner(template, str(url), HarnessConfig())
                return await evaluate(
                    client,
                    env,
                    served_tok,
                    num_examples=num_examples,
                    temperature=temperature,
                    max_tokens=max_tokens,
                    pass_k=pass_k,
                    harness=harness,
                )

        result = asyncio.run(go())
    finally:
        if proc is not None:
            from worker.inference.server import stop_server

            stop_server(proc)
    served = {"adapter": str(adapter)} if adapter is not None else {}
    return {"model": model or url, **served, "env": env_id, "temperature": temperature, **result}


ADAPTER_NAME = "eval-adapter"
"""The name ``asyncrl eval --adapter`` serves the adapter under (one adapter per eval server: no run to name)."""


def adapter_rank(adapter: Path, *, served_by_url: bool) -> int:
    """The LoRA rank ``r`` of the PEFT adapter folder ``adapter`` (its ``adapter_config.json``).

    Raises:
        SpecError: ``--adapter`` with ``--url`` (the server's LoRA settings are not ours to set), no
            ``adapter_config.json`` in the folder, or no integer ``r`` in it.
    """
    from worker.inference.server import LORA_RANKS
    from worker.lora_adapters import ADAPTER_CONFIG
    from worker.spec import SpecError

    if served_by_url:
        raise SpecError("--adapter: needs --model (the adapter's base model); a server at --url is not started here")
    config = adapter / ADAPTER_CONFIG
    if not config.is_file():
        raise SpecError(f"--adapter: expected a PEFT adapter folder with adapter_config.json, got {adapter}")
    try:
        rank = json.loads(config.read_text())["r"]
    except (ValueError, KeyError) as err:
        raise SpecError(f"--adapter: {config} has no LoRA rank 'r' ({err})") from None
    top = LORA_RANKS[-1]
    if not isinstance(rank, int) or not 1 <= rank <= top:
        raise SpecError(f"--adapter: {config}: expected an integer rank 'r' in [1, {top}] (vLLM's), got {rank!r}")
    return rank
