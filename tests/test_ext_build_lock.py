"""The extension's build lock: a build killed while holding it must not block the next load.

torch's cpp_extension leaves its ``lock`` file behind when the building process dies; pyllm._ext.build_lock holds
an flock(2) (released by the OS when the holder dies) and clears that stale file.  Reference: the OS semantics of
flock and of SIGKILL; no build is run here.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pyllm import _ext
from pyllm.errors import PyllmError

ROOT = Path(__file__).resolve().parent.parent

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from pyllm import _ext
    build = Path(sys.argv[1])
    with _ext.build_lock(build):
        (build / "lock").write_text("")  # what torch's FileBaton holds during a build
        print("held", flush=True)
        time.sleep(600)
""")


def _start_holder(build: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(build)], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "held"
    return p


def test_killed_holder_does_not_block_the_next_build(tmp_path):
    p = _start_holder(tmp_path)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert (tmp_path / "lock").exists()  # the stale baton a killed torch build leaves
    t0 = time.monotonic()
    with _ext.build_lock(tmp_path, timeout=20):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - t0 < 20


def test_live_holder_is_waited_for_then_named(tmp_path):
    p = _start_holder(tmp_path)
    try:
        with pytest.raises(PyllmError, match="another process has been building"):
            with _ext.build_lock(tmp_path, timeout=0.5):
                pass
        assert (tmp_path / "lock").exists()  # a live builder's baton is left alone
    finally:
        p.kill()
        p.wait(timeout=30)
    with _ext.build_lock(tmp_path, timeout=20):
        pass


def test_one_extension_build():
    """One build: _ext.load is the only cpp_extension.load in the package, and CUDA sources join the CPU ones."""
    hits = [str(f.relative_to(ROOT)) for f in (ROOT / "pyllm").rglob("*.py")
            if "cpp_extension.load(" in f.read_text()]
    assert hits == ["pyllm/_ext.py"]
    assert not set(_ext.CPU_SOURCES) & set(_ext.CUDA_SOURCES)
    assert all((_ext.csrc_dir() / s).is_file() for s in _ext.CPU_SOURCES + _ext.CUDA_SOURCES)
