"""Trainer components (``worker/trainer/common.py``) on CPU: packing masks, weights, scheduler, checkpoints."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from worker.checkpoint import is_complete, write_part
from worker.rundir import STABLE_MARKER, RunDir
from worker.spec import OptimConfig, SchedulerConfig
from worker.trainer.common import (
    BackgroundCheckpointer,
    build_optimizer,
    build_scheduler,
    load_trainer_state,
    micro_batch_tensors,
    packed_attention_mask,
    publish_weights,
)


def tiny_qwen3(seed: int = 0, tie: bool = True) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    r = RunDir(tmp_path / "run")
    r.create()
    return r


# ----------------------------------------------------------------------------- packing


def test_packed_attention_mask_two_samples() -> None:
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    got = packed_attention_mask([2, 3])
    assert got.shape == (1, 1, 5, 5)
    assert got.dtype == torch.bool
    assert torch.equal(got[0, 0], expected)
    assert torch.equal(packed_attention_mask([1, 1])[0, 0], torch.eye(2, dtype=torch.bool))


def test_micro_batch_tensors_fields() -> None:
    t = micro_batch_tensors(
        [
            {"input_ids": [5, 6], "loss_mask": [0, 1], "sampling_logprobs": [0.0, -0.5]},
            {"input_ids": [7, 8, 9], "loss_mask": [0, 1, 1]},
        ]
    )
    assert t.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert t.position_ids.tolist() == [[0, 1, 0, 1, 2]]
    assert t.loss_mask.tolist() == [False, True, False, True, True]
    assert t.sampling_logprobs.tolist() == [0.0, -0.5, 0.0, 0.0, 0.0]
    assert t.spans == [(0, 2), (2, 3)]
    assert torch.equal(t.attention_mask, packed_attention_mask([2, 3]))


@torch.no_grad()
def test_packed_logits_equal_single_samples() -> None:
    model = tiny_qwen3()
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 300, (7,), generator=gen).tolist()
    b = torch.randint(0, 300, (5,), generator=gen).tolist()
    t = micro_batch_tensors([{"input_ids": a, "loss_mask": [1] * 7}, {"input_ids": b, "loss_mask": [1] * 5}])
    packed = model(input_ids=t.input_ids, position_ids=t.position_ids, attention_mask=t.attention_mask).logits[0]
    alone_a = model(input_ids=torch.tensor([a])).logits[0]
    alone_b = model(input_ids=torch.tensor([b])).logits[0]
    assert packed.shape == (12, 300)
    torch.testing.assert_close(packed[:7], alone_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[7:], alone_b, atol=1e-5, rtol=0)
    # and the mask matters: without it, b's logits see a's tokens
    unmasked = model(input_ids=t.input_ids, position_ids=t.position_ids).logits[0]
    assert (unmasked[7:] - alone_b).abs().max() > 1e-3


@torch.no_grad()
def test_shared_prompt_row_gives_each_sample_its_own_logits() -> None:
    model = tiny_qwen3()
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 300, (6,), generator=gen).tolist()
    completions = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (4, 2, 5)]
    other = torch.randint(0, 300, (7,), generator=gen).tolist()  # another group, laid out in full
    samples = [
        {"input_ids": prompt + c, "loss_mask": [0] * 6 + [1] * len(c), "group": 0, "prefix_len": 6} for c in completions
    ]
    samples.append({"input_ids": other, "loss_mask": [0] * 3 + [1] * 4, "group": 1, "prefix_len": 3})
    t = micro_batch_tensors(samples)
    assert t.input_ids.shape == (1, 6 + 4 + 2 + 5 + 7)  # the prompt once
    assert t.position_ids[0].tolist() == [*range(10), 6, 7, 6, 7, 8, 9, 10, *range(7)]
    assert t.spans == [(0, 10), (10, 2), (12, 5), (17, 7)]
    assert t.rows[1].tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
        10,
    ]  # tokens 1..7 of sample 1: prompt rows of sample 0, then its own
    packed = model(input_ids=t.input_ids, position_ids=t.position_ids, attention_mask=t.attention_mask).logits[0]
    for s, rows in zip(samples, t.rows, strict=True):
        alone = model(input_ids=torch.tensor([s["input_ids"]])).logits[0]
        torch.testing.assert_close(packed[rows], alone[:-1], atol=1e-5, rtol=0)


def test_shared_prompt_needs_the_same_prompt_tokens() -> None:
    a = {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "group": 0, "prefix_len": 2}
    b = {"input_ids": [1, 9, 5, 6], "loss_mask": [0, 0, 1, 1], "group": 0, "prefix_len": 2}  # different prompt
    t = micro_batch_tensors([a, b])
    assert t.input_ids[0].tolist() == [1, 2, 3, 4, 1, 9, 5, 6]
    assert torch.equal(t.attention_mask, packed_attention_mask([4, 4]))


# ----------------------------------------------------------------------------- weights


def test_publish_weights_tied(run: RunDir) -> None:
    model = tiny_qwen3(tie=True)
    final = publish_weights(model, run, 1, keep_versions=2)
    assert final == run.weight_dir(1)
    assert sorted(p.name for p in final.iterdir()) == [STABLE_MARKER, "model.safetensors"]
    assert (final / STABLE_MARKER).read_text() == "1"
    weights = load_file(final / "model.safetensors")
    assert "lm_head.weight" not in weights
    assert torch.equal(weights["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert set(weights) == set(model.state_dict()) - {"lm_head.weight"}
    assert run.latest_stable_weights() == (1, final)
    assert not [p for p in run.weights.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_publish_weights_untied_keeps_lm_head(run: RunDir) -> None:
    model = tiny_qwen3(tie=False)
    weights = load_file(publish_weights(model, run, 3, keep_versions=1) / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], model.lm_head.weight)


def test_publish_weights_keeps_newest_versions(run: RunDir) -> None:
    model = tiny_qwen3()
    for v in range(1, 6):
        publish_weights(model, run, v, keep_versions=2)
    assert sorted(p.name for p in run.weights.iterdir()) == ["step_4", "step_5"]
    publish_weights(model, run, 6, keep_versions=3)
    assert sorted(p.name for p in run.weights.iterdir()) == ["step_4", "step_5", "step_6"]


# ----------------------------------------------------------------------------- scheduler


def _factors(cfg: SchedulerConfig, max_steps: int, steps: int) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2.0)
    sched = build_scheduler(opt, cfg, max_steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"] / 2.0)
        opt.step()
        sched.step()
    return out


def test_scheduler_constant_with_warmup() -> None:
    got = _factors(SchedulerConfig(type="constant", warmup_steps=4), max_steps=10, steps=7)
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])
    assert _factors(SchedulerConfig(), max_steps=3, steps=3) == [1.0, 1.0, 1.0]


def test_scheduler_linear_with_warmup() -> None:
    # warmup 2 of 10 steps, then 1 - (s - 2) / 8 scaled into [0.2, 1]: 0.2 + 0.8 * (1 - (s - 2) / 8)
    got = _factors(SchedulerConfig(type="linear", warmup_steps=2, min_lr_ratio=0.2), max_steps=10, steps=12)
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.2])


def test_scheduler_cosine_with_warmup() -> None:
    # warmup 2, then 0.1 + 0.9 * 0.5 * (1 + cos(pi * (s - 2) / 4)) for max_steps 6
    got = _factors(SchedulerConfig(type="cosine", warmup_steps=2, min_lr_ratio=0.1), max_steps=6, steps=8)
    half = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))  # 0.868198...
    quarter = 0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4))  # 0.231801...
    assert got == pytest.approx([0.5, 1.0, 1.0, half, 0.55, quarter, 0.1, 0.1])
    assert half == pytest.approx(0.8681980515)


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
