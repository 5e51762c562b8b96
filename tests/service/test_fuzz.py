"""Property-based fuzzing of the OpenAPI spec (schemathesis) with a valid user token: no operation answers 5xx,
neither for random ids nor on an existing run that has a checkpoint and logs (so resume, fork, logs, config and
metrics get past the lookup). An unhandled exception fails the test as a 500 would."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from server.main import app
from worker.checkpoint import write_part
from worker.rundir import RunDir

schema = schemathesis.openapi.from_asgi("/openapi.json", app)
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def existing_run(make_module_run: Any) -> int:
    run = make_module_run()
    rd = RunDir(run["run_dir"])
    rd.create()
    rd.config.write_text(json.dumps(run["spec"]))
    for part in ("trainer", "orchestrator"):
        write_part(rd, 2, part, lambda d: (d / "state.bin").write_bytes(b"x"))
    (rd.logs / "trainer.log").write_text("one\ntwo\n")
    return int(run["id"])


@pytest.fixture(scope="module")
def make_module_run(client: Any, auth: dict[str, str]) -> Any:
    from tests.support.server import spec

    def make() -> dict[str, Any]:
        resp = client.post("/api/runs", json=spec(max_steps=5), headers=auth)
        assert resp.status_code == 201, resp.text
        return dict(resp.json())

    return make


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


@schema.parametrize()
@FUZZ
def test_no_server_errors(case: Any, auth: dict[str, str]) -> None:
    case.call_and_validate(headers=auth, checks=[not_a_server_error])


@schema.include(path_regex=r"\{run_id\}").parametrize()
@FUZZ
def test_no_server_errors_on_an_existing_run(case: Any, auth: dict[str, str], existing_run: int) -> None:
    case.path_parameters["run_id"] = existing_run
    case.call_and_validate(headers=auth, checks=[not_a_server_error])
