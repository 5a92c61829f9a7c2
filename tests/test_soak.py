"""tools/soak.py's leak detector: a leak injected at a known rate must show as that slope and fail the run.

Reference: the injected rate itself (64 KiB of touched memory per generated token = 62.5 MiB per 1,000 tokens).
The model is the tiny synthetic llama on the reference backend, so the test needs no cached model or extension.
The record 20,000-token run is in docs/SECURITY.md.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak_tool"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_slope_is_least_squares_per_1000(soak):
    xs = [1000, 2000, 3000, 4000]
    assert soak.slope_per_1k(xs, [10.0, 12.0, 14.0, 16.0]) == pytest.approx(2.0)
    assert soak.slope_per_1k(xs, [5.0, 5.0, 5.0, 5.0]) == 0.0
    assert soak.slope_per_1k([7], [1.0]) == 0.0


def _soak_run(model: str, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    """(exit status, result) of tools/soak.py in a process of its own: its resident memory is then the run's alone
    (inside the test suite's process, which holds GBs of cached models, an injected leak had to be scaled to that
    size and came out at half its rate once the machine's memory ran short)."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(TOOL), model, "-n", "600", "--ctx", "256", "--max-reply", "32",
                          "--backend", "reference", "--json", *extra], capture_output=True, text=True, timeout=600,
                         env=env, cwd=tmp_path)
    assert out.stdout.strip(), out.stderr[-2000:]
    return out.returncode, json.loads(out.stdout)


def test_injected_leak_is_caught(tmp_path):
    from pyllm.synthetic import write_tiny_llama

    p = str(write_tiny_llama(tmp_path / "m.gguf", n_ctx=512))
    leak = 64 * 1024
    rc, r = _soak_run(p, tmp_path, "--leak-bytes-per-token", str(leak), "--log", str(tmp_path / "log.csv"))
    want = leak * 1000 / 2**20
    assert 0.9 * want < r["slope_mib_per_1k_tokens_last_half"] < 1.25 * want, r
    assert r["overflows"] > 0 and r["warmup_overflows"] > 0  # the run really overflowed its context
    assert not r["ok"] and rc == 1
    if r["malloc_used_slope_mib_per_1k_tokens_last_half"] is not None:  # glibc: the in-use bytes show the leak
        assert r["diagnosis"].startswith("leak"), r
        assert r["malloc_used_slope_mib_per_1k_tokens_last_half"] > 0.8 * want, r
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert rows[0].startswith("turn,tokens,") and len(rows) == r["turns"] + 2  # header, start, one per turn
    rc, clean = _soak_run(p, tmp_path)
    assert clean["slope_mib_per_1k_tokens_last_half"] < 0.2 * want, clean
    assert clean["invalid_utf8_replies"] == 0
    assert not clean["diagnosis"].startswith("leak"), clean


def test_diagnosis_tells_a_leak_from_allocator_high_water(soak):
    assert soak.diagnose(0.5, 0.3, 0.1, 0.1) == "flat"
    assert soak.diagnose(5.0, 6.0, 2.0, 1.9).startswith("leak")
    assert soak.diagnose(5.0, 6.0, 2.0, 0.01).startswith("allocator high-water")
    assert soak.diagnose(5.0, 6.0, 2.0, None).startswith("growing")
