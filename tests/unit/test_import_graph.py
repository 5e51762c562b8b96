"""The import graph of ``server/``, ``worker/`` and ``webui/``, read with ``ast`` (nothing is imported).

Rules: imports point one way, surfaces -> services -> engine, as the table of ``docs/architecture.md`` ("Import
rules") says, and this module reads that table (:func:`layers`), so the page and the check cannot differ:
- every module of ``server/``, ``worker/`` and ``webui/`` is in one layer of the table (the most specific path wins:
  ``worker/cli.py`` is a surface inside the engine's ``worker/``);
- no module imports a layer its row says it never imports (the engine: services and surfaces, so ``worker/`` never
  imports ``server`` or ``webui`` but for the CLI dispatcher);
- no module cycle, imports inside functions included (``importlib.import_module("x")`` and ``__import__("x")``
  with a literal name count as imports of ``x``);
- no module is called ``common``, ``utils``, ``helpers`` or ``misc``.

An import is an edge to the most specific module it names: ``from a.b import c`` is an edge to ``a.b.c`` when that
is a module, else to ``a.b``; the package ``__init__`` files an import runs on its way are not edges (they would
make every package that imports its own submodules a cycle). ``if TYPE_CHECKING:`` imports count too.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "worker", "webui")
ARCHITECTURE = REPO / "docs" / "architecture.md"


@dataclass(frozen=True)
class Layer:
    name: str
    prefixes: tuple[str, ...]
    """Dotted module prefixes of the layer's packages (``server/api/`` -> ``server.api``)."""
    never: tuple[str, ...]
    """Names of the layers it never imports."""


def layers(page: Path = ARCHITECTURE) -> list[Layer]:
    """The rows of the page's import-rules table (``| layer | packages | may import | never imports |``)."""
    import re

    rows = [line for line in page.read_text().splitlines() if line.startswith("| ") and line.count("|") == 5]
    header = rows.index(next(r for r in rows if r.startswith("| layer | packages |")))
    out = []
    for row in rows[header + 1 :]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) != 4 or not re.fullmatch(r"[a-z]+", cells[0]):
            break
        paths = re.findall(r"`([a-z_]+/[a-z_/]*(?:\.py)?)`", cells[1])
        prefixes = tuple(p.removesuffix("/").removesuffix(".py").replace("/", ".") for p in paths)
        never = tuple(w for w in re.findall(r"[a-z]+", cells[3]))
        out.append(Layer(cells[0], prefixes, never))
    return out


def layer_of(module: str, table: list[Layer]) -> Layer | None:
    """The layer of the most specific (longest) prefix that holds ``module``."""
    best: tuple[int, Layer] | None = None
    for layer in table:
        for p in layer.prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), layer)
    return best[1] if best else None


VAGUE_NAMES = frozenset({"common", "utils", "helpers", "misc"})


@dataclass(frozen=True, order=True)
class Edge:
    """``src`` imports ``dst`` at ``file:line`` (``file`` relative to the scanned root)."""

    src: str
    dst: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} ({self.file}:{self.line})"


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file of every ``.py`` under ``root/<package>`` (``a/b/__init__.py`` is ``a.b``)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is one of ``modules`` (``None`` outside them)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return None


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """(absolute dotted name, line) of every import in ``tree``, at any depth; ``from a import b`` gives ``a.b``
    (resolved to ``a`` by the caller when ``a.b`` is not a module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                yield (f"{prefix}.{alias.name}" if alias.name != "*" else prefix), node.lineno
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            first = node.args[0]
            if (
                name in {"import_module", "__import__"}
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and not first.value.startswith(".")
            ):
                yield first.value, node.lineno


def import_edges(root: Path, packages: Iterable[str] = PACKAGES) -> tuple[dict[str, Path], list[Edge]]:
    """The modules under ``root/<package>`` and the import edges between them (imports of anything else dropped)."""
    modules = module_files(root, packages)
    edges: set[Edge] = set()
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(root).as_posix()
        for name, line in _imported_names(tree, module, path.name == "__init__.py"):
            dst = _known(name, modules)
            if dst is not None and dst != module:
                edges.add(Edge(module, dst, rel, line))
    return modules, sorted(edges)


def strongly_connected(nodes: Iterable[str], edges: Iterable[Edge]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted, in sorted order."""
    graph: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        graph[e.src].append(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(start: str) -> None:  # iterative: deep import chains would overflow the recursion limit
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for n in sorted(graph):
        if n not in index:
            visit(n)
    return sorted(components)


def shortest_cycle(start: str, component: list[str], edges: list[Edge]) -> list[Edge]:
    """A shortest cycle through ``start`` inside its component, as its edges (the first edge per module pair)."""
    inside = set(component)
    first: dict[tuple[str, str], Edge] = {}
    for e in edges:
        if e.src in inside and e.dst in inside:
            first.setdefault((e.src, e.dst), e)
    parent: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for (src, dst), e in first.items():
            if src != node:
                continue
            if dst == start:
                chain = [e]
                while chain[0].src != start:
                    chain.insert(0, parent[chain[0].src])
                return chain
            if dst not in parent:
                parent[dst] = e
                queue.append(dst)
    raise AssertionError(f"no cycle through {start} in {component}")


def cycle_chains(component: list[str], edges: list[Edge]) -> list[str]:
    """``a -> b -> ... -> a``: a shortest cycle through each module of the component, each cycle once."""
    seen: set[frozenset[tuple[str, str]]] = set()
    chains = []
    for module in component:
        chain = shortest_cycle(module, component, edges)
        key = frozenset((e.src, e.dst) for e in chain)
        if key not in seen:
            seen.add(key)
            chains.append(" -> ".join([e.src for e in chain] + [module]))
    return chains


def problems(root: Path, packages: Iterable[str] = PACKAGES, table: list[Layer] | None = None) -> list[str]:
    """Every breach of the rules above (``table``: the layers, default the page's), one readable line (or block, for
    a cycle) each; empty when clean."""
    packages = tuple(packages)
    table = layers() if table is None else table
    modules, edges = import_edges(root, packages)
    found: list[str] = []
    for component in strongly_connected(modules, edges):
        inner = [str(e) for e in edges if e.src in component and e.dst in component]
        found.append(
            f"cycle among {len(component)} modules:\n    "
            + "\n    ".join(cycle_chains(component, edges))
            + "\n  its imports:\n    "
            + "\n    ".join(inner)
        )
    for module in modules:
        if module not in packages and layer_of(module, table) is None:  # a package root holds no code
            found.append(f"module in no layer of docs/architecture.md's import rules: {module}")
    for e in edges:
        src, dst = layer_of(e.src, table), layer_of(e.dst, table)
        if src is not None and dst is not None and dst.name in src.never:
            found.append(f"{src.name} imports {dst.name} (never, by docs/architecture.md): {e}")
    for module, path in modules.items():
        vague = VAGUE_NAMES.intersection(module.split("."))
        if vague:
            found.append(f"module named {sorted(vague)[0]!r}: {module} ({path.relative_to(root).as_posix()})")
    return found


# ----------------------------------------------------------------------------- the real tree


def test_import_graph_has_no_cycle_no_engine_to_control_plane_import_and_no_vague_module_name() -> None:
    found = problems(REPO)
    assert not found, f"{len(found)} import-graph problems:\n" + "\n".join(found)


ENVS_MAY_IMPORT_OF_THE_ORCHESTRATOR = {"worker.orchestrator.harness_runtime"}
"""The one module of the orchestrator the environments import (the env registry asks whether a harness is installed);
what both need besides (the missing-reward rule: ``worker.rewards``) lives outside both."""


def test_the_environments_import_no_orchestrator_internals() -> None:
    _, edges = import_edges(REPO)
    found = [
        str(e)
        for e in edges
        if e.src.startswith("worker.envs")
        and e.dst.startswith("worker.orchestrator")
        and e.dst not in ENVS_MAY_IMPORT_OF_THE_ORCHESTRATOR
    ]
    assert found == []


# ----------------------------------------------------------------------------- the checker on tiny packages


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


CLEAN = {
    "server/__init__.py": "",
    "server/api.py": "from server import services\nfrom worker.trainer import loss\n",
    "server/services.py": "import worker.spec\n",
    "webui/__init__.py": "",
    "webui/views.py": "from server.services import *\n",
    "worker/__init__.py": "",
    "worker/spec.py": "import json\n",
    "worker/trainer/__init__.py": "from . import loss\n",  # a package importing its own submodule is no cycle
    "worker/trainer/loss.py": "from worker.trainer import kernels\nfrom ..spec import json\n",
    "worker/trainer/kernels.py": "",
}


TINY = [Layer("surfaces", ("server", "webui"), ()), Layer("engine", ("worker",), ("surfaces",))]
"""The layers of the tiny trees: the control plane as one layer, the engine that never imports it."""


def test_the_page_has_the_three_layers() -> None:
    table = {layer.name: layer for layer in layers()}
    assert list(table) == ["surfaces", "services", "engine"]
    assert table["engine"].never == ("services", "surfaces") and table["services"].never == ("surfaces",)
    assert table["surfaces"].prefixes == ("server.api", "webui", "server.main", "server.cli", "worker.cli")
    assert layer_of("worker.cli", layers()) == table["surfaces"]  # the dispatcher, inside the engine's package
    assert layer_of("worker.trainer.loss.dppo_kl", layers()) == table["engine"]
    assert layer_of("server.jobs.tasks", layers()) == table["services"]


def test_checker_passes_a_clean_graph(tmp_path: Path) -> None:
    root = write_tree(tmp_path, CLEAN)
    modules, edges = import_edges(root)
    assert {(e.src, e.dst) for e in edges} == {
        ("server.api", "server.services"),
        ("server.api", "worker.trainer.loss"),
        ("server.services", "worker.spec"),
        ("webui.views", "server.services"),
        ("worker.trainer", "worker.trainer.loss"),
        ("worker.trainer.loss", "worker.trainer.kernels"),
        ("worker.trainer.loss", "worker.spec"),  # relative, to a name defined in the module
    }
    assert problems(root, table=TINY) == []


def test_checker_finds_a_cycle_through_a_function_level_dynamic_import(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        {
            **CLEAN,
            "server/services.py": "import worker.spec\nfrom server import alerts\n",
            "server/alerts.py": "def f():\n    import importlib\n    return importlib.import_module('server.api')\n",
        },
    )
    assert problems(root, table=TINY) == [
        "cycle among 3 modules:\n"
        "    server.alerts -> server.api -> server.services -> server.alerts\n"
        "  its imports:\n"
        "    server.alerts -> server.api (server/alerts.py:3)\n"
        "    server.api -> server.services (server/api.py:1)\n"
        "    server.services -> server.alerts (server/services.py:2)"
    ]


def test_checker_finds_an_engine_import_of_the_server(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        {**CLEAN, "worker/trainer/kernels.py": "def f():\n    __import__('server.services')\n"},
    )
    assert problems(root, table=TINY) == [
        "engine imports surfaces (never, by docs/architecture.md): worker.trainer.kernels -> server.services "
        "(worker/trainer/kernels.py:2)"
    ]


def test_checker_finds_vague_module_names(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {**CLEAN, "worker/trainer/common.py": "", "webui/utils/__init__.py": ""})
    assert problems(root, table=TINY) == [
        "module named 'common': worker.trainer.common (worker/trainer/common.py)",
        "module named 'utils': webui.utils (webui/utils/__init__.py)",
    ]
