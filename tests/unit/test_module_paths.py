"""Every module path written as text names a module that exists: a stale name fails here in seconds, not when a
real run, a Celery task or a reader follows it.

What is checked, in the code (strings and comments only: a variable called ``server`` is no module path), scripts,
deploy files, configs and docs:
- dotted names ``worker.…``, ``server.…``, ``webui.…`` (``-m`` targets, ``mock.patch`` targets, ``"module:attr"``
  paths, names in docstrings): the longest prefix that is a module or package must be followed, if by anything, by a
  name that module defines at its top level (``worker.run.rundir.RunDir`` passes, ``worker.rundir.RunDir`` fails:
  ``worker`` defines no ``rundir``). A name that ends in a file suffix (``worker.log``) is a file name, not a module;
- imports of ``worker``, ``server``, ``webui`` and ``tests`` modules, also inside functions (a heavy test's
  ``from worker.x import y`` runs only when that test does);
- file paths under the checkout's folders (``worker/run/rundir.py``, ``worker/spec/``,
  ``tests/unit/worker/run/test_rundir.py``, ``worker/orchestrator/packing.pack``): the file or folder must exist.

Left out: ``benchmarks/results/`` (each file records a run at the commit it names, with the paths of then) and the
tiny fake trees the import-graph checkers build in their own tests.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("worker", "server", "webui")
FIRST_PARTY = (*PACKAGES, "tests")
"""Packages whose imports are checked (``benchmarks/`` and ``scripts/`` import through ``sys.path``)."""
FOLDERS = (*PACKAGES, "tests", "scripts", "benchmarks", "deploy", "configs", "docs", "migrations", "examples")
ROOT_FILES = ("README.md", "pyproject.toml", "docker-compose.yml", "alembic.ini", ".pre-commit-config.yaml", ".ci/run")
SUFFIXES = {".py", ".md", ".toml", ".sh", ".j2", ".yml", ".yaml", ".txt", ".ini", ".cfg", ".html", ".json", ".lock"}
SKIP = ("benchmarks/results/", "webui/static/vendor/")
"""Not read, and paths into them not checked: records of past runs (each names the commit it ran at), run outputs,
files setup.sh fetches."""
FAKE_TREES = {"tests/unit/test_import_graph.py", "tests/unit/test_image_deps.py", "tests/unit/test_module_paths.py"}
"""Files that write module names of made-up trees (checked on their own temporary folders)."""
FILE_SUFFIXES = frozenset(
    "py log json jsonl toml md txt sh pid lock offset yml yaml html j2 sock db csv parquet tgz gz err out ini".split()
)

DOTTED = re.compile(rf"(?<![\w.\-/])((?:{'|'.join(PACKAGES)})(?:\.\w+)+)")
SLASHED = re.compile(rf"(?<![\w.\-/])((?:{'|'.join(FOLDERS)})(?:/[\w.\-*{{}}<>$]+)+/?)")


def text_files(root: Path = REPO) -> Iterator[Path]:
    for name in ROOT_FILES:
        if (root / name).is_file():
            yield root / name
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if (
                path.is_file()
                and (path.suffix in SUFFIXES or path.name.startswith("Dockerfile"))
                and "__pycache__" not in path.parts
                and not rel.startswith(SKIP)
                and rel not in FAKE_TREES
            ):
                yield path


def checked_text(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of what may hold a module path: a Python file's strings and comments, any other file whole."""
    text = path.read_text()
    if path.suffix != ".py":
        yield from enumerate(text.splitlines(), 1)
        return
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT or token.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            yield token.start[0], token.string
        elif token.type == tokenize.STRING:  # an f-string's literal parts only: {server.url} is code
            node = ast.parse(token.string, mode="eval").body
            parts = node.values if isinstance(node, ast.JoinedStr) else [node]
            yield (
                token.start[0],
                "".join(p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)),
            )


def module_file(root: Path, dotted: str) -> Path | None:
    path = root.joinpath(*dotted.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


@cache
def top_level_names(path: Path) -> frozenset[str]:
    """Names a module binds at its top level (including inside top-level ``if``/``try``/``with``/``for`` blocks)."""
    names: set[str] = set()

    def bind(target: ast.AST) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.add(node.id)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    bind(target)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                bind(node.target)
            elif isinstance(node, ast.TypeAlias if hasattr(ast, "TypeAlias") else ()):
                bind(node.name)
            if isinstance(node, (ast.For, ast.AsyncFor)):
                bind(node.target)
            for field in ("body", "orelse", "finalbody"):
                if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.AsyncFor, ast.While)):
                    visit(getattr(node, field, []))
            if isinstance(node, ast.Try):
                for handler in node.handlers:
                    visit(handler.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    return frozenset(names)


def dotted_problem(root: Path, name: str) -> str | None:
    """Why the dotted ``name`` names nothing (``None`` when it resolves)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        path = module_file(root, ".".join(parts[:end]))
        if path is not None:
            break
    else:
        return "no such package"
    if end == len(parts) or parts[end] in top_level_names(path):
        return None
    if parts[-1] in FILE_SUFFIXES:  # a file name: worker.log, server.py
        return None
    return f"{'.'.join(parts[:end])} ({path.relative_to(root).as_posix()}) has no module or name {parts[end]!r}"


def slashed_problem(root: Path, path: str) -> str | None:
    """Why the file path ``path`` names nothing: a ``.py`` file, a folder, or a module with an attribute
    (``worker/orchestrator/packing.pack``). A file of another type passes unless its folder is a package or is
    missing."""
    path = path.rstrip(".,:;")
    if any(c in path for c in "*{}<>$") or path.startswith(SKIP) or (root / path).exists():
        return None
    if path.endswith("/"):
        return "no such folder"
    if path.endswith(".py"):
        return "no such file"
    folder, _, name = path.rpartition("/")
    stem, dot, rest = name.partition(".")
    if not dot:
        return "no such file or folder"
    module = root / folder / stem
    if module.is_dir() or module.with_suffix(".py").is_file():  # a module and an attribute
        return None
    if (root / folder).is_dir() and not (root / folder / "__init__.py").is_file():
        return None  # a file of another type in a folder that is no package (docs/picture.png)
    return "no such module"


def imported_names(root: Path, path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line, dotted name, must be a module) of every first-party import of a Python file, at any depth: ``import
    a.b`` gives ``a.b`` (a module), ``from a.b import c`` gives ``a.b`` (a module) and ``a.b.c`` (a module or a
    name of ``a.b``); relative imports are made absolute."""
    parts = path.relative_to(root).with_suffix("").parts
    package = parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, True
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            yield node.lineno, module, True
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{module}.{alias.name}", False


def problems(root: Path, files: list[Path]) -> list[str]:
    found = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        if path.suffix == ".py":
            for line, name, is_module in imported_names(root, path):
                if name.split(".")[0] not in FIRST_PARTY:
                    continue
                why = "no such module" if is_module and module_file(root, name) is None else dotted_problem(root, name)
                if why:
                    found.append(f"{rel}:{line}: import {name}: {why}")
        for line, text in checked_text(path):
            for m in DOTTED.finditer(text):
                why = dotted_problem(root, m.group(1))
                if why:
                    found.append(f"{rel}:{line}: {m.group(1)}: {why}")
            for m in SLASHED.finditer(text):
                why = slashed_problem(root, m.group(1))
                if why:
                    found.append(f"{rel}:{line}: {m.group(1).rstrip('.,:;')}: {why}")
    return found


def test_every_module_path_in_code_scripts_and_docs_exists() -> None:
    found = problems(REPO, list(text_files()))
    assert not found, f"{len(found)} stale module paths:\n" + "\n".join(found)


# ----------------------------------------------------------------------------- the checker on a tiny tree


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for rel, text in {
        "worker/__init__.py": "",
        "worker/run/__init__.py": "",
        "worker/run/rundir.py": "import json\nclass RunDir:\n    pass\nif True:\n    LATE = 1\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "text",
    [
        "python -m worker.run.rundir",
        "mock.patch('worker.run.rundir.RunDir.path')",
        "worker.run.rundir.LATE, worker.run.rundir.json.dumps",
        "see worker/run/rundir.py, worker/run/ and worker/run/rundir.RunDir",
        "logs/worker.log, docs/not_here.png",
    ],
)
def test_checker_passes_names_that_exist(tree: Path, text: str) -> None:
    (tree / "docs").mkdir()
    (tree / "docs" / "page.md").write_text(text + "\n")
    assert problems(tree, [tree / "docs" / "page.md"]) == []


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("python -m worker.rundir", "worker.rundir: worker (worker/__init__.py) has no module or name 'rundir'"),
        (
            "worker.run.rundir.Gone",
            "worker.run.rundir.Gone: worker.run.rundir (worker/run/rundir.py) has no module or name 'Gone'",
        ),
        ("see `worker/rundir.py`", "worker/rundir.py: no such file"),
        ("see worker/tracking/", "worker/tracking/: no such folder"),
        ("worker/rundir.RunDir", "worker/rundir.RunDir: no such module"),
    ],
)
def test_checker_finds_a_stale_name(tree: Path, text: str, why: str) -> None:
    (tree / "docs").mkdir()
    (tree / "docs" / "page.md").write_text(f"intro\n{text}\n")
    assert problems(tree, [tree / "docs" / "page.md"]) == [f"docs/page.md:2: {why}"]


def test_checker_finds_a_stale_import_inside_a_function(tree: Path) -> None:
    (tree / "worker" / "run" / "mod.py").write_text(
        "from worker.run.rundir import RunDir\nfrom . import rundir\n\n\ndef f():\n    from worker import rundir\n"
        "    import worker.run.gone\n    from .rundir import Gone\n"
    )
    assert problems(tree, [tree / "worker" / "run" / "mod.py"]) == [
        "worker/run/mod.py:6: import worker.rundir: worker (worker/__init__.py) has no module or name 'rundir'",
        "worker/run/mod.py:7: import worker.run.gone: no such module",
        "worker/run/mod.py:8: import worker.run.rundir.Gone: worker.run.rundir (worker/run/rundir.py) has no module or "
        "name 'Gone'",
    ]


def test_checker_reads_only_strings_and_comments_of_python(tree: Path) -> None:
    (tree / "worker" / "mod.py").write_text(
        'server = object()\nserver.url  # worker.gone\nCMD = ["-m", "worker.run.gone"]\n'
    )
    assert problems(tree, [tree / "worker" / "mod.py"]) == [
        "worker/mod.py:2: worker.gone: worker (worker/__init__.py) has no module or name 'gone'",
        "worker/mod.py:3: worker.run.gone: worker.run (worker/run/__init__.py) has no module or name 'gone'",
    ]
