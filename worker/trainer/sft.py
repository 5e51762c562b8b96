"""Supervised fine-tuning: the SFT trainer, one process or FSDP2 ranks under ``torchrun`` as the RL trainer.

Data (``[data]``, read and checked by ``worker/trainer/sft_data.py`` before any weights load): rows of a JSONL or
Parquet file or a ``datasets`` folder (``data.path``; chat messages or prompt/completion pairs, the loss on every
assistant turn), or the environment's own tasks with their reference answers (``num_examples`` of its train split;
an environment with its own SFT conversation, ``env.sft_conversation``, gives the whole conversation). Step ``n``
takes the next ``data.batch_size`` rows from the data cursor (epoch, offset) in each epoch's seeded order
(``data.shuffle``). The loss is cross-entropy on the loss-mask tokens only, a token-level mean over the step's
batch; samples are packed into rows of at most ``seq_len`` tokens (``worker/orchestrator/packing.py``) and run through
the RL trainer's packed forward and fused LM head (``worker/trainer/packed.py``, ``worker/trainer/logprobs.py``); the
model is prepared by the RL trainer's ``prepare_model`` (FSDP2 when sharded, ``compile``, activation checkpointing),
LoRA by ``worker/trainer/lora.py``; AdamW and the warmup/decay schedule of ``worker/trainer/optim.py``.

Evals every ``eval_interval`` steps and at the end: the held-out loss (``data.eval_path``, or the environment's eval
tasks with their reference answers) and, with environment data or ``data.eval_reward``, the greedy reward on the
first ``eval_examples`` eval tasks (not for environments whose rollouts call tools: ``asyncrl eval``).

What it writes into the run directory: ``config.json`` (the spec); one ``metrics.jsonl`` row per step (source
``sft``: loss, grad_norm, lr, tokens_per_s, step_time_s, epoch, eval_loss, eval_reward_greedy); checkpoints every
``ckpt.interval`` steps in the RL layout (``worker/run/checkpoint.py``: the ``trainer`` part with weights or adapter,
optimizer, scheduler and RNG states, and the ``orchestrator`` part with the data cursor), from which
``asyncrl sft --resume`` continues exactly; the trained model with its tokenizer at the end (``<run>/final``) and
``summary.json``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from worker.envs import load_environment
from worker.orchestrator.data import data_order
from worker.orchestrator.packing import pack
from worker.orchestrator.prompts import prompt_ids
from worker.run.checkpoint import due as checkpoint_due
from worker.run.checkpoint import prune, write_part
from worker.run.rundir import RunDir, atomic_write_json
from worker.spec import SFTSpec, SpecError
from worker.tracking.console import RunConsole
from worker.trainer.checkpointer import BackgroundCheckpointer, load_trainer_state, save_final
from worker.trainer.dist import (
    DistInfo,
    all_ranks_max,
    all_ranks_sum,
    broadcast_from_main,
    grad_norm_value,
    prepare_model,
    setup,
)
from worker.trainer.logprobs import fused_logprob_entropy
from worker.trainer.lora import wrap
from worker.trainer.optim import build_optimizer, build_scheduler
from worker.trainer.packed import forward_hidden, micro_batch_tensors
from worker.trainer.sft_data import (
    DataCursor,
    EpochOrder,
    check_rows,
    read_rows,
    sft_conversation_sample,
    sft_sample,
    tokenize_rows,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger("asyncrl.sft")
SFT_LORA_FIELD = "lora.target_modules"
"""The spec key of an SFT spec's LoRA targets (``trainer.lora.target_modules`` in an RL spec)."""


def sft_loss(
    model: PreTrainedModel,
    samples: list[dict[str, list[int]]],
    n_tokens: int,
    info: DistInfo,
    *,
    autocast: bool,
    compiled: bool = False,
) -> torch.Tensor:
    """Cross-entropy over the loss-mask tokens of one packed micro-batch, divided by ``n_tokens``.

    The row goes through the RL trainer's packed forward (``forward_hidden``: attention kept inside each sample)
    and the fused chunked LM head (``fused_logprob_entropy``: the ``[T, vocab]`` logits are never built), on the
    hidden states of the masked positions only: ``loss = -sum_t log p(x_t | x_<t) * mask_t / n_tokens``.

    Args:
        samples: ``{"input_ids": [L], "loss_mask": [L]}`` dicts packed into one row.
        n_tokens: the step's loss-token count over every micro-batch and rank (token-level mean).
        info: this rank (device, FSDP2's ``loss_scale``); the returned value is not scaled by it.

    Returns:
        A 0-dim float32 tensor (differentiable; the caller runs ``backward`` on it times ``info.loss_scale``).
    """
    t = micro_batch_tensors(samples).to(info.device)
    hidden, weight = forward_hidden(model, t, autocast)  # [T, D], [vocab, D]
    rows = [r[torch.tensor(s["loss_mask"][1:], dtype=torch.bool)] for r, s in zip(t.rows, samples, strict=True)]
    targets = [
        torch.tensor([x for x, m in zip(s["input_ids"][1:], s["loss_mask"][1:], strict=True) if m]) for s in samples
    ]
    sel = t.sample_logits(hidden, torch.cat(rows))  # [N, D]
    lp, _ = fused_logprob_entropy(sel, weight, torch.cat(targets).to(info.device), compiled=compiled)
    return -lp.sum() / max(n_tokens, 1)


@torch.no_grad()
def greedy_eval(model: Any, tokenizer: Any, env: Any, num_examples: int, max_new_tokens: int = 64) -> float:
    """Mean environment reward of greedy completions on the first ``num_examples`` eval tasks.

    The left-padded prompts ``[num_examples, width]`` go to the model's device (``model.device``: the trainer's
    ``cuda`` device in a GPU run). Returns NaN when no completion was scored."""
    model.eval()
    tokenizer.padding_side = "left"
    tasks = [env.task(i) for i in range(num_examples)]  # sft_preflight refused more than the split has
    prompts = [prompt_ids(tokenizer, env.prompt_messages(t)) for t in tasks]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        use_cache=True,  # the trainer's prepare_model turns the cache off for training
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)

    async def score_all() -> list[float | None]:
        return list(await asyncio.gather(*(env.score(t, x) for t, x in zip(tasks, texts, strict=True))))

    rewards = [r for r in asyncio.run(score_all()) if r is not None]
    model.train()
    return statistics.fmean(rewards) if rewards else float("nan")


@dataclass
class SFTData:
    """What :func:`sft_preflight` prepared: the tokenizer, the training and held-out samples (``input_ids`` and
    ``loss_mask`` lists), and the environment whose eval tasks give the greedy reward (None: no greedy reward)."""

    tokenizer: Any
    train: list[dict[str, list[int]]]
    held_out: list[dict[str, list[int]]]
    eval_env: Any | None


def _env_samples(tokenizer: Any, env: Any, spec: SFTSpec, count: int, ordered: bool) -> list[dict[str, list[int]]]:
    """``count`` samples of ``env``'s tasks with their reference answers (in ``data_order`` when ``ordered``)."""
    out = []
    for p in range(count):  # ordered: passes over the train split; else the first ``count`` (checked) eval tasks
        task = env.task(data_order(p, env.num_tasks, spec.seed) if ordered else p)
        if (conversation := env.sft_conversation(task)) is not None:
            try:
                out.append(sft_conversation_sample(tokenizer, *conversation))
            except ValueError as err:
                raise SpecError(f"env.id: {spec.env.id!r}: {err}") from None
            continue
        answer = getattr(task.data, "answer", None)
        if answer is None:
            raise SpecError(f"env.id: {spec.env.id!r} tasks have no reference 'answer' to fine-tune on")
        out.append(sft_sample(tokenizer, env.prompt_messages(task), str(answer)))
    return out


def sft_preflight(spec: SFTSpec, *, tokenize: bool = True) -> SFTData:
    """The cheap checks of an SFT spec, before any weights load; ``asyncrl sft --dry-run`` runs them too.

    Reads and tokenizes every training and held-out row (``data.path`` / ``data.eval_path``, or the environment's
    tasks with their reference answers) and loads the eval environment when evals take its greedy reward. Without
    ``tokenize`` (the local launcher, whose trainer process then runs it in full) file rows are checked for
    structure only (``worker.trainer.sft_data.check_rows``), environment tasks are not turned into samples, and the
    returned ``train`` / ``held_out`` are empty (no ``seq_len`` check): the rows are tokenized once, by the trainer.

    Raises:
        SpecError: the model directory, tokenizer (chat template, ``<|im_end|>``) or environment is unusable, the
            trainer cannot train the architecture (``worker.trainer.dist.check_trainable``: one line naming it), its
            tasks have no reference answer, ``eval_examples`` is more than its eval split has, a data file is missing, empty or has a row without an assistant turn
            (``data.path: row 3 has no assistant turn ...``), or a sample is longer than ``seq_len``.
    """
    from worker.envs import EnvironmentLoadError, env_error_field
    from worker.orchestrator.eval import check_num_examples
    from worker.policy.models import check_model

    try:
        tokenizer = check_model(spec.model.name)
    except (FileNotFoundError, ValueError) as err:
        raise SpecError(f"model.name: {err}") from None
    if tokenizer.convert_tokens_to_ids("<|im_end|>") in (None, tokenizer.unk_token_id):
        raise SpecError(
            f"model.name: {spec.model.name}: tokenizer has no '<|im_end|>' token (SFT ends answers with it)"
        )
    from worker.trainer.dist import check_trainable_dir

    try:  # decoder blocks and output projection found through the model's own accessors (config only, no weights)
        check_trainable_dir(spec.model.name)
    except ValueError as err:
        raise SpecError(f"model.name: {err}") from None
    if spec.lora is not None:  # every target names a linear layer (the model's config, no weights read): case C15
        from worker.trainer.lora import check_targets

        try:
            check_targets(spec.model.name, spec.lora.target_modules, field=SFT_LORA_FIELD)
        except ValueError as err:
            raise SpecError(str(err)) from None
    train: list[dict[str, list[int]]] = []
    held_out: list[dict[str, list[int]]] = []
    files = [("data.path", spec.data.path, spec.data.split)] if spec.uses_file else []
    if spec.data.eval_path:
        files.append(("data.eval_path", spec.data.eval_path, spec.data.eval_split))
    for field, path, split in files:  # the rows first: a missing or broken file is named before any environment loads
        rows = read_rows(path, field, split)
        if not tokenize:
            check_rows(rows, field)
        elif field == "data.path":
            train = tokenize_rows(tokenizer, rows, field)
        else:
            held_out = tokenize_rows(tokenizer, rows, field)
    eval_env = None
    if not spec.uses_file or spec.greedy_reward:
        try:
            env = load_environment(spec.env.id, split="train", seed=spec.seed, **spec.env.args)
            eval_env = load_environment(spec.env.id, split="eval", seed=spec.seed, **spec.env.args)
        except (EnvironmentLoadError, TypeError, ValueError) as err:
            raise SpecError(f"{env_error_field(err)}: {err}") from None
        if (not spec.uses_file and not spec.data.eval_path) or spec.greedy_reward:  # held-out rows / greedy reward
            check_num_examples(eval_env, spec.eval_examples, "eval_examples")
        if not spec.uses_file and tokenize:
            train = _env_samples(tokenizer, env, spec, spec.data.num_examples, ordered=True)
        if not spec.uses_file and not spec.data.eval_path and tokenize:
            held_out = _env_samples(tokenizer, eval_env, spec, spec.eval_examples, ordered=False)
        if not spec.greedy_reward:
            eval_env = None
    if not tokenize:
        return SFTData(tokenizer, train, held_out, eval_env)
    too_long = max(len(e["input_ids"]) for e in [*train, *held_out])
    if too_long > spec.seq_len:
        raise SpecError(
            f"seq_len: {spec.seq_len} tokens cannot hold a {too_long}-token example; use at least {too_long}"
        )
    return SFTData(tokenizer, train, held_out, eval_env)


def _step_loss(
    model: PreTrainedModel, samples: list[dict[str, list[int]]], spec: SFTSpec, info: DistInfo, *, train: bool
) -> tuple[float, int, int]:
    """One pass over ``samples`` packed into ``seq_len`` rows, this rank's rows (``rank::world``) with padding passes
    so every rank runs as many FSDP2 forwards; with ``train`` each row's loss is back-propagated (gradients summed).

    Returns ``(loss, loss_tokens, trained_tokens)`` summed over ranks; ``loss`` is the token-level mean."""
    n_tokens = sum(sum(s["loss_mask"][1:]) for s in samples)
    bins = pack([len(s["input_ids"]) for s in samples], spec.seq_len)
    mine = bins[info.rank :: info.world_size]
    autocast = spec.model.dtype == "bfloat16" and not info.sharded  # FSDP2's policy casts to bf16 itself
    total, trained = 0.0, 0
    for k in range(all_ranks_max(len(mine), info)):
        pad = k >= len(mine)  # padding pass: same collectives, no gradient
        rows = [{"input_ids": [0, 0], "loss_mask": [0, 0]}] if pad else [samples[i] for i in mine[k]]
        with torch.set_grad_enabled(train):
            loss = sft_loss(model, rows, n_tokens, info, autocast=autocast, compiled=spec.compile)
            if train:
                (loss * (0.0 if pad else info.loss_scale)).backward()
        if not pad:
            total += float(loss.detach())
            trained += sum(len(r["input_ids"]) for r in rows)
    sums = all_ranks_sum({"loss": total, "trained": float(trained)}, info)
    return sums["loss"], n_tokens, int(sums["trained"])


def _write_data_cursor(run: RunDir, step: int, cursor: DataCursor, n_rows: int, spec: SFTSpec) -> None:
    """The ``orchestrator`` part of an SFT checkpoint: the data cursor (epoch, offset), the row count and order."""

    def write(folder: Path) -> None:
        state = {"step": step, **cursor.to_json(), "num_rows": n_rows, **_order_keys(spec)}
        (folder / "data_cursor.json").write_text(json.dumps(state))

    write_part(run, step, "orchestrator", write)


def _order_keys(spec: SFTSpec) -> dict[str, Any]:
    """The spec keys that fix the training order after a data cursor: ``{spec key: value}``."""
    return {"seed": spec.seed, "data.shuffle": spec.data.shuffle, "data.batch_size": spec.data.batch_size}


def _read_data_cursor(run: RunDir, step: int, n_rows: int, spec: SFTSpec) -> DataCursor:
    """The data cursor of checkpoint ``step``.

    Raises:
        SpecError: the dataset now has another row count, or ``seed`` / ``data.shuffle`` / ``data.batch_size``
            differs from when the checkpoint was written (the steps after it would take other rows)."""
    state = json.loads((run.checkpoint_dir(step) / "orchestrator" / "data_cursor.json").read_text())
    if state["num_rows"] != n_rows:
        raise SpecError(
            f"data.path: the training data has {n_rows} rows, checkpoint step {step} was written with "
            f"{state['num_rows']}; resume with the same data"
        )
    for key, value in _order_keys(spec).items():
        if key in state and state[key] != value:
            raise SpecError(
                f"{key}: {value!r} differs from {state[key]!r} of checkpoint step {step} (the data order would "
                f"change); resume with {key} = {json.dumps(state[key])}"
            )
    return DataCursor(int(state["epoch"]), int(state["offset"]))


def run_sft(spec: SFTSpec, *, overwrite: bool = False, resume: bool = False, prepared: bool = False) -> dict[str, Any]:
    """Train ``spec`` to ``max_steps``; returns ``{"status": "completed", "final": path, "eval_reward_greedy": r,
    "eval_loss": l, "wall_s": s, "resumed_from": k}``.

    ``r`` is the greedy eval's mean reward after the last step (None without a greedy eval: file data without
    ``data.eval_reward``, or an environment whose rollouts call tools); ``l`` the held-out loss (None without
    held-out rows). With ``resume`` it continues from the newest complete checkpoint: weights (or the LoRA adapter),
    optimizer, scheduler, RNG states and the data cursor, and the metrics of later steps are dropped; the steps
    after it then repeat an uninterrupted run's (``tests/e2e/test_sft_resume.py``).

    The cheap checks (run directory state, then :func:`sft_preflight`) run before the weights load, and a fresh run
    directory is created only after everything loaded. Under ``torchrun`` every rank calls it (FSDP2); rank 0
    writes. With ``prepared`` the local launcher (``worker.launchers.local.launch_sft``) made the run directory
    (config, logs, events): it is kept as it is.

    Raises:
        SpecError: the run directory exists (without ``overwrite`` or ``resume``), ``resume`` finds no complete
            checkpoint, the model, data or environment cannot load.
    """
    from worker.policy.models import load_model
    from worker.run.checkpoint import check_run_dir

    resume_from = check_run_dir(spec, resume=resume, overwrite=overwrite or prepared)
    data = sft_preflight(spec)
    info = setup(spec.device)
    if spec.lora is not None and info.world_size > 1:
        raise SpecError("lora: LoRA SFT trains in one process for now (run it without torchrun)")
    run = RunDir(spec.run_dir)
    order = EpochOrder(len(data.train), spec.seed, spec.data.shuffle)
    cursor = _read_data_cursor(run, resume_from, len(data.train), spec) if resume_from is not None else DataCursor()
    try:
        model = load_model(spec.model.name, dtype="float32", attn_implementation=spec.attention)
    except (FileNotFoundError, ValueError) as err:
        raise SpecError(f"model.name: {err}") from None

    if resume_from is None and info.is_main and not prepared:
        if run.root.exists():
            shutil.rmtree(run.root)
        run.root.mkdir(parents=True)
    if info.is_main:
        atomic_write_json(run.config, json.loads(spec.model_dump_json()))
    torch.manual_seed(spec.seed)
    random.seed(spec.seed)
    torch.set_num_threads(spec.threads)

    adapter = wrap(model, spec.lora, field=SFT_LORA_FIELD) if spec.lora is not None else None
    model.train()
    prepare_model(
        model,
        info,
        bf16=spec.model.dtype == "bfloat16",
        activation_checkpointing=spec.activation_checkpointing,
        compile=spec.compile,
    )
    optimizer = build_optimizer(model, spec.optim)
    scheduler = build_scheduler(optimizer, spec.scheduler, spec.max_steps)
    start = 0
    if resume_from is not None:
        start = load_trainer_state(
            run.checkpoint_dir(resume_from) / "trainer", model, optimizer, scheduler, adapter=adapter
        )
        if info.is_main:
            run.prune_after(start)
        logger.info("resumed from checkpoint step %d (data epoch %d, row %d)", start, cursor.epoch, cursor.offset)
    checkpointer = BackgroundCheckpointer(run, keep=spec.ckpt.keep)
    t_start = time.time()
    reward: float | None = None
    eval_loss: float | None = None
    eval_env = data.eval_env
    if eval_env is not None and eval_env.needs_harness:  # its rollouts call tools: verifiers' agent harness on vLLM
        eval_env = None
        print(f"sft: {spec.env.id!r} tasks use tools; no greedy eval here (run `asyncrl eval --model <run>/final`)")  # noqa: T201
    # lines as before; on a terminal a progress bar too (worker/tracking/console.py); other ranks print nothing
    with RunConsole(spec.max_steps, start, quiet=not info.is_main) as say:
        for step in range(start + 1, spec.max_steps + 1):
            checkpointer.check()  # a failed background checkpoint write (a full disk) ends the run here
            t0 = time.perf_counter()
            idx, cursor = order.take(cursor, spec.data.batch_size)
            loss, _, trained = _step_loss(model, [data.train[i] for i in idx], spec, info, train=True)
            grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.optim.max_grad_norm))
            lr = float(scheduler.get_last_lr()[0])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            dt = time.perf_counter() - t0
            values: dict[str, float | int | None] = {
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "tokens_per_s": trained / dt if dt > 0 else 0.0,
                "step_time_s": dt,
                "epoch": cursor.epoch,
            }
            if step == spec.max_steps or (spec.eval_interval and step % spec.eval_interval == 0):
                if data.held_out:
                    model.eval()
                    with torch.no_grad():
                        eval_loss = values["eval_loss"] = _step_loss(model, data.held_out, spec, info, train=False)[0]
                    model.train()
                if eval_env is not None:
                    reward = values["eval_reward_greedy"] = greedy_eval(
                        model, data.tokenizer, eval_env, spec.eval_examples
                    )
            if info.is_main:
                run.log_metrics("sft", step, values)
            if step % 20 == 0 or "eval_reward_greedy" in values or "eval_loss" in values:
                extra = "".join(f" {k} {values[k]:.3f}" for k in ("eval_loss", "eval_reward_greedy") if k in values)
                say(f"sft step {step:>4}/{spec.max_steps} | loss {loss:.4f} | lr {lr:.2e}{extra}")
            say.bar(step, f"loss {loss:.4f} | {values['tokens_per_s']:.0f} tok/s")
            if broadcast_from_main(info.is_main and checkpoint_due(run, step, spec.ckpt.interval), info):
                checkpointer.save(step, model, optimizer, scheduler, adapter=adapter)
                checkpointer.wait()  # the trainer part first: a data cursor never stands beside no weights
                if info.is_main:
                    _write_data_cursor(run, step, cursor, len(data.train), spec)
                    prune(run, spec.ckpt.keep)  # again: the step is complete only now
    checkpointer.wait()
    save_final(model, spec.model.name, run.final, adapter=adapter)
    result = {
        "status": "completed",
        "final": str(run.final),
        "eval_reward_greedy": reward,
        "eval_loss": eval_loss,
        "wall_s": round(time.time() - t_start, 1),
        "resumed_from": resume_from,
    }
    if info.is_main:
        atomic_write_json(run.summary, result)
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.trainer.sft --run-dir DIR [--resume]``: the SFT run of ``DIR/config.json`` in the run
    directory the local launcher prepared; exit 2 with ``error: <field>: ...`` on bad input."""
    import argparse
    import sys

    from worker.spec import validate_spec

    p = argparse.ArgumentParser(prog="python -m worker.trainer.sft")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = RunDir(args.run_dir)
    try:
        spec = validate_spec("sft", json.loads(run.config.read_text()))
        assert isinstance(spec, SFTSpec)
        run_sft(spec, resume=args.resume, prepared=True)
    except SpecError as err:
        run.log_event("failed", process="trainer", reason=str(err))
        print(f"error: {err}", file=sys.stderr)  # noqa: T201
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
