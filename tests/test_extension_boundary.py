"""Property test of the extension boundary: random (mostly wrong) arguments raise Python exceptions, never crash.

Every exported kernel entry point gets tensors of random dtype, rank, shape, contiguity and type id, built around
valid cases so that many calls get deep into the checks. A crash (segfault, abort) fails the whole run, which is
the point; an exception outside the allowed set, or a result with the wrong shape, fails the example.
"""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pyllm import _ext  # noqa: E402
from pyllm.formats.gguf import BLOCK_INFO, GGMLType  # noqa: E402

ALLOWED = (ValueError, TypeError, IndexError, NotImplementedError, RuntimeError, OverflowError)
TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
         GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
DTYPES = [torch.uint8, torch.int8, torch.float32, torch.float16, torch.int64, torch.int32, torch.float64]


@pytest.fixture(scope="module")
def C():
    return _ext.load()


@st.composite
def call_args(draw):
    qtype = draw(st.sampled_from(TYPES + [-1, 4, 5, 29, 31, 999]))
    bs, ts = BLOCK_INFO.get(qtype, (32, 18)) if qtype in BLOCK_INFO else (32, 18)
    n = draw(st.integers(0, 9))
    kb = draw(st.integers(0, 3))
    k = kb * bs + draw(st.sampled_from([0, 0, 0, 1, -1])) if kb else draw(st.integers(0, 3))
    row_bytes = max(kb * ts + draw(st.sampled_from([0, 0, 0, 1, -2])), 0)
    m = draw(st.sampled_from([0, 1, 2, 8, 9, 33]))
    wd = draw(st.sampled_from(DTYPES[:2] + [torch.float32]))
    xd = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.float64, torch.int32]))
    w_rank = draw(st.sampled_from([2, 2, 2, 1, 3]))
    w_shape = {1: (n * row_bytes,), 2: (n, row_bytes), 3: (1, n, row_bytes)}[w_rank]
    w = torch.zeros(w_shape, dtype=wd) if wd != torch.uint8 else torch.randint(0, 256, w_shape, dtype=torch.uint8)
    if wd == torch.uint8 and qtype in BLOCK_INFO and w_rank == 2 and n and row_bytes:
        # finite fp16 scales where a valid call is possible, so the results can be checked for shape only
        w.view(-1)[:] = torch.randint(0, 60, (w.numel(),), dtype=torch.uint8)
    x = torch.randn(m, max(k, 0)).to(xd)
    if draw(st.booleans()) and x.dim() == 2 and x.shape[1] > 1:
        x = x[:, ::2]  # non-contiguous
    out = None
    if draw(st.booleans()):
        out = torch.empty(draw(st.sampled_from([(m, n), (m, n + 1), (n,)])), dtype=draw(
            st.sampled_from([torch.float32, torch.float16])))
    ids = None
    if draw(st.booleans()):
        ids = torch.tensor(draw(st.lists(st.integers(-3, n + 3), max_size=4)), dtype=draw(
            st.sampled_from([torch.int64, torch.int32, torch.float32])))
    fn = draw(st.sampled_from(["gemv", "gemm", "mul_mat", "dequantize"]))
    return fn, x, w, int(qtype), out, ids


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(call_args())
def test_random_arguments_raise_python_exceptions_only(C, args):
    fn, x, w, qtype, out, ids = args
    try:
        if fn == "dequantize":
            y = C.dequantize(w, qtype, ids)
            assert y.dtype == torch.float32 and y.dim() == 2
        else:
            y = getattr(C, fn)(x, w, qtype, out)
            assert y.dtype == torch.float32 and y.shape[-1] == w.shape[0]
    except ALLOWED:
        pass


@st.composite
def repack_args(draw):
    qtype = draw(st.sampled_from(TYPES + [-1, 999]))
    _, ts = BLOCK_INFO.get(qtype, (32, 18)) if qtype in BLOCK_INFO else (32, 18)
    n = draw(st.sampled_from([0, 8, 12, 16]))
    row_bytes = max(draw(st.integers(0, 3)) * ts + draw(st.sampled_from([0, 0, 1, -2])), 0)
    buf = torch.randint(0, 60, (3 * n * row_bytes + 64,), dtype=torch.uint8)  # finite fp16 scales
    w = buf[:n * row_bytes].view(n, row_bytes)
    kind = draw(st.sampled_from(["none", "fresh", "dtype", "shape", "transposed", "overlap", "beside"]))
    out = {"none": None,
           "fresh": torch.empty(n, row_bytes, dtype=torch.uint8),
           "dtype": torch.empty(n, row_bytes, dtype=torch.int16),
           "shape": torch.empty(n + 8, row_bytes, dtype=torch.uint8),
           "transposed": torch.empty(row_bytes, n, dtype=torch.uint8).t(),
           "overlap": buf[row_bytes:row_bytes + n * row_bytes].view(n, row_bytes),
           "beside": buf[n * row_bytes + 64:2 * n * row_bytes + 64].view(n, row_bytes)}[kind]
    return int(qtype), w, out


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(repack_args())
def test_repack_into_out_and_huge_page_advice_raise_python_exceptions_only(C, args):
    """repack_rows8 with an ``out`` of any dtype, shape, layout or overlap with w, and advise_huge_pages on the same
    tensors: a result of w's shape written into out where it is valid, a Python exception otherwise."""
    qtype, w, out = args
    try:
        y = C.repack_rows8(w, qtype, out)
        assert y.shape == w.shape and y.dtype == torch.uint8
        assert out is None or y.data_ptr() == out.data_ptr()
    except ALLOWED:
        pass
    for t in (w, out):
        if t is None:
            continue
        try:
            assert 0 <= C.advise_huge_pages(t) <= t.numel() * t.element_size()
        except ALLOWED:
            assert not t.is_contiguous()
