"""``asyncrl rl``'s console (worker/tracking/console.py): the step lines everywhere, a progress bar with reward,
tokens/s and time left only on a terminal (a pseudo-terminal here), nothing when quiet."""

from __future__ import annotations

import io
import os
import pty
import re

from worker.tracking.console import RunConsole, step_line

ORCH = {"reward_mean": 0.5, "staleness_mean": 0.25, "staleness_max": 1, "dropped_stale": 0, "wait_for_policy_s": 0.0}
TRAINER = {"loss": -0.0123, "mismatch_kl": 2.5e-5, "wait_for_batch_s": 1.5, "tokens_per_s": 1834.4}
LINE = (
    "step    2/3 | reward 0.500 | loss -0.0123 | mismatch_kl 2.5e-05 | stale 0.2/1 drop 0 | wait_for_batch 1.50s "
    "wait_for_policy 0.00s | 1834 tok/s"
)


def test_the_step_line_by_hand_and_dashes_for_missing_metrics() -> None:
    assert step_line(2, 3, ORCH, TRAINER) == LINE
    assert step_line(1, 3, {}, {}).startswith("step    1/3 | reward - | loss - | mismatch_kl - | stale -/- drop -")


def test_not_a_terminal_prints_the_lines_alone() -> None:
    out = io.StringIO()
    with RunConsole(3, start=1, stream=out) as say:
        say("run r: /tmp/r")
        say.step(2, ORCH, TRAINER)
    assert say.progress is None
    assert out.getvalue() == f"run r: /tmp/r\n{LINE}\n"


def test_quiet_prints_nothing() -> None:
    out = io.StringIO()
    with RunConsole(3, quiet=True, stream=out) as say:
        say("x")
        say.step(1, ORCH, TRAINER)
    assert out.getvalue() == ""


def test_a_terminal_gets_a_bar_with_step_reward_tokens_and_time_left() -> None:
    master, slave = pty.openpty()
    stream = os.fdopen(slave, "w", encoding="utf-8")
    try:
        with RunConsole(3, start=1, stream=stream) as say:
            assert say.progress is not None
            say("run r: /tmp/r")
            say.step(2, ORCH, TRAINER)
        stream.flush()
        raw = b""
        os.set_blocking(master, False)
        while True:
            try:
                chunk = os.read(master, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            raw += chunk
    finally:
        stream.close()
        os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode("utf-8", "replace"))
    assert "run r: /tmp/r" in text and LINE in text
    last_bar = [line for line in text.replace("\r", "\n").splitlines() if line.startswith("step ") and "left" in line][
        -1
    ]
    assert "2/3" in last_bar and "reward 0.500" in last_bar and "1834 tok/s" in last_bar
