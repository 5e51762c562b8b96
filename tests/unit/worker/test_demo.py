"""The service half of ``asyncrl demo``: a real ``asyncrl server`` + ``asyncrl worker`` in embedded mode (SQLite,
file broker), a run submitted over REST and followed to its end, and no server or worker left behind (also on
Ctrl-C). The run names a model path that does not exist, so it fails in preflight at once: no model, no vLLM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from worker.demo import TERMINAL, DemoError, _stage_steps, embedded_service, follow_run, pipeline_data
from worker.run.procs import alive  # the liveness check the service itself uses

BAD_MODEL = "sft/final"  # under tmp_path: outside the service's own folder, as the demo's SFT model is; never made


def test_embedded_service_follows_a_submitted_run_to_its_final_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedded server and worker take a submitted run through launch to its final status (here the launch's
    preflight refuses the model folder: the run fails naming it), store and serve its metrics, print its transitions,
    and stop with nothing left running. A run of the embedded service that trains to ``completed`` is the demo's
    (``tests/e2e/test_demo_run.py``)."""
    model = str(tmp_path / BAD_MODEL)
    with (
        embedded_service(tmp_path / "home", model_roots=[tmp_path / "sft"]) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}) as client,
    ):
        assert service.token.startswith("asr_") and set(service.pids) == {"server", "worker"}
        assert all(alive(pid) for pid in service.pids.values())
        assert client.get("/healthz").json() == {
            "status": "ok",
            "database": "sqlite",
            "broker": "embedded",
            "worker": "ok",
        }
        resp = client.post("/api/runs", json={"name": "demo-test", "max_steps": 2, "model": {"name": model}})
        elsewhere = {"name": "x", "max_steps": 2, "model": {"name": str(tmp_path / "other" / "m")}}
        refused = client.post("/api/runs", json=elsewhere)  # outside both roots
        assert refused.status_code == 422 and "MODEL_ROOTS" in refused.json()["detail"], refused.text
        assert resp.status_code == 201, resp.text
        run = follow_run(client, resp.json()["id"], max_steps=2, poll_s=0.2, local_supervisor=True)
        pids = service.pids
        # SQLite stores no NaN; a NaN point (mismatch_kl_on_policy off-policy) must still be accepted and read back
        body = (
            '{"points": [{"source": "trainer", "step": 1, "name": "kl", "value": NaN, "time": 1.0},'
            ' {"source": "trainer", "step": 2, "name": "kl", "value": 0.5, "time": 2.0}]}'
        )
        resp = client.post(f"/api/runs/{run['id']}/metrics", content=body, headers={"Content-Type": "application/json"})
        assert resp.status_code == 200 and resp.json() == {"received": 2, "inserted": 2}, resp.text
        kl = client.get(f"/api/runs/{run['id']}/metrics", params={"name": "kl"}).json()["series"]
        assert [(s["step"], s["value"]) for s in kl] == [([1, 2], [None, 0.5])]
    assert run["status"] == "failed" and run["status"] in TERMINAL
    assert run["status_reason"].startswith(f"preflight: model.name: {model}")
    assert run["run_dir"].startswith(str(tmp_path / "home" / "outputs" / "runs"))
    out = capsys.readouterr().out
    assert f"run {run['id']}: - -> queued" in out and f"run {run['id']}: starting -> failed (preflight" in out
    assert not any(alive(pid) for pid in pids.values())
    assert (tmp_path / "home" / "asyncrl.db").exists() and (tmp_path / "home" / "broker").is_dir()


def test_server_and_worker_die_with_the_demo_on_ctrl_c(tmp_path: Path) -> None:
    # SIGINT handled as in a terminal (a shell's background job would inherit it ignored)
    code = (
        "import json, signal, sys, time; from pathlib import Path; from worker.demo import embedded_service\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "with embedded_service(Path(sys.argv[1])) as s:\n"
        "    print(json.dumps(s.pids), flush=True); time.sleep(300)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "home")],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[3],
        env={**os.environ},
    )
    try:
        assert proc.stdout is not None
        pids = json.loads(proc.stdout.readline())
        assert all(alive(pid) for pid in pids.values())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) != 0
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in pids.values()), pids
    finally:
        proc.kill()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rl-steps", "0"], "error: --rl-steps: expected an integer >= 1, got 0"),
        (["--sft-steps", "-3", "--local"], "error: --sft-steps: expected an integer >= 1, got -3"),
        (["--bogus"], "error: asyncrl demo: unrecognized arguments: --bogus"),
        (["--summary", "/"], "error: --summary: expected a .json file path such as outputs/demo/summary.json, got /"),
        (["--serve", "--port", "0"], "error: --port: expected a port 1-65535, got 0"),
    ],
)
def test_demo_refuses_bad_arguments_before_doing_anything(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from worker.cli import main

    assert main(["demo", "--summary", str(tmp_path / "s.json"), *argv]) == 2
    assert capsys.readouterr().err.strip() == message
    assert not any(tmp_path.iterdir())


@pytest.mark.timing  # Ctrl-C ends it within 30 s: 62 s in all beside pass 1's 4 processes and the fuzz (33 s alone)
def test_serve_reopens_the_dashboard_on_an_earlier_demos_state(tmp_path: Path) -> None:
    """``asyncrl demo --serve`` starts the embedded service again on ``<output-dir>/service``: the runs the demo
    stored are there, a new token logs in, and Ctrl-C ends it (exit 0) with nothing left running."""
    from worker.run.procs import free_port

    out = tmp_path / "demo"
    with (
        embedded_service(out / "service") as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}) as client,
    ):
        made = client.post("/api/runs", json={"name": "kept", "max_steps": 2, "model": {"name": str(tmp_path / "m")}})
        assert made.status_code == 422  # a model outside the roots: nothing stored, then one that is stored
        made = client.post("/api/runs", json={"name": "kept", "max_steps": 2, "model": {"name": "org/model"}})
        assert made.status_code == 201, made.text
        client.post(f"/api/runs/{made.json()['id']}/stop")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "demo", "--serve", "--output-dir", str(out), "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    try:
        assert proc.stdout is not None
        line = next(line for line in proc.stdout if line.startswith("[demo] dashboard: "))
        assert line.startswith(f"[demo] dashboard: http://127.0.0.1:{port}/pipelines (log in with the token asr_")
        token = line.split("token ", 1)[1].split(")", 1)[0]
        runs = httpx.get(f"http://127.0.0.1:{port}/api/runs", headers={"Authorization": f"Bearer {token}"}).json()
        assert [r["name"] for r in runs["data"]] == ["kept"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz")


def test_serve_without_a_demo_state_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    assert main(["demo", "--serve", "--output-dir", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: --output-dir: no demo state in {tmp_path / 'none'}")


def _scripted_server(
    run_dir: Path, pid: int, statuses: list[str], series: list[dict[str, Any]] | None = None
) -> httpx.Client:
    """A server whose run reports ``statuses`` one per poll (the last one from then on), launched as ``pid``, and
    ``series`` as its ``reward_mean`` metric."""
    polls = iter(statuses)
    last = {"status": statuses[0]}

    def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/api/runs/7":
            last["status"] = next(polls, last["status"])
            return httpx.Response(200, json={"id": 7, "launcher_handle": str(pid), "run_dir": str(run_dir), **last})
        if path.endswith("/events"):
            return httpx.Response(200, json={"data": []})
        return httpx.Response(200, json={"series": series or []})

    return httpx.Client(base_url="http://asyncrl.test", transport=httpx.MockTransport(answer))


def test_follow_run_waits_for_a_supervisor_that_has_not_taken_its_lock_yet(tmp_path: Path) -> None:
    # a loaded machine: the supervisor still imports (no supervisor.lock yet) for more than three polls
    starting = subprocess.Popen(["sleep", "30"])
    try:
        statuses = ["starting"] * 6 + ["failed"]
        with _scripted_server(tmp_path / "runs" / "7" / "run", starting.pid, statuses) as client:
            run = follow_run(client, 7, max_steps=2, poll_s=0.01, local_supervisor=True)
        assert run["status"] == "failed"
    finally:
        starting.kill()
        starting.wait()


def test_follow_run_stops_when_the_supervisor_died_unreported(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    with (
        _scripted_server(tmp_path / "runs" / "7" / "run", dead.pid, ["starting"]) as client,
        pytest.raises(DemoError, match=rf"run 7: its supervisor \(pid {dead.pid}\) exited without reporting an end"),
    ):
        follow_run(client, 7, max_steps=2, poll_s=0.01, local_supervisor=True)


def test_the_demo_submits_the_example_pipeline_with_its_model_and_step_counts() -> None:
    """``asyncrl demo`` sends ``examples/pipelines/reverse_text.toml`` (sft -> rl -> eval, bases inline) with the SFT
    stage on the tiny model it made and the ``--sft-steps`` / ``--rl-steps`` counts as overrides."""
    data = pipeline_data("/m/tiny", sft_steps=4, rl_steps=2)
    assert data["name"] == "reverse-text"
    assert [s["kind"] for s in data["stages"]] == ["sft", "rl", "eval"]
    assert [s.get("overrides") for s in data["stages"]] == [
        {"model.name": "/m/tiny", "max_steps": 4},
        {"ckpt.interval": 20, "max_steps": 2},
        None,
    ]
    assert data["stages"][0]["base"]["max_steps"] == 240 and data["stages"][1]["base"]["max_steps"] == 160
    assert data["stages"][2]["base"]["eval"] == {"num_examples": 64, "temperature": 0.0, "max_tokens": 64}
    assert "output_dir" not in json.dumps(data)  # the service chooses the run folders
    assert _stage_steps(data) == [4, 2, 1]
    assert _stage_steps(pipeline_data("/m/tiny")) == [240, 160, 1]


def test_an_sft_stage_shows_its_step_and_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An SFT run logs no reward: its bar stayed at ``0/240 ... reward nan`` for a whole SFT stage; it shows the
    newest ``sft`` step and its loss."""
    running = subprocess.Popen(["sleep", "30"])
    try:
        series = [{"source": "sft", "step": [1, 2, 3], "value": [2.5, 1.75, 1.25]}]
        statuses = ["running", "running", "failed"]
        with _scripted_server(tmp_path / "runs" / "7" / "run", running.pid, statuses, series) as client:
            follow_run(client, 7, max_steps=240, poll_s=0.01, label="SFT")
    finally:
        running.kill()
        running.wait()
    out = capsys.readouterr().out
    assert "3/240" in out and "loss 1.250" in out and "reward" not in out


def test_an_eval_stage_shows_its_eval_reward_and_a_full_bar_when_done(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An eval run logs no training rows: the demo's line showed ``0/1 ... reward nan`` for a completed eval stage
    (fresh user, session 18); it shows the eval's reward and 1/1."""
    finished = subprocess.Popen(["true"])
    finished.wait()
    series = [{"source": "eval", "step": [4], "value": [0.829]}]
    with _scripted_server(tmp_path / "runs" / "7" / "run", finished.pid, ["completed"], series) as client:
        run = follow_run(client, 7, max_steps=1, poll_s=0.01, label="EVAL")
    out = capsys.readouterr().out
    assert run["status"] == "completed"
    assert "eval at policy version 4: reward 0.829" in out
    assert "1/1" in out and "completed | reward 0.829" in out and "reward nan" not in out
