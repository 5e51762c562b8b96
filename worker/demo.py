"""``asyncrl demo``: tiny model -> SFT warm-up -> async RL -> greedy eval on reverse-text, with a summary.

Two ways to run it, same summary keys:

- default: through the service, as ONE pipeline (issue 22). ``asyncrl server`` and ``asyncrl worker`` start as
  children in embedded mode (SQLite + a file broker under ``<output_dir>/service``, a free port on 127.0.0.1); the
  tiny model is made here, then ``examples/pipelines/reverse_text.toml`` (sft -> rl -> eval, each stage's base read
  inline, the SFT stage from the tiny model) is submitted with ``POST /api/pipelines`` under a fresh token and each
  stage's run is followed to its end in turn (step and reward from ``GET /api/runs/{id}/metrics``, status changes
  from ``/events``); the summary adds ``pipeline_id``, the stages' run ids, the eval stage's greedy reward and
  ``dashboard_url`` (the pipeline's page). Server and worker die with the demo (also on Ctrl-C, which first stops
  the pipeline and its live run).
- ``--local``: SFT in this process, then ``launch_rl`` (the three run processes are its children); no eval stage.

The summary's ``reward_after_sft`` and ``reward_after_rl`` are the RL run's own online evals at policy version 0
(the SFT model) and at the last version, on the same held-out tasks with the same sampling
(``orchestrator.eval``), so the difference is what RL added.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.dotted_keys import with_keys
from worker.run.rundir import SupervisorHome, atomic_write_json
from worker.spec import SFTSpec, SpecError, load_pipeline_data, load_spec_data, validate_spec

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "reverse_text"
PIPELINE = Path(__file__).resolve().parent.parent / "examples" / "pipelines" / "reverse_text.toml"
"""The demo's pipeline through the service (sft -> rl -> eval)."""
TICK_S = 2.0
"""The embedded worker's ``SWEEP_TICK_S``: how soon a pipeline's next stage starts after one completed."""
TERMINAL = {"completed", "failed", "cancelled"}


class DemoError(RuntimeError):
    """The service demo could not finish; the message is a one-line reason."""


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)  # noqa: T201 - console output


def _model_and_sft(out: Path, sft_steps: int | None) -> tuple[dict[str, Any], SFTSpec]:
    """Stages 1-2 under ``out``: tiny model, then the SFT warm-up; returns run_sft's result and its spec."""
    from worker.policy.models import init_model
    from worker.trainer.sft import run_sft

    model_dir = init_model(out / "model", size="tiny", seed=0, overwrite=True)
    say(f"tiny model: {model_dir}")
    overrides = [("model.name", str(model_dir)), ("output_dir", str(out)), ("name", "sft")]
    if sft_steps:
        overrides.append(("max_steps", str(sft_steps)))
    spec = validate_spec("sft", load_spec_data([CONFIGS / "sft.toml"], overrides))
    assert isinstance(spec, SFTSpec)
    sft = run_sft(spec, overwrite=True)
    say(f"SFT done in {sft['wall_s']}s: greedy eval reward {sft['eval_reward_greedy']:.3f}")
    return sft, spec


def _rl_data(model: str, rl_steps: int | None, **overrides: str) -> dict[str, Any]:
    """The RL spec mapping: ``configs/reverse_text/rl.toml`` from ``model``, with overrides."""
    pairs = [("model.name", model), *overrides.items()]
    if rl_steps:
        pairs.append(("max_steps", str(rl_steps)))
    return load_spec_data([CONFIGS / "rl.toml"], pairs)


def _summary(
    rl: dict[str, Any], sft: dict[str, Any], sft_steps: int, t0: float, run_dir: str, **extra: Any
) -> dict[str, Any]:
    """The demo's summary from the RL run's ``summary.json`` (``rl``) and the SFT run's (``sft``: its
    ``eval_reward_greedy`` and ``wall_s``); ``extra`` keys follow ``status``."""
    first, last = rl["eval_reward_first"], rl["eval_reward_last"]
    return {
        "status": rl["status"],
        **extra,
        "reward_after_sft": first,
        "reward_after_rl": last,
        "reward_gain": last - first if first is not None and last is not None else None,
        "sft_greedy_eval_reward": sft["eval_reward_greedy"],
        "mismatch_kl": rl["mismatch_kl"],
        "mismatch_kl_on_policy": rl["mismatch_kl_on_policy"],
        "steps": rl["steps"],
        "sft_steps": sft_steps,
        "wall_s": round(time.time() - t0, 1),
        "rl_wall_s": rl["wall_s"],
        "sft_wall_s": sft["wall_s"],
        "run_dir": run_dir,
    }


def _write(summary_path: Path, summary: dict[str, Any]) -> None:
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(summary_path, summary)


def run_demo(
    output_dir: str, summary_path: Path, *, rl_steps: int | None = None, sft_steps: int | None = None
) -> dict[str, Any]:
    """``--local``: the three stages below ``output_dir`` (replacing an earlier demo there); returns the summary."""
    from worker.launchers.local import launch_rl

    t0 = time.time()
    out = Path(output_dir)
    sft, sft_spec = _model_and_sft(out, sft_steps)
    data = _rl_data(sft["final"], rl_steps, output_dir=str(out), name="rl")
    rl_spec = validate_spec("rl", data)
    rl = launch_rl(rl_spec, overwrite=True)
    summary = _summary(rl, sft, sft_spec.max_steps, t0, str(rl_spec.run_dir))
    _write(summary_path, summary)
    return summary


# ----------------------------------------------------------------------------- through the service


@dataclass(frozen=True)
class Service:
    url: str
    """Base URL, ``http://127.0.0.1:<port>``."""
    token: str
    """An API token made for the demo."""
    pids: dict[str, int]
    """``server`` and ``worker`` process ids (each leads its own process group)."""


@contextmanager
def embedded_service(
    home: Path, *, model_roots: list[Path] | None = None, startup_timeout_s: float = 120.0, port: int | None = None
) -> Iterator[Service]:
    """Start ``asyncrl server`` and ``asyncrl worker`` in embedded mode with state under ``home``; yields a
    ``Service``. ``model_roots``: the folders a submitted ``model.name`` may be under besides ``home/outputs``
    (the server's ``MODEL_ROOTS``; the demo's SFT model is outside the service's folder); ``port``: the server's
    (default: a free one). Both are children in
    their own process groups that get SIGTERM if this process dies; on exit both are terminated at once (SIGKILL after
    10 s). Logs: ``home/server.log``, ``home/worker.log``.

    Raises:
        DemoError: the server did not answer ``/healthz``, or its worker did not answer there, within
            ``startup_timeout_s``, or a child exited.
    """
    import httpx

    from worker.run.procs import free_port, kill_groups, spawn

    url = f"http://127.0.0.1:{port or free_port()}"
    env = {
        **os.environ,
        "ASYNCRL_HOME": str(home),
        "DATABASE_URL": "",
        "CELERY_BROKER_URL": "",
        "ASYNCRL_OUTPUT_DIR": str(home / "outputs"),
        "ASYNCRL_SERVER_URL": url,
        "MODEL_ROOTS": ",".join(str(p) for p in [home / "outputs", *(model_roots or [])]),
        "SWEEP_TICK_S": str(TICK_S),  # a pipeline's next stage starts within TICK_S of the one before completing
    }
    cli = [sys.executable, "-m", "worker.cli"]
    procs = {
        "server": spawn(
            [*cli, "server", "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1]], home / "server.log", env
        )
    }
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if procs["server"].poll() is not None:
                raise DemoError(
                    f"asyncrl server exited with code {procs['server'].returncode} (log: {home / 'server.log'})"
                )
            try:
                if httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise DemoError(f"asyncrl server not up after {startup_timeout_s:.0f}s (log: {home / 'server.log'})")
            time.sleep(0.3)
        procs["worker"] = spawn([*cli, "worker", "--concurrency", "1"], home / "worker.log", env)
        while True:  # the worker's heartbeat (/healthz "worker": "ok"): it takes the tasks from here on
            if procs["worker"].poll() is not None:
                raise DemoError(
                    f"asyncrl worker exited with code {procs['worker'].returncode} (log: {home / 'worker.log'})"
                )
            try:
                if httpx.get(f"{url}/healthz", timeout=2.0).json().get("worker") == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise DemoError(f"asyncrl worker not up after {startup_timeout_s:.0f}s (log: {home / 'worker.log'})")
            time.sleep(0.3)
        made = subprocess.run([*cli, "token", "create", "--name", "demo"], env=env, capture_output=True, text=True)
        if made.returncode != 0:
            raise DemoError(f"asyncrl token create failed: {made.stderr.strip().splitlines()[-1:]}")
        yield Service(url, made.stdout.strip(), {name: proc.pid for name, proc in procs.items()})
    finally:
        kill_groups(list(procs.values()))


def _stop_run(client: Any, run: dict[str, Any], timeout_s: float = 60.0) -> None:
    """Ask the service to stop a live run and wait for its end; if it does not end (or the server does not
    answer), terminate the run's supervisor found by its lock file (its processes go with it)."""
    import httpx

    from worker.launchers import supervisor

    try:
        client.post(f"/api/runs/{run['id']}/stop")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if client.get(f"/api/runs/{run['id']}").json()["status"] in TERMINAL:
                return
            time.sleep(0.5)
    except httpx.HTTPError:
        pass
    pid = supervisor.running_pid(Path(run["run_dir"]).parent)
    if pid is not None:
        supervisor.terminate(pid, grace_s=15.0)


def follow_run(
    client: Any,
    run_id: int,
    max_steps: int,
    poll_s: float = 2.0,
    unreachable_s: float = 120.0,
    local_supervisor: bool = False,
    label: str = "RL",
) -> dict[str, Any]:
    """Poll the run until it ends (``label``: what its progress bar is called): a rich progress line with step and reward, an SFT stage's loss (``GET .../metrics``), one line per
    status change and eval (``GET .../events``, eval points). Returns the final run (``RunPublic`` JSON).
    With ``local_supervisor`` (the worker runs on this machine) a launched run whose supervisor is gone while the
    run is still live is an error rather than a wait without end.

    Raises:
        DemoError: the server did not answer for ``unreachable_s`` seconds, or the supervisor died unreported.
    """
    import httpx
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from worker.run.procs import alive

    seen_events, last_step, evals_seen, reward, gone = 0, -1, -1, float("nan"), 0
    metric = "loss" if label == "SFT" else "reward_mean"  # the bar's number: an SFT run's loss, other runs' reward
    last_ok = time.monotonic()
    columns = (
        TextColumn(f"[demo] {label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        bar = progress.add_task("queued", total=max_steps)

        def line(text: str) -> None:
            progress.console.print(text, markup=False, highlight=False)

        while True:
            try:
                run = client.get(f"/api/runs/{run_id}").raise_for_status().json()
                events = client.get(f"/api/runs/{run_id}/events", params={"offset": seen_events})
                for e in events.raise_for_status().json()["data"]:
                    seen_events += 1
                    if e["kind"] == "status":
                        reason = f" ({e['reason']})" if e["reason"] else ""
                        line(f"[demo] run {run_id}: {e['from_status'] or '-'} -> {e['to_status']}{reason}")
                    else:
                        said = e["reason"] if e["reason"].startswith(e["kind"]) else f"{e['kind']}: {e['reason']}"
                        line(f"[demo] run {run_id}: {said}")
                series = (
                    client.get(
                        f"/api/runs/{run_id}/metrics",
                        params={"name": metric, "since_step": min(last_step, evals_seen), "max_points": 1000},
                    )
                    .raise_for_status()
                    .json()["series"]
                )
                last_ok = time.monotonic()
            except httpx.HTTPError as err:
                if time.monotonic() - last_ok > unreachable_s:
                    raise DemoError(f"server unreachable for {unreachable_s:.0f}s: {err}") from None
                time.sleep(poll_s)
                continue
            for s in series:
                for step, value in zip(s["step"], s["value"], strict=True):
                    if s["source"] in ("orchestrator", "sft") and step > last_step:
                        last_step, reward = step, value if value is not None else float("nan")
                    elif s["source"] == "eval" and step > evals_seen:
                        evals_seen = step
                        shown = "-" if value is None else f"{value:.3f}"
                        line(f"[demo] eval at policy version {step}: reward {shown}")
                        if last_step < 0 and value is not None:  # an eval stage: no training rows, its eval's reward
                            reward = value
            done = max_steps if run["status"] == "completed" else max(last_step, 0)  # an eval stage has no steps
            progress.update(
                bar, completed=done, description=f"{run['status']} | {metric.removesuffix('_mean')} {reward:.3f}"
            )
            if run["status"] in TERMINAL:
                return dict(run)
            home = Path(run["run_dir"]).parent
            handle = str(run["launcher_handle"] or "")
            # by its pid, not its lock: a supervisor still importing has not taken the lock yet
            gone = gone + 1 if local_supervisor and handle.isdigit() and not alive(int(handle)) else 0
            if gone >= 3:  # it reports the end before it exits: three polls later the server would know
                raise DemoError(
                    f"run {run_id}: its supervisor (pid {run['launcher_handle']}) exited without "
                    f"reporting an end (log: {SupervisorHome(home).log})"
                )
            time.sleep(poll_s)


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def pipeline_data(model: str, *, rl_steps: int | None = None, sft_steps: int | None = None) -> dict[str, Any]:
    """The demo's pipeline mapping (``POST /api/pipelines``): :data:`PIPELINE` with each stage's ``base`` file read
    inline (as ``asyncrl pipeline`` sends it), the SFT stage starting from ``model`` (a path) and the step counts
    given set as overrides.

    Raises:
        SpecError: the pipeline file or a base file does not read (names the file).
    """
    data = load_pipeline_data(PIPELINE)
    sft, rl = data["stages"][0], data["stages"][1]
    sft["overrides"] = {**sft.get("overrides", {}), "model.name": model}
    if sft_steps:
        sft["overrides"]["max_steps"] = sft_steps
    if rl_steps:
        rl["overrides"] = {**rl.get("overrides", {}), "max_steps": rl_steps}
    return data


def _stage_steps(data: dict[str, Any]) -> list[int]:
    """Each stage's step count for its progress bar (an eval stage: 1); the training stages' specs are validated
    here, so bad input fails before the service starts.

    Raises:
        SpecError: a training stage's spec is invalid (one line naming the field).
    """
    steps, model = [], None
    for stage in data["stages"]:
        if stage["kind"] == "eval":
            steps.append(1)
            continue
        stage_data = with_keys(stage["base"], stage.get("overrides", {}))
        if model is not None:  # a later stage starts from the stage before's weights (the service sets model.name)
            stage_data = with_keys(stage_data, {"model.name": model})
        spec = validate_spec(stage["kind"], stage_data)
        steps.append(spec.max_steps)
        model = spec.model.name
    return steps


def follow_pipeline(
    client: Any, pipeline_id: int, steps: list[int], current: dict[str, Any], poll_s: float = 2.0
) -> dict[str, Any]:
    """Follow each stage's run of the pipeline in turn (:func:`follow_run`) until the pipeline ends; returns the
    pipeline (``GET /api/pipelines/{id}`` JSON). ``current`` gets the run being followed (``{"run": RunPublic}``),
    for the caller to stop on Ctrl-C.

    Raises:
        DemoError: as :func:`follow_run`, or the server did not answer for 120 s.
    """
    import httpx

    index, last_ok = 0, time.monotonic()
    while True:
        try:
            pipeline = client.get(f"/api/pipelines/{pipeline_id}").raise_for_status().json()
            last_ok = time.monotonic()
        except httpx.HTTPError as err:
            if time.monotonic() - last_ok > 120.0:
                raise DemoError(f"server unreachable for 120s: {err}") from None
            time.sleep(poll_s)
            continue
        stages = pipeline["stages"]
        if index < len(stages) and stages[index]["run_id"] is not None:
            stage = stages[index]
            say(f"pipeline {pipeline_id} stage {index} ({stage['kind']}): run {stage['run_id']}")
            current["run"] = client.get(f"/api/runs/{stage['run_id']}").raise_for_status().json()
            follow_run(
                client, stage["run_id"], steps[index], poll_s, local_supervisor=True, label=stage["kind"].upper()
            )
            index += 1
            continue
        if pipeline["status"] != "running":
            return dict(pipeline)
        time.sleep(poll_s)


def _stop_pipeline(client: Any, pipeline_id: int, run: dict[str, Any] | None) -> None:
    """Stop the pipeline (its live stage's run through the normal stop path), then make sure that run ended
    (:func:`_stop_run`)."""
    import httpx

    try:
        client.post(f"/api/pipelines/{pipeline_id}/stop")
    except httpx.HTTPError:
        pass
    if run is not None:
        _stop_run(client, run)


def _read_summary(run: dict[str, Any]) -> dict[str, Any]:
    """The run's ``summary.json`` (its run directory), {} when it wrote none."""
    path = Path(run["run_dir"]) / "summary.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


def run_service_demo(
    output_dir: str, summary_path: Path, *, rl_steps: int | None = None, sft_steps: int | None = None
) -> dict[str, Any]:
    """The demo as one pipeline through the service (see the module doc); returns the summary, also written to
    ``summary_path``. Everything below ``output_dir`` from an earlier demo is replaced.

    Raises:
        DemoError: the pipeline did not complete (its status and reason, the logs to read), or the service did not
            start.
        SpecError: a stage's spec is invalid (before the service starts).
    """
    import httpx

    from worker.policy.models import init_model

    t0 = time.time()
    out = Path(output_dir).resolve()
    model_dir = init_model(out / "model", size="tiny", seed=0, overwrite=True).resolve()
    say(f"tiny model: {model_dir}")
    data = pipeline_data(str(model_dir), rl_steps=rl_steps, sft_steps=sft_steps)
    steps = _stage_steps(data)
    home = out / "service"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    current: dict[str, Any] = {}
    with (
        embedded_service(home, model_roots=[model_dir]) as service,
        httpx.Client(
            base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}, timeout=30.0
        ) as client,
    ):
        resp = client.post("/api/pipelines", json=data)
        if resp.status_code != 201:
            raise DemoError(f"POST /api/pipelines: {resp.status_code} {resp.text[:500]}")
        pipeline = resp.json()
        dashboard = f"{service.url}/pipelines/{pipeline['id']}"
        say(
            f"server {service.url} (state: {home}); pipeline {pipeline['id']} submitted, dashboard: {dashboard} "
            f"(log in with the token {service.token})"
        )
        previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill <demo>` cleans up like Ctrl-C
        try:
            pipeline = follow_pipeline(client, pipeline["id"], steps, current)
        except BaseException:  # Ctrl-C, SIGTERM or the server went away: leave no run behind
            say(f"stopping pipeline {pipeline['id']}")
            _stop_pipeline(client, pipeline["id"], current.get("run"))
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        runs = {
            s["kind"]: client.get(f"/api/runs/{s['run_id']}").raise_for_status().json()
            for s in pipeline["stages"]
            if s["run_id"] is not None
        }
    sft, rl, ev = (_read_summary(runs[k]) if k in runs else {} for k in ("sft", "rl", "eval"))
    if pipeline["status"] != "completed" or not (sft and rl and ev):
        logs = ", ".join(f"{r['run_dir']}/logs" for r in runs.values())
        raise DemoError(
            f"pipeline {pipeline['id']} {pipeline['status']}: {pipeline['status_reason'] or 'no reason given'}"
            f" (logs: {logs or '-'}, {home}/worker.log)"
        )
    summary = _summary(
        rl,
        sft,
        runs["sft"]["spec"]["max_steps"],
        t0,
        runs["rl"]["run_dir"],
        pipeline_id=pipeline["id"],
        run_id=runs["rl"]["id"],
        sft_run_id=runs["sft"]["id"],
        eval_run_id=runs["eval"]["id"],
        eval_reward_greedy=ev.get("reward_mean"),
        eval_temperature=ev.get("temperature"),
        dashboard_url=dashboard,
    )
    summary["status"] = pipeline["status"]
    _write(summary_path, summary)
    say(
        f"the dashboard stopped with the demo; to see this pipeline again: asyncrl demo --serve --output-dir {output_dir}"
    )
    return summary


def serve_demo(output_dir: str, *, port: int = 8000) -> None:
    """``asyncrl demo --serve``: the embedded service again on an earlier demo's state (``<output_dir>/service``),
    its dashboard on ``127.0.0.1:port`` with a new login token, until Ctrl-C.

    Raises:
        SpecError: no demo state in ``output_dir``.
        DemoError: the service did not start (port taken, ...) or stopped.
    """
    home = Path(output_dir).resolve() / "service"
    if not (home / "asyncrl.db").is_file():
        raise SpecError(f"--output-dir: no demo state in {home} (run `asyncrl demo --output-dir {output_dir}` first)")
    # Ctrl-C stops it even when started with SIGINT ignored (a script's `&` job, or a parent that ignores it)
    signal.signal(signal.SIGINT, _interrupt)
    with embedded_service(home, model_roots=[home.parent / "model"], port=port) as service:
        say(f"dashboard: {service.url}/pipelines (log in with the token {service.token}); Ctrl-C stops it")
        while all(_alive(pid) for pid in service.pids.values()):
            time.sleep(1.0)
        raise DemoError(f"the server or worker stopped (logs: {home / 'server.log'}, {home / 'worker.log'})")


def _alive(pid: int) -> bool:
    from worker.run.procs import alive

    return alive(pid)
