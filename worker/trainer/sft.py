"""Supervised fine-tuning on an environment's own (prompt, reference answer) pairs, in one process.

Examples: for each of ``data.num_examples`` training tasks, the environment's chat prompt with the
assistant turn opened plus the task's reference answer (``task.data.answer``) and the end-of-turn
token; an environment with its own SFT conversation (``env.sft_conversation``, tool calls included)
gives the whole conversation instead, with the loss on the assistant turns. Step ``n`` takes the next
``data.batch_size`` examples in a fixed cycle over them. The loss is cross-entropy on the loss-mask
tokens only, a token-level mean over the step's batch; samples are packed into rows of at most
``seq_len`` tokens with attention kept inside each sample (bf16 autocast when ``model.dtype`` is
bfloat16); AdamW and the warmup/decay schedule of ``worker/trainer/optim.py``.

A greedy held-out eval (the environment's reward on the first ``eval_examples`` eval tasks) runs
every ``eval_interval`` steps and at the end, except for environments whose rollouts call tools
(these need the agent harness on vLLM: ``asyncrl eval``).

What it writes into the run directory: ``config.json`` (the spec), one ``metrics.jsonl`` row per
step (source ``sft``: loss, grad_norm, lr, tokens_per_s, step_time_s, eval_reward_greedy), the
trained model with its tokenizer at the end (``save_pretrained`` to ``<run>/final``) and
``summary.json``. It writes no checkpoints (``SFTSpec`` has no ``ckpt`` section): an interrupted SFT
run cannot resume; run again with ``overwrite`` and it starts over from the base model in a fresh run
directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import statistics
import time
from typing import Any

import torch

from worker.envs import load_environment
from worker.orchestrator.data import data_order
from worker.orchestrator.prompts import prompt_ids
from worker.packing import pack
from worker.rundir import RunDir, atomic_write_json
from worker.spec import SFTSpec, SpecError
from worker.trainer.checkpointer import save_final
from worker.trainer.logprobs import selective_log_softmax
from worker.trainer.optim import build_optimizer, build_scheduler
from worker.trainer.packed import micro_batch_tensors

logger = logging.getLogger("asyncrl.sft")


def sft_sample(tokenizer: Any, messages: list[dict[str, Any]], answer: str) -> dict[str, list[int]]:
    """Token ids of prompt + answer + end-of-turn, with the loss mask on the answer tokens."""
    prompt = prompt_ids(tokenizer, messages)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    completion = tokenizer.encode(answer, add_special_tokens=False) + [end]
    return {"input_ids": prompt + completion, "loss_mask": [0] * len(prompt) + [1] * len(completion)}


def sft_conversation_sample(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> dict[str, list[int]]:
    """Token ids of a whole conversation (OpenAI chat messages, assistant tool calls included) rendered as the
    RL rollouts render it (renderers' `DefaultRenderer`: the model's chat template with `tools`, as verifiers'
    TrainClient uses it), cut after the last assistant turn's end-of-turn token. The loss mask is 1 on what the
    model samples in a rollout: each assistant turn's tokens after its ``<|im_start|>assistant\\n`` opener up to and
    including its ``<|im_end|>``; system, user and tool turns and the template scaffold are 0.

    Raises:
        ValueError: no assistant message, or the template renders a conversation prefix differently from the
            start of the whole conversation (then rollouts and SFT would see different tokens).
    """
    from renderers import DefaultRenderer

    renderer = DefaultRenderer(tokenizer)
    full = renderer.render_ids(messages, tools=tools)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mask = [0] * len(full)
    end = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = renderer.render_ids(messages[:i], tools=tools, add_generation_prompt=True)
        if full[: len(prefix)] != prefix:
            raise ValueError(f"chat template: the conversation up to message {i} does not render as a prefix of it")
        end = full.index(end_id, len(prefix)) + 1
        mask[len(prefix) : end] = [1] * (end - len(prefix))
    if end == 0:
        raise ValueError("sft conversation: no assistant message to train on")
    return {"input_ids": full[:end], "loss_mask": mask[:end]}


def sft_loss(model: torch.nn.Module, samples: list[dict[str, list[int]]], n_tokens: int) -> torch.Tensor:
    """Cross-entropy over the loss-mask tokens of one packed micro-batch, divided by ``n_tokens``."""
    t = micro_batch_tensors(samples)
    logits = model(input_ids=t.input_ids, position_ids=t.position_ids, attention_mask=t.attention_mask).logits[0]
    total = logits.new_zeros(())
    for start, length in t.spans:
        lp = selective_log_softmax(
            logits[start : start + length - 1].float(), t.input_ids[0, start + 1 : start + length]
        )
        total = total - lp[t.loss_mask[start + 1 : start + length]].sum()
    return total / max(n_tokens, 1)


@torch.no_grad()
def greedy_eval(model: Any, tokenizer: Any, env: Any, num_examples: int, max_new_tokens: int = 64) -> float:
    """Mean environment reward of greedy completions on the first ``num_examples`` eval tasks."""
    model.eval()
    tokenizer.padding_side = "left"
    count = num_examples if env.num_tasks is None else min(num_examples, env.num_tasks)
    tasks = [env.task(i) for i in range(count)]
    prompts = [prompt_ids(tokenizer, env.prompt_messages(t)) for t in tasks]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)

    async def score_all() -> list[float | None]:
        return list(await asyncio.gather(*(env.score(t, x) for t, x in zip(tasks, texts, strict=True))))

    rewards = [r for r in asyncio.run(score_all()) if r is not None]
    model.train()
    return statistics.fmean(rewards) if rewards else float("nan")


def sft_preflight(spec: SFTSpec) -> tuple[Any, Any, list[dict[str, list[int]]]]:
    """The cheap checks of an SFT spec, before any weights load; ``asyncrl sft --dry-run`` runs them too.

    Returns ``(tokenizer, eval_env, examples)``; examples hold the token ids of every training sample.

    Raises:
        SpecError: the model directory, tokenizer (chat template, ``<|im_end|>``) or environment is unusable,
            its tasks have no reference answer, or an example is longer than ``seq_len``.
    """
    from worker.envs import EnvironmentLoadError, env_error_field
    from worker.models import check_model

    try:
        tokenizer = check_model(spec.model.name)
    except (FileNotFoundError, ValueError) as err:
        raise SpecError(f"model.name: {err}") from None
    if tokenizer.convert_tokens_to_ids("<|im_end|>") in (None, tokenizer.unk_token_id):
        raise SpecError(
            f"model.name: {spec.model.name}: tokenizer has no '<|im_end|>' token (SFT ends answers with it)"
        )
    try:
        env = load_environment(spec.env.id, split="train", seed=spec.seed, **spec.env.args)
        eval_env = load_environment(spec.env.id, split="eval", seed=spec.seed, **spec.env.args)
    except (EnvironmentLoadError, TypeError, ValueError) as err:
        raise SpecError(f"{env_error_field(err)}: {err}") from None
    examples = []
    for p in range(spec.data.num_examples):
        task = env.task(data_order(p, env.num_tasks, spec.seed))
        if (conversation := env.sft_conversation(task)) is not None:
            try:
                examples.append(sft_conversation_sample(tokenizer, *conversation))
            except ValueError as err:
                raise SpecError(f"env.id: {spec.env.id!r}: {err}") from None
            continue
        answer = getattr(task.data, "answer", None)
        if answer is None:
            raise SpecError(f"env.id: {spec.env.id!r} tasks have no reference 'answer' to fine-tune on")
        examples.append(sft_sample(tokenizer, env.prompt_messages(task), str(answer)))
    too_long = max(len(e["input_ids"]) for e in examples)
    if too_long > spec.seq_len:
        raise SpecError(
            f"seq_len: {spec.seq_len} tokens cannot hold a {too_long}-token example; use at least {too_long}"
        )
    return tokenizer, eval_env, examples


def run_sft(spec: SFTSpec, *, overwrite: bool = False) -> dict[str, Any]:
    """Train ``spec`` to ``max_steps``; returns ``{"final": path, "eval_reward_greedy": r, "wall_s": s}``.

    ``r`` is the greedy eval's mean reward after the last step (None for environments whose rollouts call
    tools, which get no greedy eval here).

    The cheap checks (run directory state, then :func:`sft_preflight`) run before the weights load, and the
    run directory is created only after everything loaded.

    Raises:
        SpecError: the run directory exists (without ``overwrite``), the model or environment cannot load.
    """
    from worker.launchers.local import check_run_dir
    from worker.models import load_model

    check_run_dir(spec, overwrite=overwrite)
    tokenizer, eval_env, examples = sft_preflight(spec)
    try:
        model = load_model(spec.model.name, dtype="float32", attn_implementation="sdpa")
    except (FileNotFoundError, ValueError) as err:
        raise SpecError(f"model.name: {err}") from None

    run = RunDir(spec.run_dir)
    if run.root.exists():
        shutil.rmtree(run.root)
    run.root.mkdir(parents=True)
    atomic_write_json(run.config, json.loads(spec.model_dump_json()))
    torch.manual_seed(spec.seed)
    torch.set_num_threads(spec.threads)

    model.train()
    optimizer = build_optimizer(model, spec.optim)
    scheduler = build_scheduler(optimizer, spec.scheduler, spec.max_steps)
    autocast = spec.model.dtype == "bfloat16"
    t_start = time.time()
    reward: float | None = float("nan")
    can_eval = not eval_env.needs_harness
    if not can_eval:  # its rollouts call tools: only verifiers' agent harness on a vLLM server can run them
        reward = None
        print(f"sft: {spec.env.id!r} tasks use tools; no greedy eval here (run `asyncrl eval --model <run>/final`)")  # noqa: T201
    for step in range(1, spec.max_steps + 1):
        t0 = time.perf_counter()
        batch = [examples[((step - 1) * spec.data.batch_size + j) % len(examples)] for j in range(spec.data.batch_size)]
        n_tokens = sum(sum(e["loss_mask"]) for e in batch)
        loss_sum = 0.0
        for bin_ in pack([len(e["input_ids"]) for e in batch], spec.seq_len):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = sft_loss(model, [batch[i] for i in bin_], n_tokens)
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.optim.max_grad_norm)
        lr = float(scheduler.get_last_lr()[0])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        dt = time.perf_counter() - t0
        values: dict[str, float | int | None] = {
            "loss": loss_sum,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens_per_s": sum(len(e["input_ids"]) for e in batch) / dt,
            "step_time_s": dt,
        }
        if can_eval and (step == spec.max_steps or (spec.eval_interval and step % spec.eval_interval == 0)):
            reward = greedy_eval(model, tokenizer, eval_env, spec.eval_examples)
            values["eval_reward_greedy"] = reward
        run.log_metrics("sft", step, values)
        if step % 20 == 0 or "eval_reward_greedy" in values:
            extra = f" eval_reward_greedy {reward:.3f}" if "eval_reward_greedy" in values else ""
            print(f"sft step {step:>4}/{spec.max_steps} | loss {loss_sum:.4f} | lr {lr:.2e}{extra}", flush=True)  # noqa: T201
    save_final(model, spec.model.name, run.final)
    result = {"final": str(run.final), "eval_reward_greedy": reward, "wall_s": round(time.time() - t_start, 1)}
    atomic_write_json(run.summary, result)
    return result
