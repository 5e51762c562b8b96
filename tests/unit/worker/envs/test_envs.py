"""Built-in environments and the `load_environment` entry point (worker/envs)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import verifiers.v1 as vf

import worker.envs as envs
from worker.envs import EnvironmentLoadError, load_environment, parse_answer
from worker.envs.reverse_text import SYSTEM_PROMPT, ReverseTextData, ReverseTextTask, lcs_ratio


def score(env, task, completion: str) -> float | None:
    return asyncio.run(env.score(task, completion))


@pytest.fixture(scope="module")
def reverse_eval():
    return load_environment("reverse_text", split="eval", seed=0)


@pytest.fixture(scope="module")
def arithmetic_eval():
    return load_environment("arithmetic", split="eval", seed=0, num_eval=20)


# --- rewards -------------------------------------------------------------------------------------

# The text "Ab." reverses to ".bA". Copying it matches one character ("A") of 3 + 3: 2 * 1 / 6.
REVERSE_CASES = [
    pytest.param(".bA", 1.0, id="exact-reversal"),
    pytest.param("Ab.", 1 / 3, id="copy-of-input"),
    pytest.param(".b", 0.8, id="missing-last-char"),  # 2 * 2 / (2 + 3)
    pytest.param("", 0.0, id="empty"),
    pytest.param("  .bA\n", 1.0, id="surrounding-whitespace"),
    pytest.param("<think>flip it</think>\n.bA", 1.0, id="after-think-block"),
    pytest.param("<think>.bA", 0.0, id="unclosed-think"),
    pytest.param("<reversed_text> .bA </reversed_text>", 1.0, id="reversed-text-tags"),
    pytest.param("<think>a</think><think>b</think>.bA", 1.0, id="after-last-think"),
]


@pytest.mark.parametrize(("completion", "expected"), REVERSE_CASES)
def test_reverse_text_reward(reverse_eval, completion, expected):
    task = ReverseTextTask(ReverseTextData(id="t", prompt="Ab.", system_prompt=SYSTEM_PROMPT, text="Ab.", answer=".bA"))
    assert score(reverse_eval, task, completion) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        pytest.param("abc", "abc", 1.0, id="equal"),
        pytest.param("ab", "ba", 0.5, id="swapped-pair"),
        pytest.param("", "abc", 0.0, id="one-empty"),
        pytest.param("", "", 1.0, id="both-empty"),
    ],
)
def test_lcs_ratio(a, b, expected):
    assert lcs_ratio(a, b) == pytest.approx(expected)


def test_reverse_text_eval_task_scores_its_own_reversal(reverse_eval):
    task = reverse_eval.task(7)
    assert task.data.answer == task.data.text[::-1]
    assert score(reverse_eval, task, task.data.answer) == 1.0


@pytest.mark.parametrize(
    ("make_completion", "expected"),
    [
        pytest.param(lambda answer: answer, 1.0, id="correct"),
        pytest.param(lambda answer: str(int(answer) + 1), 0.0, id="off-by-one"),
        pytest.param(lambda answer: "", 0.0, id="empty"),
        pytest.param(lambda answer: f"<think>easy</think> <answer>{answer}</answer>", 1.0, id="think-and-tags"),
        # reasoning-gym gives len(result) / len(reply) when the result is inside the reply
        pytest.param(lambda answer: f"x = {answer}", None, id="result-inside-reply"),
    ],
)
def test_arithmetic_reward_is_reasoning_gyms(arithmetic_eval, make_completion, expected):
    task = arithmetic_eval.task(3)
    completion = make_completion(task.data.answer)
    if expected is None:
        expected = len(task.data.answer) / len(completion)
    assert score(arithmetic_eval, task, completion) == pytest.approx(expected)


def test_arithmetic_prompt(arithmetic_eval):
    messages = arithmetic_eval.prompt_messages(arithmetic_eval.task(0))
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"].startswith("Calculate ")


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        pytest.param(" 42 ", "42", id="bare"),
        pytest.param("<answer>1</answer> then <answer>2</answer>", "2", id="last-tag"),
        pytest.param("<think>3</think>4", "4", id="after-think"),
        pytest.param("<think>3", "", id="unclosed-think"),
    ],
)
def test_parse_answer(reply, expected):
    assert parse_answer(reply, "answer") == expected


# --- tasks and splits ----------------------------------------------------------------------------


def test_reverse_text_prompt_format(reverse_eval):
    task = reverse_eval.task(0)
    assert reverse_eval.prompt_messages(task) == [
        {"role": "system", "content": "Reverse the text."},
        {"role": "user", "content": task.data.text},
    ]
    assert not reverse_eval.is_multi_turn


@pytest.mark.parametrize("env_id", ["reverse_text", "arithmetic"])
@pytest.mark.parametrize("split", ["train", "eval"])
def test_tasks_are_deterministic(env_id, split):
    first = load_environment(env_id, split=split, seed=3, num_eval=30)
    second = load_environment(env_id, split=split, seed=3, num_eval=30)
    # read in a different order: a task depends on its index only
    indices = [0, 5, 29, 1]
    a = [first.task(i) for i in indices]
    b = [second.task(i) for i in reversed(indices)][::-1]
    assert [t.data.prompt for t in a] == [t.data.prompt for t in b]
    assert [t.key for t in a] == [t.key for t in b] == [f"{split}/3/{i}" for i in indices]
    other_seed = load_environment(env_id, split=split, seed=4, num_eval=30)
    assert [other_seed.task(i).data.prompt for i in indices] != [t.data.prompt for t in a]


def test_train_is_endless_by_default_and_finite_when_sized():
    endless = load_environment("reverse_text", split="train", seed=0)
    assert endless.num_tasks is None
    assert endless.task(2000).key == "train/0/2000"
    sized = load_environment("reverse_text", split="train", seed=0, num_train=10)
    assert sized.num_tasks == 10
    assert sized.task(9).data == endless.task(9).data
    with pytest.raises(IndexError):
        sized.task(10)


def test_reverse_text_train_never_repeats_an_eval_sentence():
    # 2-3 character sentences: a small space, so raw train draws do hit eval sentences.
    args = {"min_chars": 2, "max_chars": 3, "num_eval": 20}
    train = load_environment("reverse_text", split="train", seed=0, **args)
    eval_ = load_environment("reverse_text", split="eval", seed=0, **args)
    eval_texts = {eval_.task(i).data.text for i in range(eval_.num_tasks)}
    raw_draws = {train.taskset._sentence("train", i, 0) for i in range(500)}
    assert raw_draws & eval_texts, "the space is too large to exercise the redraw"
    assert not {train.task(i).data.text for i in range(500)} & eval_texts


def test_arithmetic_train_never_repeats_an_eval_question():
    args = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"], "num_eval": 50}
    train = load_environment("arithmetic", split="train", seed=0, **args)
    eval_ = load_environment("arithmetic", split="eval", seed=0, **args)
    eval_questions = {eval_.task(i).data.prompt for i in range(eval_.num_tasks)}
    assert not {train.task(i).data.prompt for i in range(300)} & eval_questions


def test_evicted_tasks_are_rebuilt_identically(monkeypatch):
    monkeypatch.setattr(envs, "_CACHE_WINDOW", 4)
    env = load_environment("arithmetic", split="eval", seed=0, num_eval=30)
    first = env.task(0).data
    env.task(29)
    assert 0 not in env._tasks
    assert env.task(0).data == first


# --- loading -------------------------------------------------------------------------------------


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=0.5)
    async def exact(self, trace: vf.Trace) -> float | None:
        return None if trace.last_reply == "?" else float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.25)
    async def nonempty(self, trace: vf.Trace) -> float:
        return float(bool(trace.last_reply))


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def __init__(self, words: list[str]) -> None:
        super().__init__(vf.TasksetConfig())
        self.words = words

    def load(self):
        return [EchoTask(EchoData(prompt=f"Say {w}", answer=w)) for w in self.words]


def echo_taskset(split: str, prefix: str = "w") -> EchoTaskset:
    """A user taskset, loaded by `"<module>:echo_taskset"`."""
    return EchoTaskset([f"{prefix}-{split}-{i}" for i in range(3)])


def test_load_user_taskset_by_function_path():
    env = load_environment(f"{__name__}:echo_taskset", split="eval", seed=0, prefix="p")
    assert env.num_tasks == 3
    task = env.task(1)
    assert env.prompt_messages(task) == [{"role": "user", "content": "Say p-eval-1"}]
    # weighted sum of the task's own @vf.reward methods: 0.5 * exact + 0.25 * nonempty
    assert score(env, task, "p-eval-1") == pytest.approx(0.75)
    assert score(env, task, "nope") == pytest.approx(0.25)
    assert score(env, task, "?") is None  # a reward returned None


def test_score_trace_keeps_each_reward(reverse_eval):
    trace = asyncio.run(reverse_eval.score_trace(reverse_eval.task(0), "x"))
    assert set(trace.rewards) == {"lcs"}
    assert trace.reward == trace.rewards["lcs"].score


def test_load_builtin_by_class_path():
    env = load_environment("worker.envs.reverse_text:ReverseTextTaskset", split="eval", seed=0, num_eval=5)
    assert env.num_tasks == 5
    builtin = load_environment("reverse_text", split="eval", seed=0, num_eval=5)
    assert env.task(4).data == builtin.task(4).data


@pytest.mark.parametrize(
    ("env_id", "fragment"),
    [
        pytest.param("nope", "unknown environment 'nope'", id="unknown-name"),
        pytest.param("no_such_pkg.mod:load", "'no_such_pkg.mod:load' does not import", id="missing-module"),
        pytest.param("worker.envs:nothing_here", "has no 'nothing_here'", id="missing-attr"),
    ],
)
def test_bad_id_error_names_id_and_builtins(env_id, fragment):
    with pytest.raises(EnvironmentLoadError) as info:
        load_environment(env_id, split="train", seed=0)
    message = str(info.value)
    assert fragment in message
    assert "arithmetic, reverse_text" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("env_id", "valid"),
    [
        pytest.param("reverse_text", "max_chars", id="builtin"),
        pytest.param(f"{__name__}:echo_taskset", "prefix", id="function"),
    ],
)
def test_unknown_arg_error_names_arg_and_valid_ones(env_id, valid):
    with pytest.raises(EnvironmentLoadError, match=rf"no argument 'max_char'; valid: .*\b{valid}\b"):
        load_environment(env_id, split="train", seed=0, max_char=10)


def test_invalid_arg_value_is_a_load_error():
    with pytest.raises(EnvironmentLoadError, match="max_chars"):
        load_environment("reverse_text", split="train", seed=0, min_chars=10, max_chars=5)


def test_entry_point_environment_loads_by_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.worker.spec.test_user_code import fake_distribution

    fake_distribution(tmp_path, "[asyncrl.environments]\nfake_reverse = fakeenvs:make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("fake_reverse", split="eval", seed=0)
    assert env.num_tasks == 3
    assert env.task(2).data == load_environment("reverse_text", split="eval", seed=0, num_eval=3).task(2).data


def test_a_function_re_exported_from_another_package_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fakeenvs:run`` is ``subprocess.run`` (``from subprocess import run``): allowing ``fakeenvs`` does not allow
    it, and ``env.args`` never reach it."""
    from tests.unit.worker.spec.test_user_code import fake_distribution

    fake_distribution(tmp_path, "")
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "ran"
    with pytest.raises(EnvironmentLoadError) as info:
        load_environment("fakeenvs:run", split="train", seed=0, args=["touch", str(marker)])
    assert str(info.value) == (
        "environment 'fakeenvs:run' names subprocess.run, defined outside 'fakeenvs'; name the module that defines it"
    )
    assert not marker.exists()
    assert load_environment("fakeenvs:make", split="eval", seed=0).num_tasks == 3  # its own function loads
