"""Worker capacity (``worker/launchers/capacity.py``): what this machine declares, and specs checked against a
capacity."""

from __future__ import annotations

import os
from typing import Any

import pytest

from worker.launchers.capacity import Capacity, check, detect
from worker.spec import SpecError, validate_spec

CAP = Capacity(cores=4, memory_gib=8, gpus=1)
MODEL = {"model": {"name": "some/model"}}


def _refusal(data: dict[str, Any], kind: str = "rl", cap: Capacity = CAP) -> str:
    with pytest.raises(SpecError) as info:
        check(validate_spec(kind, {**MODEL, **data}), cap)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_detect_reads_this_machine() -> None:
    cap = detect()
    assert cap.cores == len(os.sched_getaffinity(0))
    with open("/proc/meminfo") as f:
        kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert cap.memory_gib == round(kib / 2**20, 1)
    assert cap.gpus >= 0
    assert str(CAP) == "4 cores, 8 GiB, 1 GPUs"


def test_detect_counts_no_gpu_when_none_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect().gpus == 0


def test_a_spec_that_fits_passes() -> None:
    check(
        validate_spec("rl", {**MODEL, "trainer": {"threads": 4}, "launcher": {"local": {"trainer_processes": 4}}}), CAP
    )
    check(validate_spec("sft", {**MODEL, "threads": 4}), CAP)
    check(validate_spec("rl", {**MODEL, "launcher": {"memory_limit_gib": 8}}), CAP)  # the whole machine: allowed


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"trainer": {"threads": 1000}},
            "trainer.threads: 1000 exceeds the worker's capacity (4 cores, 8 GiB, 1 GPUs): at most 4",
        ),
        (
            {"launcher": {"local": {"trainer_processes": 5}}},
            "launcher.local.trainer_processes: 5 exceeds the worker's capacity (4 cores, 8 GiB, 1 GPUs): at most 4",
        ),
        (
            {"launcher": {"local": {"inference_gpus": [0, 1]}}},
            "launcher.local.inference_gpus: [0, 1] exceeds the worker's capacity (4 cores, 8 GiB, 1 GPUs): "
            "device ids below 1",
        ),
        (
            {"trainer": {"device": "cuda"}, "launcher": {"local": {"trainer_gpus": [3]}}},
            "launcher.local.trainer_gpus: [3] exceeds the worker's capacity (4 cores, 8 GiB, 1 GPUs): device ids below 1",
        ),
        (
            {"launcher": {"memory_limit_gib": 8.5}},
            "launcher.memory_limit_gib: 8.5 exceeds the worker's capacity (4 cores, 8 GiB, 1 GPUs): at most 8",
        ),
        (
            {"orchestrator": {"batch_size": 4096, "group_size": 64}, "inference": {"max_model_len": 4096}},
            "orchestrator.batch_size: 4096 (x group_size 64 x inference.max_model_len 4096 = 1073741824 rollout tokens "
            "per step) exceeds the worker's capacity (4 cores, 8 GiB, 1 GPUs): at most 16777216 tokens (256 bytes "
            "each in 0.5 of the memory)",
        ),
    ],
)
def test_a_spec_beyond_the_capacity_names_key_value_and_capacity(data: dict[str, Any], message: str) -> None:
    assert _refusal(data) == message


def test_cuda_without_a_gpu_and_sft_threads() -> None:
    cpu_only = Capacity(cores=2, memory_gib=4, gpus=0)
    assert _refusal({"trainer": {"device": "cuda"}}, cap=cpu_only) == (
        "trainer.device: 'cuda' exceeds the worker's capacity (2 cores, 4 GiB, 0 GPUs): no GPU"
    )
    assert _refusal({"inference": {"enforce_eager": False}}, cap=cpu_only) == (
        "inference.enforce_eager: false exceeds the worker's capacity (2 cores, 4 GiB, 0 GPUs): CUDA graphs need a "
        "GPU; leave it unset or set it to true"
    )
    assert _refusal({"threads": 3}, kind="sft", cap=cpu_only) == (
        "threads: 3 exceeds the worker's capacity (2 cores, 4 GiB, 0 GPUs): at most 2"
    )


def test_slurm_runs_are_not_checked_against_the_worker() -> None:
    """Their processes run on the cluster's nodes; only the spec's static bounds apply."""
    spec = validate_spec("rl", {**MODEL, "trainer": {"threads": 64}, "launcher": {"kind": "slurm"}})
    check(spec, Capacity(cores=1, memory_gib=1, gpus=0))
