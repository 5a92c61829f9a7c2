"""The decode step's row kernels (csrc/cuda/step.cu) against their float64 definitions (tests/gpu/cuda_testutil.py,
the same functions that stand in for them in tests/test_cuda_backend_host.py).

Tolerances: float32 values computed in the definition's order: relative 2e-6 on norms and RoPE outputs, 1e-5 on
the activations (the kernels' __expf / tanhf under --use_fast_math); int8 codes as cuda_quantize_act would make of
the kernel's own float output (a code may differ by one where x / d lands on a rounding tie).
"""

import pytest
import torch

from .cuda_testutil import reference_act, reference_quantize_act, reference_residual_norm, reference_rope_store


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_codes(h: torch.Tensor, xq: torch.Tensor, xds: torch.Tensor):
    q, ds = reference_quantize_act(h.reshape(1, -1).cpu())
    assert (xq.cpu().int() - q.int()).abs().max() <= 1
    d = xds[..., 0].cpu()
    torch.testing.assert_close(d, ds[..., 0], rtol=5e-7, atol=0)  # max|h| / 127: a fast-math division
    torch.testing.assert_close(xds[..., 1].cpu(), d * xq.cpu().float().view(1, -1, 32).sum(-1), rtol=1e-6, atol=1e-30)


def codes(n: int):
    return (torch.full((1, n), 99, dtype=torch.int8, device="cuda"),
            torch.full((1, n // 32, 2), float("nan"), device="cuda"))


@pytest.mark.parametrize("D", [576, 640, 896, 4096, 5120, 8192, 12288])  # 12288: the loop kernel
@pytest.mark.parametrize("branch", ["none", "add", "post-norm"])
def test_residual_norm_quant(K, D, branch):
    g = torch.Generator(device="cuda").manual_seed(D)
    x = torch.randn(1, D, device="cuda", generator=g) * 3
    a = torch.randn(1, D, device="cuda", generator=g) * 10 if branch != "none" else None
    post = torch.rand(D, device="cuda", generator=g) + 0.5 if branch == "post-norm" else None
    w = torch.rand(D, device="cuda", generator=g) * 2
    want_x, want_h = reference_residual_norm(x, a, post, w, 1e-6)
    h = torch.full((1, D), float("nan"), device="cuda")
    xq, xds = codes(D)
    K.cuda_residual_norm_quant(x, a, post, w, 1e-6, h, xq, xds)
    assert rel(x, want_x) <= 2e-6 and rel(h, want_h) <= 2e-6, f"D={D} {branch}"
    check_codes(h, xq, xds)


@pytest.mark.parametrize("n", [1536, 4864, 14336])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_quant(K, n, act):
    g = torch.Generator(device="cuda").manual_seed(n)
    gate = torch.randn(1, n, device="cuda", generator=g) * 4
    gate[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # saturated both ways
    up = torch.randn(1, n, device="cuda", generator=g)
    h = torch.full((1, n), float("nan"), device="cuda")
    xq, xds = codes(n)
    K.cuda_act_quant(gate, up, act, h, xq, xds)
    assert torch.isfinite(h).all()
    assert rel(h, reference_act(gate, up, act)) <= 1e-5, act
    check_codes(h, xq, xds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("H,Hkv,hd,rope_dim,neox,extras", [
    (32, 8, 128, 128, False, ""),        # Llama
    (14, 2, 64, 64, True, "bias"),       # Qwen2
    (16, 8, 128, 128, True, "norm"),     # Qwen3
    (4, 1, 256, 256, True, "norm"),      # Gemma 3 270M
    (8, 4, 128, 64, False, "bias norm"),  # partial rotary
    (16, 4, 128, 0, False, ""),          # a NoPE layer (SmolLM3): no tables, no rotation
])
def test_rope_store(K, H, Hkv, hd, rope_dim, neox, extras, dtype):
    g = torch.Generator(device="cuda").manual_seed(H * hd + rope_dim)
    max_seq, pos = 300, 217
    q = torch.randn(1, H * hd, device="cuda", generator=g)
    k = torch.randn(1, Hkv * hd, device="cuda", generator=g)
    v = torch.randn(1, Hkv * hd, device="cuda", generator=g)
    bias = [torch.randn(n, device="cuda", generator=g) for n in (H * hd, Hkv * hd, Hkv * hd)] \
        if "bias" in extras else [None] * 3
    norms = [torch.rand(hd, device="cuda", generator=g) + 0.5 for _ in range(2)] if "norm" in extras else [None] * 2
    theta = torch.arange(max_seq, device="cuda")[:, None] * 0.37 ** torch.arange(rope_dim // 2, device="cuda")
    cos, sin = (theta.cos().contiguous(), theta.sin().contiguous()) if rope_dim else (None, None)
    kc = torch.randn(Hkv, max_seq, hd, device="cuda", generator=g).to(dtype)
    vc = torch.randn(Hkv, max_seq, hd, device="cuda", generator=g).to(dtype)
    k0, v0 = kc.clone(), vc.clone()
    q_out = torch.full((H, hd), float("nan"), device="cuda")
    K.cuda_rope_store(q, k, v, *bias, *norms, 1e-6, cos, sin, neox, torch.tensor([pos], device="cuda"), kc, vc,
                      q_out)
    wq, wk, wv = reference_rope_store(q, k, v, hd, *bias, *norms, 1e-6, cos, sin, neox, pos)
    assert rel(q_out, wq) <= 2e-6
    for got, want, before in ((kc, wk, k0), (vc, wv, v0)):
        assert rel(got[:, pos], want) <= {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        others = torch.ones(max_seq, dtype=torch.bool)
        others[pos] = False
        assert torch.equal(got[:, others], before[:, others]), "rows other than pos changed"


def test_row_kernel_errors(K):
    x = torch.randn(1, 64, device="cuda")
    h = torch.empty_like(x)
    xq, xds = codes(64)
    with pytest.raises(ValueError, match="multiple of 32"):
        K.cuda_residual_norm_quant(torch.randn(1, 48, device="cuda"), None, None, torch.ones(48, device="cuda"),
                                   1e-6, h, xq, xds)
    with pytest.raises(ValueError, match="w must be 64 contiguous values"):
        K.cuda_residual_norm_quant(x, None, None, torch.ones(32, device="cuda"), 1e-6, h, xq, xds)
    with pytest.raises(ValueError, match="post_w needs a"):
        K.cuda_residual_norm_quant(x, None, torch.ones(64, device="cuda"), torch.ones(64, device="cuda"), 1e-6, h,
                                   xq, xds)
    with pytest.raises(ValueError, match="act must be"):
        K.cuda_act_quant(x, x, "relu", h, xq, xds)
    with pytest.raises(ValueError, match="xds has shape"):
        K.cuda_act_quant(x, x, "silu", h, xq, torch.empty(1, 3, 2, device="cuda"))
    with pytest.raises(ValueError, match="xq has shape"):
        K.cuda_gemv_q(torch.zeros(4, 18, dtype=torch.uint8, device="cuda"), 2, xq[:, :48].contiguous(), xds)
    q = torch.randn(1, 128, device="cuda")
    cache = torch.zeros(1, 8, 128, device="cuda")
    cs = torch.zeros(8, 64, device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    with pytest.raises(TypeError, match="k_cache must be Float, Half or BFloat16"):
        K.cuda_rope_store(q, q, q, None, None, None, None, None, 1e-6, cs, cs, False, pos,
                          cache.to(torch.uint8), cache.to(torch.uint8), torch.empty(1, 128, device="cuda"))
    with pytest.raises(ValueError, match="give cos and sin, or neither"):
        K.cuda_rope_store(q, q, q, None, None, None, None, None, 1e-6, cs, None, False, pos, cache, cache,
                          torch.empty(1, 128, device="cuda"))
    with pytest.raises(ValueError, match="head_dim 96"):
        K.cuda_rope_store(q, q, q, None, None, None, None, None, 1e-6, cs, cs, False, pos, cache, cache,
                          torch.empty(1, 96, device="cuda"))
