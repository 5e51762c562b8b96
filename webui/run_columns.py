"""The runs table's columns: which there are, which the user chose (``?col=…``, remembered in localStorage by
``webui/static/dashboard.js``) and the reward sparkline's drawing (an inline SVG polyline, no JavaScript)."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import HTTPException

COLUMNS = {
    "status": "Status",
    "step": "Step",
    "reward": "Latest reward",
    "best_eval": "Best eval reward",
    "trend": "Reward trend",
    "duration": "Duration",
    "steps_per_s": "Steps/s",
    "age": "Age",
    "owner": "Owner",
}
"""Column key -> header of each column the user may show or hide, in table order (the run's name always shows)."""
ALWAYS = "run"
"""The column always shown (the chooser form sends it so that a choice of no other column is still a choice)."""
SPARK_W, SPARK_H = 100, 24
"""Size of the sparkline's SVG viewBox (px)."""


def chosen(cols: Sequence[str]) -> list[str]:
    """The columns to show, in table order, from the ``col`` query values; none given: every column.

    Raises:
        HTTPException: 422 naming ``col`` and the allowed keys when a value is not a column key.
    """
    for c in cols:
        if c != ALWAYS and c not in COLUMNS:
            raise HTTPException(422, f"col: expected some of {', '.join([ALWAYS, *COLUMNS])}, got {c!r}")
    return [c for c in COLUMNS if c in cols] if cols else list(COLUMNS)


def sparkline(values: Sequence[float], width: int = SPARK_W, height: int = SPARK_H, pad: float = 2.0) -> str:
    """SVG ``polyline`` points (``"x,y x,y …"``) of ``values`` spread evenly over ``width`` and scaled so the lowest
    value touches the bottom and the highest the top (``pad`` px inside; a flat series is drawn mid-height); empty
    below two values."""
    if len(values) < 2:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo
    step = width / (len(values) - 1)
    inner = height - 2 * pad
    return " ".join(
        f"{i * step:.1f},{(height / 2 if span == 0 else pad + inner * (hi - v) / span):.1f}"
        for i, v in enumerate(values)
    )
