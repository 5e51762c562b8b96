"""``asyncrl eval`` and eval jobs: held-out reward and pass@k of a model path or of a running vLLM server.

``run_eval`` (one environment, the CLI) and ``run_evals`` (several: an eval job, ``kind = "eval"``) share one path:
the checks, one vLLM server for the whole eval, :func:`worker.orchestrator.eval.evaluate` per environment and
:func:`worker.orchestrator.mixture.combine_evals` over them. ``python -m worker.evaluation --run-dir DIR`` is the one
process of an eval job (:func:`run_job`; the local launcher's ``launch_eval`` starts it).

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
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from worker.envs import load_environment
from worker.inference.client import InferenceClient
from worker.orchestrator.eval import TaskResult, check_num_examples, evaluate
from worker.orchestrator.harness import serving_tools
from worker.orchestrator.mixture import combine_evals
from worker.run.rundir import RunDir, append_jsonl, atomic_write_json, read_jsonl
from worker.spec import EnvConfig, EvalSpec


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


@dataclass(frozen=True)
class EvalSettings:
    """How each environment is evaluated: the keywords :func:`worker.orchestrator.eval.evaluate` takes besides the
    client, environment and tokenizer (``num_examples`` tasks of the eval split, ``num_samples`` samples each (None:
    ``pass_k``) of at most ``max_tokens`` tokens at ``temperature``; pass@``pass_k`` with a sample passing at reward >=
    ``pass_threshold``)."""

    num_examples: int
    temperature: float
    max_tokens: int
    pass_k: int
    pass_threshold: float = 1.0
    num_samples: int | None = None


def run_eval(
    *,
    model: str | None,
    url: str | None,
    tokenizer: str | None,
    env_id: str,
    env_args: dict[str, Any],
    settings: EvalSettings,
    seed: int,
    adapter: Path | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` (a vLLM server is started for it and stopped after) or the server at ``url`` on one
    environment: :func:`run_evals` with ``envs = [EnvConfig(id=env_id, args=env_args)]``.

    Returns:
        The result of :func:`worker.orchestrator.eval.evaluate` plus ``model``, ``env`` and ``temperature``.

    Raises:
        SpecError: as :func:`run_evals` (an environment's error names ``--env``/``--env-args``).
    """
    env = EnvConfig.model_construct(id=env_id, args=env_args, name=env_id, weight=1.0)
    return run_evals(
        model=model, url=url, tokenizer=tokenizer, envs=[env], settings=settings, seed=seed, adapter=adapter
    )


def run_evals(
    *,
    model: str | None,
    url: str | None,
    tokenizer: str | None,
    envs: list[EnvConfig],
    settings: EvalSettings,
    seed: int,
    adapter: Path | None = None,
    env_field: str = "--env-",
    count_field: str = "--num-examples",
    server_log: Path | None = None,
    done: Mapping[str, Mapping[int, TaskResult]] | None = None,
    on_task: Callable[[str, int, TaskResult], None] | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` (a vLLM server is started for it and stopped after; its log at ``server_log``, default a
    temporary file) or the server at ``url`` on each of ``envs`` in turn, as ``settings`` says (its eval split,
    ``num_examples`` tasks, ``pass_k`` samples each).

    With ``adapter`` (a PEFT LoRA folder, e.g. ``asyncrl export --adapter-only``; needs ``model``, its base), the
    server runs with LoRA enabled up to the adapter's rank, loads it as ``ADAPTER_NAME``, and every eval request names
    it, as a LoRA run's rollouts name their policy version.

    Task i's requests are seeded with ``request_seed(seed, i)`` (``worker.orchestrator.eval.evaluate``), so an eval
    at a temperature above 0 samples the same completions again. ``done`` (environment name -> task index -> result
    of an interrupted eval job) and ``on_task(name, index, result)`` are passed on to ``evaluate`` per environment:
    recorded tasks are not sampled again (an eval job's resume, :func:`run_job`).

    Returns:
        ``model``, ``env`` (the id with one environment, else the names joined by ``,``), ``temperature`` and
        :func:`worker.orchestrator.mixture.combine_evals` of the environments' results (one environment: its
        :func:`worker.orchestrator.eval.evaluate` result; several: each under ``<metric>/<name>`` plus the whole).

    Raises:
        SpecError: neither or both of ``model`` and ``url``; ``adapter`` with ``url``, or a folder without
            ``adapter_config.json`` (or with a rank vLLM does not serve); a model or tokenizer that fails
            :func:`worker.policy.models.check_model` / ``load_tokenizer`` (no chat template...); an environment that
            does not load, or that the orchestrator cannot run (`Environment.unsupported`, e.g. tools without
            ``uv``), named ``<env_field>id`` / ``<env_field>args`` (several: ``env.<i>.id``); ``settings.num_examples``
            more than an environment's eval split has, named ``count_field`` (``check_num_examples``: never evaluated
            on fewer without a word). All are checked before a server starts.
    """
    from worker.envs import EnvironmentLoadError, env_error_field
    from worker.policy.models import check_model, load_tokenizer
    from worker.run.procs import free_port
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
    loaded = {}
    for i, cfg in enumerate(envs):
        field = env_field if len(envs) == 1 else f"env.{i}."
        try:
            env = load_environment(cfg.id, split="eval", seed=seed, **cfg.args)
        except (EnvironmentLoadError, TypeError, ValueError) as err:
            raise SpecError(f"{env_error_field(err, field)}: {err}") from None
        if env.unsupported is not None:
            raise SpecError(f"{field}id: {env.unsupported}")
        check_num_examples(env, settings.num_examples, count_field)
        loaded[cfg.name or cfg.id] = env
    proc = None
    if url is None:
        from worker.inference.auth import API_KEY_VAR, new_api_key
        from worker.inference.server import start_server, wait_ready

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = server_log or Path(tempfile.gettempdir()) / f"asyncrl-eval-{port}.log"
        key = os.environ[API_KEY_VAR] = new_api_key()  # our clients (and the harness's) read it from here
        proc = start_server(
            str(model),
            port=port,
            log_path=log,
            max_model_len=max(512, 4 * settings.max_tokens),
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
                results = {}
                for name, env in loaded.items():
                    harness = None
                    if env.needs_harness:
                        from worker.orchestrator.harness import HarnessRunner
                        from worker.spec import HarnessConfig

                        template = tokenizer or (str(model) if model is not None else await client.served_model())
                        harness = HarnessRunner(template, str(url), HarnessConfig())
                    record = None if on_task is None else (lambda i, r, name=name: on_task(name, i, r))
                    async with serving_tools([env]):  # the taskset's shared tools: one server for the whole eval
                        results[name] = await evaluate(
                            client,
                            env,
                            served_tok,
                            **asdict(settings),
                            harness=harness,
                            seed=seed,
                            done=(done or {}).get(name),
                            on_task=record,
                        )
                return combine_evals(results)

        result = asyncio.run(go())
    finally:
        if proc is not None:
            from worker.inference.server import stop_server

            stop_server(proc)
    served = {"adapter": str(adapter)} if adapter is not None else {}
    shown = envs[0].id if len(envs) == 1 else ",".join(loaded)
    return {"model": model or url, **served, "env": shown, "temperature": settings.temperature, **result}


ADAPTER_NAME = "eval-adapter"
"""The name ``asyncrl eval --adapter`` serves the adapter under (one adapter per eval server: no run to name)."""


def adapter_rank(adapter: Path, *, served_by_url: bool) -> int:
    """The LoRA rank ``r`` of the PEFT adapter folder ``adapter`` (its ``adapter_config.json``).

    Raises:
        SpecError: ``--adapter`` with ``--url`` (the server's LoRA settings are not ours to set), no
            ``adapter_config.json`` in the folder, or no integer ``r`` in it.
    """
    from worker.inference.server import LORA_RANKS
    from worker.policy.lora_adapters import ADAPTER_CONFIG
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


# ----------------------------------------------------------------------------- eval jobs


def job_step(spec: EvalSpec) -> int:
    """The step an eval job's metrics are stored at: the step its weights come from (``model.weights_step``: the
    evaluated checkpoint's step, a run's final weights at that run's ``max_steps``, where the service's
    ``/api/runs/{id}/evals`` draws them too; 0 for a model path)."""
    return spec.model.weights_step


def job_model(spec: EvalSpec, run: RunDir) -> str:
    """The model folder an eval job serves: ``model.name`` itself, or, with ``model.run``, ``<run_dir>/model`` made
    from ``<run_dir>/source`` (the evaluated run's weights the service copied in) on top of the base model
    ``model.name`` by :func:`worker.policy.export.write_export` (a LoRA adapter merged), the same folder
    ``asyncrl export`` writes.

    Raises:
        SpecError: ``model.run`` without ``source/`` (a spec run outside the service) or with neither weights nor an
            adapter in it; the export's own errors (``worker.policy.export.ExportError``) as ``model.run``.
    """
    from worker.policy.export import ExportError, ExportSource, adapter_folder, source_kind, write_export
    from worker.spec import SpecError

    if spec.model.run is None:
        return spec.model.name
    source, out = run.eval_source, run.eval_model
    kind = source_kind(source) if source.is_dir() else None
    if kind is None:
        raise SpecError(
            f"model.run: no weights of run {spec.model.run} in {source} (the service copies them there when it "
            "creates the eval run); evaluate a model folder with model.name or asyncrl eval --model"
        )
    if out.exists():
        import shutil

        shutil.rmtree(out)  # an earlier attempt's: made again from source/
    path = adapter_folder(source) if kind == "lora" else source
    try:
        write_export(ExportSource(run.root, spec.model.step, kind, path, spec.model.name, spec.model.dtype), out)
    except ExportError as err:
        raise SpecError(f"model.run: {err}") from None
    return str(out)


def recorded_tasks(run: RunDir) -> dict[str, dict[int, TaskResult]]:
    """The eval tasks an earlier attempt of the job in ``run`` finished (``eval_tasks.jsonl``, one line per task:
    ``{"env", "index", "rewards", "lengths", "pid"}``; a line a kill tore is skipped): environment name -> task index
    -> ``(rewards, lengths)``."""
    done: dict[str, dict[int, TaskResult]] = {}
    for row in read_jsonl(run.eval_tasks):
        done.setdefault(str(row["env"]), {})[int(row["index"])] = (list(row["rewards"]), list(row["lengths"]))
    return done


def run_job(spec: EvalSpec, run: RunDir) -> dict[str, Any]:
    """The eval job ``spec`` in its run directory ``run`` (made by the launcher): its model (:func:`job_model`) on
    each of its environments (:func:`run_evals`, vLLM's log ``logs/inference.log``). The numeric results are appended
    to ``metrics.jsonl`` as source ``eval`` at :func:`job_step`, the whole result is ``summary.json``; returns it.

    Resumable: each task's result is appended to ``eval_tasks.jsonl`` as it finishes, and a later attempt (a resume
    after a stop or a failure, a requeued Slurm job) takes the tasks recorded there instead of sampling them again
    (:func:`recorded_tasks`; event ``eval_tasks_reused`` with their count). Tasks are combined in index order and
    their requests seeded, so the result equals an uninterrupted eval's (exactly at temperature 0).

    Raises:
        SpecError: as :func:`job_model` and :func:`run_evals` (environments named ``env.id`` / ``env.<i>.id``, the
            count ``eval.num_examples``: more than an environment's eval split fails the job with that line).
    """
    ev = spec.eval
    done = recorded_tasks(run)
    if done:
        run.log_event("eval_tasks_reused", tasks=sum(map(len, done.values())))
    pid = os.getpid()

    def record(env: str, index: int, task: TaskResult) -> None:
        append_jsonl(run.eval_tasks, {"env": env, "index": index, "rewards": task[0], "lengths": task[1], "pid": pid})

    result = run_evals(
        model=job_model(spec, run),
        url=None,
        tokenizer=None,
        envs=spec.envs,
        settings=EvalSettings(
            ev.num_examples, ev.temperature, ev.max_tokens, ev.pass_k, ev.pass_threshold, ev.num_samples
        ),
        seed=spec.seed,
        env_field="env.",
        count_field="eval.num_examples",
        server_log=run.logs / "inference.log",
        done=done,
        on_task=record,
    )
    numbers: dict[str, float | int | None] = {
        k: v for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    run.log_metrics("eval", job_step(spec), numbers)
    atomic_write_json(run.summary, {"status": "completed", **result})
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.evaluation --run-dir DIR``: the eval job of ``DIR/config.json`` in the run directory the
    local launcher prepared; exit 2 with ``error: <field>: ...`` on bad input."""
    import argparse
    import logging
    import sys

    from worker.spec import SpecError, validate_spec

    p = argparse.ArgumentParser(prog="python -m worker.evaluation")
    p.add_argument("--run-dir", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = RunDir(args.run_dir)
    try:
        spec = validate_spec("eval", json.loads(run.config.read_text()))
        result = run_job(spec, run)
    except SpecError as err:
        run.log_event("failed", process="eval", reason=str(err))
        print(f"error: {err}", file=sys.stderr)  # noqa: T201
        return 2
    logging.getLogger("asyncrl.eval").info("eval done: %s", json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
