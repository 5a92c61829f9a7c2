"""The C++ CPU kernels (pyllm._C via pyllm._ext) against gguf.quants, the oracle.

Weights are random raw GGUF blocks: random bytes are valid codes for every type, and the fp16 scale/min fields
are overwritten with random finite values of sane size (|d| in [0.002, 0.02]) so no block is inf/nan.
gguf.quants.dequantize (gguf-py, independent of pyllm) turns them into the float weights W [N, K]; the reference
product is computed in float64 as x.double() @ W.double().T.  Inputs are fresh each run: the seed comes from the
clock (or PYLLM_TEST_SEED) and every failure message prints it.

Each quantized-weight product is checked twice (error metric: max|y - ref| / max(max|ref|, rms), where
rms = sqrt(mean_{m,n} sum_k (W x)^2) is the size of an output for random data, so one output that happens to be
near zero cannot make a test flaky):
- against x_q @ W.T, x_q being x rounded to int8 blocks exactly as the kernels do it (emulated in numpy: scale
  max|x|/127 in fp32, round half to even; with precise_x, Q8_0 gets int16 blocks, scale max|x|/32767):
  TOL_EXACT = 1e-5.  The kernels then differ from float64 only by fp32
  rounding of per-block scale products and sums (~1e-7 per block, seen <= 1e-6), so any wrong nibble, bit,
  scale, min or offset shows up by orders of magnitude;
- against the plain float64 product: TOL_Q8 = 5e-2.  Rounding x to int8 with scale max|x_block|/127 adds an
  error of std ~ max|x_block| / (127 sqrt 12) per value, ~0.66% of an output's rms for Gaussian x over blocks of
  256 (~0.55% for 32).  Over many outputs the metric is ~1%; with one or a few outputs it is |z| * 0.66% (seen
  up to 2.3%), so 5% is a 7-sigma bound that does not flake yet catches a broken quantizer.  Q8_0 with
  precise_x (int16 x): TOL_Q16 = 1e-3, the same argument with 32767 levels (~2.6e-5 of an output's rms per sigma).
Float weights (F32/F16/BF16, x unquantized): TOL_F32 = 1e-5; weights widen exactly and fp32 FMA sums over
K <= 4864 in 8-32 partial sums err by ~sqrt(K) * 2^-24 relative (seen <= 4e-7).
Scalar vs AVX2: TOL_ISA = 1e-5 (the same integer block sums, fp32 block accumulation in another order).
"""

import functools
import os
import time
import zlib

import numpy as np
import pytest
import torch

from pyllm import _ext, ops
from pyllm.errors import PyllmError
from pyllm.formats.gguf import GGMLType

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf import quants  # noqa: E402

SEED = int(os.environ.get("PYLLM_TEST_SEED") or time.time_ns() % 2**31)
TOL_F32, TOL_EXACT, TOL_Q8, TOL_Q16, TOL_ISA = 1e-5, 1e-5, 5e-2, 1e-3, 1e-5

FLOAT_TYPES = ["F32", "F16", "BF16"]
LEGACY_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
ROWS8_K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]  # the K-quants with a rows-by-8 layout (Q4_K_R8 ... Q6_K_R8)
ALL_TYPES = FLOAT_TYPES + LEGACY_TYPES + K_TYPES
# Byte offsets of the fp16 scale / min fields inside each block (REFERENCE.md section 5).
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0]}
# (N, K): the fixture models' projections (SmolLM2 576/1536, Qwen2.5-0.5B 896/4864) and odd row counts.
SHAPES = {
    "float": [(1536, 576), (896, 4864), (1, 8), (7, 13), (33, 100)],
    "legacy": [(1536, 576), (4864, 896), (896, 4864), (1, 576), (7, 64), (33, 160)],
    "k": [(576, 1536), (896, 4864), (1, 256), (7, 512), (33, 768)],
}
MS = [1, 2, 5, 8]


def family(name):
    return "float" if name in FLOAT_TYPES else ("legacy" if name in LEGACY_TYPES else "k")


def rng_for(*key):
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def why(*what):
    return f"(PYLLM_TEST_SEED={SEED}; {', '.join(map(str, what))})"


@pytest.fixture(scope="module")
def C_all_isas():
    """The extension with every kernel path on offer: where the CPU lacks AVX-512, its VNNI kernels compiled as
    AVX2 code stand in as 'avx512' (emulate_avx512), so every test below runs their code on any x86 host."""
    try:
        mod = _ext.load()
    except PyllmError as e:
        pytest.fail(f"extension unavailable: {e}")
    mod.default_isa = mod.get_isa()  # the best one, or the one PYLLM_ISA forces for this run
    mod.emulate_avx512(True)
    yield mod
    mod.emulate_avx512(False)
    mod.set_isa(mod.default_isa)


@pytest.fixture
def C(C_all_isas):
    """C_all_isas, set back to this run's kernels after each test: the ISA is process-wide, and the last one a
    test's loop chose (scalar, emulated AVX-512) would otherwise run every later test of the module that loads a
    model, so what those check would depend on which tests ran before them."""
    yield C_all_isas
    C_all_isas.set_isa(C_all_isas.default_isa)


ISAS = ["scalar", "avx2", "avx512", "amx"]


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((ln for ln in f if ln.startswith("flags")), "flags:").split(":", 1)[1].split())


def test_isa_detection_matches_the_kernel_and_names_the_paths(C):
    """Reference: Linux's /proc/cpuinfo flags, which the kernel clears for register state it does not save (so
    they already mean "CPUID and XCR0"); AMX also needs the tile-data permission, granted by Linux >= 5.16.
    Prints which kernel paths this machine runs and which it lacks (pytest -s, or see the -rA summary)."""
    avail = list(C.available_isas())
    emulated = C.avx512_emulated()
    assert avail[0] == "scalar" and all(a in ISAS for a in avail)
    assert C.best_isa() == [a for a in avail if not (emulated and a == "avx512")][-1]  # emulation is never the default
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        flags = cpu_flags()
        expect = {"avx2": {"avx2", "fma", "f16c"} <= flags,
                  "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags}
        expect["amx"] = expect["avx512"] and {"amx_tile", "amx_int8"} <= flags
        # The AVX-512 VNNI kernels must run here, natively or emulated: an AVX2 build that left them out fails.
        assert emulated == (expect["avx2"] and not expect["avx512"]), (emulated, expect)
        expect["avx512"] |= emulated
        for name, want in expect.items():
            assert (name in avail) == want, f"{name}: cpuinfo says {want}, the extension says {name in avail}"
    missing = [i for i in ISAS if i not in avail]
    run = [f"{a} (emulated: its VNNI kernels as AVX2 code)" if emulated and a == "avx512" else a for a in avail]
    print(f"\nkernel paths run: {', '.join(run)}; missing on this CPU: {', '.join(missing) or 'none'}")
    for name in missing:
        with pytest.raises(ValueError, match="not available"):
            C.set_isa(name)
    with pytest.raises(ValueError, match="unknown ISA"):
        C.set_isa("sse9")


def test_avx512_object_defines_only_its_own_functions(C):
    """Reference: nm's table of the symbols gemv_avx512.o (the build's AVX-512 translation unit) defines.  It is
    compiled under an AVX-512 target pragma on every x86 host, so each function it emits is AVX-512 code: one that
    another file also emits (a std:: template such as std::vector's, as a weak symbol) may be the copy the linker
    keeps for all callers, and would then run AVX-512 instructions on CPUs without them.  Only its own namespace
    (pyllm::cpu::avx512) and its three entry points may appear."""
    import platform
    import shutil
    import subprocess
    from pathlib import Path

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX-512 translation unit is empty off x86")
    obj = Path(C.__file__).parent / "gemv_avx512.o"
    nm = shutil.which("nm")
    assert obj.is_file() and nm, f"need {obj} and binutils' nm (found {nm})"
    out = subprocess.run([nm, "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
    # Mangled names: the entry points, and anything naming the namespace (its functions, their statics, and
    # templates instantiated on them, such as rows_of<M, &avx512::dot_q4_0<M>>, which no other file can emit).
    entry = {"_ZN5pyllm3cpu15avx512_compiledEv", "_ZN5pyllm3cpu17row_kernel_avx512ENS_5QTypeE",
             "_ZN5pyllm3cpu21row_kernel_avx512_x16ENS_5QTypeE"}
    foreign = []
    for line in out.splitlines():
        _, kind, name = line.split(" ", 2)
        if kind in "TWVu" and "6avx512" not in name and name not in entry:
            foreign.append(f"{kind} {name}")
    assert not foreign, "gemv_avx512.o defines functions other files may share:\n" + "\n".join(foreign)


class Weight:
    """raw uint8 [N, row_bytes] blocks; W f32 [N, K] from the oracle; W64 its float64 copy and colsq = sum_n W^2
    [K] (cached: the float64 work dominates the test time otherwise)."""

    def __init__(self, raw, W):
        self.raw, self.W = raw, W
        self.W64 = W.double()
        self.colsq = (self.W64 ** 2).sum(0)

    def ref(self, x):
        return x.double() @ self.W64.T


@functools.lru_cache(maxsize=2)
def make_weight(name, N, K) -> Weight:
    return Weight(*_make_weight(name, N, K))


def _make_weight(name, N, K):
    """(raw uint8 [N, row_bytes], W float32 [N, K] from the oracle)."""
    rng = rng_for("w", name, N, K)
    if name == "F32":
        w = rng.standard_normal((N, K), dtype=np.float32)
        return torch.from_numpy(w.view(np.uint8).copy()), torch.from_numpy(w)
    if name == "F16":
        w = rng.standard_normal((N, K)).astype(np.float16)
        return torch.from_numpy(w.view(np.uint8).copy()), torch.from_numpy(w.astype(np.float32))
    if name == "BF16":
        bits = (rng.standard_normal((N, K), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        raw = bits.view(np.uint8).copy()
        return torch.from_numpy(raw), torch.from_numpy(quants.dequantize(raw, GT.BF16).reshape(N, K))
    qt = GT[name]
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    nb = N * K // bs
    raw = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    if name == "MXFP4":  # byte 0 the E8M0 exponent: scales 2^-10 .. 2^-3, as the fp16 ones below
        raw[:, 0] = rng.integers(118, 126, nb)
    for off in F16_FIELDS.get(name, []):
        d = rng.uniform(0.002, 0.02, nb) * rng.choice([-1.0, 1.0], nb)
        raw[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    raw = raw.reshape(N, K // bs * ts)
    W = quants.dequantize(raw, qt).reshape(N, K).astype(np.float32)
    return torch.from_numpy(raw), torch.from_numpy(W)


def rel_err(y, ref, x, w: Weight):
    """max|y - ref| / max(max|ref|, rms);  rms^2 = mean_{m,n} sum_k x_mk^2 W_nk^2 (computed in O(M K))."""
    y, ref = y.double(), ref.double()
    rms = ((x.double() ** 2).sum(0) @ w.colsq / (x.shape[0] * w.W.shape[0])).sqrt()
    return ((y - ref).abs().max() / torch.maximum(ref.abs().max(), rms)).item()


def quantize_like_kernels(x: torch.Tensor, block: int, levels: int = 127) -> torch.Tensor:
    """x f32 [M, K] -> float64 [M, K]: the values the kernels multiply after rounding x to int8 per `block`
    (block 32 for Q4_0..Q5_1, 256 for the K-quants): d = max|x| / 127 and q = rint(x * (1/d)), all in fp32.
    Q8_0 weights get int16 activations: levels = 32767."""
    xb = x.numpy().reshape(x.shape[0], -1, block)
    d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(levels)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    return torch.from_numpy((q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape))


def gemv_cases():
    for name in ALL_TYPES:
        for N, K in SHAPES[family(name)]:
            for M in MS:
                yield pytest.param(name, N, K, M, id=f"{name}-N{N}-K{K}-M{M}")


@pytest.mark.parametrize("name,N,K,M", list(gemv_cases()))
def test_gemv_matches_oracle_and_isas_agree(C, name, N, K, M):
    wt = make_weight(name, N, K)
    w = wt.raw
    x = torch.from_numpy(rng_for("x", name, N, K, M).standard_normal((M, K), dtype=np.float32))
    ref = wt.ref(x)
    checks = [(ref, TOL_F32, "float64")]
    if name not in FLOAT_TYPES:
        xq = quantize_like_kernels(x, 256 if name in K_TYPES else 32)
        checks = [(xq @ wt.W64.T, TOL_EXACT, "int8-x float64"), (ref, TOL_Q8, "float64")]
    gemv_on_every_isa(C, name, w, int(GT[name]), x, wt, checks)


def gemv_on_every_isa(C, label, w, qtype, x, wt: Weight, checks, call=None) -> dict:
    """call(x, w, qtype) (default C.gemv) on each ISA path this CPU has, against each (reference, tolerance, name)
    of checks; scalar and every SIMD path within TOL_ISA; the VNNI dots compute the AVX2 kernels' integer sums in
    the same fp32 order, so avx512 / amx give the AVX2 bits, with the rows-by-8 kernels' two groups per zmm and
    without (C.set_rows8_pairs: each CPU runs one of them by default).  Returns {isa: y}."""
    (M, K), N = x.shape, w.shape[0]
    call = call or C.gemv
    ys = {}
    for isa in C.available_isas():
        C.set_isa(isa)
        ys[isa] = call(x, w, qtype)
        assert ys[isa].shape == (M, N) and ys[isa].dtype == torch.float32
        for r, tol, what in checks:
            err = rel_err(ys[isa], r, x, wt)
            assert err < tol, f"{label} {isa} gemv vs {what} reference: error {err:.3g} > {tol} " + why(N, K, M)
    for isa in ys:
        err = rel_err(ys[isa], ys["scalar"], x, wt)
        assert err < TOL_ISA, f"{label}: scalar and {isa} differ by {err:.3g} " + why(N, K, M)
    default = C.rows8_pairs()
    try:
        for isa in ("avx512", "amx"):
            if isa not in ys:
                continue
            assert torch.equal(ys[isa], ys["avx2"]), f"{label}: {isa} and avx2 differ " + why(N, K, M)
            C.set_isa(isa)
            C.set_rows8_pairs(not default)
            assert torch.equal(call(x, w, qtype), ys["avx2"]), \
                f"{label}: {isa} with rows8 pairs {'on' if not default else 'off'} and avx2 differ " + why(N, K, M)
    finally:
        C.set_rows8_pairs(default)
    return ys


def outlier_mask(x: torch.Tensor) -> torch.Tensor:
    """bool [M, K]: the elements csrc/cpu/gemv.cpp takes out of a Q8_K row: above 6x the row's rms."""
    xd = x.double()
    return xd ** 2 > 36 * (xd ** 2).mean(-1, keepdim=True)


def row_kinds(x: torch.Tensor) -> list[str]:
    """Per row: "plain" (no outlier), "sparse" (1..32 outliers: taken out and added back exactly) or "residual"
    (more: a second Q8_K row holds the rounding residual)."""
    n = outlier_mask(x).sum(-1)
    return ["plain" if k == 0 else "sparse" if k <= 32 else "residual" for k in n.tolist()]


def quantize_q8_K_like_kernels(x: torch.Tensor) -> torch.Tensor:
    """x f32 [M, K] -> float64 [M, K]: what the K-quant GEMVs multiply, per row kind (row_kinds): its Q8_K rounding;
    the Q8_K rounding of the row with its outliers zeroed, plus the outliers themselves; or its Q8_K rounding plus
    the Q8_K rounding of the fp32 residual x - d q (csrc/cpu/gemv.cpp q8_K_residual)."""
    mask = outlier_mask(x)
    dense = torch.where(mask, torch.zeros_like(x), x)
    sparse = quantize_like_kernels(dense, 256) + torch.where(mask, x, torch.zeros_like(x)).double()
    xb = x.numpy().reshape(x.shape[0], -1, 256)
    d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv).astype(np.float32)
    r = torch.from_numpy((xb - d * q).reshape(x.shape).astype(np.float32))
    two_level = quantize_like_kernels(x, 256) + quantize_like_kernels(r, 256)
    kinds = row_kinds(x)
    single = quantize_like_kernels(x, 256)
    rows = [sparse[m] if k == "sparse" else two_level[m] if k == "residual" else single[m] for m, k in enumerate(kinds)]
    return torch.stack(rows)


@pytest.mark.parametrize("name,layout", [(n, "gguf") for n in K_TYPES] + [(n, "rows8") for n in ROWS8_K_TYPES])
@pytest.mark.parametrize("M", [1, 2, 5, 8])
@pytest.mark.parametrize("n_out", [4, 64])
def test_k_quant_gemv_handles_rows_with_outliers(C, name, layout, M, n_out):
    """Reference: float64 x @ W.T.  Rows whose 256-blocks hold values ~60x their rms (Gemma 3's MLP outputs, Qwen2.5's
    ffn_down inputs) would lose them to one Q8_K scale per block.  With a few per row (n_out = 4, 60x) they are taken
    out of the Q8_K row and added back exactly; with more than 32 (n_out = 64 at K = 4096, 200x: a row can only hold
    K/36 values above 6x its rms) the row gets a second Q8_K row with the rounding residual.  Either way the kernels
    give the emulated arithmetic (TOL_EXACT) and beat a single Q8_K row by 4x or more against float64.  Every ISA
    path agrees with scalar within TOL_ISA.  The same for the rows interleaved by 8 (the decode step's copy): the
    outliers' weights are decoded from that layout."""
    N, K = 96, 1024 if n_out == 4 else 4096
    wt = make_weight(name, N, K)
    raw, qtype = (wt.raw, int(GT[name])) if layout == "gguf" else rows8(C, name, wt)
    x = torch.from_numpy(rng_for("xo", name, M).standard_normal((M, K), dtype=np.float32))
    x[:, 37::256 if n_out == 4 else 64] = 60.0 if n_out == 4 else 200.0  # as in Gemma's activations
    assert set(row_kinds(x)) == {"sparse" if n_out == 4 else "residual"}
    single = quantize_like_kernels(x, 256) @ wt.W64.T
    err_single = rel_err(single, wt.ref(x), x, wt)
    ys = {}
    for isa in C.available_isas():
        C.set_isa(isa)
        ys[isa] = C.gemv(x, raw, qtype)
        err = rel_err(ys[isa], quantize_q8_K_like_kernels(x) @ wt.W64.T, x, wt)
        assert err < TOL_EXACT, f"{name} {isa} vs emulated int8-x float64: {err:.3g} " + why(N, K, M)
        err = rel_err(ys[isa], wt.ref(x), x, wt)
        assert err < err_single / 4, f"{name} {isa} vs float64: {err:.3g}, one Q8_K row {err_single:.3g} " + why(
            N, K, M)
        assert rel_err(ys[isa], ys["scalar"], x, wt) < TOL_ISA, f"{name}: {isa} vs scalar " + why(N, K, M)


@pytest.mark.parametrize("name,layout", [(n, "gguf") for n in K_TYPES] + [(n, "rows8") for n in ROWS8_K_TYPES])
def test_k_quant_gemv_rows_do_not_depend_on_each_other(C, name, layout):
    """Rows with and without outliers in one call give bit for bit what each gives alone (outliers are found and
    handled per row), on every ISA path: verifying drafted tokens in one call must not move their logits.  Rows
    0, 2, 4, 6 take residual rows: calls of 2 and 3 rows fit one kernel call with them; those of 6, 7 and 8 rows (9
    to 12 activation rows) are split over two.  Row 7 has its few outliers taken out."""
    N, K = 64, 2048
    wt = make_weight(name, N, K)
    raw, qtype = (wt.raw, int(GT[name])) if layout == "gguf" else rows8(C, name, wt)
    x = torch.from_numpy(rng_for("xmix", name).standard_normal((8, K), dtype=np.float32))
    x[::2, 37::48] = 400.0  # rows 0, 2, 4, 6: 42 outliers each
    x[7, 37::256] = 400.0  # row 7: 8
    assert row_kinds(x) == ["residual", "plain"] * 3 + ["residual", "sparse"]
    for isa in C.available_isas():
        C.set_isa(isa)
        alone = [C.gemv(x[m:m + 1].contiguous(), raw, qtype)[0] for m in range(8)]
        for rows in (slice(0, 2), slice(0, 3), slice(0, 6), slice(1, 8), slice(0, 8)):
            y = C.gemv(x[rows].contiguous(), raw, qtype)
            for i, m in enumerate(range(8)[rows]):
                assert torch.equal(y[i], alone[m]), f"{name} {isa}: row {m} of rows {rows} differs from the row alone"


@pytest.mark.parametrize("name", LEGACY_TYPES + ["MXFP4"] + K_TYPES)
def test_gemv_rows_do_not_depend_on_m(C, name):
    """Each row of an M-row call (M = 2..8) gives bit for bit what it gives alone, on every ISA path: the row
    kernels sum a row in one fp32 order whatever M is, which speculative verification (greedy equality) and
    batched decoding rely on (pyllm/backends/cpu.py EXACT_ROW_TYPES lists these types).  K covers whole 8-block
    groups, a tail of 2 blocks, and a tail alone (the 32-element types, MXFP4 among them: gpt-oss's experts); the Q8_0
    output projection's int16-activation kernel (precise_x) is checked the same way."""
    Ks = [768, 256] if name in K_TYPES else [576, 160]
    for K in Ks:
        N = 40
        wt = make_weight(name, N, K)
        x = torch.from_numpy(rng_for("xm", name, K).standard_normal((8, K), dtype=np.float32))
        calls = [lambda xs: C.gemv(xs, wt.raw, int(GT[name]))]
        if name == "Q8_0":
            calls.append(lambda xs: C.mul_mat(xs, wt.raw, int(GT[name]), None, True))
        for isa in C.available_isas():
            C.set_isa(isa)
            for f in calls:
                alone = [f(x[m:m + 1].contiguous())[0] for m in range(8)]
                for M in (2, 3, 4, 5, 8):
                    y = f(x[:M].contiguous())
                    for m in range(M):
                        assert torch.equal(y[m], alone[m]), f"{name} {isa} K={K}: row {m} of {M} differs from alone"


def numpy_argmax_or_not_finite(y: np.ndarray) -> int:
    """The reference for the C++ RowArgmax: np.argmax (the first of tied maxima) of a finite row, else -1."""
    return int(np.argmax(y)) if np.isfinite(y).all() else -1


def test_row_argmax_is_the_first_largest_and_flags_non_finite_rows(C):
    """Reference: numpy_argmax_or_not_finite.  Lengths around the vector widths, ties (the first wins, +0.0 and
    -0.0 are equal), NaN and both infinities anywhere in the row, including the first and last value."""
    rng = rng_for("row_argmax")
    for n in (1, 2, 7, 8, 15, 16, 17, 31, 33, 64, 100, 4099):
        y = rng.standard_normal(n).astype(np.float32)
        rows = [y, np.zeros(n, np.float32), np.full(n, -3.5, np.float32)]
        if n > 1:
            t = y.copy()
            i, j = sorted(rng.choice(n, 2, replace=False))
            t[i] = t[j] = t.max() + 1  # a tie of two maxima
            rows.append(t)
            z = np.full(n, -1.0, np.float32)
            z[i], z[j] = -0.0, 0.0  # equal to np.argmax: the first
            rows.append(z)
        for bad in (np.nan, np.inf, -np.inf):
            for at in {0, n // 2, n - 1}:
                b = y.copy()
                b[at] = bad
                rows.append(b)
        for r in rows:
            assert C.row_argmax(torch.from_numpy(r)) == numpy_argmax_or_not_finite(r), why(n, r[:8])


@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_argmax_over_chunks_is_numpys_on_its_output(C, threads):
    """Reference: numpy_argmax_or_not_finite of the same call's y, which equals gemv's bit for bit.  N = 4096
    rows of Q8_0 (1.1 MB: the threads take many chunks): random rows; then two equal largest rows in different
    chunks (the first must win); then a block scale of +inf in one row (every x row sees a non-finite value)."""
    N, K = 4096, 256
    wt = make_weight("Q8_0", N, K)
    x = torch.from_numpy(rng_for("xa", threads).standard_normal((3, K), dtype=np.float32))
    raw_tie = wt.raw.clone()  # rows 7 and 3000 the largest for x row 0: scales 1.0, weights +-127 along x's signs
    q = torch.where(x[0] >= 0, 127, -127).to(torch.int8).reshape(K // 32, 32)
    raw_tie[7].view(K // 32, 34)[:, 2:] = q.view(torch.uint8)
    raw_tie[7].view(K // 32, 34)[:, :2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # f16 1.0
    raw_tie[3000] = raw_tie[7]
    raw_inf = wt.raw.clone()
    raw_inf[2000].view(K // 32, 34)[3, :2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # f16 +inf scale
    old = C.get_num_threads()
    try:
        C.set_num_threads(threads)
        for isa in C.available_isas():
            C.set_isa(isa)
            for raw in (wt.raw, raw_tie, raw_inf):
                for precise in (False, True):
                    for M in (1, 3):
                        xs = x[:M].contiguous()
                        y, top = C.gemv_argmax(xs, raw, int(GT["Q8_0"]), precise)
                        same = C.gemv(xs, raw, int(GT["Q8_0"]), None, precise)  # bits (NaN included)
                        assert torch.equal(y.view(torch.int32), same.view(torch.int32)), why(isa, M)
                        want = [numpy_argmax_or_not_finite(r) for r in y.numpy()]
                        assert top == want, why(isa, threads, precise, M, top, want)
            assert C.gemv_argmax(x[:1].contiguous(), raw_tie, int(GT["Q8_0"]), False)[1] == [7], why(isa)
            assert C.gemv_argmax(x, raw_inf, int(GT["Q8_0"]), False)[1] == [-1, -1, -1], why(isa)
    finally:
        C.set_num_threads(old)


def test_gemv_argmax_with_residual_rows_is_numpys_on_its_output(C):
    """Reference: numpy_argmax_or_not_finite of the same call's y (gemv's bits).  Q4_K rows against activation
    rows with many outliers take a second (residual) Q8_K row added after the threads' region, so their argmax is
    found after it; 8 such rows do not fit one kernel call and are split over two (row_kinds as in
    test_k_quant_gemv_rows_do_not_depend_on_each_other)."""
    N, K = 2048, 2048  # 2.4 MB: the threads take many chunks
    wt = make_weight("Q4_K", N, K)
    x = torch.from_numpy(rng_for("xarg", "Q4_K").standard_normal((8, K), dtype=np.float32))
    x[::2, 37::48] = 400.0
    x[7, 37::256] = 400.0
    assert row_kinds(x) == ["residual", "plain"] * 3 + ["residual", "sparse"]
    old = C.get_num_threads()
    try:
        C.set_num_threads(2)
        for isa in C.available_isas():
            C.set_isa(isa)
            for rows in (slice(0, 3), slice(1, 2), slice(0, 8)):
                xs = x[rows].contiguous()
                y, top = C.gemv_argmax(xs, wt.raw, int(GT["Q4_K"]), False)
                assert torch.equal(y, C.gemv(xs, wt.raw, int(GT["Q4_K"]))), why(isa, rows)
                assert top == [numpy_argmax_or_not_finite(r) for r in y.numpy()], why(isa, rows, top)
    finally:
        C.set_num_threads(old)


@pytest.mark.parametrize("N,K", [(96, 640), (37, 576), (160, 896)])
@pytest.mark.parametrize("M", [1, 3, 8, 13])
def test_gemv_precise_x_keeps_16_bit_activations_for_q8_0(C, N, K, M):
    """mul_mat(..., precise_x=True) (the output projection): Q8_0 against int16 activations, ~100x closer to the
    float64 product than the int8 path; types without a 16-bit kernel give exactly their plain result."""
    wt = make_weight("Q8_0", N, K)
    x = torch.from_numpy(rng_for("x16", "Q8_0", N, K, M).standard_normal((M, K), dtype=np.float32))
    xq = quantize_like_kernels(x, 32, levels=32767)
    ys = {}
    for isa in C.available_isas():
        C.set_isa(isa)
        ys[isa] = C.mul_mat(x, wt.raw, int(GT["Q8_0"]), None, True)
        for r, tol, what in [(xq @ wt.W64.T, TOL_EXACT, "int16-x float64"), (wt.ref(x), TOL_Q16, "float64")]:
            err = rel_err(ys[isa], r, x, wt)
            assert err < tol, f"Q8_0 precise_x {isa} vs {what}: error {err:.3g} > {tol} " + why(N, K, M)
    for isa in ys:
        assert rel_err(ys[isa], ys["scalar"], x, wt) < TOL_ISA, isa
    q4 = make_weight("Q4_0", N, K)
    if M < C.gemm_min_rows():  # both on the GEMV (from gemm_min_rows() rows on, only precise_x stays there)
        assert torch.equal(C.mul_mat(x, q4.raw, int(GT["Q4_0"]), None, True), C.mul_mat(x, q4.raw, int(GT["Q4_0"])))


@pytest.mark.parametrize("name", ALL_TYPES)
def test_gemv_threads_and_out(C, name):
    """Rows are independent, so 1 and 2 threads give identical bits; `out` is filled in place."""
    N, K = SHAPES[family(name)][1]
    w = make_weight(name, N, K).raw
    x = torch.from_numpy(rng_for("xt", name).standard_normal((3, K), dtype=np.float32))
    old = C.get_num_threads()
    try:
        C.set_num_threads(1)
        y1 = C.gemv(x, w, int(GT[name]))
        C.set_num_threads(2)
        out = torch.full((3, N), float("nan"))
        y2 = C.gemv(x, w, int(GT[name]), out)
    finally:
        C.set_num_threads(old)
    assert y2.data_ptr() == out.data_ptr()
    assert torch.equal(y1, out), why(name)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequantize_is_bit_exact(C, name):
    N, K = SHAPES[family(name)][-1]
    w, W = make_weight(name, N, K).raw, make_weight(name, N, K).W
    for isa in C.available_isas():
        C.set_isa(isa)
        got = C.dequantize(w, int(GT[name]))
        assert got.shape == (N, K)
        assert torch.equal(got, W), f"{name} {isa}: dequantize differs from gguf.quants " + why(N, K)
        ids = torch.from_numpy(rng_for("ids", name).integers(0, N, 9))
        for dt in (torch.int64, torch.int32):
            assert torch.equal(C.dequantize(w, int(GT[name]), ids.to(dt)), W[ids]), why(name, isa, dt)


# ---- Rows interleaved by 8 (Q4_0_R8 ... Q5_1_R8: the decode step's copy of the layer matrices) ---------------
ROWS8_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
ROWS8_SHAPES = [(1536, 576), (2048, 640), (4864, 896), (8, 32), (24, 160)]
# The K-quants' layouts (Q4_K_R8 ... Q6_K_R8): Qwen2.5's ffn_down (896, 4864), Gemma 3's attn_output and ffn_down
# (640, 1024), (640, 2048), one super-block and one group, a few groups.
ROWS8_K_SHAPES = [(896, 4864), (640, 1024), (640, 2048), (8, 256), (24, 768)]


def rows8_cases(with_m=False):
    for name in ROWS8_TYPES + ROWS8_K_TYPES:
        for N, K in ROWS8_K_SHAPES if name in ROWS8_K_TYPES else ROWS8_SHAPES:
            for M in [1, 2, 5, 8] if with_m else [None]:
                yield pytest.param(name, N, K, *([M] if with_m else []),
                                   id=f"{name}-N{N}-K{K}" + (f"-M{M}" if M else ""))


def rows8(C, name, wt):
    rid = C.rows8_qtype(int(GT[name]))
    return C.repack_rows8(wt.raw, int(GT[name])), rid


@pytest.mark.parametrize("name,N,K", list(rows8_cases()))
def test_rows8_repack_is_lossless(C, name, N, K):
    """Reference: gguf.quants.dequantize of the GGUF rows.  The repacked rows dequantize to exactly those values
    (whole tensor and row lookups, every ISA), and take the same bytes."""
    wt = make_weight(name, N, K)
    r, rid = rows8(C, name, wt)
    assert r.shape == wt.raw.shape and r.dtype == torch.uint8 and not torch.equal(r, wt.raw)
    ids = torch.from_numpy(rng_for("ids8", name, N).integers(0, N, 9))
    for isa in C.available_isas():
        C.set_isa(isa)
        assert torch.equal(C.dequantize(r, rid), wt.W), f"{name}_R8 {isa}: dequantize differs " + why(N, K)
        assert torch.equal(C.dequantize(r, rid, ids), wt.W[ids]), f"{name}_R8 {isa}: row lookup " + why(N, K)


@pytest.mark.parametrize("name,N,K,M", list(rows8_cases(with_m=True)))
def test_rows8_gemv_matches_oracle_and_isas_agree(C, name, N, K, M):
    """The same two references and tolerances as test_gemv_matches_oracle_and_isas_agree (int8-x float64:
    TOL_EXACT; float64: TOL_Q8), on every ISA path; scalar (rows unpacked, then the generic row dot) and SIMD
    within TOL_ISA; the VNNI build's integer sums are the AVX2 build's: identical bits."""
    wt = make_weight(name, N, K)
    r, rid = rows8(C, name, wt)
    x = torch.from_numpy(rng_for("x8", name, N, K, M).standard_normal((M, K), dtype=np.float32))
    xq = quantize_like_kernels(x, 256 if name in ROWS8_K_TYPES else 32)
    checks = [(xq @ wt.W64.T, TOL_EXACT, "int8-x float64"), (wt.ref(x), TOL_Q8, "float64")]
    gemv_on_every_isa(C, f"{name}_R8", r, rid, x, wt, checks)


@pytest.mark.parametrize("name", ROWS8_TYPES + ROWS8_K_TYPES)
def test_rows8_rows_do_not_depend_on_m_or_threads(C, name):
    """Each activation row of an M-row call gives bit for bit what it gives alone, on every ISA path (speculative
    verification's greedy equality), and 1 or 2 threads give the same bits (chunks start on whole groups)."""
    N, K = (48, 768) if name in ROWS8_K_TYPES else (48, 576)
    wt = make_weight(name, N, K)
    r, rid = rows8(C, name, wt)
    x = torch.from_numpy(rng_for("xm8", name).standard_normal((8, K), dtype=np.float32))
    old = C.get_num_threads()
    try:
        for isa in C.available_isas():
            C.set_isa(isa)
            alone = [C.gemv(x[m:m + 1].contiguous(), r, rid)[0] for m in range(8)]
            for M in range(2, 9):  # the kernels take rows 4 at a time: every remainder
                y = C.gemv(x[:M].contiguous(), r, rid)
                for m in range(M):
                    assert torch.equal(y[m], alone[m]), f"{name}_R8 {isa}: row {m} of {M} differs from alone"
            bn, bk = (896, 4864) if name in ROWS8_K_TYPES else (4864, 896)
            rb, _ = rows8(C, name, make_weight(name, bn, bk))
            xb = torch.from_numpy(rng_for("xt8", name).standard_normal((3, bk), dtype=np.float32))
            C.set_num_threads(1)
            y1 = C.gemv(xb, rb, rid)
            C.set_num_threads(2)
            assert torch.equal(C.gemv(xb, rb, rid), y1), f"{name}_R8 {isa}: 1 and 2 threads differ"
    finally:
        C.set_num_threads(old)


@pytest.mark.parametrize("N,K", ROWS8_SHAPES)
@pytest.mark.parametrize("M", [1, 3, 8, 13])
def test_rows8_q8_0_precise_x_keeps_16_bit_activations(C, N, K, M):
    """Q8_0_R8 under mul_mat(..., precise_x=True) (the decode step's output projection): the references and
    tolerances of test_gemv_precise_x_keeps_16_bit_activations_for_q8_0 (int16-x float64: TOL_EXACT; float64:
    TOL_Q16), on every ISA path; scalar and SIMD within TOL_ISA; AVX-512's vpdpwssd sums are AVX2's: identical bits."""
    wt = make_weight("Q8_0", N, K)
    r, rid = rows8(C, "Q8_0", wt)
    x = torch.from_numpy(rng_for("x16r8", N, K, M).standard_normal((M, K), dtype=np.float32))
    xq = quantize_like_kernels(x, 32, levels=32767)
    checks = [(xq @ wt.W64.T, TOL_EXACT, "int16-x float64"), (wt.ref(x), TOL_Q16, "float64")]
    gemv_on_every_isa(C, "Q8_0_R8 precise_x", r, rid, x, wt, checks,
                      call=lambda x, w, q: C.mul_mat(x, w, q, None, True))


def test_rows8_q8_0_precise_x_rows_do_not_depend_on_m_or_threads(C):
    """As test_rows8_rows_do_not_depend_on_m_or_threads, for the int16-activation kernel (precise_x): each row of
    an M-row call gives bit for bit what it gives alone (speculative verification of the logits), and 1 or 2
    threads give the same bits."""
    N, K = 48, 576
    wt = make_weight("Q8_0", N, K)
    r, rid = rows8(C, "Q8_0", wt)
    x = torch.from_numpy(rng_for("xm16r8").standard_normal((8, K), dtype=np.float32))
    old = C.get_num_threads()
    try:
        for isa in C.available_isas():
            C.set_isa(isa)
            alone = [C.mul_mat(x[m:m + 1].contiguous(), r, rid, None, True)[0] for m in range(8)]
            for M in (2, 3, 4, 5, 7, 8):
                y = C.mul_mat(x[:M].contiguous(), r, rid, None, True)
                for m in range(M):
                    assert torch.equal(y[m], alone[m]), f"Q8_0_R8 precise_x {isa}: row {m} of {M} differs from alone"
            big = make_weight("Q8_0", 4096, 640)
            rb, _ = rows8(C, "Q8_0", big)
            xb = torch.from_numpy(rng_for("xt16r8").standard_normal((3, 640), dtype=np.float32))
            C.set_num_threads(1)
            y1 = C.mul_mat(xb, rb, rid, None, True)
            C.set_num_threads(2)
            assert torch.equal(C.mul_mat(xb, rb, rid, None, True), y1), f"Q8_0_R8 precise_x {isa}: threads differ"
    finally:
        C.set_num_threads(old)


def test_rows8_k_quant_ids(C):
    """The K-quants' layouts have the ids qtype.h reserves, and name themselves in errors."""
    assert [C.rows8_qtype(int(GT[n])) for n in ROWS8_K_TYPES] == [64, 65, 66]
    assert C.rows8_qtype(int(GT["Q2_K"])) == -1 and C.rows8_qtype(int(GT["Q3_K"])) == -1
    with pytest.raises(ValueError, match=r"gemv: w is Q6_K_R8 \(rows interleaved by 8\) but has 12 rows"):
        C.gemv(torch.zeros(1, 256), make_weight("Q6_K", 12, 256).raw, 66)


def test_rows8_errors(C):
    """Types without the layout, and row counts that do not fill groups of 8, are refused by name."""
    assert [C.rows8_qtype(int(GT[n])) for n in ROWS8_TYPES] == [60, 61, 62, 63, 67]
    assert C.rows8_qtype(int(GT["F16"])) == -1 and C.rows8_qtype(99) == -1
    with pytest.raises(ValueError, match=r"repack_rows8: F16 has no rows-by-8 layout"):
        C.repack_rows8(make_weight("F16", 8, 32).raw, int(GT["F16"]))
    w12 = make_weight("Q4_0", 12, 64).raw
    with pytest.raises(ValueError, match=r"repack_rows8: w has 12 rows, not a multiple of 8"):
        C.repack_rows8(w12, int(GT["Q4_0"]))
    with pytest.raises(ValueError, match=r"gemv: w is Q4_0_R8 \(rows interleaved by 8\) but has 12 rows"):
        C.gemv(torch.zeros(1, 64), w12, 60)
    with pytest.raises(ValueError, match=r"dequantize: w is Q4_1_R8"):
        C.dequantize(make_weight("Q4_1", 12, 64).raw, 61)


def test_rows8_repack_into_out(C):
    """Reference: the copy repack_rows8 allocates itself.  Written into ``out`` (a view of a larger buffer, as the
    CPU backend's one allocation for every copy), the bytes are the same; an out of another shape or dtype, or one
    that overlaps w, is refused by name."""
    wt = make_weight("Q4_K", 16, 512)
    own = C.repack_rows8(wt.raw, int(GT["Q4_K"]))
    buf = torch.full((wt.raw.numel() + 128,), 0xA5, dtype=torch.uint8)
    out = buf[64:64 + wt.raw.numel()].view(wt.raw.shape)
    got = C.repack_rows8(wt.raw, int(GT["Q4_K"]), out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, own)
    assert (buf[:64] == 0xA5).all() and (buf[64 + wt.raw.numel():] == 0xA5).all()  # nothing outside out written
    with pytest.raises(ValueError, match=r"repack_rows8: out has shape \[8, \d+\], w \[16, \d+\]"):
        C.repack_rows8(wt.raw, int(GT["Q4_K"]), out[:8])
    with pytest.raises(TypeError, match=r"repack_rows8: out must be Byte"):
        C.repack_rows8(wt.raw, int(GT["Q4_K"]), torch.zeros(wt.raw.shape, dtype=torch.int16))
    raw = torch.cat([wt.raw.reshape(-1), torch.zeros(wt.raw.shape[1], dtype=torch.uint8)])
    with pytest.raises(ValueError, match=r"repack_rows8: out overlaps w"):
        C.repack_rows8(raw[:wt.raw.numel()].view(wt.raw.shape), int(GT["Q4_K"]),
                       raw[wt.raw.shape[1]:].view(wt.raw.shape))


def test_advise_huge_pages(C):
    """madvise(MADV_HUGEPAGE) over the 2 MiB pages that lie whole inside the tensor: their bytes on Linux with
    transparent huge pages (0 for a tensor too small to hold one), 0 elsewhere; a non-contiguous tensor is refused
    by name."""
    import sys

    from pyllm import ops

    small = torch.empty(1 << 20, dtype=torch.uint8)
    assert C.advise_huge_pages(small) == 0
    big = torch.empty(8 << 20, dtype=torch.uint8)
    got = C.advise_huge_pages(big)
    if sys.platform == "linux" and ops.huge_pages_mode() is not None:  # a kernel built without THP refuses madvise
        lo = -big.data_ptr() % (1 << 21)
        assert got == (big.numel() - lo) // (1 << 21) * (1 << 21) and got >= 6 << 20
    else:
        assert got == 0
    with pytest.raises(ValueError, match=r"advise_huge_pages: t must be contiguous"):
        C.advise_huge_pages(big.view(2048, 4096).t())


@pytest.mark.parametrize("name", ALL_TYPES)
@pytest.mark.parametrize("M", [9, 40])
def test_gemm_prefill(C, name, M):
    """Dequantized tiles + torch GEMM; (896, 4864) spans several tiles of rows."""
    N, K = (896, 4864) if M == 9 else SHAPES[family(name)][-1]
    wt = make_weight(name, N, K)
    x = torch.from_numpy(rng_for("xg", name, M).standard_normal((M, K), dtype=np.float32))
    err = rel_err(C.gemm(x, wt.raw, int(GT[name])), wt.ref(x), x, wt)
    assert err < TOL_F32, f"{name} gemm error {err:.3g} " + why(N, K, M)


Q4_0 = int(GGMLType.Q4_0)


# ---- pyllm.ops on QTensors ---------------------------------------------------------------------------------

def qtensor(name, N, K):
    from pyllm.formats.quant import QTensor

    return QTensor(GGMLType[name], (N, K), make_weight(name, N, K).raw, name=f"test.{name}")


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q6_K", "F16"])
def test_ops_fast_matches_reference(C, name):
    from pyllm import backends

    N, K = SHAPES[family(name)][0]
    w = qtensor(name, N, K)
    rng = rng_for("ops", name)
    reference = backends.get("reference")
    for M in (1, 8, 20, 40):
        x = torch.from_numpy(rng.standard_normal((M, K), dtype=np.float32))
        ref = reference.linear(x, w)
        y = ops.qmatmul(x, w)
        kernel = C.prefill_kernel() if M >= C.gemm_min_rows() else "int8-gemv"  # below: the GEMV's chunks
        tol = TOL_F32 if name in FLOAT_TYPES or kernel == "f32" else TOL_Q8
        if kernel not in ("f32", "int8-gemv"):
            tol = 2e-2  # bf16 prefill GEMM (test_prefill_gemm.py's TOL_BF16)
        assert rel_err(y, ref, x, make_weight(name, N, K)) < tol, why(name, M)
    x3 = torch.from_numpy(rng.standard_normal((2, 3, K), dtype=np.float32))
    assert ops.qmatmul(x3, w).shape == (2, 3, N)
    assert torch.equal(ops.dequantize(w), w.dequantize())
    ids = torch.tensor([[0, 5], [N - 1, 0]])
    assert torch.equal(ops.embedding(w, ids), w.rows(ids))


def test_mul_mat_picks_the_path_and_keeps_leading_dims(C):
    wt = make_weight("Q4_0", 33, 160)
    rng = rng_for("mm")
    for shape in [(1, 160), (8, 160), (9, 160), (2, 3, 160), (2, 7, 160), (0, 160), (33, 160), (3, 11, 160)]:
        x = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
        y = C.mul_mat(x, wt.raw, Q4_0)
        assert y.shape == (*shape[:-1], 33)
        x2 = x.reshape(-1, 160)
        if x2.shape[0] >= C.gemm_min_rows():
            want = C.gemm(x2, wt.raw, Q4_0, None, C.prefill_kernel())
        elif x2.shape[0]:  # 8-row GEMV chunks
            want = torch.cat([C.gemv(x2[i:i + 8], wt.raw, Q4_0) for i in range(0, x2.shape[0], 8)])
        if x2.shape[0]:
            assert torch.equal(y.reshape(-1, 33), want), why(shape)
            out = torch.empty(*shape[:-1], 33)
            assert C.mul_mat(x, wt.raw, Q4_0, out).data_ptr() == out.data_ptr() and torch.equal(out, y)


def test_ops_without_extension_use_the_reference(C, monkeypatch):
    """If the extension cannot be built, ops still works (torch reference) instead of failing."""
    lazy = ops._LazyExtension()
    lazy.failed = PyllmError("pretend the compiler is missing")
    monkeypatch.setattr(ops, "_C", lazy)
    w = qtensor("Q4_K", 7, 512)
    x = torch.from_numpy(rng_for("noext").standard_normal((2, 512), dtype=np.float32))
    assert torch.equal(ops.qmatmul(x, w), x @ w.dequantize().T)
    assert torch.equal(ops.dequantize(w), w.dequantize())
    assert torch.equal(ops.embedding(w, torch.tensor([3, 1])), w.rows(torch.tensor([3, 1])))


def test_ops_fall_back_for_types_the_kernels_lack(C):
    """IQ4_NL is a real GGUF type quant.py dequantizes but the CPU kernels do not: qmatmul must still work."""
    rng = rng_for("iq4")
    N, K = 7, 64
    raw = rng.integers(0, 256, (N * K // 32, 18), dtype=np.uint8)
    raw[:, 0:2] = rng.uniform(0.002, 0.02, (N * K // 32, 1)).astype(np.float16).view(np.uint8)
    from pyllm.formats.quant import QTensor

    w = QTensor(GGMLType.IQ4_NL, (N, K), torch.from_numpy(raw.reshape(N, -1)))
    x = torch.from_numpy(rng.standard_normal((2, K), dtype=np.float32))
    assert torch.allclose(ops.qmatmul(x, w), x @ w.dequantize().T)
    assert torch.equal(ops.dequantize(w), w.dequantize())
    with pytest.raises(NotImplementedError, match="IQ4_NL"):
        C.gemv(x, w.data, int(GGMLType.IQ4_NL))


# ---- bad calls raise Python exceptions naming the values ------------------------------------------------

def q4_0(N=4, K=576):
    return make_weight("Q4_0", N, K).raw


def test_error_wrong_dtype(C):
    with pytest.raises(TypeError, match=r"gemv: x must be Float, got Double"):
        C.gemv(torch.zeros(1, 576, dtype=torch.float64), q4_0(), Q4_0)
    with pytest.raises(TypeError, match=r"w must be Byte, got Int"):
        C.gemv(torch.zeros(1, 576), torch.zeros(4, 324, dtype=torch.int32), Q4_0)


def test_error_wrong_device(C):
    with pytest.raises(ValueError, match=r"x is on meta"):
        C.gemv(torch.zeros(1, 576, device="meta"), q4_0(), Q4_0)


def test_error_wrong_rank(C):
    with pytest.raises(ValueError, match=r"x must be 2-D, got shape \[1, 1, 576\]"):
        C.gemv(torch.zeros(1, 1, 576), q4_0(), Q4_0)


def test_error_too_many_rows_for_gemv(C):
    with pytest.raises(ValueError, match=r"x has 9 rows, the fused GEMV takes 1..8"):
        C.gemv(torch.zeros(9, 576), q4_0(), Q4_0)


def test_error_non_contiguous(C):
    with pytest.raises(ValueError, match=r"x must be contiguous"):
        C.gemv(torch.zeros(576, 2).T, q4_0(), Q4_0)


def test_error_k_not_divisible_by_block(C):
    with pytest.raises(ValueError, match=r"K=100 is not a multiple of Q4_0's block size 32"):
        C.gemv(torch.zeros(1, 100), q4_0(), Q4_0)


def test_error_row_bytes_mismatch(C):
    with pytest.raises(ValueError, match=r"gemv: w has 610 bytes per row but Q4_0 with K=576 needs 324"):
        C.gemv(torch.zeros(1, 576), torch.zeros(4, 610, dtype=torch.uint8), Q4_0)


def test_error_unknown_type_id(C):
    with pytest.raises(ValueError, match=r"unknown GGML type id 99"):
        C.gemv(torch.zeros(1, 576), q4_0(), 99)
    with pytest.raises(ValueError, match=r"unknown GGML type id -1"):
        C.dequantize(q4_0(), -1)


def test_error_out_shape(C):
    with pytest.raises(ValueError, match=r"out has shape \[1, 5\], expected \[1, 4\]"):
        C.gemv(torch.zeros(1, 576), q4_0(), Q4_0, torch.zeros(1, 5))


def test_error_ids_out_of_range(C):
    with pytest.raises(IndexError, match=r"ids\[1\] = 4 is out of range for 4 rows"):
        C.dequantize(q4_0(), Q4_0, torch.tensor([0, 4]))


def test_error_bad_settings(C):
    with pytest.raises(ValueError, match=r"unknown ISA 'sse9'"):
        C.set_isa("sse9")
    with pytest.raises(ValueError, match=r"n must be >= 1, got 0"):
        C.set_num_threads(0)


def _pyllm(args, **env):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    e = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    return subprocess.run([sys.executable, "-m", "pyllm.cli.main", *args], capture_output=True, text=True,
                          timeout=600, env=e)


def test_pyllm_isa_env_forces_the_kernels_and_rejects_what_the_cpu_lacks(C):
    """README: `PYLLM_ISA=avx2 pyllm --version` names the forced kernels; an unknown or unavailable name is a
    one-line error for a command that runs kernels, never a silent fallback to other kernels."""
    forced = C.available_isas()[-2] if len(C.available_isas()) > 1 else "scalar"
    r = _pyllm(["--version"], PYLLM_ISA=forced)
    assert r.returncode == 0 and f"cpu kernels {forced} of " in r.stdout, r.stdout + r.stderr
    r = _pyllm(["--version"])
    assert f"cpu kernels {C.best_isa()} of " in r.stdout, r.stdout + r.stderr
    bad = next((i for i in ISAS if i not in C.available_isas()), "sse9")
    r = _pyllm(["run", "smollm2-135m", "hi", "-n", "1"], PYLLM_ISA=bad)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyllm: error:") and f"PYLLM_ISA={bad}" in lines[0], r.stderr


def test_rows8_pairs_default_follows_the_cpu_vendor(C):
    """Reference: /proc/cpuinfo's vendor_id.  The AVX-512 rows-by-8 kernels take two 8-row groups per zmm by default
    except on AMD CPUs, where they ran 1.7-2.6x slower (csrc/kernels.h cpu_rows8_pairs), unless this run's
    PYLLM_ROWS8_PAIRS decided.  (Their bits, both ways: gemv_on_every_isa.)"""
    with open("/proc/cpuinfo") as f:
        amd = any(line.split(":")[-1].strip() == "AuthenticAMD" for line in f if line.startswith("vendor_id"))
    env = os.environ.get("PYLLM_ROWS8_PAIRS", "").strip()
    assert C.rows8_pairs() == (env == "1" if env else not amd), (amd, env)


def test_pyllm_repack_env_switches_the_decode_copy(C):
    """README: `pyllm info MODEL --device cpu --json` names the decode step's interleaved copy (repacked_mb: the
    default model's Q4_1 layer matrices, 63.3 MiB, and its Q8_0 output projection, 28.7 MiB), and PYLLM_REPACK=0
    leaves the loaded layout alone."""
    import json

    r = _pyllm(["info", "smollm2-135m", "--device", "cpu", "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["runtime"]["repacked_mb"] == 92.0
    r = _pyllm(["info", "smollm2-135m", "--device", "cpu", "--json"], PYLLM_REPACK="0")
    assert r.returncode == 0 and "repacked_mb" not in json.loads(r.stdout)["runtime"], r.stdout + r.stderr


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_a_non_finite_activation_reaches_its_rows_outputs(C, qtype):
    """A NaN or +-inf among otherwise finite activations makes every output of its row non-finite (every ISA, int8
    and int16 activations, the value first, inside and last in the row), and the other rows stay finite.  The
    activation quantizers once rounded a NaN into finite codes (fmax and max_ps drop NaN), so a broken activation
    became plausible logits instead of the runtime's "non-finite logits" error."""
    N, K = 64, 512
    wt = make_weight(qtype, N, K)
    x = torch.from_numpy(rng_for("nonfinite", qtype).standard_normal((3, K), dtype=np.float32))
    try:
        for isa in C.available_isas():
            C.set_isa(isa)
            for bad in (float("nan"), float("inf"), -float("inf")):
                for at in (0, 37, K - 1):
                    xs = x.clone()
                    xs[1, at] = bad
                    for precise in (False, True):
                        y = C.gemv(xs, wt.raw, int(GT[qtype]), None, precise)
                        assert not torch.isfinite(y[1]).any(), why(isa, bad, at, precise)
                        assert torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all(), why(isa, bad, at, precise)
    finally:
        C.set_isa(C.default_isa)
