"""The run specs (``RLSpec``, ``SFTSpec``) and the tables they share: the model, the environment, inference."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from worker.alert_rules import MAX_RULES_PER_RUN, AlertRule
from worker.spec.launcher import LauncherConfig
from worker.spec.orchestrator import OrchestratorConfig
from worker.spec.strict import StrictModel
from worker.spec.trainer import CheckpointConfig, OptimConfig, SchedulerConfig, TrainerConfig
from worker.spec.user_code import ENV_ID

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


class InferenceConfig(StrictModel):
    url: str | None = None
    """Use an already running vLLM server at this base URL instead of starting one."""
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    """0 picks a free port."""
    max_model_len: int = Field(default=512, ge=16, le=1_048_576)
    """vLLM context length in tokens (at most 2**20, past every released model's context)."""
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    """Share of each inference GPU's memory vLLM may take (a fraction: at most 1)."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra ``api_server`` flags, passed through unchanged."""
    connect_timeout_s: float = Field(default=5.0, gt=0, le=3600)
    """Seconds to connect to vLLM (at most an hour: a longer wait is a hung run)."""
    read_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    """Seconds to wait for one response (at most a day)."""
    max_retries: int = Field(default=3, ge=0, le=20)
    """Retries of one request (exponential backoff) before the run fails."""
    startup_timeout_s: float = Field(default=300.0, gt=0, le=86_400)
    """Seconds vLLM may take to come up (at most a day)."""


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
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    alerts: list[AlertRule] = Field(default_factory=list)
    """Alert rules of this run (``worker/alert_rules.py``); the service adds them to its rules at submission. At
    most ``MAX_RULES_PER_RUN``: every metrics upload checks each rule."""

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
        if self.trainer.lora is not None and self.trainer.weight_sync.kind != "filesystem":
            raise ValueError(
                "trainer.lora: a LoRA run publishes its adapter through trainer.weight_sync.kind = 'filesystem'"
            )
        if self.trainer.lora is not None and self.trainer_ranks > 1:
            raise ValueError("trainer.lora: LoRA trains in one trainer process for now (launcher.local: one rank)")
        slurm = self.launcher.slurm
        if self.trainer.lora is not None and self.launcher.kind == "slurm" and slurm.nodes > 1:
            ranks = (slurm.nodes - slurm.inference_nodes) * max(slurm.gpus_per_node, 1)  # the job script's torchrun
            if ranks > 1:
                raise ValueError(
                    f"trainer.lora: LoRA trains in one trainer process for now (launcher.slurm: one trainer node with "
                    f"gpus_per_node <= 1), got {ranks} trainer ranks"
                )
        return self

    @property
    def trainer_ranks(self) -> int:
        """Trainer processes a local launch starts (``launcher.local``): 1 means a plain process, no torchrun."""
        local = self.launcher.local
        return local.trainer_processes or max(len(local.trainer_gpus), 1)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


class SFTDataConfig(StrictModel):
    num_examples: int = Field(default=4096, ge=1, le=10_000_000)
    """Generated prompt/completion pairs (from the environment's train split; held in memory: at most 10**7)."""
    batch_size: int = Field(default=32, ge=1, le=65_536)
    """Samples per optimizer step (at most 65,536)."""


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
    alerts: list[AlertRule] = Field(default_factory=list)
    """Alert rules of this run (``worker/alert_rules.py``), at most ``MAX_RULES_PER_RUN``."""

    _name = field_validator("name")(_check_run_name)
    _alerts = field_validator("alerts", mode="before")(_check_alert_count)

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
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


SPEC_TYPES: dict[str, type[RLSpec] | type[SFTSpec]] = {"rl": RLSpec, "sft": SFTSpec}
