"""Running user code is a permission: a spec submitted to the service names only allowed code and addresses.

Every submit path (``POST /api/runs`` as JSON and as an upload, the dashboard's launch form, fork) refuses an
``env.id``, ``orchestrator.harness.id``, plugin ``import_path`` or ``inference.url`` the service does not allow with a 422 naming the key,
storing nothing; a launch of a spec stored before the setting changed fails with that reason, starting nothing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.service.test_lifecycle import checkpoint
from tests.support.server import new_token, spec
from tests.support.webui import login

BUILTINS = "arithmetic, reverse_text, reverse_tool, reverse_twice, self_play"


def refused_env(value: str, allowed: str = "none") -> str:
    return (
        f"env.id: {value!r} is not allowed in a run submitted to the service; allowed: a built-in environment "
        f"({BUILTINS}) or package.module:attr from an allowed package (ALLOWED_CODE_PACKAGES: {allowed})"
    )


def refused_url(url: str, allowed: str = "none") -> str:
    return (
        f"inference.url: {url!r} is not allowed in a run submitted to the service; allowed: an http(s) URL of a "
        f"loopback address (127.0.0.1, localhost, ::1) or of a host in INFERENCE_ALLOW_HOSTS ({allowed})"
    )


def run_count(client: Any, auth: dict[str, str]) -> int:
    return int(client.get("/api/runs", params={"limit": 1}, headers=auth).json()["count"])


@pytest.fixture
def allow(monkeypatch: pytest.MonkeyPatch) -> Any:
    from server.core.config import settings

    def set_(name: str, values: list[str]) -> None:
        monkeypatch.setattr(settings, name, values)

    return set_


@pytest.mark.parametrize(
    ("overrides", "detail"),
    [
        pytest.param({"env": {"id": "os:system", "args": {"command": "id"}}}, refused_env("os:system"), id="os-system"),
        pytest.param({"env": {"id": "subprocess:run"}}, refused_env("subprocess:run"), id="subprocess-run"),
        pytest.param({"env": {"id": "mypkg.envs:make"}}, refused_env("mypkg.envs:make"), id="package-not-allowed"),
        pytest.param({"env": {"id": "nope"}}, refused_env("nope"), id="unknown-name"),
        pytest.param(
            {"trainer": {"loss": {"type": "custom", "import_path": "os:system"}}},
            "trainer.loss.import_path: 'os:system' is not allowed in a run submitted to the service; allowed: "
            "package.module:attr from an allowed package (ALLOWED_CODE_PACKAGES: none)",
            id="custom-loss",
        ),
        pytest.param(
            {"orchestrator": {"advantage": {"type": "custom", "import_path": "mypkg.adv:rloo", "kwargs": {"k": 1}}}},
            "orchestrator.advantage.import_path: 'mypkg.adv:rloo' is not allowed in a run submitted to the service; "
            "allowed: package.module:attr from an allowed package (ALLOWED_CODE_PACKAGES: none)",
            id="custom-advantage",
        ),
        pytest.param(
            {"env": [{"id": "reverse_text"}, {"id": "os:system", "name": "x"}]},
            refused_env("os:system").replace("env.id", "env.1.id", 1),
            id="mixture-second-env",
        ),
        pytest.param(
            {"orchestrator": {"harness": {"id": "antigravity"}}},
            "orchestrator.harness.id: 'antigravity' is not allowed in a run submitted to the service; allowed: a "
            "built-in harness (",
            id="harness-module",
        ),
        pytest.param(
            {"inference": {"url": "http://10.0.0.5:8000"}}, refused_url("http://10.0.0.5:8000"), id="private-url"
        ),
        pytest.param(
            {"inference": {"url": "http://169.254.169.254/latest"}},
            refused_url("http://169.254.169.254/latest"),
            id="metadata-url",
        ),
        pytest.param(  # not a URL at all: the spec's own check, before the service's policy
            {"inference": {"url": "file:///etc/passwd"}},
            "inference.url: expected an http(s) URL with a host, got 'file:///etc/passwd'",
            id="not-http",
        ),
        pytest.param(
            {"inference": {"extra_args": ["--max-num-seqs", "8", "--worker-extension-cls=evil.Extension"]}},
            "inference.extra_args.2: '--worker-extension-cls' is not allowed in a run submitted to the service (vLLM "
            "flags that load code or files are not); allowed: --block-size VALUE, ",
            id="vllm-extension-cls",
        ),
        pytest.param(
            {"inference": {"extra_args": ["--middle", "os.system"]}},  # argparse would expand the abbreviation
            "inference.extra_args.0: '--middle' is not allowed in a run submitted to the service",
            id="vllm-middleware-abbreviated",
        ),
        pytest.param(
            {"launcher": {"slurm": {"extra_sbatch": ["--constraint=a100", "--output=/etc/cron.d/x"]}}},
            "launcher.slurm.extra_sbatch: '--output' is not allowed in a run submitted to the service (options that "
            "write files or change the job's user or environment are not); allowed: --begin, ",
            id="sbatch-output",
        ),
        pytest.param(
            {"launcher": {"slurm": {"env": {"NCCL_DEBUG": "INFO", "LD_PRELOAD": "/tmp/x.so"}}}},
            "launcher.slurm.env: 'LD_PRELOAD' is not allowed in a run submitted to the service; allowed: "
            "CUDA_LAUNCH_BLOCKING, GLOO_SOCKET_IFNAME, HF_DATASETS_OFFLINE, ",
            id="job-env-ld-preload",
        ),
        pytest.param(
            {"inference": {"extra_args": ["--max-num-seqs=4 --trust-remote-code"]}},
            "inference.extra_args.0: '--max-num-seqs=4 --trust-remote-code' holds whitespace; give each option and "
            "value as its own item",
            id="vllm-flag-hidden-after-a-space",
        ),
        pytest.param(
            {
                "inference": {"host": "169.254.169.254"},
                "launcher": {"kind": "slurm", "slurm": {"extra_sbatch": ["--nodelist=169.254.169.254"]}},
            },
            "inference.host: '169.254.169.254' is not allowed in a run submitted to the service; allowed: a loopback",
            id="an-address-as-a-slurm-node",
        ),
        pytest.param(
            {"orchestrator": {"harness": {"tool_parser": "/tmp/evil.py"}}},
            "orchestrator.harness.tool_parser: Input should be 'qwen3', 'qwen3.5', 'glm' or 'deepseek-v3'",
            id="tool-parser-not-a-parser",
        ),
        pytest.param(
            {"launcher": {"slurm": {"env": {"GCONV_PATH": "/tmp/gconv"}}}},
            "launcher.slurm.env: 'GCONV_PATH' is not allowed",
            id="job-env-not-in-the-allowlist",
        ),
        pytest.param(
            {"launcher": {"slurm": {"env": {"ASYNCRL_SERVER_URL": "http://evil.example"}}}},
            "launcher.slurm.env: 'ASYNCRL_SERVER_URL' is not allowed",
            id="job-env-report-elsewhere",
        ),
    ],
)
def test_submit_refuses_code_and_addresses_naming_the_key(
    client: Any, auth: dict[str, str], overrides: dict[str, Any], detail: str
) -> None:
    before = run_count(client, auth)
    resp = client.post("/api/runs", json=spec(**overrides), headers=auth)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"].startswith(detail), resp.json()["detail"]
    assert "\n" not in resp.json()["detail"]
    assert run_count(client, auth) == before


def test_upload_refuses_os_system(client: Any, auth: dict[str, str]) -> None:
    """The path of ``asyncrl submit``: a TOML file upload."""
    before = run_count(client, auth)
    text = f'name = "evil"\nmax_steps = 3\n[model]\nname = "{spec()["model"]["name"]}"\n[env]\nid = "os:system"\n'
    resp = client.post("/api/runs", files={"file": ("evil.toml", text.encode(), "text/plain")}, headers=auth)
    assert (resp.status_code, resp.json()["detail"]) == (422, refused_env("os:system"))
    assert run_count(client, auth) == before


def test_allowed_package_and_host_pass(client: Any, auth: dict[str, str], allow: Any) -> None:
    allow("ALLOWED_CODE_PACKAGES", ["mypkg"])
    allow("INFERENCE_ALLOW_HOSTS", ["vllm.internal"])
    allow("INFERENCE_ALLOW_FLAGS", ["--trust-remote-code"])
    for overrides in (
        {"inference": {"extra_args": ["-tp", "1", "--max-num-seqs=8", "--trust-remote-code"]}},
        {"launcher": {"slurm": {"extra_sbatch": ["--constraint=a100", "--hold"], "env": {"NCCL_DEBUG": "INFO"}}}},
        {"env": {"id": "mypkg.envs:make"}},
        {"orchestrator": {"advantage": {"type": "custom", "import_path": "mypkg.adv:rloo"}}},
        {"env": {"id": "reverse_tool"}},
        {"orchestrator": {"harness": {"id": "bash"}}},
        {"inference": {"url": "http://127.0.0.1:8001"}},
        {"inference": {"url": "http://[::1]:8001"}},
        {"inference": {"url": "http://vllm.internal:8000"}},
    ):
        resp = client.post("/api/runs", json=spec(**overrides), headers=auth)
        assert resp.status_code == 201, (overrides, resp.text)
    other = client.post("/api/runs", json=spec(env={"id": "otherpkg:make"}), headers=auth)
    assert (other.status_code, other.json()["detail"]) == (422, refused_env("otherpkg:make", "mypkg"))


def test_launch_form_refuses_os_system_at_its_line(client: Any, auth: dict[str, str]) -> None:
    login(client, new_token("web-code"))
    csrf = re.search(r'name="csrf" value="([^"]+)"', client.get("/launch").text)
    assert csrf
    before = run_count(client, auth)
    text = 'name = "evil"\nmax_steps = 3\n[model]\nname = "m"\n[env]\nid = "os:system"\n'
    resp = client.post("/launch", data={"csrf": csrf.group(1), "spec": text})
    assert resp.status_code == 422
    shown = refused_env("os:system").replace("'", "&#39;")
    assert '<li value="6" class="bad" id="bad-line"><code>id = &#34;os:system&#34;</code>' in resp.text
    assert f"{shown} (line 6)</p>" in resp.text
    assert run_count(client, auth) == before


def test_fork_refuses_a_change_to_os_system(client: Any, auth: dict[str, str], make_run: Any) -> None:
    parent = make_run(max_steps=8)
    checkpoint(parent, 2)
    before = run_count(client, auth)
    for body in ({"changes": {"env.id": "os:system"}}, {"changes": {"env": {"id": "subprocess:run"}}}):
        resp = client.post(f"/api/runs/{parent['id']}/fork", json=body, headers=auth)
        value = "os:system" if "env.id" in body["changes"] else "subprocess:run"
        assert (resp.status_code, resp.json()["detail"]) == (422, refused_env(value)), resp.text
    no_checkpoint = make_run()  # the code is named before the checkpoint is looked for
    resp = client.post(f"/api/runs/{no_checkpoint['id']}/fork", json={"changes": {"env.id": "os:system"}}, headers=auth)
    assert (resp.status_code, resp.json()["detail"]) == (422, refused_env("os:system"))
    assert run_count(client, auth) == before + 1


def test_launch_of_a_stored_spec_no_longer_allowed_fails_and_starts_nothing(
    client: Any, auth: dict[str, str], make_run: Any, allow: Any
) -> None:
    from server.jobs.tasks import launch
    from worker.launchers import supervisor

    allow("ALLOWED_CODE_PACKAGES", ["mypkg"])
    run = make_run(env={"id": "mypkg.envs:make"})
    allow("ALLOWED_CODE_PACKAGES", [])  # the admin withdrew the package before a worker took the launch
    result = launch(run["id"])
    reason = f"refused at launch: {refused_env('mypkg.envs:make')}"
    assert result == f"failed: run {run['id']}: {reason}"
    done = client.get(f"/api/runs/{run['id']}", headers=auth).json()
    assert (done["status"], done["status_reason"], done["launcher_handle"]) == ("failed", reason, None)
    home = Path(run["run_dir"]).parent
    assert supervisor.running_pid(home) is None and not home.exists()  # no supervisor, no run directory
    events = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
    assert [(e["from_status"], e["to_status"]) for e in events if e["kind"] == "status"] == [
        (None, "queued"),
        ("queued", "failed"),
    ]


def test_asyncrl_submit_exits_2_naming_env_id(
    capsys: pytest.CaptureFixture[str], live_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.cli import main

    monkeypatch.setenv("ASYNCRL_URL", live_server)
    monkeypatch.setenv("ASYNCRL_TOKEN", new_token("cli-code"))
    path = tmp_path / "evil.toml"
    path.write_text('name = "evil"\nmax_steps = 2\n[model]\nname = "m"\n[env]\nid = "os:system"\n')
    assert main(["submit", str(path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: 422: {refused_env('os:system')}"


def test_a_supervisor_an_earlier_delivery_started_is_adopted_not_refused(
    client: Any, auth: dict[str, str], make_run: Any, allow: Any
) -> None:
    """The launch check guards starting; a supervisor already running (its delivery was killed before the commit)
    is adopted and can be stopped, not left running behind a run marked failed."""
    from server.jobs.tasks import launch, stop
    from tests.service.test_tasks import fake_supervisor

    allow("ALLOWED_CODE_PACKAGES", ["mypkg"])
    run = make_run(env={"id": "mypkg.envs:make"})
    allow("ALLOWED_CODE_PACKAGES", [])
    proc = fake_supervisor(Path(run["run_dir"]).parent)
    try:
        assert launch(run["id"]) == f"adopted: run {run['id']} pid {proc.pid}"
        assert stop(run["id"], grace_s=5) == f"stopped: run {run['id']}"
    finally:
        proc.kill()
        proc.wait()
    assert client.get(f"/api/runs/{run['id']}", headers=auth).json()["status"] == "cancelled"


def _model_folder(name: str, config: str) -> Path:
    from server.core.config import settings

    folder = Path(settings.ASYNCRL_OUTPUT_DIR) / "models" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config)
    return folder


def test_a_model_folder_whose_file_links_out_of_the_roots_is_refused(client: Any, auth: dict[str, str]) -> None:
    folder = _model_folder("linked", '{"model_type": "qwen3"}')
    (folder / "tokenizer.json").symlink_to("/etc/hostname")
    before = run_count(client, auth)
    resp = client.post("/api/runs", json=spec(model={"name": str(folder)}), headers=auth)
    assert (resp.status_code, resp.json()["detail"]) == (
        422,
        f"model.name: {str(folder)!r}: tokenizer.json links out of MODEL_ROOTS (/etc/hostname); copy the file into "
        "the folder",
    )
    assert run_count(client, auth) == before


def test_a_lora_spec_of_a_folder_whose_config_does_not_load_is_a_422(client: Any, auth: dict[str, str]) -> None:
    folder = _model_folder("badjson", "{not json")
    lora = {"rank": 4, "target_modules": ["q_proj"]}
    resp = client.post("/api/runs", json=spec(model={"name": str(folder)}, trainer={"lora": lora}), headers=auth)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"].startswith(f"model.name: {str(folder)!r}: its config.json does not load (")


def test_an_sft_data_path_that_is_a_fifo_is_refused_not_opened(client: Any, auth: dict[str, str]) -> None:
    import os

    from server.core.config import settings

    fifo = Path(settings.ASYNCRL_OUTPUT_DIR) / "rows.jsonl"
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    body = {"kind": "sft", "name": "fifo", "max_steps": 2, "model": {"name": "org/model"}, "data": {"path": str(fifo)}}
    resp = client.post("/api/runs", json=body, headers=auth)
    assert (resp.status_code, resp.json()["detail"]) == (
        422,
        f"data.path: {fifo} is not a regular file or a folder (expected a .jsonl or .parquet file)",
    )


def test_a_pipeline_stored_while_its_first_tick_meets_a_locked_database_is_201(
    client: Any, auth: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline row is committed before its first tick; a tick that fails (SQLite busy) leaves it to beat,
    never a "not stored" 503 for a stored pipeline (a client would retry and make a second one)."""
    from sqlalchemy.exc import OperationalError

    from server.services import pipelines

    def busy(*_: Any) -> list[str]:
        raise OperationalError("UPDATE", {}, Exception("database is locked"))

    monkeypatch.setattr(pipelines, "tick", busy)
    body = {"name": "busy", "stages": [{"kind": "sft", "base": {"model": {"name": "org/model"}, "max_steps": 2}}]}
    resp = client.post("/api/pipelines", json=body, headers=auth)
    assert resp.status_code == 201, resp.text
    stored = client.get(f"/api/pipelines/{resp.json()['id']}", headers=auth).json()
    assert (stored["status"], [s["status"] for s in stored["stages"]]) == ("running", ["pending"])
