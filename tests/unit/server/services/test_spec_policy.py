"""The path and address rules of submitted specs (``server/services/spec_policy.py``): ``model.name`` under
``MODEL_ROOTS`` or a hub id, and the hosts a run listens on inside itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from server.services.spec_policy import AddressNotAllowed, check_model_name, check_run_host, nodelist
from worker.spec import SpecError, validate_spec


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``<tmp>/work`` is the working folder, ``<tmp>/work/outputs`` the one model root (given relative)."""
    work = tmp_path / "work"
    (work / "outputs" / "models" / "tiny").mkdir(parents=True)
    (work / "outputs" / "models" / "tiny" / "config.json").write_text("{}")
    (work / "outputs" / "escape").symlink_to(tmp_path)
    (work / "outside").mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.mark.parametrize(
    "name",
    [
        "Qwen/Qwen3-0.6B",
        "gpt2",
        "outputs/models/tiny",  # relative, under the root
        "./outputs/models/tiny",
    ],
)
def test_hub_ids_and_paths_under_a_root_pass(root: Path, name: str) -> None:
    check_model_name(name, ["outputs"])
    check_model_name(str(root / "outputs/models/tiny"), ["outputs"])  # absolute, same root


@pytest.mark.parametrize(
    "name",
    [
        "/etc",
        "/proc/self/root",
        "../work/outside",
        "outputs/../outside",
        "outputs/../../etc",
        "~/.ssh",
        "~root",
        "outside",  # hub-shaped, but a local folder outside the roots
        "outputs/escape/work/outside",  # through a symlink out of the root
        "outputs/escape",
        "a/b/../c",
        "model\x00name",
    ],
)
def test_paths_outside_the_roots_are_refused_naming_model_name(root: Path, name: str) -> None:
    with pytest.raises(SpecError) as err:
        check_model_name(name, ["outputs"])
    assert str(err.value) == (
        f"model.name: {name!r} is not allowed in a run submitted to the service; allowed: a hub id (org/name) or a "
        f"path under MODEL_ROOTS ({root / 'outputs'}), without '..' or '~'"
    )


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("outputs/reverse-text-sft/fnal", "no such model folder (under MODEL_ROOTS {root}/outputs)"),
        ("./outputs/nope", "no such model folder (under MODEL_ROOTS {root}/outputs)"),
        ("{root}/outputs/models/tiny2", "no such model folder (under MODEL_ROOTS {root}/outputs)"),
        ("outputs", "not a model folder (no config.json)"),
        ("outputs/models", "not a model folder (no config.json)"),
    ],
)
def test_a_path_under_a_root_this_server_sees_must_be_a_model_folder(root: Path, name: str, why: str) -> None:
    """A mistyped local model is refused at submit (HTTP 422), not at launch; hub ids are never looked up."""
    name = name.format(root=root)
    with pytest.raises(SpecError) as err:
        check_model_name(name, ["outputs"])
    assert str(err.value) == f"model.name: {name!r}: {why.format(root=root)}"


@pytest.mark.usefixtures("root")
def test_a_path_under_a_root_mounted_on_the_workers_only_is_judged_at_launch() -> None:
    check_model_name("/srv/not-on-this-machine/models/m", ["/srv/not-on-this-machine"])
    check_model_name("Qwen/Qwen3-0.6B", ["outputs"])  # a hub id: nothing on disk by that name


def test_a_root_that_is_itself_a_symlink_is_followed(root: Path, tmp_path: Path) -> None:
    real = tmp_path / "real-models"
    (real / "m").mkdir(parents=True)
    (real / "m" / "config.json").write_text("{}")
    (root / "models").symlink_to(real)
    check_model_name("models/m", ["models"])
    check_model_name(str(real / "m"), [str(root / "models")])
    assert os.path.realpath(root / "models") == str(real)


def _slurm(*extra: str) -> object:
    return validate_spec(
        "rl", {"model": {"name": "x"}, "launcher": {"kind": "slurm", "slurm": {"extra_sbatch": list(extra)}}}
    )


def test_nodelist_expands_ranges_and_is_empty_for_local_runs() -> None:
    assert nodelist(_slurm("--nodelist=gpu[01-03,7],cpu-a", "--qos=high")) == {  # type: ignore[arg-type]
        "gpu01",
        "gpu02",
        "gpu03",
        "gpu7",
        "cpu-a",
    }
    assert nodelist(validate_spec("rl", {"model": {"name": "x"}})) == set()  # type: ignore[arg-type]
    local = validate_spec("rl", {"model": {"name": "x"}, "launcher": {"slurm": {"extra_sbatch": ["--nodelist=n1"]}}})
    assert nodelist(local) == set()  # type: ignore[arg-type]  # a local run has no nodes of its own


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "localhost", "::1", "LOCALHOST"])
def test_loopback_hosts_pass(host: str) -> None:
    check_run_host("inference.host", host, set())


def test_a_node_of_the_run_passes_and_others_are_refused_naming_the_key() -> None:
    check_run_host("trainer.weight_sync.master_addr", "gpu02", {"gpu01", "gpu02"})
    for host in ("0.0.0.0", "10.0.0.1", "169.254.169.254", "gpu03", "::"):
        with pytest.raises(AddressNotAllowed) as err:
            check_run_host("trainer.weight_sync.master_addr", host, {"gpu01", "gpu02"})
        assert str(err.value) == (
            f"trainer.weight_sync.master_addr: {host!r} is not allowed in a run submitted to the service; allowed: a "
            "loopback address (127.0.0.1, localhost, ::1) or a node of the run's Slurm --nodelist (gpu01, gpu02)"
        )
