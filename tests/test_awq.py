"""AWQ ("gemm") checkpoints: unpacking, loading, end-to-end logits, and one-line errors for bad folders.

Fixtures come from a real writer, auto-round 0.16.1 (format="auto_awq"), run inside the tests on tiny random
models (tools/make_awq_fixture.py; nothing downloaded). Without auto-round installed those tests skip; the packing
and bad-folder tests use a packer written from REFERENCE.md §4 and always run.

The unpacking reference is AutoAWQ 0.2.x's ``awq.utils.packing_utils.dequantize_gemm``, copied below as written
(int8 nibbles, reverse order map, ``(iweight - izeros) * scales`` in the scales' dtype).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import unblock_fifo_later
from pyllm.formats.awq.folder import open_awq
from pyllm.formats.awq.shards import open_shards
from pyllm.formats.awq.tokenizer import chat_template_source, tokenizer_from_hf
from pyllm.formats.awq.unpack import AWQTensor
from pyllm.errors import PyllmError

ROOT = Path(__file__).resolve().parent.parent
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
HAVE_AUTO_ROUND = importlib.util.find_spec("auto_round") is not None
needs_writer = pytest.mark.skipif(not HAVE_AUTO_ROUND, reason="auto-round not installed "
                                  "(pip install auto-round==0.16.1 torch==2.13.0): no real AWQ writer")


# ------------------------------------------------------------------ AutoAWQ's reference (packing_utils.py)
def _unpack_awq(qweight, qzeros, bits):
    shifts = torch.arange(0, 32, bits, device=qzeros.device)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    return iweights, izeros


def _reverse_awq_order(iweights, izeros, bits):
    order = torch.arange(iweights.shape[-1], dtype=torch.int32, device=izeros.device)
    order = order.view(-1, 32 // bits)[:, AWQ_REVERSE_ORDER].view(-1)
    return iweights[:, order], izeros[:, order]


def dequantize_gemm(qweight, qzeros, scales, bits, group_size):
    iweight, izeros = _unpack_awq(qweight, qzeros, bits)
    iweight, izeros = _reverse_awq_order(iweight, izeros, bits)
    iweight = torch.bitwise_and(iweight, (2**bits) - 1)
    izeros = torch.bitwise_and(izeros, (2**bits) - 1)
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return (iweight - izeros) * scales  # W^T [K, N]


# ------------------------------------------------------------------ a packer from REFERENCE.md §4
def pack_gemm(vals: torch.Tensor) -> torch.Tensor:
    """int [R, C] (0..15) -> int32 [R, C/8]: nibble i of word c holds column 8c + AWQ_ORDER[i]."""
    r, c = vals.shape
    v = vals.to(torch.int64).view(r, c // 8, 8)[:, :, AWQ_ORDER]
    word = sum(v[:, :, i] << (4 * i) for i in range(8))
    return (word - ((word >> 31) << 32)).to(torch.int32)  # two's complement into int32


def random_awq(k, n, g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // g, n), generator=gen)
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 1e-3).half()
    return q, z, s, pack_gemm(q), pack_gemm(z)


def test_pack_test_vector():
    # REFERENCE.md §4: logical columns v0..v7 = 0..7 pack to 0x75316420
    assert pack_gemm(torch.arange(8).view(1, 8)).item() == 0x75316420
    assert AWQTensor.unpack(torch.tensor([[0x75316420]], dtype=torch.int32)).tolist() == [list(range(8))]


@pytest.mark.parametrize("k,n,g", [(128, 64, 32), (256, 96, 64), (384, 256, 128), (576, 40, 64), (64, 8, -1)])
def test_dequantize_matches_autoawq(k, n, g):
    gg = k if g == -1 else g  # -1: one group per column (per-channel)
    q, z, s, qw, qz = random_awq(k, n, gg, seed=k + n)
    t = AWQTensor(qw, qz, s, g, name="t")
    assert t.shape == (n, k)
    ref = dequantize_gemm(qw, qz, s, 4, gg)  # fp16 [K, N]
    assert torch.equal(t.dequantize(torch.float16), ref.T)
    exact = (q - z.repeat_interleave(gg, 0)).float() * s.float().repeat_interleave(gg, 0)
    assert torch.equal(t.dequantize(torch.float32), exact.T)
    assert torch.equal(t.dequantize(torch.float32).half(), ref.T)  # the fp32 product rounds to AutoAWQ's fp16
    idx = torch.tensor([0, n - 1, 3 % n])
    assert torch.equal(t.rows(idx), exact.T[idx])
    x = torch.randn(3, k)
    torch.testing.assert_close(t.matmul(x), x.double() @ exact.double(), rtol=1e-5, atol=1e-5, check_dtype=False)


def test_shape_mismatch_in_tensor():
    q, z, s, qw, qz = random_awq(128, 64, 32)
    with pytest.raises(PyllmError, match="scales shape"):
        AWQTensor(qw, qz, s[:, :32], 32, name="x")
    with pytest.raises(PyllmError, match="qzeros shape"):
        AWQTensor(qw, qz[:2], s, 32, name="x")


# ------------------------------------------------------------------ real-writer fixtures
@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    if not HAVE_AUTO_ROUND:
        pytest.skip("auto-round not installed (pip install auto-round==0.16.1 torch==2.13.0): no real AWQ writer")
    spec = importlib.util.spec_from_file_location("make_awq_fixture", ROOT / "tools" / "make_awq_fixture.py")
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    out = {}
    base = tmp_path_factory.mktemp("awq")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    for g, arch, tied in ((32, "llama", True), (64, "llama", False), (128, "qwen2", False)):
        d = base / f"{arch}-g{g}"
        out[g] = (mk.build(d, group_size=g, arch=arch, tied=tied, seed=g), d / "dense")
    return out


def _dense_from_awq(awq_dir: Path, dense_dir: Path):
    """transformers model of the dense architecture with every weight replaced by the AWQ folder's, dequantized."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    where = open_shards(awq_dir)
    sd = {}
    for name in where:
        mod, _, suffix = name.rpartition(".")
        if suffix == "qweight":
            t = AWQTensor(where[name].get(name), where[mod + ".qzeros"].get(mod + ".qzeros"),
                              where[mod + ".scales"].get(mod + ".scales"), _group(awq_dir))
            sd[mod + ".weight"] = t.dequantize(torch.float32)
        elif suffix in ("weight", "bias"):
            sd[name] = where[name].get(name).float()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def _group(d: Path) -> int:
    return json.loads((d / "config.json").read_text())["quantization_config"]["group_size"]


@needs_writer
@pytest.mark.parametrize("g", [32, 64, 128])
def test_real_writer_unpacks_like_autoawq(fixtures, g):
    d, _ = fixtures[g]
    where = open_shards(d)
    n = 0
    for name in where:
        if name.endswith(".qweight"):
            mod = name[: -len(".qweight")]
            qw, qz, s = (where[mod + x].get(mod + x) for x in (".qweight", ".qzeros", ".scales"))
            t = AWQTensor(qw, qz, s, g, name=mod)
            ref = dequantize_gemm(qw, qz, s, 4, g)
            assert torch.equal(t.dequantize(s.dtype), ref.T), mod
            assert torch.equal(t.dequantize(torch.float32).to(s.dtype), ref.T), mod
            n += 1
    assert n == 14  # 7 linears x 2 layers


@needs_writer
@pytest.mark.parametrize("g", [32, 64, 128])
def test_logits_match_transformers_dense(fixtures, g):
    import pyllm

    d, dense = fixtures[g]
    ref_model = _dense_from_awq(d, dense)
    llm = pyllm.load(d, kernels="reference", n_ctx=64)
    assert llm.config.rope_style == "neox"
    assert llm.config.tied_output == (g == 32)
    ids = llm.tokenize("Hello world! The quick brown fox.")
    assert len(ids) > 4
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    got = llm.logits(ids)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-3, rel
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # the per-call chunked AWQ matmul (the "fast" backend's path for weights left in checkpoint form) against the
    # cached reference
    w = llm.weights["blk.0.ffn_down.weight"]
    x = torch.randn(2, w.shape[1])
    torch.testing.assert_close(w.matmul(x), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


@needs_writer
def test_tokenizer_template_and_stop_tokens(fixtures):
    import pyllm
    from transformers import AutoTokenizer

    d, _ = fixtures[64]
    hf = AutoTokenizer.from_pretrained(d)
    llm = pyllm.load(d, kernels="reference", n_ctx=64)
    tok = llm.tokenizer
    for text in ["Hello world!", "café 東京 😀 <|im_end|> x", "  two  spaces\nnew line"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == text
    im_end, eot = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_id == im_end and tok.is_eog(im_end) and tok.is_eog(eot)
    msgs = [{"role": "user", "content": "hi"}]
    assert llm.format_chat(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    out = llm.generate("Hello", max_tokens=4, temperature=0)
    assert isinstance(out, str)
    info = llm.info()
    assert info["architecture"] == "llama"


# ------------------------------------------------------------------ bad folders: one-line errors
def _write_st(path: Path, tensors: dict[str, torch.Tensor]):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def _tiny_folder(d: Path, qc: dict | None = None, mutate=None):
    """A hand-packed 1-layer llama AWQ folder (REFERENCE.md §4 layout), optionally broken by ``mutate``."""
    d.mkdir(parents=True, exist_ok=True)
    hid, ff, g = 64, 128, 32
    cfg = dict(model_type="llama", hidden_size=hid, intermediate_size=ff, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=32, max_position_embeddings=64,
               rms_norm_eps=1e-6, quantization_config=qc if qc is not None else
               dict(quant_method="awq", bits=4, group_size=g, zero_point=True, version="gemm"))
    (d / "config.json").write_text(json.dumps(cfg))
    t = {"model.embed_tokens.weight": torch.randn(32, hid).half(), "model.norm.weight": torch.ones(hid).half(),
         "lm_head.weight": torch.randn(32, hid).half()}
    p = "model.layers.0."
    t[p + "input_layernorm.weight"] = torch.ones(hid).half()
    t[p + "post_attention_layernorm.weight"] = torch.ones(hid).half()
    for name, (k, n) in {"self_attn.q_proj": (hid, hid), "self_attn.k_proj": (hid, 32), "self_attn.v_proj": (hid, 32),
                         "self_attn.o_proj": (hid, hid), "mlp.gate_proj": (hid, ff), "mlp.up_proj": (hid, ff),
                         "mlp.down_proj": (ff, hid)}.items():
        _, _, s, qw, qz = random_awq(k, n, g)
        t[p + name + ".qweight"], t[p + name + ".qzeros"], t[p + name + ".scales"] = qw, qz, s
    if mutate:
        mutate(t)
    _write_st(d / "model.safetensors", t)
    return d


def _one_line_error(path, match):
    with pytest.raises(PyllmError, match=match) as ei:
        open_awq(path)
    msg = str(ei.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_good_hand_packed_folder_loads(tmp_path):
    info, cfg, w = open_awq(_tiny_folder(tmp_path / "ok"))
    assert cfg.arch == "llama" and cfg.rope_style == "neox" and not cfg.tied_output
    assert isinstance(w["blk.0.attn_q.weight"], AWQTensor) and w["blk.0.ffn_down.weight"].shape == (64, 128)


def test_missing_config(tmp_path):
    d = _tiny_folder(tmp_path / "m")
    (d / "config.json").unlink()
    _one_line_error(d, "config.json is missing")


def test_not_a_folder(tmp_path):
    _one_line_error(tmp_path / "nope", "is not a folder")


@pytest.mark.parametrize("qc,match", [
    (dict(quant_method="awq", bits=8, group_size=32, version="gemm"), "only 4-bit"),
    (dict(quant_method="awq", bits=4, group_size=32, version="GEMV"), "version 'gemv' is not supported"),
    (dict(quant_method="awq", bits=4, group_size=32, version="marlin"), "version 'marlin' is not supported"),
    (dict(quant_method="awq", bits=4, group_size=32, version="exllama"), "version 'exllama' is not supported"),
    (dict(quant_method="awq", bits=4, group_size=32, version="gemv_fast"), "version 'gemv_fast' is not supported"),
    (dict(quant_method="awq", bits=4, group_size=32, zero_point=False), "symmetric"),
    (dict(quant_method="gptq", bits=4, group_size=32), "expected 'awq'"),
    (dict(quant_method="awq", bits=4, group_size="big"), "group_size"),
])
def test_bad_quant_config(tmp_path, qc, match):
    _one_line_error(_tiny_folder(tmp_path / "q", qc=qc), match)


def test_wrong_group_size_is_a_shape_mismatch(tmp_path):
    qc = dict(quant_method="awq", bits=4, group_size=64, zero_point=True, version="gemm")
    _one_line_error(_tiny_folder(tmp_path / "g", qc=qc), "scales shape")


def test_shape_mismatch_qweight_vs_scales(tmp_path):
    def cut(t):
        t["model.layers.0.mlp.up_proj.scales"] = t["model.layers.0.mlp.up_proj.scales"][:, :64]
    msg = _one_line_error(_tiny_folder(tmp_path / "s", mutate=cut), "scales shape")
    assert "up_proj" in msg


def test_shape_mismatch_vs_config(tmp_path):
    def swap(t):
        _, _, s, qw, qz = random_awq(64, 64, 32)
        p = "model.layers.0.self_attn.k_proj."
        t[p + "qweight"], t[p + "qzeros"], t[p + "scales"] = qw, qz, s
    _one_line_error(_tiny_folder(tmp_path / "c", mutate=swap), r"blk.0.attn_k.weight has shape \(64, 64\)")


@pytest.mark.parametrize("hf_name, shape, name", [
    ("model.layers.0.self_attn.q_norm.weight", (16,), "blk.0.attn_q_norm.weight"),
    ("model.layers.0.self_attn.k_norm.weight", (64,), "blk.0.attn_k_norm.weight"),
    ("model.embed_tokens.weight", (40, 64), "token_embd.weight"),
])
def test_shapes_follow_the_gguf_loaders_rule(tmp_path, hf_name, shape, name):
    """The AWQ folder had a shape check of its own that left out the q/k norms (qwen3): a norm of the wrong size
    loaded, to fail in the first forward pass. Reference: ModelConfig's rule, the GGUF loader's, for every tensor
    (head_dim 32 here; a row per token of the 32 of config.json's vocab_size)."""
    def put(t):
        t[hf_name] = torch.ones(shape).half()
    _one_line_error(_tiny_folder(tmp_path / "n", mutate=put), rf"{re.escape(name)} has shape {re.escape(str(shape))} "
                                                              r"but config.json implies \(")


def test_missing_scales(tmp_path):
    _one_line_error(_tiny_folder(tmp_path / "z", mutate=lambda t: t.pop("model.layers.0.mlp.up_proj.scales")),
                    "has no model.layers.0.mlp.up_proj.scales")


def test_missing_shard(tmp_path):
    d = _tiny_folder(tmp_path / "sh")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    from safetensors import safe_open

    with safe_open(str(d / "model-00001-of-00002.safetensors"), "pt") as f:
        names = list(f.keys())
    wm = {n: "model-00001-of-00002.safetensors" for n in names}
    wm["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    _one_line_error(d, "shard model-00002-of-00002.safetensors .* is missing")


def test_no_weights_and_truncated_shard(tmp_path):
    d = _tiny_folder(tmp_path / "t")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    _one_line_error(d, "truncated")
    (d / "model.safetensors").unlink()
    _one_line_error(d, "no \\*.safetensors")


def _edit_header(d: Path, edit, pad: int = 8):
    """Rewrites model.safetensors' JSON header with ``edit(header)``; the header is padded to a multiple of
    ``pad`` bytes (8 as the Rust writer does; another value moves every tensor to an unaligned offset)."""
    import struct

    p = d / "model.safetensors"
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % pad or (pad if pad % 8 else 0))
    p.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


Q_PROJ = "model.layers.0.self_attn.q_proj.qweight"


def _set_entry(key, value):
    def edit(header):
        header[Q_PROJ][key] = value(header[Q_PROJ][key]) if callable(value) else value
    return edit


@pytest.mark.parametrize("edit", [
    _set_entry("shape", lambda s: [-s[0], -s[1]]),  # a product that is positive and the right size
    _set_entry("shape", [float("inf"), 1]),
    _set_entry("shape", [64.5, 8]),
    _set_entry("data_offsets", lambda o: [str(o[0]), str(o[1])]),
    _set_entry("data_offsets", lambda o: [o[0] + 0.0, o[1] + 0.0]),
    _set_entry("dtype", ["I32"]),
], ids=["negative-dims", "infinite-dim", "float-dim", "string-offsets", "float-offsets", "list-dtype"])
def test_malformed_header_entry_is_one_line(tmp_path, edit):
    d = _tiny_folder(tmp_path / "h")
    _edit_header(d, edit)
    assert "q_proj.qweight" in _one_line_error(d, "malformed header entry")


def test_deeply_nested_json_is_one_line(tmp_path):
    import struct

    d = _tiny_folder(tmp_path / "n")
    deep = b"[" * 100_000 + b"]" * 100_000
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(deep)) + deep)
    _one_line_error(d, "safetensors header is not valid JSON .*nest deeper than")
    (d / "config.json").write_bytes(deep)
    _one_line_error(d, "config.json: cannot read JSON .*nest deeper than")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                  "chat_template.jinja"])
def test_a_fifo_in_the_folder_is_refused_before_it_is_opened(tmp_path, name):
    """A FIFO blocks open() until a writer comes (safetensors' native open held the GIL): each file the folder
    is read from is checked to be regular first, and the error names it."""
    import os

    d = _tiny_folder(tmp_path / "f")
    _add_word_tokenizer(d)
    (d / name).unlink(missing_ok=True)
    os.mkfifo(d / name)
    t = unblock_fifo_later(d / name)
    with pytest.raises(PyllmError, match=f"{name}: is a FIFO, not a regular file") as ei:
        open_awq(d) if name in ("config.json", "model.safetensors") else (
            tokenizer_from_hf(d, 32) if name == "tokenizer.json" else chat_template_source(d))
    assert "\n" not in str(ei.value)
    t.join()


def test_odd_head_dim_is_one_line(tmp_path):
    d = _tiny_folder(tmp_path / "h")
    _edit_config(d, head_dim=33)
    _one_line_error(d, "head_dim 33 is odd; rotary embeddings need an even head dimension")


def test_unpadded_header_loads_like_a_padded_one(tmp_path):
    """The safetensors spec does not require the header to be padded; tensors then start at unaligned offsets."""
    d = _tiny_folder(tmp_path / "a")
    names = ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight")
    # copies: the weights are views of the file's mapping, which rewriting the file changes under them
    ref = {n: w.dequantize().clone() for n, w in open_awq(d)[2].items() if n in names}
    _edit_header(d, lambda h: None, pad=3)
    from safetensors import safe_open

    got = open_awq(d)[2]
    with safe_open(str(d / "model.safetensors"), "pt") as f:  # the reference reader takes the file
        assert torch.equal(f.get_tensor(Q_PROJ), got["blk.0.attn_q.weight"].qweight)
    for name in names:
        assert torch.equal(got[name].dequantize(), ref[name]), name


def _edit_config(d: Path, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if k.startswith("qc_"):
            cfg["quantization_config"][k[3:]] = v
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,match", [
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps = '1e-6' is not a finite number"),
    (dict(rms_norm_eps=[1]), "rms_norm_eps"),
    (dict(rope_theta=float("inf")), "rope_theta = inf"),
    (dict(model_type="mistral", sliding_window="4096"), "sliding_window = '4096' is not an integer"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": "8"}), "rope scaling factor = '8'"),
    (dict(rope_scaling={"rope_type": "llama3", "low_freq_factor": 2.0, "high_freq_factor": 2.0}),
     "high_freq_factor 2 is not above low_freq_factor 2"),
    (dict(qc_modules_to_not_convert=5), "modules_to_not_convert = 5 is not a list"),
    (dict(num_hidden_layers=100_000), r"num_hidden_layers = 100000 is not an integer in \[1, 4096\]"),
    (dict(hidden_size=10 ** 12), "hidden_size = 1000000000000 is not an integer in"),
], ids=["eps-string", "eps-list", "theta-inf", "window-string", "llama3-factor-string", "llama3-equal-factors",
        "skip-not-list", "huge-layer-count", "huge-hidden-size"])
def test_bad_config_value_is_one_line(tmp_path, changes, match):
    d = _tiny_folder(tmp_path / "v")
    _edit_config(d, **changes)
    _one_line_error(d, match)


def test_mistral_null_sliding_window_is_no_window(tmp_path):
    d = _tiny_folder(tmp_path / "w")
    _edit_config(d, model_type="mistral", sliding_window=None)
    assert open_awq(d)[1].sliding_window == 0


def test_index_naming_a_non_file_shard_is_one_line(tmp_path):
    d = _tiny_folder(tmp_path / "x")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": ["a"]}}))
    _one_line_error(d, "weight_map names a shard \\['a'\\], which is not a file name")


def _add_word_tokenizer(d: Path, n: int = 32):
    """A tokenizer.json of ``n`` whole-word tokens (w0, w1, ...), enough for the hand-packed folder to load."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(d / "tokenizer.json"))


def _one_line_load_error(path, match):
    import pyllm

    with pytest.raises(PyllmError, match=match) as ei:
        pyllm.load(path)
    assert "\n" not in str(ei.value) and len(str(ei.value)) < 400, str(ei.value)


def test_tokenizer_side_files_that_are_wrong_are_one_line(tmp_path):
    d = _tiny_folder(tmp_path / "t")
    _add_word_tokenizer(d)
    (d / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    _one_line_load_error(d, "chat_template.jinja: the chat template is not UTF-8 text \\(byte 0xff at offset 0\\)")
    (d / "chat_template.jinja").unlink()
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 10 ** 6}))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    _one_line_load_error(d, "generation_config.json: bos_token_id 1000000 is not in the vocabulary of 32 tokens")


def test_unsupported_model_type(tmp_path):
    d = _tiny_folder(tmp_path / "u")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    _one_line_error(d, "model_type 'gpt_neox' is not supported")


def test_pyllm_load_routes_folders(tmp_path):
    import pyllm

    d = _tiny_folder(tmp_path / "r", qc=dict(quant_method="awq", bits=3, group_size=32, version="gemm"))
    with pytest.raises(PyllmError, match="only 4-bit"):
        pyllm.load(d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PyllmError, match="no quantization_config"):
        pyllm.load(d)


def test_cli_info_on_awq_folder(tmp_path, capsys):
    from pyllm.cli.main import main

    d = _tiny_folder(tmp_path / "i")
    assert main(["info", str(d), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "llama" and info["quantization"].startswith("AWQ gemm, 4-bit, group size 32")
    assert info["tensor_types"]["AWQ_GEMM_W4"]["tensors"] == 7
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "awq", "bits": 4, "version": "exllama"}}))
    assert main(["info", str(d)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "version 'exllama' is not supported" in err[0]
