"""``train_step`` on a real (tiny) Qwen3: shared-prompt packing gives the same loss, metrics and gradients."""

from __future__ import annotations

import math

import torch
from transformers import Qwen3ForCausalLM

from tests.support.models import tiny_qwen3
from worker.orchestrator.packing import pack, pack_shared_prompt
from worker.spec import validate_spec
from worker.trainer.train import train_step


def _model() -> Qwen3ForCausalLM:
    return tiny_qwen3(tie=False).train()


def _samples() -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    samples = []
    for g, p_len in enumerate((9, 5)):
        prompt = torch.randint(0, 300, (p_len,), generator=gen).tolist()
        for k in range(4):
            n = 2 + (k * 3 + g) % 5
            c = torch.randint(0, 300, (n,), generator=gen).tolist()
            samples.append(
                {
                    "input_ids": prompt + c,
                    "loss_mask": [0] * p_len + [1] * n,
                    "sampling_logprobs": [0.0] * p_len + (-torch.rand(n, generator=gen) * 3).tolist(),
                    "advantage": [-1.0, 0.5, 1.5, -1.0][k],
                    "temperature": [1.0, 1.5][g],
                    "policy_span": [0, 0],
                    "group": g,
                    "prefix_len": p_len,
                }
            )
    return samples


def _run(share: bool) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    spec = validate_spec("rl", {"model": {"name": "unused"}, "orchestrator": {"seq_len": 32}})
    samples = _samples()
    if not share:  # without group and prefix_len every sample is laid out in full
        samples = [{k: v for k, v in s.items() if k not in ("group", "prefix_len")} for s in samples]
    lengths = [len(s["input_ids"]) for s in samples]
    bins = (
        pack_shared_prompt(lengths, [s["prefix_len"] for s in samples], [s["group"] for s in samples], 32)
        if share
        else pack(lengths, 32)
    )
    batch = {
        "step": 1,
        "num_samples": len(samples),
        "num_loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "micro_batches": [[samples[i] for i in b] for b in bins],
    }
    model = _model()
    metrics = train_step(model, batch, spec, step=1)  # type: ignore[arg-type]
    return metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_shared_prompt_packing_changes_nothing_but_the_token_count() -> None:
    shared, g_shared = _run(share=True)
    full, g_full = _run(share=False)
    assert full["trained_tokens"] == sum(len(s["input_ids"]) for s in _samples())
    assert shared["trained_tokens"] < full["trained_tokens"]
    for name in ("loss", "entropy", "mismatch_kl", "is_ratio", "masked_fraction"):
        assert math.isclose(shared[name], full[name], rel_tol=1e-5, abs_tol=1e-7), name
    assert g_shared.keys() == g_full.keys()
    for name in g_full:
        torch.testing.assert_close(g_shared[name], g_full[name], atol=1e-6, rtol=1e-4)
    assert any(g.abs().max() > 0 for g in g_full.values())


def test_a_separable_loss_in_one_call_per_unit_equals_one_call_per_sample(monkeypatch) -> None:
    """A built-in loss at the token level runs once per (on-policy, env) unit of a micro-batch instead of once per
    sample: loss, every metric (on-policy and per-env mismatch_kl included) and the gradients are the per-sample
    ones; a micro-batch of 8 samples in 4 units takes 4 calls."""
    import worker.trainer.train as train

    spec = validate_spec(
        "rl",
        {
            "model": {"name": "unused"},
            "orchestrator": {"seq_len": 64},
            "env": [{"name": "a", "id": "reverse_text"}, {"name": "b", "id": "reverse_text"}],
        },
    )
    samples = _samples()
    for i, s in enumerate(samples):  # interleaved: on/off policy (step 2 trains v1) and two environments
        s["policy_span"] = [1, 1] if i % 2 else [0, 1]
        s["env"] = "ab"[(i // 2) % 2]
    batch = {"step": 2, "num_samples": 8, "num_loss_tokens": sum(sum(s["loss_mask"]) for s in samples)}
    batch["micro_batches"] = [samples]
    calls: list[int] = []
    real = train.loss_calls

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        calls.append(len(out))
        return out

    monkeypatch.setattr(train, "loss_calls", counted)
    runs = {}
    for separable in (True, False):
        monkeypatch.setattr(train, "token_separable", lambda *_, _s=separable: _s)
        model = _model()
        metrics = train.train_step(model, batch, spec, step=2)  # type: ignore[arg-type]
        runs[separable] = (metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert calls == [4, 8]
    (one, g_one), (each, g_each) = runs[True], runs[False]
    assert one.keys() == each.keys()
    for name in one:
        assert math.isclose(one[name], each[name], rel_tol=1e-5, abs_tol=1e-7), name
    assert not math.isnan(one["mismatch_kl_on_policy"]) and not math.isnan(one["mismatch_kl/b"])
    for name in g_each:
        torch.testing.assert_close(g_one[name], g_each[name], atol=1e-6, rtol=1e-4)


def test_lora_step_trains_adapters_only_and_starts_at_the_base() -> None:
    """With ``[trainer.lora]`` the first step sees the base model (B = 0): the same loss and metrics as the full
    model; gradients reach only the adapters, and only B (dL/dA = B^T (...) = 0 while B = 0)."""
    from worker.spec import LoraConfig
    from worker.trainer.lora import wrap

    spec = validate_spec("rl", {"model": {"name": "unused"}, "orchestrator": {"seq_len": 32}})
    samples = _samples()
    batch = {
        "step": 1,
        "num_samples": len(samples),
        "num_loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "micro_batches": [[s] for s in samples],
    }
    full = train_step(_model(), batch, spec, step=1)  # type: ignore[arg-type]
    model = _model()
    wrap(model, LoraConfig(rank=4, target_modules=["q_proj", "down_proj"]))
    lora = train_step(model, batch, spec, step=1)  # type: ignore[arg-type]
    assert lora.keys() == full.keys()
    for name, value in full.items():
        assert math.isclose(lora[name], value, rel_tol=1e-6, abs_tol=1e-7) or (
            math.isnan(value) and math.isnan(lora[name])
        ), name
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == 2 * 2 * 2  # 2 layers x (q_proj, down_proj) x (A, B)
    assert all(g.abs().max() == 0 for n, g in grads.items() if "lora_A" in n)
    assert all(g.abs().max() > 0 for n, g in grads.items() if "lora_B" in n)
