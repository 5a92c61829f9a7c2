"""AWQ int4 on the fast CPU kernels: the load-time repack (AutoAWQ "gemm" -> pyllm's AWQ rows, csrc/common/blocks.h),
the scalar, AVX2 and AVX-512 VNNI GEMVs, dequantize, and AWQ models on the fast backend end to end.

References (none of them pyllm's kernels):
- Weights: random codes q, zeros z (0..15) and fp16 scales s drawn here and packed with tests/test_awq.py's packer
  (written from REFERENCE.md §4); the exact weights are (q - z) * s in float32 (exact: 5-bit times 11-bit), which
  AutoAWQ's dequantize_gemm (copied in test_awq.py) and AWQTensor.dequantize also give.  Dequantize must equal it
  bit for bit on both ISAs.
- GEMV: float64 products on those exact weights, with test_kernels.py's error metric max|y - ref| / max(max|ref|,
  rms).  Two tolerances, as for the GGUF types: against x rounded to int8 per 32 values exactly as the kernels do
  (emulated in numpy): 1e-5 (only fp32 rounding of the per-block scale products remains, so a wrong nibble, zero
  or scale shows up by orders of magnitude); against the plain float64 product: 5e-2 on that max metric (the
  int8 rounding of x: ~0.55% of an output's rms per value for Gaussian x, see test_kernels.py) and 1.5e-2 on the
  Frobenius relative error ||y - ref|| / ||ref|| (measured ~6e-3).  Scalar vs each SIMD path: 1e-5 (same integer
  sums, other fp32 order); AVX-512 VNNI (emulated where the CPU lacks it) gives the AVX2 bits.
- End to end: the auto-round fixtures of test_awq.py; the reference backend (AWQTensor's torch dequantization +
  float32 matmuls, which test_awq.py ties to transformers at 1e-3) against the fast backend.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyllm import _ext
from pyllm.formats.awq.repack import AWQRows, repack, repack_weights
from pyllm.formats.awq.unpack import AWQTensor
from test_awq import HAVE_AUTO_ROUND, dequantize_gemm, fixtures, needs_writer, random_awq  # noqa: F401 (fixture)
from test_kernels import C, C_all_isas, SEED, gemv_on_every_isa, quantize_like_kernels, rel_err, rng_for, why  # noqa: F401 (fixture)

TOL_EXACT, TOL_Q8, TOL_FRO = 1e-5, 5e-2, 1.5e-2

# (K, N, G): every group size, K = 576 with G = 64 (SmolLM2), N % 8 == 0 but not a multiple of 64, one row word.
SHAPES = [(128, 64, 32), (256, 96, 64), (576, 40, 64), (576, 200, 64), (384, 256, 128), (1024, 72, 128),
          (512, 24, 256), (4096, 8, 128), (1536, 576, 64)]


class AwqWeight:
    """Random AWQ tensors, their exact float32 W [N, K], and the repacked rows."""

    def __init__(self, C, k, n, g, seed):
        self.q, self.z, self.s, self.qweight, self.qzeros = random_awq(k, n, g, seed=seed)
        self.W = ((self.q - self.z.repeat_interleave(g, 0)).float() * self.s.float().repeat_interleave(g, 0)).T
        self.W = self.W.contiguous()
        self.W64 = self.W.double()
        self.colsq = (self.W64 ** 2).sum(0)
        self.rows = C.awq_repack(self.qweight, self.qzeros, self.s, g)
        self.qtype = C.awq_qtype(g)
        self.k, self.n, self.g = k, n, g

    def ref(self, x):
        return x.double() @ self.W64.T


def make(C, k, n, g):
    return AwqWeight(C, k, n, g, seed=(SEED + 7 * k + n + g) % 2**31)


@pytest.mark.parametrize("k,n,g", SHAPES)
def test_repack_dequantize_is_exact(C, k, n, g):
    w = make(C, k, n, g)
    assert w.rows.dtype == torch.uint8 and tuple(w.rows.shape) == (n, k // 2 + 3 * k // g)
    t = AWQTensor(w.qweight, w.qzeros, w.s, g)
    assert torch.equal(t.dequantize(torch.float32), w.W)
    assert torch.equal(w.W.half(), dequantize_gemm(w.qweight, w.qzeros, w.s, 4, g).T)  # AutoAWQ's own, in fp16
    ids = torch.from_numpy(rng_for("ids", k, n, g).integers(0, n, 7))
    for isa in C.available_isas():
        C.set_isa(isa)
        assert torch.equal(C.awq_repack(w.qweight, w.qzeros, w.s, g), w.rows), f"{isa} repack differs"
        got = C.dequantize(w.rows, w.qtype)
        assert torch.equal(got, w.W), f"{isa}: dequantize of the repacked rows differs " + why(k, n, g)
        assert torch.equal(C.dequantize(w.rows, w.qtype, ids), w.W[ids]), why(isa, k, n, g)


@pytest.mark.parametrize("k,n,g", SHAPES)
def test_gemv_against_float64(C, k, n, g):
    w = make(C, k, n, g)
    for M in range(1, 9):
        x = torch.from_numpy(rng_for("x", k, n, g, M).standard_normal((M, k), dtype=np.float32))
        ref = w.ref(x)
        exact = quantize_like_kernels(x, 32) @ w.W64.T
        ys = gemv_on_every_isa(C, f"AWQ G{g}", w.rows, w.qtype, x, w,
                               [(exact, TOL_EXACT, "int8-x float64"), (ref, TOL_Q8, "float64")])
        for isa, y in ys.items():
            fro = ((y.double() - ref).norm() / ref.norm()).item()
            assert fro < TOL_FRO, f"{isa} vs float64, Frobenius: {fro:.3g} " + why(k, n, g, M)


@pytest.mark.parametrize("M", [1, 20, 40])
def test_mul_mat_paths_and_threads(C, M):
    """mul_mat: GEMV (M <= 8), 8-row GEMV chunks below C.gemm_min_rows(), prefill GEMM from there (f32: 1e-5,
    bf16: 2e-2)."""
    w = make(C, 1536, 576, 64)
    x = torch.from_numpy(rng_for("mm", M).standard_normal((M, 1536), dtype=np.float32))
    old = C.get_num_threads()
    try:
        C.set_num_threads(1)
        y1 = C.mul_mat(x, w.rows, w.qtype)
        C.set_num_threads(2)
        y2 = C.mul_mat(x, w.rows, w.qtype)
    finally:
        C.set_num_threads(old)
    assert torch.equal(y1, y2)
    tol = TOL_EXACT if M >= C.gemm_min_rows() else TOL_Q8
    if M >= C.gemm_min_rows() and C.prefill_kernel() != "f32":
        tol = 2e-2  # bf16 prefill GEMM (test_prefill_gemm.py's TOL_BF16)
    assert rel_err(y1, w.ref(x), x, w) < tol, why(M)


def test_awq_rows_through_ops(C):
    """AWQRows quacks like a QTensor for ops.qmatmul / ops.dequantize / ops.embedding."""
    from pyllm import ops

    w = make(C, 256, 96, 64)
    t = repack(AWQTensor(w.qweight, w.qzeros, w.s, 64, name="t"))
    assert isinstance(t, AWQRows) and t.shape == (96, 256) and t.nbytes == 96 * (128 + 12)
    assert torch.equal(ops.dequantize(t), w.W) and torch.equal(t.dequantize(), w.W)
    ids = torch.tensor([[3, 95], [0, 7]])
    assert torch.equal(ops.embedding(t, ids), w.W[ids]) and torch.equal(t.rows(ids), w.W[ids])
    x = torch.randn(2, 256)
    assert rel_err(ops.qmatmul(x, t), w.ref(x), x, w) < TOL_Q8


def test_repack_takes_exact_scales_only(C):
    q, z, s, qw, qz = random_awq(128, 16, 32, seed=1)
    assert repack(AWQTensor(qw, qz, s.float(), 32)) is not None  # fp32 holding fp16 values: exact
    assert repack(AWQTensor(qw, qz, s.bfloat16(), 32)) is not None  # bf16 values of this range fit fp16
    odd = s.float() + 1e-7  # not representable in fp16: keep the AWQTensor path
    assert repack(AWQTensor(qw, qz, odd, 32)) is None
    q, z, s, qw, qz = random_awq(96, 16, 96, seed=2)
    assert repack(AWQTensor(qw, qz, s, 96)) is None  # no row layout for G = 96


def test_cpu_backend_falls_back_per_tensor(C):
    """A weight the row layout cannot take stays an AWQTensor and the CPU backend multiplies it (same numbers)."""
    from pyllm import backends, ops

    q, z, s, qw, qz = random_awq(96, 16, 96, seed=3)
    w = make(C, 128, 16, 32)
    weights = {"a": AWQTensor(qw, qz, s, 96), "b": AWQTensor(w.qweight, w.qzeros, w.s, 32)}
    b = backends.get("fast")
    weights = b.prepare_weights(weights)
    assert isinstance(weights["a"], AWQTensor) and isinstance(weights["b"], AWQRows)
    assert b.linear != b.qmatmul
    x = torch.randn(1, 96)
    torch.testing.assert_close(b.linear(x, weights["a"]), x @ weights["a"].dequantize().T, rtol=1e-5, atol=1e-5)
    b = backends.get("fast")
    b.prepare_weights({"b": AWQTensor(w.qweight, w.qzeros, w.s, 32)})
    assert b.linear == b.qmatmul and b.embed is ops.embedding  # all repacked: the GGUF ops (and the C++ step)


# ---- bad calls raise Python exceptions naming the values ------------------------------------------------
def test_repack_rejects_bad_arguments(C):
    q, z, s, qw, qz = random_awq(256, 64, 64, seed=4)
    with pytest.raises(TypeError, match=r"awq_repack: qweight must be Int, got Long"):
        C.awq_repack(qw.long(), qz, s, 64)
    with pytest.raises(TypeError, match=r"awq_repack: scales must be Half, got Float"):
        C.awq_repack(qw, qz, s.float(), 64)
    with pytest.raises(ValueError, match=r"group_size 48 has no CPU layout"):
        C.awq_repack(qw, qz, s, 48)
    with pytest.raises(ValueError, match=r"group_size -1 has no CPU layout"):
        C.awq_repack(qw, qz, s, -1)
    with pytest.raises(ValueError, match=r"K = 192 must be a positive multiple of group_size 128"):
        C.awq_repack(qw[:192].contiguous(), qz[:1], s[:1], 128)
    with pytest.raises(ValueError, match=r"qzeros has shape \[3, 8\], expected \[4, 8\]"):
        C.awq_repack(qw, qz[:3].contiguous(), s, 64)
    with pytest.raises(ValueError, match=r"scales has shape \[4, 32\], expected \[4, 64\]"):
        C.awq_repack(qw, qz, s[:, :32].contiguous(), 64)
    with pytest.raises(ValueError, match=r"qweight must be contiguous"):
        C.awq_repack(qw[:, ::2], qz[:, ::2], s[:, :32], 64)
    with pytest.raises(ValueError, match=r"qweight must be 2-D"):
        C.awq_repack(qw.reshape(-1), qz, s, 64)
    with pytest.raises(ValueError, match=r"awq_qtype: group_size 100 has no CPU layout"):
        C.awq_qtype(100)


def test_awq_rows_checked_like_gguf_blocks(C):
    w = make(C, 256, 16, 64)
    with pytest.raises(ValueError, match=r"gemv: w has 140 bytes per row but AWQ_G64 with K=512 needs 280"):
        C.gemv(torch.zeros(1, 512), w.rows, w.qtype)
    with pytest.raises(ValueError, match=r"K=100 is not a multiple of AWQ_G64's block size 64"):
        C.gemv(torch.zeros(1, 100), w.rows, w.qtype)


# ---- end to end: auto-round fixtures on the fast backend against the reference backend --------------------------
PROMPT = ("Hello world! The quick brown fox jumps over the lazy dog. Once upon a time there was a small language "
          "model that lived in a test. Quantization keeps four bits per weight and a scale per group.")


def _decode_logits(llm, ids):
    g = llm.generator
    g.reset()
    out = [g._forward([t])[-1] for t in ids]
    g.reset()
    return torch.stack(out).double()


@needs_writer
@pytest.mark.parametrize("g", [32, 64, 128])
def test_fast_backend_matches_reference(fixtures, g):  # noqa: F811 (the imported fixture)
    """Every AWQ linear runs repacked through the GGUF ops and the C++ decode step.  Prefill (> 32 tokens) on the
    float32 GEMM equals the reference to 1e-4 relative; on a bf16 prefill kernel (AMX / AVX-512, x and W rounded to
    bf16) within 3e-2 (measured ~1e-2 on these near-uniform logits; half the int8 decode's error); decode (int8 activations, token by
    token) within 5e-2 relative of max|logit| (measured ~2.2%: random tiny models have near-uniform logits) with
    mean KL < 1e-3 (measured ~1.6e-4), argmax equal except at reference near-ties (top-2 gap < 0.1), and greedy
    decoding identical for 32 tokens or diverging only at such a near-tie."""
    import pyllm

    d, _ = fixtures[g]
    ref = pyllm.load(d, kernels="reference", n_ctx=128)
    fast = pyllm.load(d, kernels="fast", n_ctx=128)
    quant = [n for n, w in ref.weights.items() if isinstance(w, AWQTensor)]
    assert len(quant) == 14 and all(isinstance(fast.weights[n], AWQRows) for n in quant)
    ids = ref.tokenize(PROMPT)
    assert len(ids) > 32
    lr = ref.logits(ids).double()
    scale = lr.abs().max()
    C = _ext.load()
    default = C.prefill_kernel()
    try:
        C.set_prefill_kernel("f32")
        lp = fast.logits(ids).double()
    finally:
        C.set_prefill_kernel(default)
    assert ((lp - lr).abs().max() / scale).item() < 1e-4
    if default != "f32":
        lp = fast.logits(ids).double()
        assert ((lp - lr).abs().max() / scale).item() < 3e-2, default

    ld = _decode_logits(fast, ids)
    assert fast.model.fused_step(fast.kv) is not None  # the C++ decode step ran
    assert ((ld - lr).abs().max() / scale).item() < 5e-2
    pr, pf = torch.log_softmax(lr, -1), torch.log_softmax(ld, -1)
    kl = (pr.exp() * (pr - pf)).sum(-1).mean().item()
    assert kl < 1e-3, kl
    top2 = lr.topk(2, -1).values
    gap = top2[:, 0] - top2[:, 1]
    differ = lr.argmax(-1) != ld.argmax(-1)
    assert (gap[differ] < 0.1).all(), gap[differ]

    start = ids[:8]
    tr = list(ref.generate_tokens(start, max_tokens=32, temperature=0))
    tf = list(fast.generate_tokens(start, max_tokens=32, temperature=0))
    if tr != tf:
        i = next(j for j, (a, b) in enumerate(zip(tr, tf)) if a != b)
        lg = ref.logits(start + tr[:i])[-1]
        t2 = lg.topk(2).values
        assert (t2[0] - t2[1]).item() < 0.1, f"greedy diverges at {i} where the reference's top-2 gap is " \
                                            f"{(t2[0] - t2[1]).item():.3f}"


def test_without_extension_awq_tensors_stay(C, monkeypatch):
    from pyllm import _ext
    from pyllm.errors import PyllmError

    def no_ext():
        raise PyllmError("no extension (test)")

    monkeypatch.setattr(_ext, "load", no_ext)
    w = make(C, 128, 16, 32)
    weights = {"b": AWQTensor(w.qweight, w.qzeros, w.s, 32)}
    assert repack_weights(weights) == 1 and isinstance(weights["b"], AWQTensor)


# ---- speed tooling: synthetic AWQ models and `pyllm bench DIR` ---------------------------------------------------
def test_synthetic_awq_model(C):
    from pyllm.errors import PyllmError
    from pyllm import backends
    from pyllm.models import build_model
    from pyllm.models.synthetic import synthetic_model
    from pyllm.runtime.kv_cache import make_kv_cache

    with pytest.raises(PyllmError, match=r"K=576.*group_size 128 \(try another awq_g<G>\)"):
        synthetic_model("smollm2-135m:awq")
    cfg, w = synthetic_model("smollm2-135m:awq_g64")
    assert isinstance(w["blk.0.ffn_down.weight"], AWQRows) and w["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert w["token_embd.weight"].qtype.name == "F16"
    mdl = build_model(cfg, w, backends.get("fast"), max_pos=8)
    kv = make_kv_cache("f16", cfg.n_layer, cfg.n_kv_head, 8, cfg.head_dim)
    with torch.inference_mode():
        a = mdl.forward(torch.tensor([1, 2, 3]), 0, kv)
        b = mdl.forward(torch.tensor([4]), 3, kv)
    assert mdl.fused_step(kv) is not None and torch.isfinite(a).all() and torch.isfinite(b).all()


@needs_writer
def test_bench_on_awq_folder(fixtures, monkeypatch, capsys):  # noqa: F811 (the imported fixture)
    import json

    from pyllm import roofline
    from pyllm.cli.main import main

    from pyllm import ops

    monkeypatch.setattr(roofline, "probe", lambda *a, **k: {})  # no bandwidth measurement in a unit test
    d, _ = fixtures[64]
    threads = torch.get_num_threads(), ops.get_num_threads()
    try:
        assert main(["bench", str(d), "-p", "4", "-n", "2", "-r", "1", "-t", "1", "-o", "json"]) == 0
    finally:  # bench sets both thread counts process-wide; later tests expect the defaults
        torch.set_num_threads(threads[0])
        ops.set_num_threads(threads[1])
    rows = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in rows] == ["pp4", "tg2"] and all(r["avg_ts"] > 0 for r in rows)
    assert rows[0]["model_size"] == sum(p.stat().st_size for p in d.glob("*.safetensors"))
