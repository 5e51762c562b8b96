"""``asyncrl`` commands of the control plane (``worker.cli`` imports this module when one is used; never the reverse).

    asyncrl server [--host 127.0.0.1] [--port 8000] [--no-migrate]
    asyncrl worker [--concurrency 2] [--export-concurrency 1] [--no-beat] [--exports-only]
    asyncrl token create --name NAME [--role admin|member|viewer] [--read-only] | revoke --name NAME
    asyncrl token role --name NAME --role admin|member|viewer
    asyncrl submit SPEC.toml|SPEC.json [--set key=value ...] [--url URL] [--token T]
    asyncrl runs ls [--status S] [--name N] [--limit 50] | show ID | stop ID | resume ID | delete ID
    asyncrl runs fork ID [--step K] [--name N] [--set key=value ...]
    asyncrl runs logs ID [--process trainer|orchestrator|inference|inference-<i>|supervisor] [--tail 200]
    asyncrl sweep SWEEP.toml|SWEEP.json | sweep show ID | sweep stop ID   [--url URL] [--token T]
    asyncrl pipeline PIPELINE.toml | pipeline show|stop|resume ID        [--url URL] [--token T]

``submit``, ``runs``, ``sweep`` and ``pipeline`` go through the REST API (``ASYNCRL_URL``, else ``settings.server_url()``) with
``ASYNCRL_TOKEN``; ``token`` writes to the database directly (it is how the first token is made): it is the local
admin command, so whoever may write ``ASYNCRL_HOME`` (or log in to ``DATABASE_URL``) may make an admin token, by design.
``server``, ``worker`` and ``token`` run by a user who may not write the service's state there say so in one line,
exit 2 (:func:`opens_home`).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from worker.cli_parser import ArgParser  # argparse errors: one 'error:' line, exit 2
from worker.spec import SpecError


def migrate() -> None:
    """``alembic upgrade head`` against ``DATABASE_URL``."""
    from alembic import command
    from alembic.config import Config

    cfg = Config(str(Path(__file__).resolve().parents[1] / "alembic.ini"))
    command.upgrade(cfg, "head")


def server_command(argv: list[str]) -> int:
    p = ArgParser(prog="asyncrl server", description="run the API server (uvicorn)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--no-migrate", action="store_true", help="skip 'alembic upgrade head' at start")
    args = p.parse_args(argv)
    sock = bind(args.host, args.port)  # first: a busy port fails at once, before migrating or publishing
    from server.core.db import DatabaseUnavailable, check_connection

    try:
        check_connection()
    except DatabaseUnavailable as err:  # no such database, host down, bad password: one line, exit 1
        sock.close()
        print(f"error: {err}", file=sys.stderr)  # noqa: T201
        return 1
    if not args.no_migrate:
        migrate()
    from server.core.config import settings

    if "ASYNCRL_SERVER_URL" not in settings.model_fields_set:  # workers on this ASYNCRL_HOME find this server
        settings.publish_server_url(args.host, args.port)
    serve(sock, args.host, args.port)
    return 0


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening). Raises SpecError naming --port when it is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise SpecError(f"--port: cannot listen on {host}:{port} ({err.strerror or err})") from None
    return sock


def serve(sock: socket.socket, host: str, port: int) -> None:
    """Run the API server (uvicorn) on the bound ``sock`` until it is stopped."""
    import uvicorn

    uvicorn.Server(uvicorn.Config("server.main:app", host=host, port=port)).run(sockets=[sock])


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1-65535, got {text!r}")
    return int(text)


def worker_command(argv: list[str]) -> int:
    p = ArgParser(prog="asyncrl worker", description="run the Celery workers that launch runs and export models")
    p.add_argument(
        "--concurrency",
        type=_count(1),
        default=2,
        help="processes taking control-plane tasks (launch, stop, reconcile, webhooks) from CELERY_QUEUE",
    )
    p.add_argument(
        "--export-concurrency",
        type=_count(0),
        default=1,
        help="processes of the export worker started beside it, taking model exports from CELERY_EXPORT_QUEUE "
        "(default <CELERY_QUEUE>-exports); 0 = no exports on this machine",
    )
    p.add_argument("--loglevel", default="INFO")
    p.add_argument(
        "--no-beat",
        action="store_true",
        help="do not embed Celery beat (the periodic reconcile); run one 'celery -A server.jobs.celery_app beat'",
    )
    p.add_argument(
        "--exports-only",
        action="store_true",
        help="be only an export worker (--export-concurrency processes, no beat, no control-plane tasks)",
    )
    args = p.parse_args(argv)
    from server.core.config import settings
    from server.jobs.celery_app import app

    home = settings.private_home()  # beat's schedule file lives there, and the embedded broker's folder
    check_writable(home, *([home / "broker"] if settings.embedded_broker else []))
    if args.exports_only:
        if args.export_concurrency == 0:
            raise SpecError("--export-concurrency: an --exports-only worker needs at least 1 process (got 0)")
        app.worker_main(
            [
                "worker",
                f"--concurrency={args.export_concurrency}",
                f"--loglevel={args.loglevel}",
                f"--queues={settings.export_queue}",
                "--hostname=exports@%h",  # beside the control worker's celery@%h (the healthcheck pings that one)
            ]
        )
        return 0
    exports = start_export_worker(args.export_concurrency, args.loglevel) if args.export_concurrency else None
    beat = [] if args.no_beat else ["-B"]
    try:
        app.worker_main(
            [
                "worker",
                f"--concurrency={args.concurrency}",
                f"--loglevel={args.loglevel}",
                f"--queues={settings.CELERY_QUEUE}",
                *beat,
            ]
        )
    finally:
        if exports is not None and exports.poll() is None:
            exports.terminate()  # Celery's warm shutdown: the export under way finishes first
            exports.wait()
    return 0


def check_writable(*folders: Path) -> None:
    """Refuse to start on a folder of ``folders`` that exists and this user may not write (Celery would print a
    traceback from its own threads and go on without a broker or a beat schedule).

    Raises:
        PermissionError: naming the folder (:func:`opens_home` words it as one line).
    """
    for folder in folders:
        if folder.exists() and not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(folder))


def start_export_worker(concurrency: int, loglevel: str) -> subprocess.Popen[bytes]:
    """``asyncrl worker --exports-only`` as a child of this process (output to this one's); it gets SIGTERM when this
    process dies, even by SIGKILL (``worker.run.procs.die_with_parent``)."""
    from worker.run.procs import die_with_parent

    parent = os.getpid()
    cmd = [sys.executable, "-m", "worker.cli", "worker", "--exports-only"]
    cmd += [f"--export-concurrency={concurrency}", f"--loglevel={loglevel}"]
    return subprocess.Popen(cmd, preexec_fn=lambda: die_with_parent(parent))  # noqa: PLW1509


def _count(low: int) -> Any:
    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or int(text) < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
        return int(text)

    return parse


def token_command(argv: list[str]) -> int:
    from server.models import Role

    roles = [r.value for r in Role]
    p = ArgParser(
        prog="asyncrl token",
        description="create or revoke API tokens, set a user's role. The local admin command: it writes to the "
        "service's database directly (DATABASE_URL; by default the SQLite file in ASYNCRL_HOME), so whoever may "
        "write ASYNCRL_HOME (or log in to DATABASE_URL) may make any token, an admin's included, by design (it makes "
        "the first one). Everyone else asks an admin.",
    )
    sub = p.add_subparsers(dest="action", required=True)
    for action in ("create", "revoke", "role"):
        sub.add_parser(action).add_argument("--name", required=True)
    sub.choices["create"].add_argument(
        "--role",
        choices=roles,
        help="role of a new user (default: admin for the installation's first user, member after that); an "
        "existing user keeps theirs (change it with 'asyncrl token role')",
    )
    sub.choices["create"].add_argument(
        "--read-only", action="store_true", help="a read token: GET only (dashboards, monitoring)"
    )
    sub.choices["role"].add_argument("--role", choices=roles, required=True)
    args = p.parse_args(argv)
    from sqlalchemy import inspect
    from sqlmodel import Session

    from server.core.db import DatabaseUnavailable, check_connection, engine
    from server.services import tokens

    try:
        check_connection()  # the SQLite file of another user, Postgres down: one line
    except DatabaseUnavailable as err:
        raise SpecError(str(err)) from None
    db = engine.url.render_as_string(hide_password=True)
    if not inspect(engine).has_table("api_tokens"):
        raise SpecError(
            f"database {db} has no tables yet: start `asyncrl server` once (it migrates) or run `alembic upgrade head`"
        )
    if not inspect(engine).has_table("users"):
        raise SpecError(f"database {db} has an older schema (no users): run `alembic upgrade head`")
    with Session(engine) as session:
        try:
            if args.action == "create":
                _, plain = tokens.create(
                    session, name=args.name, scope="read" if args.read_only else "write", role=args.role
                )
            elif args.action == "role":
                tokens.set_role(session, name=args.name, role=args.role)
        except ValueError as err:
            raise SpecError(f"--{err}") from None
        if args.action == "create":
            role = tokens.user(session, args.name)
            session.commit()
            print(plain)  # noqa: T201 - shown once; only its hash is stored
            print(
                f"token '{args.name}' ({role.role if role else '?'}) created; it is not shown again "  # noqa: T201
                "(export ASYNCRL_TOKEN=...)",
                file=sys.stderr,
            )
            return 0
        if args.action == "role":
            session.commit()
            print(f"user '{args.name}' is now {args.role}")  # noqa: T201
            return 0
        count = tokens.revoke(session, name=args.name)
        session.commit()
    if not count:
        raise SpecError(f"--name: no live token called {args.name!r}")
    print(f"revoked {count} token(s) called '{args.name}' and ended their dashboard sessions")  # noqa: T201
    return 0


CLI_USER_AGENT = "asyncrl-cli"
"""The ``User-Agent`` of this CLI's requests: the server records an action it asks as ``via CLI``
(``server.api.deps.client_surface``)."""


def _client(url: str | None, token: str | None) -> Any:
    import httpx

    from server.core.config import settings

    token = token or os.environ.get("ASYNCRL_TOKEN")
    if not token:
        raise SpecError("--token: set ASYNCRL_TOKEN or pass --token (asyncrl token create --name NAME)")
    base = url or os.environ.get("ASYNCRL_URL") or settings.server_url()
    headers = {"Authorization": f"Bearer {token}", "User-Agent": CLI_USER_AGENT}  # the server records "via CLI"
    return httpx.Client(base_url=base, headers=headers, timeout=30.0)


def _call(client: Any, method: str, path: str, **kwargs: Any) -> Any:
    import httpx

    try:
        resp = client.request(method, path, **kwargs)
    except httpx.HTTPError as err:
        raise SpecError(f"--url: cannot reach the server at {client.base_url} ({err})") from None
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        raise SpecError(f"{resp.status_code}: {detail}")
    return resp.json() if resp.content else None  # 204: no body


def _api_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        help="server base URL (default: ASYNCRL_URL, ASYNCRL_SERVER_URL, or the URL the "
        "server published in ASYNCRL_HOME/server_url)",
    )
    p.add_argument("--token", help="API token (default: ASYNCRL_TOKEN)")


def submit_command(argv: list[str]) -> int:
    """``asyncrl submit SPEC [--set key=value ...]``: the file as it is (uploaded), or, with ``--set``, the spec
    with the changes applied (``worker.spec.load_spec_data``, as ``asyncrl rl @ SPEC --key value``) and its keys
    checked here first, so a misspelt key is named before anything reaches the server (exit 2)."""
    from worker.spec.loading import SPEC_TYPES, check_unknown_keys, load_spec_data

    p = ArgParser(prog="asyncrl submit", description="submit a run spec to the server")
    p.add_argument("spec", type=Path, help=".toml or .json run spec")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="spec change, e.g. --set trainer.optim.lr=5e-5 (repeatable; as asyncrl runs fork)",
    )
    _api_args(p)
    args = p.parse_args(argv)
    if args.spec.is_dir():
        raise SpecError(f"config file {args.spec} is a directory; expected a .toml or .json run spec")
    if not args.spec.is_file():
        raise SpecError(f"config file not found: {args.spec}")
    body: dict[str, Any] = {"files": {"file": (args.spec.name, args.spec.read_bytes())}}
    if args.sets:
        data = load_spec_data([args.spec], [_set_pair(pair) for pair in args.sets])
        kind = data.get("kind", "rl")
        if not isinstance(kind, str) or kind not in SPEC_TYPES:
            raise SpecError(f"kind: expected one of {sorted(SPEC_TYPES)}, got {kind!r}")
        check_unknown_keys(SPEC_TYPES[kind], data)
        body = {"json": data}
    with _client(args.url, args.token) as client:
        run = _call(client, "POST", "/api/runs", **body)
    print(json.dumps({k: run[k] for k in ("id", "name", "status", "run_dir")}))  # noqa: T201
    return 0


def _set_pair(pair: str) -> tuple[str, str]:
    """``"trainer.optim.lr=5e-5"`` -> ``("trainer.optim.lr", "5e-5")`` (the value parsed later, as a TOML literal).

    Raises:
        SpecError: no ``=`` or an empty key.
    """
    key, sep, value = pair.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"--set: expected key=value such as trainer.optim.lr=5e-5, got {pair!r}")
    return key.strip(), value.strip()


def _parse_sets(pairs: list[str]) -> dict[str, Any]:
    """``["trainer.optim.lr=5e-5", ...]`` → ``{"trainer.optim.lr": 5e-05}`` (values as TOML literals, else text).

    Raises:
        SpecError: an item without ``=`` or with an empty key.
    """
    from worker.spec import parse_override_value

    changes = {}
    for pair in pairs:
        key, value = _set_pair(pair)
        changes[key] = parse_override_value(value, f"--set {key}")
    return changes


def runs_command(argv: list[str]) -> int:
    p = ArgParser(prog="asyncrl runs", description="list, show, stop, resume, fork, delete runs; read logs")
    sub = p.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("ls", help="the newest runs (filter by --status, --name)")
    ls.add_argument("--status")
    ls.add_argument("--name")
    ls.add_argument("--limit", type=int, default=50)
    _api_args(ls)
    helps = {
        "show": "one run as JSON (status, step, reason, spec, run directory)",
        "stop": "stop a live run (its checkpoints stay)",
        "resume": "resume a stopped or failed run from its newest complete checkpoint",
        "delete": "delete an ended run (its directory stays)",
    }
    for action, text in helps.items():
        sp = sub.add_parser(action, help=text)
        sp.add_argument("id", type=int)
        _api_args(sp)
    fork = sub.add_parser("fork", help="new run from a checkpoint of ID with spec changes")
    fork.add_argument("id", type=int)
    fork.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    fork.add_argument("--name", help="name of the new run (default: the parent's)")
    fork.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="spec change, e.g. --set trainer.optim.lr=5e-5 (repeatable)",
    )
    _api_args(fork)
    logs = sub.add_parser("logs", help="last lines of a process log of run ID")
    logs.add_argument("id", type=int)
    logs.add_argument(
        "--process",
        default="trainer",
        help="trainer | orchestrator | inference | inference-<i> (a replica) | supervisor",
    )
    logs.add_argument("--tail", type=int, default=200)
    _api_args(logs)
    args = p.parse_args(argv)
    if args.action == "fork":
        body = {"changes": _parse_sets(args.sets), "step": args.step, "name": args.name}
        with _client(args.url, args.token) as client:
            run = _call(
                client, "POST", f"/api/runs/{args.id}/fork", json={k: v for k, v in body.items() if v is not None}
            )
        print(json.dumps({k: run[k] for k in ("id", "name", "status", "run_dir")}))  # noqa: T201
        return 0
    if args.action == "delete":
        with _client(args.url, args.token) as client:
            _call(client, "DELETE", f"/api/runs/{args.id}")
        print(json.dumps({"deleted": args.id}))  # noqa: T201
        return 0
    if args.action == "logs":
        with _client(args.url, args.token) as client:
            out = _call(client, "GET", f"/api/runs/{args.id}/logs", params={"process": args.process, "tail": args.tail})
        print("\n".join(out["lines"]))  # noqa: T201
        return 0
    with _client(args.url, args.token) as client:
        if args.action == "ls":
            params = {k: v for k, v in {"status": args.status, "name": args.name, "limit": args.limit}.items() if v}
            page = _call(client, "GET", "/api/runs", params=params)
            for r in page["data"]:
                print(f"{r['id']:>6}  {r['status']:<10} {r['name']:<32} {r['created_at'][:19]}")  # noqa: T201
            print(f"{len(page['data'])} of {page['count']} runs")  # noqa: T201
            return 0
        post = args.action in ("stop", "resume")
        run = _call(client, "POST" if post else "GET", f"/api/runs/{args.id}" + (f"/{args.action}" if post else ""))
    print(json.dumps(run, indent=2))  # noqa: T201
    return 0


def _read_base(spec_file: Path, base: str, where: str) -> dict[str, Any]:
    """The run spec file ``base`` named in ``spec_file`` (relative to its folder), read as a mapping.

    Raises:
        SpecError: ``<where>: run spec file not found: <path>``, or the file does not parse.
    """
    from worker.spec import load_spec_data

    path = Path(base)
    path = path if path.is_absolute() else spec_file.parent / path
    if not path.is_file():
        raise SpecError(f"{where}: run spec file not found: {path}")
    return load_spec_data([path], [])


def load_sweep(path: Path) -> dict[str, Any]:
    """A sweep spec file (TOML, or JSON by its suffix) with ``base = "run.toml"`` (relative to the sweep file) read
    inline, as ``POST /api/sweeps`` takes it.

    Raises:
        SpecError: the file or its base is missing, unreadable or does not parse.
    """
    from worker.spec import load_spec_data

    data = load_spec_data([path], [])
    if isinstance(data.get("base"), str):
        data["base"] = _read_base(path, data["base"], "base")
    return data


def load_pipeline(path: Path) -> dict[str, Any]:
    """A pipeline spec file with each stage's base file read inline (``worker.spec.load_pipeline_data``).

    Raises:
        SpecError: the file or a stage's base is missing, unreadable or does not parse (``stages[i].base: ...``).
    """
    from worker.spec import load_pipeline_data

    return load_pipeline_data(path)


def _group_command(argv: list[str], noun: str, actions: tuple[str, ...], load: Any, members: str, about: str) -> int:
    """``asyncrl <noun> SPEC`` submits a spec file read by ``load`` to ``/api/<noun>s`` and prints its id, name, how
    many ``members`` (trials, stages) it has and the runs started; ``asyncrl <noun> ACTION ID`` shows it
    (``show``: ``GET``) or posts ``ACTION`` (``stop``, ``resume``) and prints the answer.

    Raises:
        SpecError: an action without an id, an id after a spec file, or a spec file ``load`` refuses (exit 2).
    """
    shown = " / ".join(actions)
    p = ArgParser(prog=f"asyncrl {noun}", description=f"submit a {noun} spec, or {about}")
    p.add_argument("spec", help=f"{noun} spec (.toml or .json), or " + " / ".join(f"'{a}'" for a in actions))
    p.add_argument("id", nargs="?", type=int, help=f"{noun} id ({shown.replace(' /', ',')})")
    _api_args(p)
    args = p.parse_args(argv)
    if args.spec in actions:
        if args.id is None:
            raise SpecError(f"asyncrl {noun} {args.spec}: expected a {noun} id")
        with _client(args.url, args.token) as client:
            if args.spec == "show":
                out = _call(client, "GET", f"/api/{noun}s/{args.id}")
            else:
                out = _call(client, "POST", f"/api/{noun}s/{args.id}/{args.spec}")
        print(json.dumps(out, indent=2, default=str))  # noqa: T201
        return 0
    if args.id is not None:
        raise SpecError(f"asyncrl {noun}: unexpected argument {args.id} after the spec file")
    data = load(Path(args.spec))
    with _client(args.url, args.token) as client:
        group = _call(client, "POST", f"/api/{noun}s", json=data)
    runs = [m["run_id"] for m in group[members] if m["run_id"] is not None]
    print(json.dumps({"id": group["id"], "name": group["name"], members: len(group[members]), "runs": runs}))  # noqa: T201
    return 0


def sweep_command(argv: list[str]) -> int:
    """``asyncrl sweep SPEC`` submits a sweep and prints its id, trials and first runs; ``show ID`` / ``stop ID``."""
    return _group_command(argv, "sweep", ("show", "stop"), load_sweep, "trials", "show / stop a sweep")


def pipeline_command(argv: list[str]) -> int:
    """``asyncrl pipeline SPEC`` submits a pipeline and prints its id and first run; ``show ID`` / ``stop ID`` /
    ``resume ID``."""
    return _group_command(
        argv, "pipeline", ("show", "stop", "resume"), load_pipeline, "stages", "show / stop / resume a pipeline"
    )


def home_refusal(err: OSError, command: str) -> SpecError | None:
    """The one line for ``err``, an ``OSError`` a server-side ``command`` (``server``, ``worker``, ``token``) met
    opening the service's state: a path in ``ASYNCRL_HOME`` (the SQLite database, the secret key, the broker's and
    beat's files) or the SQLite file of ``DATABASE_URL``, which this user may not write; None for any other path."""
    from server.core.config import settings

    if not isinstance(err, PermissionError | IsADirectoryError | NotADirectoryError) or not err.filename:
        return None
    path = os.path.abspath(os.fsdecode(err.filename))
    home = os.path.abspath(settings.ASYNCRL_HOME)
    url = settings.DATABASE_URL
    database = os.path.abspath(url.removeprefix("sqlite:///").split("?", 1)[0]) if url.startswith("sqlite:///") else ""
    why = f"{path} ({err.strerror or err})"
    if path == home or path.startswith(home.rstrip("/") + "/"):
        return SpecError(
            f"ASYNCRL_HOME: this user cannot use {why}: `asyncrl {command}` opens the service's database and secret "
            f"key in {home}; run it as the user who owns that folder (the service's), or set ASYNCRL_HOME to a folder "
            "you may write (another service)"
        )
    if database and (path == database or path == os.path.dirname(database)):
        return SpecError(
            f"DATABASE_URL: this user cannot use {why}: run `asyncrl {command}` as the user who owns the database "
            "file, or set DATABASE_URL to one you may write"
        )
    return None


def opens_home(command: str, run: Any) -> Any:
    """``run`` (the ``command``'s function), with a permission error on the service's state (:func:`home_refusal`) as
    one line and exit status 2 instead of a traceback: ``asyncrl token create`` as a user who may not write
    ``ASYNCRL_HOME``."""

    def guarded(argv: list[str]) -> int:
        try:
            return int(run(argv))
        except OSError as err:
            if (line := home_refusal(err, command)) is None:
                raise
            raise line from None

    return guarded


COMMANDS: dict[str, Any] = {
    "server": opens_home("server", server_command),
    "worker": opens_home("worker", worker_command),
    "token": opens_home("token", token_command),
    "submit": submit_command,
    "runs": runs_command,
    "sweep": sweep_command,
    "pipeline": pipeline_command,
}
