"""The monitoring files of ``deploy/``: Prometheus alert rules (``deploy/prometheus/alerts.yml``) that Debian's
``promtool`` accepts and whose alerts fire on the runs they should (``promtool test rules`` on made-up series), and a
Grafana dashboard (``deploy/grafana/asyncrl.json``) whose queries, like the rules', name only series the server's
``/metrics`` exports: every family is in a real scrape, and every ``asyncrl_run_metric{source, name}`` is a metric
that process logs (``worker.tracking.alert_rules.reports``) and is exported for a live run that logged it. A real
Prometheus loads the rules and scrapes the server: a live run's full KV cache puts its alert in ``pending``."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.prometheus import api_get, prometheus
from tests.support.server import wait_for
from worker.tracking.alert_rules import reports

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
BOARD = ROOT / "deploy" / "grafana" / "asyncrl.json"
SELECTOR = re.compile(r"\b(asyncrl_[a-z_]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"')


def rule_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def board_exprs() -> list[str]:
    board = json.loads(BOARD.read_text())
    targets = [t["expr"] for p in board["panels"] for t in p["targets"]]
    variables = [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    return targets + variables


def selectors(exprs: list[str]) -> list[tuple[str, dict[str, str]]]:
    """``(family, exact label matchers)`` of every ``asyncrl_*`` selector in ``exprs``."""
    return [
        (m.group(1), {k: v for k, op, v in MATCHER.findall(m.group(2) or "") if op == "="})
        for e in exprs
        for m in SELECTOR.finditer(e)
    ]


def test_promtool_accepts_the_alert_rules() -> None:
    done = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 5 rules found" in done.stdout, done.stdout


def _series(family: str, run: str, values: str, **labels: str) -> dict[str, str]:
    labels = {"run": run, "env": "reverse_text", "owner": "alice", **labels}
    return {"series": family + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def _metric(source: str, name: str, run: str, values: str) -> dict[str, str]:
    return _series("asyncrl_run_metric", run, values, source=source, name=name)


def test_the_alerts_fire_on_the_runs_they_name(tmp_path: Path) -> None:
    """One sample a minute. Run 1 is healthy everywhere; run 2 has a full KV cache with nobody waiting (no alert),
    a high mismatch KL, a trainer stuck at step 7 and a flat reward; run 3 a queue with room in its KV cache."""
    descriptions = {
        r["alert"]: r["annotations"]["description"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
    }

    def alert(alertname: str, eval_time: str, summary: str = "", labels: dict[str, str] | None = None) -> Any:
        """The alert firing at ``eval_time`` with ``labels`` and ``summary``; none firing without labels."""
        annotations = {"summary": summary, "description": descriptions[alertname]}
        return {
            "eval_time": eval_time,
            "alertname": alertname,
            "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}] if labels else [],
        }

    def run(n: str, source: str, severity: str, name: str | None = None) -> dict[str, str]:
        """The labels of an alert on run ``n``: the series' (``name`` unless the rule drops it) and the rule's."""
        labels = {"run": n, "env": "reverse_text", "owner": "alice", "source": source, "severity": severity}
        return labels if name is None else {**labels, "name": name}

    series = [
        _metric("vllm", "kv_cache_usage", "1", "0.99x30"),
        _metric("vllm", "requests_waiting", "1", "3x30"),
        _metric("vllm", "kv_cache_usage", "2", "0.99x30"),
        _metric("vllm", "requests_waiting", "2", "0x30"),
        _metric("vllm", "kv_cache_usage", "3", "0.5x30"),
        _metric("vllm", "requests_waiting", "3", "5x30"),
        _metric("trainer", "mismatch_kl", "1", "0.0001x30"),
        _metric("trainer", "mismatch_kl", "2", "0.01x30"),
        _series("asyncrl_run_step", "1", "1+1x30", source="trainer"),
        _series("asyncrl_run_step", "2", "7x30", source="trainer"),
        _metric("orchestrator", "reward_mean", "1", "0.1+0.001x120"),
        _metric("orchestrator", "reward_mean", "2", "0.5x120"),
        {"series": 'asyncrl_run_metrics_left_out{cap="metrics"}', "values": "2x30"},
        {"series": 'asyncrl_run_metrics_left_out{cap="runs"}', "values": "0x30"},
    ]
    kv_full = "run 1 (alice): vLLM KV cache 99% full with requests waiting"
    tests = [
        alert("AsyncrlKVCacheFull", "4m"),  # not yet 5 minutes
        alert("AsyncrlKVCacheFull", "10m", kv_full, run("1", "vllm", "warning", "kv_cache_usage")),
        alert(
            "AsyncrlMismatchKLHigh",
            "10m",
            "run 2 (alice): mismatch_kl 0.01 above 1e-3 for 5 minutes",
            run("2", "trainer", "warning", "mismatch_kl"),
        ),
        alert("AsyncrlRunNoProgress", "10m"),  # run 2 is younger than 15 minutes: its first step is no stall
        alert(
            "AsyncrlRunNoProgress",
            "21m",
            "run 2 (alice): no trainer step for 20 minutes",
            run("2", "trainer", "warning"),
        ),
        alert("AsyncrlRewardStalled", "50m"),
        alert(
            "AsyncrlRewardStalled",
            "100m",
            "run 2 (alice): training reward has not improved for an hour",
            run("2", "orchestrator", "info", "reward_mean"),
        ),
        alert(
            "AsyncrlRunSeriesLeftOut",
            "20m",
            "asyncrl /metrics leaves out 2 (metrics cap)",
            {"cap": "metrics", "severity": "info"},
        ),
    ]
    config = tmp_path / "alerts_test.yml"  # JSON is YAML
    config.write_text(
        json.dumps(
            {
                "rule_files": [str(RULES)],
                "evaluation_interval": "1m",
                "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": tests}],
            }
        )
    )
    done = subprocess.run(["promtool", "test", "rules", str(config)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout, done.stdout


def test_the_board_and_the_rules_name_only_series_the_server_exports(
    client: Any, auth: dict[str, str], make_run: Any
) -> None:
    board = json.loads(BOARD.read_text())
    assert board["uid"] == "asyncrl-runs" and len(board["panels"]) == len({p["id"] for p in board["panels"]})
    found = selectors(board_exprs() + rule_exprs())
    run_series = sorted({(m["source"], m["name"]) for family, m in found if family == "asyncrl_run_metric"})
    assert ("vllm", "kv_cache_usage") in run_series and ("trainer", "mismatch_kl") in run_series
    for source, name in run_series:
        assert reports(source, name), f"{source} logs no {name!r}"  # type: ignore[arg-type]

    run = make_run()
    points = [{"source": s, "step": 1, "name": n, "value": 0.5, "time": 1.0} for s, n in run_series]
    points.append({"source": "trainer", "step": 1, "name": "loss", "value": 1.0, "time": 1.0})
    assert client.post(f"/api/runs/{run['id']}/metrics", json={"points": points}, headers=auth).status_code == 200
    client.get("/api/runs", headers=auth)  # a request, so the HTTP latency histogram has a sample
    text = client.get("/metrics", headers=auth).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    exported = {s.name for s in samples}
    for family, _ in found:
        assert family in exported, f"{family} is not exported by /metrics"
    mine = {
        (s.labels["source"], s.labels["name"])
        for s in samples
        if s.name == "asyncrl_run_metric" and s.labels["run"] == str(run["id"])
    }
    assert set(run_series) <= mine, set(run_series) - mine
    steps = [s for s in samples if s.name == "asyncrl_run_step" and s.labels.get("run") == str(run["id"])]
    assert {"owner", "run"} <= steps[0].labels.keys()  # the board's variables read these labels


def test_a_real_prometheus_loads_the_rules_and_holds_the_kv_cache_alert_of_a_live_run(
    live_server: str, client: Any, auth: dict[str, str], make_run: Any, tmp_path: Path
) -> None:
    """Debian's ``prometheus`` scrapes ``/metrics`` every second with ``alerts.yml`` loaded and evaluated every second:
    a live run whose vLLM KV cache is full with requests waiting has its ``AsyncrlKVCacheFull`` alert pending (it
    would fire after 5 minutes); another run, with room in its cache, has none."""
    full, roomy = make_run()["id"], make_run()["id"]
    for run_id, kv in ((full, 0.99), (roomy, 0.4)):
        points = [
            {"source": "vllm", "step": 3, "name": "kv_cache_usage", "value": kv, "time": 1.0},
            {"source": "vllm", "step": 3, "name": "requests_waiting", "value": 12, "time": 1.0},
        ]
        assert client.post(f"/api/runs/{run_id}/metrics", json={"points": points}, headers=auth).status_code == 200
    token = auth["Authorization"].removeprefix("Bearer ")

    def kv_alerts(api: str) -> list[Any]:
        alerts = (api_get(api, "alerts") or {}).get("alerts", [])
        return [a for a in alerts if a["labels"]["alertname"] == "AsyncrlKVCacheFull"]

    with prometheus(live_server, token, tmp_path, rules=RULES) as api:
        groups = wait_for(lambda: (api_get(api, "rules") or {}).get("groups"), 60, "prometheus to load the rules")
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) == 5 and all(r["health"] in ("ok", "unknown") for r in rules), rules
        (pending,) = wait_for(lambda: kv_alerts(api), timeout=60, what="the KV-cache alert of the full run")
        assert pending["state"] == "pending" and pending["labels"]["run"] == str(full), pending
        assert pending["labels"]["source"] == "vllm" and float(pending["value"]) == 0.99
        assert "vLLM KV cache 99% full with requests waiting" in pending["annotations"]["summary"]
