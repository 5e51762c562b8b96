"""FSDP2 on CPU (gloo): a trainer step on 2 ranks equals the one-process step (``tests/support/fsdp_step.py``)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.serial  # gloo process groups: not beside the parallel pass (a peer closed under load)

ROOT = Path(__file__).resolve().parents[4]
SCRIPT = ROOT / "tests" / "support" / "fsdp_step.py"


def run_step(out: Path, nproc: int, *args: str) -> dict:
    """Run ``fsdp_step.py`` plainly (``nproc`` 0) or under ``torchrun --nproc-per-node nproc``; its results."""
    launcher = [] if nproc == 0 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, *launcher, str(SCRIPT), "--out", str(out), *args], check=True, cwd=ROOT, env=env, timeout=300
    )
    return torch.load(out, weights_only=False)


def assert_same_step(one: dict, two: dict, *, rtol: float, atol: float) -> None:
    for name in ("loss", "entropy", "mismatch_kl", "is_ratio", "masked_fraction", "mismatch_kl_on_policy"):
        assert math.isclose(one["metrics"][name], two["metrics"][name], rel_tol=rtol, abs_tol=atol), name
    for name in ("trained_tokens", "attended_pairs"):
        assert one["metrics"][name] == two["metrics"][name], name
    assert math.isclose(one["grad_norm"], two["grad_norm"], rel_tol=rtol, abs_tol=atol)
    assert one["params"].keys() == two["params"].keys()
    for name, p in one["params"].items():
        torch.testing.assert_close(two["params"][name], p, rtol=rtol, atol=atol, msg=name)


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """The one-process fp32 step, and the 2-rank steps: fp32, fp32 with activation checkpointing, bf16."""
    tmp = tmp_path_factory.mktemp("fsdp")
    one = run_step(tmp / "one.pt", 0)
    two = run_step(tmp / "two.pt", 2, "--variants", "float32,float32+ac,bfloat16")
    return one, two


def test_fsdp2_two_ranks_equal_one_process(steps: tuple[dict, dict]) -> None:
    one, two = steps[0]["float32"], steps[1]["float32"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    # 6 samples with a 9-token prompt (completions 2+5+8+4+7+3) and 6 with a 5-token one (3+6+2+5+8+4)
    assert one["metrics"]["trained_tokens"] == 6 * 9 + 29 + 6 * 5 + 28 == 141
    assert one["grad_norm"] > 0.01  # so max_grad_norm 0.01 clips: the reported norm is the one before clipping
    assert_same_step(one, two, rtol=1e-5, atol=1e-6)


def test_weights_gathered_one_tensor_at_a_time_equal_the_full_state_dict(steps: tuple[dict, dict]) -> None:
    """``iter_full_weights`` (the colocated weight sync's source): on 2 FSDP2 ranks, with and without activation
    checkpointing, the same names in the same order and the same values as the gathered state dict, the tied
    ``lm_head`` left out; ``weight_shapes`` gives the full (global) shapes."""
    for result in (steps[0]["float32"], steps[1]["float32"], steps[1]["float32+ac"]):
        params = {k: v for k, v in result["params"].items() if k != "lm_head.weight"}
        assert list(result["one_by_one"]) == list(params) == list(result["shapes"])
        for name, t in params.items():
            assert torch.equal(result["one_by_one"][name], t), name
            assert tuple(result["shapes"][name]) == tuple(t.shape), name


def test_fsdp2_activation_checkpointing_changes_nothing(steps: tuple[dict, dict]) -> None:
    assert_same_step(steps[1]["float32"], steps[1]["float32+ac"], rtol=1e-6, atol=1e-7)


def test_fsdp2_bf16_policy_keeps_fp32_master_weights(steps: tuple[dict, dict]) -> None:
    """bf16 params/compute with fp32 reduction and fp32 master weights: the step stays within bf16 error."""
    fp32, bf16 = steps[1]["float32"], steps[1]["bfloat16"]
    assert bf16["params"]["model.embed_tokens.weight"].dtype == torch.float32
    assert math.isclose(bf16["metrics"]["loss"], fp32["metrics"]["loss"], rel_tol=2e-2, abs_tol=2e-3)
    assert math.isclose(bf16["grad_norm"], fp32["grad_norm"], rel_tol=5e-2)


@pytest.mark.gpu
def test_fsdp2_two_gpus_equal_one_gpu(tmp_path: Path) -> None:
    """bf16 params/compute, fp32 reduction: 2 GPUs give the 1-GPU step (same kernels; only the reduction order differs)."""
    one = run_step(tmp_path / "one.pt", 0, "--device", "cuda", "--variants", "bfloat16")["bfloat16"]
    two = run_step(tmp_path / "two.pt", 2, "--device", "cuda", "--variants", "bfloat16")["bfloat16"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for name in ("loss", "entropy", "mismatch_kl", "is_ratio"):
        assert math.isclose(one["metrics"][name], two["metrics"][name], rel_tol=1e-2, abs_tol=1e-4), name
    assert math.isclose(one["grad_norm"], two["grad_norm"], rel_tol=1e-2)
    # AdamW's first step moves each weight by about lr * sign(grad): only weights whose bf16 gradient is ~0
    # may move differently, so nearly every weight must agree to float precision
    differing = sum(int((two["params"][n] - p).abs().gt(1e-6).sum()) for n, p in one["params"].items())
    total = sum(p.numel() for p in one["params"].values())
    assert differing <= total // 100, f"{differing} of {total} weights differ"


def test_attended_pairs_count_the_mask() -> None:
    """MFU's attention term: every token of a packed row (shared prompts too) sees its position + 1 keys."""
    from worker.trainer.packed import micro_batch_tensors

    samples = [
        {"input_ids": list(range(p + c)), "loss_mask": [0] * p + [1] * c, "group": g, "prefix_len": p}
        for g, p, c in ((0, 7, 3), (0, 7, 5), (1, 4, 2), (2, 0, 6))
    ]
    t = micro_batch_tensors(samples)
    assert t.input_ids.shape[1] == 10 + 5 + 6 + 6
    assert t.attended_pairs == int(t.attention_mask.sum()) == 55 + (8 + 9 + 10 + 11 + 12) + 21 + 21


@pytest.mark.gpu
def test_flex_attention_and_compiled_blocks_equal_sdpa_eager(tmp_path: Path) -> None:
    """The flex attention block mask, with and without compiled blocks, gives the dense-mask SDPA step (bf16)."""
    variants = ("bfloat16", "bfloat16+flex", "bfloat16+flex+compile+ac")
    got = run_step(tmp_path / "gpu.pt", 0, "--device", "cuda", "--variants", ",".join(variants))
    sdpa = got["bfloat16"]
    for variant in variants[1:]:
        for name in ("loss", "entropy", "mismatch_kl"):
            assert math.isclose(sdpa["metrics"][name], got[variant]["metrics"][name], rel_tol=2e-2, abs_tol=1e-3), (
                variant,
                name,
            )
        assert math.isclose(sdpa["grad_norm"], got[variant]["grad_norm"], rel_tol=2e-2), variant


def test_trainer_process_on_two_ranks_resumes_in_one(tmp_path: Path) -> None:
    """``python -m worker.trainer`` under torchrun (2 gloo ranks): rank 0 alone writes metrics, weights,
    checkpoints and the final model; its step-1 checkpoint resumes in one plain process to the same step 2."""
    import json
    import shutil

    from safetensors.torch import load_file

    from tests.support.fsdp_step import batch
    from worker.orchestrator.batch import write_batch
    from worker.policy.models import init_model
    from worker.run.rundir import RunDir, read_jsonl
    from worker.spec import validate_spec

    model_dir = init_model(tmp_path / "model", size="tiny", seed=0)
    run = RunDir(tmp_path / "run")
    run.create()
    spec = validate_spec(
        "rl",
        {
            "model": {"name": str(model_dir)},
            "max_steps": 2,
            "orchestrator": {"seq_len": 64},
            "trainer": {"optim": {"lr": 1e-3}},
            "ckpt": {"interval": 1, "keep": 2},
        },
    )
    run.config.write_text(spec.model_dump_json())
    for step in (1, 2):
        write_batch(run.batch(step), batch())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    subprocess.run(
        [*torchrun, "-m", "worker.trainer", "--run-dir", str(run.root)], check=True, cwd=ROOT, env=env, timeout=300
    )
    rows = [r for r in read_jsonl(run.metrics) if r["source"] == "trainer"]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["mfu"] is None and rows[0]["peak_memory_gib"] is None  # CPU: no peak FLOP/s, no GPU memory
    # the process's own system metrics (worker/tracking/system_metrics.py): a busy trainer holding a model; no GPU names
    # on CPU
    assert all(r["system/cpu_percent"] > 0 and r["system/rss_mb"] > 100 for r in rows), rows
    assert not any(k.startswith("system/gpu") for r in rows for k in r)
    assert all((run.weight_dir(s) / "STABLE").exists() for s in (1, 2))
    assert json.loads((run.final / "config.json").read_text())["num_hidden_layers"] == 4
    two_rank = load_file(run.weight_dir(2) / "model.safetensors")
    shutil.rmtree(run.weight_dir(2))

    subprocess.run(
        [sys.executable, "-m", "worker.trainer", "--run-dir", str(run.root), "--resume-step", "1"],
        check=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    resumed = load_file(run.weight_dir(2) / "model.safetensors")
    assert resumed.keys() == two_rank.keys()
    for name, w in two_rank.items():
        torch.testing.assert_close(resumed[name], w, rtol=1e-5, atol=1e-6, msg=name)
    again = [r for r in read_jsonl(run.metrics) if r["source"] == "trainer"][-1]
    assert again["step"] == 2
    assert math.isclose(again["loss"], rows[1]["loss"], rel_tol=1e-5, abs_tol=1e-7)


def test_sample_logits_view_only_for_consecutive_rows() -> None:
    from worker.trainer.packed import PackedTensors

    x = torch.arange(12.0).reshape(6, 2)
    view = PackedTensors.sample_logits(x, torch.tensor([2, 3, 4]))
    assert view.data_ptr() == x[2].data_ptr() and view.tolist() == [[4, 5], [6, 7], [8, 9]]
    # first and last row 3 apart over 4 rows, yet not consecutive: a gather, not the slice 0..3
    assert PackedTensors.sample_logits(x, torch.tensor([0, 2, 1, 3])).tolist() == [[0, 1], [4, 5], [2, 3], [6, 7]]
