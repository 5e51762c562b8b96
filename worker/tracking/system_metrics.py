"""Per-process system metrics, logged by the trainer and the orchestrator with each step's metrics (``metrics.jsonl``,
then the server like any other metric):

| name | unit | what |
|---|---|---|
| ``system/cpu_percent`` | % of one core | this process's CPU time since the previous sample / wall time (psutil; 200 = two cores busy) |
| ``system/rss_mb`` | MiB | resident set size of this process (psutil ``memory_info().rss``) |
| ``system/gpu_util_percent`` | % | utilisation of the process's GPU over the driver's last sample period (NVML through ``torch.cuda.utilization``) |
| ``system/gpu_memory_mb`` | MiB | GPU memory this process's CUDA caching allocator holds (``torch.cuda.memory_reserved``) |

The GPU names are logged only by a process given a CUDA device (the trainer on a GPU); ``gpu_util_percent`` is null
where NVML is not installed. The first sample's ``cpu_percent`` covers the time since the sampler was made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    import torch

CPU_PERCENT = "system/cpu_percent"
RSS_MB = "system/rss_mb"
GPU_UTIL_PERCENT = "system/gpu_util_percent"
GPU_MEMORY_MB = "system/gpu_memory_mb"
PROCESS_METRICS = (CPU_PERCENT, RSS_MB)
"""Logged by every sampling process."""
GPU_METRICS = (GPU_UTIL_PERCENT, GPU_MEMORY_MB)
"""Logged also by a process with a CUDA device."""
MIB = 2**20


class ProcessSampler:
    """Samples this process's system metrics (module docstring) once per step: ``sample()``."""

    def __init__(self, gpu: torch.device | None = None) -> None:
        """``gpu``: the process's CUDA device, or None (CPU only; a non-CUDA device counts as None)."""
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # starts the interval the first sample measures
        self.gpu = gpu if gpu is not None and gpu.type == "cuda" else None

    def sample(self) -> dict[str, float | None]:
        """Name -> value of each metric of the module docstring this process logs (CPU %, MiB)."""
        values: dict[str, float | None] = {
            CPU_PERCENT: self.process.cpu_percent(None),
            RSS_MB: self.process.memory_info().rss / MIB,
        }
        if self.gpu is not None:
            import torch

            values[GPU_MEMORY_MB] = torch.cuda.memory_reserved(self.gpu) / MIB
            try:
                values[GPU_UTIL_PERCENT] = float(torch.cuda.utilization(self.gpu))
            except (ModuleNotFoundError, RuntimeError):  # no NVML (pynvml) on this machine, or it failed to start
                values[GPU_UTIL_PERCENT] = None
        return values
