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
from worker.orchestrator.staleness import LAG_HIST_METRICS
from worker.tracking.alert_rules import PER_ENV_METRICS

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
    unit: str = ""
    """Title of the y axis: the unit of the plotted values (the x axis is always the trainer step)."""


def _lines(text: str) -> tuple[tuple[str, str, str], ...]:
    """``"trainer/loss=loss, sft/loss=sft loss"`` -> ``(("trainer", "loss", "loss"), ("sft", "loss", "sft loss"))``:
    a chart's lines as ``<source>/<metric>=<legend label>``, comma-separated (a metric may hold ``/``)."""
    out = []
    for part in text.split(","):
        key, _, label = part.strip().rpartition("=")
        source, _, name = key.partition("/")
        out.append((source, name, label))
    return tuple(out)


LAG_LINES = ", ".join(
    f"orchestrator/{name}=lag {name.removeprefix('lag_hist/').replace('plus', '+')}" for name in LAG_HIST_METRICS
)
# fmt: off
CHART_TABLE: tuple[tuple[str, str, str, str], ...] = (
    # key           title                   y axis unit                 lines (see _lines)
    ("reward",      "Reward",               "reward per sample",
     "orchestrator/reward_mean=train, eval/reward_mean=eval, sft/eval_reward_greedy=greedy eval"),  # sft: an SFT run's
    ("loss",        "Loss",                 "loss (unitless)",          "trainer/loss=loss, sft/loss=sft loss, sft/eval_loss=held-out"),
    ("entropy",     "Entropy",              "nats per token",           "trainer/entropy=entropy"),
    ("mismatch_kl", "Mismatch KL",          "nats per token",           "trainer/mismatch_kl=mismatch_kl"),
    ("grad_norm",   "Grad norm",            "L2 norm",                  "trainer/grad_norm=grad norm, sft/grad_norm=sft grad norm"),
    ("lr",          "Learning rate",        "learning rate",            "trainer/lr=lr, sft/lr=sft lr"),
    ("staleness",   "Staleness (policy versions) and dropped rollouts", "policy versions; rollouts",
     "orchestrator/staleness_mean=mean, orchestrator/staleness_max=max, orchestrator/dropped_stale=dropped"),
    ("lag_hist",    "Policy lag of trained samples (count per lag bucket)", "samples", LAG_LINES),
    ("tokens_per_s", "Trainer tokens/s",    "tokens/s",                 "trainer/tokens_per_s=tokens/s, sft/tokens_per_s=sft tokens/s"),
    # vLLM's own metrics of the run's inference servers (worker/inference/server_metrics.py): why rollouts are slow
    ("vllm_cache", "Inference KV cache and prefix cache (vLLM)", "fraction (0-1)",
     "vllm/kv_cache_usage=KV cache in use (step max), vllm/prefix_cache_hit_rate=prefix-cache hit rate"),
    ("vllm_requests", "Inference requests (vLLM)", "requests",
     "vllm/requests_running=running (step max), vllm/requests_waiting=waiting (step max), vllm/preemptions=preempted"),
)
# fmt: on
"""The run page's charts in order: ``(key, title, unit, lines)``; options of a few charts in :data:`CHART_OPTIONS`."""
CHART_OPTIONS: dict[str, dict[str, Any]] = {
    "mismatch_kl": {"log_y": True, "threshold": MISMATCH_KL_THRESHOLD},
    "lag_hist": {"stacked": True},
}
CHARTS: tuple[Chart, ...] = tuple(
    Chart(key, title, _lines(lines), unit=unit, **CHART_OPTIONS.get(key, {})) for key, title, unit, lines in CHART_TABLE
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


X_TITLE = "trainer step"
"""Title of the x axis of every chart over steps."""
LEGEND = {"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top", "font": {"size": 11}}
"""Every chart's legend: a column right of the plot area (Plotly pushes the right margin to fit it), so it never
meets the x axis title below the plot or the y axis title left of it, however many entries it has."""


def _layout(
    title: str, marks: list[tuple[int, str]], *, log_y: bool = False, y_title: str = "", x_title: str = X_TITLE
) -> dict[str, Any]:
    """The layout of every dashboard chart (the one place it is made): ``title`` on top, the axis titles
    ``x_title`` and ``y_title`` (units) with plain-number ticks, the legend right of the plot (:data:`LEGEND`), and a
    dotted vertical line with a label at each of ``marks`` (``(step, label)``)."""
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
        "height": 260,
        "margin": {"l": 60, "r": 10, "t": 30, "b": 45},
        # d3 "~g": plain numbers (0.0005, 1e-05, 12000), never SI prefixes mixed with decimals (500µ beside 0.5)
        "xaxis": {"title": {"text": x_title, "standoff": 4}, "tickformat": "~g", "automargin": True},
        "yaxis": {
            "title": {"text": y_title, "standoff": 4},
            "type": "log" if log_y else "linear",
            "tickformat": "~g",
            "automargin": True,
        },
        "shapes": shapes,
        "annotations": notes,
        "legend": dict(LEGEND),
        "uirevision": title,
    }


NO_DATA = "No data yet"
"""The note a chart without a single point shows in its middle (an empty chart alone reads as a drawing bug)."""


def _noted(fig: dict[str, Any]) -> dict[str, Any]:
    """``fig`` (``{"data", "layout"}``) with the :data:`NO_DATA` note when none of its traces has a point."""
    if not any(len(t.get("x") or []) for t in fig["data"]):
        note = {"text": NO_DATA, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5, "showarrow": False}
        fig["layout"]["annotations"] = [*fig["layout"].get("annotations", []), {**note, "font": {"color": "#6b7280"}}]
    return fig


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
        layout = _layout(chart.title, marks, log_y=chart.log_y, y_title=chart.unit)
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
                        "meta": "threshold",  # never smoothed (webui/static/dashboard.js)
                    }
                )
        figs[chart.key] = _noted({"data": data, "layout": layout})
    return figs


RUN_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
"""Colour of the n-th compared run (cycled): Plotly's default qualitative palette (D3 ``category10``)."""
LINE_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
"""Dash of the n-th line of a chart (cycled): within a run's colour, its lines differ by dash."""


def compare_figures(runs: list[tuple[str, dict[tuple[str, str], MetricSeries]]]) -> dict[str, Any]:
    """Chart key -> Plotly figure with every line of every run overlaid (legend ``<run label> <line label>``): each
    run keeps one colour on every chart (``RUN_COLORS``, in the order of ``runs``), each line of a chart one dash
    (``LINE_DASHES``), so a run is found by its colour whichever lines it has."""
    figs = {}
    for chart in CHARTS:
        data = [
            {
                **_trace(f"{run_label} {label}", series[(src, name)]),
                "line": {"color": RUN_COLORS[r % len(RUN_COLORS)], "dash": LINE_DASHES[i % len(LINE_DASHES)]},
                "marker": {"color": RUN_COLORS[r % len(RUN_COLORS)]},
            }
            for r, (run_label, series) in enumerate(runs)
            for i, (src, name, label) in enumerate(chart.lines)
            if (src, name) in series
        ]
        layout = _layout(chart.title, [], log_y=chart.log_y, y_title=chart.unit)
        figs[chart.key] = _noted({"data": data, "layout": layout})
    return figs


# ----------------------------------------------------------------------------- bottleneck

BOUND_SHARE = 0.25
"""A wait above this share of step time marks its side as the bottleneck."""
WINDOW = 20
"""The verdict looks at the last this many steps."""
MORE_ROLLOUTS = "larger orchestrator.batch_size: more concurrent rollouts keep vLLM busier"
"""Inference-bound advice that holds only while vLLM has room: left out when its KV cache is full or requests queue."""
ADVICE = {
    "inference-bound": [
        "move GPUs from the trainer to inference",
        "raise orchestrator.max_async_level so inference runs further ahead of the trainer (keep "
        "orchestrator.max_off_policy_steps >= it: the window is the smaller of the two)",
        MORE_ROLLOUTS,
        "lower orchestrator.max_tokens if completions are cut anyway",
    ],
    "trainer-bound": [
        "move GPUs from inference to the trainer",
        "raise orchestrator.max_async_level so inference does not wait for each new policy",
        "shorter seq_len / fewer samples per step, or a smaller model",
    ],
    "balanced": ["both sides are busy: add GPUs to both in proportion"],
}
KV_CACHE_FULL = 0.9
"""Mean step-highest ``vllm`` ``kv_cache_usage`` over the verdict's window at or above which an inference-bound run is
told its servers are out of KV cache."""
KV_CACHE_ADVICE = (
    "the vLLM KV cache is full (kv_cache_usage {kv:.0%}): give vLLM more memory (inference.gpu_memory_utilization) "
    "or fewer rollouts at once; more concurrent rollouts would only wait and be preempted"
)
QUEUE_ADVICE = (
    "requests wait in vLLM's queue (requests_waiting {waiting:.0f}) with room in its KV cache: the servers are out of "
    "compute; add inference replicas or GPUs rather than rollouts"
)
BOTTLENECK_VLLM = (("vllm", "kv_cache_usage"), ("vllm", "requests_waiting"))
"""The inference servers' own metrics (``worker/inference/server_metrics.py``) that refine the inference-bound advice."""


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
    kv_cache_usage: float | None = None
    """Mean of the ``vllm`` ``kv_cache_usage`` over the verdict's steps (None: the run logged none)."""
    requests_waiting: float | None = None
    """Mean of the ``vllm`` ``requests_waiting`` over the verdict's steps (None: the run logged none)."""

    @property
    def advice(self) -> list[str]:
        """What to change for the verdict; an inference-bound run whose vLLM KV cache is full (``KV_CACHE_FULL``), or
        whose requests queue with room in it, is told so first, and not to run more rollouts at once."""
        advice = ADVICE.get(self.verdict or "", [])
        if self.verdict != "inference-bound" or self.kv_cache_usage is None:
            return advice
        if self.kv_cache_usage >= KV_CACHE_FULL:
            first = KV_CACHE_ADVICE.format(kv=self.kv_cache_usage)
        elif self.requests_waiting is not None and self.requests_waiting >= 1:
            first = QUEUE_ADVICE.format(waiting=self.requests_waiting)
        else:
            return advice
        return [first, *(a for a in advice if a != MORE_ROLLOUTS)]


def bottleneck(series: dict[tuple[str, str], MetricSeries]) -> Bottleneck:
    """Per step: trainer ``wait_for_batch_s`` and orchestrator ``wait_for_policy_s`` as shares of the trainer's
    ``step_time_s`` (capped at 1), and the verdict over the last ``WINDOW`` steps that have all three (with the means
    of the ``vllm`` metrics over those steps, for the advice)."""
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
    kv, waiting = (_window_mean(series.get(k), steps[-WINDOW:]) for k in BOTTLENECK_VLLM)
    return Bottleneck(steps, b, p, bottleneck_verdict(mb, mp), mb, mp, kv, waiting)


def _window_mean(s: MetricSeries | None, steps: list[int]) -> float | None:
    """Mean of the finite values of ``s`` at ``steps`` (None: none there)."""
    at = set(steps)
    values = (
        [v for n, v in zip(s.step, s.value, strict=True) if n in at and v is not None and math.isfinite(v)] if s else []
    )
    return sum(values) / len(values) if values else None


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
    layout = _layout("Waits as share of step time", marks, y_title="share of step time")
    layout["yaxis"].update(range=[0, 1], tickformat=".0%")
    return _noted({"data": data, "layout": layout})


def figures_json(figs: dict[str, Any]) -> str:
    """Figures as JSON safe inside ``<script type="application/json">`` (no ``</`` can end the element)."""
    return json.dumps(figs, allow_nan=False, default=str).replace("</", "<\\/")


PRUNED_COLOR = "#b91c1c"
KEPT_COLOR = "#1d4ed8"


def sweep_figures(sweep: dict[str, Any], curves: dict[int, MetricSeries]) -> dict[str, Any]:
    """Figures of a sweep page from ``server.services.sweeps.public(...)``: per swept key ``swept-<n>``, the metric's
    best value of each trial over that key's values (pruned trials as red crosses, labelled ``#<run id>``); and
    ``by-step``, each trial's metric over steps (``curves``: trial index -> series; pruned trials dashed red, with a
    cross at the pruning step)."""
    metric, figs = sweep["metric"], {}
    keys = list(dict.fromkeys(k for t in sweep["trials"] for k in t["params"]))
    for n, key in enumerate(keys):
        data = []
        for pruned in (False, True):
            rows = [t for t in sweep["trials"] if t["best"] and (t["status"] == "pruned") == pruned]
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers+text",
                    "name": "pruned" if pruned else "kept",
                    "x": [t["params"][key] for t in rows],
                    "y": [t["best"]["value"] for t in rows],
                    "text": [f"#{t['run_id']}" for t in rows],
                    "textposition": "top center",
                    "marker": {
                        "size": 11,
                        "symbol": "x" if pruned else "circle",
                        "color": PRUNED_COLOR if pruned else KEPT_COLOR,
                    },
                }
            )
        values = [t["params"][key] for t in sweep["trials"]]
        numeric = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        log_x = len(numeric) == len(values) and min(numeric, default=0) > 0 and max(numeric) / min(numeric) >= 10
        layout = _layout(f"best {metric} over {key}", [], y_title=metric, x_title=key)
        layout["xaxis"]["type"] = "log" if log_x else "-"
        figs[f"swept-{n}"] = {"data": data, "layout": layout}
    lines = []
    for t in sweep["trials"]:
        s = curves.get(t["index"])
        if s is None:
            continue
        pruned = t["status"] == "pruned"
        label = f"#{t['run_id']} " + ", ".join(
            f"{k.rsplit('.', 1)[-1]}={v:g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
            for k, v in t["params"].items()
        )
        trace = _trace(label + (" (pruned)" if pruned else ""), s)
        if pruned:
            trace["line"] = {"dash": "dash", "color": PRUNED_COLOR}
        lines.append(trace)
    marks = sorted({(t["pruned_step"], "pruned") for t in sweep["trials"] if t["pruned_step"] is not None})
    layout = _layout(f"{metric} by step", marks, y_title=metric)
    layout["height"] = 320
    figs["by-step"] = {"data": lines, "layout": layout}
    return figs


def checkpoint_evals_figure(points: list[Any]) -> dict[str, Any]:
    """Eval reward over a training run's checkpoints: one point per eval job of its weights that stored metrics
    (``server.services.evals.evals_of``: ``x`` the checkpoint step, ``metrics``), a line for ``reward_mean`` and
    ``pass_at_k`` and one per environment's ``reward_mean/<env>``; each point's hover names its eval run."""
    done = [p for p in points if p.metrics]
    names = ["reward_mean", "pass_at_k"]
    names += sorted({n for p in done for n in p.metrics if n.startswith("reward_mean/")})
    data = []
    for name in names:
        shown = [p for p in done if name in p.metrics]
        if shown:
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers",
                    "name": name,
                    "x": [p.x for p in shown],
                    "y": [p.metrics[name] for p in shown],
                    "text": [f"eval run #{p.run_id}" for p in shown],
                }
            )
    layout = _layout("Eval reward over checkpoints", [])
    layout["xaxis"] = {"title": {"text": "checkpoint step"}, "tickformat": "~g"}
    return _noted({"data": data, "layout": layout})
