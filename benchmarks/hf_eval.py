"""Greedy held-out eval of an exported model loaded by transformers (no vLLM): the other half of the export round trip
(benchmarks/export_roundtrip.sh).

``asyncrl eval`` serves a model with vLLM; this loads the same folder with ``AutoModelForCausalLM`` (a merged export
or a full-weights export), or a base model plus a PEFT adapter folder (``--adapter``: an ``asyncrl export
--adapter-only`` export, via ``peft.PeftModel``), generates greedily (``do_sample=False``) on the first
``--num-examples`` eval tasks of the environment, and scores each completion with the environment's own reward, as
``worker.orchestrator.eval.evaluate`` does. Greedy decoding makes the two engines comparable task by task (they may
differ only where two tokens' logits tie within float32 rounding).

Run: ``.venv/bin/python benchmarks/hf_eval.py --model DIR [--adapter DIR] [--env-args JSON] [--num-examples 64]
[--max-tokens 48] [--out FILE]``; prints ``{"reward_mean", "completion_len_mean", "num_examples", ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def hf_eval(
    model: Path, adapter: Path | None, env_args: dict[str, Any], num_examples: int, max_tokens: int
) -> dict[str, Any]:
    """Greedy eval of ``model`` (+ ``adapter``) with transformers on the reverse_text eval split (module docstring).

    Returns:
        ``{"reward_mean", "completion_len_mean", "num_examples", "rewards"}``; rewards as the env scores them (LCS
        ratio in [0, 1]).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.envs import load_environment
    from worker.orchestrator.prompts import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        net = PeftModel.from_pretrained(net, adapter)
    net.eval()
    env = load_environment("reverse_text", split="eval", seed=0, **env_args)
    count = num_examples if env.num_tasks is None else min(num_examples, env.num_tasks)
    rewards, lengths = [], []
    for i in range(count):
        task = env.task(i)
        ids = prompt_ids(tokenizer, env.prompt_messages(task))
        with torch.no_grad():
            out = net.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        completion = out[0, len(ids) :].tolist()
        if tokenizer.eos_token_id in completion:  # vLLM stops at EOS and counts it as a sampled token
            completion = completion[: completion.index(tokenizer.eos_token_id) + 1]
        text = tokenizer.decode(completion, skip_special_tokens=True)
        rewards.append(asyncio.run(env.score(task, text)))
        lengths.append(len(completion))
    return {
        "reward_mean": statistics.fmean(r for r in rewards if r is not None),
        "completion_len_mean": statistics.fmean(lengths),
        "num_examples": count,
        "rewards": rewards,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--adapter", type=Path, default=None)
    ap.add_argument("--env-args", default="{}")
    ap.add_argument("--num-examples", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = hf_eval(args.model, args.adapter, json.loads(args.env_args), args.num_examples, args.max_tokens)
    text = json.dumps({"model": str(args.model), "adapter": str(args.adapter) if args.adapter else None, **result})
    print(text)  # noqa: T201
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
