"""Live config in the run directory: the per-process reader/applier, acks, resume, the lr re-basing of the
trainer's scheduler, and ``asyncrl config set``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from worker.cli import main
from worker.live_config import (
    ACKS_FILE,
    LIVE_CONFIG_FILE,
    LiveConfig,
    append_revision,
    applied_changes,
    read_revisions,
    replay_in_effect,
    set_base_lr,
    set_local,
)
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import RLSpec, SpecError, validate_spec

REPO = Path(__file__).resolve().parents[3]


def make_run_dir(tmp_path: Path, **spec: object) -> tuple[Path, RLSpec]:
    data = {
        "model": {"name": "m"},
        "orchestrator": {"max_tokens": 32, "temperature": 1.0},
        "trainer": {"optim": {"lr": 1e-4}},
        **spec,
    }
    resolved = validate_spec("rl", data)
    assert isinstance(resolved, RLSpec)
    (tmp_path / "config.json").write_text(resolved.model_dump_json())
    return tmp_path, resolved


def acks(run_dir: Path) -> list[tuple[int, str, int]]:
    return [(a["revision"], a["process"], a["step"]) for a in read_jsonl(run_dir / ACKS_FILE)]


def test_each_process_applies_its_own_keys_once_and_acks_the_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir, spec = make_run_dir(tmp_path)
    trainer, orch = LiveConfig(run_dir, "trainer"), LiveConfig(run_dir, "orchestrator")
    same, changed = trainer.apply(spec, 1)
    assert same is spec and changed == {}  # no file yet
    append_revision(run_dir, 1, {"trainer.optim.lr": 5e-5, "orchestrator.temperature": 1.5})
    with caplog.at_level(logging.INFO, logger="asyncrl.live_config"):
        t_spec, t_changed = trainer.apply(spec, 3)
    assert t_changed == {"trainer.optim.lr": 5e-5}
    assert t_spec.trainer.optim.lr == 5e-5 and t_spec.orchestrator.temperature == 1.0
    assert caplog.messages == ["live config revision 1 in effect from step 3: {'trainer.optim.lr': 5e-05}"]
    o_spec, o_changed = orch.apply(spec, 5)
    assert o_changed == {"orchestrator.temperature": 1.5} and o_spec.orchestrator.temperature == 1.5
    assert o_spec.trainer.optim.lr == 1e-4
    assert trainer.apply(t_spec, 4) == (t_spec, {})  # read once: the offset moved past it
    assert acks(run_dir) == [(1, "trainer", 3), (1, "orchestrator", 5)]

    # a revision with only another process's keys is not acked by this one; later revisions win
    append_revision(run_dir, 2, {"orchestrator.max_tokens": 20})
    append_revision(run_dir, 3, {"trainer.optim.lr": 2e-5})
    t_spec, t_changed = trainer.apply(t_spec, 6)
    assert t_changed == {"trainer.optim.lr": 2e-5} and t_spec.trainer.optim.lr == 2e-5
    o_spec, o_changed = orch.apply(o_spec, 7)
    assert o_changed == {"orchestrator.max_tokens": 20} and o_spec.orchestrator.max_tokens == 20
    assert acks(run_dir)[2:] == [(3, "trainer", 6), (2, "orchestrator", 7)]


def test_a_half_written_line_waits_and_a_refused_revision_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir, spec = make_run_dir(tmp_path)
    reader = LiveConfig(run_dir, "orchestrator")
    line = json.dumps({"revision": 1, "changes": {"orchestrator.temperature": 0.7}}) + "\n"
    (run_dir / LIVE_CONFIG_FILE).write_text(line[:20])
    assert reader.apply(spec, 1) == (spec, {})
    with (run_dir / LIVE_CONFIG_FILE).open("a") as f:
        f.write(line[20:])
        # a hand-edited line the schema refuses (max_tokens >= max_model_len): logged, never acked
        f.write(json.dumps({"revision": 2, "changes": {"orchestrator.max_tokens": 9999}}) + "\n")
    with caplog.at_level(logging.ERROR, logger="asyncrl.live_config"):
        new, changed = reader.apply(spec, 2)
    assert changed == {"orchestrator.temperature": 0.7} and new.orchestrator.max_tokens == 32
    assert acks(run_dir) == [(1, "orchestrator", 2)]
    assert caplog.messages == [
        "live config revision 2 refused: orchestrator.max_tokens: must be below inference.max_model_len (512), got 9999"
    ]


def test_resume_reapplies_everything_and_acks_only_steps_the_checkpoint_does_not_cover(tmp_path: Path) -> None:
    run_dir, spec = make_run_dir(tmp_path)
    append_revision(run_dir, 1, {"trainer.optim.lr": 5e-5})
    append_revision(run_dir, 2, {"trainer.optim.lr": 3e-5})
    # the first life of the run acked revision 1 at step 3 and revision 2 at step 9, then died
    (run_dir / ACKS_FILE).write_text(
        json.dumps({"revision": 1, "process": "trainer", "step": 3})
        + "\n"
        + json.dumps({"revision": 2, "process": "trainer", "step": 9})
        + "\n"
    )
    resumed = LiveConfig(run_dir, "trainer", start_step=5)  # checkpoint 5: covers step 3, not step 9
    new, changed = resumed.apply(spec, 6)
    assert new.trainer.optim.lr == 3e-5 and changed == {"trainer.optim.lr": 3e-5}
    assert acks(run_dir)[2:] == [(2, "trainer", 6)]  # revision 1 re-applied silently


def test_set_base_lr_continues_the_schedule_from_the_new_base() -> None:
    import torch

    from worker.spec import SchedulerConfig
    from worker.trainer.optim import build_optimizer, build_scheduler

    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, RLSpec.model_validate({"model": {"name": "m"}}).trainer.optim)
    scheduler = build_scheduler(optimizer, SchedulerConfig(type="linear", warmup_steps=4), max_steps=12)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * 3 / 4)  # warm-up step 3 of 4
    set_base_lr(optimizer, scheduler, 5e-5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-5 * 3 / 4)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-5)  # warm-up done
    for _ in range(4):
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-5 * (1 - 3 / 8))  # linear decay, 3 of 8 steps
    restored = build_scheduler(optimizer, SchedulerConfig(type="linear", warmup_steps=4), max_steps=12)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.base_lrs == [5e-5]  # a checkpoint keeps the new base


def test_config_set_cli_numbers_revisions_and_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = make_run_dir(tmp_path, inference={"max_model_len": 64})
    assert main(["config", "set", str(run_dir), "trainer.optim.lr=5e-5", "orchestrator.temperature=1.2"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "revision": 1,
        "changes": {"trainer.optim.lr": 5e-5, "orchestrator.temperature": 1.2},
    }
    assert set_local(run_dir, ["orchestrator.max_tokens=40"])["revision"] == 2
    for argv, line in [
        (["trainer.optim.betas=[0.5, 0.9]"], "error: trainer.optim.betas: not a live key; only these change"),
        (
            ["orchestrator.max_tokens=40", "orchestrator.max_tokens=64"],
            "error: orchestrator.max_tokens: must be below inference.max_model_len (64), got 64",
        ),
        (["trainer.optim.lr=0"], "error: trainer.optim.lr: Input should be greater than 0"),
        (["trainer.optim.lr"], "error: expected key=value, got 'trainer.optim.lr'"),
    ]:
        assert main(["config", "set", str(run_dir), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(line), err
    assert [r["revision"] for r in read_revisions(run_dir)] == [1, 2]  # nothing written by the refusals
    assert main(["config", "set", str(tmp_path / "nope"), "trainer.optim.lr=1e-5"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: run directory {tmp_path / 'nope'}: no config.json (start the run first)"
    )
    assert not (tmp_path / "nope").exists()


def test_set_local_checks_values_against_earlier_revisions(tmp_path: Path) -> None:
    run_dir, _ = make_run_dir(tmp_path, inference={"max_model_len": 64})
    set_local(run_dir, ["orchestrator.max_tokens=50"])
    with pytest.raises(SpecError, match="orchestrator.max_tokens: must be below"):
        set_local(run_dir, ["orchestrator.max_tokens=64"])


def test_config_set_refuses_a_run_that_ended_and_takes_it_again_once_resumed(tmp_path: Path) -> None:
    run_dir, _ = make_run_dir(tmp_path, inference={"max_model_len": 64})
    events = RunDir(run_dir)
    for kind in ("starting", "running", "truncated", "completed"):
        events.log_event(kind)
    with pytest.raises(SpecError) as err:
        set_local(run_dir, ["trainer.optim.lr=1e-5"])
    assert str(err.value) == (
        f"run directory {run_dir}: the run is completed: config changes only while it runs "
        "(resume it first: asyncrl rl ... --resume)"
    )
    assert read_revisions(run_dir) == []
    events.log_event("starting", resume_step=4)
    assert set_local(run_dir, ["trainer.optim.lr=1e-5"])["revision"] == 1


def test_imports_nothing_heavy() -> None:
    code = (
        "import sys, json, worker.live_config\n"
        "print(json.dumps([m for m in ('torch', 'vllm', 'fastapi', 'transformers', 'httpx') if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ----------------------------------------------------------------------------- keys grown by issue 17 (item 7)

IPO = {"trainer": {"loss": {"type": "ipo"}}}
ICEPOP = {"trainer": {"loss": {"type": "icepop"}}}
POOL = {"orchestrator": {"curriculum": {"type": "difficulty_pool"}}}


@pytest.mark.parametrize(
    ("key", "tables", "good", "read", "bad", "error"),
    [
        (
            "orchestrator.group_size",
            {},
            "4",
            lambda s: s.orchestrator.group_size,
            "1",
            "orchestrator.group_size: GRPO needs at least 2 rollouts per group, got 1",
        ),
        (
            "orchestrator.batch_size",
            {},
            "16",
            lambda s: s.orchestrator.batch_size,
            "0",
            "orchestrator.batch_size: Input should be greater than or equal to 1, got 0",
        ),
        (
            "trainer.loss.kl_tau",
            {},
            "0.01",
            lambda s: s.trainer.loss.kl_tau,
            "-1",
            "trainer.loss.kl_tau: Input should be greater than or equal to 0, got -1",
        ),
        (
            "trainer.loss.mask_low",
            {},
            "0.1",
            lambda s: s.trainer.loss.mask_low,
            "0",
            "trainer.loss.mask_low: Input should be greater than 0, got 0",
        ),
        (
            "trainer.loss.mask_high",
            {},
            "0.3",
            lambda s: s.trainer.loss.mask_high,
            "1.5",
            "trainer.loss.mask_high: Input should be less than or equal to 1, got 1.5",
        ),
        (
            "trainer.loss.epsilon",
            IPO,
            "0.1",
            lambda s: s.trainer.loss.epsilon,
            "2",
            "trainer.loss.epsilon: Input should be less than or equal to 1, got 2",
        ),
        (
            "trainer.loss.band",
            ICEPOP,
            "[0.4, 6]",
            lambda s: list(s.trainer.loss.band),
            "[1.5, 5]",
            "trainer.loss.band: expected [low, high] with 0 < low < 1 < high, got [1.5, 5]",
        ),
        (
            "orchestrator.curriculum.weights.hard",
            POOL,
            "0.5",
            lambda s: s.orchestrator.curriculum.weights.hard,
            "-0.1",
            "orchestrator.curriculum.weights.hard: Input should be greater than or equal to 0, got -0.1",
        ),
        (
            "orchestrator.curriculum.weights.unseen",
            POOL,
            "2",
            lambda s: s.orchestrator.curriculum.weights.unseen,
            "1e9",
            "orchestrator.curriculum.weights.unseen: Input should be less than or equal to 1000000, got 1000000000.0",
        ),
    ],
)
def test_issue17_live_key_is_validated_and_applied_at_the_step_boundary(
    tmp_path: Path, key: str, tables: dict[str, object], good: str, read: object, bad: str, error: str
) -> None:
    run_dir, spec = make_run_dir(tmp_path, **tables)
    with pytest.raises(SpecError) as err:  # the bad value: one line naming the key, nothing written
        set_local(run_dir, [f"{key}={bad}"])
    assert str(err.value) == error
    assert read_revisions(run_dir) == []
    process = "orchestrator" if key.startswith("orchestrator") else "trainer"
    live = LiveConfig(run_dir, process)
    assert live.apply(spec, 2) == (spec, {})  # step 2 runs with the old value
    written = set_local(run_dir, [f"{key}={good}"])
    value = json.loads(json.dumps(written["changes"][key]))
    new, changed = live.apply(spec, 3)  # the next step boundary: in effect from step 3, acked there
    assert changed == {key: value} and read(new) == value and read(spec) != value  # type: ignore[operator]
    assert acks(run_dir) == [(1, process, 3)]


def test_a_loss_key_of_another_loss_type_is_refused_naming_the_run_type(tmp_path: Path) -> None:
    run_dir, _ = make_run_dir(tmp_path, **IPO)
    with pytest.raises(SpecError) as err:
        set_local(run_dir, ["trainer.loss.kl_tau=0.1"])
    assert str(err.value).startswith(
        "trainer.loss.kl_tau: not a field of this run's trainer.loss (type 'ipo'); the run's live keys: "
        "trainer.optim.lr, orchestrator.temperature,"
    )
    assert "trainer.loss.epsilon" in str(err.value) and "trainer.loss.mask_low" not in str(err.value)


def test_a_curriculum_weight_of_the_standard_curriculum_is_refused_naming_its_type(tmp_path: Path) -> None:
    run_dir, _ = make_run_dir(tmp_path)
    with pytest.raises(SpecError) as err:
        set_local(run_dir, ["orchestrator.curriculum.weights.hard=0.5"])
    assert str(err.value).startswith(
        "orchestrator.curriculum.weights.hard: not a field of this run's orchestrator.curriculum (type 'standard')"
    )
    assert read_revisions(run_dir) == []


def test_replay_in_effect_counts_a_key_from_the_step_its_process_acknowledged() -> None:
    """Spec lr 1e-4, temperature 1.0. r1 = lr 5e-5 (trainer from step 3); r2 = temperature 1.3 + lr 3e-5 (orchestrator
    from 5, trainer from 7); r3 = lr 1e-5, never acknowledged. By hand, (lr, temperature) in effect at step:
    2 -> (1e-4, 1.0); 3 and 4 -> (5e-5, 1.0); 5 and 6 -> (5e-5, 1.3); 7 and at the end -> (3e-5, 1.3): r3 never."""
    spec = {"trainer": {"optim": {"lr": 1e-4}}, "orchestrator": {"temperature": 1.0}, "max_steps": 9}
    revisions = [
        ({"trainer.optim.lr": 5e-5}, {"trainer": 3}),
        ({"orchestrator.temperature": 1.3, "trainer.optim.lr": 3e-5}, {"orchestrator": 5, "trainer": 7}),
        ({"trainer.optim.lr": 1e-5}, {}),
    ]

    def at(step: int | None) -> tuple[float, float]:
        out = replay_in_effect(spec, revisions, step)
        return out["trainer"]["optim"]["lr"], out["orchestrator"]["temperature"]

    assert [at(s) for s in (2, 3, 4, 5, 6, 7, None)] == [
        (1e-4, 1.0),
        (5e-5, 1.0),
        (5e-5, 1.0),
        (5e-5, 1.3),
        (5e-5, 1.3),
        (3e-5, 1.3),
        (3e-5, 1.3),
    ]
    assert spec["trainer"]["optim"]["lr"] == 1e-4  # not changed in place
    assert applied_changes(*revisions[1], step=6) == {"orchestrator.temperature": 1.3}
    assert applied_changes(*revisions[2]) == {}
