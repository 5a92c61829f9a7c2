"""The decode step's row kernels (csrc/cuda/step.cu) against their float64 definitions (tests/gpu/cuda_testutil.py,
the same functions that stand in for them in tests/test_cuda_backend_host.py).

Tolerances: float32 values computed in the definition's order: relative 2e-6 on norms and RoPE outputs, 1e-5 on
the activations (the kernels' __expf / tanhf under --use_fast_math); int8 codes as cuda_quantize_act would make of
the kernel's own float output (a code may differ by one where x / d lands on a rounding tie).
"""

import pytest
import torch

from .cuda_testutil import (arch_for, reference_act, reference_quantize_act, reference_residual_norm,
                            reference_rope_store)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_codes(h: torch.Tensor, xq: torch.Tensor, xds: torch.Tensor):
    m = h.shape[0]
    q, ds = reference_quantize_act(h.reshape(m, -1).cpu())
    assert (xq.cpu().int() - q.int()).abs().max() <= 1
    d = xds[..., 0].cpu()
    torch.testing.assert_close(d, ds[..., 0], rtol=5e-7, atol=0)  # max|h| / 127: a fast-math division
    torch.testing.assert_close(xds[..., 1].cpu(), d * xq.cpu().float().view(m, -1, 32).sum(-1), rtol=1e-6, atol=1e-30)


def codes(n: int, m: int = 1):
    return (torch.full((m, n), 99, dtype=torch.int8, device="cuda"),
            torch.full((m, n // 32, 2), float("nan"), device="cuda"))


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("D", [576, 640, 896, 4096, 5120, 8192, 12288])  # 12288: the loop kernel
@pytest.mark.parametrize("branch", ["none", "add", "post-norm"])
def test_residual_norm_quant(K, D, branch, M):
    """M rows in one launch: each row against the float64 definition, and bit for bit the row run alone (what a
    batched step's rows rely on)."""
    g = torch.Generator(device="cuda").manual_seed(D)
    x = torch.randn(M, D, device="cuda", generator=g) * 3
    a = torch.randn(M, D, device="cuda", generator=g) * 10 if branch != "none" else None
    post = torch.rand(D, device="cuda", generator=g) + 0.5 if branch == "post-norm" else None
    w = torch.rand(D, device="cuda", generator=g) * 2
    arch = arch_for(K, n_embd=D, eps=1e-6)
    want_x, want_h = reference_residual_norm(x, a, post, w, 1e-6)
    x0 = x.clone()
    h = torch.full((M, D), float("nan"), device="cuda")
    xq, xds = codes(D, M)
    K.cuda_residual_norm_quant(arch, x, a, post, w, h, xq, xds)
    assert rel(x, want_x) <= 2e-6 and rel(h, want_h) <= 2e-6, f"D={D} {branch}"
    check_codes(h, xq, xds)
    r = M - 1  # the last row, alone
    x1, h1, (xq1, xds1) = x0[r:r + 1].clone(), torch.empty(1, D, device="cuda"), codes(D)
    K.cuda_residual_norm_quant(arch, x1, None if a is None else a[r:r + 1].contiguous(), post, w, h1, xq1, xds1)
    assert torch.equal(x1, x[r:r + 1]) and torch.equal(h1, h[r:r + 1]) and torch.equal(xq1, xq[r:r + 1])


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("n", [1536, 4864, 14336])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_quant(K, n, act, M):
    g = torch.Generator(device="cuda").manual_seed(n)
    gate = torch.randn(M, n, device="cuda", generator=g) * 4
    gate[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # saturated both ways
    up = torch.randn(M, n, device="cuda", generator=g)
    h = torch.full((M, n), float("nan"), device="cuda")
    xq, xds = codes(n, M)
    arch = arch_for(K, n_ff=n, act=act)
    K.cuda_act_quant(arch, gate, up, h, xq, xds)
    assert torch.isfinite(h).all()
    assert rel(h, reference_act(gate, up, act)) <= 1e-5, act
    check_codes(h, xq, xds)
    h1, (xq1, xds1) = torch.empty(1, n, device="cuda"), codes(n)
    K.cuda_act_quant(arch, gate[-1:].contiguous(), up[-1:].contiguous(), h1, xq1, xds1)
    assert torch.equal(h1, h[-1:]) and torch.equal(xq1, xq[-1:]) and torch.equal(xds1, xds[-1:])


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
    arch = arch_for(K, n_head=H, n_kv_head=Hkv, head_dim=hd, rope_dim=rope_dim or hd, neox=neox,
                    qkv_bias="bias" in extras, qk_norm="norm" in extras, rope=rope_dim > 0)
    K.cuda_rope_store(arch, 0, q, k, v, *bias, *norms, cos, sin, torch.tensor([pos], device="cuda"), kc, vc, q_out)
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
    arch = arch_for(K, n_embd=64, n_ff=64)
    with pytest.raises(ValueError, match="arch.n_embd = 48 is not a positive multiple of 32"):
        K.cuda_residual_norm_quant(arch_for(K, n_embd=48), torch.randn(1, 48, device="cuda"), None, None,
                                   torch.ones(48, device="cuda"), h, xq, xds)
    with pytest.raises(ValueError, match=r"x has shape \[1, 64\]; 1..8 rows of arch.n_embd = 128"):
        K.cuda_residual_norm_quant(arch_for(K, n_embd=128), x, None, None, torch.ones(128, device="cuda"), h, xq,
                                   xds)
    with pytest.raises(ValueError, match="1..8 rows"):
        K.cuda_residual_norm_quant(arch, torch.randn(9, 64, device="cuda"), None, None, torch.ones(64, device="cuda"),
                                   h, xq, xds)
    with pytest.raises(ValueError, match="w must be 64 contiguous values"):
        K.cuda_residual_norm_quant(arch, x, None, None, torch.ones(32, device="cuda"), h, xq, xds)
    with pytest.raises(ValueError, match="post_w needs a"):
        K.cuda_residual_norm_quant(arch, x, None, torch.ones(64, device="cuda"), torch.ones(64, device="cuda"), h,
                                   xq, xds)
    with pytest.raises(ValueError, match="xds has shape"):
        K.cuda_act_quant(arch, x, x, h, xq, torch.empty(1, 3, 2, device="cuda"))
    with pytest.raises(ValueError, match="xq has shape"):
        K.cuda_gemv_q(torch.zeros(4, 18, dtype=torch.uint8, device="cuda"), 2, xq[:, :48].contiguous(), xds)
    with pytest.raises(ValueError, match="act must be"):  # the struct's constructor checks the activation's name
        arch_for(K, act="relu")
    q = torch.randn(1, 128, device="cuda")
    cache = torch.zeros(1, 8, 128, device="cuda")
    cs = torch.zeros(8, 64, device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    a128 = arch_for(K, head_dim=128)
    with pytest.raises(TypeError, match="k_cache must be Float, Half or BFloat16"):
        K.cuda_rope_store(a128, 0, q, q, q, None, None, None, None, None, cs, cs, pos,
                          cache.to(torch.uint8), cache.to(torch.uint8), torch.empty(1, 128, device="cuda"))
    with pytest.raises(ValueError, match="give cos and sin exactly where the layer has rope tables"):
        K.cuda_rope_store(a128, 0, q, q, q, None, None, None, None, None, cs, None, pos, cache, cache,
                          torch.empty(1, 128, device="cuda"))
    with pytest.raises(ValueError, match="give cos and sin exactly where the layer has rope tables"):
        K.cuda_rope_store(arch_for(K, head_dim=128, rope=False), 0, q, q, q, None, None, None, None, None, cs, cs, pos,
                          cache, cache, torch.empty(1, 128, device="cuda"))
    with pytest.raises(ValueError, match="give q, k and v biases exactly where arch.qkv_bias"):
        K.cuda_rope_store(a128, 0, q, q, q, q[0], q[0], q[0], None, None, cs, cs, pos, cache, cache,
                          torch.empty(1, 128, device="cuda"))
    with pytest.raises(ValueError, match="layer 1 is outside 0..0"):
        K.cuda_rope_store(a128, 1, q, q, q, None, None, None, None, None, cs, cs, pos, cache, cache,
                          torch.empty(1, 128, device="cuda"))
    with pytest.raises(ValueError, match="head_dim 96"):
        K.cuda_rope_store(arch_for(K, head_dim=96), 0, q, q, q, None, None, None, None, None, cs, cs, pos, cache,
                          cache, torch.empty(1, 96, device="cuda"))
