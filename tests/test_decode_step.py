"""The one-call C++ decode step (csrc/cpu/decode_step.cpp) against the torch forward (models/transformer.py).

Both run the same GEMV kernels, so logits differ only by summation order in the small ops (norms, attention).
With float weights (the GEMV reads fp32 activations) that keeps logits within ~1e-4 relative.  Quantized weights
quantize the activations to int8 per block first, so a 1-ulp difference can flip one rounding step (1/127 of
the block max) and the difference grows to ~1e-2 over 30 layers (measured: K identical to 1e-6 through layer 7
of SmolLM2, then a flip); there the greedy tokens must still be identical.
"""

import numpy as np
import pytest
import torch

import pyllm
from pyllm import ops
from pyllm.models.transformer import Transformer
from pyllm.runtime.kv_cache import KVCache

@pytest.fixture(autouse=True, scope="module")
def _extension():
    """These tests are about the extension: a build that fails is a failure (PyllmError), never a skip."""
    pyllm._ext.load()


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
    assert model.fused_step(kv) is not None, "C++ decode step was not used"
    scale = lg_py.abs().max()
    atol = tol * float(scale)
    # Greedy tokens must agree up to (and logits at) the first step whose top-2 margin on the torch path is within
    # the logit tolerance: there either path may legitimately pick the other token, and the runs part ways.
    top2 = lg_py.topk(2, dim=-1).values
    ties = ((top2[:, 0] - top2[:, 1]) <= 2 * atol).nonzero()
    m = int(ties[0]) + 1 if len(ties) else n
    assert toks_c[:m - 1] == toks_py[:m - 1]
    torch.testing.assert_close(lg_c[:m], lg_py[:m], rtol=0, atol=atol)
    # The cache holds the same K/V over those steps (up to one fp16 ulp from the different op order)
    kv_tol = 2e-3 if tol < 1e-3 else 50 * tol
    upto = len(prompt) + m
    torch.testing.assert_close(kv.k[:, :, :upto].float(), kv_py[0][:, :, :upto].float(), rtol=kv_tol, atol=kv_tol)
    torch.testing.assert_close(kv.v[:, :, :upto].float(), kv_py[1][:, :, :upto].float(), rtol=kv_tol, atol=kv_tol)
    return toks_c


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return pyllm.load(smollm2_path, n_ctx=128)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_smollm2_cpp_decode_matches_python(smollm2, dtype):
    model = smollm2.model
    assert type(model) is Transformer and model.linear == model.backend.qmatmul
    _compare(model, smollm2.tokenize("The capital of France is"), dtype=dtype, tol=0.05)


def test_smollm2_sliding_window(smollm2, monkeypatch):
    model = smollm2.model
    monkeypatch.setattr(model, "spec", model.spec.with_windows(5))
    _compare(model, smollm2.tokenize("One, two, three, four, five, six,"), tol=0.05)


def assert_step_argmax_is_numpys(model, prompt, n=6):
    """Reference: np.argmax of the step's own logits (finite here).  The fused step hands greedy decoding each row's
    argmax instead of the row being read again: one-token steps along a greedy chain, then a 5-row pass with all
    rows' logits and with the last row's only."""
    kv = _kv(model, 96, torch.float16)
    ids = torch.tensor(prompt, dtype=torch.int64)
    with torch.inference_mode():
        tok, pos = int(model.forward(ids, 0, kv)[-1].argmax()), len(prompt)
        step = model.fused_step(kv)
        assert step is not None, "C++ decode step was not used"
        for i in range(n):
            logits, top = step.with_argmax(tok, pos + i)
            assert logits.shape == (model.cfg.n_vocab,)
            assert top == int(np.argmax(logits.numpy())), i
            tok = top
        toks = torch.tensor([tok, 5, 6, 7, 8], dtype=torch.int64)
        for all_logits in (True, False):
            rows, tops = step.rows_with_argmax(toks, pos + n, all_logits)
            assert tops == [int(np.argmax(r)) for r in rows.numpy()], all_logits


def test_step_argmax_is_numpys_on_its_logits(smollm2, tiny_qwen2):
    assert_step_argmax_is_numpys(smollm2.model, smollm2.tokenize("The capital of France is"))
    assert_step_argmax_is_numpys(tiny_qwen2.model, [1, 5, 9, 2, 7])


@pytest.mark.parametrize("bits,what", [(0x7E00, "nan"), (0x7C00, "inf")])
def test_step_argmax_is_minus_one_for_a_non_finite_logit(smollm2_path, monkeypatch, bits, what):
    """One block scale of the Q8_0 output projection set to NaN / +inf: one logit (row 30000, in a later chunk of
    the threads' split) is not finite, and the step reports argmax -1 (the caller then checks the row itself), not
    the index of the largest finite logit.  A model of its own: the backend keeps what it repacks."""
    from pyllm.formats.quant import QTensor

    model = pyllm.load(smollm2_path, n_ctx=32).model
    out = model.output
    data = out.data.clone()
    data[30000, 0:2] = torch.tensor([bits & 0xFF, bits >> 8], dtype=torch.uint8)
    monkeypatch.setattr(model, "output", QTensor(out.qtype, out.shape, data))
    kv = _kv(model, 32, torch.float16)
    with torch.inference_mode():
        model.forward(torch.tensor([1, 2, 3]), 0, kv)
        step = model.fused_step(kv)
        logits, top = step.with_argmax(4, 3)
        rows, tops = step.rows_with_argmax(torch.tensor([5, 6]), 4, True)
    assert not bool(torch.isfinite(logits[30000])), what
    assert top == -1 and tops == [-1, -1]
    assert bool(torch.isfinite(torch.cat([logits[:30000], logits[30001:]])).all())


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
    from pyllm.formats.quant import GGMLType
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
    monkeypatch.setattr(model, "spec", model.spec.with_windows(window))
    _compare(model, [5, 17, 42, 99, 7, 3, 250], n=16, dtype=dtype, n_ctx=64, tol=tiny_qwen2.tol)


@pytest.fixture(scope="module")
def tiny_qwen2_long(tmp_path_factory):
    from pyllm.formats.quant import GGMLType
    from pyllm.synthetic import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("qwen2-long") / "tiny-qwen2.gguf", arch="qwen2", n_layer=2,
                            n_embd=128, n_ff=256, n_head=4, n_kv_head=2, n_vocab=320, n_ctx=1280, seed=5,
                            qtype=GGMLType.F32)
    return pyllm.load(str(path), n_ctx=1280)


@pytest.mark.parametrize("depth,window", [(1100, 0), (700, 0), (1100, 600)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_long_rows_attend_in_key_parts_as_the_torch_path(tiny_qwen2_long, monkeypatch, depth, window, dtype):
    """Past 512 keys the C++ step attends to a row's keys in 2-4 parts on their own, merged by their log-sum-exps
    (4 parts at 1100 keys, 2 at 700 and in a 600-key window that no longer starts at key 0).  Reference: the torch
    path's one softmax over all keys, with float weights: within _compare's 2e-4 of the max logit, as at short
    depths (a part left out or weighted wrongly moves logits by far more)."""
    model = tiny_qwen2_long.model
    monkeypatch.setattr(model, "spec", model.spec.with_windows(window))
    prompt = torch.randint(0, 320, (depth,), generator=torch.Generator().manual_seed(depth)).tolist()
    _compare(model, prompt, n=8, dtype=dtype, n_ctx=1280, tol=2e-4)


@pytest.mark.parametrize("kind", ["q8_0", "q4_rot"])
def test_long_rows_over_a_quantized_cache(tiny_qwen2_long, kind):
    """Key parts with the exact sink row (every block kind keeps position 0 in float32) and, for q4_rot, the
    rotations: the C++ step against the torch path over the same stored rows, 1100 keys.  They differ only by the
    query's rounding for integer keys: int16 steps for q8_0 keys (measured 4e-6 of the max logit; bound 1e-4),
    int8 ones for q4_0 keys (1.3e-3; bound 0.01).  Merging the parts with equal weights moves logits by more."""
    from pyllm.runtime.kv_cache import make_kv_cache

    model = tiny_qwen2_long.model
    c = model.cfg
    prompt = torch.randint(0, 320, (1100,), generator=torch.Generator().manual_seed(11))
    kv = make_kv_cache(kind, c.n_layer, c.n_kv_head, 1280, c.head_dim)
    tok = int(model.forward(prompt, 0, kv)[-1].argmax())
    assert model.fused_step(kv) is not None, "the C++ step must apply to this cache"
    out = {}
    for cpp in (False, True):
        model.use_cpp_decode = cpp
        try:
            out[cpp] = model.forward(torch.tensor([tok]), 1100, kv)[0]
        finally:
            model.use_cpp_decode = True
    err = float((out[True] - out[False]).abs().max() / out[False].abs().max())
    assert err < (1e-4 if kind == "q8_0" else 0.01), err


def test_kv_cache_kinds_and_the_cpp_path(tiny_qwen2):
    """bf16 caches take the torch path; quantized ones the C++ step, once their means are estimated."""
    from pyllm.runtime.kv_cache import make_kv_cache

    model = tiny_qwen2.model
    c = model.cfg
    kv = make_kv_cache("bf16", c.n_layer, c.n_kv_head, 32, c.head_dim)
    model.forward(torch.tensor([1, 2, 3]), 0, kv)
    model.forward(torch.tensor([4]), 3, kv)
    assert model.fused_step(kv) is None
    kv = make_kv_cache("q8_0", c.n_layer, c.n_kv_head, 32, c.head_dim)
    model.forward(torch.tensor([1]), 0, kv)  # one position: no key mean yet, so the torch path runs
    assert not kv.means_ready()
    model.forward(torch.tensor([2]), 1, kv)  # the torch path estimates the means here
    assert kv.means_ready()
    model.forward(torch.tensor([3]), 2, kv)
    assert model.fused_step(kv) is not None


# ---- the binding's argument checks ---------------------------------------------------------------------------

def arch_args(model) -> dict:
    """The model's ArchSpec as the extension's DecodeArch keyword arguments."""
    spec = model.spec
    return dict(n_embd=spec.n_embd, n_ff=spec.n_ff, n_head=spec.n_head, n_kv_head=spec.n_kv_head,
                head_dim=spec.head_dim, rope_dim=spec.rope_dim, rope_style=spec.rope_style, rms_eps=spec.rms_eps,
                attn_scale=spec.attn_scale, qkv_bias=spec.qkv_bias, qk_norm=spec.qk_norm,
                post_norms=spec.post_norms, act=spec.act, embd_scale=spec.embd_scale,
                final_softcap=spec.final_softcap, layer_rope=list(model.layer_rope),
                layer_window=[layer.window for layer in spec.layers])


def ctx_args(C, model, kv) -> dict:
    """DecodeContext's arguments for ``model`` over the float cache ``kv``, as backends/cpu.py builds them (with
    the weights as loaded, not their rows-by-8 copies)."""
    spec, w, vec = model.spec, model.w, model.vec
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    mats = [w[f"blk.{i}.{n}.weight"] for i in range(spec.n_layer) for n in names]
    small = {n.removesuffix(".weight"): n for n in spec.layer_tensors() if n.removesuffix(".weight") not in names}
    return dict(arch=C.DecodeArch(**arch_args(model)), weights=[m.data for m in mats],
                qtypes=[int(m.qtype) for m in mats],
                vectors={name: [vec[f"blk.{i}.{t}"].float().contiguous() for i in range(spec.n_layer)]
                         for name, t in small.items()},
                token_embd=w["token_embd.weight"].data, token_embd_qtype=int(w["token_embd.weight"].qtype),
                output=model.output.data, output_qtype=int(model.output.qtype),
                output_norm=vec["output_norm.weight"].float().contiguous(), rope=list(model.rope_tables),
                k_cache=C.DecodeCachePart(kv.k), v_cache=C.DecodeCachePart(kv.v))


def test_binding_rejects_bad_arguments(tiny_qwen2):
    C = pyllm._ext.load()
    model = tiny_qwen2.model
    kv = _kv(model, 16, torch.float16)
    good = ctx_args(C, model, kv)
    ctx = C.DecodeContext(**good)
    assert ctx.n_vocab == model.cfg.n_vocab and ctx.max_seq == 16
    n = model.cfg.n_layer

    def bad(exc, match, **kw):
        with pytest.raises(exc, match=match):
            C.DecodeContext(**{**good, **kw})

    def bad_arch(match, **kw):
        with pytest.raises(ValueError, match=match):
            C.DecodeArch(**{**arch_args(model), **kw})

    vectors = good["vectors"]
    bad(ValueError, "7 weights", weights=good["weights"][:-1])
    bad(ValueError, "bytes per row", weights=[good["weights"][6]] + good["weights"][1:])  # ffn_down as attn_q
    bad(ValueError, "rows, expected", weights=[good["weights"][1]] + good["weights"][1:])  # attn_k as attn_q
    bad(ValueError, "unknown GGML type", qtypes=[99] + good["qtypes"][1:])
    bad(TypeError, "must be Byte", weights=[good["weights"][0].float()] + good["weights"][1:])
    bad(ValueError, "contiguous", weights=[good["weights"][0].t().contiguous().t()] + good["weights"][1:])
    bad(ValueError, "attn_norm has", vectors={**vectors, "attn_norm": [torch.ones(3)] + vectors["attn_norm"][1:]})
    bad(TypeError, "must be Float", vectors={**vectors, "ffn_norm": [vectors["ffn_norm"][0].double()]
                                             + vectors["ffn_norm"][1:]})
    bad(ValueError, "vectors has no attn_q.bias", vectors={k: v for k, v in vectors.items() if k != "attn_q.bias"})
    bad(ValueError, r"vectors\[attn_k.bias\] has", vectors={**vectors, "attn_k.bias": vectors["attn_k.bias"][:-1]})
    bad(ValueError, "does not use", vectors={**vectors, "attn_q_norm": vectors["attn_norm"]})
    bad(TypeError, "k_cache must be Float", k_cache=C.DecodeCachePart(kv.k.bfloat16()),
        v_cache=C.DecodeCachePart(kv.v.bfloat16()))
    bad(ValueError, "type must be", k_cache=C.DecodeCachePart(kv.k, 7))
    bad(TypeError, "k_cache must be Byte", k_cache=C.DecodeCachePart(kv.k, 2))  # q8_0 rows are bytes
    bad(ValueError, "k_mu must be", k_cache=C.DecodeCachePart(kv.k, mu=torch.zeros(3)))
    bad(ValueError, "k_cache has shape", k_cache=C.DecodeCachePart(kv.k[:1].contiguous()),
        v_cache=C.DecodeCachePart(kv.v[:1].contiguous()))
    bad(ValueError, "v_cache has shape", v_cache=C.DecodeCachePart(kv.v[:, :, :8].contiguous()))
    bad(TypeError, "v_cache must be Half", v_cache=C.DecodeCachePart(kv.v.float(), 1))
    cos, sin = model.rope_tables[0]
    bad(ValueError, r"rope\[0\] cos/sin", rope=[(cos[:, :3].contiguous(), sin)])
    bad(ValueError, "rope has 2", rope=[(cos, sin)] * 2)
    # DecodeArch's checked constructor names each field
    bad_arch("rope_style", rope_style="yarn")
    bad_arch("not a multiple of n_kv_head", n_kv_head=3)
    bad_arch("rope_dim", rope_dim=model.spec.head_dim + 2)
    bad_arch("layer_window entries", layer_window=[-1] * n)
    bad_arch("layer_rope has 1", layer_rope=[0])
    bad_arch("layer_rope entries", layer_rope=[2] * n)
    bad_arch("layer_rope entries", layer_rope=[-2] * n)
    bad_arch("act must be", act="relu")
    bad_arch("act 'swiglu_oai' needs experts", act="swiglu_oai")
    bad_arch("expert_gating must be", expert_gating="sigmoid")
    bad_arch("are expert fields", expert_bias=True)
    bad_arch("swiglu_limit", swiglu_limit=float("nan"))
    bad_arch("embd_scale", embd_scale=-1.0)
    bad_arch("final_softcap", final_softcap=float("nan"))
    bad_arch("rms_eps", rms_eps=0.0)
    bad_arch("attn_scale", attn_scale=float("inf"))

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


# ---- quantized caches: the C++ attention reads q8_0/q4_0 rows directly (csrc/cpu/attention.cpp) --------------
KV_IDS = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3}


def _q8_blocks(q, levels=127):
    """q as the AVX2 kernel dots it with q4_0 keys: quantized per 32 values to q8 (d = absmax/127 in fp32,
    codes round(q * (1/d)) half to even, as llama.cpp's quantize_row_q8_0), dequantized in float64; with q8_0
    keys the same at 16 bits (levels 32767)."""
    b = q.unflatten(-1, (-1, 32))
    d = b.abs().amax(-1, keepdim=True) / levels
    codes = torch.round(b * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return (codes.double() * d.double()).flatten(-2)


# (query heads per KV head, head dim): the kernel takes heads 3 at a time with 32 vector registers (2 at a time for
# values, 1 for scores with 16), then the rest; float rows may have a head dim that is not a multiple of 32. With the
# AVX-512 kernels float rows whose head dim is a multiple of 16 take the 16-wide loops (values 64 at a time, then
# 16: hd 48 and 128 cover both); hd 40 stays on the 8-wide ones.
ATTN_SHAPES = [(3, 64), (1, 64), (2, 64), (4, 64), (7, 64), (5, 40), (3, 48), (2, 128)]
ATTN_CASES = [(kind, group, hd) for kind in KV_IDS for group, hd in ATTN_SHAPES
              if hd % 32 == 0 or kind in ("f32", "f16")]  # block rows hold whole 32-value blocks


@pytest.mark.parametrize("kind,group,hd", ATTN_CASES)
def test_kv_attention_matches_float64_on_dequantized_rows(kind, group, hd):
    """Reference: float64 softmax attention over the rows kv_cache.py dequantizes (same stored bytes), with the
    query the kernel dots, for the scalar reference loop and the kernels of every ISA this CPU runs (set_isa):
    the SIMD kernels take q8_0 / q4_0 keys with an integer dot (int16 query blocks against q8_0 keys; llama.cpp's
    vec_dot_q4_0_q8_0 against q4_0), each query head rounded to blocks first, so for those kinds their reference
    query is that rounded q (_q8_blocks); the scalar loops and float keys use q itself. The rounding is the
    kernel's one approximation (half a step of 1/127 of a block's absmax per query value, next to the key's own
    1/254 (q8_0) or 1/8 (q4_0) of its block's absmax); its effect on the logits is bounded by
    test_smollm2_cpp_decode_quantized_cache. Tolerance: float32 accumulation over <= 77 keys x 128 dims, 2e-5 of
    the output's max."""
    from pyllm.runtime.kv_cache import make_kv_cache

    g = torch.Generator().manual_seed(3)
    hkv, s = 2, 77
    c = make_kv_cache(kind, 1, hkv, s, hd)
    k, v = torch.randn(s, hkv, hd, generator=g), torch.randn(s, hkv, hd, generator=g)
    k[:, :, 9] *= 20  # an outlier channel
    c.update(0, 0, k, v)
    q = torch.randn(hkv * group, hd, generator=g) * 2
    # storage basis, the stored row 0 (the kernel reads rows; the step's exact sink row is tested apart)
    kd, vd = (p.stored(0, s, sink=False).double().repeat_interleave(group, 0) for p in c.parts)
    was = ops._C.get_isa()
    try:
        for isa in ["reference", *ops._C.available_isas()]:
            if isa != "reference":
                ops._C.set_isa(isa)
            int_dot = isa not in ("reference", "scalar") and kind in ("q8_0", "q4_0")
            qr = _q8_blocks(q, 32767 if kind == "q8_0" else 127) if int_dot else q.double()
            p = torch.softmax(torch.einsum("hd,hsd->hs", qr, kd) * hd ** -0.5, -1)
            want = torch.einsum("hs,hsd->hd", p, vd)
            got = ops._C.kv_attention(q, c.k_part.data[0], c.v_part.data[0], KV_IDS[kind], KV_IDS[kind],
                                      hd ** -0.5, isa == "reference")
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < 2e-5, f"{kind} {isa} group {group} hd {hd}: {err:.2e}"
    finally:
        ops._C.set_isa(was)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_kv_store_is_bit_identical_to_python(kind):
    """The decode step stores new rows with the same llama.cpp rounding as kv_cache.py (reference: its bytes)."""
    from pyllm.runtime.kv_cache import _BlockPart

    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(4)) * 5
    x[3] = 0.0  # an all-zero block: d = 0, codes 0 (q8_0) / 8 (q4_0)
    part = _BlockPart(kind, 1, 1, 50, 64, "cpu", is_key=False)
    part.write(0, 0, x[None])
    assert torch.equal(ops._C.kv_store(x, KV_IDS[kind]), part.data[0, 0])


@pytest.mark.parametrize("hd", [64, 44])
def test_kv_store_f16_is_torchs_rounding(hd):
    """f16 rows (8 at a time, then a scalar tail): torch's float -> half conversion, bit for bit (reference), on
    values that round half to even, overflow to inf, land on subnormals or underflow to zero, and random ones."""
    x = torch.randn(40, hd, generator=torch.Generator().manual_seed(6)) * 3
    one_ulp = 2.0 ** -10  # spacing of halves in [1, 2): 1 + ulp / 2 ties to 1, 1 + 3 ulp / 2 to 1 + 2 ulp
    special = torch.tensor([1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -(1 + one_ulp / 2), 65504.0, 65520.0, 1e6, -1e6,
                            6e-8, 3e-8, 1e-9, 2.0 ** -20, -(2.0 ** -24) * 1.5, 0.0, -0.0, float("inf"), 5.5e-5])
    x[:, :len(special)] = special
    want = x.to(torch.float16)
    assert torch.equal(ops._C.kv_store(x, KV_IDS["f16"]).view(torch.int16), want.view(torch.int16))


# Every cache kind as keys and as values (the fused step and the torch path must follow one storage transform:
# centering, key scales, sink row, rotation; kv_cache.PartLayout).
EVERY_KIND = ["f16", "q8_0", "q4_0", "q8_rot", "q4_rot", "q8_0/q4_rot", "q4_rot/q8_0", "q4_0/q8_rot",
              "q8_rot/q4_0", "f16/q4_rot", "bf16/q8_0"]


def _cpp_vs_torch_over_cache(model, ids, kind, n_steps):
    """(torch, fused) pairs of (greedy tokens, logits [n, V], cache contents in the model basis) for ``kind``."""
    from pyllm.runtime.kv_cache import make_kv_cache

    cfg = model.cfg
    out = []
    for cpp in (False, True):
        kv = make_kv_cache(kind, cfg.n_layer, cfg.n_kv_head, 64, cfg.head_dim)
        first = int(model.forward(ids, 0, kv)[-1].argmax())
        toks, lg = _greedy(model, kv, first, len(ids), n_steps, cpp=cpp)
        if cpp:
            fused = model.fused_step(kv) is not None
            assert fused == ("bf16" not in kind), f"{kind}: the C++ step {'was not' if not fused else 'was'} used"
        upto = len(ids) + n_steps
        views = [torch.stack(kv.view(i, upto)) for i in range(cfg.n_layer)]
        out.append((toks, lg, torch.stack(views)))
    return out


@pytest.mark.parametrize("kind", EVERY_KIND)
def test_smollm2_cpp_decode_quantized_cache(smollm2, kind):
    """C++ decode over every cache kind (centered keys, key scales, sink rows, rotations; K and V apart) against
    the torch path over the same kind. Both quantize their own K/V, so codes at rounding boundaries differ: the
    bound is looser than f16's. The caches' contents, read back through kv_cache.py's inverse transform, agree
    within two rounding steps of their kind (each path rounds its own rows: a 4-bit step is 1/8 of a block's
    absmax, so 0.4 of the head's max with the key scales; 8-bit: 0.06), where a step storing rows in another basis
    (no centering, no rotation) is off by about the rows' whole size."""
    model = smollm2.model
    ids = torch.tensor(smollm2.tokenize("The capital of France is"))
    (toks_py, lg_py, kv_py), (toks_c, lg_c, kv_c) = _cpp_vs_torch_over_cache(model, ids, kind, 8)
    tol = 0.06 if "q4" not in kind else 0.2
    atol = tol * float(lg_py.abs().max())
    # The two paths round different K/V codes, so greedy may part at a near-tie (SmolLM2 q4_rot: top-2 gap 0.14
    # of a max logit 34); it must not part anywhere else, and the logits agree up to that step.
    n = next((i for i, (a, b) in enumerate(zip(toks_py, toks_c)) if a != b), len(toks_py))
    if n < len(toks_py):
        gap = float(lg_py[n, toks_py[n]] - lg_py[n, toks_c[n]])
        assert gap <= atol, f"greedy parted at step {n} where the torch path's margin is {gap:.3f} > {atol:.3f}"
    torch.testing.assert_close(lg_c[:n + 1], lg_py[:n + 1], rtol=0, atol=atol)
    upto = len(ids) + n  # rows written before the paths could part
    scale = kv_py[..., :upto, :].abs().amax(dim=(-2, -1), keepdim=True)  # per layer, K/V and head
    err = ((kv_c[..., :upto, :] - kv_py[..., :upto, :]).abs() / scale).max().item()
    kv_tol = 0.4 if "q4" in kind else 0.06
    assert err < kv_tol, f"{kind}: cache contents differ by {err:.3f} of their per-head max"


def test_cpp_step_writes_the_exact_sink_row_from_position_zero(smollm2):
    """A cache without means (f16 keys, q4_0 values) runs the C++ step from position 0, so the step itself stores
    the exact sink row. Reference: the torch path over the same kind, token by token from position 0 (its sink is
    v at position 0, as float32); bound as test_smollm2_cpp_decode_quantized_cache's for 4-bit caches."""
    from pyllm.runtime.kv_cache import make_kv_cache

    model, cfg = smollm2.model, smollm2.model.cfg
    ids = smollm2.tokenize("The capital of France is")
    out = []
    for cpp in (False, True):
        kv = make_kv_cache("f16/q4_0", cfg.n_layer, cfg.n_kv_head, 64, cfg.head_dim)
        model.use_cpp_decode = cpp
        try:
            lg = torch.cat([model.forward(torch.tensor([t]), i, kv) for i, t in enumerate(ids)])
        finally:
            model.use_cpp_decode = True
        if cpp:
            assert model.fused_step(kv) is not None, "C++ step was not used"
        out.append((lg, kv.v_part.sink.clone()))
    (lg_py, sink_py), (lg_c, sink_c) = out
    # the two paths' GEMVs round differently, and deeper layers' position-0 rows inherit it (as the cache rows do
    # in _compare); a wrong or missing row is off by the row's whole size
    torch.testing.assert_close(sink_c, sink_py, rtol=0, atol=0.05 * float(sink_py.abs().max()))
    assert sink_py.abs().max() > 0
    torch.testing.assert_close(lg_c, lg_py, rtol=0, atol=0.2 * float(lg_py.abs().max()))
    assert (lg_c.argmax(-1) == lg_py.argmax(-1)).all()


def test_profile_counts_every_weight_byte_and_leaves_the_logits_alone(tiny_qwen2):
    """decode_profile's timers (tools/decode_profile.py): with them on, a step's logits are the same bits as with
    them off, and each GEMV kind's counters add up to the model's weight bytes per step (the fused q/k/v and
    gate/up calls count once per layer).  Counts only: no timing is asserted."""
    C = pyllm._ext.load()
    model, cfg = tiny_qwen2.model, tiny_qwen2.model.cfg
    kv = _kv(model, 32, torch.float32)
    model.forward(torch.tensor([5, 17, 42]), 0, kv)
    k0, v0 = kv.k.clone(), kv.v.clone()
    outs = []
    for on in (False, True):
        kv.k.copy_(k0)
        kv.v.copy_(v0)
        C.decode_profile(on)
        try:
            outs.append(torch.cat([model.forward(torch.tensor([t]), 3 + i, kv) for i, t in enumerate([7, 99, 3])]))
            p = C.decode_profile_read()
        finally:
            C.decode_profile(False)
    assert model.fused_step(kv) is not None, "C++ decode step was not used"
    assert torch.equal(outs[0], outs[1])
    n = 3
    assert p["on"] and p["steps"] == n and p["step_ns"] > 0

    def nbytes(*names):
        return sum(model.w[f"blk.{i}.{m}.weight"].data.numel() for i in range(cfg.n_layer) for m in names)

    want = {"qkv": nbytes("attn_q", "attn_k", "attn_v"), "wo": nbytes("attn_output"),
            "gate_up": nbytes("ffn_gate", "ffn_up"), "down": nbytes("ffn_down"), "output": model.output.data.numel()}
    for kind, b in want.items():
        e = p[kind]
        assert e["calls"] == n * (1 if kind == "output" else cfg.n_layer), kind
        assert e["bytes"] == n * b, kind
        assert e["busy_ns"] <= e["thread_ns"], kind
    assert C.decode_profile_read()["steps"] == 0  # decode_profile(False) zeroed it and it stays off


def test_cpp_step_reads_legacy_matrices_interleaved_by_8(smollm2, monkeypatch):
    """The C++ step's copy of the Q4_0..Q5_1 and Q8_0 layer matrices and of the Q8_0 output projection has its rows
    interleaved by 8 (the backend makes it once and names its size in describe(); the tied embedding keeps the
    loaded bytes); PYLLM_REPACK=0 keeps the loaded layout.  Reference: the step over the
    loaded layout, from the same cache.  The two differ only in the GEMVs' fp32 summation order, which (as the
    module docstring says) can flip int8 activation roundings and so moves logits by ~1e-2 of the max over 30
    layers (measured 1.0-1.3% on three prompts): tolerance 3%, and the greedy token is the same on a prompt whose
    top-2 margin (7.9%) is wider than twice that."""
    from pyllm.backends.cpu import LAYER_MATRICES

    model, backend = smollm2.model, smollm2.model.backend
    kv = _kv(model, 64, torch.float16)
    ids = torch.tensor(smollm2.tokenize("def add(a, b):\n    return"), dtype=torch.int64)
    first = int(model.forward(ids, 0, kv)[-1].argmax())
    packed = backend.fused_decode(model, kv)
    mats = [model.w[f"blk.{i}.{n}.weight"] for i in range(model.cfg.n_layer) for n in LAYER_MATRICES]
    mats.append(model.output)  # the tied Q8_0 output projection: the step's copy, not the embedding's
    want = sum(m.data.numel() for m in mats if int(m.qtype) in (2, 3, 6, 7, 8) and m.data.shape[0] % 8 == 0)
    assert int(model.output.qtype) == 8 and model.output.data is model.w["token_embd.weight"].data
    assert want > 0 and backend.describe()["repacked_mb"] == round(want / 2**20, 1)
    monkeypatch.setenv("PYLLM_REPACK", "0")
    plain = backend.fused_decode(model, kv)
    a, b = packed(first, len(ids))[0], plain(first, len(ids))[0]
    atol = 0.03 * float(b.abs().max())
    top2 = b.topk(2).values
    assert float(top2[0] - top2[1]) > 2 * atol, "the test needs a prompt with a clear top token"
    assert int(a.argmax()) == int(b.argmax())
    torch.testing.assert_close(a, b, rtol=0, atol=atol)
    if ops._C.get_isa() == "scalar":  # PYLLM_ISA=scalar: one summation order per row whatever the layout
        assert torch.equal(a, b), "the scalar kernels read the interleaved copy in another order than the loaded rows"
    else:
        assert not torch.equal(a, b), "the two layouts should differ in summation order: is the copy in use?"
