"""A run's folder is its own uid's and the server's group's only, and a pipeline stage still starts from the stage
before's weights: a root ``asyncrl server`` + ``asyncrl worker`` in embedded mode (defaults: each run as its own uid
``DEFAULT_RUN_UID_BASE + id``) runs an SFT -> SFT pipeline on the tiny random-init Qwen3. Stage 1's model is stage
0's ``final/`` folder, which stage 1's uid cannot enter: the worker copies it into stage 1's home before stage 1
starts (``worker.run.inputs``), and stage 1 completes from that copy. Then, kernel-checked: each stage's uid gets
``PermissionError`` reading or listing the other's files, reads its own, and a uid of the server's group (the group of
the folder of homes) reads both; every home is 2750.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.uids import probe_as
from worker.demo import TERMINAL, embedded_service
from worker.launchers import supervisor
from worker.spec import load_spec_data

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="a root worker's runs, as their uids")]

REPO = Path(__file__).resolve().parents[2]


def test_a_stage_cannot_read_the_stage_befores_folder_yet_starts_from_its_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.policy.models import init_model

    for name in ("SECRET_KEY", "RUN_USER", "RUN_UID_BASE"):
        monkeypatch.delenv(name, raising=False)
    state = tmp_path / "home"
    model = init_model(state / "outputs" / "models" / "tiny", size="tiny", seed=0)
    overrides = {
        "model.name": str(model),
        "max_steps": "8",
        "data.num_examples": "32",
        "data.batch_size": "4",
        "scheduler.warmup_steps": "1",
        "eval_examples": "2",
        "threads": "1",
    }
    sft = load_spec_data([REPO / "configs/reverse_text/sft.toml"], list(overrides.items()))
    then = {k: v for k, v in sft.items() if k != "model"}  # stage 1's model: stage 0's final weights, set by the chain
    body = {"name": "locked", "stages": [{"kind": "sft", "base": sft}, {"kind": "sft", "base": then}]}
    with (
        embedded_service(state) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}) as client,
    ):
        resp = client.post("/api/pipelines", json=body)
        assert resp.status_code == 201, resp.text
        pid = resp.json()["id"]
        deadline = time.monotonic() + 900
        while (pipe := client.get(f"/api/pipelines/{pid}").json())["status"] == "running":
            assert time.monotonic() < deadline, f"the pipeline did not end within 900 s: {pipe}"
            time.sleep(1)
        assert pipe["status"] == "completed", pipe.get("status_reason")
        runs: list[dict[str, Any]] = [client.get(f"/api/runs/{s['run_id']}").json() for s in pipe["stages"]]
        assert [r["status"] for r in runs] == ["completed", "completed"], [r["status_reason"] for r in runs]
        assert all(r["status"] in TERMINAL for r in runs)
        logs = client.get(f"/api/runs/{runs[1]['id']}/logs", params={"process": "supervisor"})
    a, b = (Path(r["run_dir"]) for r in runs)
    uid_a, uid_b = (supervisor.DEFAULT_RUN_UID_BASE + r["id"] for r in runs)

    # stage 1 started from its own copy of stage 0's final weights; its stored spec names stage 0's folder
    copy = b.parent / "inputs" / "model.name" / "final"
    assert runs[1]["spec"]["model"]["name"] == f"{a}/final"
    assert json.loads((b / "config.json").read_text())["model"]["name"] == str(copy)
    assert (copy / "model.safetensors").read_bytes() == (a / "final" / "model.safetensors").read_bytes()
    assert (copy / "model.safetensors").stat().st_uid == uid_b
    assert (b / "final" / "model.safetensors").exists()
    assert logs.status_code == 200 and logs.json()["lines"], logs.text  # the server still reads the run's files

    # each uid is kept out of the other's folder, reads its own; the server's group reads both
    group = (a.parent.parent).stat().st_gid
    files = {
        a: [a.parent / "spec.json", a / "final" / "model.safetensors", a / "metrics.jsonl", a.parent],
        b: [b.parent / "spec.json", copy / "model.safetensors", b / "metrics.jsonl", b.parent],
    }
    assert probe_as(files[a], uid_b, uid_b) == ["denied"] * 4
    assert probe_as(files[b], uid_a, uid_a) == ["denied"] * 4
    assert probe_as(files[a], uid_a, uid_a) == ["read"] * 4
    assert probe_as(files[b], uid_b, uid_b) == ["read"] * 4
    assert probe_as(files[a] + files[b], uid_b + 1000, group) == ["read"] * 8  # not a run's uid, the server's group
    for home, uid in ((a.parent, uid_a), (b.parent, uid_b)):
        st = home.stat()
        assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o7777)) == (uid, group, "0o2750")
    print(f"runs {runs[0]['id']} (uid {uid_a}) and {runs[1]['id']} (uid {uid_b}): each denied the other's files")
