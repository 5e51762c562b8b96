"""verifiers traces (from the agent harness) -> our rollout records: exact ids, loss mask, logprobs, reward.

The traces are hand-made the way verifiers' TrainClient records them (one message-graph node per message,
each holding the tokens it adds; assistant nodes mark their sampled tokens and carry vLLM's logprobs) and
scored by the reverse_tool taskset's own reward function.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import verifiers.v1 as vf
from verifiers.v1.graph import MessageNode

from worker.envs import load_environment
from worker.orchestrator.batcher import build_batch
from worker.orchestrator.harness import trace_to_rollouts
from worker.orchestrator.harness_runtime import harness_missing
from worker.spec import OrchestratorConfig

ENV = load_environment("reverse_tool", split="eval", seed=0)
TASK = ENV.task(3)


def node(
    parent: int | None, message: vf.Message, ids: list[int], sampled: int = 0, logprobs: list[float] | None = None
) -> MessageNode:
    """A node adding `ids`; its last `sampled` ids are model-sampled (with `logprobs`)."""
    mask = [False] * (len(ids) - sampled) + [True] * sampled
    return MessageNode(
        parent=parent, message=message, sampled=sampled > 0, token_ids=ids, mask=mask, logprobs=logprobs or []
    )


def tool_trace(answer: str) -> vf.Trace:
    """system, user, assistant (a tool call), tool result, assistant (the answer)."""
    call = vf.AssistantMessage(
        content="", tool_calls=[vf.ToolCall(id="c0", name="reverse", arguments=f'{{"text": "{TASK.data.text}"}}')]
    )
    nodes = [
        node(None, vf.SystemMessage(content=TASK.data.system_prompt), [1, 2]),
        node(0, vf.UserMessage(content=TASK.data.text), [3, 4]),
        node(1, call, [5, 6, 7, 8], sampled=3, logprobs=[-0.1, -0.2, -0.3]),
        node(2, vf.ToolMessage(content=TASK.data.answer, tool_call_id="c0"), [9, 10]),
        node(
            3,
            vf.AssistantMessage(content=f"<reversed_text>{answer}</reversed_text>"),
            [11, 12, 13],
            sampled=2,
            logprobs=[-0.4, -0.5],
        ),
    ]
    trace = vf.Trace(
        task=vf.TraceTask(type="ReverseToolTask", data=TASK.data, key=TASK.key, hash=TASK.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        nodes=nodes,
        ok=True,
    )
    asyncio.run(TASK.score(trace))
    return trace


def test_tool_trace_becomes_one_rollout_with_tool_tokens_masked() -> None:
    trace = tool_trace(TASK.data.answer)
    (r,) = trace_to_rollouts(trace, task_key=TASK.key, temperature=0.7, policy_span=(2, 3))
    assert r.prompt_ids == [1, 2, 3, 4, 5]  # up to the first sampled token: scaffold stays in the prompt
    assert r.completion_ids == [6, 7, 8, 9, 10, 11, 12, 13]
    assert r.completion_mask == [1, 1, 1, 0, 0, 0, 1, 1]  # tool result and the next turn's scaffold: 0
    assert r.completion_logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5]
    assert r.reward == 1.0  # the taskset's own lcs reward on the final reply
    assert (r.task_key, r.temperature, r.policy_span, r.finish_reason) == ("eval/0/3", 0.7, (2, 3), "stop")
    assert r.completion_text == (
        f'[assistant]  <tool_call reverse({{"text": "{TASK.data.text}"}})>\n[tool] {TASK.data.answer}\n'
        f"[assistant] <reversed_text>{TASK.data.answer}</reversed_text>"
    )
    assert r.record(1)["completion_len"] == 5


def test_reward_is_the_tasksets_and_failed_traces_get_none() -> None:
    half = TASK.data.answer[: len(TASK.data.answer) // 2]
    trace = tool_trace(half)
    (r,) = trace_to_rollouts(trace, task_key=TASK.key, temperature=1.0, policy_span=(0, 0))
    expected = 2 * len(half) / (len(half) + len(TASK.data.answer))
    assert r.reward == pytest.approx(expected) and trace.rewards["lcs"].score == pytest.approx(expected)
    trace.ok = False  # the harness or a tool failed: never scored as 0
    assert trace_to_rollouts(trace, task_key=TASK.key, temperature=1.0, policy_span=(0, 0))[0].reward is None


def test_branches_each_become_a_rollout_and_batch_like_any_other() -> None:
    trace = tool_trace(TASK.data.answer)
    # a re-rendered second turn (the prompt did not extend the first turn's tokens): a second root-to-leaf branch
    trace.nodes.append(node(1, vf.AssistantMessage(content="x"), [20, 21], sampled=1, logprobs=[-0.9]))
    rollouts = trace_to_rollouts(trace, task_key=TASK.key, temperature=1.0, policy_span=(0, 1))
    assert [(r.prompt_ids, r.completion_ids, r.completion_mask) for r in rollouts] == [
        ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13], [1, 1, 1, 0, 0, 0, 1, 1]),
        ([1, 2, 3, 4, 20], [21], [1]),
    ]
    other = tool_trace("")
    group = rollouts + trace_to_rollouts(other, task_key=TASK.key, temperature=1.0, policy_span=(0, 1))
    samples, metrics = build_batch(1, [group], OrchestratorConfig(group_size=2))
    assert len(samples) == 3 and metrics["reward_mean"] == pytest.approx(2 / 3)  # over rollout records
    first = samples[0]
    assert first["input_ids"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert first["loss_mask"] == [0] * 5 + [1, 1, 1, 0, 0, 0, 1, 1]
    assert first["sampling_logprobs"] == [0.0] * 5 + [-0.1, -0.2, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5]
    # the branches share no sampled token (the fork is before the first model turn): both train in full, and the
    # trace counts once in the baseline: mean of the traces' rewards [1, 0] = 0.5 (case C22)
    assert [s["advantage"] for s in samples] == pytest.approx([0.5, 0.5, -0.5])


def test_c22_a_shared_sampled_tool_call_trains_once_and_the_trace_counts_once() -> None:
    trace = tool_trace(TASK.data.answer)
    # verifiers forks after the sampled tool-call node (node 2: ids 5, 6 7 8 sampled): a second tool result and a
    # second answer hang from it, so both root-to-leaf branches hold the call's sampled tokens 6 7 8
    trace.nodes.append(node(2, vf.ToolMessage(content=TASK.data.answer, tool_call_id="c0"), [30, 31]))
    trace.nodes.append(node(5, vf.AssistantMessage(content="y"), [32, 33], sampled=1, logprobs=[-0.7]))
    rollouts = trace_to_rollouts(trace, task_key=TASK.key, temperature=1.0, policy_span=(0, 1))
    assert [(r.prompt_ids, r.completion_ids, r.completion_mask) for r in rollouts] == [
        ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13], [1, 1, 1, 0, 0, 0, 1, 1]),
        ([1, 2, 3, 4, 5], [6, 7, 8, 30, 31, 32, 33], [0, 0, 0, 0, 0, 0, 1]),  # 6 7 8: context here, trained above
    ]
    other = tool_trace("")  # reward 0
    group = rollouts + trace_to_rollouts(other, task_key=TASK.key, temperature=1.0, policy_span=(0, 1))
    assert [r.reward for r in group] == [1.0, 1.0, 0.0]
    samples, _ = build_batch(1, [group], OrchestratorConfig(group_size=2))
    # GRPO over the two traces: mean(1, 0) = 0.5 -> +0.5 for both branches of the forked trace, -0.5 for the other
    # (per branch it would be mean(1, 1, 0) = 2/3 -> [1/3, 1/3, -2/3])
    assert [s["advantage"] for s in samples] == pytest.approx([0.5, 0.5, -0.5])
    # loss weight of the call's sampled tokens (positions 5, 6, 7 of the forked trace's samples): once in total
    forked = samples[:2]
    assert [sum(s["loss_mask"][i] for s in forked) for i in (5, 6, 7)] == [1, 1, 1]


def test_branch_with_no_sampled_tokens_gives_no_rollout() -> None:
    trace = tool_trace(TASK.data.answer)
    trace.nodes = trace.nodes[:2]  # the harness failed before the first model turn
    assert trace_to_rollouts(trace, task_key=TASK.key, temperature=1.0, policy_span=(0, 0)) == []


def test_tool_taskset_runs_unless_uv_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ENV.needs_harness and ENV.is_multi_turn and ENV.unsupported is None and harness_missing() is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no uv on PATH ...
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))  # ... nor next to this Python
    env = load_environment("reverse_tool", split="train", seed=0)
    assert env.unsupported == (
        "environment 'reverse_tool': its tasks have tools; the agent harness needs `uv` (pip install uv), "
        "which is not on PATH or next to this Python"
    )
    assert os.environ["PATH"] == str(tmp_path)


def test_a_tasksets_shared_tool_server_runs_once_while_served_and_answers() -> None:
    """``serving_tools`` starts reverse_tool's `reverse` server once for both splits' environments given (the same
    one twice starts it once), lends it through ``env.tools``, answers a real MCP call through it, and stops it (and
    empties ``env.tools``) at the block's end."""
    import httpx
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from worker.orchestrator.harness import serving_tools

    train, evals = load_environment("reverse_tool", split="train", seed=0), ENV
    urls: list[str] = []

    async def go() -> str:
        async with serving_tools([train, evals, train]):
            urls.extend(server.url for env in (train, evals) for server in env.tools.values())
            async with streamable_http_client(urls[0]) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                result = await session.call_tool("reverse", {"text": "tool text"})
        return str(result.structured_content["result"])

    assert asyncio.run(go()) == "txet loot"
    assert len(urls) == 2 and urls[0] != urls[1]  # one server per environment, each started once
    assert train.tools == evals.tools == {}
    for url in urls:
        with pytest.raises(httpx.ConnectError):
            httpx.get(url, timeout=2)
