"""The fault matrix of issue 16 on one real run: every process of the run and every service it depends on killed
with SIGKILL while it trains (``tests/support/fault_matrix.py`` runs and measures the cells).

The stack is the test's own (``tests/support/faults.py``): a Postgres and a Redis started for it on free ports (never
the shared ones), ``asyncrl server`` and ``asyncrl worker`` (Celery with embedded beat, reconcile every 2 s) on them.
The run: reverse-text on the tiny random model, 4 prompts x 4 samples, 16 tokens, a checkpoint every 2 steps,
``max_async_level`` 1 (the shipped config's).

- The Celery worker, the API server, Postgres and Redis, each killed and restarted after 5 s: the run goes on with
  the same processes, every point written meanwhile is stored once recovered, and nothing of the killed service is
  left (Postgres' backends, Celery's pool and beat end with their parent).
- Trainer, orchestrator, vLLM and the supervisor, each killed one step after a checkpoint: the run is ``failed``
  within seconds (by its supervisor; by the worker's reconcile when the supervisor itself died), no process of it is
  left, and ``POST /resume`` continues it from the checkpoint, losing only the steps after it.
- The run completes: its stored metric points equal the points of its ``metrics.jsonl``, each trainer step once.

``benchmarks/fault_matrix.py`` runs the same cells and writes the README's table. About 10 minutes on 2 cores (491-581 s
beside other jobs; five launches of vLLM, trainer and orchestrator: the first and one per resume).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fault_matrix import PROCESSES, SERVICES, FaultMatrix, table
from tests.support.faults import Stack, new_root, remove
from tests.support.runs import small_spec

pytestmark = [pytest.mark.vllm, pytest.mark.fault_matrix]
MAX_STEPS = 150
"""Enough for the service cells (40-60 steps in three runs on the 2-core box) and the four process cells after
them (2-4 steps each), with room for a faster machine."""
DETECT_S = {"trainer": 15.0, "orchestrator": 15.0, "inference": 15.0, "supervisor": 10.0}
"""Bounds on the time to detect a killed process (measured: 0.8-2.7 s): the supervisor polls its processes every
0.5 s, stops the others (SIGTERM, at most 10 s each before SIGKILL) and reports; a dead supervisor is found by the
next reconcile (every 2 s here, ``RECONCILE_INTERVAL_S``)."""


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    root = new_root()
    st = Stack(root, reconcile_s=2.0)
    try:
        yield st.start()
    finally:
        st.close()
        remove(root)


def test_every_process_and_service_killed_mid_run_loses_no_metric_point(stack: Stack, model: Path) -> None:
    matrix = FaultMatrix(stack, stack.token(), small_spec(model, "fault-matrix", max_steps=MAX_STEPS), say=print)
    matrix.submit()
    for name in SERVICES:
        cell = matrix.service_cell(name)
        assert (cell.points_lost, cell.points_duplicated, cell.processes_left) == (0, 0, 0), cell
        assert (cell.steps_lost, cell.outcome) == (0, "run went on with the same processes"), cell
        assert cell.recover_s < 60, cell
        if name != "worker":  # a dead worker is nothing a run notices; the others are seen at once
            assert cell.detect_s is not None and cell.detect_s < matrix.down_s, cell
    for name in PROCESSES:
        cell = matrix.process_cell(name)
        assert (cell.points_lost, cell.points_duplicated, cell.processes_left) == (0, 0, 0), cell
        assert cell.detect_s is not None and cell.detect_s < DETECT_S[name], cell
        # killed one step after a checkpoint: that step, and at most one more in flight, are trained again (0 when
        # the trainer still finished the next step and its checkpoint, as after the orchestrator or vLLM died)
        assert 0 <= cell.steps_lost <= 2, cell
        by = "worker reconcile: supervisor" if name == "supervisor" else f"supervisor: {name} exited"
        assert cell.detected_by.startswith(by), cell

    final = matrix.finish()
    print(table(matrix.cells, final))  # noqa: T201 - the measured table (-s shows it)
    assert (final["status"], final["points_lost"], final["points_extra"], final["points_duplicated"]) == (
        "completed",
        0,
        0,
        0,
    ), final
    assert final["points_stored"] == final["points_written"] > 0
    assert final["trainer_steps"] == list(range(1, MAX_STEPS + 1))  # every step once
    assert final["processes_left"] == 0
    assert final["statuses"] == ["queued", "starting", "running"] + ["failed", "queued", "starting", "running"] * 4 + [
        "completed"
    ]
