"""The one rule for code a spec names (``worker/spec/user_code.py``): built-ins, registered entry points, allowed
packages; every ``ImportPath`` field of a spec goes through it; reading it imports neither verifiers nor torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.spec import validate_spec
from worker.spec.user_code import (
    BUILTIN_ENVS,
    ENV_ID,
    HARNESS_ID,
    CodeNotAllowed,
    check_import_path,
    check_spec_code,
    import_paths,
    verifiers_harnesses,
)

REPO = Path(__file__).resolve().parents[4]
BUILTINS = "arithmetic, reverse_text, reverse_tool, reverse_twice, self_play"


def fake_distribution(site: Path, entry_points: str) -> None:
    """An installed package ``fakeenvs`` (a dist-info folder on ``site``) registering ``entry_points``; its
    ``make`` returns a 3-task reverse_text eval split."""
    (site / "fakeenvs").mkdir(parents=True)
    (site / "fakeenvs" / "__init__.py").write_text(
        "from worker.envs.reverse_text import ReverseTextConfig, ReverseTextTaskset\n"
        "def make(split='train', seed=0):\n"
        "    return ReverseTextTaskset(ReverseTextConfig(split=split, seed=seed, num_eval=3))\n"
        "from subprocess import run\n"
    )
    info = site / "fakeenvs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeenvs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.mark.parametrize("value", ["arithmetic", "reverse_text", "reverse_tool", "reverse_twice"])
def test_builtins_pass_with_nothing_allowed(value: str) -> None:
    check_import_path("env.id", value, (), ENV_ID)


@pytest.mark.parametrize(
    "value",
    [
        "os:system",
        "subprocess:run",
        "builtins:eval",
        "mypkg.envs:make",
        "worker.envs.reverse_text:ReverseTextTaskset",  # built-ins by their id only: `worker` is not a code package
        "nope",
    ],
)
def test_anything_else_is_refused_naming_the_key(value: str) -> None:
    with pytest.raises(CodeNotAllowed) as info:
        check_import_path("env.id", value, (), ENV_ID)
    assert str(info.value) == (
        f"env.id: {value!r} is not allowed in a run submitted to the service; allowed: a built-in environment "
        f"({BUILTINS}) or package.module:attr from an allowed package (ALLOWED_CODE_PACKAGES: none)"
    )


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("mypkg:make", True),
        ("mypkg.envs.math:load_environment", True),
        ("mypkg:_private", False),  # a private name is not an entry point
        ("mypkg.:make", False),
        ("mypkg", False),  # no attribute
        ("mypkg:a.b", False),
        ("mypkgevil:make", False),  # the top-level package, not a prefix of it
        ("os:system", False),
    ],
)
def test_allowed_package_by_its_top_level_name(value: str, ok: bool) -> None:
    if ok:
        check_import_path("env.id", value, ["mypkg"], ENV_ID)
        return
    with pytest.raises(CodeNotAllowed, match=r"ALLOWED_CODE_PACKAGES: mypkg\)$"):
        check_import_path("env.id", value, ["mypkg"], ENV_ID)


def test_generic_import_path_of_a_future_field() -> None:
    """The rule every future ``import_path`` (custom loss, advantage, gate) goes through: no built-ins."""
    check_import_path("trainer.loss.import_path", "mypkg.losses:my_loss", ["mypkg"])
    with pytest.raises(CodeNotAllowed) as info:
        check_import_path("trainer.loss.import_path", "os:system", ["mypkg"])
    assert str(info.value) == (
        "trainer.loss.import_path: 'os:system' is not allowed in a run submitted to the service; allowed: "
        "package.module:attr from an allowed package (ALLOWED_CODE_PACKAGES: mypkg)"
    )


def test_harness_ids_are_verifiers_own_or_an_allowed_module() -> None:
    own = verifiers_harnesses()
    assert {"null", "bash"} <= set(own) and "utils" not in own
    for value in ("null", "bash", "owner/mypkg@1.0", "my-pkg"):
        check_import_path("orchestrator.harness.id", value, ["mypkg", "my_pkg"], HARNESS_ID)
    for value in ("antigravity", "os", "owner/os@1"):
        with pytest.raises(CodeNotAllowed, match=r"^orchestrator\.harness\.id: .* allowed: a built-in harness \("):
            check_import_path("orchestrator.harness.id", value, ["mypkg"], HARNESS_ID)


def test_entry_points_are_allowed_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_distribution(tmp_path, "[asyncrl.environments]\nfake_reverse = fakeenvs:make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_import_path("env.id", "fake_reverse", (), ENV_ID)
    with pytest.raises(CodeNotAllowed) as info:
        check_import_path("env.id", "fakeenvs:run", (), ENV_ID)  # the package itself is not allowed
    assert "one registered under the 'asyncrl.environments' entry points (fake_reverse)" in str(info.value)


def test_every_import_path_of_a_spec_is_found_and_checked() -> None:
    spec = validate_spec(
        "rl", {"model": {"name": "m"}, "env": {"id": "os:system"}, "orchestrator": {"harness": {"id": "bash"}}}
    )
    assert [(key, value) for key, value, _ in import_paths(spec)] == [
        ("env.id", "os:system"),
        ("orchestrator.harness.id", "bash"),
    ]
    with pytest.raises(CodeNotAllowed, match=r"^env\.id: 'os:system' is not allowed"):
        check_spec_code(spec, ())
    check_spec_code(spec, ["os"])  # the admin's choice
    sft = validate_spec("sft", {"model": {"name": "m"}, "env": {"id": "subprocess:run"}})
    with pytest.raises(CodeNotAllowed, match=r"^env\.id: 'subprocess:run' is not allowed"):
        check_spec_code(sft, ())


def test_checking_imports_neither_verifiers_nor_torch() -> None:
    code = (
        "import sys, json\n"
        "from worker.spec import validate_spec\n"
        "from worker.spec.user_code import check_spec_code, CodeNotAllowed, verifiers_harnesses\n"
        "spec = validate_spec('rl', {'model': {'name': 'm'}, 'env': {'id': 'arithmetic'}})\n"
        "check_spec_code(spec, ())\n"
        "assert verifiers_harnesses()\n"
        "print(json.dumps([m for m in ('verifiers', 'torch', 'vllm') if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_readme_names_every_built_in_environment_a_submitted_spec_may_use() -> None:
    readme = (Path(__file__).resolve().parents[4] / "docs" / "service.md").read_text()  # the README's service page
    rule = readme[readme.index("**What a submitted spec may run.**") :].split("\n\n", 1)[0]
    assert [env for env in BUILTIN_ENVS if f"`{env}`" not in rule] == []
