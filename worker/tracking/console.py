"""What ``asyncrl rl`` and ``asyncrl sft`` print while their run goes: their lines (an RL run's per step, eval and
warning; an SFT run's every 20 steps and at evals); on a terminal also a progress bar under them (step of
``max_steps``, the last reward or loss, tokens/s, time left).

Where stdout is not a terminal (a log file, a pipe, the supervisor of a service run) only the lines are printed, as
before; ``quiet`` prints nothing. The bar's time left is rich's estimate from the steps done in this attempt (a
resumed run's bar starts at the step it resumed from).
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def step_line(step: int, max_steps: int, orch: dict[str, Any], trainer: dict[str, Any]) -> str:
    """The console line of step ``step``: its orchestrator and trainer metrics (``-`` where one is missing)."""

    def f(d: dict[str, Any], key: str, fmt: str) -> str:
        value = d.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "-"

    return (
        f"step {step:>4}/{max_steps} | reward {f(orch, 'reward_mean', '.3f')} | loss {f(trainer, 'loss', '+.4f')}"
        f" | mismatch_kl {f(trainer, 'mismatch_kl', '.1e')} | stale {f(orch, 'staleness_mean', '.1f')}"
        f"/{f(orch, 'staleness_max', 'd')} drop {f(orch, 'dropped_stale', 'd')}"
        f" | wait_for_batch {f(trainer, 'wait_for_batch_s', '.2f')}s wait_for_policy {f(orch, 'wait_for_policy_s', '.2f')}s"
        f" | {f(trainer, 'tokens_per_s', '.0f')} tok/s"
    )


class RunConsole:
    """The console of one run attempt; call it with a line to print, :meth:`step` for each trained step.

    Args:
        max_steps: the run's last step (the bar's total).
        start: the step this attempt starts after (0, or the resumed checkpoint's).
        quiet: print nothing.
        stream: where to print (default stdout); the bar is shown only where it is a terminal.
    """

    def __init__(self, max_steps: int, start: int = 0, *, quiet: bool = False, stream: IO[str] | None = None) -> None:
        self.max_steps, self.start, self.quiet = max_steps, start, quiet
        out = sys.stdout if stream is None else stream
        self.console = Console(file=out, highlight=False, soft_wrap=True)
        self.progress: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> RunConsole:
        return self.open()

    def open(self) -> RunConsole:
        """Show the bar (on a terminal, not quiet); :meth:`close` takes it down. Returns ``self``."""
        if not self.quiet and self.console.is_terminal and self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]step"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TextColumn("left"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.progress.start()
            self._task = self.progress.add_task(
                "run", total=self.max_steps, completed=self.start, status="starting", start=True
            )
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Take the bar down, left as it last was; later lines print below it."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def __call__(self, message: str) -> None:
        """Print ``message`` as a line (above the bar on a terminal)."""
        if not self.quiet:
            self.console.print(message, markup=False, highlight=False)

    def bar(self, step: int, status: str = "") -> None:
        """Move the bar (if shown) to ``step`` done, ``status`` beside it; prints no line."""
        if self.progress is not None:
            self.progress.update(self._task, completed=step, status=status)

    def step(self, step: int, orch: dict[str, Any], trainer: dict[str, Any]) -> None:
        """RL step ``step`` trained: its line, and the bar moved to it with its reward and tokens/s."""
        self(step_line(step, self.max_steps, orch, trainer))
        reward, tok_s = orch.get("reward_mean"), trainer.get("tokens_per_s")
        parts = (
            f"reward {reward:.3f}" if isinstance(reward, int | float) else "",
            f"{tok_s:.0f} tok/s" if isinstance(tok_s, int | float) else "",
        )
        self.bar(step, " | ".join(part for part in parts if part))
