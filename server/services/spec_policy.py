"""What a spec submitted to the service may name, beyond what the schema checks: code and addresses.

A local ``asyncrl rl`` runs its user's own code on its user's machine; a spec submitted to the service runs on a
shared worker, so it may name only

- environment arguments a built-in environment declares (``worker/spec/env_args.py``: plain data with bounds);
  any other ``env.args`` key is refused, and an installed package's environment takes ``env.args`` only from a
  submitter with the code permission (an admin), whose verifiers code, file and address fields are then checked
  against the roots and hosts below (:func:`check_env_args`);
- the agent harness ``null`` (verifiers' chat program over the environment's own tools): the others run
  model-written shell commands or agent programs on the worker, so they need the code permission;
- code the admin allows: every import path of the spec (``env.id``, ``orchestrator.harness.id``, future custom
  losses, advantages, gates) goes through the one rule :func:`worker.spec.user_code.check_import_path` with the
  setting ``ALLOWED_CODE_PACKAGES``;
- an ``inference.url`` on the worker itself (loopback) or a host in ``INFERENCE_ALLOW_HOSTS``: the run sends
  weight updates and requests there;
- an ``inference.host`` (where vLLM listens) and a ``trainer.weight_sync.master_addr`` (where the trainer's store
  listens and vLLM connects) on loopback or a node of the run's own Slurm ``--nodelist``
  (:func:`check_run_host`): vLLM's weight-loading routes have no authentication, so it never listens elsewhere;
- a ``model.name`` that is a hub id (``org/name``) or a path under an admin's ``MODEL_ROOTS``
  (:func:`check_model_name`): not ``/etc``, ``/proc/self/...``, ``~`` or ``..`` out of a root, nor a symlink out
  of one; an SFT run's ``data.path`` / ``data.eval_path`` only under an admin's ``DATA_ROOTS``
  (:func:`check_data_path`, the same rule without hub ids). ``output_dir`` is set by the service; the spec has no
  other path (RL data is generated, a fork's checkpoint is the parent's);
- ``inference.extra_args`` flags from :data:`VLLM_FLAGS` (tuning and parallelism) or ``INFERENCE_ALLOW_FLAGS``:
  others load code (``--worker-extension-cls``, ``--middleware``, ``--trust-remote-code``, ``--tool-parser-plugin``)
  or files; every item is such a flag (``--flag``, ``--flag=value``) or the plain value right after one that takes
  a value (:func:`check_vllm_args`), never a bare value (vLLM's positional model);
- ``launcher.slurm.extra_sbatch`` options from :data:`SBATCH_OPTIONS` (``--output=/etc/...`` would write a file
  anywhere as the submitting user) and ``launcher.slurm.env`` names that do not change what code loads or where
  the run reports: an allowlist, :data:`JOB_ENV_NAMES` and the setting ``JOB_ENV_ALLOW``;
- ``launcher.slurm.allocation`` (run inside an existing job) only from an admin: the worker's Slurm user owns every
  user's jobs.

:func:`check` runs at submit (``runs.create``: the API, the dashboard's launch form, fork) and again at launch
(``server.jobs.tasks.launch``: a spec stored before a rule or a setting changed).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Collection, Mapping
from typing import Any
from urllib.parse import urlsplit

from server.core.config import settings
from server.services.permissions import Forbidden
from worker.spec import EvalSpec, RLSpec, SFTSpec, SpecError
from worker.spec.env_args import BUILTIN_ENV_ARGS, check_builtin_args
from worker.spec.runs import EnvConfig
from worker.spec.user_code import (
    HARNESS_ID,
    PLUGIN,
    CodeNotAllowed,
    ImportPath,
    check_import_path,
    check_spec_code,
    import_paths,
)


class AddressNotAllowed(SpecError):
    """A spec names a network address the service does not let a run reach (one line naming the key)."""


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_inference_url(url: str | None, allowed_hosts: Collection[str], key: str = "inference.url") -> None:
    """Refuse an ``inference.url`` (or the ``key`` given: ``inference.urls.<i>``) whose host is not loopback (``localhost``, ``127.0.0.0/8``, ``::1``) or one of
    ``allowed_hosts``. Names are not resolved: a name is allowed only when listed.

    Raises:
        AddressNotAllowed: ``inference.url: 'http://10.0.0.5:8000' is not allowed in a run submitted to the
            service; allowed: a loopback address (127.0.0.1, localhost, ::1) or a host in INFERENCE_ALLOW_HOSTS
            (none)``.
    """
    if url is None:
        return
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
    except ValueError:
        host, parts = "", None
    if parts is not None and parts.scheme in {"http", "https"} and host:
        if _loopback(host) or host in {h.lower() for h in allowed_hosts}:
            return
    listed = ", ".join(sorted(allowed_hosts)) or "none"
    raise AddressNotAllowed(
        f"{key}: {url!r} is not allowed in a run submitted to the service; allowed: an http(s) URL of a "
        f"loopback address (127.0.0.1, localhost, ::1) or of a host in INFERENCE_ALLOW_HOSTS ({listed})"
    )


HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
"""A model hub id: ``name`` or ``org/name`` of letters, digits, ``-``, ``_``, ``.`` (not leading, no ``..``)."""


def _under(path: str, roots: Collection[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def root_here(path: str, roots: Collection[str]) -> str | None:
    """The folder of ``roots`` (relative ones from this process's working folder, as written or with symlinks
    resolved) that holds ``path`` and exists on this machine, or None: a path under a root the server does not see
    (mounted on the workers only) is judged at launch."""
    cwd = os.getcwd()
    local = os.path.normpath(os.path.join(cwd, path))
    absolute = [os.path.normpath(os.path.join(cwd, r)) for r in roots]
    here = [r for r in absolute + [os.path.realpath(r) for r in absolute] if _under(local, [r]) and os.path.isdir(r)]
    return here[0] if here else None


def check_model_name(name: str, roots: Collection[str], *, hub_offline: bool = False) -> None:
    """Refuse a ``model.name`` that is neither a hub id (:data:`HUB_ID`, and no local path outside ``roots`` by that
    name) nor a path under one of ``roots`` (relative ones from this process's working folder). A path is judged
    as written (``..`` refused) and, where it exists here, with its symlinks resolved. A path under a root that
    exists on this machine (the outputs folder the server shares with the workers) must be a model folder now (a
    ``config.json``), so a mistyped path is refused at submit, not at launch; under a root the server does not see
    (mounted on the workers only) it is judged at launch (``worker.policy.models.check_model``). A hub id is taken
    without a look-up where hub downloads are on; with ``hub_offline`` (the setting ``HF_HUB_OFFLINE``) it must be a
    model in this machine's hub cache (its ``config.json`` there), else the launch would fail on it.

    Raises:
        SpecError: ``model.name: '/etc' is not allowed in a run submitted to the service; allowed: a hub id
            (org/name) or a path under MODEL_ROOTS (/srv/asyncrl/outputs)``; ``model.name: 'outputs/sft/fnal': no
            such model folder (under MODEL_ROOTS /srv/asyncrl/outputs)``; ``... not a model folder (no
            config.json)``; ``model.name: 'org/typo' is not a model folder under MODEL_ROOTS (...) nor a model in this
            machine's hub cache, and hub downloads are off (HF_HUB_OFFLINE)``.
    """
    cwd = os.getcwd()
    absolute = [os.path.normpath(os.path.join(cwd, r)) for r in roots]
    real = [os.path.realpath(r) for r in absolute]
    parts = name.replace("\\", "/").split("/")
    plain = "\0" not in name and ".." not in parts and not name.startswith("~")
    if plain and HUB_ID.match(name) and ".." not in name:
        ok = not os.path.lexists(name) or _under(os.path.realpath(name), real)  # a local folder by that name
    else:
        path = os.path.normpath(os.path.join(cwd, name)) if plain else ""
        ok = (
            bool(path)
            and (_under(path, absolute) or _under(path, real))
            and (not os.path.lexists(path) or _under(os.path.realpath(path), real))
        )
    if not ok:
        raise SpecError(
            f"model.name: {name!r} is not allowed in a run submitted to the service; allowed: a hub id (org/name) or "
            f"a path under MODEL_ROOTS ({', '.join(absolute) or 'none'}), without '..' or '~'"
        )
    if plain and HUB_ID.match(name) and not os.path.lexists(name):
        if hub_offline and not in_hub_cache(name):
            raise SpecError(
                f"model.name: {name!r} is not a model folder under MODEL_ROOTS ({', '.join(absolute) or 'none'}) nor a "
                "model in this machine's hub cache, and hub downloads are off (HF_HUB_OFFLINE); give a model folder's path"
            )
        return  # a hub id: the worker downloads (or finds in its cache) it
    local = os.path.normpath(os.path.join(cwd, name))
    if (root := root_here(name, roots)) is not None:  # a root this server sees (the shared outputs folder)
        if not os.path.isdir(local):
            raise SpecError(f"model.name: {name!r}: no such model folder (under MODEL_ROOTS {root})")
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise SpecError(f"model.name: {name!r}: not a model folder (no config.json)")
        real = [os.path.realpath(r) for r in absolute]
        for entry in sorted(os.listdir(local)):  # a file linked out of the roots would be read (by the server too)
            target = os.path.realpath(os.path.join(local, entry))
            if not _under(target, real):
                raise SpecError(
                    f"model.name: {name!r}: {entry} links out of MODEL_ROOTS ({target}); copy the file into the folder"
                )


def in_hub_cache(name: str) -> bool:
    """Whether the hub id ``name`` has its ``config.json`` in this machine's Hugging Face cache (``HF_HOME``), so that
    transformers loads it with hub downloads off."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def check_data_path(field: str, path: str, roots: Collection[str]) -> None:
    """Refuse an SFT data path (``data.path``, ``data.eval_path``) that is not under one of ``roots`` (relative ones
    from this process's working folder), judged as :func:`check_model_name` judges a local model path: as written
    (``..``, ``~`` refused) and, where it exists here, with its symlinks resolved. Whether the file exists and its rows
    are well formed is checked next, where the server sees the root (``server.services.launch_checks``), and at
    launch (``worker.trainer.sft.sft_preflight``).

    Raises:
        SpecError: ``data.path: '/etc/passwd' is not allowed in a run submitted to the service; allowed: a path
            under DATA_ROOTS (/srv/asyncrl/outputs), without '..' or '~'``.
    """
    cwd = os.getcwd()
    absolute = [os.path.normpath(os.path.join(cwd, r)) for r in roots]
    real = [os.path.realpath(r) for r in absolute]
    parts = path.replace("\\", "/").split("/")
    plain = "\0" not in path and ".." not in parts and not path.startswith("~")
    local = os.path.normpath(os.path.join(cwd, path)) if plain else ""
    ok = (
        bool(local)
        and (_under(local, absolute) or _under(local, real))
        and (not os.path.lexists(local) or _under(os.path.realpath(local), real))
    )
    if not ok:
        raise SpecError(
            f"{field}: {path!r} is not allowed in a run submitted to the service; allowed: a path under DATA_ROOTS "
            f"({', '.join(absolute) or 'none'}), without '..' or '~'"
        )


def nodelist(spec: RLSpec) -> set[str]:
    """Host names of the run's own Slurm ``--nodelist`` / ``-w`` option (``launcher.slurm.extra_sbatch``), with
    ``node[1-3,5]`` ranges expanded; empty for a local run."""
    if spec.launcher.kind != "slurm":
        return set()
    names: set[str] = set()
    for opt in spec.launcher.slurm.extra_sbatch:
        flag, _, value = opt.partition("=")
        if flag not in {"--nodelist", "-w"}:
            continue
        for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?", value):
            prefix, ranges = m.group(1), m.group(2)
            if ranges is None:
                names.add(prefix)
                continue
            for part in ranges.split(","):
                lo, _, hi = part.partition("-")
                if lo.isdigit() and (not hi or hi.isdigit()) and int(hi or lo) - int(lo) < 4096:
                    names.update(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1))
    return {n.lower() for n in names if n}


def _ip_literal(host: str) -> bool:
    """An address, not a node name (a ``--nodelist`` of ``169.254.169.254`` names no node of the cluster)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def check_run_host(key: str, host: str, nodes: Collection[str]) -> None:
    """Refuse an address a run listens on or connects to inside itself (``inference.host``,
    ``trainer.weight_sync.master_addr``) unless it is loopback or one of ``nodes`` (:func:`nodelist`).

    Raises:
        AddressNotAllowed: ``inference.host: '0.0.0.0' is not allowed in a run submitted to the service; allowed: a
            loopback address (127.0.0.1, localhost, ::1) or a node of the run's Slurm --nodelist (none)``.
    """
    if _loopback(host.lower()) or (host.lower() in nodes and not _ip_literal(host)):
        return
    raise AddressNotAllowed(
        f"{key}: {host!r} is not allowed in a run submitted to the service; allowed: a loopback address (127.0.0.1, "
        f"localhost, ::1) or a node of the run's Slurm --nodelist ({', '.join(sorted(nodes)) or 'none'})"
    )


VLLM_VALUE_FLAGS = frozenset(
    {
        *("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp"),
        *("--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--swap-space", "--cpu-offload-gb"),
        *("--kv-cache-dtype", "--max-logprobs", "--max-seq-len-to-capture"),
    }
)
"""vLLM server flags that take one value (``--max-num-seqs 8`` or ``--max-num-seqs=8``) a submitted spec may pass in
``inference.extra_args``: throughput, memory and parallelism."""
VLLM_SWITCHES = frozenset(
    {
        *("--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill"),
        *("--no-enable-chunked-prefill", "--disable-log-requests", "--enable-log-requests"),
        *("--disable-custom-all-reduce", "--disable-log-stats"),
    }
)
"""vLLM server flags without a value a submitted spec may pass in ``inference.extra_args`` (``--disable-log-stats``:
no vLLM stats, so no ``vllm`` metrics: ``worker/inference/server_metrics.py``)."""
VLLM_FLAGS = VLLM_VALUE_FLAGS | VLLM_SWITCHES
"""Every vLLM server flag a submitted spec may pass without the setting ``INFERENCE_ALLOW_FLAGS``."""
VLLM_VALUE = re.compile(r"^(-?[0-9]+(\.[0-9]+)?|[A-Za-z0-9][A-Za-z0-9_.+-]{0,63})$")
"""A value of a :data:`VLLM_VALUE_FLAGS` flag: a number (``8``, ``0.5``, ``-1``) or a short name (``fp8_e4m3``,
``4k``): ASCII, never starting with ``-`` (argparse would read it as a flag), no ``/`` (no path)."""
VLLM_ADMIN_VALUE = re.compile(r"^[!-~]{1,4096}$")
"""A value given after ``=`` to a flag of ``INFERENCE_ALLOW_FLAGS`` (an admin allowed it, so also a path): printable
ASCII without spaces."""
SBATCH_OPTIONS = frozenset(
    {
        *("--constraint", "--gres", "--gpus", "--gpus-per-task", "--cpus-per-task", "--cpus-per-gpu", "--mem"),
        *("--mem-per-cpu", "--mem-per-gpu", "--qos", "--exclusive", "--nodelist", "--exclude", "--comment"),
        *("--nice", "--mail-type", "--begin", "--deadline", "--hint", "--tmp", "--hold"),
    }
)
"""``#SBATCH`` options a submitted spec may add in ``launcher.slurm.extra_sbatch``: placement and resources."""
JOB_ENV_NAMES = frozenset(
    {
        *("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM", "TZ"),
        *(
            "NCCL_DEBUG",
            "NCCL_DEBUG_SUBSYS",
            "NCCL_SOCKET_IFNAME",
            "NCCL_IB_DISABLE",
            "NCCL_IB_HCA",
            "NCCL_P2P_DISABLE",
        ),
        *(
            "NCCL_P2P_LEVEL",
            "NCCL_ALGO",
            "NCCL_PROTO",
            "NCCL_NVLS_ENABLE",
            "GLOO_SOCKET_IFNAME",
            "CUDA_LAUNCH_BLOCKING",
        ),
        *(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "TORCH_NCCL_BLOCKING_WAIT",
            "TORCH_DISTRIBUTED_DEBUG",
            "TORCH_CPP_LOG_LEVEL",
        ),
        *("PYTORCH_CUDA_ALLOC_CONF", "VLLM_ATTENTION_BACKEND", "VLLM_LOGGING_LEVEL", "VLLM_CPU_KVCACHE_SPACE"),
        *("VLLM_CPU_OMP_THREADS_BIND", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"),
    }
)
"""``launcher.slurm.env`` names a submitted spec may set (more in the setting ``JOB_ENV_ALLOW``): threads, NCCL/gloo
transport and debugging, the CUDA allocator, vLLM's backend and logging, offline switches. An allowlist, not a
denylist: ``NCCL_NET_PLUGIN``, ``GCONV_PATH``, ``VLLM_PLUGINS`` and the like load shared libraries or code,
``HTTP_PROXY`` moves traffic, ``SLURM_CONF`` another cluster's controller."""


def _flag(arg: str) -> str | None:
    """The flag ``arg`` names (``--max-num-seqs=8`` -> ``--max-num-seqs``), None for a value (``8``, ``-1``)."""
    if not arg.startswith("-") or re.match(r"^-\d", arg):
        return None
    return arg.split("=", 1)[0]


def check_flags(key: str, args: list[str], allowed: Collection[str], what: str, setting: str | None = None) -> None:
    """Refuse an argument of ``args`` (the spec's ``key``) that is a flag not in ``allowed``.

    Raises:
        SpecError: ``inference.extra_args: '--middleware' is not allowed in a run submitted to the service ...``.
    """
    for arg in args:
        if any(c.isspace() for c in arg):  # one argv item each: "--a=1 --trust-remote-code" hides a second flag
            raise SpecError(f"{key}: {arg!r} holds whitespace; give each option and value as its own item")
        flag = _flag(arg)
        if flag is not None and flag not in allowed:
            raise SpecError(
                f"{key}: {flag!r} is not allowed in a run submitted to the service ({what}); allowed: "
                f"{', '.join(sorted(allowed))}" + (f" (more in {setting})" if setting else "")
            )


def check_vllm_args(args: list[str], allowed: Collection[str]) -> None:
    """Refuse ``inference.extra_args`` (vLLM server argv) unless every item is a flag of :data:`VLLM_FLAGS` or of
    ``allowed`` (the setting ``INFERENCE_ALLOW_FLAGS``) by its exact ASCII name, alone or as ``--flag=value``, or the
    value right after a flag of :data:`VLLM_VALUE_FLAGS` (:data:`VLLM_VALUE`). An allow-list of the argv, not of the
    flag names found in it: a bare value is vLLM's positional model (``vllm serve`` takes it as the model to load),
    ``—trust-remote-code`` (an em dash) or ``-9.x`` are no allowed flag, a value beginning with ``-`` would be read as
    a flag. A flag of ``allowed`` takes a value only after ``=`` (what it takes is the admin's knowledge, not this
    module's). The count is bounded by the schema (``worker.spec.runs.MAX_EXTRA_ARGS``).

    Raises:
        SpecError: ``inference.extra_args.<i>: ...`` naming the item and what is allowed.
    """
    key = "inference.extra_args"
    shown = ", ".join(f"{f} VALUE" if f in VLLM_VALUE_FLAGS else f for f in sorted(VLLM_FLAGS | set(allowed)))
    rule = (
        f"allowed: {shown} (more in INFERENCE_ALLOW_FLAGS), each flag as an item, its VALUE the next item or after '='"
    )
    takes: str | None = None  # the flag before this item, when it waits for its value
    for i, arg in enumerate(args):
        if takes is not None:
            if not VLLM_VALUE.match(arg):
                raise _not_a_value(f"{key}.{i}", arg, takes)
            takes = None
            continue
        if any(c.isspace() for c in arg):  # one argv item each: "--a=1 --trust-remote-code" hides a second flag
            raise SpecError(f"{key}.{i}: {arg!r} holds whitespace; give each option and value as its own item")
        flag, eq, value = arg.partition("=")
        if flag not in VLLM_FLAGS and flag not in allowed:
            if arg.startswith("-"):
                raise SpecError(
                    f"{key}.{i}: {flag!r} is not allowed in a run submitted to the service (vLLM flags that load code "
                    f"or files are not); {rule}"
                )
            raise SpecError(
                f"{key}.{i}: {arg!r} is no flag and follows no flag that takes a value (vLLM would take it as the "
                f"model); {rule}"
            )
        if flag in VLLM_SWITCHES and eq:
            raise SpecError(f"{key}.{i}: {flag} takes no value, got {arg!r}; give {flag} alone")
        if flag in VLLM_VALUE_FLAGS and eq and not VLLM_VALUE.match(value):
            raise _not_a_value(f"{key}.{i}", value, flag)
        if flag not in VLLM_FLAGS and eq and not VLLM_ADMIN_VALUE.match(value):
            raise SpecError(f"{key}.{i}: {value!r} is not a value of {flag}; expected printable ASCII without spaces")
        if flag in VLLM_VALUE_FLAGS and not eq:
            takes = flag
    if takes is not None:
        raise SpecError(f"{key}.{len(args) - 1}: {takes} takes a value; give it as the next item or as {takes}=VALUE")


def _not_a_value(where: str, value: str, flag: str) -> SpecError:
    """The refusal of ``value`` given to ``flag`` of :data:`VLLM_VALUE_FLAGS` (:data:`VLLM_VALUE`)."""
    return SpecError(
        f"{where}: {value!r} is not a value of {flag}; expected a number or a name of ASCII letters, digits, '_', "
        "'.', '+', '-' (not starting with '-')"
    )


def check_job_env(names: Collection[str], allowed: Collection[str]) -> None:
    """Refuse a ``launcher.slurm.env`` name not in :data:`JOB_ENV_NAMES` or ``allowed`` (``JOB_ENV_ALLOW``).

    Raises:
        SpecError: ``launcher.slurm.env: 'LD_PRELOAD' is not allowed in a run submitted to the service ...``.
    """
    for name in names:
        if name not in JOB_ENV_NAMES and name not in allowed:
            raise SpecError(
                f"launcher.slurm.env: {name!r} is not allowed in a run submitted to the service; allowed: "
                f"{', '.join(sorted(JOB_ENV_NAMES | set(allowed)))} (more in JOB_ENV_ALLOW)"
            )


SERVICE_SETS_OUTPUT_DIR = (
    "output_dir: the service chooses the run folder (<ASYNCRL_OUTPUT_DIR>/runs/<id>/<name>); leave output_dir out "
    "of a submitted spec"
)


def check_submitted(data: Mapping[str, Any]) -> None:
    """Refuse a raw spec mapping submitted to the service (``POST /api/runs``, the dashboard's launch form) that sets
    ``output_dir``: the service chooses every run's folder, so the value would be replaced, not used.

    Raises:
        SpecError: ``output_dir`` is given (one line naming it; 422).
    """
    if "output_dir" in data:
        raise SpecError(SERVICE_SETS_OUTPUT_DIR)


CODE_PERMISSION = "the code permission, which admins hold"
"""Who may name code, files and addresses beyond the declared plain data (named in refusals)."""
SHELL_FREE_HARNESSES = frozenset({"null"})
"""Harness ids a submitter without the code permission may pick: ``null`` runs only the environment's own tools;
verifiers' others (``bash``, ``terminus_2``, ``claude_code``, ...) run model-written commands on the worker."""
VERIFIERS_CODE_FIELDS = ("task", "system_prompt")
"""Fields of every verifiers ``TasksetConfig`` that name code, files or addresses (no built-in declares them)."""
_FUNCTION_FIELDS = {"fn", "priority", "weight"}
_JUDGE_FIELDS = {"id", "name", "weight", "model", "sampling", "timeout", "base_url", "prompt", "api_key_var"}
_JUDGE_FIELDS |= {"headers", "headers_from_env"}
JUDGE = ImportPath("judge", form="module")
"""``task.judges[].id``: verifiers imports a module of that name."""
RUN_SECRETS = ("ASYNCRL_", "VLLM_API_KEY")
"""Environment variables of a run's processes that hold its secrets (the run token, the vLLM key): a judge may not
send them anywhere (``api_key_var``, ``headers_from_env``)."""


def check_env_args(key: str, env: EnvConfig, *, may_run_code: bool) -> None:
    """Refuse ``env.args`` (``key`` is ``env`` or ``env.<i>``) that a submitted spec may not pass: a built-in
    environment takes only its declared arguments (``worker/spec/env_args.py``); another environment's arguments are
    declared nowhere the service can read, so they need the code permission. With it, verifiers' own code, file and
    address fields (``task``, ``system_prompt``) are allowed within the roots and hosts (:func:`check_verifiers_fields`).

    Raises:
        SpecError: ``env.args.task: not an argument a submitted spec may give 'reverse_text'; allowed: ...``.
        CodeNotAllowed: ``env.args``: an installed package's environment, from a submitter without the permission.
    """
    args = dict(env.args)
    if may_run_code:
        check_verifiers_fields(f"{key}.args", {k: args.pop(k) for k in VERIFIERS_CODE_FIELDS if k in args})
    if env.id in BUILTIN_ENV_ARGS:
        check_builtin_args(f"{key}.args", env.id, args)
    elif args and not may_run_code:
        raise CodeNotAllowed(
            f"{key}.args: environment {env.id!r} declares no arguments the service can check; only a submitter with "
            f"{CODE_PERMISSION} may pass them (the built-in environments' arguments are open to all)"
        )


def _table(key: str, value: Any, fields: Collection[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(f"{key}: expected a table, got {type(value).__name__}")
    for name in value:
        if name not in fields:
            raise SpecError(f"{key}.{name}: not a field the service passes on; allowed: {', '.join(sorted(fields))}")
    return value


def _env_name(key: str, name: Any) -> None:
    if not isinstance(name, str) or name.startswith(RUN_SECRETS):
        raise SpecError(
            f"{key}: {name!r} is not allowed in a run submitted to the service; allowed: a variable that holds no "
            f"secret of the run (not {', '.join(p + '*' if p.endswith('_') else p for p in RUN_SECRETS)})"
        )


def check_verifiers_fields(key: str, fields: Mapping[str, Any]) -> None:
    """Check verifiers' code, file and address fields of a taskset config (``key`` is the ``env.args`` key) against
    the service's roots and hosts: ``system_prompt`` and a judge's ``prompt`` are files under ``DATA_ROOTS``; every
    ``task.rewards|metrics|stops.<name>.fn`` is a ``package.module:function`` of an allowed package (never a file
    path); a judge's ``id`` a module of an allowed package, its ``base_url`` loopback or a host of
    ``INFERENCE_ALLOW_HOSTS``, and the variables it sends hold no secret of the run. Other keys are refused.

    Raises:
        SpecError | CodeNotAllowed | AddressNotAllowed: the first field not allowed, naming its key.
    """
    if (prompt := fields.get("system_prompt")) is not None:
        check_data_path(f"{key}.system_prompt", str(prompt), settings.DATA_ROOTS)
    if "task" not in fields:
        return
    task = _table(f"{key}.task", fields["task"], {"rewards", "metrics", "stops", "judges"})
    for group in ("rewards", "metrics", "stops"):
        for name, fn in _table(f"{key}.task.{group}", task.get(group, {}), task.get(group, {}) or ()).items():
            where = f"{key}.task.{group}.{name}"
            fn = _table(where, fn, _FUNCTION_FIELDS)
            if "fn" in fn:
                check_import_path(f"{where}.fn", str(fn["fn"]), settings.ALLOWED_CODE_PACKAGES, PLUGIN)
    judges = task.get("judges", [])
    if not isinstance(judges, list):
        raise SpecError(f"{key}.task.judges: expected an array of tables, got {type(judges).__name__}")
    for i, judge in enumerate(judges):
        where = f"{key}.task.judges.{i}"
        judge = _table(where, judge, _JUDGE_FIELDS)
        check_import_path(f"{where}.id", str(judge.get("id", "")), settings.ALLOWED_CODE_PACKAGES, JUDGE)
        check_inference_url(str(judge.get("base_url", "")), settings.INFERENCE_ALLOW_HOSTS, key=f"{where}.base_url")
        if (prompt := judge.get("prompt")) is not None:
            check_data_path(f"{where}.prompt", str(prompt), settings.DATA_ROOTS)
        _env_name(f"{where}.api_key_var", judge.get("api_key_var", ""))
        headers = judge.get("headers_from_env", {})
        for header, name in _table(f"{where}.headers_from_env", headers, headers or ()).items():
            _env_name(f"{where}.headers_from_env.{header}", name)


def check_harness(spec: RLSpec | SFTSpec | EvalSpec, *, may_run_code: bool) -> None:
    """Refuse an agent harness that runs model-written commands (:data:`SHELL_FREE_HARNESSES`) to a submitter
    without the code permission.

    Raises:
        CodeNotAllowed: ``orchestrator.harness.id: 'bash' runs model-written commands on the worker; ...``.
    """
    for key, value, kind in import_paths(spec):
        if kind is HARNESS_ID and value not in SHELL_FREE_HARNESSES and not may_run_code:
            raise CodeNotAllowed(
                f"{key}: {value!r} runs model-written commands or an agent program on the worker; allowed: "
                f"{', '.join(sorted(SHELL_FREE_HARNESSES))} (the others need {CODE_PERMISSION})"
            )


class AllocationNotAllowed(Forbidden):
    """A member's spec runs inside an existing Slurm allocation (403)."""


def check(spec: RLSpec | SFTSpec | EvalSpec, *, admin: bool) -> None:
    """Refuse a validated spec that names code or an address the service does not allow (see the module docstring).

    Raises:
        CodeNotAllowed: an import path not allowed (names its key).
        AddressNotAllowed: ``inference.url`` not loopback or allowed; ``inference.host`` or
            ``trainer.weight_sync.master_addr`` not loopback or a node of the run.
        SpecError: ``model.name`` neither a hub id nor under ``MODEL_ROOTS``; an SFT ``data.path`` or
            ``data.eval_path`` not under ``DATA_ROOTS``.
        SpecError: an ``inference.extra_args`` flag, ``launcher.slurm.extra_sbatch`` option or ``launcher.slurm.env``
            name not allowed (names the key).
        AllocationNotAllowed: ``launcher.slurm.allocation`` in the spec of a non-admin (``admin`` false): every job of
            the worker's Slurm user is one, another user's run's included.
    """
    check_spec_code(spec, settings.ALLOWED_CODE_PACKAGES)
    envs = spec.envs if isinstance(spec, RLSpec | EvalSpec) else [spec.env]
    for i, env in enumerate(envs):
        check_env_args("env" if isinstance(spec.env, EnvConfig) else f"env.{i}", env, may_run_code=admin)
    check_harness(spec, may_run_code=admin)
    check_model_name(spec.model.name, settings.MODEL_ROOTS, hub_offline=settings.HF_HUB_OFFLINE)
    if isinstance(spec, SFTSpec):
        for field, path in (("data.path", spec.data.path), ("data.eval_path", spec.data.eval_path)):
            if path:
                check_data_path(field, path, settings.DATA_ROOTS)
    slurm = spec.launcher.slurm  # every kind may run as a Slurm job: the same options, the same rules
    check_flags(
        "launcher.slurm.extra_sbatch",
        slurm.extra_sbatch,
        SBATCH_OPTIONS,
        "options that write files or change the job's user or environment are not",
    )
    check_job_env(slurm.env, settings.JOB_ENV_ALLOW)
    if slurm.allocation is not None and not admin:
        raise AllocationNotAllowed(
            f"launcher.slurm.allocation: only an admin may run inside an existing allocation (job {slurm.allocation}): "
            "the worker's Slurm jobs include other users' runs"
        )
    if not isinstance(spec, RLSpec):  # an SFT run or an eval job: no addresses or vLLM flags
        return
    check_inference_url(spec.inference.url, settings.INFERENCE_ALLOW_HOSTS)
    for i, url in enumerate(spec.inference.urls):
        check_inference_url(url, settings.INFERENCE_ALLOW_HOSTS, key=f"inference.urls.{i}")
    nodes = nodelist(spec)
    check_run_host("inference.host", spec.inference.host, nodes)
    check_run_host("trainer.weight_sync.master_addr", spec.trainer.weight_sync.master_addr, nodes)
    check_vllm_args(spec.inference.extra_args, settings.INFERENCE_ALLOW_FLAGS)
