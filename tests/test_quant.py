"""pyllm.formats.quant reference dequantization.

Oracle: gguf-py's ``gguf.quants.dequantize`` (numpy ports of ggml's ``dequantize_row_*``). pyllm's torch
dequantizers do the same float32 operations in the same order, so results must be bit-identical
(np.array_equal, NaN == NaN), both on random blocks and on real tensors of the three fixture models.
"""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
import gguf.quants  # noqa: E402

from pyllm.formats import quant  # noqa: E402
from pyllm.errors import GGUFError, ModelError  # noqa: E402
from pyllm.formats.gguf import BLOCK_INFO, COMPUTE_TYPES, GGMLType, open_gguf  # noqa: E402
from pyllm.formats.quant import DEQUANTIZERS, QTensor, dequantize_blocks, qtensor_from_gguf  # noqa: E402
from pyllm.synthetic import SCALE_OFFSETS, random_blocks, write_tiny_llama  # noqa: E402

TYPES = sorted(DEQUANTIZERS, key=int)
QUANT_TYPES = [t for t in TYPES if t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)]


def oracle(qtype: GGMLType, raw: np.ndarray) -> np.ndarray:
    """gguf-py's float32 dequantization of raw blocks (uint8, any shape) -> flat float32."""
    with np.errstate(all="ignore"):
        flat = np.ascontiguousarray(raw).reshape(-1)
        return gguf.quants.dequantize(flat, gguf.GGMLQuantizationType(int(qtype))).reshape(-1)


def assert_bits_equal(got: torch.Tensor, want: np.ndarray):
    got = got.numpy().reshape(-1)
    assert got.dtype == want.dtype and got.shape == want.shape
    if not np.array_equal(got, want, equal_nan=True):
        bad = np.flatnonzero(~((got == want) | (np.isnan(got) & np.isnan(want))))
        raise AssertionError(f"{bad.size} values differ, first at {bad[0]}: got {got[bad[0]]!r}, want {want[bad[0]]!r}")


def test_compute_types_match_dequantizers():
    assert set(DEQUANTIZERS) == COMPUTE_TYPES


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_match_oracle(qtype):
    rng = np.random.default_rng(int(qtype))
    bs, ts = BLOCK_INFO[qtype]
    n_rows, k = 24, 4 * max(bs, 32)
    raw = random_blocks(qtype, n_rows * k // bs, rng).reshape(n_rows, k // bs * ts)
    want = oracle(qtype, raw)
    w = QTensor(qtype, (n_rows, k), torch.from_numpy(raw))
    full = w.dequantize()
    assert full.shape == (n_rows, k) and full.dtype == torch.float32
    assert_bits_equal(full, want)
    assert torch.isfinite(full).all()  # finite scales in, finite values out
    idx = torch.tensor([5, 0, 23, 5])
    assert torch.equal(w.rows(idx), full[idx])
    assert torch.equal(w.rows(idx.reshape(2, 2)), full[idx].reshape(2, 2, k))
    assert w.rows(torch.tensor([], dtype=torch.long)).shape == (0, k)
    assert torch.equal(w.dequantize(torch.float16), full.to(torch.float16))
    assert torch.equal(w.rows(idx, torch.bfloat16), full[idx].to(torch.bfloat16))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_arbitrary_scale_bytes_match_oracle(qtype):
    """Fully random bytes (inf/NaN/subnormal fp16 scales too): the formulas, not only the typical values, agree."""
    _, ts = BLOCK_INFO[qtype]
    raw = np.random.default_rng(100 + int(qtype)).integers(0, 256, (512, ts), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:  # make sure the fp16 specials appear
        raw[:4, off : off + 2] = np.array([0x7C00, 0xFC00, 0x7E00, 0x0001], np.uint16).view(np.uint8).reshape(4, 2)
    assert_bits_equal(dequantize_blocks(qtype, torch.from_numpy(raw)), oracle(qtype, raw))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [1, 3])
def test_blocks_at_an_odd_offset_match_oracle(qtype, n_rows):
    """A file with general.alignment 1 can place a tensor at an odd byte offset, so its fp16 scales are not
    2-byte aligned in the mapping. One block (a single-row view is already contiguous, so no copy happens on the
    way to the fp16 view) and several rows both dequantize like gguf-py (found by tools/fuzz_gguf.py --deep)."""
    bs, ts = BLOCK_INFO[qtype]
    raw = random_blocks(qtype, n_rows, np.random.default_rng(7 + int(qtype))).reshape(n_rows, ts)
    buf = torch.cat([torch.zeros(1, dtype=torch.uint8), torch.from_numpy(raw).reshape(-1)])
    w = QTensor(qtype, (n_rows, bs), buf[1:].view(n_rows, ts))
    assert w.data.data_ptr() % 2 == 1
    assert_bits_equal(w.dequantize(), oracle(qtype, raw))
    assert_bits_equal(w.rows(torch.tensor([n_rows - 1])), oracle(qtype, raw[-1:]))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.F16], ids=lambda t: t.name)
def test_chunked_path(monkeypatch, qtype):
    bs, ts = BLOCK_INFO[qtype]
    raw = random_blocks(qtype, 100, np.random.default_rng(7))
    whole = dequantize_blocks(qtype, torch.from_numpy(raw))
    monkeypatch.setattr(quant, "CHUNK_BLOCKS", 7)  # 100 blocks -> 15 chunks, the last one partial
    assert torch.equal(dequantize_blocks(qtype, torch.from_numpy(raw)), whole)
    assert torch.equal(dequantize_blocks(qtype, torch.from_numpy(raw), torch.float16), whole.half())
    assert_bits_equal(whole, oracle(qtype, raw))


# -- real tensors -------------------------------------------------------------------------------------------

MODELS = ["smollm2_path", "qwen2_path", "gemma3_path"]
ROWS = 16


@pytest.mark.parametrize("fixture", MODELS)
def test_real_tensors_match_oracle(request, fixture):
    """Every block type in the file: first/last 16 rows of up to 3 tensors (first, middle, last of that type)."""
    gf = open_gguf(request.getfixturevalue(fixture))
    by_type: dict[GGMLType, list[str]] = {}
    for name, t in gf.tensors.items():
        by_type.setdefault(t.ggml_type, []).append(name)
    assert set(by_type) <= COMPUTE_TYPES
    checked = 0
    for qtype, names in by_type.items():
        picks = sorted({names[0], names[len(names) // 2], names[-1]})
        for name in picks:
            w = qtensor_from_gguf(gf, name)
            assert w.qtype == qtype and w.shape == gf.tensors[name].shape
            assert w.data.data_ptr() == gf.raw(name).data_ptr()  # zero-copy
            if len(w.shape) == 1:
                assert_bits_equal(w.dequantize(), oracle(qtype, w.data.numpy()))
                continue
            n = w.shape[0]
            idx = torch.tensor(sorted(set(range(min(ROWS, n))) | set(range(max(0, n - ROWS), n))))
            want = oracle(qtype, w.data[idx].numpy())
            assert_bits_equal(w.rows(idx), want)
            checked += 1
    assert checked >= len(by_type) - 1  # at least one matrix per quantized type


def test_real_rows_equal_slice_of_whole(qwen2_path):
    """rows() of real matrices (the Q5_0 embedding, a K-quant ffn) equals the slice of the full dequantization."""
    gf = open_gguf(qwen2_path)
    emb = qtensor_from_gguf(gf, "token_embd.weight")  # 151936 x 896: only decode a slab, the table is 136M values
    idx = torch.tensor([0, 4095, 42, 42, 1000])
    assert torch.equal(emb.rows(idx), QTensor(emb.qtype, (4096, 896), emb.data[:4096]).dequantize()[idx])
    assert_bits_equal(emb.rows(torch.tensor([151935])), oracle(emb.qtype, emb.data[-1:].numpy()))
    w = qtensor_from_gguf(gf, "blk.0.ffn_down.weight")
    full = w.dequantize()
    assert full.shape == w.shape == (896, 4864)
    idx = torch.tensor([895, 0, 300])
    assert torch.equal(w.rows(idx), full[idx])


def test_float_tensors_are_views(gemma3_path):
    gf = open_gguf(gemma3_path)
    w = qtensor_from_gguf(gf, "output_norm.weight")
    assert w.qtype == GGMLType.F32 and w.is_float
    t = w.typed()
    assert t.dtype == torch.float32 and t.shape == w.shape and t.data_ptr() == gf.raw(w.name).data_ptr()
    d = w.dequantize()
    assert torch.equal(d, t) and d.data_ptr() != t.data_ptr()  # callers may modify what dequantize() returns


# -- errors -------------------------------------------------------------------------------------------------


def test_qtensor_rejects_bad_input():
    blocks = torch.from_numpy(random_blocks(GGMLType.Q4_0, 4))
    with pytest.raises(ModelError, match="IQ2_XXS"):
        QTensor(GGMLType.IQ2_XXS, (1, 256), torch.zeros(66, dtype=torch.uint8))
    with pytest.raises(ModelError, match="need 54"):
        QTensor(GGMLType.Q4_0, (3, 32), blocks)
    with pytest.raises(ModelError, match="whole Q4_0 blocks"):
        QTensor(GGMLType.Q4_0, (2, 48), blocks)
    with pytest.raises(ModelError, match="uint8"):
        QTensor(GGMLType.Q4_0, (2, 64), blocks.view(torch.int8))
    w = QTensor(GGMLType.Q4_0, (2, 64), blocks, name="w")
    with pytest.raises(ModelError, match="'w': row index 2 is out of range for 2 rows"):
        w.rows(torch.tensor([0, 2]))
    with pytest.raises(ModelError, match="row index -1"):
        w.rows(torch.tensor([-1]))
    with pytest.raises(ModelError, match="integers"):
        w.rows(torch.tensor([0.0]))
    with pytest.raises(ModelError, match="float tensors"):
        w.typed()
    assert w.to("cpu").dequantize().equal(w.dequantize())


def test_tiny_model_tensors_all_dequantize(tmp_path):
    """Every tensor of a synthetic K-quant model loads through qtensor_from_gguf and decodes to finite values."""
    gf = open_gguf(write_tiny_llama(tmp_path / "m.gguf", qtype=GGMLType.Q6_K, arch="qwen2", n_embd=256, n_ff=512))
    for name in gf.tensors:
        w = qtensor_from_gguf(gf, name)
        v = w.dequantize()
        assert v.shape == w.shape and torch.isfinite(v).all(), name
    with pytest.raises(GGUFError, match="no tensor named"):
        qtensor_from_gguf(gf, "blk.9.attn_q.weight")
