"""The self_play environment: strict proposal parsing, the proposer's reward by hand, tasks, and one group of
proposer -> solver episodes run by ``rollouts.self_play_group`` against a scripted model (real taskset, real tiny
tokenizer), then scored by rae and hierarchical_grpo through ``build_batch``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from worker.envs import load_environment
from worker.envs.reverse_text import lcs_ratio
from worker.envs.self_play import PROPOSER, SOLVER, parse_proposal, proposer_reward
from worker.inference.client import Completion
from worker.orchestrator.advantages import make_advantage
from worker.orchestrator.batcher import build_batch
from worker.orchestrator.rollouts import rollout_group
from worker.policy.models import build_tokenizer
from worker.spec import OrchestratorConfig


@pytest.mark.parametrize(
    ("reply", "word"),
    [
        ("<word>hello</word>", "hello"),
        ("  abc \n", "abc"),  # no tag: the whole reply, stripped
        ("<think>maybe xyz</think><word>abcdefgh</word>", "abcdefgh"),  # 8 letters: the upper bound
        ("<word>one</word> then <word>three</word>", "three"),  # the last tag
        ("<word>ab</word>", None),  # 2 letters: too short
        ("<word>abcdefghi</word>", None),  # 9 letters: too long
        ("<word>Hello</word>", None),  # a capital
        ("<word>two words</word>", None),
        ("<word>abc.</word>", None),
        ("<word>héllo</word>", None),  # not a-z
        ("<think>never closed <word>abc</word>", None),
        ("", None),
    ],
)
def test_parse_proposal_is_strict(reply: str, word: str | None) -> None:
    assert parse_proposal(reply, 3, 8) == word


@pytest.mark.parametrize(
    ("valid", "solver_rewards", "expected"),
    [
        (True, [1.0, 0.0, 1.0, 0.0], 1.0),  # p = 2/4 solved: 1 - 2*0 = 1
        (True, [1.0, 1.0, 1.0, 1.0], 0.0),  # p = 1: 1 - 2*0.5 = 0 (too easy)
        (True, [0.0, 0.0], 0.0),  # p = 0: too hard
        (True, [1.0, 1.0, 1.0, 0.0], 0.5),  # p = 0.75: 1 - 2*0.25 = 0.5
        (True, [1.0, 0.0, 0.0], pytest.approx(2 / 3)),  # p = 1/3: 1 - 2*(1/6) = 2/3
        (True, [0.5, 0.5], 0.0),  # partly right is not solved: p = 0 (the mean 0.5 would have given 1)
        (True, [0.9, 1.0], 1.0),  # p = 1/2 (0.9 < SOLVED_AT = 1.0)
        (True, [None, 1.0, 0.0], 1.0),  # missing solver rewards are left out: p = 1/2
        (True, [float("nan"), 1.0, float("inf")], 0.0),  # NaN/inf are missing: p = 1/1
        (False, [1.0, 0.0], 0.0),  # invalid proposal: 0 whatever the solvers did
        (True, [None, None], None),  # no solver reward: missing, never 0
        (True, [float("nan")], None),
        (False, [None], None),
    ],
)
def test_proposer_reward_by_hand(valid: bool, solver_rewards: list[float | None], expected: float | None) -> None:
    got = proposer_reward(valid, solver_rewards)
    assert got == (None if expected is None else pytest.approx(expected))


def test_tasks_are_stable_and_bounded() -> None:
    train = load_environment("self_play", split="train", seed=0)
    ev = load_environment("self_play", split="eval", seed=0)
    assert ev.num_tasks == 100 and train.num_tasks is None
    assert not train.is_multi_turn and not train.needs_harness and train.unsupported is None
    again = load_environment("self_play", split="train", seed=0)
    eval_words = {ev.task(i).data.example for i in range(100)}
    for i in range(50):
        task = train.task(i)
        assert task.data == again.task(i).data
        assert 3 <= len(task.data.example) <= 8 and task.data.example.isalpha() and task.data.example.islower()
        assert task.data.example not in eval_words
        assert f"<word>{task.data.example}</word>" in task.data.prompt
    task = train.task(0)
    assert task.solver_task("hello").data.prompt == "hello" and task.solver_task("hello").data.answer == "olleh"
    fallback = task.solver_task(None).data
    assert (fallback.text, fallback.answer) == (task.data.example, task.data.example[::-1])
    custom = load_environment("self_play", split="eval", seed=0, min_letters=5, max_letters=5, num_solvers=2)
    assert len(custom.task(0).data.example) == 5 and custom.task(0).num_solvers == 2
    assert custom.task(0).proposal("<word>abcd</word>") is None
    # system_message = false (the shipped reverse_text RL config's arg): the solver sees its word alone
    bare = load_environment("self_play", split="eval", seed=0, system_message=False)
    messages = bare.prompt_messages(bare.task(0))
    assert len(messages) == 1 and messages[0]["content"].startswith("Write one word of 3-8 lowercase letters")
    solver = bare.task(0).solver_task("abc")
    assert bare.prompt_messages(solver) == [{"role": "user", "content": "abc"}]


def test_bad_env_args_name_the_field() -> None:
    from worker.envs import EnvironmentLoadError

    with pytest.raises(EnvironmentLoadError, match="max_letters .2. must be >= min_letters .3."):
        load_environment("self_play", split="eval", seed=0, max_letters=2)


def test_one_solver_is_refused_at_launch_naming_the_key(tmp_path: Path) -> None:
    """With one solver p is 0 or 1, so R_P is 0 for every proposal: such a run could never train its proposer."""
    from worker.envs import EnvironmentLoadError
    from worker.launchers.local import preflight
    from worker.policy.models import init_model
    from worker.spec import SpecError, validate_spec

    assert [proposer_reward(True, [r]) for r in (0.0, 0.5, 1.0)] == [0.0, 0.0, 0.0]
    with pytest.raises(EnvironmentLoadError) as err:
        load_environment("self_play", split="train", seed=0, num_solvers=1)
    assert str(err.value) == (
        "environment 'self_play': invalid args: num_solvers: got 1; with one solver p is 0 or 1, so the proposer's "
        "reward 1 - 2|p - 1/2| is always 0: use at least 2"
    )
    model = init_model(tmp_path / "model", size="tiny", seed=0)
    spec = validate_spec("rl", {"model": {"name": str(model)}, "env": {"id": "self_play", "args": {"num_solvers": 1}}})
    with pytest.raises(SpecError) as launch:
        preflight(spec)  # type: ignore[arg-type]
    assert str(launch.value).startswith("env.args: environment 'self_play': invalid args: num_solvers: got 1;")
    assert "\n" not in str(launch.value)


class ScriptedModel:
    """``InferenceClient.generate`` that answers by prompt: proposer prompts get the next scripted proposal, solver
    prompts get the scripted answers for the word they show; records every request's seed."""

    def __init__(self, tok: Any, proposals: list[str], answers: dict[str, list[str]]) -> None:
        self.tok, self.proposals, self.answers, self.seeds = tok, list(proposals), answers, []

    async def generate(
        self, ids: list[int], *, n: int, max_tokens: int, temperature: float, seed: int | None = None
    ) -> list[Completion]:
        self.seeds.append(seed)
        prompt = self.tok.decode(ids)
        if "Propose a word" in prompt:
            texts = [self.proposals.pop(0)]
        else:
            word = prompt.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
            texts = self.answers[word]
        assert len(texts) == n
        out = []
        for text in texts:
            token_ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            out.append(Completion(token_ids, [-0.25] * len(token_ids), "stop"))
        return out


def test_a_group_of_two_episodes_runs_both_roles_and_scores_them() -> None:
    tok = build_tokenizer(0)
    env = load_environment("self_play", split="train", seed=0, num_solvers=2)
    fallback = env.task(3).data.example
    # episode 0 proposes "hello": one solver reverses it, one answers "ollxx" (LCS ratio 2*3/10 = 0.6)
    # episode 1 proposes "Hi!" (invalid): its solvers reverse the fallback word, both right
    model = ScriptedModel(
        tok,
        proposals=["<word>hello</word>", "Hi!"],
        answers={"hello": ["olleh", "ollxx"], fallback: [fallback[::-1], fallback[::-1]]},
    )

    async def go() -> list[Any]:
        return await rollout_group(
            model, tok, env, 3, harness=None, n=2, max_tokens=32, temperature=1.0, policy_version=lambda: 0, seed=7
        )

    rollouts = asyncio.run(go())
    assert [(r.role, r.episode) for r in rollouts] == [
        (PROPOSER, 0),
        (SOLVER, 0),
        (SOLVER, 0),
        (PROPOSER, 1),
        (SOLVER, 1),
        (SOLVER, 1),
    ]
    assert lcs_ratio("ollxx", "olleh") == pytest.approx(0.6)
    # solvers: [1, 0.6] -> 1 of 2 solved (0.6 < 1.0) -> p 0.5 -> R_P = 1; episode 1: invalid -> 0, its solvers [1, 1]
    assert [r.reward for r in rollouts] == [
        1.0,
        1.0,
        pytest.approx(0.6),
        0.0,
        1.0,
        1.0,
    ]
    assert rollouts[1].task_key == "train/0/3/solver/hello" and rollouts[4].task_key == f"train/0/3/solver/{fallback}"
    assert rollouts[0].record(1)["role"] == PROPOSER and rollouts[0].record(1)["episode"] == 0
    assert len(set(model.seeds)) == 4 and None not in model.seeds  # one seed per (episode, stage)

    hier = OrchestratorConfig.model_validate({"advantage": {"type": "hierarchical_grpo", "episode_agents": ["solver"]}})
    samples, metrics = build_batch(1, [rollouts], hier, make_advantage(hier.advantage))
    # proposers across the group: mean (1 + 0) / 2 = 0.5 -> [0.5, -0.5]
    # episode 0 solvers: mean 0.8 -> [0.2, -0.2]; episode 1 solvers [1, 1] -> [0, 0]
    assert [r.advantage for r in rollouts] == [
        pytest.approx(0.5),
        pytest.approx(0.2),
        pytest.approx(-0.2),
        pytest.approx(-0.5),
        0.0,
        0.0,
    ]
    assert len(samples) == 6 and metrics["num_samples"] == 6

    rae_config = OrchestratorConfig.model_validate({"group_size": 1, "advantage": {"type": "rae", "decay": 0.5}})
    rae = make_advantage(rae_config.advantage, env="self_play")
    build_batch(1, [rollouts], rae_config, rae)
    # proposers in order: R=1: b_P = 0.5, A = 0.5;  R=0: b_P = 0.25, A = -0.25
    # solvers in order: R=1: b_S = 0.5, A = 0.5;  R=0.6: b_S = 0.55, A = 0.05;  R=1: b_S = 0.775, A = 0.225;
    #                   R=1: b_S = 0.8875, A = 0.1125
    assert [r.advantage for r in rollouts] == [pytest.approx(a) for a in (0.5, 0.5, 0.05, -0.25, 0.225, 0.1125)]
    assert rae.state()["baselines"] == {"self_play": {PROPOSER: pytest.approx(0.25), SOLVER: pytest.approx(0.8875)}}
