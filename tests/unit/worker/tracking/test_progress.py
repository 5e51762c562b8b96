"""The hang watchdog's stall classification on hand-built progress records (``worker/tracking/progress.py``, cases C18,
C19).

Times are unix seconds around ``NOW``; every run here has a no-progress time of 30 s."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from worker.tracking.progress import (
    NO_PROGRESS_FLOOR_S,
    ProgressRecorder,
    Watchdog,
    classify,
    derived_no_progress_s,
    read_records,
)

NOW = 1_000_000.0
LIMIT = 30.0


def rec(process: str, *, beat: float = 1, progress: float = 40, state: str = "generating", **extra: Any) -> dict:
    """A record written ``beat`` s before NOW whose last progress was ``progress`` s before NOW."""
    return {
        "process": process,
        "pid": 100 if process == "trainer" else 200,
        "started": NOW - 500,
        "time": NOW - beat,
        "progress_time": NOW - progress,
        "counts": {},
        "state": state,
        "state_since": NOW - extra.pop("state_age", 35),
        "detail": extra.pop("detail", {}),
        "calls": extra.pop("calls", {}),
    }


def call(kind: str, age: float, n: int = 1, what: str = "POST /v1/completions") -> dict[str, dict[str, Any]]:
    return {kind: {"in_flight": n, "since": NOW - age, "what": what}}


def check(records: list[dict], **kw: Any) -> Any:
    return classify({r["process"]: r for r in records}, now=NOW, started=NOW - 1000, no_progress_s=LIMIT, **kw)


def test_recent_progress_of_any_process_is_no_stall() -> None:
    records = [rec("trainer", progress=100), rec("orchestrator", progress=29, calls=call("inference", 100))]
    assert check([rec("orchestrator", calls=call("inference", 14))]).component == "unknown"  # 14 s: not yet half
    assert check(records) is None
    # the run started 20 s ago: nothing is stalled yet, whatever the records say
    started = classify(
        {r["process"]: r for r in records}, now=NOW, started=NOW - 20, no_progress_s=LIMIT, inference_answers=False
    )
    assert started is None


def test_no_verdict_while_a_process_is_starting_and_its_start_counts_as_progress() -> None:
    orch = rec("orchestrator", calls=call("inference", 100))
    assert check([orch], alive={"trainer", "orchestrator"}) is None  # the trainer is still loading its model
    trainer = {**rec("trainer", state="waiting_for_batch"), "started": NOW - 20}  # wrote its first record 20 s ago
    assert check([orch, trainer], alive={"trainer", "orchestrator"}) is None
    trainer["started"] = NOW - 31
    assert check([orch, trainer], alive={"trainer", "orchestrator"}).quiet_s == 31.0


def test_inference_not_answering_is_named_from_the_orchestrators_calls() -> None:  # case C18
    records = [
        rec("trainer", state="waiting_for_batch", detail={"step": 3}),
        rec("orchestrator", calls=call("inference", 37, n=4)),
    ]
    found = check(records)
    assert (found.component, found.waiting) == ("inference", "orchestrator")
    assert found.reason == (
        "no progress for 40 s: inference not answering: orchestrator waits, 4 request(s) in flight, the oldest "
        "(POST /v1/completions) for 37 s"
    )
    assert found.event() == {
        "process": "supervisor",
        "component": "inference",
        "waiting": "orchestrator",
        "quiet_s": 40.0,
        "no_progress_s": 30.0,
        "reason": found.reason,
    }


def test_a_failed_health_probe_names_inference_before_the_requests_are_old() -> None:
    records = [rec("trainer", state="waiting_for_batch", detail={"step": 3}), rec("orchestrator")]
    found = check(records, inference_answers=False)
    assert found.component == "inference"
    assert found.reason.endswith("no request in flight; its /health does not answer")
    assert check(records, inference_answers=True).component == "orchestrator"  # it answers: the trainer's wait


def test_environment_stuck_is_named_when_its_calls_are_old() -> None:  # case C18, a stalled environment
    env = call("environment", 36, n=2, what="reverse_text score")
    records = [
        rec("trainer", state="waiting_for_batch", detail={"step": 2}),
        rec("orchestrator", calls={**env, **call("inference", 5)}),  # fresh inference calls: it answers
    ]
    found = check(records)
    assert (found.component, found.waiting) == ("environment", "orchestrator")
    assert found.reason.endswith("environment stuck: 2 call(s) in flight, the oldest (reverse_text score) for 36 s")
    # a call that began after the last progress counts once it lasted half the no-progress time (15 s)
    records[1]["calls"] = call("environment", 16, what="reverse_text score")
    assert check(records).component == "environment"
    records[1]["calls"] = call("environment", 14, what="reverse_text score")
    assert check(records).component == "orchestrator"  # a fresh call: the trainer's wait for its batch


def test_trainer_waiting_for_a_batch_names_the_orchestrator() -> None:
    records = [rec("trainer", state="waiting_for_batch", detail={"step": 5}, state_age=44), rec("orchestrator")]
    found = check(records)
    assert (found.component, found.waiting) == ("orchestrator", "trainer")
    assert found.reason == "no progress for 40 s: trainer waiting for batch 5 for 44 s; orchestrator generating"


def test_orchestrator_waiting_for_a_policy_names_the_trainer() -> None:
    records = [
        rec("trainer", state="training", detail={"step": 4}),
        rec("orchestrator", state="waiting_for_policy", detail={"version": 3}, state_age=50),
    ]
    found = check(records)
    assert (found.component, found.waiting) == ("trainer", "orchestrator")
    assert found.reason == "no progress for 40 s: orchestrator waiting for policy version 3 for 50 s; trainer training"


def test_a_run_held_at_a_hold_step_is_no_stall() -> None:
    held = [rec("trainer", state="held", detail={"step": 2}, state_age=500), rec("orchestrator", state="held")]
    assert check(held) is None  # ckpt.hold_at: it waits to be stopped
    frozen = [rec("trainer", beat=31, state="held", detail={"step": 2}), rec("orchestrator", state="held")]
    assert check(frozen).component == "trainer"  # a heartbeat that stopped still counts


def test_a_frozen_process_comes_first_unless_it_has_exited() -> None:
    records = [
        rec("trainer", beat=31, state="training"),  # its heartbeat stopped (SIGSTOP): frozen
        rec("orchestrator", state="waiting_for_policy", detail={"version": 3}, calls=call("inference", 60)),
    ]
    found = check(records)
    assert (found.component, found.waiting) == ("trainer", "")
    assert (
        found.reason
        == "no progress for 40 s: trainer (pid 100) has not written its progress for 31 s (frozen or stopped)"
    )
    # the trainer exited after its last step (the final eval runs): its old record says nothing
    assert check(records, alive={"orchestrator"}).component == "inference"


def test_a_process_still_starting_is_waited_for_but_its_stuck_calls_are_named() -> None:
    # the fresh-user case: "trainer waiting for batch 1 for 21 s; orchestrator starting" was a false stall
    trainer = rec("trainer", state="waiting_for_batch", detail={"step": 1}, state_age=44)
    orch = rec("orchestrator", state="starting")
    assert check([trainer, orch]) is None
    assert check([rec("trainer", state="starting"), rec("orchestrator", state="waiting_for_policy")]) is None
    # but a warm-up request hung on a server left paused is named while starting (the CI hang of 2026-12-04)
    orch["calls"] = call("inference", 120)
    assert check([trainer, orch]).component == "inference"
    assert check([trainer, rec("orchestrator", state="starting", beat=31)]).component == "orchestrator"  # frozen


def test_an_exiting_process_is_not_frozen_while_the_interpreter_shuts_down(tmp_path: Path) -> None:
    records = [rec("trainer", state="training"), rec("orchestrator", state="exiting", beat=60)]
    assert check(records).component == "unknown"  # not "orchestrator ... has not written its progress for 60 s"
    recorder = ProgressRecorder()
    recorder.start(tmp_path, "orchestrator", interval_s=0.05)
    recorder.finish()
    written = read_records(tmp_path)["orchestrator"]
    time.sleep(0.2)
    assert read_records(tmp_path)["orchestrator"] == written  # the heartbeat stopped with the last record
    assert written["state"] == "exiting"


def test_no_known_wait_is_unknown_with_each_state() -> None:
    found = check([rec("trainer", state="training"), rec("orchestrator", state="eval")])
    assert (found.component, found.reason) == ("unknown", "no progress for 40 s: orchestrator eval, trainer training")


def test_the_derived_no_progress_time_is_ten_median_steps_with_a_floor() -> None:
    assert derived_no_progress_s([]) == NO_PROGRESS_FLOOR_S == 120.0
    assert derived_no_progress_s([2.0, 3.0, 100.0]) == 120.0  # 10 x 3 s = 30 s: the floor
    assert derived_no_progress_s([20.0, 14.0, 13.0, 90.0]) == 170.0  # 10 x median 17 s


def test_the_watchdog_writes_one_event_per_episode(tmp_path: Path) -> None:
    folder = tmp_path / "progress"
    folder.mkdir()

    def write(progress_age: float) -> None:
        record = rec("orchestrator", progress=progress_age, calls=call("inference", progress_age))
        (folder / "orchestrator.json").write_text(json.dumps(record))

    dog = Watchdog(tmp_path, no_progress_s=LIMIT, started=NOW - 1000)
    write(10)
    assert dog.check(now=NOW, step_times=[]) is None
    write(31)
    kind, fields = dog.check(now=NOW, step_times=[])
    assert (kind, fields["component"], fields["quiet_s"]) == ("stalled", "inference", 31.0)
    write(45)
    assert dog.check(now=NOW, step_times=[]) is None  # the same episode: said once
    write(0.5)
    assert dog.check(now=NOW, step_times=[]) == (
        "progress_resumed",
        {"process": "supervisor", "component": "inference", "reason": "progress again after the inference stall"},
    )
    assert dog.check(now=NOW, step_times=[]) is None


def test_the_recorder_writes_calls_counts_and_state(tmp_path: Path) -> None:
    r = ProgressRecorder()
    r.start(tmp_path, "orchestrator", interval_s=3600)  # one write now; the next ones are written by hand
    before = time.time()
    with r.call("inference", "POST /v1/completions"), r.call("inference", "GET /health"):
        with r.call("environment", "reverse_text score"):
            r.state("waiting_for_policy", version=2)
            r.tick("rollout_groups", 3)
            r.write()
    got = read_records(tmp_path)["orchestrator"]
    assert got["counts"] == {"rollout_groups": 3}
    assert (got["state"], got["detail"]) == ("waiting_for_policy", {"version": 2})
    assert {k: v["in_flight"] for k, v in got["calls"].items()} == {"inference": 2, "environment": 1}
    assert got["calls"]["inference"]["what"] == "POST /v1/completions"  # the oldest of the two
    assert got["progress_time"] >= before
    r.write()
    assert read_records(tmp_path)["orchestrator"]["calls"] == {}  # every call ended
    r.stop()


@pytest.mark.parametrize("text", ["", "{", "[]", '{"pid": 1}'])
def test_a_torn_or_foreign_record_is_left_out(tmp_path: Path, text: str) -> None:
    (tmp_path / "progress").mkdir()
    (tmp_path / "progress" / "trainer.json").write_text(text)
    assert read_records(tmp_path) == {}
