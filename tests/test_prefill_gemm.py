"""The prefill GEMM kernels (mul_mat above GEMV_CHUNKED_MAX_M rows; csrc/cpu/gemm_amx.cpp and bindings_kernels.cpp's gemm)
against float64 on the same dequantized weights, for every kernel this CPU runs.

Kernels: "f32" (dequantized tiles + torch's fp32 GEMM), "avx512-bf16" (vdpbf16ps), "amx-bf16" (AMX tiles) and
"int8-gemv" (the decode GEMV on 8-row chunks of x, the default on CPUs without bf16 units).  A
kernel the CPU (or OS) lacks is skipped with a reason naming it; one it has must run, and test_report_paths prints
both lists (see them with pytest -rA or -s).

References and tolerances (error metric: test_kernels.rel_err, max|y - ref| / max(max|ref|, rms of an output)):
- every kernel against x.double() @ W.double().T, W from gguf.quants (test_kernels.make_weight) or the exact AWQ
  weights (test_awq_kernels.make).  f32: TOL_F32 = 1e-5 (fp32 sums).  bf16 kernels: TOL_BF16 = 2e-2.  Rounding x
  and W to bf16 (8-bit mantissa, round to nearest even) gives each product a relative error of std ~1.6e-3, so an
  output errs by ~1.6e-3 of its rms per sigma; 2e-2 is a 12-sigma bound on the max over ~5e4 outputs.  Measured
  Frobenius error ||y - ref|| / ||ref|| ~2.4e-3, bound TOL_BF16_FRO = 5e-3.
- bf16 kernels, tight: against x_bf16.double() @ W_bf16.double().T (x and W rounded exactly as the kernels do):
  TOL_BF16_EXACT = 2e-5.  Products of two bf16 are exact in fp32, so only the fp32 accumulation (~sqrt(K) 2^-24)
  remains and a wrong weight, scale, layout or tail shows up by orders of magnitude.
- int8-gemv: test_kernels.TOL_Q8 = 5e-2 against float64 (x rounded to int8 blocks; float weights keep x in fp32:
  TOL_F32), and bit for bit the GEMV's result on each 8-row chunk of x, whose tight bound against x rounded
  exactly as the kernels do is test_kernels.py's (TOL_EXACT).
Inputs are fresh each run (PYLLM_TEST_SEED replays them); shapes cover M = 9, 17, 100, 513 (not multiples of the
32-token block), N not a multiple of 16 or of the strip, and K not a multiple of 32 where the type allows (F16).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pyllm import _ext
from test_awq_kernels import make as make_awq
from test_kernels import (FLOAT_TYPES, GT, K_TYPES, ROWS8_K_TYPES, TOL_Q8, make_weight, rel_err, rng_for, row_kinds,
                          rows8, why)

TOL_F32, TOL_BF16, TOL_BF16_FRO, TOL_BF16_EXACT = 1e-5, 2e-2, 5e-3, 2e-5
KERNELS = ["f32", "avx512-bf16", "amx-bf16", "int8-gemv"]
MS = [9, 17, 100, 513]
# (type, N, K): legacy blocks need K % 32 == 0, K-quants K % 256 == 0; F16 takes any K.  (1000, 576) spans several
# strips per thread with a partial last one; K = 4864 (Qwen2.5's down projection) makes the strip narrower.
CASES = [("Q4_0", 100, 160), ("Q4_0", 1000, 576), ("Q4_1", 33, 4864), ("Q8_0", 200, 96), ("Q4_K", 200, 768),
         ("Q6_K", 17, 256), ("F16", 37, 100), ("F16", 64, 576)]


@pytest.fixture(scope="module")
def C():
    return _ext.load()  # raises when the extension is missing: the tests fail, never pass quietly


def need(C, kernel):
    if kernel not in C.prefill_kernels():
        pytest.skip(f"this CPU/OS lacks the {kernel} prefill kernel")


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def check(C, kernel, y, x, w, ref, what):
    """w: an object with W (f32 [N, K]), W64 and colsq, as test_kernels.Weight."""
    if kernel == "f32" or kernel == "int8-gemv":
        tol = TOL_Q8 if kernel == "int8-gemv" and what[0] not in FLOAT_TYPES else TOL_F32
        err = rel_err(y, ref, x, w)
        assert err < tol, f"{kernel} {what} vs float64: {err:.3g} > {tol} " + why(what)
        return
    err = rel_err(y, ref, x, w)
    assert err < TOL_BF16, f"{kernel} {what} vs float64: {err:.3g} > {TOL_BF16} " + why(what)
    fro = ((y.double() - ref).norm() / ref.norm()).item()
    assert fro < TOL_BF16_FRO, f"{kernel} {what} Frobenius vs float64: {fro:.3g} > {TOL_BF16_FRO} " + why(what)
    exact = bf16(x) @ bf16(w.W).T
    err = rel_err(y, exact, x, w)
    assert err < TOL_BF16_EXACT, f"{kernel} {what} vs bf16-rounded float64: {err:.3g} > {TOL_BF16_EXACT} " + why(what)


def test_report_paths(C):
    ran = C.prefill_kernels()
    lacks = [k for k in KERNELS if k not in ran]
    print(f"\nprefill GEMM kernels run here: {', '.join(ran)}; this CPU/OS lacks: {', '.join(lacks) or 'none'}; "
          f"mul_mat uses {C.prefill_kernel()}")
    assert "f32" in ran and C.prefill_kernel() in ran


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("name,N,K", CASES, ids=[f"{n}-N{a}-K{b}" for n, a, b in CASES])
def test_gemm_kernel_vs_float64(C, kernel, M, name, N, K):
    need(C, kernel)
    wt = make_weight(name, N, K)
    x = torch.from_numpy(rng_for("pf", name, N, K, M).standard_normal((M, K), dtype=np.float32))
    y = C.gemm(x, wt.raw, int(GT[name]), None, kernel)
    assert y.shape == (M, N) and y.dtype == torch.float32
    check(C, kernel, y, x, wt, wt.ref(x), (name, N, K, M))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("M", [17, 100])
@pytest.mark.parametrize("k,n,g", [(1536, 576, 64), (384, 40, 128)])
def test_gemm_kernel_awq(C, kernel, M, k, n, g):
    need(C, kernel)
    w = make_awq(C, k, n, g)
    x = torch.from_numpy(rng_for("pf-awq", k, n, g, M).standard_normal((M, k), dtype=np.float32))
    y = C.gemm(x, w.rows, w.qtype, None, kernel)
    check(C, kernel, y, x, w, w.ref(x), ("AWQ", n, k, g, M))


@pytest.mark.parametrize("kernel", KERNELS)
def test_threads_out_and_scales(C, kernel):
    """Each output is summed by one thread in a fixed order: 1 and 2 threads give the same bits; `out` is filled
    in place; large and tiny activations (Gemma's embeddings are scaled by sqrt(n_embd)) keep their relative error."""
    need(C, kernel)
    wt = make_weight("Q4_K", 300, 512)
    x = torch.from_numpy(rng_for("pf-t", kernel).standard_normal((70, 512), dtype=np.float32))
    old = C.get_num_threads()
    try:
        C.set_num_threads(1)
        y1 = C.gemm(x, wt.raw, int(GT["Q4_K"]), None, kernel)
        C.set_num_threads(2)
        out = torch.full((70, 300), float("nan"))
        y2 = C.gemm(x, wt.raw, int(GT["Q4_K"]), out, kernel)
    finally:
        C.set_num_threads(old)
    assert y2.data_ptr() == out.data_ptr() and torch.equal(y1, out), why(kernel)
    for s in (1e3, 1e-3):
        check(C, kernel, C.gemm(x * s, wt.raw, int(GT["Q4_K"]), None, kernel), x * s, wt, wt.ref(x * s),
              ("Q4_K", kernel, s))


@pytest.mark.parametrize("name,layout", [("Q4_1", "gguf"), ("Q4_1", "rows8"), ("Q4_K", "rows8"), ("Q6_K", "gguf")])
def test_int8_gemv_is_the_gemv_on_8_row_chunks(C, name, layout):
    """int8-gemv gives each row of x the bits the fused GEMV gives it in any chunk of 1..8 rows, on the GGUF rows
    and on the decode step's interleaved copy (which the CPU backend's forward reads under this kernel): a prompt
    read in spans of any length, or beside other prompts, gets the same rows.  Float weights, whose GEMV unrolls
    by M, take the fp32 GEMM."""
    wt = make_weight(name, 64, 512)
    raw, qtype = wt.raw, int(GT[name])
    if layout == "rows8":
        raw, qtype = C.repack_rows8(raw, qtype), int(C.rows8_qtype(qtype))
    x = torch.from_numpy(rng_for("pf-i8", name).standard_normal((45, 512), dtype=np.float32))
    y = C.gemm(x, raw, qtype, None, "int8-gemv")
    assert torch.equal(y, torch.cat([C.gemv(x[i:i + 8], raw, qtype) for i in range(0, 45, 8)])), why(name, layout)
    for lo, hi in [(0, 1), (3, 17), (17, 45)]:
        part = x[lo:hi].contiguous()
        got = C.gemm(part, raw, qtype, None, "int8-gemv") if hi - lo > 8 else C.gemv(part, raw, qtype)
        assert torch.equal(got, y[lo:hi]), why(name, layout, lo, hi)
    check(C, "int8-gemv", y, x, wt, wt.ref(x), (name, layout))
    f16 = make_weight("F16", 64, 512)
    assert torch.equal(C.gemm(x, f16.raw, int(GT["F16"]), None, "int8-gemv"),
                       C.gemm(x, f16.raw, int(GT["F16"]), None, "f32"))



@pytest.mark.parametrize("name,layout", [(n, "gguf") for n in K_TYPES] + [(n, "rows8") for n in ROWS8_K_TYPES])
def test_int8_gemv_rows_with_outliers_are_the_gemv_on_8_row_chunks(C, name, layout):
    """Rows whose Q8_K activations drop outliers (sparse) or take a residual row, among plain rows, get from
    int8-gemv the bits the GEMV gives each 8-row chunk of x, on every ISA path and thread count: its tiles run
    every chunk's row-dot calls in one region, and a chunk of residual rows (up to 16 activation rows) is split
    over two calls as the GEMV splits it.  Reference: C.gemv per chunk, tolerance 0."""
    N, K, M = 64, 2048, 45
    wt = make_weight(name, N, K)
    raw, qtype = (wt.raw, int(GT[name])) if layout == "gguf" else rows8(C, name, wt)
    x = torch.from_numpy(rng_for("pf-outl", name).standard_normal((M, K), dtype=np.float32))
    x[8:16, 37::48] = 400.0  # the second chunk: all residual (42 outliers a row)
    x[[1, 20, 33, 44], 37::48] = -400.0
    x[[2, 21, 40], 37::256] = 400.0  # 8 outliers: sparse
    kinds = row_kinds(x)
    assert kinds.count("residual") == 12 and kinds.count("sparse") == 3
    old_isa, old_threads = C.get_isa(), C.get_num_threads()
    try:
        for isa in C.available_isas():
            C.set_isa(isa)
            want = torch.cat([C.gemv(x[i:i + 8], raw, qtype) for i in range(0, M, 8)])
            for threads in (1, 2):
                C.set_num_threads(threads)
                assert torch.equal(C.gemm(x, raw, qtype, None, "int8-gemv"), want), why(name, layout, isa, threads)
            x20 = x[:20]
            assert torch.equal(C.mul_mat(x20, raw, qtype, None, True),
                               torch.cat([C.gemv(x20[i:i + 8], raw, qtype, None, True) for i in range(0, 20, 8)])), why(
                name, layout, isa, "precise_x")
    finally:
        C.set_isa(old_isa)
        C.set_num_threads(old_threads)

def test_mul_mat_uses_the_prefill_kernel(C):
    """From gemm_min_rows() rows mul_mat runs prefill_kernel() (AMX from 9 rows, AVX-512 bf16 from 20, fp32 or the
    int8 GEMVs above the 32 rows of 8-row GEMV chunks); precise_x (the output projection) keeps the fp32 GEMM above
    32 rows and GEMV chunks below."""
    wt = make_weight("Q4_0", 100, 160)
    q = int(GT["Q4_0"])
    first = C.gemm_min_rows()
    assert first == {"amx-bf16": 9, "avx512-bf16": 20}.get(C.prefill_kernel(), C.GEMV_CHUNKED_MAX_M + 1)
    assert C.gemm_min_rows(True) == C.GEMV_CHUNKED_MAX_M + 1
    for rows in (first, 80):
        x = torch.from_numpy(rng_for("pf-mm", rows).standard_normal((rows, 160), dtype=np.float32))
        y = C.mul_mat(x.reshape(1, rows, 160), wt.raw, q)
        assert torch.equal(y.reshape(rows, 100), C.gemm(x, wt.raw, q, None, C.prefill_kernel())), why(rows)
        assert torch.equal(C.gemm(x, wt.raw, q, None, ""), y.reshape(rows, 100))
    x = torch.from_numpy(rng_for("pf-mm-p").standard_normal((80, 160), dtype=np.float32))
    assert torch.equal(C.mul_mat(x, wt.raw, q, None, True), C.gemm(x, wt.raw, q, None, "f32"))


def test_set_prefill_kernel(C):
    """set_prefill_kernel switches mul_mat's GEMM in this process (A/B benchmarks); unavailable names raise."""
    wt = make_weight("Q4_0", 100, 160)
    q = int(GT["Q4_0"])
    x = torch.from_numpy(rng_for("pf-set").standard_normal((80, 160), dtype=np.float32))
    default = C.prefill_kernel()
    try:
        for k in C.prefill_kernels():
            C.set_prefill_kernel(k)
            assert C.prefill_kernel() == k
            assert torch.equal(C.mul_mat(x, wt.raw, q), C.gemm(x, wt.raw, q, None, k)), k
    finally:
        C.set_prefill_kernel(default)
    for k in KERNELS:
        if k not in C.prefill_kernels():
            with pytest.raises(ValueError, match="not available"):
                C.set_prefill_kernel(k)


def test_pyllm_isa_forces_the_path(C):
    """PYLLM_ISA=avx2 selects the int8 GEMVs, scalar the fp32 GEMM; avx512 the AVX-512 bf16 kernel where the CPU
    has it (else the int8 GEMVs); unset, the fastest the CPU has.  A fresh process each, as the choice is made once
    per process."""
    root = Path(__file__).resolve().parent.parent
    code = "from pyllm import _ext; print(_ext.load().prefill_kernel())"
    got = {}
    for isa in ("avx2", "scalar", "avx512"):
        env = dict(os.environ, PYLLM_ISA=isa, PYTHONPATH=str(root))
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        if isa not in C.available_isas():  # this host cannot run it: a clear refusal, not a fallback or a crash
            assert r.returncode == 1 and f"PYLLM_ISA={isa}: this CPU" in r.stderr, (r.returncode, r.stderr[-2000:])
            continue
        assert r.returncode == 0, r.stderr[-2000:]
        got[isa] = r.stdout.strip().splitlines()[-1]
    assert got.get("avx2", "int8-gemv") == "int8-gemv" and got["scalar"] == "f32"
    if "avx512" in got:
        assert got["avx512"] == ("avx512-bf16" if "avx512-bf16" in C.prefill_kernels() else "int8-gemv")
    # unforced: the fastest kernel the CPU has (AMX tiles, else AVX-512 BF16, else the int8 GEMVs on SIMD, else fp32)
    env = {k: v for k, v in os.environ.items() if k != "PYLLM_ISA"}
    r = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=str(root)), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    simd = "int8-gemv" if C.best_isa() != "scalar" else "f32"
    best = next(k for k in ("amx-bf16", "avx512-bf16", simd) if k in C.prefill_kernels())
    assert r.stdout.strip().splitlines()[-1] == best


def test_errors(C):
    wt = make_weight("Q4_0", 100, 160)
    x = torch.zeros(40, 160)
    with pytest.raises(ValueError, match="unknown kernel 'amx'"):
        C.gemm(x, wt.raw, int(GT["Q4_0"]), None, "amx")
    for k in KERNELS:
        if k not in C.prefill_kernels():
            with pytest.raises(ValueError, match="not available"):
                C.gemm(x, wt.raw, int(GT["Q4_0"]), None, k)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
@pytest.mark.parametrize("march", ["x86-64", "skylake-avx512", "cooperlake", "sapphirerapids"])
def test_gemm_file_compiles_for_each_isa_level(march):
    """gemm_amx.cpp on hosts without AVX-512 (stubs: f32 only), AVX-512 without BF16 (stubs), AVX-512 BF16 without
    AMX (avx512-bf16 only) and AMX.  Reference: the compiler (the extension itself is built -march=native)."""
    src = Path(__file__).resolve().parent.parent / "csrc"
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-fopenmp", f"-march={march}", f"-I{src}",
           str(src / "cpu" / "gemm_amx.cpp")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"gemm_amx.cpp does not compile for -march={march}:\n{r.stderr[-3000:]}"
