"""What a spec submitted to the service may name, beyond what the schema checks: code and addresses.

A local ``asyncrl rl`` runs its user's own code on its user's machine; a spec submitted to the service runs on a
shared worker, so it may name only

- code the admin allows: every import path of the spec (``env.id``, ``orchestrator.harness.id``, future custom
  losses, advantages, gates) goes through the one rule :func:`worker.spec.user_code.check_import_path` with the
  setting ``ALLOWED_CODE_PACKAGES``;
- an ``inference.url`` on the worker itself (loopback) or a host in ``INFERENCE_ALLOW_HOSTS``: the run sends
  weight updates and requests there;
- ``inference.extra_args`` flags from :data:`VLLM_FLAGS` (tuning and parallelism) or ``INFERENCE_ALLOW_FLAGS``:
  others load code (``--worker-extension-cls``, ``--middleware``, ``--trust-remote-code``, ``--tool-parser-plugin``)
  or files;
- ``launcher.slurm.extra_sbatch`` options from :data:`SBATCH_OPTIONS` (``--output=/etc/...`` would write a file
  anywhere as the submitting user) and ``launcher.slurm.env`` names that do not change what code loads or where
  the run reports (:data:`JOB_ENV_REFUSED`).

:func:`check` runs at submit (``runs.create``: the API, the dashboard's launch form, fork) and again at launch
(``worker.tasks.launch``: a spec stored before a rule or a setting changed).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection
from urllib.parse import urlsplit

from server.core.config import settings
from worker.spec import RLSpec, SFTSpec, SpecError
from worker.spec.user_code import check_spec_code


class AddressNotAllowed(SpecError):
    """A spec names a network address the service does not let a run reach (one line naming the key)."""


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_inference_url(url: str | None, allowed_hosts: Collection[str]) -> None:
    """Refuse an ``inference.url`` whose host is not loopback (``localhost``, ``127.0.0.0/8``, ``::1``) or one of
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
        f"inference.url: {url!r} is not allowed in a run submitted to the service; allowed: an http(s) URL of a "
        f"loopback address (127.0.0.1, localhost, ::1) or of a host in INFERENCE_ALLOW_HOSTS ({listed})"
    )


VLLM_FLAGS = frozenset(
    {
        *("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp"),
        *("--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--swap-space", "--cpu-offload-gb"),
        *("--kv-cache-dtype", "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill"),
        *("--no-enable-chunked-prefill", "--max-logprobs", "--disable-log-requests", "--enable-log-requests"),
        *("--max-seq-len-to-capture", "--disable-custom-all-reduce"),
    }
)
"""vLLM server flags a submitted spec may pass in ``inference.extra_args``: throughput, memory and parallelism."""
SBATCH_OPTIONS = frozenset(
    {
        *("--constraint", "--gres", "--gpus", "--gpus-per-task", "--cpus-per-task", "--cpus-per-gpu", "--mem"),
        *("--mem-per-cpu", "--mem-per-gpu", "--qos", "--exclusive", "--nodelist", "--exclude", "--comment"),
        *("--nice", "--mail-type", "--begin", "--deadline", "--hint", "--tmp", "--hold"),
    }
)
"""``#SBATCH`` options a submitted spec may add in ``launcher.slurm.extra_sbatch``: placement and resources."""
JOB_ENV_REFUSED = re.compile(r"^(ASYNCRL_\w*|LD_\w*|PYTHON\w*|PATH|BASH_ENV|ENV|HOME|SHELL|DATABASE_URL|CELERY_\w*)$")
"""``launcher.slurm.env`` names a submitted spec may not set: what code loads, where the run reports, secrets."""


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
        flag = _flag(arg)
        if flag is not None and flag not in allowed:
            raise SpecError(
                f"{key}: {flag!r} is not allowed in a run submitted to the service ({what}); allowed: "
                f"{', '.join(sorted(allowed))}" + (f" (more in {setting})" if setting else "")
            )


def check_job_env(names: Collection[str]) -> None:
    """Refuse a ``launcher.slurm.env`` name of :data:`JOB_ENV_REFUSED`.

    Raises:
        SpecError: ``launcher.slurm.env: 'LD_PRELOAD' is not allowed in a run submitted to the service ...``.
    """
    for name in names:
        if JOB_ENV_REFUSED.match(name):
            raise SpecError(
                f"launcher.slurm.env: {name!r} is not allowed in a run submitted to the service; allowed: variables "
                "other than PATH, HOME, SHELL, ENV, BASH_ENV, LD_*, PYTHON*, ASYNCRL_*, CELERY_*, DATABASE_URL"
            )


def check(spec: RLSpec | SFTSpec) -> None:
    """Refuse a validated spec that names code or an address the service does not allow (see the module docstring).

    Raises:
        CodeNotAllowed: an import path not allowed (names its key).
        AddressNotAllowed: ``inference.url`` not loopback or allowed.
        SpecError: an ``inference.extra_args`` flag, ``launcher.slurm.extra_sbatch`` option or ``launcher.slurm.env``
            name not allowed (names the key).
    """
    check_spec_code(spec, settings.ALLOWED_CODE_PACKAGES)
    if not isinstance(spec, RLSpec):
        return
    check_inference_url(spec.inference.url, settings.INFERENCE_ALLOW_HOSTS)
    flags = VLLM_FLAGS | set(settings.INFERENCE_ALLOW_FLAGS)
    check_flags(
        "inference.extra_args",
        spec.inference.extra_args,
        flags,
        "vLLM flags that load code or files are not",
        "INFERENCE_ALLOW_FLAGS",
    )
    slurm = spec.launcher.slurm
    check_flags(
        "launcher.slurm.extra_sbatch",
        slurm.extra_sbatch,
        SBATCH_OPTIONS,
        "options that write files or change the job's user or environment are not",
    )
    check_job_env(slurm.env)
