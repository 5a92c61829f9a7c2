"""Random GGUF weights for the CUDA tests: random quant bytes with finite fp16 scales sized so a row's values
have roughly unit-variance dot products with unit inputs, plus the gguf.quants float64 reference; random AWQ rows
with their float64 values; and the float64 definition of the decode attention over a KV cache's stored rows (also
used by the CPU-side tests)."""

from __future__ import annotations

import numpy as np
import torch

from pyllm.formats.gguf import BLOCK_INFO, GGMLType

# (byte offset, magnitude factor) of each fp16 scale field; value ~ factor / sqrt(K) keeps weights ~ 1/sqrt(K)
SCALES = {
    GGMLType.Q4_0: [(0, 1 / 4.6)],
    GGMLType.Q4_1: [(0, 1 / 4.6), (2, -7.5 / 4.6)],
    GGMLType.Q5_0: [(0, 1 / 9.2)],
    GGMLType.Q5_1: [(0, 1 / 9.2), (2, -15.5 / 9.2)],
    GGMLType.Q8_0: [(0, 1 / 74.0)],
    GGMLType.Q2_K: [(80, 1 / 8.0), (82, 1 / 16.0)],
    GGMLType.Q3_K: [(108, 1 / 40.0)],
    GGMLType.Q4_K: [(0, 1 / 140.0), (2, 1 / 60.0)],
    GGMLType.Q5_K: [(0, 1 / 280.0), (2, 1 / 60.0)],
    GGMLType.Q6_K: [(208, 1 / 2000.0)],
}


def random_blocks(qtype: GGMLType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes] of valid random blocks."""
    bs, ts = BLOCK_INFO[qtype]
    raw = rng.integers(0, 256, size=(n * (k // bs), ts), dtype=np.uint8)
    for off, f in SCALES[qtype]:
        vals = (f / np.sqrt(k)) * rng.uniform(0.5, 1.5, size=raw.shape[0]) * rng.choice([-1, 1], size=raw.shape[0])
        raw[:, off:off + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def random_awq_rows(n: int, k: int, g: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """AWQ rows (csrc/common/blocks.h AwqRow: per row k/g fp16 scales, k/g u8 zeros 0..15, the 4-bit codes in the Q4_0
    element order) of group size g: (uint8 [n, 3k/g + k/2], their float64 values (q - z) * s [n, k])."""
    ng = k // g
    s = (rng.uniform(0.5, 1.5, (n, ng)) * rng.choice([-1, 1], (n, ng)) / (8 * np.sqrt(k))).astype(np.float16)
    z = rng.integers(0, 16, (n, ng), dtype=np.uint8)
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    qb = q.reshape(n, k // 32, 32)
    packed = (qb[..., :16] | (qb[..., 16:] << 4)).reshape(n, k // 2)
    rows = np.concatenate([s.view(np.uint8).reshape(n, 2 * ng), z, packed], axis=1)
    vals = (q.astype(np.float64) - np.repeat(z, g, axis=1)) * np.repeat(s.astype(np.float64), g, axis=1)
    return np.ascontiguousarray(rows), vals


def reference(qtype: GGMLType, blocks: np.ndarray) -> np.ndarray:
    """gguf.quants' dequantization (float32, as the file format defines it)."""
    from gguf import quants

    return quants.dequantize(blocks, int(qtype))


def to_cuda(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def stored_rows(data: torch.Tensor, block: str) -> torch.Tensor:
    """Rows of one layer's cache part as float64 [Hkv, S, hd]: float rows as they are, q8_0 / q4_0 blocks through
    pyllm/runtime/kv_cache.py's own dequantizers (the definition both the CPU step and csrc/cuda follow)."""
    from pyllm.runtime import kv_cache

    if not block:
        return data.double()
    hkv, s, rb = data.shape
    bb = kv_cache.BLOCK_BYTES[block]
    b = data.reshape(hkv, s, rb // bb, bb)
    d = b[..., :2].contiguous().view(torch.float16)[..., 0]
    if block == "q8_0":
        x = kv_cache.dequantize_q8_0(b[..., 2:].contiguous().view(torch.int8), d)
    else:
        x = kv_cache.dequantize_q4_0(b[..., 2:].contiguous(), d)
    return x.reshape(hkv, s, -1).double()


def reference_attn_decode(q: torch.Tensor, k, v, length: int, scale: float, window: int = 0,
                          softcap: float = 0.0) -> torch.Tensor:
    """float64 definition of csrc/cuda/attention.cu: q [H, hd] (keys' storage basis) over one layer's parts k, v
    (pyllm.backends.cuda_step.AttnPart), positions max(0, length - window) .. length - 1, position 0 from the sink
    rows where a part has them, scores softcapped when softcap > 0.  Returns [H, hd] float64 (values' basis)."""
    kk = stored_rows(k.data, k.block)[:, :length].clone()
    vv = stored_rows(v.data, v.block)[:, :length].clone()
    if k.sink is not None:
        kk[:, 0] = k.sink.double()
    if v.sink is not None:
        vv[:, 0] = v.sink.double()
    lo = max(0, length - window) if window else 0
    kk, vv = kk[:, lo:], vv[:, lo:]
    g = q.shape[0] // kk.shape[0]
    s = torch.einsum("hd,hsd->hs", q.double() * scale, kk.repeat_interleave(g, 0))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return torch.einsum("hs,hsd->hd", torch.softmax(s, -1), vv.repeat_interleave(g, 0))


# ---- the decode step's row kernels (csrc/cuda/step.cu, gemv.cu), defined in torch -------------------------------
# The CUDA tests compare each kernel with these; tests/test_cuda_backend_host.py runs CudaDecodeStep on the CPU with
# them standing in for the kernels.
def reference_quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] f32 -> (codes int8 [M, K], f32 [M, K/32, 2] = (d, d * sum(codes))): d = max|x| / 127 per 32 values,
    codes = x / d rounded half to even (0 where d is 0)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.where(d[..., None] > 0, torch.round(xb / safe[..., None]), torch.zeros_like(xb))
    return q.to(torch.int8).reshape(m, k), torch.stack((d, d * q.sum(-1)), -1)


def reference_codes_value(xq: torch.Tensor, xds: torch.Tensor) -> torch.Tensor:
    """The activations the codes stand for: codes * d per 32 values, [M, K] float64."""
    m, k = xq.shape
    return (xq.double().reshape(m, k // 32, 32) * xds[..., :1].double()).reshape(m, k)


def rms_norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def reference_residual_norm(x, a, post_w, w, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + a', rms_norm(x + a') * w) in float64, a' = rms_norm(a) * post_w where post_w is given, a where not, 0
    where a is None: what cuda_residual_norm_quant leaves in x and h."""
    x = x.double()
    if a is not None:
        x = x + (rms_norm64(a, post_w, eps) if post_w is not None else a.double())
    return x, rms_norm64(x, w, eps)


def reference_act(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    g = g.double()
    a = torch.nn.functional.gelu(g, approximate="tanh") if act == "gelu_tanh" else torch.nn.functional.silu(g)
    return a * u.double()


def reference_rope_store(q, k, v, hd, q_bias, k_bias, v_bias, q_norm, k_norm, eps, cos, sin, neox, pos):
    """float64 (q [H, hd] after bias, per-head RMS norm and RoPE at pos; k likewise [Hkv, hd]; v [Hkv, hd] after
    bias): what cuda_rope_store writes to q_out and, before rounding to the cache's dtype, into the rows at pos.
    cos and sin None: no RoPE."""
    from pyllm.models.decoder import apply_rope

    def heads(t, b):
        t = t.double().reshape(-1, hd)
        return t + b.double().reshape(-1, hd) if b is not None else t

    qq, kk, vv = heads(q, q_bias), heads(k, k_bias), heads(v, v_bias)
    if q_norm is not None:
        qq, kk = rms_norm64(qq, q_norm, eps), rms_norm64(kk, k_norm, eps)
    if cos is None:
        return qq, kk, vv
    c, s = cos[pos:pos + 1].double(), sin[pos:pos + 1].double()
    style, rope_dim = ("neox" if neox else "norm"), 2 * cos.shape[1]
    return apply_rope(qq[None], c, s, style, rope_dim)[0], apply_rope(kk[None], c, s, style, rope_dim)[0], vv


def arch_for(K, n_embd=64, n_ff=64, n_head=1, n_kv_head=1, head_dim=64, rope_dim=None, neox=False, qkv_bias=False,
             qk_norm=False, act="silu", eps=1e-6, rope=True):
    """A one-layer DecodeArch (csrc/common/arch.h, the struct the row kernels take) with these sizes; ``rope``
    False: the layer has no rope tables (a NoPE layer)."""
    return K.DecodeArch(n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
                        rope_dim=rope_dim or head_dim, rope_style="neox" if neox else "norm", rms_eps=eps,
                        attn_scale=head_dim ** -0.5, qkv_bias=qkv_bias, qk_norm=qk_norm, post_norms=False, act=act,
                        embd_scale=0.0, final_softcap=0.0, layer_rope=[0 if rope else -1], layer_window=[0])
