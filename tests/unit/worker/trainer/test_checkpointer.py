"""Trainer checkpoints (``worker/trainer/checkpointer.py``): round trip, snapshot at save, a write on a full disk."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from tests.support.models import tiny_qwen3
from tests.support.tmpfs import fill, free_bytes
from worker.run.checkpoint import complete_steps, is_complete, write_part
from worker.run.rundir import DiskFull, RunDir
from worker.spec import OptimConfig, SchedulerConfig
from worker.trainer.checkpointer import BackgroundCheckpointer, load_trainer_state
from worker.trainer.optim import build_optimizer, build_scheduler

# ----------------------------------------------------------------------------- checkpoints


def _train_step(
    model: Qwen3ForCausalLM,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


@pytest.mark.parametrize("tie", [True, False])
def test_a_checkpoint_without_the_output_projection_loads_only_when_it_is_tied(run: RunDir, tie: bool) -> None:
    """A tied model's checkpoint leaves the output projection out (it is the embedding) and loads; an untied model's
    checkpoint without it is refused, naming the missing weight, whatever the architecture calls it."""
    from safetensors.torch import save_file

    model = tiny_qwen3(seed=0, tie=tie).train()
    opt = build_optimizer(model, OptimConfig(lr=1e-2))
    sched = build_scheduler(opt, SchedulerConfig(), max_steps=10)
    ckpt = BackgroundCheckpointer(run, keep=2)
    ckpt.save(1, model, opt, sched)
    ckpt.wait()
    folder = run.checkpoint_dir(1) / "trainer"
    weights = load_file(folder / "model.safetensors")
    weights.pop("lm_head.weight", None)
    save_file(weights, folder / "model.safetensors")
    fresh = tiny_qwen3(seed=7, tie=tie).train()
    opt2 = build_optimizer(fresh, OptimConfig(lr=1e-2))
    sched2 = build_scheduler(opt2, SchedulerConfig(), max_steps=10)
    if tie:
        assert load_trainer_state(folder, fresh, opt2, sched2) == 1
        assert torch.equal(fresh.lm_head.weight, model.model.embed_tokens.weight)
    else:
        with pytest.raises(RuntimeError, match="missing.*lm_head.weight"):
            load_trainer_state(folder, fresh, opt2, sched2)


def test_checkpoint_round_trip(run: RunDir) -> None:
    model = tiny_qwen3(seed=0)
    model.train()
    opt = build_optimizer(model, OptimConfig(lr=1e-2))
    sched = build_scheduler(opt, SchedulerConfig(type="cosine", warmup_steps=2), max_steps=10)
    _train_step(model, opt, sched)
    torch.manual_seed(1234)
    random.seed(99)
    ckpt = BackgroundCheckpointer(run, keep=2)
    ckpt.save(1, model, opt, sched)
    expected_rand = torch.rand(4)
    expected_py = random.random()
    expected_state = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = opt.state_dict()
    expected_lr = opt.param_groups[0]["lr"]
    ckpt.wait()
    write_part(run, 1, "orchestrator", lambda folder: (folder / "state.json").write_text("{}"))
    assert is_complete(run.checkpoint_dir(1))
    folder = run.checkpoint_dir(1) / "trainer"
    assert {"model.safetensors", "state.pt", "meta.json"} <= {p.name for p in folder.iterdir()}

    # a fresh model (other seed) with fresh optimizer and scheduler, and another RNG state
    model2 = tiny_qwen3(seed=7)
    model2.train()
    opt2 = build_optimizer(model2, OptimConfig(lr=1e-2))
    sched2 = build_scheduler(opt2, SchedulerConfig(type="cosine", warmup_steps=2), max_steps=10)
    torch.manual_seed(0)
    random.seed(0)
    assert not torch.equal(model2.model.embed_tokens.weight, expected_state["model.embed_tokens.weight"])

    assert load_trainer_state(folder, model2, opt2, sched2) == 1
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected_state[k]), k
    assert model2.lm_head.weight.data_ptr() == model2.model.embed_tokens.weight.data_ptr()  # still tied
    got_opt = opt2.state_dict()
    assert len(got_opt["state"]) == len(expected_opt["state"]) > 0
    for idx, s in expected_opt["state"].items():
        assert torch.equal(got_opt["state"][idx]["step"], s["step"])
        assert torch.equal(got_opt["state"][idx]["exp_avg"], s["exp_avg"])
        assert torch.equal(got_opt["state"][idx]["exp_avg_sq"], s["exp_avg_sq"])
    assert sched2.last_epoch == sched.last_epoch == 1
    assert opt2.param_groups[0]["lr"] == pytest.approx(expected_lr) and expected_lr == pytest.approx(1e-2)
    assert torch.equal(torch.rand(4), expected_rand)
    assert random.random() == expected_py

    # both continue identically from here
    _train_step(model, opt, sched)
    _train_step(model2, opt2, sched2)
    for (k, v), v2 in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(v, v2), k


def test_checkpointer_snapshot_is_taken_at_save(run: RunDir) -> None:
    """Training on after ``save`` must not change what is written (the state is copied first)."""
    model = tiny_qwen3()
    opt = build_optimizer(model, OptimConfig(lr=1e-2))
    sched = build_scheduler(opt, SchedulerConfig(), max_steps=10)
    _train_step(model, opt, sched)
    before = model.model.embed_tokens.weight.detach().clone()
    ckpt = BackgroundCheckpointer(run, keep=1)
    ckpt.save(2, model, opt, sched)
    _train_step(model, opt, sched)  # may overlap the writer thread
    ckpt.wait()
    saved = load_file(run.checkpoint_dir(2) / "trainer" / "model.safetensors")
    assert torch.equal(saved["model.embed_tokens.weight"], before)
    assert not torch.equal(model.model.embed_tokens.weight, before)


def test_a_checkpoint_write_on_a_full_disk_fails_the_trainer_and_leaves_the_previous_one_loadable(disk: Path) -> None:
    """A real tmpfs: ``torch.save`` answers the full disk with a RuntimeError; the trainer gets ``DiskFull``."""
    run = RunDir(disk / "run")
    run.create()
    model = tiny_qwen3(seed=0)
    model.train()
    opt = build_optimizer(model, OptimConfig(lr=1e-2))
    sched = build_scheduler(opt, SchedulerConfig(), max_steps=10)
    _train_step(model, opt, sched)
    ckpt = BackgroundCheckpointer(run, keep=2)
    ckpt.save(2, model, opt, sched)
    ckpt.wait()
    write_part(run, 2, "orchestrator", lambda folder: (folder / "state.json").write_text("{}"))
    step2 = {k: v.clone() for k, v in model.state_dict().items()}
    _train_step(model, opt, sched)
    fill(disk, leave=600 * 1024)  # room for the weights (0.4 MiB), not for the optimizer state after them
    free = free_bytes(disk)
    ckpt.save(4, model, opt, sched)
    with pytest.raises(DiskFull) as info:
        ckpt.wait()  # (or ``check``, ``save``: the training thread's next step)
    trainer = run.checkpoint_dir(4) / "trainer"
    assert (
        str(info.value)
        == f"disk full while writing checkpoint step 4 (trainer part) at {trainer} (free 0 B of 4.0 MiB)"
    )
    assert isinstance(info.value.__cause__, RuntimeError)  # torch.save's own words say nothing of the disk
    ckpt.wait()  # raised once: nothing more
    ckpt.check()
    assert not run.checkpoint_dir(4).exists() and free_bytes(disk) == free  # all of its space is back
    assert complete_steps(run) == [2]

    fresh = tiny_qwen3(seed=7)
    fresh_opt = build_optimizer(fresh, OptimConfig(lr=1e-2))
    fresh_sched = build_scheduler(fresh_opt, SchedulerConfig(), max_steps=10)
    assert load_trainer_state(run.checkpoint_dir(2) / "trainer", fresh, fresh_opt, fresh_sched) == 2
    assert all(torch.equal(v, step2[k]) for k, v in fresh.state_dict().items())
