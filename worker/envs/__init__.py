"""Environments for the orchestrator: verifiers v1 Tasksets behind one small interface.

The orchestrator samples completions itself (vLLM, token ids + logprobs), so it needs from an
environment only its tasks, their chat prompt, and a score. `load_environment` builds a
verifiers `Taskset` (a built-in one, or any user Taskset named by import path) and wraps it in an
`Environment`. `Environment.score` runs the task's own `@vf.reward` functions through verifiers'
offline scoring path (`Task.score(trace)`, as `vf replay` re-scores saved traces) on a one-turn
trace built from the completion.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Iterator
from itertools import count
from typing import Any, Generic, Literal, TypeVar

import verifiers.v1 as vf
from pydantic import ValidationError
from verifiers.v1.graph import MessageNode

from worker.orchestrator.harness_runtime import harness_missing
from worker.spec.env_args import SplitArgs
from worker.spec.user_code import BUILTIN_ENVS, ENV_ID
from worker.tracking import progress

logger = logging.getLogger(__name__)

EnvTask = vf.Task
"""A task of an environment: a verifiers `Task` (its data on `task.data`)."""

_LOAD_ARGS = {"split", "seed"}
"""Config fields set by `load_environment` itself, not by `**args`."""
_CACHE_WINDOW = 4096
"""Tasks kept in memory behind the furthest one read (older ones are rebuilt on demand)."""

_THINK = re.compile(r".*</think>", re.DOTALL)


class EnvironmentLoadError(ValueError):
    """An environment id that does not resolve to a Taskset (``arg = "id"``), or arguments it does not take
    (``arg = "args"``)."""

    def __init__(self, message: str, arg: str = "id") -> None:
        super().__init__(message)
        self.arg = arg


def env_error_field(err: Exception, prefix: str = "env.") -> str:
    """The spec field to name for an error of ``load_environment``: ``env.id`` for an id that does not resolve,
    ``env.args`` for arguments the taskset refused (its own ``TypeError``/``ValueError`` included). ``prefix``
    ``"--env-"`` gives the CLI flags (``--env-id`` is spelled ``--env``)."""
    arg = err.arg if isinstance(err, EnvironmentLoadError) else "args"
    return "--env" if (prefix, arg) == ("--env-", "id") else prefix + arg


def parse_answer(reply: str, tag: str) -> str:
    """The answer in a model reply: the text after the last `</think>` (or nothing if a `<think>`
    is never closed), then the content of the last `<tag>...</tag>` if there is one, stripped."""
    text = _THINK.sub("", reply, count=1) if "</think>" in reply else reply
    if "<think>" in text:
        return ""
    matches = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL)
    return (matches[-1] if matches else text).strip()


DataT = TypeVar("DataT", bound=vf.TaskData)


class SingleTurnTask(vf.Task[DataT], Generic[DataT]):
    """A task that ends after the model's first reply, keyed by its `id` ("<split>/<seed>/<index>": unique in the
    taskset and free of the run-local `idx`); subclasses add the `@vf.reward`."""

    @property
    def key(self) -> str:
        return self.data.id or self.hash

    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1


class SplitConfig(vf.TasksetConfig, SplitArgs):
    """Config of a built-in taskset that generates its tasks: which split and the seed (set by `load_environment`),
    and the split sizes (`SplitArgs`: a built-in's arguments are declared in `worker.spec.env_args`, the allow-list
    of what a submitted spec may give it)."""

    split: Literal["train", "eval"] = "train"
    """Which split `load()` yields."""
    seed: int = 0
    """Seed of both splits; the same seed gives the same tasks."""


TaskT = TypeVar("TaskT", bound=vf.Task)
SplitConfigT = TypeVar("SplitConfigT", bound=SplitConfig)


class SplitTaskset(vf.Taskset[TaskT, SplitConfigT], Generic[TaskT, SplitConfigT]):
    """A taskset whose task `index` of a split is a function of the config alone (`make_task`); `load()` yields
    `num_train`/`num_eval` of them, or train tasks forever when `num_train` is None."""

    def __init__(self, config: SplitConfigT) -> None:
        super().__init__(config)
        self.INFINITE = config.split == "train" and config.num_train is None

    def load(self) -> Iterator[TaskT]:
        c = self.config
        size = c.num_eval if c.split == "eval" else c.num_train
        for index in count() if size is None else range(size):
            yield self.make_task(c.split, index)

    def make_task(self, split: Literal["train", "eval"], index: int) -> TaskT:
        """Task `index` of `split`."""
        raise NotImplementedError


class Environment:
    """One split of a Taskset, read by index, with prompts and scores for the orchestrator."""

    def __init__(self, env_id: str, taskset: vf.Taskset, *, split: str, seed: int) -> None:
        self.id = env_id
        self.split = split
        self.seed = seed
        self.taskset = taskset
        self._tasks: dict[int, vf.Task] = {}
        self._iter: Iterator[vf.Task] | None = None
        self._next = 0  # index of the task `_iter` yields next
        self._agent = vf.AgentInfo(config=vf.AgentConfig())
        self.num_tasks: int | None = sum(1 for _ in taskset) if taskset.bounded else None
        """Number of tasks; None for an endless taskset."""
        first = self.task(0) if self.num_tasks != 0 else None
        no_prompt = first is not None and first.data.prompt is None
        self.needs_harness: bool = first is not None and (
            no_prompt or bool(type(taskset).toolsets(taskset.config) or first.toolsets(first.config))
        )
        """True when tasks have tools (or no opening prompt): rollouts run through verifiers' agent harness
        (`worker.orchestrator.harness`)."""
        self.tools: dict[str, Any] = {}
        """The taskset's shared tool servers while `worker.orchestrator.harness.serving_tools` runs them (lent to
        each harness rollout of this split); empty otherwise."""
        self.is_multi_turn: bool = self.needs_harness or hasattr(first, "env_response")
        """True when a task needs more than one model turn: its task answers the model with
        `env_response(trace) -> str | None` (run by `worker.orchestrator.multiturn`), or it has tools
        or no opening prompt (a scripted user opens it)."""
        self.unsupported: str | None = None
        if no_prompt:
            self.unsupported = (
                f"environment {env_id!r}: its tasks have no opening prompt (a user opens them through verifiers' "
                "`Agent.interaction`), which the orchestrator does not drive; give each task a prompt"
            )
        elif self.needs_harness:
            missing = harness_missing()
            self.unsupported = f"environment {env_id!r}: its tasks have tools; {missing}" if missing else None
        """Why the orchestrator cannot run this taskset (one line), or None if it can."""

    def __repr__(self) -> str:
        return f"Environment({self.id!r}, split={self.split!r}, seed={self.seed}, num_tasks={self.num_tasks})"

    def task(self, index: int) -> vf.Task:
        """Task `index` of the split: the same task for the same (env args, split, seed, index)."""
        if index < 0 or (self.num_tasks is not None and index >= self.num_tasks):
            raise IndexError(f"{self.id}: task index {index} out of range (num_tasks={self.num_tasks})")
        if index in self._tasks:
            return self._tasks[index]
        if self._iter is None or index < self._next:  # evicted: replay the deterministic stream
            self._iter, self._next = iter(self.taskset), 0
        while self._next <= index:
            self._tasks[self._next] = next(self._iter)
            self._next += 1
        for old in [i for i in self._tasks if i < self._next - _CACHE_WINDOW]:
            del self._tasks[old]
        return self._tasks[index]

    def prompt_messages(self, task: vf.Task) -> list[dict[str, Any]]:
        """The task's opening chat messages, `[{"role": ..., "content": ...}, ...]`."""
        data = task.data
        if data.prompt is None:
            raise ValueError(f"{self.id}: task {task.key} has no prompt (a multi-turn task opened by its env)")
        messages: list[dict[str, Any]] = []
        if data.system_prompt is not None:
            messages.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [m.model_dump(exclude_none=True) for m in data.prompt]
        return messages

    def sft_conversation(self, task: vf.Task) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None] | None:
        """The whole conversation SFT trains on for `task` and the tool specs its chat template renders, from the
        task's own ``sft_conversation()`` (e.g. a tool call, its result and the answer); None if the task has
        none (SFT then trains on the prompt and ``task.data.answer``)."""
        conversation = getattr(task, "sft_conversation", None)
        return conversation() if conversation is not None else None

    async def score(self, task: vf.Task, completion_text: str) -> float | None:
        """Weighted sum of the task's rewards for one completion; None if the task has no reward or
        one went unscored (a reward function returned None or raised: verifiers records it so)."""
        return trace_reward(await self.score_trace(task, completion_text))

    async def score_trace(self, task: vf.Task, completion_text: str) -> vf.Trace:
        """The scored verifiers trace of one completion: `trace.rewards` (name -> score, weight),
        `trace.metrics`, and `trace.reward`, the weighted sum."""
        return await self.score_conversation(task, [{"role": "assistant", "content": completion_text}])

    def trace(self, task: vf.Task, turns: list[dict[str, Any]]) -> vf.Trace:
        """An unscored verifiers trace of the task's prompt followed by `turns` (chat messages after the
        prompt, `{"role", "content"}`); assistant messages among `turns` are marked sampled (model turns)."""
        prompt = [_message(m) for m in self.prompt_messages(task)]
        messages = prompt + [_message(m) for m in turns]
        nodes = [
            MessageNode(
                parent=i - 1 if i else None,
                message=m,
                sampled=i >= len(prompt) and isinstance(m, vf.AssistantMessage),
            )
            for i, m in enumerate(messages)
        ]
        return vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=self._agent,
            nodes=nodes,
        )

    async def env_response(self, task: vf.Task, turns: list[dict[str, Any]]) -> str | None:
        """The environment's next user message after `turns` (chat messages after the prompt, the last a
        model reply), from the task's own `env_response(trace)`; None ends the conversation.

        Raises:
            TypeError: the task has no `env_response` (a single-turn task).
        """
        respond = getattr(task, "env_response", None)
        if respond is None:
            raise TypeError(f"{self.id}: task {task.key} has no env_response (single-turn)")
        with progress.recorder.call("environment", f"{self.id} env_response"):
            return await respond(self.trace(task, turns))

    async def score_conversation(self, task: vf.Task, turns: list[dict[str, Any]]) -> vf.Trace:
        """The scored verifiers trace of the task's prompt followed by `turns` (chat messages after the
        prompt): `trace.rewards` (name -> score, weight), `trace.metrics`, and `trace.reward`, the weighted sum."""
        trace = self.trace(task, turns)
        try:
            with progress.recorder.call("environment", f"{self.id} score"):
                await task.score(trace)  # no runtime: rewards that need one are skipped, as in `vf replay`
        except vf.TaskError as e:
            logger.warning("%s: scoring task %s failed: %s", self.id, task.key, e)
        return trace


def trace_reward(trace: vf.Trace) -> float | None:
    """A scored trace's weighted reward; None if it has no reward or one went unscored."""
    if not trace.rewards or any(r is None for r in trace.rewards.values()):
        return None
    return trace.reward


_MESSAGE_TYPES = {
    "system": vf.SystemMessage,
    "user": vf.UserMessage,
    "assistant": vf.AssistantMessage,
    "tool": vf.ToolMessage,
}


def _message(message: dict[str, Any]) -> vf.Message:
    return _MESSAGE_TYPES[message["role"]].model_validate(message)


def load_environment(env_id: str, *, split: Literal["train", "eval"], seed: int, **args: Any) -> Environment:
    """The `split` of environment `env_id` under `seed`.

    `env_id` is a built-in id (see `BUILTIN_ENVS`), the name of an `asyncrl.environments` entry point, or
    `"package.module:attr"`, where `attr` is a verifiers `Taskset` class (built from its config class with
    `split`, `seed` and `args`) or a function defined in that package returning a Taskset (called with `args`,
    plus `split` and `seed` if it takes them). `args` are data: nothing here imports what they name. Which ids a
    service-launched run may use is decided before (`worker.spec.user_code`), not here.

    Raises:
        EnvironmentLoadError: `env_id` does not import, names a function another package defines (re-exported),
            or `args` has a name the taskset does not take.
    """
    if split not in ("train", "eval"):
        raise EnvironmentLoadError(f"environment {env_id!r}: split must be 'train' or 'eval', got {split!r}")
    target = _resolve(env_id)
    if isinstance(target, type) and issubclass(target, vf.Taskset):
        taskset = _build_from_class(env_id, target, split, seed, args)
    elif callable(target):
        taskset = _build_from_function(env_id, target, split, seed, args)
    else:
        raise EnvironmentLoadError(f"environment {env_id!r} names {type(target).__name__}, not a Taskset or function")
    if not isinstance(taskset, vf.Taskset):
        raise EnvironmentLoadError(f"environment {env_id!r} returned {type(taskset).__name__}, not a verifiers Taskset")
    return Environment(env_id, taskset, split=split, seed=seed)


def _resolve(env_id: str) -> Any:
    allowed = (
        f"allowed: a built-in ({', '.join(sorted(BUILTIN_ENVS))}) or 'package.module:function' returning a Taskset"
    )
    target = BUILTIN_ENVS.get(env_id) or ENV_ID.registered().get(env_id) or env_id
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise EnvironmentLoadError(f"unknown environment {env_id!r}; {allowed}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvironmentLoadError(f"environment {env_id!r} does not import ({e}); {allowed}") from e
    if not hasattr(module, attr):
        raise EnvironmentLoadError(f"environment {env_id!r}: module {module_name!r} has no {attr!r}; {allowed}")
    found = getattr(module, attr)
    defined_in = str(getattr(found, "__module__", "") or "")
    is_taskset = isinstance(found, type) and issubclass(found, vf.Taskset)
    if not is_taskset and defined_in.split(".")[0] != module_name.split(".")[0]:
        # e.g. "pkg:run" where pkg did `from subprocess import run`: the allowed package is pkg, not subprocess
        raise EnvironmentLoadError(
            f"environment {env_id!r} names {defined_in or '?'}.{attr}, defined outside {module_name.split('.')[0]!r}; "
            f"name the module that defines it"
        )
    return found


def _build_from_class(env_id: str, cls: type[vf.Taskset], split: str, seed: int, args: dict) -> vf.Taskset:
    config_cls = _config_type(cls)
    fields = set(config_cls.model_fields)
    _check_args(env_id, args, fields - _LOAD_ARGS - {"id"})
    given = {name: value for name, value in (("split", split), ("seed", seed)) if name in fields}
    if "split" not in fields:
        logger.warning("%s: taskset config has no 'split' field; train and eval get the same tasks", env_id)
    try:
        config = config_cls(**given, **args)
    except ValidationError as e:
        errors = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise EnvironmentLoadError(f"environment {env_id!r}: invalid args: {errors}", arg="args") from e
    return cls(config)


def _build_from_function(env_id: str, fn: Any, split: str, seed: int, args: dict) -> vf.Taskset:
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        _check_args(env_id, args, set(params) - _LOAD_ARGS)
    given = {name: value for name, value in (("split", split), ("seed", seed)) if name in params}
    if "split" not in params:
        logger.warning("%s: %s takes no 'split'; train and eval get the same tasks", env_id, fn.__name__)
    return fn(**given, **args)


def _check_args(env_id: str, args: dict, valid: set[str]) -> None:
    if unknown := sorted(set(args) - valid):
        raise EnvironmentLoadError(
            f"environment {env_id!r} has no argument {', '.join(map(repr, unknown))}; "
            f"valid: {', '.join(sorted(valid)) or '(none)'}",
            arg="args",
        )


def _config_type(cls: type[vf.Taskset]) -> type[vf.TasksetConfig]:
    from verifiers.v1.utils.generic import concrete_type

    return concrete_type(cls, vf.TasksetConfig) or vf.TasksetConfig
