"""Plotly figures of the dashboard (plain figure dicts in Plotly's JSON schema) and the bottleneck verdict.

Series come from the downsampled metrics query (``server.services.metrics.series``). Every chart marks the step
where each process acknowledged each live config revision (a vertical line and a label ``r<n> <process>``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session

from server.models import ConfigRevision, MetricSeries
from server.services import metrics
from worker.alert_rules import PER_ENV_METRICS
from worker.orchestrator.staleness import LAG_HIST_METRICS

MISMATCH_KL_THRESHOLD = 1e-3
"""Alert threshold drawn on the ``mismatch_kl`` chart (nats per token, k3 estimator)."""
MAX_POINTS = 500
"""Points per series on a chart (the query downsamples; the newest point is always kept)."""


@dataclass(frozen=True)
class Chart:
    key: str
    title: str
    lines: tuple[tuple[str, str, str], ...]
    """(source, metric name, legend label) of each line."""
    log_y: bool = False
    threshold: float | None = None
    stacked: bool = False
    """Draw the lines as bars stacked per step (a histogram per step; the compare page overlays them as lines)."""


CHARTS: tuple[Chart, ...] = (
    Chart("reward", "Reward", (("orchestrator", "reward_mean", "train"), ("eval", "reward_mean", "eval"))),
    Chart("loss", "Loss", (("trainer", "loss", "loss"),)),
    Chart("entropy", "Entropy", (("trainer", "entropy", "entropy"),)),
    Chart(
        "mismatch_kl",
        "Mismatch KL",
        (("trainer", "mismatch_kl", "mismatch_kl"),),
        log_y=True,
        threshold=MISMATCH_KL_THRESHOLD,
    ),
    Chart("grad_norm", "Grad norm", (("trainer", "grad_norm", "grad norm"),)),
    Chart("lr", "Learning rate", (("trainer", "lr", "lr"),)),
    Chart(
        "staleness",
        "Staleness (policy versions) and dropped rollouts",
        (
            ("orchestrator", "staleness_mean", "mean"),
            ("orchestrator", "staleness_max", "max"),
            ("orchestrator", "dropped_stale", "dropped"),
        ),
    ),
    Chart(
        "lag_hist",
        "Policy lag of trained samples (count per lag bucket)",
        tuple(
            ("orchestrator", name, "lag " + name.removeprefix("lag_hist/").replace("plus", "+"))
            for name in LAG_HIST_METRICS
        ),
        stacked=True,
    ),
    Chart("tokens_per_s", "Trainer tokens/s", (("trainer", "tokens_per_s", "tokens/s"),)),
)
BOTTLENECK_LINES = (("trainer", "wait_for_batch_s"), ("trainer", "step_time_s"), ("orchestrator", "wait_for_policy_s"))
SERIES_KEYS = sorted({(src, name) for c in CHARTS for src, name, _ in c.lines} | set(BOTTLENECK_LINES))
"""(source, name) of every series the run page draws."""


def env_names(spec: dict[str, Any]) -> list[str]:
    """Names of a stored spec's environments when it is a mixture of several (``[[env]]``), else ``[]``: the
    charts then split by environment (a name defaults to the env's ``id``, as in ``worker.spec.EnvConfig``)."""
    env = spec.get("env")
    if not isinstance(env, list) or len(env) < 2:
        return []
    return [str(e.get("name") or e.get("id", "reverse_text")) for e in env]


def chart_lines(chart: Chart, envs: list[str]) -> list[tuple[str, str, str]]:
    """The chart's lines, and with ``envs`` (a mixture's env names) one more per environment for each line whose
    metric is also logged per environment (``PER_ENV_METRICS``: ``reward_mean/<env>``, label ``train <env>``)."""
    split = [
        (src, f"{name}/{env}", f"{label} {env}")
        for src, name, label in chart.lines
        if name in PER_ENV_METRICS.get(src, ())  # type: ignore[call-overload]  # src is a Source literal
        for env in envs
    ]
    return [*chart.lines, *split]


def load_series(
    session: Session, run_id: int, max_points: int = MAX_POINTS, envs: list[str] | None = None
) -> dict[tuple[str, str], MetricSeries]:
    """``(source, name) -> series`` of every metric the run page draws, each downsampled to ``max_points``; with
    ``envs`` (``env_names``) also each chart metric's per-environment series."""
    keys = sorted({(src, name) for c in CHARTS for src, name, _ in chart_lines(c, envs or [])} | set(SERIES_KEYS))
    return metrics.series_of(session, run_id=run_id, keys=keys, max_points=max_points)


def revision_marks(revisions: list[ConfigRevision]) -> list[tuple[int, str]]:
    """``(step, label)`` for each process's acknowledgement of each revision, by step."""
    marks = [(int(step), f"r{rev.revision} {process}") for rev in revisions for process, step in rev.applied.items()]
    return sorted(marks)


def _layout(title: str, marks: list[tuple[int, str]], *, log_y: bool = False) -> dict[str, Any]:
    shapes = [
        {
            "type": "line",
            "xref": "x",
            "yref": "paper",
            "x0": s,
            "x1": s,
            "y0": 0,
            "y1": 1,
            "line": {"color": "#b45309", "dash": "dot", "width": 1},
        }
        for s, _ in marks
    ]
    notes = [
        {
            "x": s,
            "xref": "x",
            "y": 1,
            "yref": "paper",
            "text": label,
            "showarrow": False,
            "textangle": -90,
            "xanchor": "right",
            "yanchor": "top",
            "font": {"size": 10, "color": "#b45309"},
        }
        for s, label in marks
    ]
    return {
        "title": {"text": title, "font": {"size": 14}},
        "height": 250,
        "margin": {"l": 50, "r": 10, "t": 30, "b": 30},
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"type": "log" if log_y else "linear"},
        "shapes": shapes,
        "annotations": notes,
        "legend": {"orientation": "h", "y": -0.25},
        "uirevision": title,
    }


def _trace(label: str, s: MetricSeries) -> dict[str, Any]:
    return {
        "type": "scatter",
        "mode": "lines+markers" if len(s.step) < 50 else "lines",
        "name": label,
        "x": s.step,
        "y": s.value,
    }


def run_figures(
    series: dict[tuple[str, str], MetricSeries], marks: list[tuple[int, str]], envs: list[str] | None = None
) -> dict[str, Any]:
    """Chart key -> Plotly figure for one run; with ``envs`` (a mixture's env names) split by environment: one
    more line per environment for each metric logged per environment (``chart_lines``)."""
    figs = {}
    for chart in CHARTS:
        lines = chart_lines(chart, envs or [])
        data = [_trace(label, series[(src, name)]) for src, name, label in lines if (src, name) in series]
        layout = _layout(chart.title, marks, log_y=chart.log_y)
        if chart.stacked:
            data = [{"type": "bar", "name": t["name"], "x": t["x"], "y": t["y"]} for t in data]
            layout["barmode"] = "stack"
        if chart.threshold is not None:
            steps = [x for t in data for x in t["x"]]
            if steps:
                data.append(
                    {
                        "type": "scatter",
                        "mode": "lines",
                        "name": f"alert threshold {chart.threshold:g}",
                        "x": [min(steps), max(steps)],
                        "y": [chart.threshold] * 2,
                        "line": {"color": "#dc2626", "dash": "dash"},
                    }
                )
        figs[chart.key] = {"data": data, "layout": layout}
    return figs


def compare_figures(runs: list[tuple[str, dict[tuple[str, str], MetricSeries]]]) -> dict[str, Any]:
    """Chart key -> Plotly figure with every line of every run overlaid (legend ``<run label> <line label>``)."""
    figs = {}
    for chart in CHARTS:
        data = [
            _trace(f"{run_label} {label}", series[(src, name)])
            for run_label, series in runs
            for src, name, label in chart.lines
            if (src, name) in series
        ]
        figs[chart.key] = {"data": data, "layout": _layout(chart.title, [], log_y=chart.log_y)}
    return figs


# ----------------------------------------------------------------------------- bottleneck

BOUND_SHARE = 0.25
"""A wait above this share of step time marks its side as the bottleneck."""
WINDOW = 20
"""The verdict looks at the last this many steps."""
ADVICE = {
    "inference-bound": [
        "move GPUs from the trainer to inference",
        "raise orchestrator.max_async_level so inference runs further ahead of the trainer (keep "
        "orchestrator.max_off_policy_steps >= it: the window is the smaller of the two)",
        "larger orchestrator.batch_size: more concurrent rollouts keep vLLM busier",
        "lower orchestrator.max_tokens if completions are cut anyway",
    ],
    "trainer-bound": [
        "move GPUs from inference to the trainer",
        "raise orchestrator.max_async_level so inference does not wait for each new policy",
        "shorter seq_len / fewer samples per step, or a smaller model",
    ],
    "balanced": ["both sides are busy: add GPUs to both in proportion"],
}


def bottleneck_verdict(batch_share: float, policy_share: float) -> str:
    """The pipeline's bottleneck from two mean shares of step time (each in [0, 1]):

    - ``inference-bound``: the trainer's ``wait_for_batch`` share is at least ``BOUND_SHARE`` and above the
      orchestrator's ``wait_for_policy`` share (the trainer idles waiting for rollouts);
    - ``trainer-bound``: ``wait_for_policy`` share at least ``BOUND_SHARE`` and above ``wait_for_batch``'s (the
      orchestrator idles waiting for a newer policy);
    - ``balanced`` otherwise (neither side waits much, or both wait equally).
    """
    if batch_share >= BOUND_SHARE and batch_share > policy_share:
        return "inference-bound"
    if policy_share >= BOUND_SHARE and policy_share > batch_share:
        return "trainer-bound"
    return "balanced"


@dataclass
class Bottleneck:
    steps: list[int]
    batch_share: list[float]
    policy_share: list[float]
    verdict: str | None
    """None until a step has all three metrics."""
    mean_batch_share: float = 0.0
    mean_policy_share: float = 0.0

    @property
    def advice(self) -> list[str]:
        return ADVICE.get(self.verdict or "", [])


def bottleneck(series: dict[tuple[str, str], MetricSeries]) -> Bottleneck:
    """Per step: trainer ``wait_for_batch_s`` and orchestrator ``wait_for_policy_s`` as shares of the trainer's
    ``step_time_s`` (capped at 1), and the verdict over the last ``WINDOW`` steps that have all three."""
    cols = [dict(zip(s.step, s.value, strict=True)) if (s := series.get(k)) else {} for k in BOTTLENECK_LINES]
    wfb, step_time, wfp = cols
    rows = [
        (n, batch, time, policy)
        for n, time in sorted(step_time.items())
        if time and math.isfinite(time) and (batch := wfb.get(n)) is not None and (policy := wfp.get(n)) is not None
    ]
    steps = [n for n, _, _, _ in rows]
    b = [min(1.0, batch / time) for _, batch, time, _ in rows]
    p = [min(1.0, policy / time) for _, _, time, policy in rows]
    if not steps:
        return Bottleneck([], [], [], None)
    mb, mp = sum(b[-WINDOW:]) / len(b[-WINDOW:]), sum(p[-WINDOW:]) / len(p[-WINDOW:])
    return Bottleneck(steps, b, p, bottleneck_verdict(mb, mp), mb, mp)


def bottleneck_figure(bn: Bottleneck, marks: list[tuple[int, str]]) -> dict[str, Any]:
    data = [
        {"type": "scatter", "mode": "lines", "name": "trainer wait_for_batch", "x": bn.steps, "y": bn.batch_share},
        {
            "type": "scatter",
            "mode": "lines",
            "name": "orchestrator wait_for_policy",
            "x": bn.steps,
            "y": bn.policy_share,
        },
    ]
    layout = _layout("Waits as share of step time", marks)
    layout["yaxis"] = {"range": [0, 1], "tickformat": ".0%"}
    return {"data": data, "layout": layout}


def figures_json(figs: dict[str, Any]) -> str:
    """Figures as JSON safe inside ``<script type="application/json">`` (no ``</`` can end the element)."""
    return json.dumps(figs, allow_nan=False, default=str).replace("</", "<\\/")
