"""Property-based fuzzing of the whole OpenAPI schema (schemathesis): no operation answers 5xx, for every principal.

Every operation of ``/openapi.json`` (:data:`OPERATIONS`, each API route of the app) is fuzzed

- as an admin (:data:`ADMIN_EXAMPLES` examples per operation) and as a second member and a viewer
  (:data:`OTHER_EXAMPLES` each), with random ids;
- on an existing run that has a checkpoint and logs (so resume, fork, logs, config and metrics get past the lookup),
  owned by the admin: as the admin, the second member, the viewer and the run's own token.

An unhandled exception fails the test as a 500 would. :func:`test_every_operation_was_fuzzed_by_every_principal`
checks the counts (it runs last in this module). README "Attacks" records the numbers.
"""

from __future__ import annotations

import json
import secrets
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from server.main import app
from tests.support.server import new_token, run_token_headers
from worker.run.checkpoint import write_part
from worker.run.rundir import RunDir

pytestmark = [pytest.mark.serial, pytest.mark.fuzz]  # scripts/test.sh: one process of its own, beside pass 1

schema = schemathesis.openapi.from_asgi("/openapi.json", app)
OPERATIONS = 50
"""Operations of the schema: every ``/api`` route and ``/healthz`` (the Prometheus ``/metrics`` is not in it)."""
RUN_OPERATIONS = 26
"""Those with a ``{run_id}``."""
ADMIN_EXAMPLES = 25
OTHER_EXAMPLES = 8
ADMIN = settings(max_examples=ADMIN_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
OTHER = settings(max_examples=OTHER_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
CALLS: Counter[tuple[str, str, str]] = Counter()
"""(test, principal, operation label) -> examples sent."""


@pytest.fixture(scope="module")
def principals(auth: dict[str, str]) -> dict[str, dict[str, str]]:
    """Authorization headers: the admin (``auth``), a second member and a viewer."""
    return {
        "admin": auth,
        "member": {"Authorization": f"Bearer {new_token(f'fuzz-member-{secrets.token_hex(3)}', role='member')}"},
        "viewer": {"Authorization": f"Bearer {new_token(f'fuzz-viewer-{secrets.token_hex(3)}', role='viewer')}"},
    }


@pytest.fixture(scope="module")
def existing_run(client: Any, auth: dict[str, str]) -> int:
    from tests.support.server import spec

    resp = client.post("/api/runs", json=spec(max_steps=5), headers=auth)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    rd = RunDir(run["run_dir"])
    rd.create()
    rd.config.write_text(json.dumps(run["spec"]))
    for part in ("trainer", "orchestrator"):
        write_part(rd, 2, part, lambda d: (d / "state.bin").write_bytes(b"x"))
    (rd.logs / "trainer.log").write_text("one\ntwo\n")
    return int(run["id"])


@pytest.fixture(scope="module", autouse=True)
def _drop_fuzzed_alerts() -> Iterator[None]:
    """Rules for every run and webhook endpoints the fuzzer created would apply to later modules' runs: drop them."""
    yield
    from sqlalchemy import delete
    from sqlmodel import Session, col

    from server.alerts.models import AlertRuleRow, WebhookEndpoint
    from server.core.db import engine

    with Session(engine) as s:
        s.execute(delete(AlertRuleRow).where(col(AlertRuleRow.run_id).is_(None)))
        s.execute(delete(WebhookEndpoint))
        s.commit()


def _call(test: str, who: str, case: Any, headers: dict[str, str]) -> None:
    CALLS[(test, who, case.operation.label)] += 1
    case.call_and_validate(headers=headers, checks=[not_a_server_error])


@schema.parametrize()
@ADMIN
def test_no_server_errors_as_admin(case: Any, principals: dict[str, dict[str, str]]) -> None:
    _call("random ids", "admin", case, principals["admin"])


@pytest.mark.parametrize("who", ["member", "viewer"])
@schema.parametrize()
@OTHER
def test_no_server_errors_as_another_user(case: Any, who: str, principals: dict[str, dict[str, str]]) -> None:
    _call("random ids", who, case, principals[who])


@schema.include(path_regex=r"\{run_id\}").parametrize()
@ADMIN
def test_no_server_errors_on_an_existing_run_as_its_admin(
    case: Any, principals: dict[str, dict[str, str]], existing_run: int
) -> None:
    case.path_parameters["run_id"] = existing_run
    _call("existing run", "admin", case, principals["admin"])


@pytest.mark.parametrize("who", ["member", "viewer", "run token"])
@schema.include(path_regex=r"\{run_id\}").parametrize()
@OTHER
def test_no_server_errors_on_an_existing_run_as_another(
    case: Any, who: str, principals: dict[str, dict[str, str]], existing_run: int
) -> None:
    case.path_parameters["run_id"] = existing_run
    _call("existing run", who, case, run_token_headers(existing_run) if who == "run token" else principals[who])


def test_every_operation_was_fuzzed_by_every_principal() -> None:
    """The schema has every API route of the app, and each operation got its examples from every principal (the
    fuzz tests above ran first: pytest runs a module's tests in order)."""
    from fastapi.routing import APIRoute

    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {op.label for op in operations}
    routes = {
        f"{method} {route.path}"
        for route in app.routes
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in route.methods - {"HEAD"}
    }
    assert labels == routes and len(labels) == OPERATIONS
    with_run = {label for label in labels if "{run_id}" in label}
    assert len(with_run) == RUN_OPERATIONS
    expected = {("random ids", who): labels for who in ("admin", "member", "viewer")} | {
        ("existing run", who): with_run for who in ("admin", "member", "viewer", "run token")
    }
    for (test, who), ops in expected.items():
        got = {label: n for (t, w, label), n in CALLS.items() if (t, w) == (test, who)}
        assert set(got) == ops, (test, who, sorted(ops - set(got)))
        least = min(got.values())
        # hypothesis stops early when an operation has fewer distinct inputs (e.g. GET /healthz has none)
        assert least >= 1 and sum(got.values()) >= len(ops) * 3, (test, who, got)
    totals = Counter[str]()
    for (test, who, _), n in CALLS.items():
        totals[f"{test} as {who}"] += n
    print(f"fuzzed {OPERATIONS} operations, {sum(totals.values())} requests: {dict(totals)}")  # noqa: T201 - with -s
