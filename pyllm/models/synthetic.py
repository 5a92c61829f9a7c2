"""Models of real shapes with random weights, built in memory (no file): for speed work on any machine.

Speed does not depend on weight values, but it does depend on every byte being real memory: the blocks are
filled with random bytes (tiled from one random buffer, so building an 8B model takes seconds, where
pyllm.synthetic.random_blocks draws every byte) and every fp16 scale is set to a small finite value, so no kernel
meets NaNs or untouched zero pages.

File type "awq" (or awq_g32 / awq_g64 / awq_g256; "awq" is G = 128) is an AutoAWQ "gemm" checkpoint of that shape:
random qweight / qzeros words and small fp16 scales, repacked by the same C++ repacker a loaded AWQ folder goes
through (pyllm/formats/awq/), with fp16 embeddings and lm_head as AutoAWQ leaves them.
"""

from __future__ import annotations

import torch

from ..errors import PyllmError, shorten
from ..formats.gguf import BLOCK_INFO, GGMLType
from ..formats.quant import QTensor
from ..synthetic import SCALE_OFFSETS
from .config import ModelConfig

SHAPES = {
    # name: (n_layer, n_embd, n_ff, n_head, n_kv_head, head_dim, n_vocab, rope_base, arch, tied)
    "llama3-8b": (32, 4096, 14336, 32, 8, 128, 128256, 500000.0, "llama", False),
    "llama3-1b": (16, 2048, 8192, 32, 8, 64, 128256, 500000.0, "llama", True),
    "qwen2.5-7b": (28, 3584, 18944, 28, 4, 128, 152064, 1000000.0, "qwen2", False),
    "smollm2-135m": (30, 576, 1536, 9, 3, 64, 49152, 100000.0, "llama", True),
    "qwen3-30b-a3b": (48, 2048, 6144, 32, 4, 128, 151936, 1000000.0, "qwen3moe", False),
}
# Mixture-of-experts shapes: (experts, experts used per token, each expert's hidden size).  Their layers have
# QK-norm and no dense MLP; about 17 GiB at q4_k_m, of which a token reads ~1.6 GiB.
MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 768)}

# Block type of each tensor role per file type, as llama.cpp's quantizer picks them (Q4_K_M: Q6_K for the output,
# and for attn_v / ffn_down of the "use_more_bits" layers).
FTYPES = {
    "q4_k_m": dict(default=GGMLType.Q4_K, output=GGMLType.Q6_K, embd=GGMLType.Q4_K, more=GGMLType.Q6_K),
    "q4_0": dict(default=GGMLType.Q4_0, output=GGMLType.Q6_K, embd=GGMLType.Q4_0, more=GGMLType.Q4_0),
    "q8_0": dict(default=GGMLType.Q8_0, output=GGMLType.Q8_0, embd=GGMLType.Q8_0, more=GGMLType.Q8_0),
    "q6_k": dict(default=GGMLType.Q6_K, output=GGMLType.Q6_K, embd=GGMLType.Q6_K, more=GGMLType.Q6_K),
    "f16": dict(default=GGMLType.F16, output=GGMLType.F16, embd=GGMLType.F16, more=GGMLType.F16),
}

_POOL: dict[int, torch.Tensor] = {}


def random_qtensor(qtype: GGMLType, n: int, k: int, name: str = "w", seed: int = 0) -> QTensor:
    """A QTensor [n, k] of ``qtype`` with random quants and finite scales."""
    bs, ts = BLOCK_INFO[qtype]
    if k % bs:
        raise PyllmError(f"{name}: K={k} is not a multiple of the {qtype.name} block size {bs}")
    row_bytes = k // bs * ts
    data = _pool_bytes(n * row_bytes, seed).view(n, row_bytes)
    if qtype in (GGMLType.F16, GGMLType.BF16):
        vals = (torch.rand(n, k) - 0.5) * 0.1
        data = vals.to(torch.float16 if qtype == GGMLType.F16 else torch.bfloat16).view(torch.uint8).view(n, -1)
    elif qtype == GGMLType.F32:
        data = ((torch.rand(n, k) - 0.5) * 0.1).view(torch.uint8).view(n, -1)
    else:
        blocks = data.view(-1, ts)
        scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        for off in SCALE_OFFSETS[qtype]:
            blocks[:, off:off + 2] = scale
    shape = (n, k)
    return QTensor(qtype, shape, data.contiguous(), name=name)


def random_experts(qtype: GGMLType, e: int, n: int, k: int, name: str, seed: int = 0) -> QTensor:
    """Stacked experts [e, n, k] of ``qtype`` (llama.cpp's ffn_*_exps), random as random_qtensor's."""
    t = random_qtensor(qtype, e * n, k, name, seed)
    return QTensor(qtype, (e, n, k), t.data.view(e, n, -1), name=name)


def _pool_bytes(total: int, seed: int) -> torch.Tensor:
    """``total`` random bytes tiled from the seed's 16 MiB pool (uint8, flat)."""
    pool = _POOL.get(seed)
    if pool is None:
        g = torch.Generator().manual_seed(seed)
        pool = _POOL[seed] = torch.randint(0, 256, (1 << 24,), dtype=torch.uint8, generator=g)
    data = torch.empty(total, dtype=torch.uint8)
    for i in range(0, total, pool.numel()):
        m = min(pool.numel(), total - i)
        data[i:i + m] = pool[:m]
    return data


def random_f16(n: int, k: int, name: str, seed: int = 8) -> QTensor:
    """F16 [n, k] from random bits with the exponent capped (|v| < 0.25, no inf/nan): no fp32 temporary the size of
    an 8B model's embedding table."""
    bits = _pool_bytes(n * k * 2, seed).view(torch.int16) & 0x33FF
    return QTensor(GGMLType.F16, (n, k), bits.view(torch.uint8).view(n, 2 * k), name=name)


def random_awq(n: int, k: int, g: int, name: str = "w", seed: int = 0):
    """An AWQ weight [n, k] (group size g): random AutoAWQ qweight/qzeros words and fp16 scales in [0.002, 0.004],
    repacked for the CPU kernels (pyllm.formats.awq.repack.AWQRows)."""
    from .. import _ext
    from ..formats.awq.repack import AWQRows

    if k % g or n % 8:
        raise PyllmError(f"{name}: AWQ needs K % group_size == 0 and N % 8 == 0, got K={k}, N={n}, "
                         f"group_size {g} (try another awq_g<G>)")
    C = _ext.load()
    qweight = _pool_bytes(k * n // 2, seed).view(torch.int32).view(k, n // 8)
    qzeros = _pool_bytes(k // g * n // 2, seed + 100).view(torch.int32).view(k // g, n // 8)
    gen = torch.Generator().manual_seed(seed)
    scales = (torch.rand(k // g, n, generator=gen) * 0.002 + 0.002).half()
    return AWQRows(C.awq_repack(qweight, qzeros, scales, g), int(C.awq_qtype(g)), (n, k), g, name)


AWQ_FTYPES = {"awq": 128, "awq_g32": 32, "awq_g64": 64, "awq_g128": 128, "awq_g256": 256}


def check_synthetic_spec(spec: str) -> tuple[str, str]:
    """(shape, file type) of 'SHAPE[:FTYPE]', or a PyllmError naming the unknown part (cheap: callers check every
    spec before building or measuring anything)."""
    shape, _, ftype = spec.partition(":")
    ftype = ftype or "q4_k_m"
    if shape not in SHAPES:
        raise PyllmError(f"unknown synthetic shape {shorten(shape)!r}; known: {', '.join(SHAPES)}")
    if ftype not in FTYPES and ftype not in AWQ_FTYPES:
        raise PyllmError(f"unknown synthetic file type {shorten(ftype)!r}; known: {', '.join([*FTYPES, *AWQ_FTYPES])}")
    if ftype in AWQ_FTYPES and shape in MOE_SHAPES:
        raise PyllmError(f"synthetic {shape} is a mixture of experts, which AWQ checkpoints do not hold; known file "
                         f"types for it: {', '.join(FTYPES)}")
    return shape, ftype


def synthetic_model(spec: str) -> tuple[ModelConfig, dict]:
    """spec 'SHAPE:FTYPE' (e.g. 'llama3-8b:q4_k_m', 'llama3-8b:awq') -> (ModelConfig, weights dict of QTensors /
    AWQRows)."""
    shape, ftype = check_synthetic_spec(spec)
    L, D, FF, H, HKV, HD, V, base, arch, tied = SHAPES[shape]
    if ftype in AWQ_FTYPES:
        return _synthetic_awq(SHAPES[shape], AWQ_FTYPES[ftype])
    ft = FTYPES[ftype]
    cfg = ModelConfig(arch=arch, n_layer=L, n_embd=D, n_ff=FF, n_head=H, n_kv_head=HKV, head_dim=HD, n_vocab=V,
                      n_ctx_train=8192, rope_base=base, rope_dim=HD, rope_style="neox" if arch == "qwen2" else "norm",
                      rms_eps=1e-5, qkv_bias=arch == "qwen2", tied_output=tied)
    moe = MOE_SHAPES.get(shape)
    if moe:
        cfg.rope_style, cfg.qk_norm = "neox", True
        cfg.extra.update(expert_count=moe[0], expert_used_count=moe[1], expert_ff=moe[2], expert_shared_ff=0,
                         expert_shared_gate=False, expert_weights_norm=True)

    def pick(t: GGMLType, k: int) -> GGMLType:
        # K-quants need rows that are multiples of 256; llama.cpp falls back to a 32-block type there
        if BLOCK_INFO[t][0] == 256 and k % 256:
            return GGMLType.Q5_0 if t != GGMLType.Q6_K else GGMLType.Q8_0
        return t

    def vec(n):
        return QTensor(GGMLType.F32, (n,), torch.ones(n).view(torch.uint8), name="norm")

    w: dict[str, QTensor] = {}
    w["token_embd.weight"] = random_qtensor(pick(ft["embd"], D), V, D, "token_embd.weight")
    if not tied:
        w["output.weight"] = random_qtensor(pick(ft["output"], D), V, D, "output.weight")
    w["output_norm.weight"] = vec(D)
    for i in range(L):
        p = f"blk.{i}."
        more = i < L // 8 or i >= 7 * L // 8 or (i - L // 8) % 3 == 2  # llama.cpp's use_more_bits
        w[p + "attn_norm.weight"] = vec(D)
        w[p + "ffn_norm.weight"] = vec(D)
        w[p + "attn_q.weight"] = random_qtensor(pick(ft["default"], D), H * HD, D, p + "attn_q.weight", seed=1)
        w[p + "attn_k.weight"] = random_qtensor(pick(ft["default"], D), HKV * HD, D, p + "attn_k.weight", seed=2)
        vt = ft["more"] if more else ft["default"]
        w[p + "attn_v.weight"] = random_qtensor(pick(vt, D), HKV * HD, D, p + "attn_v.weight", seed=3)
        w[p + "attn_output.weight"] = random_qtensor(pick(ft["default"], H * HD), D, H * HD, p + "attn_output.weight",
                                                     seed=4)
        if moe:
            E, FE = moe[0], moe[2]
            w[p + "attn_q_norm.weight"] = vec(HD)
            w[p + "attn_k_norm.weight"] = vec(HD)
            # the router stays float32, as llama.cpp keeps it; small values so the softmax spreads over experts
            w[p + "ffn_gate_inp.weight"] = random_qtensor(GGMLType.F32, E, D, p + "ffn_gate_inp.weight")
            w[p + "ffn_gate_exps.weight"] = random_experts(pick(ft["default"], D), E, FE, D, p + "ffn_gate_exps.weight",
                                                           seed=5)
            w[p + "ffn_up_exps.weight"] = random_experts(pick(ft["default"], D), E, FE, D, p + "ffn_up_exps.weight",
                                                         seed=6)
            w[p + "ffn_down_exps.weight"] = random_experts(pick(vt, FE), E, D, FE, p + "ffn_down_exps.weight", seed=7)
            continue
        w[p + "ffn_gate.weight"] = random_qtensor(pick(ft["default"], D), FF, D, p + "ffn_gate.weight", seed=5)
        w[p + "ffn_up.weight"] = random_qtensor(pick(ft["default"], D), FF, D, p + "ffn_up.weight", seed=6)
        w[p + "ffn_down.weight"] = random_qtensor(pick(vt, FF), D, FF, p + "ffn_down.weight", seed=7)
        if cfg.qkv_bias:
            w[p + "attn_q.bias"] = vec(H * HD)
            w[p + "attn_k.bias"] = vec(HKV * HD)
            w[p + "attn_v.bias"] = vec(HKV * HD)
    return cfg, w


def _synthetic_awq(shape: tuple, g: int) -> tuple[ModelConfig, dict]:
    """An AutoAWQ-style model: every linear AWQ int4 (group size g), embeddings / lm_head / norms float."""
    L, D, FF, H, HKV, HD, V, base, arch, tied = shape
    # HF checkpoints (the only source of AWQ models) use the half-split rotation: pyllm/formats/awq/config.py config_from_hf
    cfg = ModelConfig(arch=arch, n_layer=L, n_embd=D, n_ff=FF, n_head=H, n_kv_head=HKV, head_dim=HD, n_vocab=V,
                      n_ctx_train=8192, rope_base=base, rope_dim=HD, rope_style="neox", rms_eps=1e-5,
                      qkv_bias=arch == "qwen2", tied_output=tied)

    def vec(n):
        return QTensor(GGMLType.F32, (n,), torch.ones(n).view(torch.uint8), name="norm")

    w: dict = {"token_embd.weight": random_f16(V, D, "token_embd.weight")}
    if not tied:
        w["output.weight"] = random_f16(V, D, "output.weight", seed=9)
    w["output_norm.weight"] = vec(D)
    for i in range(L):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = vec(D)
        w[p + "ffn_norm.weight"] = vec(D)
        for j, (name, n, k) in enumerate((("attn_q", H * HD, D), ("attn_k", HKV * HD, D), ("attn_v", HKV * HD, D),
                                          ("attn_output", D, H * HD), ("ffn_gate", FF, D), ("ffn_up", FF, D),
                                          ("ffn_down", D, FF))):
            w[p + name + ".weight"] = random_awq(n, k, g, p + name + ".weight", seed=j + 1)
        if cfg.qkv_bias:
            w[p + "attn_q.bias"] = vec(H * HD)
            w[p + "attn_k.bias"] = vec(HKV * HD)
            w[p + "attn_v.bias"] = vec(HKV * HD)
    return cfg, w
