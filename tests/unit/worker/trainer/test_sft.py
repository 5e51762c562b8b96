"""Tool-call warm-up data: reverse_tool's SFT conversations rendered with the chat template and tools, masked on
the assistant turns only, in the form renderers' qwen3 tool parser reads back."""

from __future__ import annotations

import json

import pytest
from renderers import DefaultRenderer, DefaultRendererConfig

from worker.envs import load_environment
from worker.policy.models import TOOL_CALL_TOKENS, build_tokenizer
from worker.trainer.sft import sft_conversation_sample

TOK = build_tokenizer(seed=0)
ENV = load_environment("reverse_tool", split="train", seed=0, system_message=False)


def test_tool_call_delimiters_are_single_tokens() -> None:
    for token in TOOL_CALL_TOKENS:
        (tid,) = TOK.encode(token, add_special_tokens=False)
        assert TOK.convert_ids_to_tokens(tid) == token
    ids = TOK.encode('<tool_call>{"name": "reverse"}</tool_call>', add_special_tokens=False)
    assert ids[0] == TOK.convert_tokens_to_ids("<tool_call>") and ids[-1] == TOK.convert_tokens_to_ids("</tool_call>")


def test_sample_masks_exactly_the_assistant_turns() -> None:
    task = ENV.task(0)
    text, answer = task.data.text, task.data.answer
    sample = sft_conversation_sample(TOK, *ENV.sft_conversation(task))
    ids, mask = sample["input_ids"], sample["loss_mask"]
    assert TOK.decode(ids) == (
        "<|im_start|>system\n# Tools\nreverse(text): Return `text` reversed character by character.<|im_end|>\n"
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        f'<tool_call>{{"name": "reverse", "arguments": {{"text": "{text}"}}}}</tool_call><|im_end|>\n'
        f"<|im_start|>tool\n{answer}<|im_end|>\n<|im_start|>assistant\n"
        f"<reversed_text>{answer}</reversed_text><|im_end|>"
    )
    spans = [TOK.decode([t for t, m in zip(ids, mask, strict=True) if m])]
    assert spans == [
        f'<tool_call>{{"name": "reverse", "arguments": {{"text": "{text}"}}}}</tool_call><|im_end|>'
        f"<reversed_text>{answer}</reversed_text><|im_end|>"
    ]
    # two masked runs: the call turn and the answer turn; the tool turn and its scaffold are 0
    edges = [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]]
    assert len(edges) == 3
    assert "<|im_start|>tool\n" in TOK.decode(ids[edges[1] : edges[2]])


def test_sampled_call_parses_back_with_the_rollout_parser() -> None:
    """What the model learns to sample is what verifiers' TrainClient (renderers, qwen3 parser) reads as a call."""
    task = ENV.task(1)
    sample = sft_conversation_sample(TOK, *ENV.sft_conversation(task))
    ids, mask = sample["input_ids"], sample["loss_mask"]
    start = mask.index(1)
    first_turn = ids[start : ids.index(TOK.convert_tokens_to_ids("<|im_end|>"), start) + 1]
    renderer = DefaultRenderer(TOK, DefaultRendererConfig(tool_parser="qwen3"))
    parsed = renderer.parse_response(first_turn)
    (call,) = parsed.tool_calls
    assert call.name == "reverse" and call.arguments == {"text": task.data.text}
    assert parsed.content == ""
    # and the prompt before it is the renderer's own rendering of the opening messages with the tools
    messages, tools = ENV.sft_conversation(task)
    assert ids[:start] == renderer.render_ids(
        messages[: 2 if messages[0]["role"] == "system" else 1], tools=tools, add_generation_prompt=True
    )


def test_tasks_without_a_conversation_keep_prompt_answer_sft() -> None:
    env = load_environment("reverse_text", split="train", seed=0)
    assert env.sft_conversation(env.task(0)) is None
    messages, tools = ENV.sft_conversation(ENV.task(0))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"text": ENV.task(0).data.text}
    assert tools is not None and tools[0]["function"]["name"] == "reverse"


def test_conversation_without_assistant_turn_is_refused() -> None:
    with pytest.raises(ValueError, match="no assistant message"):
        sft_conversation_sample(TOK, [{"role": "user", "content": "abc"}], None)
