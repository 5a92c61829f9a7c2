"""The CUDA side in Python: weights to VRAM in their quantized form, a CUDA (linear, embed) pair for the model,
and a llama-family decoder whose one-token step is captured once in a CUDA graph.

Not yet reached from ``pyllm.load(device="cuda")``; the kernels come from ``pyllm._C`` built with CUDA.

Paths, as the physics dictates:
- decode (<= 8 rows): fused dequantize-in-GEMV (csrc/cuda/gemv.cu), weights read once per token, quantized;
- prefill: dequantize a weight to fp16 (csrc/cuda/dequant.cu) and let cuBLAS (torch.matmul) use the tensor cores;
- attention at decode: split-K kernel over the fp16 cache (csrc/cuda/attention.cu); prefill: SDPA.
"""

from __future__ import annotations

import math
import sys
from typing import Callable

import torch

from .errors import PyllmError
from .gguf import GGMLType

_FLOAT = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
GEMV_MAX_M = 8
_kernels = None


def kernels():
    """The module holding cuda_gemv / cuda_dequantize / cuda_attn_decode (built on first call)."""
    global _kernels
    if _kernels is not None:
        return _kernels
    if not torch.cuda.is_available():
        raise PyllmError("pyllm: CUDA is not available (torch.cuda.is_available() is False)")
    from . import _ext

    mod = _ext.load()
    if not hasattr(mod, "cuda_gemv"):
        raise PyllmError("pyllm: the C++ extension was built without its CUDA kernels (nvcc or a CUDA build of "
                         "torch was missing when it was compiled)")
    _kernels = mod
    return _kernels


# ---- weights -------------------------------------------------------------------------------------------------
def upload(weights: dict, device: str | torch.device = "cuda", progress: bool = True) -> dict:
    """QTensors -> the same QTensors with their raw blocks in VRAM (no fp16 copy of the model).

    Each weight gets its own allocation, so every row block starts 256-byte aligned (the Q4_K/Q5_K GEMV loads
    16 bytes at a time). A one-line progress bar goes to stderr.
    """
    from .quant import QTensor

    total = sum(w.nbytes for w in weights.values())
    done, out, last = 0, {}, -1
    for name, w in weights.items():
        out[name] = QTensor(w.qtype, w.shape, w.data.to(device, non_blocking=False).contiguous(), w.name)
        done += w.nbytes
        pct = int(100 * done / max(total, 1))
        if progress and sys.stderr.isatty() and pct != last:
            last = pct
            print(f"\rpyllm: uploading weights {done / 2**30:6.2f} / {total / 2**30:.2f} GiB ({pct}%)", end="",
                  file=sys.stderr, flush=True)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    return out


def vram_report(weights: dict | None = None, device: int | None = None) -> dict:
    """Bytes: weights (quantized, as stored), allocated / reserved by torch, free / total on the device."""
    dev = torch.cuda.current_device() if device is None else device
    free, total = torch.cuda.mem_get_info(dev)
    return {
        "device": torch.cuda.get_device_name(dev),
        "weights": sum(w.nbytes for w in weights.values()) if weights else 0,
        "allocated": torch.cuda.memory_allocated(dev),
        "reserved": torch.cuda.memory_reserved(dev),
        "free": free,
        "total": total,
    }


# ---- linear / embed ------------------------------------------------------------------------------------------
def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [T, K] f32 (CUDA) @ W[N, K]^T -> [T, N] f32; W a QTensor in VRAM."""
    if w.qtype in _FLOAT:
        wt = w.typed()
        return torch.nn.functional.linear(x.to(wt.dtype), wt).float()
    k = kernels()
    qt = int(w.qtype)
    if x.shape[0] <= GEMV_MAX_M and k.cuda_gemv_supported(qt):
        return k.cuda_gemv(w.data, qt, x.contiguous())
    if k.cuda_dequant_supported(qt):
        wd = k.cuda_dequantize(w.data, qt, w.shape[1], None, True, True)  # [N, K] fp16, then cuBLAS
        return (x.to(torch.float16) @ wd.T).float()
    return x @ w.dequantize(torch.float32).T  # torch reference dequantizer, on the GPU


def embed(w, ids: torch.Tensor, check_ids: bool = True) -> torch.Tensor:
    """Rows ids [T] of W -> [T, K] f32, dequantizing only those rows. check_ids=False for graph capture."""
    k = kernels()
    qt = int(w.qtype)
    ids = ids.reshape(-1).to(device=w.data.device, dtype=torch.long)
    if k.cuda_dequant_supported(qt) and w.shape[1] % 8 == 0:
        return k.cuda_dequantize(w.data, qt, w.shape[1], ids, False, check_ids)
    return w.rows(ids)


def linear_functions() -> tuple[Callable, Callable]:
    """(linear, embed) with the signature of pyllm.linear.linear_functions, for CUDA-resident weights."""
    return linear, embed


# ---- decoder ------------------------------------------------------------------------------------------------
class CudaDecoder:
    """A llama-family decoder on the GPU: prefill with cuBLAS, decode through one captured CUDA graph.

    Buffers: k, v (n_layer, n_kv_head, max_seq, head_dim) fp16; cos, sin (max_seq, rope_dim/2) f32.
    The graph's inputs are device tensors (token, position), so one capture serves every position, and
    greedy decoding can chain replays with no host sync at all (``greedy``).
    """

    def __init__(self, cfg, weights: dict, max_seq: int):
        from .models.llama import rope_tables  # the same tables the CPU decoder uses

        if cfg.sliding_window:
            raise PyllmError("CudaDecoder: sliding-window attention is not supported yet")
        self.cfg, self.w, self.max_seq = cfg, weights, max_seq
        dev = next(iter(weights.values())).data.device
        self.device = dev
        self.vec = {n: t.dequantize().reshape(-1).to(dev) for n, t in weights.items() if len(t.shape) == 1}
        ff = self.vec.get("rope_freqs.weight")
        cos, sin = rope_tables(cfg, max_seq, freq_factors=None if ff is None else ff.cpu())
        self.cos, self.sin = cos.to(dev), sin.to(dev)
        shape = (cfg.n_layer, cfg.n_kv_head, max_seq, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=torch.float16, device=dev)
        self.v = torch.zeros(shape, dtype=torch.float16, device=dev)
        self.output = weights.get("output.weight", weights["token_embd.weight"])
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.graph = None

    def _forward(self, tokens: torch.Tensor, pos: torch.Tensor, start_pos: int | None, length: torch.Tensor | None,
                 check_ids: bool = True) -> torch.Tensor:
        """tokens, pos: [T] int64 on the device. Prefill: start_pos (host int). Decode (T = 1): length int32 [1]."""
        from .models.llama import apply_rope, rms_norm

        cfg, w, vec = self.cfg, self.w, self.vec
        t = tokens.shape[0]
        x = embed(w["token_embd.weight"], tokens, check_ids)  # [T, D]
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            h = rms_norm(x, vec[p + "attn_norm.weight"], cfg.rms_eps)
            q, k, v = linear(h, w[p + "attn_q.weight"]), linear(h, w[p + "attn_k.weight"]), linear(h, w[p + "attn_v.weight"])
            if cfg.qkv_bias:
                q, k, v = q + vec[p + "attn_q.bias"], k + vec[p + "attn_k.bias"], v + vec[p + "attn_v.bias"]
            q = q.view(t, cfg.n_head, cfg.head_dim)
            k = k.view(t, cfg.n_kv_head, cfg.head_dim)
            v = v.view(t, cfg.n_kv_head, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, vec[p + "attn_q_norm.weight"], cfg.rms_eps)
                k = rms_norm(k, vec[p + "attn_k_norm.weight"], cfg.rms_eps)
            q = apply_rope(q, cos, sin, cfg.rope_style, cfg.rope_dim)
            k = apply_rope(k, cos, sin, cfg.rope_style, cfg.rope_dim)
            self.k[i].index_copy_(1, pos, k.transpose(0, 1).to(torch.float16))
            self.v[i].index_copy_(1, pos, v.transpose(0, 1).to(torch.float16))
            if length is not None:
                a = kernels().cuda_attn_decode(q[0].contiguous(), self.k[i], self.v[i], length, self.scale)
                a = a.reshape(1, cfg.n_head * cfg.head_dim)
            else:
                a = self._prefill_attention(i, q, k, v, start_pos)
            x = x + linear(a, w[p + "attn_output.weight"])
            h = rms_norm(x, vec[p + "ffn_norm.weight"], cfg.rms_eps)
            g, u = linear(h, w[p + "ffn_gate.weight"]), linear(h, w[p + "ffn_up.weight"])
            x = x + linear(torch.nn.functional.silu(g) * u, w[p + "ffn_down.weight"])
        x = rms_norm(x[-1:], vec["output_norm.weight"], self.cfg.rms_eps)
        return linear(x, self.output)  # [1, n_vocab]

    def _prefill_attention(self, i: int, q, k, v, start_pos: int) -> torch.Tensor:
        t, h = q.shape[0], self.cfg.n_head
        if start_pos == 0:  # a fresh prompt attends to its own fp32 keys, as the CPU decoder does
            kk, vv = k.transpose(0, 1), v.transpose(0, 1)
        else:
            kk = self.k[i, :, :start_pos + t].float()
            vv = self.v[i, :, :start_pos + t].float()
        s = kk.shape[1]
        qpos = torch.arange(start_pos, start_pos + t, device=q.device)[:, None]
        mask = torch.arange(s, device=q.device)[None, :] <= qpos
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kk[None], vv[None], attn_mask=mask, scale=self.scale, enable_gqa=h != kk.shape[0])[0]
        return out.transpose(0, 1).reshape(t, h * self.cfg.head_dim)

    def prefill(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """tokens [T] at positions start_pos.. -> logits [n_vocab] f32 of the last one."""
        tokens = tokens.to(self.device, torch.long)
        pos = torch.arange(start_pos, start_pos + tokens.shape[0], device=self.device)
        if start_pos + tokens.shape[0] > self.max_seq:
            raise PyllmError(f"context of {self.max_seq} positions cannot hold {start_pos + tokens.shape[0]}")
        return self._forward(tokens, pos, start_pos, None)[0]

    def decode_eager(self, token: int, pos: int) -> torch.Tensor:
        """One token without the graph (the reference the graph is checked against)."""
        tok = torch.tensor([token], device=self.device)
        p = torch.tensor([pos], device=self.device)
        return self._forward(tok, p, None, (p + 1).to(torch.int32))[0]

    # -- CUDA graph ---------------------------------------------------------------------------------------
    def _step_body(self) -> torch.Tensor:
        self.g_len.copy_(self.g_pos + 1)
        logits = self._forward(self.g_tok, self.g_pos, None, self.g_len, check_ids=False)
        nxt = logits.argmax(-1)  # greedy chaining: the next replay reads its token from here
        self.g_next.copy_(nxt)
        return logits

    def capture(self) -> None:
        """Capture the decode step once (static shapes; token and position are device values)."""
        dev = self.device
        self.g_tok = torch.zeros(1, dtype=torch.long, device=dev)
        # warm-up runs really write the KV cache at g_pos: use the last slot, which any real token writes
        # before attention can read it
        self.g_pos = torch.full((1,), self.max_seq - 1, dtype=torch.long, device=dev)
        self.g_len = torch.ones(1, dtype=torch.int32, device=dev)
        self.g_next = torch.zeros(1, dtype=torch.long, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm up: lazy init, allocator pools, cuBLAS handles
            for _ in range(2):
                self._step_body()
        torch.cuda.current_stream(dev).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.g_logits = self._step_body()
        self.graph = g

    def step(self, token: int, pos: int) -> torch.Tensor:
        """Logits [n_vocab] (a view of the graph's output buffer, overwritten by the next step)."""
        if self.graph is None:
            self.capture()
        self.g_tok.fill_(token)
        self.g_pos.fill_(pos)
        self.graph.replay()
        return self.g_logits[0]

    def greedy(self, token: int, pos: int, n: int) -> list[int]:
        """n greedy tokens after `token` at `pos`, replaying the graph with no host sync until the end."""
        if self.graph is None:
            self.capture()
        if pos + n > self.max_seq:
            raise PyllmError(f"context of {self.max_seq} positions cannot hold {pos + n}")
        out = torch.empty(n, dtype=torch.long, device=self.device)
        self.g_tok.fill_(token)
        self.g_pos.fill_(pos)
        for i in range(n):
            self.graph.replay()
            out[i:i + 1].copy_(self.g_next)
            self.g_tok.copy_(self.g_next)
            self.g_pos.add_(1)
        return out.tolist()
