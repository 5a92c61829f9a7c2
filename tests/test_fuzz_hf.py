"""The Hugging Face folder fuzzer (tools/fuzz_hf.py) in CI: a deterministic run of lying checkpoint folders through
`pyllm convert` and the AWQ loader (only PyllmError may escape; a FIFO that blocks ends the run), and a check that
the harness itself reports a foreign exception."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "fuzz_hf.py"


@pytest.fixture(scope="module")
def fz():
    spec = importlib.util.spec_from_file_location("fuzz_hf", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_hf"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_fuzz_hf_ci_run():
    """400 deterministic cases (about 10 s): reference is the readers' contract, a PyllmError or a file that
    converts / loads; a hang (FIFO) or any other exception fails. Run in a subprocess so that a case blocked in
    open() ends the tool (faulthandler), not the test session."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    r = subprocess.run([sys.executable, str(TOOL), "-n", "400", "--seed", "0", "--json", "--timeout", "60"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["cases"] == 400 and rep["failures"] == []
    # the lies reach past the first check: some folders still convert or load, most are refused
    assert rep["ok"] > 30 and rep["rejected"] > 250, rep


def test_cases_are_deterministic_and_valid_seeds_pass(fz, tmp_path):
    import random

    seed = fz.make_seed(awq=False)
    a = fz.mutate(seed, random.Random("0:5"))
    assert a == fz.mutate(seed, random.Random("0:5"))
    for awq in (False, True):
        d = tmp_path / f"seed{awq}"
        fz.write_folder(d, fz.make_seed(awq), {})
        assert fz.run_case(d, awq) == "ok"


def test_the_harness_reports_a_foreign_exception(fz, monkeypatch):
    import pyllm.formats.convert

    def broken(*a, **k):
        raise KeyError("factor")

    monkeypatch.setattr(pyllm.formats.convert, "convert", broken)
    rep = fz.fuzz(20, seed=0)
    assert any("KeyError" in f[3] for f in rep.failures) and rep.cases == 20
