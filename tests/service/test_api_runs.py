"""REST API: submit, list, show, stop, status reports, events, and bad input (4xx JSON, nothing written)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.support.server import BAD_MODEL, new_token, points, run_token_headers, sft_data, spec


def run_count(client: Any, auth: dict[str, str]) -> int:
    return int(client.get("/api/runs", params={"limit": 1}, headers=auth).json()["count"])


def test_healthz(client: Any) -> None:
    """Without a worker the server still answers 200 (the worker's part: tests/service/test_healthz.py)."""
    resp = client.get("/healthz")
    assert (resp.status_code, resp.json()["database"], resp.json()["broker"]) == (200, "postgresql", "redis")


def test_submit_json_returns_queued_run(client: Any, auth: dict[str, str]) -> None:
    body = spec(trainer={"optim": {"lr": 3e-5}})
    resp = client.post("/api/runs", json=body, headers=auth)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    assert run["status"] == "queued" and run["name"] == body["name"] and run["kind"] == "rl"
    assert run["spec"]["trainer"]["optim"]["lr"] == 3e-5 and len(run["spec_hash"]) == 64
    assert run["run_dir"].endswith(f"runs/{run['id']}/{body['name']}")
    assert client.get(f"/api/runs/{run['id']}", headers=auth).json()["spec_hash"] == run["spec_hash"]
    events = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()
    assert [(e["from_status"], e["to_status"]) for e in events["data"]] == [(None, "queued")]


def test_submit_toml_upload(client: Any, auth: dict[str, str]) -> None:
    toml = f'name = "toml-run"\nmax_steps = 5\n[model]\nname = "{BAD_MODEL}"\n[orchestrator]\ngroup_size = 4\n'
    resp = client.post("/api/runs", files={"file": ("rl.toml", toml.encode(), "application/toml")}, headers=auth)
    assert resp.status_code == 201, resp.text
    assert resp.json()["spec"]["orchestrator"]["group_size"] == 4


def test_a_toml_upload_with_a_byte_order_mark_is_taken(client: Any, auth: dict[str, str]) -> None:
    """An editor's UTF-8 byte order mark before the first key is not part of the spec."""
    toml = f'\ufeffname = "bom-run"\nmax_steps = 5\n[model]\nname = "{BAD_MODEL}"\n'
    resp = client.post("/api/runs", files={"file": ("rl.toml", toml.encode(), "application/toml")}, headers=auth)
    assert resp.status_code == 201, resp.text
    assert resp.json()["name"] == "bom-run"


SPEC_LIMIT = 262_144
"""Largest spec file or pasted spec, in bytes (256 KiB; ``worker.spec.loading.MAX_SPEC_BYTES``)."""
UPLOADS = {  # route -> a valid spec of that route, as TOML
    "/api/runs": f'name = "big-run"\nmax_steps = 3\n[model]\nname = "{BAD_MODEL}"\n',
    "/api/sweeps": f'name = "big-sweep"\n[base]\nname = "b"\nmax_steps = 3\nmodel.name = "{BAD_MODEL}"\n'
    '[grid]\n"trainer.optim.lr" = [1e-4]\n',
    "/api/pipelines": f'name = "big-pipeline"\n[[stages]]\nkind = "rl"\n[stages.base]\nname = "b"\nmax_steps = 3\n'
    f'model.name = "{BAD_MODEL}"\n',
}


def sized(text: str, size: int, fill: str = "x") -> str:
    """``text`` and a comment of ``fill`` characters: ``size`` bytes in all."""
    return text + "# " + fill * (size - len(text.encode()) - 3) + "\n"


def stored() -> tuple[int, int, int]:
    from sqlalchemy import func
    from sqlmodel import Session, select

    from server.core.db import engine
    from server.models import Pipeline, Run, Sweep

    with Session(engine) as s:
        return tuple(int(s.exec(select(func.count()).select_from(m)).one()) for m in (Run, Sweep, Pipeline))  # type: ignore[return-value]


@pytest.mark.parametrize("route", list(UPLOADS))
def test_a_spec_upload_of_256_kib_is_taken_and_one_byte_more_is_413_naming_file(
    client: Any, auth: dict[str, str], route: str
) -> None:
    """The limit is the file's own, whatever the server's ``MAX_BODY_BYTES`` (256 KiB in these tests, so the
    multipart body of a 256 KiB file is larger): 262,144 bytes are created, 262,145 refused by the route, and a
    far larger upload is refused before it is read, with the same line."""
    at_limit = sized(UPLOADS[route], SPEC_LIMIT)
    assert len(at_limit.encode()) == SPEC_LIMIT
    resp = client.post(route, files={"file": ("spec.toml", at_limit.encode())}, headers=auth)
    assert resp.status_code == 201, resp.text
    line = {"detail": "file: larger than 262144 bytes (256 KiB)"}
    for size in (SPEC_LIMIT + 1, 4 * 1024 * 1024):
        before = stored()
        resp = client.post(route, files={"file": ("spec.toml", sized(UPLOADS[route], size).encode())}, headers=auth)
        assert (resp.status_code, resp.json()) == (413, line), size
        assert stored() == before


def test_the_launch_form_takes_a_256_kib_spec_and_refuses_one_byte_more_naming_spec(web: tuple[Any, str]) -> None:
    """The Launch form's pasted spec has the same limit, counted in UTF-8 bytes of the text (URL-encoded, a
    ``#`` is three bytes of the body)."""
    client, csrf = web
    at_limit = sized(UPLOADS["/api/runs"].replace("big-run", "big-launch"), SPEC_LIMIT, fill="#")
    resp = client.post("/launch", data={"csrf": csrf, "spec": at_limit}, follow_redirects=False)
    assert resp.status_code == 303, resp.text[-2000:]
    before = stored()
    resp = client.post("/launch", data={"csrf": csrf, "spec": at_limit + "#"}, follow_redirects=False)
    assert resp.status_code == 413
    assert '<p class="inline-error" role="alert" id="spec-error">spec: larger than 262144 bytes (256 KiB)</p>' in (
        resp.text
    )
    resp = client.post("/launch", data={"csrf": csrf, "spec": at_limit * 4}, follow_redirects=False)
    assert (resp.status_code, resp.json()) == (413, {"detail": "spec: larger than 262144 bytes (256 KiB)"})
    assert stored() == before


def test_list_filters_and_paginates(client: Any, auth: dict[str, str], make_run: Any) -> None:
    made = [make_run(name=f"page-{i}") for i in range(3)]
    page = client.get("/api/runs", params={"name": "page-", "limit": 2}, headers=auth).json()
    assert page["count"] == 3 and [r["id"] for r in page["data"]] == [made[2]["id"], made[1]["id"]]
    rest = client.get("/api/runs", params={"name": "page-", "limit": 2, "offset": 2}, headers=auth).json()
    assert [r["id"] for r in rest["data"]] == [made[0]["id"]]
    client.post(f"/api/runs/{made[0]['id']}/stop", headers=auth)
    cancelled = client.get("/api/runs", params={"name": "page-", "status": "cancelled"}, headers=auth).json()
    assert [r["id"] for r in cancelled["data"]] == [made[0]["id"]]


def test_show_and_list_give_the_trainers_newest_step(client: Any, auth: dict[str, str], make_run: Any) -> None:
    """``step`` is the newest step of the run's trainer metrics (other processes' steps do not count), ``null``
    before the first; ``GET /api/runs/{id}``, the list and a stop's answer all carry it."""
    run_id = make_run(name="stepped")["id"]
    assert client.get(f"/api/runs/{run_id}", headers=auth).json()["step"] is None
    rt = run_token_headers(run_id)
    batch = {"points": points(7) + points(12, name="reward_mean", source="orchestrator")}
    assert client.post(f"/api/runs/{run_id}/metrics", json=batch, headers=rt).is_success
    assert client.get(f"/api/runs/{run_id}", headers=auth).json()["step"] == 6
    listed = client.get("/api/runs", params={"name": "stepped"}, headers=auth).json()["data"]
    assert [(r["id"], r["step"]) for r in listed] == [(run_id, 6)]
    assert client.post(f"/api/runs/{run_id}/stop", headers=auth).json()["step"] == 6


def test_an_sft_runs_step_is_its_sft_trainers_newest(client: Any, auth: dict[str, str], make_run: Any) -> None:
    """An SFT run logs its steps as the ``sft`` source: its ``step`` is theirs (it stayed ``null`` while an SFT
    trained, and the README's submit example promises a step)."""
    run_id = make_run(name="sft-stepped")["id"]
    batch = {"points": points(13, name="loss", source="sft")}
    assert client.post(f"/api/runs/{run_id}/metrics", json=batch, headers=run_token_headers(run_id)).is_success
    assert client.get(f"/api/runs/{run_id}", headers=auth).json()["step"] == 12


def test_status_transitions_are_recorded(client: Any, auth: dict[str, str], make_run: Any) -> None:
    run_id = make_run()["id"]
    rt = run_token_headers(run_id)
    for status in ("starting", "running", "paused", "running", "completed"):
        resp = client.post(f"/api/runs/{run_id}/status", json={"status": status, "reason": f"to {status}"}, headers=rt)
        assert resp.status_code == 200, resp.text
    run = client.get(f"/api/runs/{run_id}", headers=auth).json()
    assert run["status"] == "completed" and run["started_at"] and run["finished_at"]
    events = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    assert [(e["from_status"], e["to_status"]) for e in events] == [
        (None, "queued"),
        ("queued", "starting"),
        ("starting", "running"),
        ("running", "paused"),
        ("paused", "running"),
        ("running", "completed"),
    ]
    assert events[-1]["reason"] == "to completed"
    resp = client.post(f"/api/runs/{run_id}/status", json={"status": "running"}, headers=rt)
    assert resp.status_code == 401
    assert resp.json()["detail"] == f"run {run_id} has ended (completed): its run token no longer writes"
    resp = client.post(f"/api/runs/{run_id}/status", json={"status": "completed"}, headers=rt)
    assert resp.status_code == 200 and resp.json()["status"] == "completed"  # the final report's retry: a no-op
    resp = client.post(f"/api/runs/{run_id}/status", json={"status": "running"}, headers=auth)
    assert resp.status_code == 409 and "completed: cannot go to running" in resp.json()["detail"]
    assert len(client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]) == 6


def test_stop_queued_run_cancels_it(client: Any, auth: dict[str, str], make_run: Any) -> None:
    run_id = make_run()["id"]
    resp = client.post(f"/api/runs/{run_id}/stop", headers=auth)
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled"
    again = client.post(f"/api/runs/{run_id}/stop", headers=auth)
    assert again.status_code == 409 and "cancelled" in again.json()["detail"]


def test_unknown_run_is_404(client: Any, auth: dict[str, str]) -> None:
    resp = client.get("/api/runs/999999", headers=auth)
    assert resp.status_code == 404 and resp.json()["detail"] == "run 999999 not found"


@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        pytest.param(
            spec(trainer={"optim": {"lrr": 1e-4}}),
            422,
            "unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)",
            id="unknown-key",
        ),
        pytest.param(
            spec(max_steps=0), 422, "max_steps: Input should be greater than or equal to 1, got 0", id="bad-value"
        ),
        pytest.param({"name": "x"}, 422, "model: Field required", id="missing-field"),
        pytest.param(
            spec(output_dir="/tmp/mine"),
            422,
            "output_dir: the service chooses the run folder (<ASYNCRL_OUTPUT_DIR>/runs/<id>/<name>); leave output_dir "
            "out of a submitted spec",
            id="output-dir-given",
        ),
        pytest.param(
            spec(max_steps=True),
            422,
            "max_steps: expected an integer (a whole number), got true (a boolean)",
            id="bool-for-int",
        ),
        pytest.param(
            spec(kind="sft", data={"path": "/etc/passwd"}),
            422,
            "data.path: '/etc/passwd' is not allowed in a run submitted to the service; allowed: a path under "
            f"DATA_ROOTS ({os.environ['ASYNCRL_OUTPUT_DIR']}), without '..' or '~'",
            id="sft-data-path-outside-roots",
        ),
        pytest.param(
            spec(kind="sft", data={"path": f"{os.environ['ASYNCRL_OUTPUT_DIR']}/a.jsonl", "eval_path": "~/b.jsonl"}),
            422,
            "data.eval_path: '~/b.jsonl' is not allowed in a run submitted to the service; allowed: a path under "
            f"DATA_ROOTS ({os.environ['ASYNCRL_OUTPUT_DIR']}), without '..' or '~'",
            id="sft-eval-path-home",
        ),
        pytest.param(
            spec(kind="sft", data={"path": f"{os.environ['ASYNCRL_OUTPUT_DIR']}/../x/a.jsonl"}),
            422,
            f"data.path: '{os.environ['ASYNCRL_OUTPUT_DIR']}/../x/a.jsonl' is not allowed in a run submitted to the "
            f"service; allowed: a path under DATA_ROOTS ({os.environ['ASYNCRL_OUTPUT_DIR']}), without '..' or '~'",
            id="sft-data-path-dotdot",
        ),
        pytest.param(
            spec(kind="sft", orchestrator={"batch_size": 4}),
            422,
            "unknown key 'orchestrator' (valid keys here: activation_checkpointing, alerts, attention, ckpt, compile, "
            "data, device, env, eval_examples, eval_interval, kind, launcher, lora, max_steps, model, name, optim, "
            "output_dir, scheduler, seed, seq_len, threads)",
            id="sft-with-rl-key",
        ),
        pytest.param(spec(kind=3), 422, "kind: expected one of ['eval', 'rl', 'sft'], got '3'", id="kind-not-string"),
        pytest.param([1, 2], 422, "body: expected a JSON object (the run spec), got list", id="not-an-object"),
    ],
)
def test_invalid_spec_is_422_naming_the_field(
    client: Any, auth: dict[str, str], body: Any, status: int, detail: str
) -> None:
    before = run_count(client, auth)
    resp = client.post("/api/runs", json=body, headers=auth)
    assert (resp.status_code, resp.json()["detail"]) == (status, detail)
    assert run_count(client, auth) == before


@pytest.mark.parametrize(
    ("kwargs", "status", "detail_start"),
    [
        pytest.param(
            {"content": b'{"name": ', "headers": {"content-type": "application/json"}},
            400,
            "body: not valid JSON",
            id="malformed-json",
        ),
        pytest.param(
            {"content": b"\xff\xfe", "headers": {"content-type": "application/json"}},
            400,
            "body: not valid JSON",
            id="not-utf8",
        ),
        pytest.param(
            {"files": {"file": ("rl.toml", b"name = ", "text/plain")}},
            400,
            "file: rl.toml is not valid TOML",
            id="malformed-toml",
        ),
        pytest.param({"files": {"other": ("rl.toml", b"", "text/plain")}}, 422, "file: upload the spec", id="no-file"),
        pytest.param(
            {"content": b"name: x", "headers": {"content-type": "text/yaml"}},
            415,
            "content-type 'text/yaml'",
            id="wrong-type",
        ),
        pytest.param(
            {"content": json.dumps({"name": "x" * 300_000}).encode(), "headers": {"content-type": "application/json"}},
            413,
            "body: larger than",
            id="oversized",
        ),
    ],
)
def test_unparsable_body_is_4xx(
    client: Any, auth: dict[str, str], kwargs: dict[str, Any], status: int, detail_start: str
) -> None:
    before = run_count(client, auth)
    headers = {**kwargs.pop("headers", {}), **auth}
    resp = client.post("/api/runs", headers=headers, **kwargs)
    assert resp.status_code == status and resp.json()["detail"].startswith(detail_start), resp.text
    assert run_count(client, auth) == before


def test_oversized_chunked_body_is_413(client: Any, auth: dict[str, str]) -> None:
    def chunks() -> Any:
        for _ in range(40):
            yield b" " * 10_000

    resp = client.post("/api/runs", content=chunks(), headers={**auth, "content-type": "application/json"})
    assert resp.status_code == 413


@pytest.mark.parametrize(
    ("headers", "detail"),
    [
        pytest.param({}, "missing token", id="missing"),
        pytest.param({"Authorization": "Token abc"}, "malformed Authorization header", id="wrong-scheme"),
        pytest.param({"Authorization": "Bearer asr_not-a-token"}, "invalid token", id="unknown"),
        pytest.param({"Authorization": "Bearer asr_run_1_" + "0" * 64}, "invalid token", id="forged-run-token"),
    ],
)
def test_missing_or_wrong_token_is_401(client: Any, auth: dict[str, str], headers: dict[str, str], detail: str) -> None:
    before = run_count(client, auth)
    resp = client.post("/api/runs", json=spec(), headers=headers)
    assert resp.status_code == 401 and resp.json()["detail"].startswith(detail)
    assert client.get("/api/runs", headers=headers).status_code == 401
    assert run_count(client, auth) == before


def test_revoked_token_is_401(client: Any) -> None:
    from sqlmodel import Session

    from server.core.db import engine
    from server.services import tokens

    plain = new_token("to-revoke")
    headers = {"Authorization": f"Bearer {plain}"}
    assert client.get("/api/runs", headers=headers).status_code == 200
    with Session(engine) as s:
        assert tokens.revoke(s, name="to-revoke") == 1
        s.commit()
        stored = [t.token_hash for t in s.exec(tokens.select(tokens.ApiToken)).all()]
    assert plain not in stored and tokens.hash_token(plain) in stored  # hashed at rest
    resp = client.get("/api/runs", headers=headers)
    assert resp.status_code == 401 and resp.json()["detail"] == "token 'to-revoke' was revoked"


def test_read_token_reads_but_every_write_is_403(client: Any, auth: dict[str, str], make_run: Any) -> None:
    run_id = make_run()["id"]
    ro = {"Authorization": f"Bearer {new_token('viewer', scope='read')}"}
    before = run_count(client, auth)
    assert client.get("/api/runs", headers=ro).status_code == 200
    assert client.get(f"/api/runs/{run_id}/events", headers=ro).status_code == 200
    writes = [
        ("post", "/api/runs", {"json": spec()}),
        ("post", f"/api/runs/{run_id}/stop", {}),
        ("patch", f"/api/runs/{run_id}/config", {"json": {"changes": {"orchestrator.temperature": 0.9}}}),
        ("post", f"/api/runs/{run_id}/fork", {"json": {}}),
    ]
    for method, url, kw in writes:
        resp = getattr(client, method)(url, headers=ro, **kw)
        assert resp.status_code == 403, (url, resp.text)
        assert resp.json()["detail"] == "token 'viewer' is read-only: it may only read (GET)"
    assert run_count(client, auth) == before
    assert client.get(f"/api/runs/{run_id}", headers=auth).json()["status"] == "queued"


def test_token_scope_must_be_known() -> None:
    with pytest.raises(ValueError, match="scope: expected one of write, read, got 'admin'"):
        new_token("bad-scope", scope="admin")


def test_run_token_reaches_only_its_run(client: Any, auth: dict[str, str], make_run: Any) -> None:
    mine, other = make_run()["id"], make_run()["id"]
    rt = run_token_headers(mine)
    assert client.get(f"/api/runs/{mine}", headers=rt).status_code == 200
    resp = client.post(f"/api/runs/{other}/status", json={"status": "starting"}, headers=rt)
    assert resp.status_code == 403 and resp.json()["detail"] == f"this run token belongs to run {mine}, not run {other}"
    assert client.get(f"/api/runs/{other}/events", headers=rt).status_code == 403
    assert client.post("/api/runs", json=spec(), headers=rt).status_code == 403
    assert client.post(f"/api/runs/{mine}/stop", headers=rt).status_code == 403
    assert client.get("/api/runs", headers=rt).status_code == 403
    assert client.get(f"/api/runs/{other}", headers=auth).json()["status"] == "queued"


def test_openapi_names_operations_by_tag(client: Any) -> None:
    ops = {op["operationId"] for path in client.get("/openapi.json").json()["paths"].values() for op in path.values()}
    assert {"runs-create_run", "runs-list_runs", "metrics-ingest_metrics", "metrics-get_metrics"} <= ops


def test_a_missing_local_model_is_refused_at_submit_and_a_hub_id_is_not(
    client: Any, auth: dict[str, str], tmp_path: Any
) -> None:
    """A model path under a MODEL_ROOTS folder the server sees (here the temporary folder) must be a model folder at
    submit: 422 naming model.name, no run made; a hub id is taken without a look-up."""
    before = run_count(client, auth)
    (tmp_path / "no-config").mkdir()
    for name, why in (
        (str(tmp_path / "typo"), "no such model folder (under MODEL_ROOTS "),
        (str(tmp_path / "no-config"), "not a model folder (no config.json)"),
    ):
        resp = client.post("/api/runs", json=spec(model={"name": name}), headers=auth)
        assert resp.status_code == 422, resp.text
        assert resp.json()["detail"].startswith(f"model.name: {name!r}: {why}")
    assert run_count(client, auth) == before
    hub = client.post("/api/runs", json=spec(model={"name": "Qwen/Qwen3-0.6B"}), headers=auth)
    assert hub.status_code == 201, hub.text


def test_sft_spec_is_queued_as_an_sft_run(client: Any, auth: dict[str, str]) -> None:
    """``kind = "sft"`` goes through the service (issue 22): queued with its data path (under DATA_ROOTS) kept and
    its output_dir set by the service, as an RL run's."""
    data = sft_data()
    resp = client.post("/api/runs", json=spec(kind="sft", data={"path": data}), headers=auth)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    assert (run["kind"], run["status"], run["spec"]["data"]["path"]) == ("sft", "queued", data)
    assert run["spec"]["output_dir"] == f"{os.environ['ASYNCRL_OUTPUT_DIR']}/runs/{run['id']}"
    assert run["run_dir"] == f"{run['spec']['output_dir']}/{run['name']}"


def test_live_config_and_fork_of_an_sft_run_are_refused(client: Any, auth: dict[str, str]) -> None:
    """An SFT run reads its spec once and its checkpoints are not an RL run's: a live config change or a fork of it
    is one 422 line naming ``kind``, and nothing is added."""
    data = sft_data()
    run = client.post("/api/runs", json=spec(kind="sft", data={"path": data}), headers=auth).json()
    before = run_count(client, auth)
    resp = client.patch(f"/api/runs/{run['id']}/config", json={"changes": {"optim.lr": 1e-4}}, headers=auth)
    assert (resp.status_code, resp.json()["detail"]) == (
        422,
        f"kind: live config changes apply to 'rl' runs; run {run['id']} is an 'sft' run",
    )
    resp = client.post(f"/api/runs/{run['id']}/fork", json={"changes": {}}, headers=auth)
    assert (resp.status_code, resp.json()["detail"]) == (
        422,
        f"kind: fork starts an 'rl' run from an 'rl' run's checkpoint; run {run['id']} is an 'sft' run",
    )
    live = client.get(f"/api/runs/{run['id']}/config", headers=auth)  # what its supervisor polls: no live keys
    assert (live.status_code, live.json()["data"], live.json()["values"]) == (200, [], {}), live.text
    events = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
    assert [e["kind"] for e in events] == ["status"]  # queued: no config_revision, no fork
    assert run_count(client, auth) == before


# ----------------------------------------------------------------------------- the broker does not take a launch


@pytest.fixture
def closed_broker(monkeypatch: pytest.MonkeyPatch) -> str:
    """``server.jobs.celery_app``'s Celery app pointed at a closed 127.0.0.1 port (Redis down): every enqueue fails for
    real; returns the broker's message for a launch."""
    from celery import Celery

    from server.jobs import celery_app
    from tests.support.server import free_port

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    monkeypatch.setenv("CELERY_BROKER_URL", url)  # Celery reads it before its broker argument
    monkeypatch.setattr(celery_app, "app", Celery("asyncrl-closed-broker", broker=url))
    return f"the broker {url} did not take the task asyncrl.launch_run: Error 111 connecting to 127.0.0.1:{port}. Connection refused."


def run_named(client: Any, auth: dict[str, str], name: str) -> dict[str, Any]:
    (run,) = client.get("/api/runs", params={"name": name}, headers=auth).json()["data"]
    return dict(run)


def status_events(client: Any, auth: dict[str, str], run_id: int) -> list[tuple[str | None, str | None, str]]:
    data = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    return [(e["from_status"], e["to_status"], e["reason"]) for e in data if e["kind"] == "status"]


def test_a_submit_the_broker_does_not_take_is_503_naming_it_and_the_run_fails(
    client: Any, auth: dict[str, str], closed_broker: str
) -> None:
    body = spec()
    resp = client.post("/api/runs", json=body, headers=auth)
    run = run_named(client, auth, body["name"])
    assert (resp.status_code, resp.json()) == (
        503,
        {"detail": f"{closed_broker}; run {run['id']} failed (not launched)"},
    )
    assert (run["status"], run["status_reason"], run["launcher_handle"]) == (
        "failed",
        f"not launched: {closed_broker}",
        None,
    )
    assert [e[:2] for e in status_events(client, auth, run["id"])] == [(None, "queued"), ("queued", "failed")]


def test_the_launch_form_sweeps_and_pipelines_the_broker_does_not_take_fail_their_runs(
    client: Any, closed_broker: str
) -> None:
    from tests.service.test_sweeps import sweep_spec
    from tests.support.webui import login

    user = f"broker-{os.urandom(3).hex()}"
    auth = {"Authorization": f"Bearer {new_token(user)}"}
    csrf = login(client, new_token(user))
    name = f"form-{os.urandom(3).hex()}"
    page = client.post(
        "/launch", data={"csrf": csrf, "spec": f'name = "{name}"\nmax_steps = 3\nmodel.name = "{BAD_MODEL}"\n'}
    )
    run = run_named(client, auth, name)
    assert page.status_code == 503 and f"{closed_broker}; run {run['id']} failed (not launched)" in page.text
    assert (run["status"], run["status_reason"]) == ("failed", f"not launched: {closed_broker}")

    sweep = sweep_spec(name=f"sw-{os.urandom(3).hex()}", max_parallel=2)
    resp = client.post("/api/sweeps", json=sweep, headers=auth)
    trials = [run_named(client, auth, f"{sweep['name']}-{i}") for i in range(2)]
    assert resp.status_code == 503
    assert resp.json() == {"detail": f"{closed_broker}; run {trials[0]['id']} failed (not launched)"}
    assert [(r["status"], r["status_reason"]) for r in trials] == [("failed", f"not launched: {closed_broker}")] * 2

    pipeline = {"name": f"pl-{os.urandom(3).hex()}", "stages": [{"kind": "rl", "base": spec()}]}
    resp = client.post("/api/pipelines", json=pipeline, headers=auth)
    stage = run_named(client, auth, f"{pipeline['name']}-0")
    assert (resp.status_code, resp.json()) == (
        503,
        {"detail": f"{closed_broker}; run {stage['id']} failed (not launched)"},
    )
    assert (stage["status"], stage["status_reason"]) == ("failed", f"not launched: {closed_broker}")


# ----------------------------------------------------------------------------- NUL characters


@pytest.mark.parametrize(
    ("path", "body", "detail"),
    [
        ("/api/runs", spec(env={"id": "reverse_text", "args": {"a\x00b": 1}}), "env.args: key 'a\\x00b' contains"),
        ("/api/runs", spec(name="a\x00b"), "name: contains"),
        ("/api/runs", {**spec(), "x\x00": 1}, "body: key 'x\\x00' contains"),
        ("/api/webhooks", {"url": "http://127.0.0.1:9/h", "name": "w\x00"}, "name: contains"),
        (
            "/api/alerts/rules",
            {"name": "r\x00", "kind": "threshold", "metric": "loss", "op": ">", "value": 1},
            "name: contains",
        ),
    ],
    ids=["env.args key", "run name", "top-level key", "webhook name", "rule name"],
)
def test_a_nul_character_is_422_naming_the_field_and_stores_nothing(
    client: Any, auth: dict[str, str], path: str, body: dict[str, Any], detail: str
) -> None:
    before = run_count(client, auth)
    resp = client.post(path, json=body, headers=auth)
    assert (resp.status_code, resp.json()) == (
        422,
        {"detail": f"{detail} a NUL character (\\x00), which cannot be stored"},
    )
    assert run_count(client, auth) == before


def test_a_nul_character_in_a_toml_upload_or_a_dashboard_form_is_422_naming_it(
    client: Any, auth: dict[str, str], web: tuple[Any, str]
) -> None:
    toml = f'name = "t"\nmax_steps = 3\nmodel.name = "{BAD_MODEL}"\n[env]\nid = "reverse_text"\nargs = {{ "a\\u0000b" = 1 }}\n'
    resp = client.post("/api/runs", files={"file": ("spec.toml", toml.encode())}, headers=auth)
    line = "env.args: key 'a\\x00b' contains a NUL character (\\x00), which cannot be stored"
    assert (resp.status_code, resp.json()) == (422, {"detail": line})
    form, csrf = web
    resp = form.post("/alerts/webhooks", data={"csrf": csrf, "url": "http://127.0.0.1:9/h", "name": "w\x00"})
    assert (resp.status_code, resp.json()) == (
        422,
        {"detail": "name: contains a NUL character (\\x00), which cannot be stored"},
    )
    page = form.post("/launch", data={"csrf": csrf, "spec": toml})
    assert page.status_code == 422 and "env.args: key &#39;a\\x00b&#39; contains a NUL character" in page.text
