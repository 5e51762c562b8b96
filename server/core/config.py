"""Service settings, read from the environment (and ``.env``) once, at import.

Without ``DATABASE_URL`` / ``CELERY_BROKER_URL`` the service runs embedded: an SQLite file and a
file-backed Celery transport under ``ASYNCRL_HOME`` (default ``~/.asyncrl``), so one machine needs no
services. With them (CI, compose, cluster) it uses Postgres and Redis.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", extra="ignore")

    ASYNCRL_HOME: Path = Path("~/.asyncrl").expanduser()
    """Embedded-mode state: the SQLite database, the broker folder and the generated secret. Kept private
    (:meth:`Settings.private_home`): mode 0700, 0711 when ``ASYNCRL_OUTPUT_DIR`` is inside it (runs must enter it)."""
    DATABASE_URL: str = ""
    """SQLAlchemy URL, e.g. ``postgresql+psycopg://user@host:5432/asyncrl``; empty = SQLite in ASYNCRL_HOME."""
    CELERY_BROKER_URL: str = ""
    """e.g. ``redis://127.0.0.1:6379/0``; empty = a file-backed transport in ASYNCRL_HOME (no Redis)."""
    CELERY_QUEUE: str = "asyncrl"
    """Control-plane queue (launch, stop, reconcile, webhooks) the server enqueues to and the worker consumes."""
    CELERY_EXPORT_QUEUE: str = ""
    """Queue of the ``export_run`` tasks (model exports: minutes and GiBs each), consumed by the export worker that
    ``asyncrl worker`` starts beside its control-plane one, so a long export never delays a launch; empty =
    ``<CELERY_QUEUE>-exports``."""
    EXPORT_MAX_DELIVERIES: Annotated[int, Field(ge=1, le=20)] = 2
    """Deliveries of one export request (a worker killed mid-export, e.g. out of memory, has it redelivered); the
    next one records ``export_failed`` instead of trying again."""
    EXPORT_REQUEST_TIMEOUT_S: Annotated[float, Field(ge=60.0)] = 6 * 3600.0
    """An export request that has not ended this long after it was made is marked failed (its task was lost or
    its worker is gone), so the step can be exported again; reconcile also fails at once an export whose worker
    process on this machine is gone."""
    CELERY_VISIBILITY_TIMEOUT_S: Annotated[int, Field(ge=60)] = 4 * 3600
    """Redis redelivers an unacked task after this long; keep it above the longest task (launch: ~1 s)."""
    ASYNCRL_OUTPUT_DIR: Path = Path("outputs")
    """Run directories of service-launched runs go to ``<ASYNCRL_OUTPUT_DIR>/runs/<id>/<name>``."""
    ASYNCRL_SERVER_URL: str = "http://127.0.0.1:8000"
    """Base URL the run processes use to reach this server."""
    SECRET_KEY: str = ""
    """Derives per-run tokens (HMAC); empty = generated once into ASYNCRL_HOME/secret_key."""
    MAX_BODY_BYTES: Annotated[int, Field(ge=1024)] = 8 * 1024 * 1024
    """Larger request bodies are refused with 413."""
    MAX_METRIC_POINTS: Annotated[int, Field(ge=1)] = 20_000
    """Points per ``POST /api/runs/{id}/metrics`` batch."""
    RECONCILE_INTERVAL_S: Annotated[float, Field(ge=1.0)] = 30.0
    """Celery beat runs ``asyncrl.reconcile`` (fail runs whose supervisor died) this often."""
    WORKER_HEARTBEAT_S: Annotated[float, Field(ge=1.0)] = 10.0
    """A worker on ``CELERY_QUEUE`` writes a heartbeat into the broker this often; ``/healthz`` reports no worker
    when none beat in three times this (``server/jobs/heartbeat.py``)."""
    WEBHOOK_ALLOW_PRIVATE: bool = False
    """Webhooks may target loopback, private (RFC 1918, ULA) and shared-address-space addresses, also embedded in
    IPv6 forms: an admin's explicit choice (the receivers are this machine's or this network's services, which any
    user may then reach). Off by default, compose included; ``WEBHOOK_ALLOW_HOSTS`` allows single hosts instead."""
    WEBHOOK_ALLOW_HOSTS: list[str] = Field(default_factory=list)
    """Hosts or IPs webhooks may target although loopback, private, link-local or cloud metadata (JSON list in the
    environment)."""
    WEBHOOK_MAX_ATTEMPTS: Annotated[int, Field(ge=1, le=100)] = 8
    """Tries of one delivery before it is marked failed (a replay starts over)."""
    WEBHOOK_BACKOFF_BASE_S: Annotated[float, Field(gt=0)] = 2.0
    """Wait before retry n is base * 2**(n-1) seconds, at most WEBHOOK_BACKOFF_MAX_S."""
    WEBHOOK_BACKOFF_MAX_S: Annotated[float, Field(gt=0)] = 600.0
    WEBHOOK_TIMEOUT_S: Annotated[float, Field(gt=0)] = 10.0
    """Per-request timeout of a delivery (connect, read)."""
    ALERT_STALL_CHECK_S: Annotated[float, Field(ge=1.0)] = 15.0
    """Celery beat checks ``stall`` alert rules this often."""
    PROMETHEUS_MAX_RUNS: Annotated[int, Field(ge=0, le=10_000)] = 100
    """Live runs (not completed, failed or cancelled) whose metrics ``GET /metrics`` exports, newest first
    (``asyncrl_run_metric``, ``asyncrl_run_step``: ``server/core/telemetry.py``); 0 = none, only the control plane.
    The runs left out are counted in ``asyncrl_run_metrics_left_out{cap="runs"}``."""
    PROMETHEUS_MAX_METRICS_PER_RUN: Annotated[int, Field(ge=1, le=10_000)] = 100
    """``(source, name)`` series one run exports at most, the last ones in (source, name) order; the runs that had
    more are counted in ``asyncrl_run_metrics_left_out{cap="metrics"}``. With ``PROMETHEUS_MAX_RUNS``, a scrape
    holds at most their product of ``asyncrl_run_metric`` series."""
    SWEEP_TICK_S: Annotated[float, Field(ge=0.5)] = 10.0
    """Celery beat advances running sweeps (prune, start trials: ``server/services/sweeps.py``) and pipelines (next
    stage: ``server/services/pipelines.py``) this often."""

    # -- limits: concurrent runs and the capacity a worker declares (server/services/capacity.py)
    MAX_RUNS_PER_USER: Annotated[int, Field(ge=1)] = 4
    """Launched runs (starting, running, paused) one owner may have at once; later ones wait in ``queued`` with
    the reason and start, oldest first, when one of them ends."""
    MAX_QUEUED_RUNS_PER_USER: Annotated[int, Field(ge=1)] = 100
    """Runs one owner may have waiting in ``queued`` at once; a submission beyond it is refused (422)."""
    MAX_RUNS_PER_WORKER: Annotated[int, Field(ge=1)] = 2
    """Local runs one worker machine runs at once; later ones wait in ``queued`` like MAX_RUNS_PER_USER."""
    WORKER_NAME: str = ""
    """Name under which a worker declares its capacity and launches runs; empty = the host name."""
    WORKER_CORES: Annotated[int, Field(ge=1)] | None = None
    """Cores the worker declares; unset = its CPU affinity mask."""
    WORKER_MEMORY_GIB: Annotated[float, Field(gt=0)] | None = None
    """Memory (GiB) the worker declares; unset = MemTotal."""
    WORKER_GPUS: Annotated[int, Field(ge=0)] | None = None
    """GPUs the worker declares; unset = those ``nvidia-smi -L`` lists."""

    # -- user code and run processes (issue 16: running user code is a permission). Comma-separated lists.
    ALLOWED_CODE_PACKAGES: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Top-level packages (installed on the workers) whose code a submitted spec may name in ``env.id``,
    ``orchestrator.harness.id`` and every other import path (``worker/spec/user_code.py``); asyncrl's built-in
    environments and those registered under the ``asyncrl.environments`` entry points are always allowed."""
    INFERENCE_ALLOW_HOSTS: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Hosts a submitted spec's ``inference.url`` may name besides loopback (the run sends weight updates there)."""
    INFERENCE_ALLOW_FLAGS: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """vLLM flags a submitted spec may pass in ``inference.extra_args`` besides the tuning ones
    (``server/services/spec_policy.py`` ``VLLM_FLAGS``), e.g. ``--trust-remote-code``."""
    JOB_ENV_ALLOW: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """``launcher.slurm.env`` names a submitted spec may set besides the safe ones
    (``server/services/spec_policy.py`` ``JOB_ENV_NAMES``), comma-separated."""
    MODEL_ROOTS: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Folders a submitted spec's ``model.name`` may name a path under (besides a hub id ``org/name``); empty =
    ``ASYNCRL_OUTPUT_DIR`` (where SFT runs and ``asyncrl model init`` write models). Relative entries are taken from
    the process's working folder, as relative model paths are (``server/services/spec_policy.py``)."""
    HF_HUB_OFFLINE: bool = False
    """Hub downloads are off on this deployment (the Hugging Face switch, set where the server and workers run): a
    submitted ``model.name`` that is a hub id (``org/name``) must then be in this machine's hub cache (``HF_HOME``),
    else it is refused at submit; with downloads on, a hub id is taken as given and the worker downloads it."""
    DATA_ROOTS: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Folders a submitted SFT spec's ``data.path`` / ``data.eval_path`` may name a path under; empty =
    ``ASYNCRL_OUTPUT_DIR``. Relative entries are taken from the process's working folder
    (``server/services/spec_policy.py`` ``check_data_path``)."""
    RUN_ENV_ALLOW: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Worker variables passed to a run's processes besides ``worker.run.procs.run_environ``'s list (e.g.
    ``HF_TOKEN``); never the database or broker URL, the secret key, ``ASYNCRL_HOME`` or a run token."""

    RUN_USER: str = ""
    """Account a root worker starts each run's supervisor, and so its processes, as (e.g. ``asyncrl-run``): it
    cannot read the secret key file (0600), the database or files of the worker's user. Empty, with ``RUN_UID_BASE``
    0 too: a root worker runs each run as its own uid from 1900000000 (``RUN_UID_BASE``), any other worker as itself.
    That account must be able to run the worker's Python and import asyncrl (checked before each launch: a run it
    cannot start is failed saying so, never run as root; a Python under ``/root`` needs ``chmod o+x /root``, which
    ``scripts/setup.sh`` does) and read the models, and its ``HOME`` holds its caches unless ``HF_HOME`` etc. are
    passed (``RUN_ENV_ALLOW``)."""

    RUN_UID_BASE: int = Field(default=0, ge=0, le=2**31 - 1)
    """A root worker runs run ``n``'s processes as uid and gid ``RUN_UID_BASE + n`` (no account needed; ``HOME`` is
    ``<run home>/user-home``; ``RUN_USER`` is then not used), so that runs, of one user or of several, cannot read each
    other's environment (``/proc/<pid>/environ``: the run token, the vLLM key), signal or trace each other's processes,
    or read or write each other's files (a run's home folder is 2750, its uid's, in the group of
    ``<ASYNCRL_OUTPUT_DIR>/runs``, which the server must be in unless it is root; what a run starts from in another
    run's folder is copied into its own before it starts: ``worker/run/inputs.py``). Pick a base above every account of the worker (a run whose uid is an account's is
    refused). Run ids are never reused, so neither are uids. 0 = every run as ``RUN_USER``, and with ``RUN_USER``
    empty too the default base 1900000000 (``worker.launchers.supervisor.DEFAULT_RUN_UID_BASE``): a root worker never
    runs a run as root (a non-root worker runs runs as itself). The run's uid must be able to run the worker's Python,
    enter ``ASYNCRL_OUTPUT_DIR`` and read the models, as for ``RUN_USER``; it cannot read ``ASYNCRL_HOME`` (0700, or
    0711 when ``ASYNCRL_OUTPUT_DIR`` is inside it), the secret key file or the SQLite database (0600)."""

    RUN_CGROUPS: bool = True
    """A root worker puts each local run's processes in a cgroup of their own (``worker/run/cgroups.py``: killed and
    removed as one when the run ends; ``launcher.memory_limit_gib`` is its memory limit). False, or where cgroups are
    not writable: the supervisor's session is the unit and memory limits are not enforced (a run event says so)."""

    @property
    def export_queue(self) -> str:
        """The queue of the export tasks: ``CELERY_EXPORT_QUEUE``, else ``<CELERY_QUEUE>-exports``."""
        return self.CELERY_EXPORT_QUEUE or f"{self.CELERY_QUEUE}-exports"

    @field_validator(
        "ALLOWED_CODE_PACKAGES",
        "INFERENCE_ALLOW_HOSTS",
        "INFERENCE_ALLOW_FLAGS",
        "JOB_ENV_ALLOW",
        "MODEL_ROOTS",
        "DATA_ROOTS",
        "RUN_ENV_ALLOW",
        mode="before",
    )
    @classmethod
    def _comma_list(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _embedded_defaults(self) -> Settings:
        if not self.DATABASE_URL:
            self.DATABASE_URL = f"sqlite:///{self.ASYNCRL_HOME / 'asyncrl.db'}"
        if not self.CELERY_BROKER_URL:
            self.CELERY_BROKER_URL = "filesystem://"
        if not self.MODEL_ROOTS:
            self.MODEL_ROOTS = [str(self.ASYNCRL_OUTPUT_DIR)]
        if not self.DATA_ROOTS:
            self.DATA_ROOTS = [str(self.ASYNCRL_OUTPUT_DIR)]
        return self

    @property
    def embedded_broker(self) -> bool:
        return self.CELERY_BROKER_URL == "filesystem://"

    def server_url(self) -> str:
        """Base URL run processes report to: ``ASYNCRL_SERVER_URL`` when set, else the URL the newest
        ``asyncrl server`` on this ``ASYNCRL_HOME`` published (``ASYNCRL_HOME/server_url``), else the default."""
        published = self.ASYNCRL_HOME / "server_url"
        if "ASYNCRL_SERVER_URL" not in self.model_fields_set and published.exists():
            return published.read_text().strip() or self.ASYNCRL_SERVER_URL
        return self.ASYNCRL_SERVER_URL

    def publish_server_url(self, host: str, port: int) -> str:
        """Record where this server listens (``0.0.0.0``/``::`` -> loopback) for workers on the same home."""
        host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)
        url = f"http://{host}:{port}"
        self.private_home()
        tmp = self.ASYNCRL_HOME / f".server_url.{os.getpid()}"
        tmp.write_text(url + "\n")
        tmp.replace(self.ASYNCRL_HOME / "server_url")
        return url

    def private_home(self) -> Path:
        """ASYNCRL_HOME, made if missing, with mode 0700, so that a run's uid (``RUN_USER``, its own uid) reads
        nothing of the service's state there (broker messages, beat schedule; the secret key and the SQLite database
        are 0600 besides). When ``ASYNCRL_OUTPUT_DIR`` is inside it (``asyncrl demo``), 0711 instead (run users must
        pass through it to their run folders, but not list it) and every other entry of it loses its group and other
        permissions. An existing folder is set so (when this process may: it owns it)."""
        home = self.ASYNCRL_HOME
        outputs = Path(os.path.abspath(self.ASYNCRL_OUTPUT_DIR))
        inside = outputs.is_relative_to(os.path.abspath(home)) and outputs != Path(os.path.abspath(home))
        mode = 0o711 if inside else 0o700
        home.mkdir(mode=mode, parents=True, exist_ok=True)
        try:
            if home.stat().st_mode & 0o777 != mode:
                home.chmod(mode)
            if inside:
                way = Path(os.path.abspath(home)) / outputs.relative_to(os.path.abspath(home)).parts[0]
                for entry in home.iterdir():
                    st = entry.lstat()
                    if entry.name != way.name and not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                        entry.chmod(st.st_mode & 0o7700)
        except PermissionError:  # not its owner (a worker of another user on a shared home): leave it
            pass
        return home

    def secret_key(self) -> str:
        """SECRET_KEY, or the one generated into ASYNCRL_HOME on first use. The file is created with mode 0600 (no
        moment when another user may read it) and an existing one is set back to 0600."""
        if self.SECRET_KEY:
            return self.SECRET_KEY
        path = self.private_home() / "secret_key"
        if not path.exists():  # written whole under a temporary name, then linked: never seen empty or readable
            tmp = path.with_name(f".secret_key.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            try:
                os.link(tmp, path)
            except FileExistsError:  # another process made it first: use that one
                pass
            finally:
                tmp.unlink()
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return path.read_text().strip()


settings = Settings()
