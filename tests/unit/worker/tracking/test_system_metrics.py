"""Per-process system metrics (``worker/tracking/system_metrics.py``): CPU % equals the process's CPU time over wall
time, RSS follows an allocation and matches ``/proc/self/status``; GPU memory follows a CUDA allocation (GPU
machine)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from worker.tracking.system_metrics import CPU_PERCENT, GPU_MEMORY_MB, GPU_UTIL_PERCENT, RSS_MB, ProcessSampler


def vm_rss_mib() -> float:
    """This process's resident set from the kernel (``VmRSS`` in kB), in MiB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_cpu_percent_is_cpu_time_over_wall_time() -> None:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    sampler = ProcessSampler()
    while time.process_time() - cpu0 < 0.4:  # 0.4 s of CPU time, however busy the machine is
        sum(i * i for i in range(10_000))
    values = sampler.sample()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    assert set(values) == {CPU_PERCENT, RSS_MB}  # no GPU given: no GPU names
    expected = 100 * cpu / wall
    assert values[CPU_PERCENT] == pytest.approx(expected, rel=0.25), (values, expected)
    assert values[CPU_PERCENT] > 5  # the loop ran: a sampler that always says 0 fails here


def test_rss_follows_an_allocation_and_matches_the_kernel() -> None:
    sampler = ProcessSampler()
    before = sampler.sample()[RSS_MB]
    assert before == pytest.approx(vm_rss_mib(), abs=8)
    block = b"\x01" * (128 * 2**20)  # written, so resident
    after = sampler.sample()[RSS_MB]
    assert after is not None and before is not None
    assert after - before == pytest.approx(128, abs=16)
    assert after == pytest.approx(vm_rss_mib(), abs=8)
    del block


def test_a_cpu_device_logs_no_gpu_metrics() -> None:
    import torch

    assert set(ProcessSampler(torch.device("cpu")).sample()) == {CPU_PERCENT, RSS_MB}


@pytest.mark.gpu
def test_gpu_memory_follows_a_cuda_allocation() -> None:
    import torch

    dev = torch.device("cuda", 0)
    sampler = ProcessSampler(dev)
    before = sampler.sample()
    x = torch.ones(256 * 2**20 // 4, device=dev)  # 256 MiB of float32
    after = sampler.sample()
    assert set(after) == {CPU_PERCENT, RSS_MB, GPU_MEMORY_MB, GPU_UTIL_PERCENT}
    assert after[GPU_MEMORY_MB] is not None and before[GPU_MEMORY_MB] is not None
    assert after[GPU_MEMORY_MB] - before[GPU_MEMORY_MB] >= 256
    util = after[GPU_UTIL_PERCENT]
    assert util is None or 0 <= util <= 100
    del x
