"""The declared arguments of the built-in environments (``worker/spec/env_args.py``): the allow-list of ``env.args``."""

from __future__ import annotations

import importlib

import pytest

from worker.spec import SpecError
from worker.spec.env_args import BUILTIN_ENV_ARGS, check_builtin_args
from worker.spec.user_code import BUILTIN_ENVS


@pytest.mark.parametrize("env_id", sorted(BUILTIN_ENVS))
def test_each_builtin_taskset_config_is_built_on_its_declared_args(env_id: str) -> None:
    from worker.envs import _config_type

    module, _, attr = BUILTIN_ENVS[env_id].partition(":")
    config = _config_type(getattr(importlib.import_module(module), attr))
    declared = BUILTIN_ENV_ARGS[env_id]
    assert issubclass(config, declared)
    for name, field in declared.model_fields.items():  # same defaults and bounds: the declared model's fields win
        assert config.model_fields[name].default == field.default, name
        assert config.model_fields[name].metadata == field.metadata, name
    # what the config has beyond the declared args: the run's split and seed, and verifiers' own fields
    assert set(config.model_fields) - set(declared.model_fields) == {"split", "seed", "id", "task", "system_prompt"}


@pytest.mark.parametrize(
    ("env_id", "args", "message"),
    [
        (
            "reverse_text",
            {"task": {"rewards": {"r": {"fn": "evil.py:f"}}}},
            "env.args.task: not an argument a submitted spec may give 'reverse_text'; allowed: max_chars, min_chars, "
            "num_eval, num_train, system_message",
        ),
        ("reverse_text", {"system_prompt": "/etc/passwd"}, "env.args.system_prompt: not an argument"),
        ("reverse_text", {"max_chars": "/etc/passwd"}, "env.args.max_chars: Input should be a valid integer"),
        ("reverse_text", {"max_chars": 3, "min_chars": 4}, "env.args: max_chars (3) must be >= min_chars (4)"),
        ("arithmetic", {"operators": ["**"]}, "env.args.operators.0: Input should be '+', '-', '*' or '/', got '**'"),
        ("self_play", {"num_solvers": 1}, "env.args.num_solvers: got 1; with one solver"),
        ("reverse_tool", {"task": {"tools": {"url": "http://evil.example"}}}, "env.args.task: not an argument"),
    ],
)
def test_undeclared_or_invalid_args_are_refused_naming_the_key(env_id: str, args: dict, message: str) -> None:
    with pytest.raises(SpecError) as err:
        check_builtin_args("env.args", env_id, args)
    assert str(err.value).startswith(message), str(err.value)


def test_declared_args_pass() -> None:
    check_builtin_args("env.1.args", "reverse_text", {"max_chars": 12, "system_message": False, "num_train": 64})
    check_builtin_args("env.args", "arithmetic", {"operators": ["+", "/"], "max_terms": 4})
