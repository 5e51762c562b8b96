"""``asyncrl eval``: held-out reward and pass@k of a model path or of a running vLLM server."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from worker.envs import load_environment
from worker.inference.client import InferenceClient
from worker.orchestrator.eval import evaluate


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
) -> dict[str, Any]:
    """Evaluate ``model`` (a vLLM server is started for it and stopped after) or the server at ``url``.

    Returns:
        The result of :func:`worker.orchestrator.eval.evaluate` plus ``model`` and ``env``.

    Raises:
        SpecError: neither or both of ``model`` and ``url``, or no tokenizer for ``url``.
    """
    from worker.envs import EnvironmentLoadError
    from worker.models import check_model_source, load_tokenizer
    from worker.procs import free_port
    from worker.spec import SpecError

    if (model is None) == (url is None):
        raise SpecError("eval: give exactly one of --model and --url")
    try:
        if model is not None:
            check_model_source(model)
        env = load_environment(env_id, split="eval", seed=seed, **env_args)
    except (FileNotFoundError, ValueError) as err:  # EnvironmentLoadError is a ValueError
        raise SpecError(f"{'--env' if isinstance(err, EnvironmentLoadError) else '--model'}: {err}") from None
    proc = None
    if url is None:
        from worker.inference.server import start_server, wait_ready

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(tempfile.gettempdir()) / f"asyncrl-eval-{port}.log"
        proc = start_server(str(model), port=port, log_path=log, max_model_len=max(512, 4 * max_tokens))
        wait_ready(url, 300, proc, log)
    try:

        async def go() -> dict[str, Any]:
            async with InferenceClient(url) as client:
                tok = load_tokenizer(tokenizer or model or await client.served_model())
                return await evaluate(
                    client,
                    env,
                    tok,
                    num_examples=num_examples,
                    temperature=temperature,
                    max_tokens=max_tokens,
                    pass_k=pass_k,
                )

        result = asyncio.run(go())
    finally:
        if proc is not None:
            from worker.inference.server import stop_server

            stop_server(proc)
    return {"model": model or url, "env": env_id, "temperature": temperature, **result}
