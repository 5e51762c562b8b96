"""The Slurm job script rendered from ``deploy/slurm/rl.sbatch.j2``: #SBATCH lines, the node split of a 4-node layout
(2 inference, 2 trainer) run through the real ``scontrol show hostnames``, the rendezvous and ports, the 1-node
script, and ``asyncrl slurm render``."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from worker.cli import main
from worker.inference.server import EXTENSION_CLS, run_server_command
from worker.launchers.slurm import render
from worker.spec import SpecError, validate_spec

HOME = Path("/srv/asyncrl/runs/7")


def spec_of(**slurm: object) -> object:
    return validate_spec(
        "rl", {"name": "big", "model": {"name": "/models/q"}, "launcher": {"kind": "slurm", "slurm": slurm}}
    )


FOUR_NODES = {
    "nodes": 4,
    "inference_nodes": 2,
    "gpus_per_node": 8,
    "partition": "gpu",
    "account": "rl",
    "time_limit": "04:00:00",
    "signal_before_end_s": 300,
    "rdzv_port": 29555,
    "inference_port": 8100,
    "extra_sbatch": ["--exclusive"],
    "env": {"NCCL_DEBUG": "WARN", "HF_HOME": "/data/hf cache"},
}


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def test_four_node_layout_sbatch_lines() -> None:
    script = render(
        spec_of(**FOUR_NODES), home=HOME, name="asyncrl-run-7", python="/venv/bin/python", workdir=Path("/srv/asyncrl")
    )
    assert sbatch_lines(script) == [
        "#SBATCH --job-name=asyncrl-run-7",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=rl",
        "#SBATCH --time=04:00:00",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@300",
        f"#SBATCH --chdir={HOME}",
        f"#SBATCH --output={HOME}/slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --exclusive",
    ]
    assert "export NCCL_DEBUG=WARN\nexport HF_HOME='/data/hf cache'\n" in script
    assert f"LOG_DIR={HOME}/slurm/attempt-$ATTEMPT" in script and "ATTEMPT=${SLURM_RESTART_COUNT:-0}" in script
    assert "worker.supervisor" not in script


def test_four_node_layout_roles_rendezvous_and_ports() -> None:
    script = render(spec_of(**FOUR_NODES), home=HOME, name="asyncrl-run-7", python="/venv/bin/python")
    sruns = [" ".join(block.split()) for block in re.findall(r"^srun .*?&$", script, flags=re.M | re.S)]
    assert [s.split(" \\ ")[0] for s in sruns] == [
        'srun --nodes=2 --ntasks=2 --nodelist="$INFERENCE_LIST"',
        'srun --nodes=2 --ntasks=2 --nodelist="$TRAINER_LIST"',
        'srun --nodes=1 --ntasks=1 --nodelist="$TRAINER_HEAD" --overlap',
    ]
    inference, trainer, orchestrator = sruns
    server = run_server_command(spec_of(**FOUR_NODES), "0.0.0.0", 8100, require_key=True, python="/venv/bin/python")
    assert f"env VLLM_SERVER_DEV_MODE=1 {shlex.join(server)} >>{HOME}/big/logs/inference.log" in inference
    assert "--middleware worker.inference.auth.RequireApiKey" in " ".join(server)  # every interface: keyed
    # the job's key is made at the job's start, never written into the script, and reaches every srun's environment
    key_line = "ASYNCRL_INFERENCE_API_KEY=$(/venv/bin/python -c 'from worker.inference.auth import new_api_key; "
    assert key_line in script and "export ASYNCRL_INFERENCE_API_KEY VLLM_API_KEY=$ASYNCRL_INFERENCE_API_KEY" in script
    assert script.index(key_line) < script.index("srun --nodes=2")
    assert server[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/q"]
    assert "--enable-lora" not in server
    assert (
        "/venv/bin/python -m torch.distributed.run --nnodes=2 --nproc-per-node=8 \\ --rdzv-backend=c10d "
        '--rdzv-endpoint="$ASYNCRL_RDZV_ENDPOINT" --rdzv-id=asyncrl-run-7 \\ -m worker.trainer '
        f"--run-dir {HOME}/big >>{HOME}/big/logs/trainer.log"
    ) in trainer
    assert f'-m worker.orchestrator --run-dir {HOME}/big \\ --inference-url "$ASYNCRL_INFERENCE_URL"' in orchestrator


@pytest.mark.slurm
def test_four_node_split_with_scontrol_hostnames() -> None:
    """The split lines of the script, run by bash with Slurm's own hostlist expansion."""
    assert shutil.which("scontrol"), "Slurm's scontrol is needed (deploy/slurm/local-cluster.sh start)"
    script = render(spec_of(**FOUR_NODES), home=HOME, name="asyncrl-run-7")
    split = script[script.index("mapfile") : script.index("srun ")]
    probe = split + 'echo "$ASYNCRL_INFERENCE_URL|$ASYNCRL_RDZV_ENDPOINT|$INFERENCE_LIST|$TRAINER_LIST|$TRAINER_HEAD"\n'
    out = subprocess.run(
        ["bash", "-c", probe],
        env={**os.environ, "SLURM_JOB_NODELIST": "gpu[07-09],gpu11"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out == [
        "inference: gpu07 gpu08 trainer: gpu09 gpu11 rendezvous: gpu09:29555",
        "http://gpu07:8100|gpu09:29555|gpu07,gpu08|gpu09,gpu11|gpu09",
    ]


def test_single_node_script_runs_the_supervisor() -> None:
    script = render(
        spec_of(requeue=False, signal_before_end_s=0),
        home=HOME,
        name="asyncrl-run-7",
        python="/venv/bin/python",
        workdir=Path("/srv/asyncrl"),
        resume=True,
    )
    assert sbatch_lines(script) == [
        "#SBATCH --job-name=asyncrl-run-7",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --no-requeue",
        f"#SBATCH --chdir={HOME}",
        f"#SBATCH --output={HOME}/slurm-%j.out",
        "#SBATCH --open-mode=append",
    ]
    assert (
        f"/venv/bin/python -m worker.supervisor --home {HOME} --resume >>{HOME}/supervisor.log 2>&1 &\npid=$!\n"
    ) in script
    assert "cd /srv/asyncrl\n" in script and "export ASYNCRL_LAUNCHER=slurm\n" in script
    assert "trap 'echo \"USR1 at $(date -u +%T): checkpoint and requeue\"; kill -USR1 $pid' USR1" in script
    assert "srun" not in script and "ASYNCRL_RUN_TOKEN" not in script  # the token is not written into the script
    subprocess.run(["bash", "-n", "-c", script], check=True)  # valid bash


def test_cli_render_prints_the_script_and_bad_specs_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "rl.toml"
    cfg.write_text(
        'name = "big"\n[model]\nname = "/models/q"\n[launcher]\nkind = "slurm"\n'
        "[launcher.slurm]\nnodes = 4\ninference_nodes = 2\n"
    )
    assert main(["slurm", "render", str(cfg), "--launcher.slurm.partition", "gpu"]) == 0
    out = capsys.readouterr().out
    spec = validate_spec(
        "rl",
        {
            "name": "big",
            "model": {"name": "/models/q"},
            "launcher": {"kind": "slurm", "slurm": {"nodes": 4, "inference_nodes": 2, "partition": "gpu"}},
        },
    )
    assert out == render(spec, home=Path("outputs").resolve(), name="asyncrl-big")
    assert main(["slurm", "render", str(cfg), "--launcher.slurm.inference_nodes", "4"]) == 2
    assert capsys.readouterr().err == (
        "error: launcher.slurm.inference_nodes: must be between 1 and nodes - 1 (3) with nodes = 4, got 4\n"
    )
    assert main(["slurm", "render", str(cfg), "--launcher.slurm.time_limit", "2h"]) == 2
    assert capsys.readouterr().err == (
        "error: launcher.slurm.time_limit: expected minutes, HH:MM:SS or D-HH:MM:SS, got '2h'\n"
    )
    assert main(["slurm", "submit", str(cfg)]) == 2
    assert capsys.readouterr().err == (
        "error: asyncrl slurm: expected 'render SPEC' (prints the job script without submitting), got 'submit'\n"
    )


LORA_TWO_NODES = {
    "name": "big",
    "model": {"name": "/models/q"},
    "trainer": {"lora": {"rank": 16}},
    "orchestrator": {"max_async_level": 2},
    "launcher": {
        "kind": "slurm",
        "slurm": {"nodes": 2, "inference_nodes": 1, "gpus_per_node": 1, "inference_port": 8100},
    },
}


def test_multi_node_lora_job_serves_adapters_as_the_local_launcher_does() -> None:
    """The multi-node script's inference step runs the run's server as built for the local launcher
    (``run_server_command``: one builder), so a LoRA run's server has ``--enable-lora``, ``--max-lora-rank``,
    ``--max-loras`` for its ``max_async_level`` and runtime adapter loading, and the weight-update extension."""
    spec = validate_spec("rl", LORA_TWO_NODES)
    script = render(spec, home=HOME, name="asyncrl-run-7", python="/venv/bin/python")
    server = run_server_command(spec, "0.0.0.0", 8100, require_key=True, python="/venv/bin/python")
    settings = "env VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
    assert f"  {settings} {shlex.join(server)} >>{HOME}/big/logs/inference.log 2>&1 &\n" in script
    flags = " ".join(server)
    assert "--enable-lora --max-lora-rank 16 --max-loras 4" in flags  # adapters_in_use(2) = 4
    assert f"--logprobs-mode processed_logprobs --worker-extension-cls {EXTENSION_CLS}" in flags
    subprocess.run(["bash", "-n", "-c", script], check=True)


def test_lora_job_with_more_than_one_trainer_rank_is_refused() -> None:
    four = {
        **LORA_TWO_NODES,
        "launcher": {"kind": "slurm", "slurm": {"nodes": 4, "inference_nodes": 2, "gpus_per_node": 8}},
    }
    with pytest.raises(SpecError) as e:
        validate_spec("rl", four)
    assert str(e.value) == (
        "trainer.lora: LoRA trains in one trainer process for now (launcher.slurm: one trainer node with "
        "gpus_per_node <= 1), got 16 trainer ranks"
    )


@pytest.mark.parametrize(
    ("slurm", "error"),
    [
        (
            {"inference_nodes": 1},
            "launcher.slurm.inference_nodes: a 1-node job runs every process on its node, so use 0, got 1",
        ),
        (
            {"nodes": 2, "inference_nodes": 0},
            "launcher.slurm.inference_nodes: must be between 1 and nodes - 1 (1) with nodes = 2, got 0",
        ),
        ({"allocation": "my-job"}, "launcher.slurm.allocation: expected a Slurm job id (digits), got 'my-job'"),
        (
            {"extra_sbatch": ["--exclusive\n#SBATCH --x"]},
            "launcher.slurm.extra_sbatch: expected one option per entry like '--constraint=a100' "
            "(no spaces or control characters), got '--exclusive\\n#SBATCH --x'",
        ),
        (
            {"extra_sbatch": ["--qos=normal --output=/tmp/x"]},
            "launcher.slurm.extra_sbatch: expected one option per entry like '--constraint=a100' "
            "(no spaces or control characters), got '--qos=normal --output=/tmp/x'",
        ),
        ({"env": {"A-B": "1"}}, "launcher.slurm.env: expected variable names of letters, digits and '_', got 'A-B'"),
        ({"gpus_per_node": -1}, "launcher.slurm.gpus_per_node: Input should be greater than or equal to 0, got -1"),
    ],
)
def test_bad_slurm_specs_name_the_field(slurm: dict[str, object], error: str) -> None:
    from worker.spec import SpecError

    with pytest.raises(SpecError) as err:
        spec_of(**slurm)
    assert str(err.value) == error


def test_checkpoint_request_adds_one_step_to_the_periodic_ones(tmp_path: Path) -> None:
    from worker.checkpoint import due, request
    from worker.rundir import RunDir

    run = RunDir(tmp_path)
    assert [s for s in range(1, 13) if due(run, s, 4)] == [4, 8, 12]
    request(run, 7)
    assert [s for s in range(1, 13) if due(run, s, 4)] == [4, 7, 8, 12]
    assert [s for s in range(1, 13) if due(run, s, 0)] == [7]
