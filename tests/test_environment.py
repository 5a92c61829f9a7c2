"""pyllm/environment.py lists every environment variable pyllm reads, and the README's table shows each one.

Reference: the names the code itself reads, found as string literals in pyllm/ and tools/, getenv calls in csrc/,
and os.environ reads in tests/. A variable added to the code without a line in the list fails here, as does a
listed variable that the README does not show.
"""

from __future__ import annotations

import re
from pathlib import Path

from pyllm import environment

ROOT = Path(__file__).resolve().parent.parent
LISTED = {v.name for v in environment.VARIABLES + environment.TEST_VARIABLES}


def _read_names() -> dict[str, str]:
    """name -> the first file that reads it."""
    found: dict[str, str] = {}
    literal, getenv = r'"(PYLLM_[A-Z0-9_]+)"', r'getenv\(\s*"(PYLLM_[A-Z0-9_]+)"'
    scans = [("pyllm", "*.py", literal), ("tools", "*.py", literal), ("csrc", "*.c*", getenv),
             ("csrc", "*.cuh", getenv),
             ("tests", "*.py", r'environ(?:\.get)?[\[(]\s*"(PYLLM_[A-Z0-9_]+)"')]
    for folder, pattern, regex in scans:
        for path in sorted((ROOT / folder).rglob(pattern)):
            for name in re.findall(regex, path.read_text(errors="replace")):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def _listed(name: str) -> bool:
    # PYLLM_ARG_ is read as a prefix: PYLLM_ARG_<FLAG> stands for every serve flag
    return name in LISTED or (name.startswith("PYLLM_ARG_") and "PYLLM_ARG_<FLAG>" in LISTED)


def test_every_variable_the_code_reads_is_listed():
    found = _read_names()
    assert {"PYLLM_CACHE_DIR", "PYLLM_ISA", "PYLLM_CUDA_GEMV_ROWS", "PYLLM_TEST_SEED"} <= set(found), \
        "the scan no longer finds the variables it must (a reader moved?)"
    unlisted = {n: f for n, f in found.items() if not _listed(n)}
    assert not unlisted, f"read but not listed in pyllm/environment.py: {unlisted}"


def test_every_listed_variable_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Environment variables"):]
    missing = sorted(n for n in LISTED if f"`{n}`" not in table)
    assert not missing, f"listed in pyllm/environment.py but not in the README's table: {missing}"


def test_help_shows_the_user_variables():
    from pyllm.cli.main import build_parser

    text = build_parser().format_help()
    assert all(v.name in text for v in environment.VARIABLES if v.user)
    assert all(v.name not in text for v in environment.VARIABLES if not v.user)
