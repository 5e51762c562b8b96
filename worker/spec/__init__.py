"""Run-spec schema: the one description of an RL, SFT or eval run.

People write TOML (``asyncrl rl @ base.toml @ override.toml --trainer.optim.lr 1e-5``); the program
writes the resolved spec as JSON into the run directory and the service stores it in Postgres.

| module            | holds                                                                          |
|-------------------|--------------------------------------------------------------------------------|
| ``strict.py``      | ``StrictModel`` (base of every table), ``SpecError``                            |
| ``runs.py``        | ``RLSpec``, ``SFTSpec``, ``EvalSpec``, ``SPEC_TYPES``; model, env and inference tables |
| ``orchestrator.py`` | ``[orchestrator]``: advantages, curricula, gates (unions on ``type``), harness, eval |
| ``trainer.py``     | ``[trainer]``, ``[ckpt]``: optimizer, scheduler, losses (union on ``type``), weight sync |
| ``launcher.py``    | ``[launcher]``: local GPU placement, Slurm                                      |
| ``loading.py``     | files + ``--dotted.key`` overrides, the unknown-key and depth checks, ``validate_spec`` |

The spec is the public schema, so its names are imported from ``worker.spec`` itself. This package
imports nothing heavy (no torch, vllm, fastapi): the server validates specs with it, and
``tests/unit/worker/test_spec.py`` checks that in a fresh interpreter.
"""

from __future__ import annotations

from worker.spec.launcher import LauncherConfig, LocalConfig, SlurmConfig
from worker.spec.loading import (
    CHAINED_MODEL_KEYS,
    MAX_DEPTH,
    check_depth,
    check_unknown_keys,
    deep_merge,
    load_pipeline_data,
    load_spec_data,
    nesting_depth,
    parse_override_value,
    parse_text,
    spec_kind_of_keys,
    validate_spec,
)
from worker.spec.orchestrator import (
    AdvantageConfig,
    AdvantageRangeGate,
    CurriculumConfig,
    CustomAdvantage,
    CustomGate,
    DifficultyPoolCurriculum,
    EvalConfig,
    GateConfig,
    GrpoAdvantage,
    HarnessConfig,
    HierarchicalGrpoAdvantage,
    MaxRLAdvantage,
    OrchestratorConfig,
    PolicyCheckConfig,
    PoolWeights,
    RaeAdvantage,
    StandardCurriculum,
)
from worker.spec.runs import (
    MAX_STEPS,
    RUN_NAME_RULE,
    SPEC_TYPES,
    EnvConfig,
    EvalModelConfig,
    EvalSettings,
    EvalSpec,
    InferenceConfig,
    ModelConfig,
    MonitorConfig,
    RLSpec,
    SFTDataConfig,
    SFTSpec,
    WandbConfig,
)
from worker.spec.strict import SpecError, StrictModel
from worker.spec.trainer import (
    AipoLoss,
    CheckpointConfig,
    CustomLoss,
    DppoKlLoss,
    IcePopLoss,
    IpoLoss,
    LoraConfig,
    LossConfig,
    OptimConfig,
    RLCheckpointConfig,
    SchedulerConfig,
    TrainerConfig,
    WeightSyncConfig,
)

__all__ = [
    "CHAINED_MODEL_KEYS",
    "MAX_DEPTH",
    "MAX_STEPS",
    "RUN_NAME_RULE",
    "SPEC_TYPES",
    "spec_kind_of_keys",
    "AdvantageConfig",
    "AdvantageRangeGate",
    "CustomGate",
    "AipoLoss",
    "CheckpointConfig",
    "RLCheckpointConfig",
    "CurriculumConfig",
    "CustomAdvantage",
    "CustomLoss",
    "DifficultyPoolCurriculum",
    "DppoKlLoss",
    "EnvConfig",
    "EvalConfig",
    "EvalModelConfig",
    "EvalSettings",
    "EvalSpec",
    "GateConfig",
    "GrpoAdvantage",
    "HarnessConfig",
    "HierarchicalGrpoAdvantage",
    "IcePopLoss",
    "InferenceConfig",
    "IpoLoss",
    "LauncherConfig",
    "LocalConfig",
    "LossConfig",
    "MaxRLAdvantage",
    "ModelConfig",
    "MonitorConfig",
    "OptimConfig",
    "OrchestratorConfig",
    "PolicyCheckConfig",
    "PoolWeights",
    "RLSpec",
    "RaeAdvantage",
    "SFTDataConfig",
    "SFTSpec",
    "WandbConfig",
    "SchedulerConfig",
    "SlurmConfig",
    "SpecError",
    "StandardCurriculum",
    "StrictModel",
    "LoraConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "check_depth",
    "check_unknown_keys",
    "deep_merge",
    "load_pipeline_data",
    "load_spec_data",
    "nesting_depth",
    "parse_override_value",
    "parse_text",
    "validate_spec",
]
