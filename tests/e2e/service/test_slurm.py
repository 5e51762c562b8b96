"""Runs as Slurm jobs on the real single-node Slurm (``deploy/slurm/local-cluster.sh start``), through the REST API
and a real Celery worker: a run requeued twice (``scontrol requeue``, then USR1 as before a time limit) resumes from
its checkpoints and completes with every step stored once; ``scancel`` cancels a run; Slurm's refusal of a job fails
the run with Slurm's message and queues nothing; a run inside an existing allocation runs as a step of it; an SFT run
and an eval job run as Slurm jobs too.

The tiny random-init model and the short spec of ``test_real_resume.py`` (the ``service`` fixture of this folder's
``conftest.py``: API server and Celery worker). Slurm 22.05 holds a requeued job for about two minutes before it may start again; the tests let it
start at once with ``scontrol update jobid=<id> StartTime=now``.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from server.models import RunStatus
from tests.support.runs import ended, run_of, small_spec, trainer_steps
from tests.support.server import BAD_MODEL, points, processes, run_token_headers, spec, stored, wait_for
from tests.support.uids import PROBE, probe_as, uid_of
from worker.launchers import slurm
from worker.run.checkpoint import complete_steps
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import load_spec_data

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[3]


def slurm_spec(model: str, name: str, max_steps: int, **slurm_options: Any) -> dict[str, Any]:
    spec = small_spec(Path(model), name, max_steps)
    spec["launcher"] = {"kind": "slurm", "slurm": {"time_limit": "30:00", "signal_before_end_s": 60, **slurm_options}}
    return spec


def submit(client: Any, auth: dict[str, str], spec: dict[str, Any]) -> dict[str, Any]:
    resp = client.post("/api/runs", json=spec, headers=auth)
    assert resp.status_code == 201, resp.text
    run_id = resp.json()["id"]
    return dict(wait_for(lambda: (r := run_of(client, auth, run_id))["status"] != "queued" and r, 60, "launch"))


def ended_job(handle: str) -> slurm.JobState | None:
    """The job's state once Slurm no longer says it is pending, running or completing; None before."""
    state = slurm.state(handle)
    assert state is not None, f"Slurm no longer knows job {handle}"
    return None if state.state in ("PENDING", "RUNNING", "COMPLETING") else state


def events(client: Any, auth: dict[str, str], run_id: int) -> list[dict[str, Any]]:
    return list(client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"])


def queued_jobs(run_id: int) -> list[str]:
    """Ids of the jobs of this run that Slurm still lists as pending or running."""
    return subprocess.run(
        ["squeue", "-h", "-n", slurm.job_name(run_id), "-o", "%i"], capture_output=True, text=True, check=True
    ).stdout.split()


def start_requeued_now(job: str, restarts: int) -> None:
    """Wait until Slurm has requeued ``job`` for the ``restarts``-th time, then let it start without the delay."""
    wait_for(
        lambda: (s := slurm.state(job)) is not None and s.restarts == restarts and s.state == "PENDING",
        120,
        f"job {job} requeued ({restarts})",
    )
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)


def test_requeue_and_usr1_preemption_resume_from_checkpoints_and_complete(
    client: Any, auth: dict[str, str], service: str
) -> None:
    spec = slurm_spec(service, "slurm-requeue", max_steps=16)
    spec["ckpt"]["interval"] = 4
    # >= 0.5 s a step, so the 0.1 s polls below see every step (the random-init tiny model's 16-token rollouts made
    # steps fast enough that the orchestrator passed 7 and 11 between two polls; CI waited 400 s for them)
    spec["trainer"]["slow_step_s"] = 0.5
    run = submit(client, auth, spec)
    job, rd = run["launcher_handle"], RunDir(run["run_dir"])
    assert run["launcher"] == "slurm" and job.isdigit(), run
    assert queued_jobs(run["id"]) == [job]

    # 1. an operator (or a preempting job) requeues it after its first checkpoint
    first = wait_for(lambda: complete_steps(rd), 400, "first checkpoint")[-1]
    subprocess.run(["scontrol", "requeue", job], check=True)
    start_requeued_now(job, 1)
    wait_for(lambda: any(e["kind"] == "requeued" for e in events(client, auth, run["id"])), 120, "requeued event")

    # 2. USR1 to the batch shell, as --signal=B:USR1@<s> before the time limit: checkpoint now, then requeue itself.
    # Sent when the orchestrator's last step is 7, 8, 11 or 12: the step asked for (2 ahead, 3 if the orchestrator
    # moves on meanwhile) is not one of the periodic checkpoints (every 4)
    def orchestrator_step() -> int:
        return max((r["step"] for r in read_jsonl(rd.metrics) if r["source"] == "orchestrator"), default=0)

    wait_for(lambda: orchestrator_step() in (7, 8, 11, 12), 400, "orchestrator at step 7, 8, 11 or 12")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    start_requeued_now(job, 2)

    done = ended(client, auth, run["id"])
    assert done["status"] == "completed", done["status_reason"]
    assert (done["launcher"], done["launcher_handle"], done["run_dir"]) == ("slurm", job, run["run_dir"])
    requeues = [e["data"] for e in events(client, auth, run["id"]) if e["kind"] == "requeued"]
    assert [(r["restarts"], r["job"]) for r in requeues] == [(1, job), (2, job)]
    assert requeues[0]["resume_step"] == first
    preempt_step = requeues[1]["resume_step"]  # the checkpoint USR1 asked for was complete before the requeue
    assert preempt_step == json.loads((rd.root / "checkpoint_request.json").read_text())["step"] > first
    assert first == 4 and preempt_step in (9, 10, 11, 13, 14, 15)  # a requested checkpoint, not a periodic one
    starts = [e["resume_step"] for e in read_jsonl(rd.events) if e["event"] == "starting"]
    assert starts == [None, first, preempt_step]
    # every step trained once in the run's record: the steps after a checkpoint were pruned and trained again
    trainer_rows = [r for r in read_jsonl(rd.metrics) if r["source"] == "trainer"]
    assert [r["step"] for r in trainer_rows] == list(range(1, 17))
    assert trainer_steps(client, auth, run["id"]) == list(range(1, 17))
    loss = client.get(f"/api/runs/{run['id']}/metrics", params={"name": "loss"}, headers=auth).json()
    stored = [v for s in loss["series"] if s["source"] == "trainer" for v in s["value"]]
    assert stored == pytest.approx([r["loss"] for r in trainer_rows], nan_ok=True)  # the values of the final attempts
    assert [e["to_status"] for e in events(client, auth, run["id"]) if e["kind"] == "status"] == [
        "queued",
        "starting",
        "running",
        "completed",
    ]
    home = rd.root.parent
    assert sorted(p.name for p in (home / "slurm").iterdir()) == ["attempt-0", "attempt-1", "attempt-2"]
    assert "DUE TO JOB REQUEUE" in (home / f"slurm-{job}.out").read_text()
    assert wait_for(lambda: queued_jobs(run["id"]) == [], 60, "job gone from squeue")  # it ends after its report


def test_scancel_cancels_the_run_and_leaves_no_process(client: Any, auth: dict[str, str], service: str) -> None:
    run = submit(client, auth, slurm_spec(service, "slurm-scancel", max_steps=10_000))
    wait_for(
        lambda: run_of(client, auth, run["id"])["status"] == "running" and trainer_steps(client, auth, run["id"]),
        400,
        "run running with stored metrics",
    )
    subprocess.run(["scancel", run["launcher_handle"]], check=True)
    done = ended(client, auth, run["id"], 120)
    job = run["launcher_handle"]
    assert (done["status"], done["status_reason"]) == (
        "cancelled",
        f"Slurm job {job} terminated (scancel or time limit)",
    )
    assert [e["to_status"] for e in events(client, auth, run["id"]) if e["kind"] == "status"] == [
        "queued",
        "starting",
        "running",
        "cancelled",
    ]
    assert wait_for(lambda: queued_jobs(run["id"]) == [], 60, "job gone from squeue")
    assert wait_for(lambda: not any(run["run_dir"] in cmd for _, cmd in processes().values()), 60, "no process left")


def test_api_stop_scancels_the_job(client: Any, auth: dict[str, str], service: str) -> None:
    run = submit(client, auth, slurm_spec(service, "slurm-stop", max_steps=2, extra_sbatch=["--hold"]))
    job = run["launcher_handle"]
    assert (run["status"], queued_jobs(run["id"])) == ("starting", [job])  # held: it waits in the queue
    assert client.post(f"/api/runs/{run['id']}/stop", headers=auth).status_code == 200
    done = ended(client, auth, run["id"], 60)
    assert (done["status"], done["status_reason"]) == ("cancelled", f"stopped by {run['owner']} via API")
    assert slurm.state(job).state == "CANCELLED" and queued_jobs(run["id"]) == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"partition": "nope"}, "invalid partition specified: nope"),
        ({"gpus_per_node": 4}, "Invalid generic resource (gres) specification"),  # this node has no GPUs
    ],
)
def test_slurm_refusal_fails_the_run_with_slurms_message(
    client: Any,
    auth: dict[str, str],
    service: str,
    options: dict[str, Any],
    message: str,
) -> None:
    run = submit(client, auth, slurm_spec(service, "slurm-refused", max_steps=2, **options))
    assert run["status"] == "failed" and run["launcher_handle"] is None, run
    assert run["status_reason"].startswith("slurm: sbatch: error: ") and message in run["status_reason"], run
    assert [e["to_status"] for e in events(client, auth, run["id"]) if e["kind"] == "status"] == ["queued", "failed"]
    assert queued_jobs(run["id"]) == []


def test_redelivered_launch_adopts_the_job_an_earlier_delivery_submitted(session: Any) -> None:
    from server.jobs import tasks
    from server.services import runs
    from worker.spec import validate_spec

    data = spec(launcher={"kind": "slurm", "slurm": {"extra_sbatch": ["--hold"]}})  # held: it never starts
    run = runs.create(session, data=data, owner="test")
    session.commit()
    home = Path(run.run_dir).parent
    # the first delivery submitted the job, then its worker died before the commit: the run is still queued
    job = slurm.submit(validate_spec("rl", run.spec), run_id=run.id, home=home, env={})
    try:
        assert tasks.launch(run.id) == f"adopted: run {run.id} slurm job {job}"
        session.refresh(run)
        assert (run.status, run.launcher, run.launcher_handle) == ("starting", "slurm", job)
        assert queued_jobs(run.id) == [job]  # one job of this run
        assert tasks.launch(run.id) == f"skipped: run {run.id} is starting (handle {job})"
    finally:
        subprocess.run(["scancel", job], check=True)


def test_reconcile_ends_runs_whose_job_ended_or_is_gone(session: Any) -> None:
    from server.jobs import tasks
    from server.services import runs

    cancelled = subprocess.run(
        ["sbatch", "--parsable", "--hold", "--wrap", "true"], capture_output=True, text=True, check=True
    ).stdout.strip()
    subprocess.run(["scancel", cancelled], check=True)
    wait_for(lambda: slurm.state(cancelled).state == "CANCELLED", 30, "job cancelled")
    live = subprocess.run(
        ["sbatch", "--parsable", "--hold", "--wrap", "true"], capture_output=True, text=True, check=True
    ).stdout.strip()
    made = {}
    for handle in (cancelled, "99999999", live):
        run = runs.create(session, data=spec(launcher={"kind": "slurm"}), owner="test")
        run.launcher, run.launcher_handle = "slurm", handle
        runs.transition(session, run, RunStatus.starting, reason="submitted to Slurm")
        made[handle] = run.id
    session.commit()
    try:
        assert sorted(set(tasks.reconcile()) & set(made.values())) == [made[cancelled], made["99999999"]]
        session.expire_all()
        gone, ended_run, alive = (runs.get(session, made[h]) for h in ("99999999", cancelled, live))
        assert (gone.status, gone.status_reason) == ("failed", "Slurm job 99999999 is gone")
        assert ended_run.status == "cancelled"
        assert ended_run.status_reason == f"Slurm job {cancelled} ended CANCELLED (reason JobHeldUser, exit code 0:0)"
        assert alive.status == "starting"  # pending (held): still live
    finally:
        subprocess.run(["scancel", live], check=True)


def test_requeued_report_drops_later_metrics_once_and_not_for_an_ended_run(client: Any, session: Any) -> None:
    from server.services import runs

    run = runs.create(session, data=spec(), owner="test")
    runs.transition(session, run, RunStatus.starting, reason="submitted to Slurm")
    session.commit()
    rt = run_token_headers(run.id)
    assert client.post(f"/api/runs/{run.id}/metrics", json={"points": points(9, start=1)}, headers=rt).json() == {
        "received": 8,
        "inserted": 8,
    }
    report = {"restarts": 1, "resume_step": 4, "job": "77"}
    assert client.post(f"/api/runs/{run.id}/requeued", json=report, headers=rt).status_code == 200
    assert stored(run.id) == 4  # steps 1-4 kept, 5-8 are trained again by the new attempt
    assert client.post(f"/api/runs/{run.id}/metrics", json={"points": points(7, start=5)}, headers=rt).json() == {
        "received": 2,
        "inserted": 2,
    }
    assert client.post(f"/api/runs/{run.id}/requeued", json=report, headers=rt).status_code == 200  # a retry
    assert stored(run.id) == 6  # the retried report of the same attempt deleted nothing
    data = client.get(f"/api/runs/{run.id}/events", headers=rt).json()["data"]
    assert [(e["reason"], e["data"]) for e in data if e["kind"] == "requeued"] == [
        ("Slurm job 77 requeued (restart 1); resuming from checkpoint step 4", report)
    ]
    bad = client.post(f"/api/runs/{run.id}/requeued", json={**report, "restarts": 0}, headers=rt)
    assert bad.status_code == 422 and "restarts" in bad.text
    runs.transition(session, run, RunStatus.cancelled, reason="stopped")
    session.commit()
    resp = client.post(f"/api/runs/{run.id}/requeued", json={**report, "restarts": 2}, headers=rt)
    assert resp.status_code == 401, resp.text  # an ended run's token no longer writes (issue 16)
    assert resp.json()["detail"] == f"run {run.id} has ended (cancelled): its run token no longer writes"
    assert stored(run.id) == 6


def test_run_inside_an_existing_allocation_is_a_step_of_it(
    client: Any,
    auth: dict[str, str],
    service: str,
    tmp_path: Path,
) -> None:
    alloc = subprocess.run(
        ["sbatch", "--parsable", "--job-name=asyncrl-test-allocation", f"--chdir={tmp_path}", "--wrap", "sleep 600"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        wait_for(lambda: (s := slurm.state(alloc)) is not None and s.state == "RUNNING", 60, "allocation running")
        spec = slurm_spec(service, "slurm-allocation", max_steps=2, allocation=alloc)
        spec["model"]["name"] = BAD_MODEL  # fails in the supervisor's preflight: the step runs and reports, briefly
        run = submit(client, auth, spec)
        assert run["launcher"] == "slurm" and run["launcher_handle"].startswith(f"{alloc}."), run
        done = ended(client, auth, run["id"], 120)
        assert done["status"] == "failed" and done["status_reason"].startswith("preflight: model.name: "), done
        assert [e["to_status"] for e in events(client, auth, run["id"]) if e["kind"] == "status"] == [
            "queued",
            "starting",
            "failed",
        ]
        assert slurm.state(alloc).state == "RUNNING"  # the allocation itself goes on
    finally:
        subprocess.run(["scancel", alloc], check=True)


@pytest.mark.slow
def test_an_sft_run_and_an_eval_job_of_its_weights_run_as_slurm_jobs(
    client: Any, auth: dict[str, str], service: str
) -> None:
    """Issue 22: ``launcher.kind = "slurm"`` for the other kinds, through the same job script (REST, Celery, sbatch):
    a 4-step SFT run, then an eval job of its final weights (4 greedy tasks, vLLM inside the job) complete as Slurm
    jobs with their metrics stored; each ran under its own job, on the cluster's node (the job's log and Slurm say so).
    """
    launcher = {"kind": "slurm", "slurm": {"time_limit": "20:00"}}
    sft_overrides = [
        ("name", "slurm-sft"),
        ("model.name", service),
        ("max_steps", "4"),
        ("data.batch_size", "4"),
        ("data.num_examples", "64"),
        ("data.eval_reward", "false"),
        ("eval_examples", "4"),
        ("threads", "1"),
    ]
    sft_spec = load_spec_data([REPO / "configs/reverse_text/sft.toml"], sft_overrides)
    sft = submit(client, auth, {**sft_spec, "launcher": launcher})
    sft_done = ended(client, auth, sft["id"], 300)
    assert sft_done["status"] == "completed", sft_done["status_reason"]
    job = {"kind": "eval", "name": "slurm-eval", "model": {"run": sft["id"]}, "env": {"id": "reverse_text"}}
    settings = {"num_examples": 4, "temperature": 0.0, "max_tokens": 16}
    ev = submit(client, auth, {**job, "eval": settings, "launcher": launcher})
    ev_done = ended(client, auth, ev["id"], 400)
    assert ev_done["status"] == "completed", ev_done["status_reason"]

    loss = client.get(f"/api/runs/{sft['id']}/metrics", params={"name": "loss"}, headers=auth).json()
    assert [s["step"] for s in loss["series"] if s["source"] == "sft"] == [[1, 2, 3, 4]]
    reward = client.get(f"/api/runs/{ev['id']}/metrics", params={"name": "reward_mean"}, headers=auth).json()
    [series] = [s for s in reward["series"] if s["source"] == "eval"]
    summary = json.loads(RunDir(ev["run_dir"]).summary.read_text())
    assert series["step"] == [4] and series["value"] == [pytest.approx(summary["reward_mean"], abs=1e-12)]
    assert summary["num_examples"] == 4 and len(read_jsonl(RunDir(ev["run_dir"]).eval_tasks)) == 4
    node = subprocess.run(["hostname"], capture_output=True, text=True, check=True).stdout.strip()
    jobs = set()
    for run in (sft_done, ev_done):
        handle = run["launcher_handle"]
        assert run["launcher"] == "slurm" and handle.isdigit(), run
        jobs.add(handle)
        home = Path(run["run_dir"]).parent
        script = (home / "job.sbatch").read_text()
        assert f"#SBATCH --job-name={slurm.job_name(run['id'])}" in script and "#SBATCH --time=20:00" in script
        first = (home / "slurm" / "attempt-0" / "job.log").read_text().splitlines()[0]
        assert first.startswith(f"job {handle} attempt 0 on {node} at "), first
        # The run is completed once its processes report it; the job script then still stops the job's own vLLM, so
        # Slurm may say RUNNING a little longer. Slurm keeps an ended job for MinJobAge (300 s by default).
        state = wait_for(lambda h=handle: ended_job(h), 60, f"job {handle} to end")
        assert (state.state, state.nodes) == ("COMPLETED", node), state
        assert [e["to_status"] for e in events(client, auth, run["id"]) if e["kind"] == "status"] == [
            "queued",
            "starting",
            "running",
            "completed",
        ]
    assert len(jobs) == 2


def test_a_root_workers_slurm_run_runs_as_its_own_uid_which_cannot_read_the_servers_secrets(
    client: Any, auth: dict[str, str], service: str
) -> None:
    """A root worker (RUN_USER and RUN_UID_BASE unset) submits an RL run as a Slurm job: every process of the run
    (vLLM and its engine, orchestrator, trainer: the process groups the supervisor starts, less each group's watchdog,
    which the supervisor owns) runs as uid = gid = DEFAULT_RUN_UID_BASE + run id; from the job's node that uid gets
    PermissionError on the server's secret key file and ASYNCRL_HOME, and reads its own run's files. The run completes;
    then, kernel-checked: another run's uid is denied this run's spec, final and published weights, metrics and the
    listing of its run directory and home, a uid of the server's group (the group of the folder of homes) reads them
    (less the published versions, which only the run's uid reads); the home is the worker's, 2751, the run directory
    and HOME the run's uid's, 2750, both in the server's group."""
    import os
    import sys

    from server.core.config import Settings
    from worker.launchers import supervisor
    from worker.run.procs import live_processes

    assert os.geteuid() == 0, "a root worker's Slurm job: run this test as root"
    Settings(SECRET_KEY="").secret_key()  # the key file of a server without SECRET_KEY, made in ASYNCRL_HOME
    secret = Path(os.environ["ASYNCRL_HOME"]) / "secret_key"
    run = submit(client, auth, slurm_spec(service, "slurm-uid", max_steps=3))
    uid, job = supervisor.DEFAULT_RUN_UID_BASE + run["id"], run["launcher_handle"]
    run_dir = Path(run["run_dir"])
    seen: dict[int, tuple[int, str]] = {}  # pid -> (uid, command line) of every process of the run seen
    probe = None
    deadline = time.monotonic() + 400
    while (now := run_of(client, auth, run["id"]))["status"] not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, "the run did not end within 400 s"
        running = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "running"]
        groups = set(running[-1]["pids"].values()) if running else set()
        for pid, (pgid, _, cmd) in live_processes().items():
            if pgid in groups and pid not in seen and "os.killpg(0, signal.SIGKILL)" not in cmd:  # not the watchdog
                if (owner := uid_of(pid)) is not None:  # None: it ended meanwhile
                    seen[pid] = (owner, cmd)
        if groups and probe is None:  # from the job's node, started as the run's processes are
            files = [secret, secret.parent, run_dir / "config.json", run_dir / "events.jsonl"]
            drop = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
            probe = subprocess.run(
                ["srun", f"--jobid={job}", "--overlap", "--nodes=1", "--ntasks=1", "setpriv", *drop, "--"]
                + [sys.executable, "-c", PROBE, *map(str, files)],
                capture_output=True,
                text=True,
                check=True,
                cwd="/",
            ).stdout.split("\n")[:-1]
        time.sleep(0.05)
    assert now["status"] == "completed", now["status_reason"]
    names = {"inference", "trainer", "orchestrator"}
    assert set(running[-1]["pids"]) == names and groups <= set(seen), (running, seen)
    assert {u for u, _ in seen.values()} == {uid}, seen
    assert any("worker.trainer" in cmd for _, cmd in seen.values()), seen
    assert (run_dir / "metrics.jsonl").stat().st_uid == uid and (run_dir / "weights").stat().st_uid == uid
    assert probe == [f"denied {secret}", f"denied {secret.parent}", *(f"read {p}" for p in files[2:])]
    assert oct(secret.stat().st_mode & 0o777) == "0o600"

    home, group = run_dir.parent, run_dir.parent.parent.stat().st_gid
    version = sorted((run_dir / "weights").rglob("*.safetensors"))  # a published policy version (0600)
    assert version, sorted(p.name for p in (run_dir / "weights").iterdir())
    private = [home / "spec.json", run_dir / "final" / "model.safetensors", run_dir / "metrics.jsonl", run_dir, home]
    assert probe_as([*private, version[-1]], uid + 1, uid + 1) == ["denied"] * 6  # another run's uid
    assert probe_as(private, uid + 1000, group) == ["read"] * 5  # not a run's uid, the server's group
    assert probe_as([*private[1:4], version[-1]], uid, uid) == ["read"] * 4  # the run's own files
    modes = {p: (p.stat().st_uid, p.stat().st_gid, oct(p.stat().st_mode & 0o7777)) for p in (home, run_dir)}
    modes[home / "user-home"] = (st := (home / "user-home").stat()).st_uid, st.st_gid, oct(st.st_mode & 0o7777)
    assert modes == {
        home: (0, group, "0o2751"),
        run_dir: (uid, group, "0o2750"),
        home / "user-home": (uid, group, "0o2750"),
    }
    assert (run_dir / "events.jsonl").stat().st_uid == uid  # the root supervisor's events, written as the run's uid
    print(f"run {run['id']}, job {job}: {len(seen)} processes, all uid {uid}; {probe}")
