"""``asyncrl`` command line (``worker/cli.py``): exit code 2 and one ``error:`` line for bad input, nothing on disk."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from worker.cli import main

REPO = Path(__file__).resolve().parents[2]
RL_TOML = str(REPO / "configs/reverse_text/rl.toml")
SFT_TOML = str(REPO / "configs/reverse_text/sft.toml")


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``main(argv)``, expect exit 2 and exactly one ``error:`` line on stderr; return that line."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert out == ""
    return lines[0]


def _nothing_under(path: Path) -> bool:
    return not path.exists() or not any(path.iterdir())


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "outputs"


# ----------------------------------------------------------------------------- spec errors (no heavy imports)


def test_unknown_key(capsys: pytest.CaptureFixture[str], out_dir: Path) -> None:
    line = _fails(capsys, ["rl", "@", RL_TOML, "--trainer.optim.lrr", "1e-5", "--output_dir", str(out_dir)])
    assert line == "error: unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)"
    assert _nothing_under(out_dir)


def test_missing_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path, out_dir: Path) -> None:
    missing = tmp_path / "nope.toml"
    line = _fails(capsys, ["rl", "@", str(missing), "--output_dir", str(out_dir)])
    assert line == f"error: config file not found: {missing}"
    assert _nothing_under(out_dir)


def test_invalid_toml(capsys: pytest.CaptureFixture[str], tmp_path: Path, out_dir: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[trainer\n')
    line = _fails(capsys, ["sft", f"@{bad}", "--output_dir", str(out_dir)])
    assert line.startswith(f"error: {bad}: not valid TOML")
    assert _nothing_under(out_dir)


def test_override_missing_value(capsys: pytest.CaptureFixture[str], out_dir: Path) -> None:
    line = _fails(capsys, ["rl", "@", RL_TOML, "--output_dir", str(out_dir), "--max_steps"])
    assert line == "error: --max_steps: missing value"
    assert _nothing_under(out_dir)


def test_group_size_one(capsys: pytest.CaptureFixture[str], out_dir: Path) -> None:
    line = _fails(capsys, ["rl", "@", RL_TOML, "--orchestrator.group_size", "1", "--output_dir", str(out_dir)])
    assert line == "error: orchestrator.group_size: GRPO needs at least 2 rollouts per group, got 1"
    assert _nothing_under(out_dir)


def test_stray_argument_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    line = _fails(capsys, ["rl", "@", RL_TOML, "stray"])
    assert "unexpected argument 'stray'" in line
    assert main(["frobnicate"]) == 2
    capsys.readouterr()


def test_dry_run_prints_resolved_json(capsys: pytest.CaptureFixture[str], out_dir: Path) -> None:
    code = main(["rl", "@", RL_TOML, "--trainer.optim.lr", "1e-5", "--orchestrator.group-size", "4",
                 "--trainer.loss.type=icepop", "--trainer.loss.band", "[0.5, 4]", "--output_dir", str(out_dir),
                 "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    spec = json.loads(out)
    assert spec["trainer"]["optim"]["lr"] == 1e-5  # override
    assert spec["orchestrator"]["group_size"] == 4  # override, dashes become underscores
    assert spec["trainer"]["loss"] == {"ratio_level": "token", "type": "icepop", "band": [0.5, 4.0]}
    assert spec["orchestrator"]["batch_size"] == 8  # from the file
    assert spec["max_steps"] == tomllib.loads(Path(RL_TOML).read_text())["max_steps"]  # from the file
    assert spec["trainer"]["optim"]["weight_decay"] == 0.0  # default
    assert spec["output_dir"] == str(out_dir)
    assert spec["kind"] == "rl"
    assert _nothing_under(out_dir)


def test_dry_run_later_file_wins(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    extra = tmp_path / "more.toml"
    extra.write_text("max_steps = 7\n[optim]\nlr = 0.5\n")
    assert main(["sft", "@", SFT_TOML, "@", str(extra), "--max_steps", "9", "--dry-run"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert (spec["max_steps"], spec["optim"]["lr"], spec["seq_len"]) == (9, 0.5, 256)


# ----------------------------------------------------------------------------- preflight (launcher)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "m")


def test_rl_missing_model_path(capsys: pytest.CaptureFixture[str], tmp_path: Path, out_dir: Path) -> None:
    missing = tmp_path / "no-such-model"
    line = _fails(capsys, ["rl", "@", RL_TOML, "--model.name", str(missing), "--output_dir", str(out_dir)])
    assert line.startswith("error: model.name: ")
    assert str(missing) in line
    assert _nothing_under(out_dir)


def test_rl_bad_env_id(capsys: pytest.CaptureFixture[str], model_dir: Path, out_dir: Path) -> None:
    line = _fails(capsys, ["rl", "@", RL_TOML, "--model.name", str(model_dir), "--env.id", "nope.module:thing",
                           "--output_dir", str(out_dir)])
    assert line.startswith("error: env: ")
    assert "nope.module:thing" in line
    assert _nothing_under(out_dir)


def test_rl_seq_len_too_small(capsys: pytest.CaptureFixture[str], model_dir: Path, out_dir: Path) -> None:
    line = _fails(capsys, ["rl", "@", RL_TOML, "--model.name", str(model_dir), "--orchestrator.seq_len", "50",
                           "--output_dir", str(out_dir), "--name", "short"])
    assert line.startswith("error: orchestrator.seq_len: 50 tokens cannot hold a ")
    assert "max_tokens 48" in line
    assert not (out_dir / "short").exists()
    assert _nothing_under(out_dir)
