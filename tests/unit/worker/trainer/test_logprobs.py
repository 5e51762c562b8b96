"""The trainer's fused LM head and attention selection compute what the materialised-logits path computed.

``fused_logprob_entropy`` (chunked head + log-softmax + entropy, recomputing backward) against
``selective_log_softmax``/``entropy_from_logits`` on full logits; ``train_step`` (fused head, SDPA
``is_causal`` for one-sample rows, packing masks otherwise) against each sample run alone through the
plain HF model with full fp32 logits. fp32 throughout: equal to ~1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3ForCausalLM

from tests.support.models import tiny_qwen3
from worker.spec import validate_spec
from worker.trainer.logprobs import entropy_from_logits, fused_logprob_entropy, selective_log_softmax
from worker.trainer.loss import LossInputs, compute_sample_loss
from worker.trainer.train import train_step


@pytest.mark.parametrize("with_temps", [False, True])
def test_fused_head_equals_full_logits(with_temps: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    n, d, vocab = 37, 16, 50
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64).float().requires_grad_()
    weight = (0.25 * torch.randn(vocab, d, generator=gen)).requires_grad_()  # logits of a few units
    targets = torch.randint(0, vocab, (n,), generator=gen)
    temps = (0.5 + torch.rand(n, generator=gen)) if with_temps else None
    coef = torch.randn(n, generator=gen)  # a loss that weighs every log-prob differently

    logits = hidden @ weight.T
    if temps is not None:
        logits = logits / temps[:, None]
    ref_lp = selective_log_softmax(logits, targets)
    ref_ent = entropy_from_logits(logits.detach())
    (ref_lp * coef).sum().backward()
    ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    lp, ent = fused_logprob_entropy(hidden, weight, targets, temps, chunk_size=8)  # 5 chunks, the last partial
    assert not ent.requires_grad and lp.dtype == ent.dtype == torch.float32
    (lp * coef).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_gh, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weight.grad, ref_gw, atol=1e-6, rtol=1e-5)


def test_fused_head_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="weight \\[vocab, D\\]"):
        fused_logprob_entropy(torch.zeros(3, 4), torch.zeros(5, 6), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="share a dtype"):
        fused_logprob_entropy(
            torch.zeros(3, 4), torch.zeros(5, 4, dtype=torch.float64), torch.zeros(3, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="temps"):
        fused_logprob_entropy(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long), torch.ones(2))


def _model(attention: str = "sdpa") -> Qwen3ForCausalLM:
    return tiny_qwen3(attention=attention).train()


def _samples() -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for k, (p, c) in enumerate(((6, 9), (4, 3), (7, 5), (3, 8))):
        out.append(
            {
                "input_ids": torch.randint(0, 300, (p + c,), generator=gen).tolist(),
                "loss_mask": [0] * p + [1] * c,
                "sampling_logprobs": [0.0] * p + (-torch.rand(c, generator=gen) * 3).tolist(),
                "advantage": [1.0, -0.5, 2.0, -1.0][k],
                "temperature": [1.0, 1.0, 0.7, 1.3][k],
                "policy_span": [0, 0],
            }
        )
    return out


@pytest.mark.parametrize(("attention", "checkpointing"), [("sdpa", False), ("flex_attention", True)])
def test_train_step_equals_each_sample_alone_with_full_logits(attention: str, checkpointing: bool) -> None:
    """Rows of one sample (SDPA is_causal) and of three (packing mask), fused head: the per-sample reference.

    A flex attention model runs one-sample rows through SDPA; with activation checkpointing the
    recompute in the backward pass must take that kernel again. (Flex attention has no backward on
    CPU, so that case trains one-sample rows only; ``test_fsdp.py``'s GPU test packs them.)
    """
    spec = validate_spec("rl", {"model": {"name": "unused"}, "orchestrator": {"seq_len": 64}})
    samples = _samples()
    n_tokens = sum(sum(s["loss_mask"]) for s in samples)
    batch = {"step": 1, "num_samples": 4, "num_loss_tokens": n_tokens, "micro_batches": [samples[:1], samples[1:]]}
    if attention == "flex_attention":
        batch["micro_batches"] = [[s] for s in samples]
    model = _model(attention)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got = train_step(model, batch, spec, step=1)  # type: ignore[arg-type]
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model = _model()
    loss = entropy = 0.0
    for s in samples:  # each alone, no mask, full fp32 logits [L, vocab], log_softmax at the temperature
        ids = torch.tensor([s["input_ids"]])
        logits = model(input_ids=ids).logits[0, :-1] / s["temperature"]
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        mask = torch.tensor(s["loss_mask"][1:], dtype=torch.bool)
        out = compute_sample_loss(
            "dppo_kl",
            LossInputs(
                trainer_logprobs=lp,
                sampling_logprobs=torch.tensor(s["sampling_logprobs"][1:]),
                advantages=torch.full_like(lp, s["advantage"]),
                loss_mask=mask,
            ),
        )
        (out.loss / n_tokens).backward()
        loss += float(out.loss.detach()) / n_tokens
        probs = torch.softmax(logits.detach(), -1)
        entropy += float(-(probs * torch.log_softmax(logits.detach(), -1)).sum(-1)[mask].sum()) / n_tokens
    assert math.isclose(got["loss"], loss, rel_tol=1e-5, abs_tol=1e-7)
    assert got["attended_pairs"] == sum(n * (n + 1) // 2 for n in (len(s["input_ids"]) for s in samples))
    assert math.isclose(got["entropy"], entropy, rel_tol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got_grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert any(g.abs().max() > 0 for g in got_grads.values())
