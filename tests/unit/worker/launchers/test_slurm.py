"""The Slurm job script rendered from ``deploy/slurm/rl.sbatch.j2``: #SBATCH lines, the 1-node and multi-node
scripts (both run the supervisor), the steps a 4-node layout (2 inference, 2 trainer) starts (``srun`` argv, the
rendezvous and ports), the split of the real multi-node cluster's nodes (``scontrol``), and ``asyncrl slurm render``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from worker.cli import main
from worker.inference.server import EXTENSION_CLS, run_server_command
from worker.launchers.slurm import SlurmError, render
from worker.launchers.slurm_layout import Layout, from_job
from worker.spec import SpecError, validate_spec

HOME = Path("/srv/asyncrl/runs/7")
MULTI_CONF = "/etc/slurm-multi/slurm.conf"


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
    "env": {"NCCL_DEBUG": "WARN", "HF_HOME": "/data/hf cache", "TZ": "$(id);`id`"},  # each value shell-quoted
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
    assert "export NCCL_DEBUG=WARN\nexport HF_HOME='/data/hf cache'\nexport TZ='$(id);`id`'\n" in script
    assert f"LOG_DIR={HOME}/slurm/attempt-$ATTEMPT" in script and "ATTEMPT=${SLURM_RESTART_COUNT:-0}" in script
    assert "/venv/bin/python -m worker.launchers.supervisor --home /srv/asyncrl/runs/7 >>" in script
    assert (  # inference.replicas unset: one server on each inference node
        "# 4 nodes: the first 2 serve inference (2 vLLM server(s): replica i on inference node i mod 2, port 8100 + i "
        "div 2), the other 2 train\n"
    ) in script
    assert "rendezvous on port 29555 of the first trainer node, 8 rank(s) a node" in script


LAYOUT = Layout(
    job_id="42",
    inference=("gpu07", "gpu08"),
    trainer=("gpu09", "gpu11"),
    addresses={"gpu07": "10.0.0.7", "gpu08": "10.0.0.8", "gpu09": "10.0.0.9", "gpu11": "10.0.0.11"},
)


def test_four_node_layout_steps_rendezvous_and_ports() -> None:
    spec = spec_of(**FOUR_NODES)
    assert LAYOUT.placement() == {"inference": ["gpu07"], "trainer": ["gpu09", "gpu11"], "orchestrator": ["gpu09"]}
    assert LAYOUT.inference_url(8100) == "http://10.0.0.7:8100"
    # inference.replicas = 3 on 2 inference nodes: round robin over the nodes, a node's second server one port up
    # (2 servers a node: each gets half of the node's 8 GPUs; 3 GPUs a node do not split: every server sees all)
    assert LAYOUT.replicas(3, 8100, 8) == [
        ("gpu07", 8100, [0, 1, 2, 3]),
        ("gpu08", 8100, [0, 1, 2, 3]),
        ("gpu07", 8101, [4, 5, 6, 7]),
    ]
    assert LAYOUT.replicas(3, 8100, 3) == [("gpu07", 8100, []), ("gpu08", 8100, []), ("gpu07", 8101, [])]
    assert [r[1:] for r in LAYOUT.replicas(8, 8000, 8)[::2]] == [
        (8000, [0, 1]),
        (8001, [2, 3]),
        (8002, [4, 5]),
        (8003, [6, 7]),
    ]
    assert LAYOUT.placement(3)["inference"] == ["gpu07", "gpu08"]
    assert LAYOUT.inference_url(8100, "gpu08") == "http://10.0.0.8:8100"
    replica = LAYOUT.inference_command(spec, 8101, "gpu08", "inference-2", [4, 5, 6, 7])
    assert replica[5:11] == [
        "--nodelist=gpu08", "--overlap", "--kill-on-bad-exit=1", "--job-name=inference-2", "env", "CUDA_VISIBLE_DEVICES=4,5,6,7"
    ]  # fmt: skip
    assert replica[replica.index("--host") + 1] == "10.0.0.8" and replica[replica.index("--port") + 1] == "8101"
    assert LAYOUT.srun(["gpu09"], "orchestrator") == [
        "srun",
        "--jobid=42",
        "--nodes=1",
        "--ntasks=1",
        "--ntasks-per-node=1",
        "--nodelist=gpu09",
        "--overlap",
        "--kill-on-bad-exit=1",
        "--job-name=orchestrator",
    ]
    trainer = LAYOUT.trainer_command(spec, ["--run-dir", "/r/big"])
    assert trainer[:6] == [
        "srun",
        "--jobid=42",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--nodelist=gpu09,gpu11",
    ]
    assert trainer[9:] == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.9:29555",
        "--rdzv-id=42",
        "--max-restarts=0",
        "-m",
        "worker.trainer",
        "--run-dir",
        "/r/big",
    ]
    assert spec.trainer_ranks == 16  # 2 trainer nodes x 8 GPUs


def test_multi_node_server_listens_on_the_inference_nodes_address_only() -> None:
    """The vLLM step listens on the first inference node's NodeAddr, the address the other nodes reach it at: never
    0.0.0.0, which the service refuses for ``inference.host`` (``spec_policy.check_run_host``)."""
    cmd = LAYOUT.inference_command(spec_of(**FOUR_NODES), 8100)
    assert cmd[:9] == LAYOUT.srun(["gpu07"], "inference")
    assert cmd[cmd.index("--host") + 1] == "10.0.0.7" and cmd[cmd.index("--port") + 1] == "8100"
    assert "0.0.0.0" not in cmd and LAYOUT.inference_url(8100) == "http://10.0.0.7:8100"
    assert "--middleware" in cmd  # keyed: reachable from the other nodes


THREE_NODES = Layout(
    job_id="43",
    inference=("n1", "n2"),
    trainer=("n3",),
    addresses={"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"},
)


def test_replicas_left_unset_follow_the_inference_nodes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """nodes = 3, inference_nodes = 2 and no inference.replicas: two vLLM servers, one on each inference node (one
    replica left a node idle); an explicit replicas is kept."""
    spec = spec_of(nodes=3, inference_nodes=2, gpus_per_node=4)
    assert spec.inference.replicas == 2
    slurm = spec.launcher.slurm
    assert THREE_NODES.replicas(spec.inference.replicas, slurm.inference_port, slurm.gpus_per_node) == [
        ("n1", 8000, [0, 1, 2, 3]),
        ("n2", 8000, [0, 1, 2, 3]),
    ]
    assert THREE_NODES.placement(spec.inference.replicas)["inference"] == ["n1", "n2"]
    script = render(spec, home=HOME, name="asyncrl-run-8", python="/venv/bin/python")
    assert (
        "# 3 nodes: the first 2 serve inference (2 vLLM server(s): replica i on inference node i mod 2, port 8000 + i "
        "div 2), the other 1 train\n"
    ) in script
    cfg = tmp_path / "rl.toml"
    cfg.write_text(
        'name = "big"\n[model]\nname = "/models/q"\n[launcher]\nkind = "slurm"\n'
        "[launcher.slurm]\nnodes = 3\ninference_nodes = 2\n"
    )
    assert main(["slurm", "render", str(cfg)]) == 0
    assert "(2 vLLM server(s): replica i on inference node i mod 2" in capsys.readouterr().out
    # the resolved spec (config.json, the service's Run.spec) holds the number and loads back as it was
    assert validate_spec("rl", spec.model_dump(mode="json")).inference.replicas == 2

    def replicas(inference: dict[str, object], **slurm: object) -> int:
        data = {"name": "big", "model": {"name": "/models/q"}, "inference": inference}
        return validate_spec("rl", {**data, "launcher": {"kind": "slurm", "slurm": slurm}}).inference.replicas

    assert replicas({"replicas": 1}, nodes=3, inference_nodes=2) == 1  # set: kept (the other node idles, as asked)
    assert replicas({"replicas": 3}, nodes=3, inference_nodes=2) == 3  # node n1 runs two
    assert replicas({}, nodes=4, inference_nodes=3) == 3
    assert replicas({}, nodes=1) == 1  # one node: one server beside the trainer
    with pytest.raises(SpecError) as e:  # several replicas need the filesystem weight sync: the default says so
        validate_spec(
            "rl",
            {
                "name": "big",
                "model": {"name": "/models/q"},
                "trainer": {"weight_sync": {"kind": "process_group"}},
                "launcher": {"kind": "slurm", "slurm": {"nodes": 3, "inference_nodes": 2}},
            },
        )
    assert str(e.value) == (
        "trainer.weight_sync.kind: several inference replicas load each policy version from the filesystem for now "
        "('filesystem'), got 'process_group' (inference.replicas unset: one per inference node, 2; set it to 1 for "
        "one server)"
    )


@pytest.mark.slurm
def test_layout_of_the_multi_node_cluster_from_scontrol() -> None:
    """The split of the real 3-node cluster (deploy/slurm/multi-node-cluster.sh): node names from Slurm's hostlist
    expansion, each node's address from its NodeAddr."""
    if not Path(MULTI_CONF).exists():
        pytest.fail("start the cluster: bash deploy/slurm/multi-node-cluster.sh start")
    spec = spec_of(nodes=3, inference_nodes=1)
    environ = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "asrl-n[1-3]"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", MULTI_CONF)
        assert from_job(spec, environ) == Layout(
            job_id="42",
            inference=("asrl-n1",),
            trainer=("asrl-n2", "asrl-n3"),
            addresses={"asrl-n1": "10.77.0.11", "asrl-n2": "10.77.0.12", "asrl-n3": "10.77.0.13"},
        )
        with pytest.raises(SlurmError) as e:
            from_job(spec, {**environ, "SLURM_JOB_NODELIST": "asrl-n[1-2]"})
        assert str(e.value) == "job 42 has 2 nodes (asrl-n1,asrl-n2), launcher.slurm.nodes = 3"
        assert from_job(spec_of(), environ) is None  # one node: every process here
        assert from_job(spec, {}) is None  # not inside a job


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
        f"/venv/bin/python -m worker.launchers.supervisor --home {HOME} --resume >>{HOME}/supervisor.log 2>&1 &\npid=$!\n"
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


def test_multi_node_lora_server_is_built_as_the_local_launchers() -> None:
    """The inference step runs the run's server as built for the local launcher (``run_server_command``: one
    builder), so a LoRA run's server has ``--enable-lora``, ``--max-lora-rank``, ``--max-loras`` for its
    ``max_async_level`` and runtime adapter loading, and the weight-update extension."""
    spec = validate_spec("rl", LORA_TWO_NODES)
    server = run_server_command(spec, "10.0.0.7", 8100, require_key=True, python="/venv/bin/python")
    flags = " ".join(server)
    assert "--middleware worker.inference.auth.RequireApiKey" in flags  # reached from the other nodes: keyed
    targets = "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj"  # trainer.lora.target_modules' default
    assert f"--enable-lora --max-lora-rank 16 --max-loras 4 --lora-target-modules {targets}" in flags  # 4: (2) + 2
    assert f"--logprobs-mode processed_logprobs --worker-extension-cls {EXTENSION_CLS}" in flags
    script = render(spec, home=HOME, name="asyncrl-run-7", python="/venv/bin/python")
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
        (
            {"nodes": 3, "inference_nodes": 3},
            "launcher.slurm.inference_nodes: must be between 1 and nodes - 1 (2) with nodes = 3, got 3",
        ),
        (
            {"nodes": 3, "inference_nodes": 1, "trainer_nodes": 2},
            "unknown key 'launcher.slurm.trainer_nodes' (the trainer runs on the nodes after the inference ones, "
            "nodes - inference_nodes: remove the key)",
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
    from worker.run.checkpoint import due, request
    from worker.run.rundir import RunDir

    run = RunDir(tmp_path)
    assert [s for s in range(1, 13) if due(run, s, 4)] == [4, 8, 12]
    request(run, 7)
    assert [s for s in range(1, 13) if due(run, s, 4)] == [4, 7, 8, 12]
    assert [s for s in range(1, 13) if due(run, s, 0)] == [7]


NODES_OUT = (
    "NodeName=asrl-n1 Arch=x86_64 CPUAlloc=1 NodeAddr=10.77.0.11 State=MIXED ThreadsPerCore=1 Partitions=multi\n"
    "NodeName=asrl-n2 Arch=x86_64 CPUAlloc=1 NodeAddr=10.77.0.12 State=MIXED* ThreadsPerCore=1 Partitions=multi\n"
    "NodeName=asrl-n3 Arch=x86_64 CPUAlloc=0 NodeAddr=10.77.0.13 State=DOWN ThreadsPerCore=1 Partitions=multi "
    "Reason=node lost in test [root@2026-12-04T03:50:00]\n"
    "NodeName=asrl-n4 Arch=x86_64 NodeAddr=10.77.0.14 State=IDLE+DRAIN Partitions=multi Reason=maint [root@2026]\n"
    "NodeName=asrl-n5 Arch=x86_64 NodeAddr=10.77.0.15 State=ALLOCATED Partitions=multi\n"
)


def test_lost_nodes_are_the_down_drained_or_not_responding_ones() -> None:
    from worker.launchers.slurm import lost_nodes_of

    assert lost_nodes_of(NODES_OUT) == {
        "asrl-n2": "MIXED*",
        "asrl-n3": "DOWN: node lost in test",
        "asrl-n4": "IDLE+DRAIN: maint",
    }
    assert lost_nodes_of("") == {}


def test_a_sigterm_after_a_lost_node_fails_the_run_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm ends a job that lost a node with SIGTERM to its batch step, as ``scancel`` does: the supervisor
    reports ``failed`` naming the node (not ``cancelled``), or, when Slurm requeued the job, says why in the
    ``requeued`` line."""
    from worker.launchers import slurm, slurm_job

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "asrl-n[1-3]")
    asked: list[list[str]] = []

    def scontrol(argv: list[str], env: dict[str, str] | None = None) -> str:  # noqa: ARG001 - slurm_command's
        asked.append(argv)
        return NODES_OUT if argv[:3] == ["scontrol", "show", "node"] else "JobId=42 JobState=CANCELLED Restarts=0"

    monkeypatch.setattr(slurm, "slurm_command", scontrol)
    assert slurm_job.end_status(0) == (
        "failed",
        "Slurm job 42 lost node asrl-n2 (MIXED*); lost node asrl-n3 (DOWN: node lost in test); "
        "lost node asrl-n4 (IDLE+DRAIN: maint)",
    )
    assert ["scontrol", "show", "node", "-o", "asrl-n[1-3]"] in asked
    assert slurm_job.end_status(-1)[0] is None  # Restarts=0 > -1: requeued, the next attempt reports
    monkeypatch.setattr(slurm, "slurm_command", lambda argv, env=None: "JobId=42 JobState=CANCELLED Restarts=0")
    assert slurm_job.end_status(0) == ("cancelled", "Slurm job 42 terminated (scancel or time limit)")
    # the node is back already (ReturnToService=2), the job's state still says it
    monkeypatch.setattr(slurm, "slurm_command", lambda argv, env=None: "JobId=42 JobState=NODE_FAIL Restarts=0")
    assert slurm_job.end_status(0) == ("failed", "Slurm job 42 lost a node (NODE_FAIL)")


@pytest.mark.parametrize(("kind", "extra", "title"), [("sft", {}, "SFT run"), ("eval", {"env": {}}, "eval job")])
def test_an_sft_run_and_an_eval_job_render_the_one_node_script(kind: str, extra: dict[str, object], title: str) -> None:
    """Issue 22: the other kinds are the same job script as a 1-node RL run (their supervisor runs the kind's local
    launcher); only the title line names the kind."""
    slurm = {"kind": "slurm", "slurm": {"partition": "gpu", "time_limit": "30:00", "gpus_per_node": 1}}
    spec = validate_spec(kind, {"kind": kind, "name": "j", "model": {"name": "/models/q"}, "launcher": slurm, **extra})
    rl = validate_spec("rl", {"name": "j", "model": {"name": "/models/q"}, "launcher": slurm})
    args = {"home": HOME, "name": "asyncrl-run-7", "python": "/venv/bin/python", "workdir": Path("/srv/asyncrl")}
    script, rl_script = render(spec, **args), render(rl, **args)  # type: ignore[arg-type]
    title_line = f'# asyncrl {title} "j": rendered from deploy/slurm/rl.sbatch.j2 (asyncrl slurm render / the Slurm'
    assert script.splitlines()[1] == title_line + " launcher)."
    assert script.splitlines()[2:] == rl_script.splitlines()[2:]
    assert "/venv/bin/python -m worker.launchers.supervisor --home /srv/asyncrl/runs/7 >>" in script
    assert sbatch_lines(script)[:6] == [
        "#SBATCH --job-name=asyncrl-run-7",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=1",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=30:00",
    ]


RUN_AS = "1900000007:1900000007:asyncrl-run-7:/srv/asyncrl/runs/7/user-home"
DROP = [
    "setpriv",
    "--reuid=1900000007",
    "--regid=1900000007",
    "--clear-groups",
    "--pdeathsig=keep",
    "--",
    "env",
    *("-u", "ASYNCRL_RUN_AS", "-u", "TORCHINDUCTOR_CACHE_DIR", "-u", "TRITON_CACHE_DIR"),
    *("-u", "VLLM_CACHE_ROOT", "-u", "XDG_CACHE_HOME"),
    "HOME=/srv/asyncrl/runs/7/user-home",
    "USER=asyncrl-run-7",
    "LOGNAME=asyncrl-run-7",
]


def test_a_root_workers_job_names_the_run_uid_and_every_step_drops_to_it() -> None:
    """A root worker's job script exports the run's identity (uid = gid = RUN_UID_BASE + run id, its HOME a folder of
    the run's home); each process of the run starts through setpriv as that uid, on every node: the srun of a step
    runs as the job's user (root), the command after it as the run's uid."""
    from worker.launchers.slurm_job import run_as_check_command
    from worker.launchers.supervisor import RunUser
    from worker.run.procs import run_as_argv

    user = RunUser("asyncrl-run-7", 1_900_000_007, 1_900_000_007, f"{HOME}/user-home")
    spec = spec_of(nodes=4, inference_nodes=2, gpus_per_node=8, rdzv_port=29555, inference_port=8100)
    script = render(spec, home=HOME, name="asyncrl-run-7", python="/venv/bin/python", user=user)
    assert f"\nexport ASYNCRL_RUN_AS={RUN_AS}\n" in script
    assert script.index("\numask 0027\n") < script.index('\nmkdir -p "$LOG_DIR"\n')  # before the job makes a file
    plain = render(spec, home=HOME, name="asyncrl-run-7", python="/venv/bin/python")
    assert "ASYNCRL_RUN_AS" not in plain and "umask" not in plain
    subprocess.run(["bash", "-n", "-c", script], check=True)

    assert run_as_argv({"ASYNCRL_RUN_AS": RUN_AS}) == DROP
    assert run_as_argv({}) == []  # a non-root worker's job: every process runs as the job's user
    layout = Layout(
        job_id="42",
        inference=("gpu07", "gpu08"),
        trainer=("gpu09", "gpu11"),
        addresses={"gpu07": "10.0.0.7", "gpu08": "10.0.0.8", "gpu09": "10.0.0.9", "gpu11": "10.0.0.11"},
        run_as=tuple(DROP),
    )
    step = [*LAYOUT.srun(["gpu09"], "orchestrator"), *DROP]
    assert layout.srun(["gpu09"], "orchestrator") == step
    trainer = layout.trainer_command(spec, ["--run-dir", "/r/big"])
    assert trainer[: len(step)] == [*LAYOUT.srun(["gpu09", "gpu11"], "trainer"), *DROP]
    assert trainer[len(step) : len(step) + 3] == [sys.executable, "-m", "torch.distributed.run"]
    inference = layout.inference_command(spec, 8100, "gpu08", "inference-1", [0, 1, 2, 3])
    assert inference[: len(step) + 2] == [
        *LAYOUT.srun(["gpu08"], "inference-1"),
        *DROP,
        "env",
        "CUDA_VISIBLE_DEVICES=0,1,2,3",
    ]
    assert inference[len(step) + 2 :] == run_server_command(spec, "10.0.0.8", 8100, require_key=True)

    env = {"ASYNCRL_RUN_AS": RUN_AS, "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[07-09,11]"}
    assert run_as_check_command(1, env) == [*DROP, "id", "-u"]
    assert run_as_check_command(4, env) == [
        "srun",
        "--jobid=42",
        "--nodes=4",
        "--ntasks=4",
        "--ntasks-per-node=1",
        "--nodelist=gpu[07-09,11]",
        "--overlap",
        "--job-name=run-as-check",
        *DROP,
        "id",
        "-u",
    ]


def test_a_node_without_setpriv_fails_the_run_with_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No setpriv on the node: the check before the run's processes start fails the run saying so (it never runs
    them as root instead); a non-root worker's job (no ASYNCRL_RUN_AS) checks nothing."""
    import os

    from worker.launchers.slurm_job import RunAsError, check_run_as

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no setpriv, no id
    monkeypatch.delenv("ASYNCRL_RUN_AS", raising=False)
    check_run_as(1)
    monkeypatch.setenv("ASYNCRL_RUN_AS", RUN_AS)
    with pytest.raises(RunAsError) as e:
        check_run_as(1)
    assert str(e.value) == (
        f"cannot run the run's processes as uid 1900000007 on {os.uname().nodename}: setpriv: not found; "
        "install util-linux (setpriv) there, the run never runs as root"
    )


def test_a_root_jobs_supervisor_touches_the_run_directory_only_as_the_run_uid() -> None:
    """Inside a root worker's job (``ASYNCRL_RUN_AS``): the home is the worker's, 2751, in the group of the folder of
    homes; ``give_to_run_user`` makes the run directory the run's uid's, 2750, in that group; inside
    ``run_user_files`` the root supervisor's append, read and atomic write through links the run planted to a root-only
    file are refused (a thread started inside too), what it makes is the run's uid's, a requeue that starts over
    empties the run directory (kept: the uid cannot make it again in the worker's home); outside, it is root again."""
    import os
    import shutil
    import tempfile
    import threading

    from worker.launchers import slurm_job, supervisor
    from worker.run.procs import give_to_run_user, run_user_files
    from worker.run.rundir import RunDir, SupervisorHome, append_jsonl, atomic_write_json, read_jsonl

    uid, group = 1_900_000_007, 4242
    base = Path(tempfile.mkdtemp(prefix="asyncrl-slurm-home-"))
    try:
        base.chmod(0o755)
        (base / "runs").mkdir()
        os.chown(base / "runs", -1, group)
        home = base / "runs" / "7"
        supervisor.open_slurm_home(home)
        assert (home.stat().st_uid, home.stat().st_gid, oct(home.stat().st_mode & 0o7777)) == (0, group, "0o2751")
        secret = base / "secret"
        secret.write_text("root only\n")
        secret.chmod(0o600)
        run, groups = RunDir(home / "rl"), os.getgroups()
        mp = pytest.MonkeyPatch()
        mp.setenv("ASYNCRL_RUN_AS", f"{uid}:{uid}:asyncrl-run-7:{home}/user-home")
        try:
            give_to_run_user(run.root)
            st = run.root.stat()
            assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o7777)) == (uid, group, "0o2750")
            run.events.symlink_to(secret)
            (run.root / f".config.json.tmp-{os.getpid()}").symlink_to(secret)
            seen: list[str] = []
            with run_user_files():
                with pytest.raises(PermissionError):
                    run.log_event("starting")
                with pytest.raises(PermissionError):
                    read_jsonl(run.events)
                with pytest.raises(OSError):
                    atomic_write_json(run.config, {"name": "rl"})
                append_jsonl(run.metrics, {"step": 1})

                def read_secret() -> None:
                    try:
                        secret.read_text()
                        seen.append("read")
                    except PermissionError:
                        seen.append("denied")

                thread = threading.Thread(target=read_secret)
                thread.start()
                thread.join()
            assert seen == ["denied"]
            assert (run.metrics.stat().st_uid, run.metrics.stat().st_gid) == (uid, group)
            assert secret.read_text() == "root only\n" and os.getgroups() == groups  # root again, the file untouched
            SupervisorHome(home).forwarded_offset.write_text("12")
            slurm_job.prepare_requeued(run.root, SupervisorHome(home))  # no config: the attempt starts over
            assert run.root.is_dir() and list(run.root.iterdir()) == []
            assert not SupervisorHome(home).forwarded_offset.exists()
        finally:
            mp.undo()
    finally:
        shutil.rmtree(base)
