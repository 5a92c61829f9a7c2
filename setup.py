"""Plain setuptools build; all metadata lives in pyproject.toml.

No extension is compiled here: pyllm/_ext.py builds it with torch.utils.cpp_extension on first use (see its
docstring for why: instant installs, no second torch downloaded by build isolation, -march=native).  A
non-editable install therefore has to carry the C++ sources: build_py copies the files named in
_ext.CPU_SOURCES / CUDA_SOURCES (the one source list) plus every header into pyllm/_csrc.  Editable installs
read <repo>/csrc directly.
"""

import ast
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _source_lists() -> list[str]:
    """CPU_SOURCES + CUDA_SOURCES from pyllm/_ext.py, read without importing it (no torch at build time)."""
    tree = ast.parse((HERE / "pyllm" / "_ext.py").read_text())
    found = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id in ("CPU_SOURCES", "CUDA_SOURCES"):
            found[target.id] = ast.literal_eval(node.value)
    return found["CPU_SOURCES"] + found.get("CUDA_SOURCES", [])


class build_py_with_csrc(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        src, dst = HERE / "csrc", Path(self.build_lib) / "pyllm" / "_csrc"
        files = set(_source_lists())
        files |= {str(p.relative_to(src)) for p in src.rglob("*") if p.suffix in (".h", ".cuh")}
        for rel in sorted(files):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dst / rel)


setup(cmdclass={"build_py": build_py_with_csrc})
