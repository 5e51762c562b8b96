"""``asyncrl token|submit|runs`` against a live server, and the supervisor's metrics forwarder (spool + replay)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import BAD_MODEL, free_port, run_token_headers, sft_data, stored
from worker.cli import main


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_token_submit_runs(
    capsys: pytest.CaptureFixture[str], live_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = cli(capsys, "token", "create", "--name", "cli-user")
    token = out.strip()
    assert code == 0 and token.startswith("asr_") and "not shown again" in err
    monkeypatch.setenv("ASYNCRL_URL", live_server)
    monkeypatch.setenv("ASYNCRL_TOKEN", token)
    spec = tmp_path / "rl.toml"
    spec.write_text(f'name = "cli-run"\nmax_steps = 2\n[model]\nname = "{BAD_MODEL}"\n')
    code, out, _ = cli(capsys, "submit", str(spec))
    run = json.loads(out)
    assert code == 0 and run["name"] == "cli-run" and run["status"] == "queued"
    code, out, _ = cli(capsys, "runs", "ls", "--name", "cli-run")
    assert code == 0 and f"{run['id']:>6}  queued" in out and "1 of 1 runs" in out
    code, out, _ = cli(capsys, "runs", "stop", str(run["id"]))
    assert code == 0 and json.loads(out)["status"] == "cancelled"
    code, out, _ = cli(capsys, "runs", "show", str(run["id"]))
    assert code == 0 and json.loads(out)["status"] == "cancelled"

    sft = tmp_path / "sft.toml"  # issue 22: an SFT spec file is submitted as it is (kind = "sft" in the file)
    data = sft_data()
    sft.write_text(f'kind = "sft"\nname = "cli-sft"\n[model]\nname = "{BAD_MODEL}"\n[data]\npath = "{data}"\n')
    code, out, _ = cli(capsys, "submit", str(sft))
    assert code == 0 and json.loads(out)["status"] == "queued"
    code, out, _ = cli(capsys, "runs", "show", str(json.loads(out)["id"]))
    assert code == 0 and (json.loads(out)["kind"], json.loads(out)["spec"]["data"]["path"]) == ("sft", data)
    sft.write_text(f'kind = "sft"\nname = "cli-sft"\n[model]\nname = "{BAD_MODEL}"\n[data]\npath = "/etc/passwd"\n')
    code, _, err = cli(capsys, "submit", str(sft))
    assert code == 2 and err.strip().startswith(
        "error: 422: data.path: '/etc/passwd' is not allowed in a run submitted"
    )

    job = tmp_path / "eval.toml"  # an eval job: a model path on two environments; then a run that does not exist
    envs = '[[env]]\nid = "reverse_text"\nname = "a"\n[[env]]\nid = "arithmetic"\nname = "b"\n'
    job.write_text(f'kind = "eval"\nname = "cli-eval"\n[model]\nname = "{BAD_MODEL}"\n{envs}[eval]\ntemperature = 0\n')
    code, out, _ = cli(capsys, "submit", str(job))
    assert code == 0 and json.loads(out)["status"] == "queued"
    code, out, _ = cli(capsys, "runs", "show", str(json.loads(out)["id"]))
    shown = json.loads(out)
    assert (shown["kind"], [e["name"] for e in shown["spec"]["env"]], shown["spec"]["eval"]["temperature"]) == (
        "eval",
        ["a", "b"],
        0.0,
    )
    job.write_text('kind = "eval"\nname = "cli-eval"\n[model]\nrun = 2147483000\nstep = 5\n')
    code, _, err = cli(capsys, "submit", str(job))
    assert code == 2 and err.strip() == "error: 422: model.run: no run 2147483000; give the id of a run of this service"

    spec.write_text(f'name = "cli-run"\n[model]\nname = "{BAD_MODEL}"\n[trainer.optim]\nlrr = 1\n')
    code, _, err = cli(capsys, "submit", str(spec))
    assert code == 2 and err.strip() == "error: 422: unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)"
    code, _, err = cli(capsys, "runs", "show", "999999", "--token", "asr_wrong")
    assert code == 2 and err.strip() == "error: 401: invalid token"

    code, out, _ = cli(capsys, "token", "create", "--name", "cli-viewer", "--read-only")
    viewer = out.strip()
    code, out, _ = cli(capsys, "runs", "ls", "--token", viewer)
    assert code == 0 and "cli-run" in out
    code, _, err = cli(capsys, "runs", "stop", str(run["id"]), "--token", viewer)
    assert code == 2 and err.strip() == "error: 403: token 'cli-viewer' is read-only: it may only read (GET)"

    code, _, err = cli(capsys, "runs", "delete", str(run["id"]), "--token", viewer)
    assert code == 2 and err.strip() == "error: 403: token 'cli-viewer' is read-only: it may only read (GET)"
    code, out, _ = cli(capsys, "runs", "delete", str(run["id"]))
    assert code == 0 and json.loads(out) == {"deleted": run["id"]}
    code, _, err = cli(capsys, "runs", "show", str(run["id"]))
    assert code == 2 and err.strip() == f"error: 404: run {run['id']} not found"

    code, out, _ = cli(capsys, "token", "revoke", "--name", "cli-user")
    assert code == 0 and "revoked 1" in out
    code, _, err = cli(capsys, "runs", "ls")
    assert code == 2 and "revoked" in err
    code, _, err = cli(capsys, "token", "revoke", "--name", "cli-user")
    assert code == 2 and "no live token called 'cli-user'" in err


def test_runs_ls_into_a_closed_pipe_ends_quietly(capsys: pytest.CaptureFixture[str], live_server: str) -> None:
    """``asyncrl runs ls | head -1``: the first line reaches ``head``; a reader gone before the output is written
    ends the command with the shell's SIGPIPE status (141) and nothing on stderr (no BrokenPipeError traceback)."""
    code, out, _ = cli(capsys, "token", "create", "--name", "cli-pipe")
    env = {**os.environ, "ASYNCRL_URL": live_server, "ASYNCRL_TOKEN": out.strip(), "PYTHONPATH": os.getcwd()}
    for i in range(2):  # two runs: ``runs ls`` prints three lines
        body = {"name": f"cli-pipe-{i}", "max_steps": 2, "model": {"name": BAD_MODEL}}
        auth = {"Authorization": f"Bearer {env['ASYNCRL_TOKEN']}"}
        assert httpx.post(f"{live_server}/api/runs", json=body, headers=auth).status_code == 201
    cmd = [sys.executable, "-m", "worker.cli", "runs", "ls"]
    shell = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{shlex.join(cmd)} | head -1"], env=env, capture_output=True, text=True
    )
    assert shell.stderr == "" and shell.returncode in (0, 141) and len(shell.stdout.splitlines()) == 1
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the command writes its first line
    err = proc.stderr.read()
    assert (proc.wait(timeout=60), err) == (141, b"")


def write_rows(path: Path, steps: range) -> int:
    """Append trainer + orchestrator rows like the run processes do; returns the number of points."""
    from worker.run.rundir import RunDir

    run = RunDir(path)
    n = 0
    for step in steps:
        run.log_metrics("trainer", step, {"loss": 1 / (step + 1), "lr": 1e-4, "grad_norm": None})
        run.log_metrics("orchestrator", step, {"reward_mean": step / 10, "dropped_stale": 0})
        n += 4
    return n


def test_forwarder_spools_while_the_server_is_down_then_sends_each_point_once(
    client: Any, make_run: Any, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient

    from server.main import app
    from worker.launchers.reporter import MetricsForwarder

    run_id = make_run()["id"]
    tmp_path.mkdir(exist_ok=True)
    emitted = write_rows(tmp_path, range(1, 6))
    down = httpx.Client(base_url=f"http://127.0.0.1:{free_port()}", timeout=2)
    spooled = MetricsForwarder(down, run_id, tmp_path / "metrics.jsonl", tmp_path / "offset", batch_points=3)
    with pytest.raises(httpx.ConnectError):
        spooled.send_once()
    assert spooled.offset == 0 and not (tmp_path / "offset").exists()

    emitted += write_rows(tmp_path, range(6, 9))  # training goes on meanwhile
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"source": "trainer", "step": 9, "lo')  # a torn line is left for the next pass
    with TestClient(app, headers=run_token_headers(run_id)) as up:
        fwd = MetricsForwarder(up, run_id, tmp_path / "metrics.jsonl", tmp_path / "offset", batch_points=3)
        assert fwd.send_once() == emitted and fwd.send_once() == 0
        (tmp_path / "offset").unlink()  # a replay from the start (e.g. a restarted supervisor that lost its offset)
        replay = MetricsForwarder(up, run_id, tmp_path / "metrics.jsonl", tmp_path / "offset")
        assert replay.send_once() == emitted
    body = client.get(f"/api/runs/{run_id}/metrics", params={"name": "loss"}, headers=run_token_headers(run_id)).json()
    assert body["series"][0]["step"] == list(range(1, 9))
    assert stored(run_id) == emitted


def test_forwarder_splits_a_backlog_larger_than_the_server_takes_in_one_request(
    client: Any, make_run: Any, tmp_path: Path
) -> None:
    """The backlog after an outage or a resume's replay may exceed ``MAX_METRIC_POINTS`` (2000 in the tests): the
    server answers 413, and the forwarder halves its batches until one is taken, instead of retrying the same batch
    forever (every later point would wait behind it)."""
    from fastapi.testclient import TestClient

    from server.core.config import settings
    from server.main import app
    from worker.launchers.reporter import MetricsForwarder

    run_id = make_run()["id"]
    emitted = write_rows(tmp_path, range(1, 1301))
    assert emitted == 5200 and settings.MAX_METRIC_POINTS == 2000
    with TestClient(app, headers=run_token_headers(run_id)) as up:
        fwd = MetricsForwarder(up, run_id, tmp_path / "metrics.jsonl", tmp_path / "offset")
        assert fwd.batch_points == 5000
        assert fwd.send_once() == 5200 and fwd.batch_points == 1250  # 5000 -> 413, 2500 -> 413, 1250 taken
        assert fwd.offset == (tmp_path / "metrics.jsonl").stat().st_size
    assert stored(run_id) == 5200
    query = {"name": "loss", "max_points": 5000}
    body = client.get(f"/api/runs/{run_id}/metrics", params=query, headers=run_token_headers(run_id)).json()
    assert body["series"][0]["step"] == list(range(1, 1301))
