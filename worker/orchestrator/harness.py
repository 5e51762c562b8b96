"""Rollouts through verifiers' own agent machinery, for tasksets whose tasks have tools (or no opening prompt).

Each rollout is one `verifiers.v1.Agent.run(task)`: verifiers starts the task's own tool servers (``Task.toolsets``)
and the agent harness (the `null` harness by default: a chat program run as a subprocess per rollout, through `uv`),
and the harness reaches our vLLM server through verifiers' `TrainClient` (token ids + sampling logprobs from
vLLM's ``/inference/v1/generate``; the server runs with ``--enable-scale-out``). verifiers parses the model's
tool calls, runs the tools, feeds the results back, and scores the finished trace with the task's own
`@vf.reward` functions.

Offline: verifiers prepares the chat program with ``uv sync --script`` and forces ``UV_OFFLINE=false`` for it, so
without a lockfile uv asks the package index on every new runtime and fails with no network even when its cache
holds every wheel. `lock_chat_program` writes the program where verifiers' subprocess runtime keeps it (the
content-addressed path it computes itself) with a ``uv lock --script`` lockfile beside it; ``uv sync`` then
installs from the lock and uv's cache without the index. Locking needs the index once, or ``UV_OFFLINE=1`` with a
cache that holds the packages (any earlier harness run on the machine fills it); `uv` and the lockfile are
`worker.orchestrator.harness_runtime`'s.

`trace_to_rollouts` turns the scored trace into our `Rollout` records: every trainable branch of the trace's
message graph (`Trace.branches`, one per root-to-leaf path; one for a conversation that only ever appended)
becomes one rollout whose ids are the branch's token ids exactly as vLLM sampled them (no re-tokenization),
the prompt being everything before the first model-sampled token; the loss mask is 1 only on model-sampled
tokens (tool results and chat-template scaffold are 0) and the logprobs are vLLM's sampling logprobs there
(0.0 elsewhere). Branches that share a prefix are merged (``worker/orchestrator/branches.py``, case C22): a shared
sampled token trains once, a branch that only extends another is one sample, and the batcher counts the trace once
in its group's baseline.

A taskset's shared tools (``Taskset.toolsets``: task-agnostic, like reverse_tool's `reverse`) run once for as long as
`serving_tools` holds them, and every rollout of the taskset borrows them (``env.tools``): one tool server process for
a whole run instead of one per rollout (each such start imports verifiers: ~3.6 s of CPU on the 2-core box, and a
tool run of 3 steps of 2 groups of 4 started 32 of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import verifiers.v1 as vf

from worker.envs import Environment, EnvTask, trace_reward
from worker.orchestrator.batcher import Rollout
from worker.orchestrator.branches import merge_branches
from worker.orchestrator.harness_runtime import ensure_uv_on_path, lock_chat_program
from worker.spec import HarnessConfig

logger = logging.getLogger(__name__)

_NO_KEY_VAR = "ASYNCRL_INFERENCE_API_KEY"
"""Env var the TrainClient reads its API key from: the run's key (``worker.inference.auth``; unset means "EMPTY")."""


def agent_config(
    model: str,
    inference_url: str,
    *,
    max_tokens: int,
    temperature: float,
    max_turns: int,
    harness: str = "null",
    tool_parser: str | None = "qwen3",
    served_model: str | None = None,
    max_total_tokens: int | None = None,
) -> vf.AgentConfig:
    """The verifiers agent for one rollout: `harness` on a local subprocess runtime, sampling from our vLLM server
    at `inference_url` through verifiers' `TrainClient`: requests name `served_model` (default `model`), the
    server's name for the weights it holds, and prompts are rendered with `model`'s chat template and tokenizer.

    `max_tokens` bounds each model turn (tokens), `max_turns` the model turns of a rollout, `max_total_tokens` (None:
    no cap) the last call's prompt + completion tokens before verifiers refuses another turn (soft by one turn: the
    turn that crosses it completes). `tool_parser` names
    the `renderers` parser that reads tool calls out of sampled token ids (``qwen3``: Hermes-style
    ``<tool_call>{json}</tool_call>``); the chat template is the model's own (renderers' default renderer).
    """
    from renderers import DefaultRendererConfig
    from verifiers.v1.clients import TrainClientConfig
    from verifiers.v1.runtimes import SubprocessConfig
    from verifiers.v1.utils.loaders import harness_config_type

    client = TrainClientConfig(
        base_url=f"{inference_url.rstrip('/')}/v1",
        api_key_var=_NO_KEY_VAR,
        renderer=DefaultRendererConfig(tool_parser=tool_parser),
        renderer_model_name=model,
    )
    return vf.AgentConfig(
        harness=harness_config_type(harness)(id=harness),
        runtime=SubprocessConfig(),
        model=served_model or model,
        client=client,
        sampling=vf.SamplingConfig(max_tokens=max_tokens, temperature=temperature),
        max_turns=max_turns,
        max_total_tokens=max_total_tokens,
        network_notice=False,
    )


def trace_to_rollouts(
    trace: vf.Trace, *, task_key: str, temperature: float, policy_span: tuple[int, int]
) -> list[Rollout]:
    """Our rollout records of one scored verifiers trace (see the module docstring): one per trainable branch
    that holds model-sampled tokens, all with the trace's reward (None if unscored or the rollout failed).

    Raises:
        ValueError: a branch's token ids, sampled mask and logprobs differ in length.
    """
    reward = trace_reward(trace) if trace.ok else None
    finish = next((c.finish_reason for c in reversed(trace.calls) if c.finish_reason), None) or "stop"
    rollouts = []
    for branch in trace.branches:
        ids, sampled, logprobs = branch.token_ids, branch.sampled_mask, branch.logprobs
        if not (len(ids) == len(sampled) == len(logprobs)):
            raise ValueError(
                f"trace {trace.id}: branch {branch.index} has {len(ids)} token ids, {len(sampled)} mask entries "
                f"and {len(logprobs)} logprobs"
            )
        if not branch.trainable or not any(sampled):
            continue
        start = sampled.index(True)
        n_prompt = _prompt_messages(branch)
        rollouts.append(
            Rollout(
                task_key=task_key,
                prompt_ids=ids[:start],
                completion_ids=ids[start:],
                # 0 on every token the model did not sample, whatever the trace carried there (a CI run once saw a
                # masked position with a logprob): the trainer reads logprobs only under the mask
                completion_logprobs=[lp if s else 0.0 for lp, s in zip(logprobs[start:], sampled[start:], strict=True)],
                completion_text="\n".join(_render(m) for m in branch.messages[n_prompt:]),
                finish_reason=finish,
                reward=reward,
                advantage=None,
                policy_span=policy_span,
                temperature=temperature,
                completion_mask=[int(s) for s in sampled[start:]],
            )
        )
    return merge_branches(rollouts, trace=str(trace.id))  # a shared prefix trains once (case C22)


def _prompt_messages(branch: Any) -> int:
    return next((i for i, n in enumerate(branch.nodes) if n.sampled), len(branch.nodes))


@contextlib.asynccontextmanager
async def serving_tools(envs: Sequence[Environment]) -> AsyncIterator[None]:
    """Start the shared tool servers of each environment's taskset (verifiers' ``Taskset.toolsets``) once and lend them
    to its rollouts (``env.tools``, passed to every `HarnessRunner.run` of its tasks) until the block ends; then stop
    them. Environments without a harness or without shared tools are left as they are."""
    from verifiers.v1.mcp import serve_shared

    started: list[Environment] = []
    async with contextlib.AsyncExitStack() as stack:
        try:
            for env in envs:
                toolsets = type(env.taskset).toolsets(env.taskset.config) if env.needs_harness else []
                if toolsets and env not in started:
                    env.tools = await stack.enter_async_context(serve_shared(toolsets))
                    started.append(env)
            yield
        finally:
            for env in started:
                env.tools = {}


def _render(message: vf.Message) -> str:
    text = f"[{message.role}] {message.content or ''}"
    for call in getattr(message, "tool_calls", None) or []:
        text += f" <tool_call {call.name}({call.arguments})>"
    return text


class HarnessRunner:
    """Runs rollout groups of a taskset through verifiers' agent harness for the model `model` (a path or hub
    name: its chat template and tokenizer render the prompts) served at `inference_url`, at most
    `config.max_concurrent` rollouts at once (each may start a subprocess and tool servers). Runners of several
    inference replicas share one limit: give each the first one's `slots` (:meth:`on`)."""

    def __init__(
        self, model: str, inference_url: str, config: HarnessConfig, slots: asyncio.Semaphore | None = None
    ) -> None:
        ensure_uv_on_path()
        if config.id == "null":
            lock_chat_program()
        self.model, self.inference_url, self.config = model, inference_url, config
        self._served: str | None = None
        self.adapter: str | None = None
        """A LoRA run's current adapter name (the orchestrator sets it per policy version): requests name it."""
        self._slots = slots or asyncio.Semaphore(config.max_concurrent)

    def on(self, inference_url: str) -> HarnessRunner:
        """A runner of the same model and harness for the replica at `inference_url`, sharing this one's limit of
        `config.max_concurrent` rollouts at once (the local subprocesses and tool servers are one machine's)."""
        return HarnessRunner(self.model, inference_url, self.config, slots=self._slots)

    async def served_model(self) -> str:
        """The server's name for the model it serves (``/v1/models``; asked once): a shared server keeps the name it
        was started with while it holds the weights of `model` (loaded in place), and vLLM refuses other names.

        Raises:
            InferenceError: the server does not answer ``/v1/models`` within the client's bounded retries.
        """
        if self.adapter is not None:
            return self.adapter
        if self._served is None:
            from worker.inference.client import InferenceClient

            async with InferenceClient(self.inference_url) as client:
                self._served = await client.served_model()
        return self._served

    async def run(
        self,
        task: EnvTask,
        *,
        max_tokens: int,
        temperature: float,
        policy_version: Callable[[], int],
        max_total_tokens: int | None = None,
        tools: Mapping[str, Any] | None = None,
    ) -> list[Rollout]:
        """One rollout of `task` (possibly several records: see `trace_to_rollouts`); `max_tokens` per model turn,
        `max_total_tokens` as for `agent_config`; `tools`: the taskset's shared tool servers, running
        (`serving_tools`: ``env.tools``), lent to the rollout. Every turn names the model served when the rollout got its slot (a
        LoRA run's adapter of the version its span starts at: ``worker.policy.lora_adapters.adapters_in_use`` keeps it
        loaded while the rollout runs)."""
        c = self.config
        async with self._slots:
            served = await self.served_model()  # no await inside for an adapter: it matches policy_version()
            v_start, t0 = policy_version(), time.perf_counter()
            config = agent_config(
                self.model,
                self.inference_url,
                max_tokens=max_tokens,
                temperature=temperature,
                max_turns=c.max_turns,
                harness=c.id,
                tool_parser=c.tool_parser,
                served_model=served,
                max_total_tokens=max_total_tokens,
            )
            trace = await vf.Agent(config).run(task, tools=tools)
            span, seconds = (v_start, policy_version()), time.perf_counter() - t0
        if not trace.ok:
            logger.warning("rollout of task %s failed: %s", task.key, [e.model_dump() for e in trace.errors])
        rollouts = trace_to_rollouts(trace, task_key=str(task.key), temperature=temperature, policy_span=span)
        for r in rollouts:
            r.generation_s = seconds
        return rollouts

    async def run_group(self, task: EnvTask, *, n: int, **kwargs: Any) -> list[Rollout]:
        """`n` rollouts of `task` (one group), concurrently within the runner's bound; `kwargs` as for `run`."""
        results = await asyncio.gather(*(self.run(task, **kwargs) for _ in range(n)))
        return [r for rollouts in results for r in rollouts]
