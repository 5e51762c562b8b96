"""The user docs (``README.md``, ``docs/*.md``): the README's size, links that resolve, numbers that are their JSON.

- README.md is the front door: at most :data:`README_MAX_LINES` lines, with the two fresh-machine commands.
- Every relative link of README.md and ``docs/`` names a file of the checkout, and its ``#anchor`` a heading of it.
- Every generated block (``<!-- NAME:start -->`` ... ``<!-- NAME:end -->``) of a page is what
  ``benchmarks/update_readme.py`` renders now from ``benchmarks/results/*.json``: a number that disagrees with its
  JSON fails here (fix: ``.venv/bin/python benchmarks/update_readme.py``).
- The docs describe behaviour, not how the team worked: no case ids, work periods or issue numbers (also in
  ``benchmarks/README.md``, the benchmarks' user page, whose relative links must resolve too).
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
BENCHMARKS_README = ROOT / "benchmarks" / "README.md"
"""The benchmarks' own page: not a docs page (no size limit, no required blocks) but read by users all the same."""
README_MAX_LINES = 250
FRESH_MACHINE_COMMANDS = (
    "bash scripts/setup.sh && .venv/bin/asyncrl demo --summary outputs/demo/summary.json",
    "bash scripts/setup.sh && bash scripts/test.sh",
)
PROCESS_WORDS = {
    r"\bC\d{1,2}\b": "a case id",
    r"\bcase C\d+": "a case id",
    r"\bsession \d+": "a work session's number",
    r"\bwork period": "a work period",
    r"\bfresh user'?s?\b": "a tester of the team",
    r"\bhelper\b": "a helper of the team",
    r"\bissue #?\d+": "an issue number",
    r"\bthe session's\b": "a work session",
}
"""Patterns of words of the team's own way of working that mean nothing to a user, and what each is."""
VENV_TOOLS = re.compile(
    r"^\s*(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(python3?|pip3?|pytest|alembic|celery|asyncrl|uvicorn|wandb)(\s|$)"
)
"""A shell line that runs a tool of the checkout's ``.venv`` by its bare name (after any ``VAR=value``): on a fresh
clone nothing puts ``.venv/bin`` on the PATH, so it fails (``python scripts/sft_rows_from_env.py``: ``No module named 'worker'``)."""
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _generator() -> ModuleType:
    path = ROOT / "benchmarks" / "update_readme.py"
    spec = importlib.util.spec_from_file_location("asyncrl_docs_generator", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GENERATOR = _generator()


def _prose(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of ``text`` outside fenced code blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to ``-``."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown page (a repeated heading gets ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_is_githubs() -> None:
    assert slug("Plugins: custom losses, advantages and gates") == "plugins-custom-losses-advantages-and-gates"
    assert slug("docker compose (one machine, one GPU or CPU only)") == "docker-compose-one-machine-one-gpu-or-cpu-only"
    assert slug("The `asyncrl` CLI") == "the-asyncrl-cli"


def test_the_readme_is_the_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for command in FRESH_MACHINE_COMMANDS:
        assert command in text
    first_screen = "\n".join(text.splitlines()[:80])
    assert "curl" in first_screen and "/api/runs" in first_screen, "the REST example belongs on the first screen"
    assert "asyncrl submit" in first_screen


@pytest.mark.parametrize("page", [*PAGES, BENCHMARKS_README], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for number, line in _prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                broken.append(f"{page.name}:{number}: {target} (no file {dest})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}:{number}: {target} (no heading #{anchor} in {dest.name})")
    assert broken == []


@pytest.mark.parametrize("page", [*PAGES, BENCHMARKS_README], ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_examples_run_the_venvs_tools(page: Path) -> None:
    """Every command of a ``bash`` / ``sh`` block works as written on a fresh clone: the checkout's tools are run as
    ``.venv/bin/<tool>``."""
    bare, shell = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line.strip()):
            shell = not shell and line.strip()[3:].strip() in ("bash", "sh", "shell")
            continue
        if shell and VENV_TOOLS.match(line):
            bare.append(f"{page.name}:{number}: {line.strip()[:100]}")
    assert bare == [], "run it as .venv/bin/<tool>"


@pytest.mark.parametrize("page", [*PAGES, BENCHMARKS_README], ids=lambda p: str(p.relative_to(ROOT)))
def test_generated_blocks_are_their_json(page: Path) -> None:
    text = page.read_text()
    rendered = GENERATOR.render(text)  # KeyError: a marker with no generator
    if rendered != text:
        diff = "\n".join(
            difflib.unified_diff(text.splitlines(), rendered.splitlines(), "page", "from JSON", lineterm="")
        )
        pytest.fail(
            f"{page.relative_to(ROOT)} disagrees with benchmarks/results (run benchmarks/update_readme.py):\n{diff}"
        )


def test_every_page_the_generator_renders_is_checked_here() -> None:
    assert set(GENERATOR.PAGES) == {*PAGES, BENCHMARKS_README}


def test_the_measured_pages_have_their_blocks() -> None:
    """The README's times and the headline numbers come from the generator, not from hand-typed prose."""
    names = {page.name: {name for name, _ in GENERATOR.blocks(page.read_text())} for page in PAGES}
    assert "fresh-machine" in names["README.md"]
    assert {"vs-trl", "rollout-throughput", "export-roundtrip"} <= names["benchmarks.md"]
    assert {"fault-matrix", "attacks-summary"} <= names["reliability-and-security.md"]
    used = set().union(*names.values()) | {name for name, _ in GENERATOR.blocks(BENCHMARKS_README.read_text())}
    assert set(GENERATOR.BLOCKS) - used == set(), "a generator no page uses"


def test_the_demos_rewards_say_they_are_one_run() -> None:
    """The demo's rewards come from one recorded run: wherever a page quotes them it says so and how far a run of
    the reader's own may land from them, so a fresh run's 0.425 next to the page's 0.381 is no surprise."""
    demo = GENERATOR.load("fresh_machine")["demo"]
    quoted = [
        (page.name, name, body)
        for page in [*PAGES, BENCHMARKS_README]
        for name, body in GENERATOR.blocks(page.read_text())
        if f"{demo['held_out_reward_after_sft']} after SFT -> **{demo['held_out_reward_after_rl']}**" in body
    ]
    assert {name for _, name, _ in quoted} >= {"fresh-machine", "demo-result"}
    assert [(page, name) for page, name, body in quoted if GENERATOR.DEMO_SPREAD not in body] == []
    assert all("one run" in body.lower() for _, _, body in quoted)


def test_a_stale_number_fails() -> None:
    page = GENERATOR.render("x\n<!-- vs-trl:start -->\n<!-- vs-trl:end -->\n")
    stale = re.sub(r"\*\*\d+\.\d+x\*\*", "**2.19x**", page, count=1)
    assert stale != page and GENERATOR.render(stale) == page


@pytest.mark.parametrize("page", [*PAGES, BENCHMARKS_README], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_words_of_the_teams_way_of_working(page: Path) -> None:
    found = [
        f"{page.name}:{number}: {what}: {line.strip()[:100]}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for pattern, what in PROCESS_WORDS.items()
        if re.search(pattern, line, re.I if pattern.startswith(r"\bfresh") else 0)
    ]
    assert found == []


BENCHMARK_SCRIPTS = sorted(
    p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".py", ".sh") and "results" not in p.parts
)
BENCHMARK_RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
DESCRIBING_KEYS = ("what", "benchmark", "note", "case", "command")
"""Keys of a results file that describe it to its reader (its numbers are checked by the generated blocks)."""


def _words_for_users(path: Path) -> list[str]:
    """What a benchmark file says to its reader: a script's docstring or leading comments; a result's describing
    values (top level and one level down, where the runs and variants are)."""
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        tops = [data] + [v for v in data.values() if isinstance(v, dict)] if isinstance(data, dict) else []
        runs = [r for v in (data.values() if isinstance(data, dict) else []) if isinstance(v, list) for r in v]
        return [str(d[k]) for d in [*tops, *runs] if isinstance(d, dict) for k in DESCRIBING_KEYS if k in d]
    text = path.read_text()
    if path.suffix == ".py":
        return [ast.get_docstring(ast.parse(text)) or ""]
    return [line for line in text.splitlines()[:40] if line.startswith("#")]


@pytest.mark.parametrize("path", BENCHMARK_SCRIPTS + BENCHMARK_RESULTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_benchmarks_speak_to_users(path: Path) -> None:
    """A benchmark's docstring and its result's descriptions are read by users (``benchmarks/README.md`` links
    them): no case ids, work-session numbers or issue numbers there either."""
    found = [
        f"{path.name}: {what}: {line.strip()[:100]}"
        for text in _words_for_users(path)
        for line in text.splitlines()
        for pattern, what in PROCESS_WORDS.items()
        if re.search(pattern, line, re.I if pattern.startswith(r"\bfresh") else 0)
    ]
    assert found == []
