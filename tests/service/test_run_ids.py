"""A deleted run leaves nothing a later run inherits, on Postgres and on SQLite (embedded mode): ids are never
reused (SQLite ``AUTOINCREMENT``, migration 0006), the deleted run's folder is moved aside, and run tokens are bound
to a random per-run nonce, so a deleted run's token opens no later run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlmodel import Session

from tests.support.server import migrate, spec


def ended(session: Session, run: Any) -> None:
    from server.models import RunStatus
    from server.services import runs

    runs.transition(session, run, RunStatus.starting, reason="test")
    runs.transition(session, run, RunStatus.failed, reason="test")


def delete_then_create(engine: sa.Engine) -> tuple[dict[str, Any], dict[str, Any]]:
    """Create run A with a file in its run directory, end and delete it, then create run B; returns what each was
    (id, run_dir, token) and where A's folder went."""
    from server.core.config import settings
    from server.models import Run
    from server.services import runs, tokens

    with Session(engine) as s:
        a = runs.create(s, data=spec(name="same"), owner="alice")
        s.commit()
        first = {"id": a.id, "run_dir": a.run_dir, "token": tokens.run_token(a), "nonce": a.token_nonce}
        Path(a.run_dir, "checkpoints", "step_5").mkdir(parents=True)
        Path(a.run_dir, "checkpoints", "step_5", "model.bin").write_bytes(b"A's weights")
        ended(s, a)
        runs.delete_run(s, a)
        s.commit()
        b = runs.create(s, data=spec(name="same"), owner="bob")
        s.commit()
        second = {"id": b.id, "run_dir": b.run_dir, "token": tokens.run_token(b)}
        with pytest.raises(tokens.AuthError, match="invalid token"):
            tokens.authenticate(s, first["token"])
        # A's token with B's id (the HMAC of the id alone, as before 0006) opens nothing either
        forged = f"asr_run_{b.id}_{first['token'].rsplit('_', 1)[1]}"
        with pytest.raises(tokens.AuthError, match="invalid token"):
            tokens.authenticate(s, forged)
        assert tokens.authenticate(s, second["token"]).run_id == b.id
        assert s.get(Run, first["id"]) is None
    first["aside"] = Path(settings.ASYNCRL_OUTPUT_DIR) / "deleted-runs" / f"{first['id']}-{first['nonce']}"
    return first, second


def check_nothing_inherited(first: dict[str, Any], second: dict[str, Any]) -> None:
    assert second["id"] > first["id"]
    assert second["run_dir"] != first["run_dir"] and second["token"] != first["token"]
    assert not Path(first["run_dir"]).exists()  # moved aside, not left where a run could find it
    assert (first["aside"] / "same" / "checkpoints" / "step_5" / "model.bin").read_bytes() == b"A's weights"
    assert not Path(second["run_dir"], "checkpoints").exists()


def test_postgres_deleted_run_leaves_nothing_to_a_later_run() -> None:
    from server.core.db import engine

    first, second = delete_then_create(engine)
    check_nothing_inherited(first, second)


@pytest.fixture
def sqlite_engine(tmp_path: Path) -> Iterator[sa.Engine]:
    from server.core.db import make_engine

    url = f"sqlite:///{tmp_path / 'asyncrl.db'}"
    migrate(url)
    eng = make_engine(url)
    yield eng
    eng.dispose()


def test_sqlite_never_reuses_a_deleted_runs_id(sqlite_engine: sa.Engine) -> None:
    first, second = delete_then_create(sqlite_engine)
    check_nothing_inherited(first, second)
    with sqlite_engine.connect() as conn:
        ddl = conn.execute(sa.text("SELECT sql FROM sqlite_master WHERE name = 'runs'")).scalar_one()
    assert "AUTOINCREMENT" in ddl


def test_sqlite_upgrade_to_0006_keeps_every_runs_rows(tmp_path: Path) -> None:
    """The rebuild of ``runs`` (AUTOINCREMENT) drops the old table: with foreign keys on, that would cascade to the
    events; ``migrations/env.py`` turns them off around it. Existing runs get distinct nonces."""
    from server.core.db import make_engine

    url = f"sqlite:///{tmp_path / 'old.db'}"
    migrate(url, "0005_users_roles")
    eng = make_engine(url)
    with eng.begin() as conn:
        for run_id in (1, 2, 3):
            conn.execute(
                sa.text(
                    "INSERT INTO runs (id, name, kind, status, status_reason, spec, spec_hash, owner, run_dir, "
                    "created_at, updated_at) VALUES (:i, 'r', 'rl', 'completed', '', '{}', '', 'me', :d, "
                    "'2026-12-01', '2026-12-01')"
                ),
                {"i": run_id, "d": f"/x/runs/{run_id}/r"},
            )
            for k in range(4):
                conn.execute(
                    sa.text(
                        "INSERT INTO run_events (run_id, time, kind, reason, data) "
                        "VALUES (:i, '2026-12-01', 'status', :r, '{}')"
                    ),
                    {"i": run_id, "r": f"e{k}"},
                )
        conn.execute(sa.text("DELETE FROM runs WHERE id = 3"))  # cascades its 4 events
    eng.dispose()
    migrate(url)
    eng = make_engine(url)
    with eng.begin() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM run_events")).scalar_one() == 8
        nonces = conn.execute(sa.text("SELECT token_nonce FROM runs ORDER BY id")).scalars().all()
        assert len(nonces) == 2 and len(set(nonces)) == 2 and all(len(n) == 32 for n in nonces)
        conn.execute(sa.text("DELETE FROM runs WHERE id = 2"))
        assert conn.execute(sa.text("SELECT count(*) FROM run_events")).scalar_one() == 4  # foreign keys work again
        conn.execute(
            sa.text(
                "INSERT INTO runs (name, kind, status, status_reason, spec, spec_hash, owner, run_dir, token_nonce, "
                "created_at, updated_at) VALUES ('n', 'rl', 'queued', '', '{}', '', 'me', '', 'x', "
                "'2026-12-01', '2026-12-01')"
            )
        )
        assert conn.execute(sa.text("SELECT max(id) FROM runs")).scalar_one() == 3  # not 2 again
    eng.dispose()
    migrate(url, "0005_users_roles", down=True)
    migrate(url)


def test_sqlite_a_locked_run_is_not_changed_under_its_holder(sqlite_engine: sa.Engine) -> None:
    """SQLite has no ``FOR UPDATE``: ``runs.get(lock=True)`` takes the database's write lock, so a launch that read
    the run ``queued`` and records ``starting`` cannot undo the ``failed`` its supervisor reported meanwhile (the
    embedded demo saw a run stay ``starting`` with its supervisor gone). The reporter waits for the launch's commit,
    then finds the run ``starting`` and ends it."""
    import threading

    from server.models import RunStatus
    from server.services import runs

    with Session(sqlite_engine) as s:
        run_id = runs.create(s, data=spec(name="race"), owner="alice").id
        s.commit()
    assert run_id is not None
    order: list[str] = []

    def supervisor_reports_failed() -> None:
        with Session(sqlite_engine) as s:
            run = runs.get(s, run_id, lock=True)  # waits for the launch's commit
            order.append(f"report sees {run.status}")
            runs.transition(s, run, RunStatus.failed, reason="preflight: model.name: missing")
            s.commit()

    with Session(sqlite_engine) as launch:
        run = runs.get(launch, run_id, lock=True)
        assert run.status == "queued"
        reporter = threading.Thread(target=supervisor_reports_failed)
        reporter.start()  # the supervisor it started reports at once
        reporter.join(timeout=1.0)
        assert reporter.is_alive()  # held off by the launch's lock
        order.append("launch records starting")
        runs.transition(launch, run, RunStatus.starting, reason="launched")
        launch.commit()
    reporter.join(timeout=30)
    assert order == ["launch records starting", "report sees starting"]
    with Session(sqlite_engine) as s:
        assert runs.get(s, run_id).status == "failed"
