"""Host-side checks of the CUDA kernels' shared parts, on a machine with nvcc and no GPU.

The decode attention reads KV-cache rows through csrc/cuda/kv_rows.cuh; compiled for the host here, its values
must equal pyllm/runtime/kv_cache.py's own dequantizers bit for bit (reference: kv_cache.py, which the CPU step
is tied to by tests/test_kv_cache.py).  Skipped only where nvcc is absent (tools/check_cuda_compile.sh runs the
GEMV's host self-test the same way).
"""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from pyllm.runtime import kv_cache

ROOT = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
KV_ROW = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3, "bf16": 4}

pytestmark = pytest.mark.skipif(NVCC is None, reason="no nvcc")


@pytest.fixture(scope="module")
def kv_rows_check(tmp_path_factory):
    exe = tmp_path_factory.mktemp("cuda_host") / "kv_rows_host_check"
    r = subprocess.run([NVCC, "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", "--Werror", "all-warnings",
                        "-Xcompiler", "-Wall,-Wextra,-Werror", str(ROOT / "tests/gpu/kv_rows_host_check.cu"),
                        "-o", str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


def _stored_rows(kind: str, x: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """(raw rows as the cache stores them, their values as kv_cache.py reads them back) for x [n, hd]."""
    n, hd = x.shape
    if kind in kv_cache.KV_DTYPES:
        t = x.to(kv_cache.KV_DTYPES[kind])
        return t.view(torch.uint8).numpy().reshape(n, -1), t.float()
    part = kv_cache._BlockPart(kind, 1, 1, n, hd, "cpu", is_key=False)
    part.write(0, 0, x[None])
    return part.data[0, 0].numpy(), part.stored(0, n, sink=False)[0]


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("hd", [64, 128])
def test_kv_rows_decode_as_kv_cache(kv_rows_check, tmp_path, kind, hd):
    g = torch.Generator().manual_seed(hd + KV_ROW[kind])
    x = torch.randn(37, hd, generator=g) * torch.rand(37, 1, generator=g) * 5
    x[3] = 0  # an all-zero row: scale 0
    raw, want = _stored_rows(kind, x)
    (tmp_path / "in").write_bytes(raw.tobytes())
    r = subprocess.run([str(kv_rows_check), str(KV_ROW[kind]), str(hd), str(x.shape[0]), str(tmp_path / "in"),
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = np.fromfile(tmp_path / "out", dtype=np.float32).reshape(x.shape)
    np.testing.assert_array_equal(got, want.numpy())
