"""The one-call C++ decode step (csrc/cpu/decode_step.cpp) against LlamaModel's torch path.

Both run the same GEMV kernels, so logits differ only by summation order in the small ops (norms, attention).
With float weights (the GEMV reads fp32 activations) that keeps logits within ~1e-4 relative.  Quantized weights
quantize the activations to int8 per block first, so a 1-ulp difference can flip one rounding step (1/127 of
the block max) and the difference grows to ~1e-2 over 30 layers (measured: K identical to 1e-6 through layer 7
of SmolLM2, then a flip); there the greedy tokens must still be identical.
"""

import pytest
import torch

import pyllm
from pyllm import ops
from pyllm.models.llama import LlamaModel
from pyllm.runtime.kv_cache import KVCache

pytestmark = pytest.mark.skipif(not pyllm._ext.has_extension(), reason="needs the C++ extension")


def _kv(model, n_ctx, dtype):
    c = model.cfg
    return KVCache(c.n_layer, c.n_kv_head, n_ctx, c.head_dim, {torch.float16: "f16", torch.float32: "f32"}[dtype])


def _greedy(model, kv, tok, pos, n, cpp):
    """n greedy steps from (tok, pos); returns the tokens and the stacked logits."""
    model.use_cpp_decode = cpp
    toks, logits = [], []
    try:
        for i in range(n):
            lg = model.forward(torch.tensor([tok]), pos + i, kv)
            assert lg.shape == (1, model.cfg.n_vocab)
            logits.append(lg[0])
            tok = int(lg[0].argmax())
            toks.append(tok)
    finally:
        model.use_cpp_decode = True
    return toks, torch.stack(logits)


def _compare(model, prompt, n=16, dtype=torch.float16, n_ctx=128, tol=2e-4):
    kv = _kv(model, n_ctx, dtype)
    ids = torch.tensor(prompt, dtype=torch.int64)
    first = int(model.forward(ids, 0, kv)[-1].argmax())
    k0, v0 = kv.k.clone(), kv.v.clone()
    toks_py, lg_py = _greedy(model, kv, first, len(prompt), n, cpp=False)
    kv_py = kv.k.clone(), kv.v.clone()
    kv.k.copy_(k0)
    kv.v.copy_(v0)
    toks_c, lg_c = _greedy(model, kv, first, len(prompt), n, cpp=True)
    assert model._decode_ctx is not None and model._decode_ctx[2] is not None, "C++ decode step was not used"
    assert toks_c == toks_py
    scale = lg_py.abs().max()
    torch.testing.assert_close(lg_c, lg_py, rtol=0, atol=tol * float(scale))
    # The cache holds the same K/V (up to one fp16 ulp from the different op order)
    kv_tol = 2e-3 if tol < 1e-3 else 50 * tol
    torch.testing.assert_close(kv.k.float(), kv_py[0].float(), rtol=kv_tol, atol=kv_tol)
    torch.testing.assert_close(kv.v.float(), kv_py[1].float(), rtol=kv_tol, atol=kv_tol)
    return toks_c


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return pyllm.load(smollm2_path, n_ctx=128)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_smollm2_cpp_decode_matches_python(smollm2, dtype):
    model = smollm2.model
    assert type(model) is LlamaModel and model.linear is ops.qmatmul
    _compare(model, smollm2.tokenize("The capital of France is"), dtype=dtype, tol=0.05)


def test_smollm2_sliding_window(smollm2, monkeypatch):
    model = smollm2.model
    monkeypatch.setattr(model.cfg, "sliding_window", 5)
    model._decode_ctx = None
    try:
        _compare(model, smollm2.tokenize("One, two, three, four, five, six,"), tol=0.05)
    finally:
        model._decode_ctx = None


def test_decode_from_position_zero(smollm2):
    """pos 0 attends to its fresh fp32 K/V in both paths."""
    model = smollm2.model
    kv = _kv(model, 32, torch.float16)
    a = model.forward(torch.tensor([1]), 0, kv)
    model.use_cpp_decode = False
    try:
        b = model.forward(torch.tensor([1]), 0, kv)
    finally:
        model.use_cpp_decode = True
    torch.testing.assert_close(a, b, rtol=0, atol=0.05 * float(b.abs().max()))
    assert int(a.argmax()) == int(b.argmax())


@pytest.fixture(scope="module", params=["F32", "Q8_0"])
def tiny_qwen2(request, tmp_path_factory):
    from pyllm.quant import GGMLType
    from pyllm.synthetic import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("qwen2") / "tiny-qwen2.gguf", arch="qwen2", n_layer=3,
                            n_embd=128, n_ff=256, n_head=4, n_kv_head=2, n_vocab=320, seed=3,
                            qtype=GGMLType[request.param])
    llm = pyllm.load(str(path), n_ctx=96)
    llm.tol = 2e-4 if request.param == "F32" else 0.05
    return llm


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_tiny_qwen2_with_bias(tiny_qwen2, monkeypatch, window, dtype):
    model = tiny_qwen2.model
    assert model.cfg.qkv_bias and model.cfg.rope_style == "neox"
    monkeypatch.setattr(model.cfg, "sliding_window", window)
    model._decode_ctx = None
    try:
        _compare(model, [5, 17, 42, 99, 7, 3, 250], n=16, dtype=dtype, n_ctx=64, tol=tiny_qwen2.tol)
    finally:
        model._decode_ctx = None


def test_quantized_kv_cache_takes_python_path(tiny_qwen2):
    from pyllm.runtime.kv_cache import make_kv_cache

    model = tiny_qwen2.model
    c = model.cfg
    kv = make_kv_cache("q8_0", c.n_layer, c.n_kv_head, 32, c.head_dim)
    model.forward(torch.tensor([1, 2, 3]), 0, kv)
    model.forward(torch.tensor([4]), 3, kv)
    assert model._decode_ctx[0] is kv and model._decode_ctx[2] is None
    model._decode_ctx = None


# ---- the binding's argument checks ---------------------------------------------------------------------------

def _ctx_args(model, kv):
    cfg, w, vec = model.cfg, model.w, model.vec
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    mats = [w[f"blk.{i}.{n}.weight"] for i in range(cfg.n_layer) for n in names]

    def vecs(name, on=True):
        return [vec[f"blk.{i}.{name}"].float().contiguous() for i in range(cfg.n_layer)] if on else []

    return dict(weights=[m.data for m in mats], qtypes=[int(m.qtype) for m in mats],
                attn_norm=vecs("attn_norm.weight"), ffn_norm=vecs("ffn_norm.weight"),
                q_bias=vecs("attn_q.bias", cfg.qkv_bias), k_bias=vecs("attn_k.bias", cfg.qkv_bias),
                v_bias=vecs("attn_v.bias", cfg.qkv_bias), q_norm=[], k_norm=[],
                token_embd=w["token_embd.weight"].data, token_embd_qtype=int(w["token_embd.weight"].qtype),
                output=model.output.data, output_qtype=int(model.output.qtype),
                output_norm=vec["output_norm.weight"].float().contiguous(), cos=model.cos, sin=model.sin,
                k_cache=kv.k, v_cache=kv.v, n_embd=cfg.n_embd, n_ff=cfg.n_ff, n_head=cfg.n_head,
                n_kv_head=cfg.n_kv_head, head_dim=cfg.head_dim, rope_dim=cfg.rope_dim, rope_style=cfg.rope_style,
                eps=cfg.rms_eps, scale=model.scale, window=0)


def test_binding_rejects_bad_arguments(tiny_qwen2):
    C = pyllm._ext.load()
    model = tiny_qwen2.model
    kv = _kv(model, 16, torch.float16)
    good = _ctx_args(model, kv)
    ctx = C.DecodeContext(**good)
    assert ctx.n_vocab == model.cfg.n_vocab and ctx.max_seq == 16

    def bad(exc, match, **kw):
        with pytest.raises(exc, match=match):
            C.DecodeContext(**{**good, **kw})

    bad(ValueError, "7 weights", weights=good["weights"][:-1])
    bad(ValueError, "bytes per row", weights=[good["weights"][6]] + good["weights"][1:])  # ffn_down as attn_q
    bad(ValueError, "rows, expected", weights=[good["weights"][1]] + good["weights"][1:])  # attn_k as attn_q
    bad(ValueError, "unknown GGML type", qtypes=[99] + good["qtypes"][1:])
    bad(TypeError, "must be Byte", weights=[good["weights"][0].float()] + good["weights"][1:])
    bad(ValueError, "contiguous", weights=[good["weights"][0].t().contiguous().t()] + good["weights"][1:])
    bad(ValueError, "attn_norm has", attn_norm=[torch.ones(3)] + good["attn_norm"][1:])
    bad(TypeError, "must be Float", ffn_norm=[good["ffn_norm"][0].double()] + good["ffn_norm"][1:])
    bad(ValueError, "q/k/v_bias", q_bias=[])
    bad(TypeError, "float16 or float32", k_cache=kv.k.bfloat16(), v_cache=kv.v.bfloat16())
    bad(ValueError, "k_cache has shape", k_cache=kv.k[:1].contiguous(), v_cache=kv.v[:1].contiguous())
    bad(ValueError, "v_cache has shape", v_cache=kv.v[:, :, :8].contiguous())
    bad(TypeError, "v_cache must be", v_cache=kv.v.float())
    bad(ValueError, "cos/sin", cos=model.cos[:, :3].contiguous())
    bad(ValueError, "rope_style", rope_style="yarn")
    bad(ValueError, "not a multiple of n_kv_head", n_kv_head=3)
    bad(ValueError, "window", window=-1)

    out = torch.empty(model.cfg.n_vocab)
    C.decode_step(ctx, 3, 0, out)
    assert torch.isfinite(out).all()
    with pytest.raises(IndexError, match="token"):
        C.decode_step(ctx, model.cfg.n_vocab + 5, 0, out)
    with pytest.raises(IndexError, match="pos"):
        C.decode_step(ctx, 3, 16, out)
    with pytest.raises(IndexError, match="pos"):
        C.decode_step(ctx, 3, -1, out)
    with pytest.raises(ValueError, match="logits_out"):
        C.decode_step(ctx, 3, 1, torch.empty(5))
    with pytest.raises(TypeError, match="logits_out"):
        C.decode_step(ctx, 3, 1, torch.empty(model.cfg.n_vocab, dtype=torch.float64))
