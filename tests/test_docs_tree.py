"""The docs name what the tree holds.

docs/DESIGN.md's module table (its first code block) lists the package's modules and folders. Every path it names
must exist, and every module of the package must be named there, so a newcomer reading the table sees the whole
house. tools/experiments/README.md describes each script in that folder.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module_table() -> str:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    m = re.search(r"^```\n(.*?)^```", text, re.S | re.M)
    assert m, "docs/DESIGN.md has no module table (a code block)"
    return m.group(1)


def _named_paths(table: str) -> set[str]:
    """Paths the table names: `pyllm/x.py` and `pyllm/sub/` at a line's start, and the `name.py` entries that follow
    a folder on its line or on the continuation lines under it."""
    named: set[str] = set()
    folder = None
    for line in table.splitlines():
        head = re.match(r"(pyllm/[\w/]*?)(\w+\.py|/)?\s", line + " ")
        if head and line.startswith("pyllm/"):
            path = line.split()[0]
            named.add(path.rstrip("/"))
            folder = path.rstrip("/") if path.endswith("/") else None
            rest = line[len(path):]
        elif line.startswith(" ") and folder:
            rest = line
        else:
            folder, rest = None, ""
        if folder:
            named.update(f"{folder}/{name}" for name in re.findall(r"\b(\w+\.py)\b", rest))
    return named


def test_every_module_the_design_table_names_exists():
    missing = sorted(p for p in _named_paths(_module_table()) if not (ROOT / p).exists())
    assert not missing, f"docs/DESIGN.md's module table names paths that do not exist: {missing}"


def test_every_package_module_is_in_the_design_table():
    named = _named_paths(_module_table())
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pyllm").rglob("*.py")
                     if p.name not in ("__init__.py", "__main__.py"))
    unnamed = [m for m in modules if m not in named]
    assert not unnamed, f"modules missing from docs/DESIGN.md's module table: {unnamed}"


SOURCE = r"\b(\w+\.(?:cpp|cu|cuh|h))\b"


def _named_sources(table: str) -> set[str]:
    """csrc files the table names: the file names on a line that starts with a csrc/ folder and on the continuation
    lines under it, each in that folder."""
    named: set[str] = set()
    folder = None
    for line in table.splitlines():
        if line.startswith("csrc/"):
            folder = line.split()[0].rstrip("/")
            rest = line[len(folder) + 1:]
        elif line.startswith(" ") and folder:
            rest = line
        else:
            folder, rest = None, ""
        if folder:
            named.update(f"{folder}/{name}" for name in re.findall(SOURCE, rest))
    return named


def test_every_source_file_the_design_table_names_exists_and_every_one_is_named():
    """The same for the extension's sources: the table's csrc/ lines name every C++ / CUDA file, and only real ones."""
    named = _named_sources(_module_table())
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/DESIGN.md's module table names source files that do not exist: {missing}"
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*")
                     if p.is_file() and re.fullmatch(SOURCE, p.name))
    unnamed = [p for p in sources if p not in named]
    assert not unnamed, f"source files missing from docs/DESIGN.md's module table: {unnamed}"


def test_every_experiment_script_is_described():
    folder = ROOT / "tools" / "experiments"
    readme = (folder / "README.md").read_text()
    scripts = sorted(p.name for p in folder.iterdir() if p.suffix in (".py", ".sh"))
    assert scripts, "tools/experiments holds no script"
    undescribed = [s for s in scripts if f"`{s}`" not in readme]
    assert not undescribed, f"tools/experiments/README.md does not describe: {undescribed}"
