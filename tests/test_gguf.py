"""pyllm.formats.gguf: the real fixture files parse, views are zero-copy, and every kind of bad file fails cleanly.

Bad inputs are built with pyllm.synthetic (gguf_bytes writes whatever header it is told) or by byte-patching
a small valid file. Each check asserts the message names the problem, and the huge-count cases must fail fast
(no allocation proportional to the claimed size).
"""

import os
import struct
import time

import numpy as np
import pytest
import torch

from pyllm.errors import GGUFError, ModelError
from pyllm.formats.gguf import COMPUTE_TYPES, GGMLType, TensorInfo, ValueType, open_gguf
from pyllm.synthetic import Typed, gguf_bytes, random_blocks, write_gguf, write_tiny_llama

REAL = [
    # fixture, arch, block_count, n_tokens
    ("smollm2_path", "llama", 30, 49152),
    ("qwen2_path", "qwen2", 24, 151936),
    ("gemma3_path", "gemma3", 18, 262144),
]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("fixture,arch,n_layer,n_tokens", REAL)
def test_real_files_parse(request, fixture, arch, n_layer, n_tokens):
    path = request.getfixturevalue(fixture)
    with open_gguf(path) as gf:
        assert gf.version == 3 and gf.alignment == 32
        assert gf.get("general.architecture") == arch
        assert gf.get(f"{arch}.block_count") == n_layer
        assert gf.get("missing.key", 7) == 7
        tokens = gf.get("tokenizer.ggml.tokens")
        assert len(tokens) == n_tokens and all(isinstance(t, str) for t in tokens[:100])
        assert len(gf.get("tokenizer.ggml.token_type")) == n_tokens
        emb = gf.tensors["token_embd.weight"]
        assert emb.shape == (n_tokens, gf.get(f"{arch}.embedding_length"))
        assert gf.raw("token_embd.weight").shape == (n_tokens, emb.row_bytes)
        norm = gf.tensors["output_norm.weight"]
        assert norm.ggml_type == GGMLType.F32 and gf.raw(norm.name).shape == (norm.nbytes,)
        assert gf.data_offset % 32 == 0 and all(t.offset >= gf.data_offset for t in gf.tensors.values())


def test_qwen2_header_parses_fast(qwen2_path):
    t0 = time.perf_counter()
    open_gguf(qwen2_path).close()  # ~152k tokens + ~151k merges
    assert time.perf_counter() - t0 < 2.0  # ~0.2 s on a quiet core; slack for a shared CI machine


def test_raw_views_are_zero_copy(qwen2_path):
    rss0 = _rss_bytes()
    gf = open_gguf(qwen2_path)  # 491 MB file
    views = [gf.raw(n) for n in gf.tensors]
    assert _rss_bytes() - rss0 < 64 << 20  # nothing copied: only the header pages were touched
    base = gf._u8.data_ptr()
    for v, t in zip(views, gf.tensors.values()):
        assert v.dtype == torch.uint8
        assert v.data_ptr() == base + t.offset  # a view into the one mapping of the file
        assert v.untyped_storage().data_ptr() == base
    gf.close()


def test_views_outlive_close(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf")
    gf = open_gguf(path)
    v = gf.raw("blk.0.attn_q.weight")
    expect = v.clone()
    gf.close()  # must not unmap under the live view
    assert torch.equal(v, expect)
    with pytest.raises(GGUFError, match="closed"):
        gf.raw("blk.0.attn_q.weight")


def test_writes_to_views_never_reach_the_file(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf")
    before = path.read_bytes()
    with open_gguf(path) as gf:
        gf.raw("output_norm.weight")[:] = 0  # private copy-on-write mapping
    assert path.read_bytes() == before


def test_metadata_round_trip(tmp_path):
    md = {
        "u8": Typed(ValueType.UINT8, 255), "i8": Typed(ValueType.INT8, -128), "u16": Typed(ValueType.UINT16, 65535),
        "i16": Typed(ValueType.INT16, -32768), "u32": 2**32 - 1, "i32": -5, "u64": 2**63, "i64": -(2**40),
        "f32": 0.5, "f64": Typed(ValueType.FLOAT64, 0.1), "t": True, "f": False, "s": "héllo", "empty": "",
        "raw": b"\xff\xfe", "arr_f": [1.5, -2.0], "arr_b": [True, False, True], "arr_s": ["a", "", "ü"],
        "nested": [[1, 2], [3]], "empty_arr": [],
    }  # fmt: skip
    path = write_gguf(tmp_path / "m.gguf", md, {})
    gf = open_gguf(path)
    m = gf.metadata
    assert list(m) == list(md)
    assert (m["u8"], m["i8"], m["u16"], m["i16"], m["u32"], m["i32"]) == (255, -128, 65535, -32768, 2**32 - 1, -5)
    assert (m["u64"], m["i64"], m["f32"], m["f64"]) == (2**63, -(2**40), 0.5, 0.1)
    assert m["t"] is True and m["f"] is False and m["s"] == "héllo" and m["empty"] == ""
    assert m["raw"].encode("utf-8", "surrogateescape") == b"\xff\xfe"  # exact bytes recoverable
    assert m["arr_f"] == [1.5, -2.0] and m["arr_b"] == [True, False, True] and m["arr_s"] == ["a", "", "ü"]
    assert m["nested"] == [[1, 2], [3]] and m["empty_arr"] == []
    assert gf.tensors == {}


def test_synthetic_file_agrees_with_gguf_py(tmp_path):
    """Cross-check writer and reader against gguf-py's reader on a small file with several types."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(1)
    tensors = {
        "a": (GGMLType.Q4_K, random_blocks(GGMLType.Q4_K, 6, rng), (3, 512)),
        "b": (GGMLType.F32, rng.standard_normal(40).astype(np.float32), (40,)),
        "c": (GGMLType.Q8_0, rng.standard_normal((2, 3, 64)).astype(np.float32), (2, 3, 64)),
        "d": (GGMLType.F16, rng.standard_normal((5, 7)).astype(np.float32), (5, 7)),
    }
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "x"}, tensors, alignment=64)
    ours = open_gguf(path)
    theirs = gguf.GGUFReader(path)
    assert ours.alignment == 64
    assert ours.get("general.architecture") == theirs.fields["general.architecture"].contents()
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == int(t.tensor_type)
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
        assert np.array_equal(ours.raw(t.name).numpy().reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    assert ours.raw("a").shape == (3, 2 * 144) and ours.raw("c").shape == (2 * 3 * 2 * 34,)


def test_compute_type_check(tmp_path):
    tensors = {
        "ok": (GGMLType.Q4_0, random_blocks(GGMLType.Q4_0, 2), (2, 32)),
        "iq": (GGMLType.IQ2_XXS, np.zeros(66, np.uint8), (1, 256)),
    }
    gf = open_gguf(write_gguf(tmp_path / "m.gguf", {}, tensors))
    assert gf.unsupported_tensors() == {"iq": GGMLType.IQ2_XXS}
    gf.check_supported(["ok"])
    with pytest.raises(GGUFError, match=r"'iq' \(IQ2_XXS\)"):
        gf.check_supported()
    from pyllm.formats.quant import qtensor_from_gguf

    with pytest.raises(ModelError, match="'iq'.*IQ2_XXS"):
        qtensor_from_gguf(gf, "iq")
    with pytest.raises(GGUFError, match="no tensor named 'nope'"):
        gf.raw("nope")
    assert GGMLType.Q4_K in COMPUTE_TYPES and GGMLType.IQ2_XXS not in COMPUTE_TYPES


def test_tensor_info_fields(tmp_path):
    gf = open_gguf(write_tiny_llama(tmp_path / "m.gguf", n_embd=64, n_vocab=320))
    t = gf.tensors["token_embd.weight"]
    assert isinstance(t, TensorInfo) and t.shape == (320, 64) and t.n_elements == 320 * 64
    assert t.nbytes == 320 * 2 * 34 and t.row_bytes == 68


# -- bad inputs ---------------------------------------------------------------------------------------------


def _err(path) -> str:
    with pytest.raises(GGUFError) as ei:
        open_gguf(path)
    msg = str(ei.value)
    assert str(path) in msg  # every message names the file
    return msg


def _write(tmp_path, blob: bytes, name="bad.gguf"):
    p = tmp_path / name
    p.write_bytes(blob)
    return p


def _tensor(name="w", ne=(32, 2), type_id=GGMLType.Q8_0, offset=0):
    return (name, ne, int(type_id), offset)


def test_missing_file(tmp_path):
    assert "no such file" in _err(tmp_path / "nope.gguf")


def test_directory(tmp_path):
    assert "is a directory" in _err(tmp_path)


def test_not_gguf(tmp_path):
    msg = _err(_write(tmp_path, b"PK\x03\x04" + b"\0" * 100, "model.zip"))
    assert "not a GGUF file" in msg and "b'PK\\x03\\x04'" in msg


def test_empty_file(tmp_path):
    assert "not a GGUF file" in _err(_write(tmp_path, b""))


@pytest.fixture
def small_file(tmp_path):
    """A valid file with metadata strings, an array and two tensors: the base for truncation and patching."""
    md = {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a", "bb", "ccc"], "n": 3}
    tensors = {
        "blk.0.attn_q.weight": (GGMLType.Q8_0, random_blocks(GGMLType.Q8_0, 4), (2, 64)),
        "norm": (GGMLType.F32, np.ones(8, np.float32), (8,)),
    }
    return write_gguf(tmp_path / "small.gguf", md, tensors)


def _header_end(path) -> int:
    return open_gguf(path).data_offset


@pytest.mark.parametrize("frac", [0.1, 0.3, 0.5, 0.7, 0.95])
def test_truncated_header(small_file, frac):
    blob = small_file.read_bytes()
    cut = max(4, int(_header_end(small_file) * frac))
    small_file.write_bytes(blob[:cut])
    msg = _err(small_file)
    assert "truncated" in msg


def test_truncated_data(small_file):
    blob = small_file.read_bytes()
    small_file.write_bytes(blob[:-100])
    msg = _err(small_file)
    assert "'blk.0.attn_q.weight'" in msg or "'norm'" in msg
    assert "extends past the end of the file" in msg and "truncated" in msg


def test_unknown_block_type_patched(small_file):
    blob = bytearray(small_file.read_bytes())
    name = b"blk.0.attn_q.weight"
    i = blob.index(name) + len(name) + 4 + 2 * 8  # n_dims, two dims -> the type id
    assert struct.unpack_from("<I", blob, i)[0] == GGMLType.Q8_0
    struct.pack_into("<I", blob, i, 99)
    small_file.write_bytes(bytes(blob))
    msg = _err(small_file)
    assert "'blk.0.attn_q.weight'" in msg and "unknown ggml type id 99" in msg


@pytest.mark.parametrize(
    "version,hint", [(1, "obsolete"), (4, "unsupported GGUF version 4"), (0x03000000, "big-endian")]
)
def test_bad_version_patched(small_file, version, hint):
    blob = bytearray(small_file.read_bytes())
    struct.pack_into("<I", blob, 4, version)
    small_file.write_bytes(bytes(blob))
    assert hint in _err(small_file)


def _fast_err(path) -> str:
    t0 = time.perf_counter()
    msg = _err(path)
    assert time.perf_counter() - t0 < 0.5
    return msg


def test_huge_string_length(tmp_path):
    blob = bytearray(gguf_bytes([("general.name", "x")], []))
    struct.pack_into("<Q", blob, 24, 2**60)  # the first key's length
    msg = _fast_err(_write(tmp_path, bytes(blob)))
    assert f"claims length {2**60}" in msg


def test_huge_string_value_length(tmp_path):
    blob = bytearray(gguf_bytes([("k", "value")], []))
    struct.pack_into("<Q", blob, 24 + 8 + 1 + 4, 2**60)
    msg = _fast_err(_write(tmp_path, bytes(blob)))
    assert "'k'" in msg and f"claims length {2**60}" in msg


def test_huge_array_count(tmp_path):
    blob = bytearray(gguf_bytes([("tokenizer.ggml.tokens", ["a", "b"])], []))
    struct.pack_into("<Q", blob, 24 + 8 + len("tokenizer.ggml.tokens") + 4 + 4, 2**60)
    msg = _fast_err(_write(tmp_path, bytes(blob)))
    assert "'tokenizer.ggml.tokens'" in msg and f"array of {2**60} STRING" in msg


def test_huge_numeric_array_count(tmp_path):
    blob = bytearray(gguf_bytes([("scores", Typed(ValueType.ARRAY, [1.0], ValueType.FLOAT32))], []))
    struct.pack_into("<Q", blob, 24 + 8 + len("scores") + 4 + 4, 2**60)
    assert "array of" in _fast_err(_write(tmp_path, bytes(blob)))


@pytest.mark.parametrize("field", ["tensor_count", "kv_count"])
def test_huge_counts(tmp_path, field):
    blob = gguf_bytes([("a", 1)], [_tensor()], b"\0" * 68, **{field: 2**60})
    msg = _fast_err(_write(tmp_path, blob))
    assert f"count {2**60} cannot fit" in msg


def test_dim_product_overflow(tmp_path):
    msg = _fast_err(_write(tmp_path, gguf_bytes([], [_tensor(ne=(2**32, 2**32))], b"\0" * 64)))
    assert "'w'" in msg and "exceeds" in msg


@pytest.mark.parametrize("ne,text", [((), "n_dims 0"), ((32, 1, 1, 1, 1), "n_dims 5"), ((32, 0), "dimension 1 = 0")])
def test_bad_dims(tmp_path, ne, text):
    assert text in _err(_write(tmp_path, gguf_bytes([], [_tensor(ne=ne)], b"\0" * 64)))


def test_dim_not_multiple_of_block(tmp_path):
    msg = _err(_write(tmp_path, gguf_bytes([], [_tensor(ne=(40, 2))], b"\0" * 128)))
    assert "first dimension 40 is not a multiple of the block size 32" in msg


def test_misaligned_offset(tmp_path):
    msg = _err(_write(tmp_path, gguf_bytes([], [_tensor(offset=16)], b"\0" * 128)))
    assert "'w'" in msg and "offset 16 is not a multiple of the alignment 32" in msg


def test_overlapping_tensors(tmp_path):
    # 'a' is 68 bytes at 0..68; 'b' starts at 64
    blob = gguf_bytes([], [_tensor("a", offset=0), _tensor("b", offset=64)], b"\0" * 160)
    msg = _err(_write(tmp_path, blob))
    assert "'b'" in msg and "overlaps tensor 'a'" in msg


def test_duplicate_tensor_name(tmp_path):
    blob = gguf_bytes([], [_tensor("w", offset=0), _tensor("w", offset=96)], b"\0" * 192)
    assert "duplicate tensor name 'w'" in _err(_write(tmp_path, blob))


def test_duplicate_metadata_key(tmp_path):
    assert "duplicate metadata key 'a'" in _err(_write(tmp_path, gguf_bytes([("a", 1), ("a", 2)], [])))


@pytest.mark.parametrize("alignment", [0, 48, -1, "32"])
def test_bad_alignment(tmp_path, alignment):
    value = Typed(ValueType.INT32, alignment) if isinstance(alignment, int) else alignment
    msg = _err(_write(tmp_path, gguf_bytes([("general.alignment", value)], [])))
    assert "general.alignment" in msg and "power of two" in msg


def test_unknown_value_type(tmp_path):
    blob = bytearray(gguf_bytes([("k", 1)], []))
    struct.pack_into("<I", blob, 24 + 8 + 1, 13)
    assert "'k' has unknown value type 13" in _err(_write(tmp_path, bytes(blob)))


def test_key_not_utf8(tmp_path):
    blob = gguf_bytes([], [])[:16] + struct.pack("<QQ", 1, 1) + b"\xff" + struct.pack("<IB", 0, 1)  # 1 KV, key b"\xff"
    assert "not valid UTF-8" in _err(_write(tmp_path, blob))


def test_arrays_nested_too_deep(tmp_path):
    v = [1]
    for _ in range(10):
        v = [v]
    assert "nested more than" in _err(_write(tmp_path, gguf_bytes([("deep", v)], [])))
