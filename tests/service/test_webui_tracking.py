"""Tracking basics of the dashboard on the real Postgres: chart axes (units, legend placement), the runs table's
columns (duration, steps/s, best eval reward, reward sparkline, the ``col`` choice) and the lineage of real forks
(``GET /api/runs/{id}/lineage`` and its page). Smoothing and log scale are drawn by the browser:
``tests/browser/test_charts.py``."""

from __future__ import annotations

import re
import secrets
import time
from datetime import datetime
from typing import Any

import pytest

from server.models import MetricSeries
from tests.service.test_lifecycle import checkpoint, set_status
from tests.support.server import run_token_headers
from webui import figures, run_columns

# ----------------------------------------------------------------------------- pure helpers


def _series(steps: list[int], values: list[float]) -> MetricSeries:
    return MetricSeries(source="trainer", total=len(steps), step=steps, value=values, time=[0.0] * len(steps))


def test_every_chart_has_units_on_both_axes_and_its_legend_right_of_the_plot() -> None:
    series = {(src, name): _series([1, 2], [0.5, 0.25]) for c in figures.CHARTS for src, name, _ in c.lines}
    run = figures.run_figures(series, [(1, "r1 trainer")])
    run["bottleneck"] = figures.bottleneck_figure(figures.bottleneck({}), [])
    both = figures.compare_figures([("#1 a", series), ("#2 b", series)])
    units = {
        "reward": "reward per sample",
        "loss": "loss (unitless)",
        "entropy": "nats per token",
        "mismatch_kl": "nats per token",
        "grad_norm": "L2 norm",
        "lr": "learning rate",
        "staleness": "policy versions; rollouts",
        "lag_hist": "samples",
        "tokens_per_s": "tokens/s",
        "vllm_cache": "fraction (0-1)",
        "vllm_requests": "requests",
        "bottleneck": "share of step time",
    }
    assert {k: f["layout"]["yaxis"]["title"]["text"] for k, f in run.items()} == units
    assert {k: f["layout"]["yaxis"]["title"]["text"] for k, f in both.items()} == {
        k: v for k, v in units.items() if k != "bottleneck"
    }
    for fig in [*run.values(), *both.values()]:
        layout = fig["layout"]
        assert layout["xaxis"]["title"]["text"] == "trainer step"
        # a vertical legend starting right of the plot area (x > 1 in paper units): never below it on the x title
        assert layout["legend"]["orientation"] == "v" and layout["legend"]["x"] > 1
        assert layout["legend"]["xanchor"] == "left"
    assert run["mismatch_kl"]["layout"]["yaxis"]["type"] == "log" and run["loss"]["layout"]["yaxis"]["type"] == "linear"
    assert run["mismatch_kl"]["data"][-1]["meta"] == "threshold"  # the threshold line is never smoothed


def test_the_inference_servers_vllm_metrics_have_two_charts_on_the_run_page() -> None:
    from worker.inference.server_metrics import METRICS

    assert {("vllm", name) for name in METRICS} <= set(figures.SERIES_KEYS)  # loaded with the run page's series
    series = {("vllm", name): _series([1, 2], [0.5, 0.25]) for name in METRICS}
    run = figures.run_figures(series, [])
    assert [t["name"] for t in run["vllm_cache"]["data"]] == ["KV cache in use (step max)", "prefix-cache hit rate"]
    assert [t["name"] for t in run["vllm_requests"]["data"]] == [
        "running (step max)",
        "waiting (step max)",
        "preempted",
    ]
    assert run["vllm_cache"]["layout"]["title"]["text"] == "Inference KV cache and prefix cache (vLLM)"


def test_an_inference_bound_run_is_told_when_its_vllm_kv_cache_is_full_or_its_requests_queue() -> None:
    """Inference-bound (the trainer waits 80 % of each step); the advice depends on vLLM's own metrics over the last
    20 steps: a full KV cache or a queue comes first, and "more concurrent rollouts" goes."""
    steps = list(range(1, 31))

    def run(kv: list[float] | None, waiting: list[float] | None) -> figures.Bottleneck:
        series = {
            ("trainer", "step_time_s"): _series(steps, [1.0] * 30),
            ("trainer", "wait_for_batch_s"): _series(steps, [0.8] * 30),
            ("orchestrator", "wait_for_policy_s"): _series(steps, [0.0] * 30),
        }
        if kv is not None and waiting is not None:
            series[("vllm", "kv_cache_usage")] = _series(steps, kv)
            series[("vllm", "requests_waiting")] = _series(steps, waiting)
        return figures.bottleneck(series)

    plain = figures.ADVICE["inference-bound"]
    assert run(None, None).advice == plain  # no vllm metrics (a server without vLLM's stats)
    # the KV cache filled up in the last 20 steps (0.5 before): mean 0.95 over them
    full = run([0.5] * 10 + [0.95] * 20, [0.0] * 10 + [12.0] * 20)
    assert full.verdict == "inference-bound" and full.kv_cache_usage == pytest.approx(0.95)
    assert full.advice[0].startswith("the vLLM KV cache is full (kv_cache_usage 95%): give vLLM more memory")
    assert full.advice[1:] == [a for a in plain if a != figures.MORE_ROLLOUTS]
    queued = run([0.3] * 30, [4.0] * 30)
    assert queued.advice[0].startswith("requests wait in vLLM's queue (requests_waiting 4) with room in its KV cache")
    assert figures.MORE_ROLLOUTS not in queued.advice
    assert run([0.3] * 30, [0.0] * 30).advice == plain  # room and no queue: the usual advice


def test_sweep_charts_share_the_layout_with_their_swept_key_and_metric_as_axis_titles() -> None:
    sweep = {
        "metric": "eval/reward_mean",
        "trials": [
            {"index": 0, "run_id": 7, "status": "done", "params": {"trainer.optim.lr": 1e-4}, "best": {"value": 0.5}}
            | {"pruned_step": None},
            {"index": 1, "run_id": 8, "status": "pruned", "params": {"trainer.optim.lr": 1e-3}, "best": {"value": 0.1}}
            | {"pruned_step": 4},
        ],
    }
    figs = figures.sweep_figures(sweep, {0: _series([1, 2], [0.2, 0.5])})
    swept = figs["swept-0"]["layout"]
    assert (swept["xaxis"]["title"]["text"], swept["yaxis"]["title"]["text"]) == (
        "trainer.optim.lr",
        "eval/reward_mean",
    )
    assert swept["xaxis"]["type"] == "log" and swept["legend"] == figures.LEGEND
    assert figs["by-step"]["layout"]["xaxis"]["title"]["text"] == "trainer step"
    assert figs["by-step"]["layout"]["legend"] == figures.LEGEND


def test_sparkline_scales_lowest_to_bottom_and_highest_to_top() -> None:
    assert run_columns.sparkline([0.0, 1.0, 0.5]) == "0.0,22.0 50.0,2.0 100.0,12.0"
    assert run_columns.sparkline([3.0, 3.0]) == "0.0,12.0 100.0,12.0"  # flat: mid-height
    assert run_columns.sparkline([1.0]) == ""


def test_column_choice_keeps_table_order_and_names_a_bad_column() -> None:
    assert run_columns.chosen([]) == list(run_columns.COLUMNS)
    assert run_columns.chosen(["run", "owner", "duration"]) == ["duration", "owner"]
    assert run_columns.chosen(["run"]) == []
    with pytest.raises(Exception, match=r"col: expected some of run, status, step, .* got 'bogus'"):
        run_columns.chosen(["duration", "bogus"])


# ----------------------------------------------------------------------------- runs table


def _post(client: Any, auth: dict[str, str], run_id: int, points: list[tuple[str, int, str, float, float]]) -> None:
    body = {"points": [{"source": s, "step": n, "name": m, "value": v, "time": t} for s, n, m, v, t in points]}
    resp = client.post(f"/api/runs/{run_id}/metrics", json=body, headers=auth)
    assert resp.status_code == 200, resp.text


def _row(html: str, run_id: int) -> str:
    m = re.search(rf'<tr data-run-id="{run_id}">(.*?)</tr>', html, re.S)
    assert m, html
    return m.group(1)


def _cell(row: str, col: str) -> str:
    m = re.search(rf'<td[^>]*data-col="{col}">(.*?)</td>', row, re.S)
    assert m, (col, row)
    return re.sub(r"<[^>]+>", "", m.group(1)).strip()


def test_runs_table_shows_duration_pace_best_eval_and_reward_trend(
    web: tuple[Any, str], auth: dict[str, str], make_run: Any
) -> None:
    client, _ = web
    tag = secrets.token_hex(3)
    run, bare = make_run(name=f"cols-{tag}", max_steps=20), make_run(name=f"cols-{tag}-bare")
    t0 = time.time() - 100
    _post(
        client,
        auth,
        run["id"],
        # 5 trainer steps 2 s apart: (5 - 1) / 8 s = 0.5 steps/s
        [("trainer", s, "step_time_s", 1.9, t0 + 2 * s) for s in range(1, 6)]
        + [("orchestrator", s, "reward_mean", v, t0 + 2 * s) for s, v in ((1, 0.0), (2, 1.0), (3, 0.5))]
        # the best eval reward 0.7 twice: the earliest step (10) is named
        + [("eval", s, "reward_mean", v, t0 + s) for s, v in ((5, 0.2), (10, 0.7), (15, 0.7), (20, 0.4))],
    )
    set_status(client, run["id"], "starting", "running", "completed")
    stored = client.get(f"/api/runs/{run['id']}", headers=auth).json()
    seconds = (datetime.fromisoformat(stored["finished_at"]) - datetime.fromisoformat(stored["started_at"])).seconds

    html = client.get("/runs", params={"q": f"cols-{tag}"}).text
    row = _row(html, run["id"])
    assert _cell(row, "steps_per_s") == "0.5"
    assert _cell(row, "best_eval") == "0.700" and 'title="at step 10"' in row
    assert _cell(row, "reward") == "0.500" and _cell(row, "step") == "3"
    assert _cell(row, "duration") == f"{seconds}s"
    assert '<polyline points="0.0,22.0 50.0,2.0 100.0,12.0"/>' in row
    assert 'aria-label="train reward trend, 3 points from 0.000 to 0.500"' in row
    empty = _row(html, bare["id"])
    assert [_cell(empty, c) for c in ("best_eval", "trend", "duration", "steps_per_s")] == ["—"] * 4
    headers = re.findall(r'<th scope="col" data-col="(\w+)">', html)
    assert headers == ["run", *run_columns.COLUMNS]

    # the chosen columns only, in table order; the live-refresh URL and the filter form keep the choice
    html = client.get("/runs", params=[("q", f"cols-{tag}"), ("col", "run"), ("col", "owner"), ("col", "trend")]).text
    assert re.findall(r'<th scope="col" data-col="(\w+)">', html) == ["run", "trend", "owner"]
    assert re.findall(r'<td[^>]*data-col="(\w+)"', _row(html, run["id"])) == ["run", "trend", "owner"]
    assert (
        f'hx-get="/runs?status=&amp;q=cols-{tag}&amp;tag=&amp;group=&amp;col=run&amp;col=owner&amp;col=trend"' in html
    )
    assert 'id="col-owner" checked' in html and 'id="col-status" >' in html
    assert client.get("/runs", params=[("col", "run")]).text.count('<th scope="col"') == 1

    bad = client.get("/runs", params=[("col", "bogus")], headers={"Accept": "text/html"})
    assert bad.status_code == 422 and "col: expected some of run, status, step" in bad.text


# ----------------------------------------------------------------------------- lineage


def test_lineage_of_real_forks_names_each_fork_step_and_its_config_changes(
    client: Any, auth: dict[str, str], make_run: Any, web: tuple[Any, str]
) -> None:
    """A parent with a live lr change acked at step 1, forked at its checkpoints 2 (A) and 4 (B); A forked at its
    own checkpoint 6 (C). The tree is the same asked from any member; A's changes compare with the parent's config
    *at step 2* (lr 5e-05 live), not its spec."""
    parent = make_run(max_steps=8)
    pid = parent["id"]
    for step in (2, 4):
        checkpoint(parent, step)
    resp = client.patch(f"/api/runs/{pid}/config", json={"changes": {"trainer.optim.lr": 5e-5}}, headers=auth)
    assert resp.status_code == 201, resp.text
    ack = client.post(
        f"/api/runs/{pid}/config/1/ack", json={"process": "trainer", "step": 1}, headers=run_token_headers(pid)
    )
    assert ack.status_code == 200, ack.text
    # a second revision acknowledged only by the orchestrator (temperature) at step 3: its lr is not in effect
    both = {"trainer.optim.lr": 1e-5, "orchestrator.temperature": 0.9}
    assert client.patch(f"/api/runs/{pid}/config", json={"changes": both}, headers=auth).status_code == 201
    ack = client.post(
        f"/api/runs/{pid}/config/2/ack", json={"process": "orchestrator", "step": 3}, headers=run_token_headers(pid)
    )
    assert ack.status_code == 200, ack.text

    def fork(of: dict[str, Any], step: int, changes: dict[str, Any]) -> dict[str, Any]:
        r = client.post(f"/api/runs/{of['id']}/fork", json={"step": step, "changes": changes}, headers=auth)
        assert r.status_code == 201, r.text
        return dict(r.json())

    a = fork(parent, 2, {"max_steps": 12})
    b = fork(parent, 4, {"trainer.optim.lr": 3e-5})
    checkpoint(a, 6)
    c = fork(a, 6, {"orchestrator.temperature": 0.7})

    trees = [client.get(f"/api/runs/{i}/lineage", headers=auth) for i in (pid, a["id"], b["id"], c["id"])]
    assert [t.status_code for t in trees] == [200] * 4
    bodies = [t.json() for t in trees]
    assert [body["run_id"] for body in bodies] == [pid, a["id"], b["id"], c["id"]]
    assert all(body["nodes"] == bodies[0]["nodes"] and body["root_id"] == pid for body in bodies)
    nodes = {n["id"]: n for n in bodies[0]["nodes"]}
    assert [(n["id"], n["parent_id"], n["step"], n["depth"]) for n in bodies[0]["nodes"]] == [
        (pid, None, None, 0),
        (a["id"], pid, 2, 1),
        (c["id"], a["id"], 6, 2),
        (b["id"], pid, 4, 1),
    ]
    assert nodes[pid]["children"] == [a["id"], b["id"]] and nodes[a["id"]]["children"] == [c["id"]]
    assert nodes[a["id"]]["requested"] == {"max_steps": 12}
    # the parent's config at step 2 has the live lr 5e-05 (acked by the trainer at step 1): the fork inherits it, so
    # its only change is max_steps
    assert a["spec"]["trainer"]["optim"]["lr"] == 5e-5
    assert nodes[a["id"]]["changes"] == [{"key": "max_steps", "parent": 8, "child": 12}]
    assert nodes[b["id"]]["changes"] == [{"key": "trainer.optim.lr", "parent": 5e-5, "child": 3e-5}]
    assert b["spec"]["orchestrator"]["temperature"] == 0.9  # in effect at step 4, as the lr 1e-05 is not
    temp = a["spec"]["orchestrator"]["temperature"]
    assert nodes[c["id"]]["changes"] == [{"key": "orchestrator.temperature", "parent": temp, "child": 0.7}]
    assert nodes[pid]["changes"] == [] and nodes[pid]["requested"] == {}

    lone = make_run()
    only = client.get(f"/api/runs/{lone['id']}/lineage", headers=auth).json()
    assert [(n["id"], n["children"]) for n in only["nodes"]] == [(lone["id"], [])]
    missing = client.get("/api/runs/2000000000/lineage", headers=auth)
    assert missing.status_code == 404 and missing.json()["detail"] == "run 2000000000 not found"
    assert client.get(f"/api/runs/{pid}/lineage", headers=run_token_headers(pid)).status_code == 403

    webclient, _ = web
    html = webclient.get(f"/runs/{c['id']}/lineage").text
    assert re.findall(r'<li class="fork( current)?" data-run-id="(\d+)" data-depth="(\d)"', html) == [
        ("", str(pid), "0"),
        ("", str(a["id"]), "1"),
        (" current", str(c["id"]), "2"),
        ("", str(b["id"]), "1"),
    ]
    assert f"forked from #{a['id']} at step 6" in html
    assert '<code>orchestrator.temperature</code></th><td class="old">' + str(temp) in html
    assert f'href="/runs/{pid}/lineage" id="run-lineage"' in webclient.get(f"/runs/{pid}").text
    assert 'id="no-forks"' in webclient.get(f"/runs/{lone['id']}/lineage").text
