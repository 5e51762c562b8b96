"""Who may do what (``server/services/permissions.py``), through the REST API and the dashboard alike: a member
cannot change another's run, an admin can, a viewer only reads; a run token writes only while its run is live;
logout and token revocation end dashboard sessions at once."""

from __future__ import annotations

import re
import secrets
from typing import Any

import pytest

from tests.service.test_lifecycle import checkpoint, set_status
from tests.support.server import new_token, run_token_headers, spec
from tests.support.webui import csrf_of, login


def _user(role: str, scope: str = "write") -> tuple[str, dict[str, str]]:
    name = f"{role}-{secrets.token_hex(3)}"
    return name, {"Authorization": f"Bearer {new_token(name, scope=scope, role=role)}"}


@pytest.fixture(scope="module")
def alice() -> tuple[str, dict[str, str]]:
    return _user("member")


@pytest.fixture(scope="module")
def bob() -> tuple[str, dict[str, str]]:
    return _user("member")


@pytest.fixture(scope="module")
def admin() -> tuple[str, dict[str, str]]:
    return _user("admin")


@pytest.fixture(scope="module")
def viewer() -> tuple[str, dict[str, str]]:
    return _user("viewer")


def _run(client: Any, headers: dict[str, str], *statuses: str) -> dict[str, Any]:
    resp = client.post("/api/runs", json=spec(), headers=headers)
    assert resp.status_code == 201, resp.text
    run = dict(resp.json())
    set_status(client, run["id"], *statuses)
    return run


def _rule() -> dict[str, Any]:
    return {"kind": "threshold", "metric": "loss", "op": ">", "value": 5.0}


def _run_writes(run_id: int, rule_id: int) -> list[tuple[str, str, dict[str, Any] | None, str]]:
    """(method, path, JSON body, verb of the refusal) of every API write on one run."""
    return [
        ("POST", f"/api/runs/{run_id}/stop", None, "stop it"),
        ("DELETE", f"/api/runs/{run_id}", None, "delete it"),
        ("POST", f"/api/runs/{run_id}/resume", None, "resume it"),
        ("POST", f"/api/runs/{run_id}/fork", {"changes": {"max_steps": 4}}, "fork from it"),
        ("PATCH", f"/api/runs/{run_id}/config", {"changes": {"trainer.optim.lr": 5e-5}}, "change its live config"),
        ("POST", f"/api/runs/{run_id}/alerts/rules", _rule(), "change its alert rules"),
        ("PATCH", f"/api/alerts/rules/{rule_id}", {"enabled": False}, "change its alert rules"),
        ("DELETE", f"/api/alerts/rules/{rule_id}", None, "change its alert rules"),
        ("POST", f"/api/runs/{run_id}/status", {"status": "paused"}, "report its status"),
        ("POST", f"/api/runs/{run_id}/requeued", {"restarts": 1, "job": "7"}, "report its status"),
        (
            "POST",
            f"/api/runs/{run_id}/metrics",
            {"points": [{"source": "trainer", "step": 1, "name": "loss", "value": 1.0, "time": 1.0}]},
            "write its metrics",
        ),
    ]


def test_a_member_cannot_change_anothers_run_through_any_api_route(client: Any, alice: Any, bob: Any) -> None:
    owner, alice_h = alice
    _, bob_h = bob
    run = _run(client, alice_h, "starting", "running")
    rule = client.post(f"/api/runs/{run['id']}/alerts/rules", json=_rule(), headers=alice_h)
    assert rule.status_code == 201, rule.text
    before = client.get(f"/api/runs/{run['id']}/config", headers=alice_h).json()
    for method, path, body, verb in _run_writes(run["id"], rule.json()["id"]):
        resp = client.request(method, path, json=body, headers=bob_h)
        assert resp.status_code == 403, (method, path, resp.text)
        assert resp.json() == {
            "detail": f"run {run['id']} belongs to {owner}: only its owner or an admin may {verb}"
        }, (method, path)
    # nothing changed: status, config, rules, metrics, no fork
    assert client.get(f"/api/runs/{run['id']}", headers=bob_h).json()["status"] == "running"
    assert client.get(f"/api/runs/{run['id']}/config", headers=bob_h).json() == before
    rules = client.get(f"/api/runs/{run['id']}/alerts/rules", headers=bob_h).json()["data"]
    assert [r["id"] for r in rules if r["run_id"] == run["id"]] == [rule.json()["id"]] and rules[0]["enabled"]
    series = client.get(f"/api/runs/{run['id']}/metrics", params={"name": "loss"}, headers=bob_h).json()["series"]
    assert series == []
    assert client.get("/api/runs", params={"name": run["name"]}, headers=bob_h).json()["count"] == 1
    # reads stay open to every user
    for path in ("", "/events", "/config", "/alerts/rules"):
        assert client.get(f"/api/runs/{run['id']}{path}", headers=bob_h).status_code == 200, path


def test_the_owner_and_an_admin_can(client: Any, alice: Any, admin: Any) -> None:
    owner, alice_h = alice
    admin_name, admin_h = admin
    for who, h in ((owner, alice_h), (admin_name, admin_h)):
        run = _run(client, alice_h, "starting", "running")
        resp = client.patch(f"/api/runs/{run['id']}/config", json={"changes": {"trainer.optim.lr": 5e-5}}, headers=h)
        assert resp.status_code == 201 and resp.json()["created_by"] == who, resp.text
        rule = client.post(f"/api/runs/{run['id']}/alerts/rules", json=_rule(), headers=h)
        assert rule.status_code == 201, rule.text
        assert client.patch(f"/api/alerts/rules/{rule.json()['id']}", json={"enabled": False}, headers=h).is_success
        assert client.delete(f"/api/alerts/rules/{rule.json()['id']}", headers=h).status_code == 204
        resp = client.post(f"/api/runs/{run['id']}/stop", headers=h)
        assert resp.status_code == 200, resp.text
        set_status(client, run["id"], "cancelled")  # what the stopped supervisor reports
        checkpoint(run, 2)
        resp = client.post(f"/api/runs/{run['id']}/fork", json={"changes": {"max_steps": 4}}, headers=h)
        assert resp.status_code == 201 and resp.json()["owner"] == who, resp.text  # a fork is the forker's
        resp = client.post(f"/api/runs/{run['id']}/resume", headers=h)
        assert resp.status_code == 200 and resp.json()["status"] == "queued", resp.text
        assert resp.json()["owner"] == owner


def test_the_owner_or_an_admin_deletes_an_ended_run(client: Any, alice: Any, bob: Any, admin: Any) -> None:
    owner, alice_h = alice
    for h in (alice_h, admin[1]):
        run = _run(client, alice_h, "starting", "running")
        resp = client.delete(f"/api/runs/{run['id']}", headers=h)
        assert resp.status_code == 409 and resp.json() == {
            "detail": f"run {run['id']} is running: only completed, failed or cancelled runs are deleted; stop it first"
        }
        point = {"source": "trainer", "step": 1, "name": "loss", "value": 1.0, "time": 1.0}
        rt = run_token_headers(run["id"])
        assert client.post(f"/api/runs/{run['id']}/metrics", json={"points": [point]}, headers=rt).is_success
        set_status(client, run["id"], "completed")
        assert client.delete(f"/api/runs/{run['id']}", headers=bob[1]).status_code == 403
        assert client.delete(f"/api/runs/{run['id']}", headers=h).status_code == 204
        assert client.get(f"/api/runs/{run['id']}", headers=h).status_code == 404
        assert client.get(f"/api/runs/{run['id']}/metrics", params={"name": "loss"}, headers=h).status_code == 404
    # and through the dashboard, back to the runs list
    run = _run(client, alice_h, "starting", "running", "failed")
    csrf = login(client, new_token(owner, role="member"))
    assert 'id="delete"' in client.get(f"/runs/{run['id']}").text
    resp = client.post(f"/runs/{run['id']}/delete", data={"csrf": csrf}, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == "/runs"
    assert client.get(f"/api/runs/{run['id']}", headers=alice_h).status_code == 404


def test_a_viewer_gets_403_on_every_write_and_reads(client: Any, alice: Any, viewer: Any) -> None:
    _, alice_h = alice
    name, viewer_h = viewer
    run = _run(client, alice_h, "starting", "running")
    rule = client.post("/api/alerts/rules", json=_rule(), headers=alice_h).json()
    writes = [(m, p, b) for m, p, b, _ in _run_writes(run["id"], rule["id"])] + [
        ("POST", "/api/runs", spec()),
        ("POST", "/api/alerts/rules", _rule()),
        ("PATCH", f"/api/alerts/rules/{rule['id']}", {"enabled": False}),
        ("DELETE", f"/api/alerts/rules/{rule['id']}", None),
        ("POST", "/api/webhooks", {"url": "http://127.0.0.1:9/hook"}),
        ("DELETE", "/api/webhooks/1", None),
        ("POST", "/api/deliveries/1/replay", None),
    ]
    for method, path, body in writes:
        resp = client.request(method, path, json=body, headers=viewer_h)
        assert resp.status_code == 403, (method, path, resp.text)
        assert resp.json() == {"detail": f"user '{name}' is a viewer: viewers may only read"}, (method, path)
    for path in (f"/api/runs/{run['id']}", "/api/runs", "/api/alerts/rules", f"/api/runs/{run['id']}/config"):
        assert client.get(path, headers=viewer_h).status_code == 200, path
    # a global rule left behind would apply to later modules' runs
    assert client.delete(f"/api/alerts/rules/{rule['id']}", headers=alice_h).status_code == 204


def test_global_rules_and_webhooks_belong_to_who_added_them(
    client: Any, alice: Any, bob: Any, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.core.config import settings

    monkeypatch.setattr(settings, "WEBHOOK_ALLOW_PRIVATE", True)  # a loopback receiver URL
    owner, alice_h = alice
    _, bob_h = bob
    _, admin_h = admin
    rules = [client.post("/api/alerts/rules", json=_rule(), headers=alice_h).json()["id"] for _ in range(2)]
    hooks = [
        client.post("/api/webhooks", json={"url": "http://127.0.0.1:9/hook"}, headers=alice_h).json()["id"]
        for _ in range(2)
    ]
    refusals = [
        ("PATCH", f"/api/alerts/rules/{rules[0]}", {"enabled": False}, f"global alert rule {rules[0]}", "change it"),
        ("DELETE", f"/api/alerts/rules/{rules[0]}", None, f"global alert rule {rules[0]}", "delete it"),
        ("DELETE", f"/api/webhooks/{hooks[0]}", None, f"webhook endpoint {hooks[0]}", "delete it"),
    ]
    shown = {w["id"]: w["url"] for w in client.get("/api/webhooks", headers=bob_h).json()["data"]}
    assert shown[hooks[0]] == "http://127.0.0.1:9/…"  # another's URL path may be a credential
    assert client.get(f"/api/webhooks/{hooks[0]}", headers=bob_h).json()["url"] == "http://127.0.0.1:9/…"
    for h in (alice_h, admin_h):
        assert client.get(f"/api/webhooks/{hooks[0]}", headers=h).json()["url"] == "http://127.0.0.1:9/hook"
    for method, path, body, what, verb in refusals:
        resp = client.request(method, path, json=body, headers=bob_h)
        assert resp.status_code == 403, (path, resp.text)
        assert resp.json() == {"detail": f"{what} belongs to {owner}: only its owner or an admin may {verb}"}
    assert client.delete(f"/api/alerts/rules/{rules[0]}", headers=alice_h).status_code == 204
    assert client.delete(f"/api/alerts/rules/{rules[1]}", headers=admin_h).status_code == 204
    assert client.delete(f"/api/webhooks/{hooks[0]}", headers=alice_h).status_code == 204
    assert client.delete(f"/api/webhooks/{hooks[1]}", headers=admin_h).status_code == 204


def test_a_run_token_writes_only_while_its_run_is_live(client: Any, alice: Any) -> None:
    _, alice_h = alice
    for final in ("completed", "failed", "cancelled"):
        run = _run(client, alice_h, "starting", "running")
        rev = client.patch(
            f"/api/runs/{run['id']}/config", json={"changes": {"trainer.optim.lr": 5e-5}}, headers=alice_h
        ).json()["revision"]
        rt = run_token_headers(run["id"])
        point = {"source": "trainer", "step": 1, "name": "loss", "value": 1.0, "time": 1.0}
        # the supervisor's end: spooled metrics and acks first, then the final status; all taken
        assert client.post(f"/api/runs/{run['id']}/metrics", json={"points": [point]}, headers=rt).json() == {
            "received": 1,
            "inserted": 1,
        }
        ack = {"process": "trainer", "step": 1}
        assert client.post(f"/api/runs/{run['id']}/config/{rev}/ack", json=ack, headers=rt).status_code == 200
        set_status(client, run["id"], final)
        ended = {"detail": f"run {run['id']} has ended ({final}): its run token no longer writes"}
        for method, path, body in (
            ("POST", f"/api/runs/{run['id']}/metrics", {"points": [{**point, "step": 2}]}),
            ("POST", f"/api/runs/{run['id']}/config/{rev}/ack", {"process": "orchestrator", "step": 1}),
            ("POST", f"/api/runs/{run['id']}/status", {"status": "running"}),
            ("POST", f"/api/runs/{run['id']}/requeued", {"restarts": 1, "job": "7"}),
        ):
            resp = client.request(method, path, json=body, headers=rt)
            assert resp.status_code == 401 and resp.json() == ended, (path, resp.text)
        series = client.get(f"/api/runs/{run['id']}/metrics", params={"name": "loss"}, headers=alice_h).json()
        assert [s["step"] for s in series["series"]] == [[1]]
        applied = client.get(f"/api/runs/{run['id']}/config", headers=alice_h).json()["data"][0]["applied"]
        assert applied == {"trainer": 1}
        # reads of its own run stay open (the final report's retry polls the config), another run's do not
        assert client.get(f"/api/runs/{run['id']}/config", headers=rt).status_code == 200
        assert client.get(f"/api/runs/{run['id'] + 1}/config", headers=rt).status_code == 403


# ----------------------------------------------------------------------------- dashboard


def _forms(run_id: int) -> list[tuple[str, dict[str, str]]]:
    return [
        (f"/runs/{run_id}/stop", {}),
        (f"/runs/{run_id}/resume", {}),
        (f"/runs/{run_id}/fork", {"changes": "max_steps = 4"}),
        (f"/runs/{run_id}/config", {"trainer.optim.lr": "0.5", "confirm": "1"}),
        (f"/runs/{run_id}/delete", {}),
    ]


def test_dashboard_forms_of_anothers_run_are_403_and_hidden(client: Any, alice: Any, admin: Any) -> None:
    owner, alice_h = alice
    run = _run(client, alice_h, "starting", "running")
    csrf = login(client, new_token(f"bob-{secrets.token_hex(3)}", role="member"))
    page = client.get(f"/runs/{run['id']}").text
    for needle in ('id="stop"', 'id="fork"', 'id="config-form"', "Review change"):
        assert needle not in page, needle
    assert f"only the owner {owner} or an admin changes them" in page
    verbs = ["stop it", "resume it", "fork from it", "change its live config", "delete it"]
    for (url, data), verb in zip(_forms(run["id"]), verbs, strict=True):
        resp = client.post(url, data={"csrf": csrf, **data})
        assert resp.status_code == 403, (url, resp.text)
        assert resp.json() == {"detail": f"run {run['id']} belongs to {owner}: only its owner or an admin may {verb}"}
        html = client.post(url, data={"csrf": csrf, **data}, headers={"Accept": "text/html"})
        assert html.status_code == 403 and 'id="page-error"' in html.text
    rule = client.post(f"/api/runs/{run['id']}/alerts/rules", json=_rule(), headers=alice_h).json()
    for url, data in (
        ("/alerts/rules", {"scope": str(run["id"]), "kind": "threshold", "metric": "loss", "op": ">", "value": "1"}),
        (f"/alerts/rules/{rule['id']}/enabled", {"enabled": "0"}),
        (f"/alerts/rules/{rule['id']}/threshold", {"value": "2"}),
    ):
        resp = client.post(url, data={"csrf": csrf, **data})
        assert resp.status_code == 403 and resp.json()["detail"].endswith("may change its alert rules"), url
    alerts = client.get("/alerts", params={"run": run["id"]}).text
    assert f'action="/alerts/rules/{rule["id"]}/enabled"' not in alerts
    assert client.get(f"/api/runs/{run['id']}", headers=alice_h).json()["status"] == "running"
    assert client.get(f"/api/runs/{run['id']}/config", headers=alice_h).json()["revision"] == 0
    # the owner sees the forms and may use them
    csrf = login(client, new_token(owner, role="member"))
    page = client.get(f"/runs/{run['id']}").text
    assert 'id="stop"' in page and 'id="config-form"' in page
    assert f'action="/alerts/rules/{rule["id"]}/enabled"' in client.get("/alerts", params={"run": run["id"]}).text
    resp = client.post(f"/runs/{run['id']}/stop", data={"csrf": csrf}, follow_redirects=False)
    assert resp.status_code == 303
    # and so does an admin
    csrf = login(client, admin[1]["Authorization"].removeprefix("Bearer "))
    other = _run(client, alice_h, "starting", "running")
    assert 'id="stop"' in client.get(f"/runs/{other['id']}").text
    resp = client.post(f"/runs/{other['id']}/stop", data={"csrf": csrf}, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == f"/runs/{other['id']}"


def test_a_viewer_sees_no_write_form_and_every_dashboard_post_is_403(client: Any, alice: Any) -> None:
    _, alice_h = alice
    run = _run(client, alice_h, "starting", "running")
    name = f"viewer-{secrets.token_hex(3)}"
    csrf = login(client, new_token(name, role="viewer"))
    for path in (f"/runs/{run['id']}", "/alerts", "/runs"):
        page = client.get(path).text
        assert not re.findall(r'<form method="post" action="(?!/logout)', page), path
    assert 'href="/launch"' not in client.get("/runs").text
    assert client.get("/launch").status_code == 403
    for url, data in [
        *_forms(run["id"]),
        ("/launch", {"spec": 'name = "x"'}),
        ("/alerts/rules", {"kind": "threshold", "metric": "loss", "op": ">", "value": "1"}),
        ("/alerts/webhooks", {"url": "http://127.0.0.1:9/hook"}),
    ]:
        resp = client.post(url, data={"csrf": csrf, **data})
        assert resp.status_code == 403, (url, resp.text)
        assert resp.json() == {"detail": f"user '{name}' is a viewer: viewers may only read"}, url


def test_a_logged_out_cookie_gets_the_login_page(client: Any) -> None:
    csrf = login(client, new_token(f"web-{secrets.token_hex(3)}"))
    old = client.cookies.get("asyncrl_session")
    assert client.get("/runs", follow_redirects=False).status_code == 200
    assert client.post("/logout", data={"csrf": csrf}, follow_redirects=False).headers["location"] == "/login"
    client.cookies.clear()
    resp = client.get("/runs", headers={"Cookie": f"asyncrl_session={old}"}, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == "/login?next=%2Fruns"
    resp = client.post(
        "/launch",
        data={"csrf": csrf, "spec": 'name = "x"'},
        headers={"Cookie": f"asyncrl_session={old}"},
        follow_redirects=False,
    )
    assert resp.status_code == 303 and resp.headers["location"] == "/login?next=%2Flaunch"


def test_revoking_a_token_ends_its_sessions(client: Any, session: Any) -> None:
    from sqlmodel import col, func, select

    from server.models import ApiToken, DashboardSession
    from server.services import tokens

    name = f"web-{secrets.token_hex(3)}"
    login(client, new_token(name))
    assert client.get("/runs", follow_redirects=False).status_code == 200
    count = (
        select(func.count())
        .select_from(DashboardSession)
        .join(ApiToken, col(ApiToken.id) == col(DashboardSession.token_id))
        .where(ApiToken.name == name)
    )
    assert session.exec(count).one() == 1
    assert tokens.revoke(session, name=name) == 1
    session.commit()
    assert session.exec(count).one() == 0
    resp = client.get("/runs", follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == "/login?next=%2Fruns"


def test_a_role_change_takes_effect_on_the_next_request(client: Any, session: Any, alice: Any) -> None:
    from server.services import tokens

    _, alice_h = alice
    run = _run(client, alice_h, "starting", "running")
    name, h = _user("member")
    assert client.post(f"/api/runs/{run['id']}/stop", headers=h).status_code == 403
    tokens.set_role(session, name=name, role="admin")
    session.commit()
    assert client.post(f"/api/runs/{run['id']}/stop", headers=h).status_code == 200
    tokens.set_role(session, name=name, role="viewer")
    session.commit()
    assert client.post("/api/runs", json=spec(), headers=h).status_code == 403
    with pytest.raises(ValueError, match=r"^role: expected one of admin, member, viewer, got 'root'$"):
        tokens.set_role(session, name=name, role="root")
    with pytest.raises(ValueError, match=rf"^role: user '{name}' is already viewer; change a role with "):
        tokens.create(session, name=name, role="member")


def test_login_page_after_logout_shows_the_form(client: Any) -> None:
    csrf = login(client, new_token(f"web-{secrets.token_hex(3)}"))
    client.post("/logout", data={"csrf": csrf})
    page = client.get("/login").text
    assert 'name="token"' in page and csrf_of(page) != csrf
