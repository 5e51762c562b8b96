"""Environment mixtures (``worker/orchestrator/mixture.py``): the weighted env choice, per-env cursors and
checkpoints, per-env metric names and values, the ``[[env]]`` spec's bad inputs, alert rules and chart lines."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from worker.orchestrator.batcher import Rollout, build_batch
from worker.orchestrator.data import TaskSampler
from worker.orchestrator.mixture import (
    EnvMixture,
    MixtureEnv,
    choose_env,
    combine_evals,
    env_draw,
    env_metric,
    env_step_metrics,
)
from worker.spec import DifficultyPoolCurriculum, EnvConfig, OrchestratorConfig, RLSpec, SFTSpec, SpecError
from worker.spec.loading import validate_spec
from worker.spec.user_code import CodeNotAllowed, check_spec_code
from worker.tracking.alert_rules import ThresholdRule, reports

# ----------------------------------------------------------------------------- the weighted choice


def test_choice_is_a_function_of_seed_step_and_slot() -> None:
    picks = [choose_env([3, 1], 7, step, slot) for step in range(1, 6) for slot in range(8)]
    again = [choose_env([3, 1], 7, step, slot) for step in range(1, 6) for slot in range(8)]
    other_seed = [choose_env([3, 1], 8, step, slot) for step in range(1, 6) for slot in range(8)]
    assert picks == again
    assert picks != other_seed  # 40 draws agreeing by chance: about 0.625**40 ~ 7e-9
    assert set(picks) == {0, 1}


def test_choice_follows_the_cumulative_weight_shares() -> None:
    """weights (3, 1): shares (0.75, 1.0), so env 0 exactly when the draw u < 0.75."""
    for step in range(1, 30):
        u = env_draw(0, step, 0)
        assert 0 <= u < 1
        assert choose_env([3, 1], 0, step, 0) == (0 if u < 0.75 else 1)
        assert choose_env([1, 3], 0, step, 0) == (0 if u < 0.25 else 1)


def test_weights_3_to_1_over_many_draws() -> None:
    """4000 draws with p = 0.75: binomial std sqrt(0.75 * 0.25 / 4000) = 0.0068; within 3 std = 0.02."""
    draws = [choose_env([3.0, 1.0], 0, step, slot) for step in range(1, 501) for slot in range(8)]
    assert draws.count(0) / len(draws) == pytest.approx(0.75, abs=0.02)


def test_zero_weight_env_is_never_drawn() -> None:
    assert {choose_env([0, 2, 0], 3, step, slot) for step in range(50) for slot in range(4)} == {1}


def test_metric_naming() -> None:
    assert env_metric("reward_mean", "arithmetic") == "reward_mean/arithmetic"


# ----------------------------------------------------------------------------- per-env cursors and checkpoints


def _mixture(cursors: tuple[int, int] = (0, 0)) -> EnvMixture:
    configs = [EnvConfig(id="reverse_text", weight=3), EnvConfig(id="arithmetic", weight=1)]
    samplers = [TaskSampler(None, seed=0, cursor=k) for k in cursors]
    # no Environment needed to hand out indices
    envs = [MixtureEnv(c, None, None, s) for c, s in zip(configs, samplers, strict=True)]  # type: ignore[arg-type]
    return EnvMixture(envs, seed=0)


def test_each_env_advances_its_own_cursor() -> None:
    mix = _mixture()
    picks = mix.take(1, 8)
    chosen = [choose_env([3, 1], 0, 1, slot) for slot in range(8)]
    assert [env for env, _ in picks] == chosen
    # endless tasksets read in order: env e's k-th group of the step gets task k
    for env in (0, 1):
        assert [task for e, task in picks if e == env] == list(range(chosen.count(env)))
    assert [e.sampler.cursor for e in mix.envs] == [chosen.count(0), chosen.count(1)]


def test_resume_repeats_choices_and_continues_each_cursor(tmp_path: Path) -> None:
    whole = _mixture()
    uninterrupted = [whole.take(step, 4) for step in range(1, 7)]
    first = _mixture()
    for step in range(1, 4):
        first.take(step, 4)
    first.write_state(tmp_path, 3)
    states = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("state.json"))
    assert states == ["envs/arithmetic/state.json", "envs/reverse_text/state.json"]
    # what EnvMixture.load reads, without loading the tasksets
    resumed = _mixture(
        tuple(  # type: ignore[arg-type]  # two cursors
            TaskSampler.resume(tmp_path / "envs" / n, step=3, num_tasks=None, seed=0, batch_size=4).cursor
            for n in ("reverse_text", "arithmetic")
        )
    )
    assert [resumed.take(step, 4) for step in range(4, 7)] == uninterrupted[3:]


def test_one_env_keeps_the_single_cursor_file(tmp_path: Path) -> None:
    mix = EnvMixture([MixtureEnv(EnvConfig(), None, None, TaskSampler(None, seed=0))], seed=0)  # type: ignore[arg-type]
    assert mix.take(1, 3) == [(0, 0), (0, 1), (0, 2)]
    mix.write_state(tmp_path, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # as before mixtures: resumable by older code


def test_pool_sizes_are_logged_per_env_and_alertable(tmp_path: Path) -> None:
    pool = DifficultyPoolCurriculum()
    configs = [EnvConfig(id="reverse_text", name="a"), EnvConfig(id="arithmetic", name="b")]
    samplers = [
        TaskSampler.resume(tmp_path / c.name, step=0, num_tasks=n, seed=0, batch_size=2, curriculum=pool)
        for c, n in zip(configs, (5, 3), strict=True)
    ]
    envs = [MixtureEnv(c, None, None, s) for c, s in zip(configs, samplers, strict=True)]  # type: ignore[arg-type]
    mix = EnvMixture(envs, seed=0)
    taken = mix.take(1, 4, 0, pool)
    metrics = mix.observe(1, [(t, [1.0]) for t in taken], pool)
    # step 1 draws from 5 + 3 unseen tasks
    assert metrics == {
        **{f"pool_size_{p}": n for p, n in (("unseen", 8), ("hard", 0), ("normal", 0), ("easy", 0))},
        **{f"pool_size_{p}/a": n for p, n in (("unseen", 5), ("hard", 0), ("normal", 0), ("easy", 0))},
        **{f"pool_size_{p}/b": n for p, n in (("unseen", 3), ("hard", 0), ("normal", 0), ("easy", 0))},
    }
    assert all(reports("orchestrator", k) for k in metrics)


def test_load_reads_real_envs_and_their_cursors(tmp_path: Path) -> None:
    mix = _mixture((5, 2))
    mix.take(1, 4)
    mix.write_state(tmp_path, 1)
    configs = [EnvConfig(id="reverse_text", weight=3), EnvConfig(id="arithmetic", weight=1)]
    loaded = EnvMixture.load(configs, tmp_path, step=1, seed=0, batch_size=4)
    assert loaded.names == ["reverse_text", "arithmetic"]
    assert [e.sampler.cursor for e in loaded.envs] == [e.sampler.cursor for e in mix.envs]
    assert [e.train.id for e in loaded.envs] == ["reverse_text", "arithmetic"]
    assert [e.eval.split for e in loaded.envs] == ["eval", "eval"]


# ----------------------------------------------------------------------------- per-env metrics


def _rollout(reward: float | None, env: str, v_start: int = 9, n_tokens: int = 3) -> Rollout:
    return Rollout(
        task_key="t",
        prompt_ids=[1, 2],
        completion_ids=list(range(10, 10 + n_tokens)),
        completion_logprobs=[-0.5] * n_tokens,
        completion_text="x",
        finish_reason="length" if n_tokens == 4 else "stop",
        reward=reward,
        advantage=None,
        policy_span=(v_start, v_start),
        temperature=1.0,
        env=env,
    )


def test_step_metrics_split_by_env() -> None:
    """Step 10, max_off_policy_steps 8 (lag = 9 - v_start):
    a, group 0: rewards (0, 1), lag 0: both trained, advantages -0.5, +0.5;
    b, group 1: rewards (0.5, 0.5): zero advantage, dropped;
    b, group 2: rewards (0, 1) at v_start 0: lag 9 > 8, both dropped as stale;
    a, group 3: rewards (1, 0, None), the first of 4 tokens (truncated): advantages +0.5, -0.5, None; two trained.
    """
    groups = [
        [_rollout(0.0, "a"), _rollout(1.0, "a")],
        [_rollout(0.5, "b"), _rollout(0.5, "b")],
        [_rollout(0.0, "b", v_start=0), _rollout(1.0, "b", v_start=0)],
        [_rollout(1.0, "a", n_tokens=4), _rollout(0.0, "a"), _rollout(None, "a")],
    ]
    orch = OrchestratorConfig(group_size=2, max_off_policy_steps=8)
    samples, whole = build_batch(10, groups, orch)
    m = env_step_metrics(10, groups, samples, ["a", "b"])
    assert [s["env"] for s in samples] == ["a", "a", "a", "a"]
    assert m["num_samples/a"] == 4 and m["num_samples/b"] == 0
    assert m["num_groups/a"] == 2 and m["num_groups/b"] == 2
    assert m["reward_mean/a"] == pytest.approx((0 + 1 + 1 + 0) / 4)
    assert m["reward_mean/b"] == pytest.approx((0.5 + 0.5 + 0 + 1) / 4)  # stale rollouts' rewards still count
    assert m["reward_std/b"] == pytest.approx(math.sqrt((0 + 0 + 0.25 + 0.25) / 4))  # mean 0.5
    assert m["reward_missing/a"] == 1 and m["reward_missing/b"] == 0
    assert m["dropped_zero_advantage_groups/b"] == 1 and m["dropped_zero_advantage_groups/a"] == 0
    assert m["dropped_stale/b"] == 2 and m["dropped_stale/a"] == 0
    assert m["dropped_overlong/a"] == 0 and m["dropped_overlong/b"] == 0
    assert m["advantage_abs_mean/a"] == pytest.approx(0.5)
    assert m["truncated_fraction/a"] == pytest.approx(1 / 5) and m["truncated_fraction/b"] == 0
    assert m["completion_len_max/a"] == 4 and m["completion_len_mean/a"] == pytest.approx((3 + 3 + 4 + 3 + 3) / 5)
    assert m["staleness_max/b"] == 9 and m["staleness_mean/b"] == pytest.approx((0 + 0 + 9 + 9) / 4)
    assert m["trained_staleness_max/a"] == 0
    # the per-env counts add up to build_batch's totals
    for name in ("num_samples", "dropped_stale", "dropped_zero_advantage_groups", "reward_missing"):
        assert m[f"{name}/a"] + m[f"{name}/b"] == whole[name], name


def test_drop_group_counts_per_env_where_the_drop_happens() -> None:
    """stale_policy drop_group, step 10, max_off_policy_steps 8 (lag = 9 - v_start):
    a, group 0: rewards (0, 1, 1), the last at v_start 0 (lag 9): the whole group dropped -> dropped_stale/a = 3,
        dropped_stale_groups/a = 1 (the fresh two are not overlong: the old count made them 2 dropped_overlong);
    b, group 1: rewards (0, 1) fresh: trained; b, group 2: rewards (1, None), the None one stale: no reward, so its
        group trains (one sample, advantage 0) and nothing is dropped as stale.
    """
    groups = [
        [_rollout(0.0, "a"), _rollout(1.0, "a"), _rollout(1.0, "a", v_start=0)],
        [_rollout(0.0, "b"), _rollout(1.0, "b")],
        [_rollout(1.0, "b"), _rollout(None, "b", v_start=0)],
    ]
    orch = OrchestratorConfig(
        group_size=2, max_off_policy_steps=8, stale_policy="drop_group", drop_zero_advantage=False
    )
    samples, whole = build_batch(10, groups, orch)
    m = env_step_metrics(10, groups, samples, ["a", "b"])
    assert (m["dropped_stale/a"], m["dropped_stale_groups/a"], m["dropped_overlong/a"]) == (3, 1, 0)
    assert (m["dropped_stale/b"], m["dropped_stale_groups/b"], m["dropped_overlong/b"]) == (0, 0, 0)
    assert (m["num_samples/a"], m["num_samples/b"], m["num_groups/a"], m["num_groups/b"]) == (0, 3, 1, 2)
    assert (whole["dropped_stale"], whole["dropped_stale_groups"], whole["num_samples"]) == (3, 1, 3)
    assert m["reward_missing/b"] == 1 and m["reward_mean/b"] == pytest.approx((0 + 1 + 1) / 3)


def test_overlong_rollouts_counted_per_env() -> None:
    groups = [[_rollout(0.0, "a", n_tokens=7), _rollout(1.0, "a")], [_rollout(0.0, "b"), _rollout(1.0, "b")]]
    orch = OrchestratorConfig(group_size=2, seq_len=8)  # 2 + 7 = 9 tokens > 8
    samples, whole = build_batch(1, groups, orch)
    m = env_step_metrics(1, groups, samples, ["a", "b"])
    assert (m["dropped_overlong/a"], m["dropped_overlong/b"], whole["dropped_overlong"]) == (1, 0, 1)
    assert (m["num_samples/a"], m["num_samples/b"]) == (1, 2)


def test_one_env_adds_no_metric_and_leaves_samples_as_before() -> None:
    groups = [[_rollout(0.0, "reverse_text"), _rollout(1.0, "reverse_text")]]
    samples, _ = build_batch(10, groups, OrchestratorConfig(group_size=2))
    assert env_step_metrics(10, groups, samples, ["reverse_text"]) == {}
    assert all("env" not in s for s in samples)


def test_evals_combined_weighted_by_examples() -> None:
    """reward_mean (0.5 * 10 + 0.8 * 30) / 40 = 0.725; pass@k (0.2 * 10 + 0.6 * 30) / 40 = 0.5."""
    a = {
        "reward_mean": 0.5,
        "pass_at_k": 0.2,
        "k": 1,
        "num_examples": 10,
        "completion_len_mean": 4.0,
        "reward_missing": 1,
    }
    b = {
        "reward_mean": 0.8,
        "pass_at_k": 0.6,
        "k": 1,
        "num_examples": 30,
        "completion_len_mean": 8.0,
        "reward_missing": 0,
    }
    out = combine_evals({"a": a, "b": b})
    assert out["reward_mean"] == pytest.approx(0.725) and out["pass_at_k"] == pytest.approx(0.5)
    assert out["completion_len_mean"] == pytest.approx((40 + 240) / 40)
    assert (out["num_examples"], out["reward_missing"], out["k"]) == (40, 1, 1)
    assert out["reward_mean/a"] == 0.5 and out["pass_at_k/b"] == 0.6 and out["num_examples/b"] == 30
    assert "k/a" not in out
    assert combine_evals({"a": a}) == a  # one env: as before


# ----------------------------------------------------------------------------- spec


def _rl(env: object) -> RLSpec:
    return RLSpec.model_validate({"model": {"name": "m"}, "env": env})


def test_one_table_spec_is_unchanged() -> None:
    spec = _rl({"id": "arithmetic", "args": {"num_train": 4}})
    assert isinstance(spec.env, EnvConfig) and spec.env.name == "arithmetic" and spec.env.weight == 1.0
    assert [e.id for e in spec.envs] == ["arithmetic"]
    stored = RLSpec.model_validate_json('{"model": {"name": "m"}, "env": {"id": "reverse_text", "args": {}}}')
    assert stored.envs[0].name == "reverse_text"  # a spec stored before mixtures loads
    assert RLSpec.model_validate_json(spec.model_dump_json()) == spec


def test_mixture_spec() -> None:
    spec = _rl([{"id": "reverse_text", "weight": 3}, {"id": "arithmetic", "name": "math"}])
    assert [(e.name, e.weight) for e in spec.envs] == [("reverse_text", 3.0), ("math", 1.0)]
    assert RLSpec.model_validate_json(spec.model_dump_json()) == spec


NAME_RULE = "1-64 characters: letters, digits, '_', '.', ':' or '-' (no '/': it ends metric names)"
BAD_ENVS = {
    "duplicate-name": (
        [{"id": "reverse_text"}, {"id": "reverse_text", "weight": 2}],
        "env.1.name: duplicate environment name 'reverse_text'; give each [[env]] its own name (names key per-env "
        "metrics)",
    ),
    "duplicate-explicit-name": (
        [{"id": "reverse_text", "name": "x"}, {"id": "arithmetic", "name": "x"}],
        "env.1.name: duplicate environment name 'x'; give each [[env]] its own name (names key per-env metrics)",
    ),
    "negative-weight": (
        [{"id": "reverse_text"}, {"id": "arithmetic", "weight": -1}],
        "env.1.weight: Input should be greater than or equal to 0, got -1",
    ),
    "negative-weight-one-table": (
        {"id": "reverse_text", "weight": -0.5},
        "env.weight: Input should be greater than or equal to 0, got -0.5",
    ),
    "all-zero": (
        [{"id": "reverse_text", "weight": 0}, {"id": "arithmetic", "weight": 0}],
        "env.weight: the weights are all 0; at least one [[env]] needs weight > 0",
    ),
    "empty": ([], "env: expected one [env] table or a non-empty [[env]] array, got an empty array"),
    "slash-in-name": ([{"id": "reverse_text", "name": "a/b"}], f"env.0.name: expected {NAME_RULE}, got 'a/b'"),
    "unnamed": (
        [{"id": "reverse_text"}, {"id": "pkg/x:f"}],
        f"env.1.name: id 'pkg/x:f' is no name; set name: {NAME_RULE}",
    ),
    "unknown-key": ([{"id": "reverse_text", "wieght": 2}], "unknown key 'env.0.wieght' (did you mean 'env.0.weight'?)"),
    "unknown-key-second-table": (
        [{"id": "reverse_text"}, {"id": "arithmetic", "nmae": "x"}],
        "unknown key 'env.1.nmae' (did you mean 'env.1.name'?)",
    ),
    "zero-weight-one-table": (
        {"id": "reverse_text", "weight": 0},
        "env.weight: the weights must have a positive sum; one [env] needs weight > 0, got 0",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ENVS))
def test_bad_mixture_one_line_naming_the_key(case: str) -> None:
    env, expected = BAD_ENVS[case]
    with pytest.raises(SpecError) as err:
        validate_spec("rl", {"model": {"name": "m"}, "env": env})
    assert str(err.value) == expected


def test_sft_refuses_a_mixture_and_takes_a_one_table_array() -> None:
    with pytest.raises(SpecError) as err:
        validate_spec("sft", {"model": {"name": "m"}, "env": [{"id": "reverse_text"}, {"id": "arithmetic"}]})
    assert str(err.value) == (
        "env: SFT trains on one environment: expected one [env] table, got 2 [[env]] tables (mixtures are for RL runs)"
    )
    one = SFTSpec.model_validate({"model": {"name": "m"}, "env": [{"id": "arithmetic"}]})
    assert one.env.id == "arithmetic"


def test_service_checks_every_env_id() -> None:
    spec = _rl([{"id": "reverse_text"}, {"id": "os:system", "name": "x"}])
    with pytest.raises(CodeNotAllowed, match=r"^env\.1\.id: 'os:system' is not allowed"):
        check_spec_code(spec, allowed=())


# ----------------------------------------------------------------------------- alert rules and charts


def test_alert_rules_take_per_env_metrics() -> None:
    rule = ThresholdRule.model_validate(
        {"kind": "threshold", "metric": "reward_mean/arithmetic", "op": "<", "value": 0}
    )
    assert rule.source == "orchestrator"
    kl = ThresholdRule.model_validate({"kind": "threshold", "metric": "mismatch_kl/x", "op": ">", "value": 0.01})
    assert kl.source == "trainer"
    ev = {"kind": "threshold", "metric": "pass_at_k/x", "op": "<", "value": 0.1, "source": "eval"}
    assert ThresholdRule.model_validate(ev).source == "eval"
    for metric in ("dropped_stale_groups/arithmetic", "pool_size_hard/arithmetic", "pool_size_unseen/x"):
        rule = ThresholdRule.model_validate({"kind": "threshold", "metric": metric, "op": ">", "value": 1})
        assert rule.source == "orchestrator"
    for bad in ("loss/arithmetic", "reward_mean/", "reward_mean/a/b", "pool_size_huge/a"):
        with pytest.raises(ValidationError, match="per environment as <metric>/<env name>"):
            ThresholdRule.model_validate({"kind": "threshold", "metric": bad, "op": "<", "value": 0})


def test_charts_split_by_environment() -> None:
    from server.models import MetricSeries
    from webui import figures

    def _series(steps: list[int], values: list[float | None]) -> MetricSeries:
        return MetricSeries(source="", total=len(steps), step=steps, value=values, time=[0.0] * len(steps))

    assert figures.env_names({"env": {"id": "reverse_text"}}) == []
    envs = figures.env_names({"env": [{"id": "reverse_text"}, {"id": "arithmetic", "name": "math"}]})
    assert envs == ["reverse_text", "math"]
    series = {
        ("orchestrator", "reward_mean"): _series([1, 2], [0.1, 0.2]),
        ("orchestrator", "reward_mean/math"): _series([1, 2], [0.0, 0.1]),
        ("eval", "reward_mean/reverse_text"): _series([0], [0.3]),
    }
    figs = figures.run_figures(series, [], envs)
    assert [t["name"] for t in figs["reward"]["data"]] == ["train", "train math", "eval reverse_text"]
    assert figs["reward"]["data"][1]["y"] == [0.0, 0.1]
    assert [t["name"] for t in figures.run_figures(series, [])["reward"]["data"]] == ["train"]


# ----------------------------------------------------------------------------- trainer: mismatch_kl per env


def _trainer_batch(samples: list[dict]) -> dict:
    from worker.orchestrator.packing import pack

    bins = pack([len(s["input_ids"]) for s in samples], 32)
    return {
        "step": 1,
        "num_samples": len(samples),
        "num_loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "micro_batches": [[samples[i] for i in b] for b in bins],
    }


def test_trainer_mismatch_kl_per_env() -> None:
    """mismatch_kl/<e> is the k3 mean over e's loss tokens: env a's value equals the whole mismatch_kl of a batch
    of a's samples alone, and the token-weighted mean of the per-env values is the step's mismatch_kl. An env with
    no sample this step gets NaN."""
    import torch

    from tests.support.models import tiny_qwen3
    from worker.trainer.train import train_step

    gen = torch.Generator().manual_seed(5)
    samples = []
    for k in range(6):
        prompt, n = torch.randint(0, 300, (4,), generator=gen).tolist(), 2 + k % 3
        samples.append(
            {
                "input_ids": prompt + torch.randint(0, 300, (n,), generator=gen).tolist(),
                "loss_mask": [0] * 4 + [1] * n,
                "sampling_logprobs": [0.0] * 4 + (-torch.rand(n, generator=gen) * 3).tolist(),
                "advantage": 1.0 - k % 2,
                "temperature": 1.0,
                "policy_span": [0, 0],
                "env": "a" if k < 4 else "b",
            }
        )
    envs = [{"id": "reverse_text", "name": n} for n in ("a", "b", "c")]
    spec = validate_spec("rl", {"model": {"name": "unused"}, "orchestrator": {"seq_len": 32}, "env": envs})
    model = tiny_qwen3(tie=False).train()
    whole = train_step(model, _trainer_batch(samples), spec, step=1)  # type: ignore[arg-type]
    only_a = train_step(model, _trainer_batch(samples[:4]), spec, step=1)  # type: ignore[arg-type]
    tokens_a, tokens_b = 2 + 3 + 4 + 2, 3 + 4  # n = 2 + k % 3 for k = 0..3 and 4..5
    assert whole["mismatch_kl/a"] == pytest.approx(only_a["mismatch_kl"], rel=1e-5)
    mixed = (whole["mismatch_kl/a"] * tokens_a + whole["mismatch_kl/b"] * tokens_b) / (tokens_a + tokens_b)
    assert mixed == pytest.approx(whole["mismatch_kl"], rel=1e-6)
    assert math.isnan(whole["mismatch_kl/c"])
    assert math.isnan(only_a["mismatch_kl/b"])
