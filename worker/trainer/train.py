"""RL trainer process: batches in, policy versions out.

One loop, in reading order (torchtitan's ``Trainer.train`` shape): wait for ``batches/step_n.json``
(the wait is ``wait_for_batch``), compute trainer logprobs of the sampled tokens at the sampling
temperature, the configured loss (``worker/trainer/loss``), clip gradients, step, publish policy
version n to ``weights/step_n`` (or broadcast it to vLLM over a process group, ``worker/weight_sync/publish.py``),
log metrics, checkpoint in the background. Batch n is built by the
orchestrator from rollouts of policies <= n - 1, so this step trains policy v(n-1) into v(n).

The trainer knows no RL algorithm: advantages arrive in the batch.

Run as ``python -m worker.trainer --run-dir DIR [--resume-step K]``, or under ``torchrun --nproc-per-node N``
(FSDP2 over N ranks, see ``worker/trainer/dist.py``); rank 0 writes weights, checkpoints and metrics.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from worker.live_config import LiveConfig, set_base_lr
from worker.orchestrator.batch import Batch, TrainSample, read_batch
from worker.orchestrator.policy_check import applies as policy_check_applies
from worker.orchestrator.policy_check import probe_from_batch, probe_logprobs, read_probe, write_logprobs, write_probe
from worker.run.checkpoint import HELD, end_of_leg
from worker.run.checkpoint import due as checkpoint_due
from worker.run.rundir import RunDir
from worker.spec import RLSpec
from worker.tracking import progress
from worker.tracking.system_metrics import ProcessSampler
from worker.trainer.checkpointer import BackgroundCheckpointer, load_trainer_state, save_final
from worker.trainer.dist import (
    DistInfo,
    all_ranks_max,
    all_ranks_sum,
    broadcast_from_main,
    flops_per_step,
    grad_norm_value,
    iter_full_weights,
    peak_flops,
    peak_memory_gib,
    prepare_model,
    setup,
    weight_shapes,
    weights_state_dict,
)
from worker.trainer.logprobs import fused_logprob_entropy
from worker.trainer.lora import wrap
from worker.trainer.loss import LossInputs, compute_sample_loss, token_separable
from worker.trainer.optim import build_optimizer, build_scheduler
from worker.trainer.packed import forward_hidden, micro_batch_tensors
from worker.weight_sync.cuda_ipc import IpcSender
from worker.weight_sync.publish import WeightSender, inference_workers, publish_adapter, publish_weights

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger("asyncrl.trainer")
EMPTY_STEP_METRICS = ("loss", "entropy", "mismatch_kl", "mismatch_kl_on_policy", "is_ratio", "masked_fraction")


def wait_for_batch(run: RunDir, step: int, poll_s: float = 0.05) -> tuple[Batch, float]:
    """Block until batch ``step`` exists; returns it and the wait in seconds."""
    path, t0 = run.batch(step), time.perf_counter()
    progress.recorder.state("waiting_for_batch", step=step)
    while not path.exists():
        time.sleep(poll_s)
    progress.recorder.state("training", step=step)
    return read_batch(path), time.perf_counter() - t0


def to_device(
    parts: list[tuple[TrainSample, int, torch.Tensor]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token inputs of a micro-batch's loss, each ``[N]`` over its samples' tokens ``first..L-1`` in order:
    target ids, loss mask, sampling log-probs and advantages.

    Built on the host and copied in one transfer (from pinned memory on a GPU, without waiting for the forward pass
    in flight): a tensor per sample and field cost 3 copies x 128 samples a step, each waiting for the GPU."""
    ids = [i for s, f, _ in parts for i in s["input_ids"][f:]]
    mask = [float(m) for s, f, _ in parts for m in s["loss_mask"][f:]]
    lps = [x for s, f, _ in parts for x in s["sampling_logprobs"][f:]]
    adv = [float(s["advantage"]) for s, f, _ in parts for _ in range(len(s["input_ids"]) - f)]
    host = torch.tensor([ids, mask, lps, adv], dtype=torch.float64)  # ids < 2**53: exact in float64
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    return dev[0].long(), dev[1].bool(), dev[2].float(), dev[3].float()


def loss_unit(sample: TrainSample, step: int) -> tuple[bool, str | None]:
    """What the step's metrics tell apart about a sample: on-policy (generated entirely by v(step-1), for
    ``mismatch_kl_on_policy``) and its environment (a mixture's ``mismatch_kl/<env>``; None in a one-env run)."""
    return sample["policy_span"] == [step - 1, step - 1], sample.get("env")


def loss_calls(
    parts: list[tuple[TrainSample, int, torch.Tensor]], step: int, separable: bool
) -> list[tuple[tuple[bool, str | None], slice]]:
    """The loss calls of a micro-batch: ``(loss_unit, slice of the parts' tokens)``, one per sample, or with a
    ``separable`` loss one per run of consecutive samples of one unit (``parts`` sorted by unit: at most a few)."""
    calls: list[tuple[tuple[bool, str | None], slice]] = []
    offset = 0
    for sample, _, rows in parts:
        unit, end = loss_unit(sample, step), offset + len(rows)
        if separable and calls and calls[-1][0] == unit:
            calls[-1] = (unit, slice(calls[-1][1].start, end))
        else:
            calls.append((unit, slice(offset, end)))
        offset = end
    return calls


def train_step(
    model: PreTrainedModel, batch: Batch, spec: RLSpec, step: int, info: DistInfo | None = None
) -> dict[str, float]:
    """Forward/backward over this rank's micro-batches of ``batch``; gradients summed, not applied.

    Rank r of a world of w trains micro-batches r, r + w, ...; a rank with fewer than the others runs
    zero-loss passes so that every rank runs the same number of FSDP2 forward/backward passes.
    Each loss term is a sum over kept tokens; dividing by the batch's loss-token count makes the
    step's loss a token-level mean over the whole batch (DAPO-style token normalisation), and the
    gradients are summed over ranks.

    ``mismatch_kl`` (k3, over all loss tokens) measures trainer policy v(step-1) against the
    sampling policy, so it includes the drift of stale rollouts; ``mismatch_kl_on_policy`` keeps only
    samples generated entirely by v(step-1), i.e. the inference-vs-trainer numerical mismatch
    (NaN when the step has none). A run of several environments also gets ``mismatch_kl/<env>`` over each
    environment's samples (their ``env``; NaN for one without samples this step).

    Returns:
        Over all ranks: sums of per-token metrics divided by the loss-token count, plus ``entropy``,
        ``trained_tokens`` (the tokens of the packed rows, a shared prompt counted once) and
        ``attended_pairs`` (the (query, key) pairs the attention masks allow, for MFU).
    """
    info = info or DistInfo()
    loss_cfg = spec.trainer.loss
    params = loss_cfg.model_dump(exclude={"type"})
    n_tokens = max(batch["num_loss_tokens"], 1)
    sums: dict[str, torch.Tensor | float] = defaultdict(float)
    autocast = spec.model.dtype == "bfloat16" and not info.sharded  # FSDP2's policy casts to bf16 itself
    dev = info.device
    separable = token_separable(loss_cfg.type, params)
    mine = batch["micro_batches"][info.rank :: info.world_size]
    for k in range(all_ranks_max(len(mine), info)):
        if k >= len(mine):  # padding pass: same collectives, no gradient
            t = micro_batch_tensors([{"input_ids": [0], "loss_mask": [0]}]).to(dev)
            hidden, weight = forward_hidden(model, t, autocast)
            ((hidden @ weight.T).sum() * 0.0).backward()
            continue
        samples = mine[k]
        t = micro_batch_tensors(samples).to(dev)
        hidden, weight = forward_hidden(model, t, autocast)  # [T, D], [vocab, D]
        total = hidden.new_zeros((), dtype=torch.float32)
        sums["trained_tokens"] += int(t.input_ids.shape[1])
        sums["attended_pairs"] += t.attended_pairs
        parts = []  # (sample, first, rows): the sample's tokens first..L-1, from its first loss token on
        for rows, sample in zip(t.rows, samples, strict=True):
            first = next((j for j, m in enumerate(sample["loss_mask"]) if m and j > 0), None)
            if first is not None:  # the prompt has no loss
                parts.append((sample, first, rows[first - 1 :]))
        if separable:  # the samples of one loss call next to each other (a stable sort keeps their order)
            parts.sort(key=lambda part: str(loss_unit(part[0], step)))
        if parts:
            # all samples' rows at once through the fused chunked LM head + log-softmax + entropy
            sel = t.sample_logits(hidden, torch.cat([r for _, _, r in parts]))  # [N, D]
            temps = None
            if any(s["temperature"] != 1.0 for s, _, _ in parts):
                temps = torch.cat([torch.full((len(r),), float(s["temperature"])) for s, _, r in parts]).to(dev)
            targets, masks, sampling_lps, advantages = to_device(parts, dev)  # [N] each, one copy
            lp_all, entropy_all = fused_logprob_entropy(sel, weight, targets, temps, compiled=spec.trainer.compile)
        for (on_policy, env), part in loss_calls(parts, step, separable):
            mask = masks[part]
            out = compute_sample_loss(
                loss_cfg.type,
                LossInputs(
                    trainer_logprobs=lp_all[part],
                    sampling_logprobs=sampling_lps[part],
                    advantages=advantages[part],
                    loss_mask=mask,
                ),
                **params,
            )
            total = total + out.loss
            for name, value in out.metrics.items():
                sums[name] += value
            if on_policy:
                sums["on_policy_kl"] += out.metrics["mismatch_kl"]
                sums["on_policy_tokens"] += out.metrics["loss_tokens"]
            if env is not None:  # a mixture's sample (worker.orchestrator.mixture): mismatch_kl/<env>
                sums[f"env_kl/{env}"] += out.metrics["mismatch_kl"]
                sums[f"env_tokens/{env}"] += out.metrics["loss_tokens"]
            sums["entropy"] += torch.where(mask, entropy_all[part], 0.0).sum()  # no boolean indexing: no device sync
        (total * (info.loss_scale / n_tokens)).backward()
        sums["loss"] += total.detach()
    totals = all_ranks_sum({name: float(v) for name, v in sums.items()}, info)  # one sync per metric, at the end
    counts = {name: totals.pop(name, 0.0) for name in ("trained_tokens", "attended_pairs", "loss_tokens")}
    on_policy_kl, on_policy_tokens = totals.pop("on_policy_kl", 0.0), totals.pop("on_policy_tokens", 0.0)
    env_kl = {n.split("/", 1)[1]: totals.pop(n) for n in [n for n in totals if n.startswith("env_kl/")]}
    env_tokens = {n.split("/", 1)[1]: totals.pop(n) for n in [n for n in totals if n.startswith("env_tokens/")]}
    metrics: dict[str, float] = {name: value / n_tokens for name, value in totals.items()}
    metrics["masked_fraction"] = metrics.pop("masked", 0.0)
    metrics["mismatch_kl_on_policy"] = on_policy_kl / on_policy_tokens if on_policy_tokens else float("nan")
    envs = [e.name for e in spec.envs] if len(spec.envs) > 1 else []
    for env in envs:  # NaN for an environment with no loss token this step
        tokens = env_tokens.get(env, 0.0)
        metrics[f"mismatch_kl/{env}"] = env_kl.get(env, 0.0) / tokens if tokens else float("nan")
    metrics["trained_tokens"] = int(counts["trained_tokens"])
    metrics["attended_pairs"] = int(counts["attended_pairs"])
    return metrics


def hold(run: RunDir, checkpointer: BackgroundCheckpointer, step: int, main: bool) -> None:
    """``ckpt.hold_at`` step ``step``: wait for its checkpoint, then do nothing until the run is stopped (SIGTERM,
    the service's stop path; a resume goes on from this checkpoint). Never returns."""
    checkpointer.wait()
    if main:
        progress.recorder.state(HELD, step=step)
        run.log_event(HELD, process="trainer", step=step, reason=f"checkpoint step {step} complete; held until stopped")
    logger.info("held at step %d (ckpt.hold_at) until the run is stopped", step)
    while True:
        time.sleep(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.trainer")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--resume-step", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")

    run = RunDir(args.run_dir)
    spec = RLSpec.model_validate_json(run.config.read_text())
    torch.set_num_threads(spec.trainer.threads)
    torch.manual_seed(spec.seed)
    random.seed(spec.seed)
    info = setup(spec.trainer.device)
    if info.device.type == "cuda" and spec.trainer.gpu_memory_fraction is not None:  # its share of a shared GPU
        torch.cuda.set_per_process_memory_fraction(spec.trainer.gpu_memory_fraction, info.device)
    sync = spec.trainer.weight_sync
    sender = (  # rank 0's end of the weight-sync group, formed in the background while the model loads
        WeightSender(
            run,
            sync,
            info.device,
            workers=inference_workers(spec.inference.extra_args),
            join_timeout_s=spec.inference.startup_timeout_s + sync.timeout_s,
            start_step=args.resume_step or 0,
        )
        if sync.kind == "process_group" and info.is_main
        else None
    )

    ipc = (  # colocated: rank 0 shares its GPU with vLLM (worker/weight_sync/cuda_ipc.py)
        IpcSender(run, sync, info.device, getattr(torch, spec.model.dtype)) if sync.kind == "cuda_ipc" else None
    )

    from worker.policy.models import load_model

    # fp32 master weights; bf16 compute through FSDP2's policy (sharded) or autocast (one CPU process)
    model = load_model(spec.model.name, dtype="float32", attn_implementation=spec.trainer.attention)
    n_params = sum(p.numel() for p in model.parameters())
    # LoRA RL: adapters injected in place, everything else frozen; ``adapter`` is the PEFT handle that saves them
    adapter = wrap(model, spec.trainer.lora) if spec.trainer.lora is not None else None
    model.train()
    prepare_model(
        model,
        info,
        bf16=spec.model.dtype == "bfloat16",
        activation_checkpointing=spec.trainer.activation_checkpointing,
        compile=spec.trainer.compile,
    )
    peak = peak_flops(info.device)
    system = ProcessSampler(info.device)  # CPU %, RSS, GPU use of this process (worker/tracking/system_metrics.py)
    optimizer = build_optimizer(model, spec.trainer.optim)
    scheduler = build_scheduler(optimizer, spec.trainer.scheduler, spec.max_steps)
    start = 0
    if args.resume_step is not None:
        start = load_trainer_state(
            run.checkpoint_dir(args.resume_step) / "trainer", model, optimizer, scheduler, adapter=adapter
        )
        # the spec's lr, not the checkpoint's, is the base: a fork with a new trainer.optim.lr trains with it
        set_base_lr(optimizer, scheduler, spec.trainer.optim.lr)
        logger.info("resumed from checkpoint step %d", start)
    checkpointer = BackgroundCheckpointer(run, keep=spec.ckpt.keep)
    # live config replays every revision on resume: the live file wins over the checkpoint's lr
    live = LiveConfig(run.root, "trainer", start_step=start)
    check = spec.orchestrator.policy_check  # the served-policy check's probe (worker/orchestrator/policy_check.py)
    probe = read_probe(run) if policy_check_applies(spec) else None  # a resumed run reuses its probe
    if probe is not None and not run.policy_check_logprobs(start).is_file():  # the resume load is checked too
        lps = probe_logprobs(model, probe, info.device)  # every rank: a sharded model's forward is collective
        if info.is_main:
            write_logprobs(run, start, lps)

    if info.is_main:
        progress.recorder.start(run.root, "trainer")
    for step in range(start + 1, spec.max_steps + 1):
        checkpointer.check()  # a failed background checkpoint write (a full disk) ends the run here
        batch, waited = wait_for_batch(run, step)
        # rank 0 reads and acknowledges live revisions; every rank trains with its result
        applied = broadcast_from_main(live.apply(spec, step) if info.is_main else None, info)
        spec, changed = cast(tuple[RLSpec, dict[str, Any]], applied)  # rank 0's (spec, changes) on every rank
        if "trainer.optim.lr" in changed:  # the schedule continues from the new base lr
            set_base_lr(optimizer, scheduler, spec.trainer.optim.lr)
        if info.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(info.device)
        # the probe is fixed once, from the first non-empty batch of a fresh run (no optimizer step before it: the
        # weights are the base's); a resumed run reads its own, a fork its parent's (copied by the service's fork)
        if policy_check_applies(spec) and probe is None and start == 0 and batch["num_samples"]:
            probe = probe_from_batch(batch, check.num_sequences, check.max_tokens)
            if probe is not None:
                base = probe_logprobs(model, probe, info.device)
                if info.is_main:  # the base first: a probe file always has its base (the orchestrator reads it first)
                    write_logprobs(run, 0, base)
                    write_probe(run, probe)
        t0 = time.perf_counter()
        metrics = train_step(model, batch, spec, step, info) if batch["num_samples"] else {}
        for name in EMPTY_STEP_METRICS:  # a step whose rollouts were all dropped still logs every key
            metrics.setdefault(name, float("nan"))
        for env in spec.envs if len(spec.envs) > 1 else []:  # and a mixture's per-env mismatch_kl
            metrics.setdefault(f"mismatch_kl/{env.name}", float("nan"))
        grad_norm = grad_norm_value(
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.trainer.optim.max_grad_norm)
        )
        lr = optimizer.param_groups[0]["lr"]  # the lr this step uses (a live change sets it between steps)
        if batch["num_samples"]:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        compute_s = time.perf_counter() - t0
        keep_versions = spec.orchestrator.max_async_level + 3
        if probe is not None:  # before version `step` is visible: the orchestrator checks it right after loading it
            lps = probe_logprobs(model, probe, info.device)
            if info.is_main:
                write_logprobs(run, step, lps)
        if adapter is not None:  # LoRA: only the adapter ships (vLLM loads it by name, policy-<step>)
            publish_adapter(adapter, run, step, keep_versions=keep_versions)
        elif ipc is not None:  # colocated: through the trainer's GPU buffer (filesystem fallback inside)
            if info.is_main:
                ipc.publish(iter_full_weights(model), weight_shapes(model), step, keep_versions)
            else:  # the other FSDP2 ranks take part in each tensor's gather
                for _ in iter_full_weights(model):
                    pass
        elif sender is not None:  # over the process group (filesystem fallback inside)
            sender.publish(weights_state_dict(model), step, keep_versions)
        else:  # with FSDP2 the other ranks take part in the gather here
            publish_weights(model, run, step, keep_versions=keep_versions)
        step_s = time.perf_counter() - t0
        n_tok = int(metrics.pop("trained_tokens", 0))  # tokens in the packed rows (a shared prompt counts once)
        flops = flops_per_step(model.config, n_params, n_tok, int(metrics.pop("attended_pairs", 0)))
        if info.is_main:
            run.log_metrics(
                "trainer",
                step,
                {
                    **metrics,
                    "grad_norm": grad_norm,
                    "lr": lr,
                    "num_samples": batch["num_samples"],
                    "num_loss_tokens": batch["num_loss_tokens"],
                    "tokens_per_s": n_tok / compute_s if compute_s > 0 else 0.0,
                    "mfu": flops / (compute_s * peak * info.world_size) if peak and compute_s > 0 else None,
                    "peak_memory_gib": peak_memory_gib(info.device),
                    "step_time_s": step_s + waited,
                    "wait_for_batch_s": waited,
                    "policy_version": step,
                    "trainer_ranks": info.world_size,
                    **system.sample(),
                },
            )
        logger.info(
            "step %d loss %.4f mismatch_kl %.2e grad_norm %.3f wait_for_batch %.2fs",
            step,
            metrics.get("loss", 0.0),
            metrics.get("mismatch_kl", 0.0),
            grad_norm,
            waited,
        )
        # periodic, or requested (preemption); rank 0 decides, since every rank takes part in the save
        if broadcast_from_main(info.is_main and checkpoint_due(run, step, spec.ckpt.interval, spec.ckpt.hold_at), info):
            checkpointer.save(step, model, optimizer, scheduler, adapter=adapter)
        progress.recorder.tick("steps")
        if step == end_of_leg(start, spec.max_steps, spec.ckpt.hold_at) < spec.max_steps:
            hold(run, checkpointer, step, info.is_main)
        if spec.trainer.slow_step_s:
            time.sleep(spec.trainer.slow_step_s)
    progress.recorder.state("saving_final")
    if ipc is not None and info.is_main:
        ipc.settle()  # the buffer dies with this process: inference reads the last version first (or gets the file)
    checkpointer.wait()
    save_final(model, spec.model.name, run.final, adapter=adapter)
    logger.info("done: %d steps", spec.max_steps)
    progress.recorder.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
