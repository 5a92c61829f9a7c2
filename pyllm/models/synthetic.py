"""Models of real shapes with random weights, built in memory (no file): for speed work on any machine.
write_synthetic_gguf writes one out as a GGUF file, so other runtimes (llama.cpp) can run the very same model.

Speed does not depend on weight values, but it does depend on every byte being real memory: the blocks are
filled with random bytes (tiled from one random buffer, so building an 8B model takes seconds, where
pyllm.synthetic.random_blocks draws every byte) and every fp16 scale is set to a small finite value, so no kernel
meets NaNs or untouched zero pages.

File type "awq" (or awq_g32 / awq_g64 / awq_g256; "awq" is G = 128) is an AutoAWQ "gemm" checkpoint of that shape:
random qweight / qzeros words and small fp16 scales, repacked by the same C++ repacker a loaded AWQ folder goes
through (pyllm/formats/awq/), with fp16 embeddings and lm_head as AutoAWQ leaves them.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..errors import PyllmError, shorten
from ..formats.gguf import BLOCK_INFO, GGMLType
from ..formats.quant import QTensor
from ..safe_io import private_tempfile
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

# Block type of each tensor role per file type, as llama.cpp's quantizer picks them (Q4_K_M and Q5_K_M: Q6_K for the
# output, and for attn_v / ffn_down of the "use_more_bits" layers).
FTYPES = {
    "q4_k_m": dict(default=GGMLType.Q4_K, output=GGMLType.Q6_K, embd=GGMLType.Q4_K, more=GGMLType.Q6_K),
    "q5_k_m": dict(default=GGMLType.Q5_K, output=GGMLType.Q6_K, embd=GGMLType.Q5_K, more=GGMLType.Q6_K),
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
    if qtype in (GGMLType.F16, GGMLType.BF16, GGMLType.F32):
        # seeded: a model written as GGUF (write_synthetic_gguf) must hold what the in-memory build holds
        vals = (torch.rand(n, k, generator=torch.Generator().manual_seed(seed)) - 0.5) * 0.1
        dtype = {GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}.get(qtype, torch.float32)
        data = vals.to(dtype).view(torch.uint8).view(n, -1)
    else:
        data = _pool_bytes(n * row_bytes, seed).view(n, row_bytes)
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


class PlannedTensor(NamedTuple):
    """One tensor of a synthetic model before it is built: what a GGUF header needs, and how to make the data."""

    qtype: GGMLType
    shape: tuple[int, ...]
    build: Callable[[], QTensor]


def synthetic_model(spec: str) -> tuple[ModelConfig, dict]:
    """spec 'SHAPE:FTYPE' (e.g. 'llama3-8b:q4_k_m', 'llama3-8b:awq') -> (ModelConfig, weights dict of QTensors /
    AWQRows)."""
    shape, ftype = check_synthetic_spec(spec)
    if ftype in AWQ_FTYPES:
        return _synthetic_awq(SHAPES[shape], AWQ_FTYPES[ftype])
    cfg, plan = synthetic_plan(spec)
    return cfg, {name: t.build() for name, t in plan.items()}


def synthetic_plan(spec: str) -> tuple[ModelConfig, dict[str, PlannedTensor]]:
    """spec 'SHAPE:FTYPE' of a GGUF file type -> (ModelConfig, name -> PlannedTensor in llama.cpp's tensor order).
    Nothing is built: a writer makes one tensor at a time, so a 17 GB model never sits in memory whole."""
    shape, ftype = check_synthetic_spec(spec)
    if ftype not in FTYPES:
        raise PyllmError(f"synthetic {ftype} models are AutoAWQ checkpoints, not GGUF files; GGUF file types: "
                         f"{', '.join(FTYPES)}")
    L, D, FF, H, HKV, HD, V, base, arch, tied = SHAPES[shape]
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

    plan: dict[str, PlannedTensor] = {}

    def vec(name: str, n: int) -> None:
        plan[name] = PlannedTensor(GGMLType.F32, (n,), partial(_ones, n))

    def mat(name: str, qtype: GGMLType, n: int, k: int, seed: int = 0) -> None:
        qtype = pick(qtype, k)
        plan[name] = PlannedTensor(qtype, (n, k), partial(random_qtensor, qtype, n, k, name, seed))

    def experts(name: str, qtype: GGMLType, e: int, n: int, k: int, seed: int) -> None:
        qtype = pick(qtype, k)
        plan[name] = PlannedTensor(qtype, (e, n, k), partial(random_experts, qtype, e, n, k, name, seed))

    mat("token_embd.weight", ft["embd"], V, D)
    if not tied:
        mat("output.weight", ft["output"], V, D)
    vec("output_norm.weight", D)
    for i in range(L):
        p = f"blk.{i}."
        more = i < L // 8 or i >= 7 * L // 8 or (i - L // 8) % 3 == 2  # llama.cpp's use_more_bits
        vt = ft["more"] if more else ft["default"]
        vec(p + "attn_norm.weight", D)
        vec(p + "ffn_norm.weight", D)
        mat(p + "attn_q.weight", ft["default"], H * HD, D, seed=1)
        mat(p + "attn_k.weight", ft["default"], HKV * HD, D, seed=2)
        mat(p + "attn_v.weight", vt, HKV * HD, D, seed=3)
        mat(p + "attn_output.weight", ft["default"], D, H * HD, seed=4)
        if moe:
            E, FE = moe[0], moe[2]
            vec(p + "attn_q_norm.weight", HD)
            vec(p + "attn_k_norm.weight", HD)
            # the router stays float32, as llama.cpp keeps it; small values so the softmax spreads over experts
            mat(p + "ffn_gate_inp.weight", GGMLType.F32, E, D)
            experts(p + "ffn_gate_exps.weight", ft["default"], E, FE, D, seed=5)
            experts(p + "ffn_up_exps.weight", ft["default"], E, FE, D, seed=6)
            experts(p + "ffn_down_exps.weight", vt, E, D, FE, seed=7)
            continue
        mat(p + "ffn_gate.weight", ft["default"], FF, D, seed=5)
        mat(p + "ffn_up.weight", ft["default"], FF, D, seed=6)
        mat(p + "ffn_down.weight", vt, D, FF, seed=7)
        if cfg.qkv_bias:
            vec(p + "attn_q.bias", H * HD)
            vec(p + "attn_k.bias", HKV * HD)
            vec(p + "attn_v.bias", HKV * HD)
    return cfg, plan


def _ones(n: int) -> QTensor:
    return QTensor(GGMLType.F32, (n,), torch.ones(n).view(torch.uint8), name="norm")


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


# llama.cpp's llama_ftype of each file type (general.file_type), as its quantizer writes it
FILE_TYPE_IDS = {"q4_k_m": 15, "q5_k_m": 17, "q4_0": 2, "q8_0": 7, "q6_k": 18, "f16": 1}
# Token lists that may grow to a shape's vocabulary: convert_hf_to_gguf.py pads a vocabulary smaller than the
# embedding table with "[PADi]" tokens of type UNUSED (5), and a score of 0 where the tokenizer has scores.
_PADDED = {"tokenizer.ggml.tokens": lambda i: f"[PAD{i}]", "tokenizer.ggml.token_type": lambda i: 5,
           "tokenizer.ggml.scores": lambda i: 0.0}


def write_synthetic_gguf(spec: str, path: str | os.PathLike, tokenizer_gguf: str | os.PathLike,
                         progress: Callable[[int, int], None] | None = None) -> Path:
    """Writes the synthetic model ``spec`` as a GGUF file llama.cpp loads: its metadata, the tokenizer.* metadata of
    ``tokenizer_gguf`` (a model file with at most the shape's vocabulary; its token list is padded up to it), and
    the tensors synthetic_model builds, byte for byte. One tensor is in memory at a time (17 GB for
    qwen3-30b-a3b:q4_k_m); the file is written beside ``path`` and renamed when complete. ``progress(done, total)``
    gets the bytes written after each tensor."""
    import gguf

    cfg, plan = synthetic_plan(spec)
    _, ftype = check_synthetic_spec(spec)
    out = Path(path)
    if out.is_dir() or (out.exists() and not out.is_file()):  # renaming over /dev/null would replace the device
        raise PyllmError(f"{out}: is a directory or not a regular file; give the name of a .gguf file to write")
    if not out.parent.is_dir():
        raise PyllmError(f"{out}: the folder {out.parent} does not exist")
    tok = _tokenizer_fields(gguf, tokenizer_gguf, cfg.n_vocab)
    total = sum(_nbytes(t) for t in plan.values())
    tmp = None
    try:
        fd, tmp = private_tempfile(out.parent, f".{out.name}.", ".part")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would make the model readable by its owner only
        os.close(fd)
        w = gguf.GGUFWriter(str(tmp), cfg.arch)
        _add_metadata(gguf, w, cfg, spec, FILE_TYPE_IDS[ftype])
        for key, (value, vtype, sub) in tok.items():
            w.add_key_value(key, value, vtype, sub_type=sub)
        for name, t in plan.items():
            bs, ts = BLOCK_INFO[t.qtype]
            byte_shape = (*t.shape[:-1], t.shape[-1] // bs * ts)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), _nbytes(t), raw_dtype=gguf.GGMLQuantizationType(
                int(t.qtype)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        done = 0
        for t in plan.values():
            q = t.build()
            w.write_tensor_data(q.data.numpy())
            done += q.data.numel()
            del q
            if progress:
                progress(done, total)
        w.close()
        tmp.replace(out)
        tmp = None
    except OSError as e:  # a full disk, a folder that is not writable
        raise PyllmError(f"{out}: cannot write the synthetic model: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return out


def _nbytes(t: PlannedTensor) -> int:
    bs, ts = BLOCK_INFO[t.qtype]
    n = t.shape[-1] // bs * ts
    for d in t.shape[:-1]:
        n *= d
    return n


def _add_metadata(gguf, w, cfg: ModelConfig, spec: str, file_type: int) -> None:
    """The keys llama.cpp's loader reads for the shape's architecture (and pyllm's ModelConfig.from_metadata)."""
    w.add_name(f"synthetic {spec}")
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rope_dim)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_vocab_size(cfg.n_vocab)
    ex = cfg.extra
    if ex.get("expert_count"):
        w.add_expert_count(ex["expert_count"])
        w.add_expert_used_count(ex["expert_used_count"])
        w.add_expert_feed_forward_length(ex["expert_ff"])
        w.add_expert_weights_norm(ex["expert_weights_norm"])


def _tokenizer_fields(gguf, src: str | os.PathLike, n_vocab: int) -> dict:
    """key -> (value, GGUF type, array element type) of every tokenizer.* field of GGUF file ``src``, the token
    lists padded to ``n_vocab``."""
    try:
        reader = gguf.GGUFReader(str(src))
    except (OSError, ValueError) as e:  # gguf-py's reader says ValueError for a file that is not GGUF
        raise PyllmError(f"{src}: cannot read its tokenizer: {e}") from None
    fields = {}
    for f in reader.fields.values():
        if f.name.startswith("tokenizer."):
            vtype = f.types[0]
            fields[f.name] = [f.contents(), vtype, f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None]
    tokens = fields.get("tokenizer.ggml.tokens", [None])[0]
    if not isinstance(tokens, list) or not tokens:
        raise PyllmError(f"{src}: has no tokenizer.ggml.tokens to give the synthetic model a tokenizer")
    if len(tokens) > n_vocab:
        raise PyllmError(f"{src}: its tokenizer has {len(tokens)} tokens, more than the synthetic model's vocabulary "
                         f"of {n_vocab}; give a model file with at most {n_vocab} tokens")
    for key, pad in _PADDED.items():
        if key in fields:
            have = fields[key][0]
            fields[key][0] = have + [pad(i) for i in range(len(have), n_vocab)]
    return {k: tuple(v) for k, v in fields.items()}
