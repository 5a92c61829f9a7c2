"""The CPU kernels compile for a machine without AVX2: every SIMD file must fall back to the generic kernels.

The extension is built with -march=native, so on this (AVX2) machine the #else branches of the gemv_avx2_*.cpp
files are never compiled by the normal build; this checks them with gcc's syntax pass for an x86-64 baseline
target. Reference: the compiler itself (no torch headers: csrc/cpu is plain C++ by design).
"""

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
@pytest.mark.parametrize("src", sorted(p.name for p in (CSRC / "cpu").glob("*.cpp")))
def test_cpu_kernels_compile_without_avx2(src):
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-fopenmp", "-march=x86-64", "-mno-avx2", "-mno-fma",
           "-mno-f16c", f"-I{CSRC}", str(CSRC / "cpu" / src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{src} does not compile without AVX2:\n{r.stderr[-3000:]}"
