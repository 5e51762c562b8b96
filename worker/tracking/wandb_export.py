"""Export of a run to Weights & Biases (``[monitor.wandb]``): one W&B run per asyncrl run, fed from its run directory.

The run's processes write ``metrics.jsonl``, ``events.jsonl`` and ``live_config.jsonl`` as always; the process that
follows the run (the local launcher's follow loop, which a service run's supervisor runs too) reads what is new in
them every half second (:meth:`WandbExport.poll`) and logs it into one W&B run, so the trainer's and the
orchestrator's metrics share a run without either process holding W&B state:

- a metrics row ``{"source": s, "step": n, "k": v, ...}`` becomes ``log({"step": n, "s/k": v, ...})``: the names of
  the dashboard and ``metrics.jsonl``, with ``step`` (the policy version) as every chart's x axis
  (``define_metric("*", step_metric="step")``), so rows of different sources may arrive out of step order;
- events and live config revisions become rows of the ``events`` table (step, time, event, reason, the rest as JSON)
  logged with each poll that saw some; a config revision also updates the run config;
- the W&B run id and the read offsets are kept in ``<run dir>/wandb_export.json``: a resumed run continues the same
  W&B run and logs no row twice (a step rerun after a resume keeps the value W&B first got for it).

``mode = "offline"`` writes the W&B run under ``<run dir>/wandb`` without network; ``wandb sync`` uploads it.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from worker.live_config import LIVE_CONFIG_FILE
from worker.run.rundir import RunDir, atomic_write_json, read_jsonl_after
from worker.spec import RLSpec

logger = logging.getLogger("asyncrl.wandb")
STATE_FILE = "wandb_export.json"


def metric_row(row: dict[str, Any]) -> dict[str, float | int]:
    """The W&B ``log`` payload of one ``metrics.jsonl`` row: ``step`` and ``<source>/<key>`` for each finite number
    (booleans, strings, lists and NaN/inf left out: W&B charts numbers)."""
    source = row["source"]
    out: dict[str, float | int] = {"step": int(row["step"])}
    for key, value in row.items():
        if key in ("source", "step", "time") or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[f"{source}/{key}"] = value
    return out


class WandbExport:
    """Feeds one W&B run from the run directory ``run`` (see the module docstring).

    Raises:
        ImportError: the ``wandb`` package is not installed (``pip install -e .[wandb]``).
    """

    def __init__(self, spec: RLSpec, run: RunDir) -> None:
        import wandb

        cfg = spec.monitor.wandb
        assert cfg is not None
        self.run = run
        self.state_path = run.root / STATE_FILE
        state = self._load_state()
        self.state = state
        self.wb = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or spec.name,
            group=cfg.group,
            tags=cfg.tags or None,
            mode=cfg.mode,
            dir=str(run.root),
            id=state["id"] or None,
            resume="allow",
            config=spec.model_dump(mode="json"),
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        state["id"] = self.wb.id
        self.wb.define_metric("step")
        self.wb.define_metric("*", step_metric="step")
        self._table_columns: list[str | int] = ["step", "time", "event", "reason", "data"]

    def _load_state(self) -> dict[str, Any]:
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            state = {}
        return {
            "id": state.get("id"),
            "offsets": {k: int(v) for k, v in (state.get("offsets") or {}).items()},
            "logged": {k: int(v) for k, v in (state.get("logged") or {}).items()},
        }

    def poll(self) -> int:
        """Log what is new in the run directory; the number of metric rows logged."""
        offsets, logged = self.state["offsets"], self.state["logged"]
        rows, offsets["metrics"] = read_jsonl_after(self.run.metrics, offsets.get("metrics", 0))
        count = 0
        for row in rows:
            key = str(row.get("source"))
            if "step" not in row or (key != "eval" and int(row["step"]) <= logged.get(key, -1)):
                continue  # read again after a resume pruned the file: W&B has it
            self.wb.log(metric_row(row))
            logged[key] = max(int(row["step"]), logged.get(key, -1))
            count += 1
        events, offsets["events"] = read_jsonl_after(self.run.events, offsets.get("events", 0))
        revisions, offsets["live_config"] = read_jsonl_after(
            self.run.root / LIVE_CONFIG_FILE, offsets.get("live_config", 0)
        )
        table_rows = [self._event_row(e) for e in events]
        for rev in revisions:  # {"revision", "changes": {dotted key: value}, "time"}
            changes = rev.get("changes") or {}
            self.wb.config.update({f"live/{k}": v for k, v in changes.items()}, allow_val_change=True)
            table_rows.append(self._event_row({**rev, "event": "config_revision"}))
        if table_rows:
            import wandb

            self.wb.log({"events": wandb.Table(columns=self._table_columns, data=table_rows)})
        if rows or table_rows:
            atomic_write_json(self.state_path, self.state)
        return count

    @staticmethod
    def _event_row(e: dict[str, Any]) -> list[Any]:
        rest = {k: v for k, v in e.items() if k not in ("step", "time", "event", "reason")}
        return [e.get("step"), e.get("time"), str(e.get("event", "")), str(e.get("reason", "")), json.dumps(rest)]

    def finish(self, status: str) -> None:
        """Log the rest and close the W&B run with exit code 0 for ``completed``, 1 otherwise."""
        try:
            self.poll()
        finally:
            self.wb.summary["status"] = status
            self.wb.finish(exit_code=0 if status == "completed" else 1)


def start_export(spec: RLSpec, run: RunDir) -> WandbExport | None:
    """The run's W&B export when ``[monitor.wandb]`` is set; None otherwise, or when W&B cannot start (logged as
    a warning and a ``wandb_failed`` event: a run is not failed for its monitoring)."""
    if spec.monitor.wandb is None:
        return None
    try:
        return WandbExport(spec, run)
    except Exception as err:  # noqa: BLE001 - wandb raises its own errors for a bad key, a network error, ...
        logger.warning("W&B export off: %s", err)
        run.log_event("wandb_failed", reason=f"W&B export off: {type(err).__name__}: {err}")
        return None
