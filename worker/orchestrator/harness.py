"""Rollouts through verifiers' own agent machinery, for tasksets whose tasks have tools (or no opening prompt).

Each rollout is one `verifiers.v1.Agent.run(task)`: verifiers starts the task's tool servers and the agent
harness (the `null` harness by default: a chat program run as a subprocess per rollout, through `uv`), and
the harness reaches our vLLM server through verifiers' `TrainClient` (token ids + sampling logprobs from
vLLM's ``/inference/v1/generate``; the server runs with ``--enable-scale-out``). verifiers parses the model's
tool calls, runs the tools, feeds the results back, and scores the finished trace with the task's own
`@vf.reward` functions.

`trace_to_rollouts` turns the scored trace into our `Rollout` records: every trainable branch of the trace's
message graph (`Trace.branches`, one per root-to-leaf path; one for a conversation that only ever appended)
becomes one rollout whose ids are the branch's token ids exactly as vLLM sampled them (no re-tokenization),
the prompt being everything before the first model-sampled token; the loss mask is 1 only on model-sampled
tokens (tool results and chat-template scaffold are 0) and the logprobs are vLLM's sampling logprobs there
(0.0 elsewhere). The orchestrator's batcher then treats these rollouts like any other.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import verifiers.v1 as vf

from worker.envs import EnvTask, trace_reward
from worker.orchestrator.batcher import Rollout
from worker.spec import HarnessConfig

logger = logging.getLogger(__name__)

_NO_KEY_VAR = "ASYNCRL_INFERENCE_API_KEY"
"""Env var the TrainClient reads its API key from (our vLLM server takes none: unset means "EMPTY")."""


def harness_missing() -> str | None:
    """What the agent harness needs and this machine lacks (one line), or None.

    The null harness prepares its chat program with `uv` (a PEP 723 script); verifiers looks it up on PATH.
    """
    if _find_uv() is None:
        return "the agent harness needs `uv` (pip install uv), which is not on PATH or next to this Python"
    return None


def _find_uv() -> str | None:
    return shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))


def _ensure_uv_on_path() -> None:
    """verifiers' subprocess runtime runs `uv` by name: put the one next to this Python on PATH if needed."""
    if shutil.which("uv") is None and (uv := _find_uv()) is not None:
        os.environ["PATH"] = f"{Path(uv).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def agent_config(
    model: str,
    inference_url: str,
    *,
    max_tokens: int,
    temperature: float,
    max_turns: int,
    harness: str = "null",
    tool_parser: str | None = "qwen3",
) -> vf.AgentConfig:
    """The verifiers agent for one rollout: `harness` on a local subprocess runtime, sampling `model` from our
    vLLM server at `inference_url` through verifiers' `TrainClient`.

    `max_tokens` bounds each model turn (tokens), `max_turns` the model turns of a rollout. `tool_parser` names
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
        model=model,
        client=client,
        sampling=vf.SamplingConfig(max_tokens=max_tokens, temperature=temperature),
        max_turns=max_turns,
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
                completion_logprobs=logprobs[start:],
                completion_text="\n".join(_render(m) for m in branch.messages[n_prompt:]),
                finish_reason=finish,
                reward=reward,
                advantage=None,
                policy_span=policy_span,
                temperature=temperature,
                completion_mask=[int(s) for s in sampled[start:]],
            )
        )
    return rollouts


def _prompt_messages(branch: Any) -> int:
    return next((i for i, n in enumerate(branch.nodes) if n.sampled), len(branch.nodes))


def _render(message: vf.Message) -> str:
    text = f"[{message.role}] {message.content or ''}"
    for call in getattr(message, "tool_calls", None) or []:
        text += f" <tool_call {call.name}({call.arguments})>"
    return text


class HarnessRunner:
    """Runs rollout groups of a taskset through verifiers' agent harness for the model `model` served at
    `inference_url`, at most `config.max_concurrent` rollouts at once (each may start a subprocess and tool
    servers)."""

    def __init__(self, model: str, inference_url: str, config: HarnessConfig) -> None:
        _ensure_uv_on_path()
        self.model, self.inference_url, self.config = model, inference_url, config
        self._slots = asyncio.Semaphore(config.max_concurrent)

    async def run(
        self, task: EnvTask, *, max_tokens: int, temperature: float, policy_version: Callable[[], int]
    ) -> list[Rollout]:
        """One rollout of `task` (possibly several records: see `trace_to_rollouts`); `max_tokens` per model turn."""
        c = self.config
        config = agent_config(
            self.model,
            self.inference_url,
            max_tokens=max_tokens,
            temperature=temperature,
            max_turns=c.max_turns,
            harness=c.id,
            tool_parser=c.tool_parser,
        )
        async with self._slots:
            v_start = policy_version()
            trace = await vf.Agent(config).run(task)
            span = (v_start, policy_version())
        if not trace.ok:
            logger.warning("rollout of task %s failed: %s", task.key, [e.model_dump() for e in trace.errors])
        return trace_to_rollouts(trace, task_key=str(task.key), temperature=temperature, policy_span=span)

    async def run_group(self, task: EnvTask, *, n: int, **kwargs: Any) -> list[Rollout]:
        """`n` rollouts of `task` (one group), concurrently within the runner's bound; `kwargs` as for `run`."""
        results = await asyncio.gather(*(self.run(task, **kwargs) for _ in range(n)))
        return [r for rollouts in results for r in rollouts]
