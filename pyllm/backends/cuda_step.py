"""The CUDA backend's one-token step (``CudaDecodeStep``) and the KV cache as its attention kernel reads it.

The step runs csrc/cuda/step.cu's row kernels between the GEMVs, or, for a model they do not take, the model's own
torch forward (models/transformer.py forward_on_device) with the position held on the device: token and position
live in device buffers, so one captured graph serves every position.  pyllm/backends/cuda.py (the backend) builds
it; nothing here imports the backend.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import PyllmError
from ..ops import GEMV_MAX_M

if TYPE_CHECKING:
    from .cuda import CudaBackend

HEAD_DIMS = (64, 128, 256)  # head sizes csrc/cuda/attention.cu is instantiated for
_BLOCK_KINDS = ("q8_0", "q4_0")
_FLOAT_KINDS = ("f32", "f16", "bf16")


# ---- the KV cache as the attention kernel reads it -------------------------------------------------------------
@dataclass
class AttnPart:
    """One cache part (keys or values) of one layer, in the arguments cuda_attn_decode takes."""
    data: torch.Tensor            # [Hkv, max_seq, hd] f32/f16/bf16, or uint8 [Hkv, max_seq, row_bytes]
    block: str                    # "" for float rows, else "q8_0" / "q4_0"
    sink: torch.Tensor | None     # [Hkv, hd] f32 exact position-0 row (storage basis), or None
    mu: torch.Tensor | None       # [Hkv, hd] f32 (stored = ((x - mu) / scale) R^T), or None
    scale: torch.Tensor | None    # [Hkv, hd] f32 (keys), or None
    rot: torch.Tensor | None      # [hd, hd] f32 R, or None
    rot_t: torch.Tensor | None = None  # R^T, contiguous: the operand kv_cache.py multiplies by (same rounding)

    def __post_init__(self):
        if self.rot is not None and self.rot_t is None:
            self.rot_t = self.rot.T.contiguous()  # R is a fixed Hadamard matrix: a copy stays valid


def attn_part(layout, layer: int) -> AttnPart:
    """``layer``'s slice of a kv.storage_layout() part (views: the cache's own live tensors)."""
    if layout.block not in _FLOAT_KINDS + _BLOCK_KINDS:
        raise PyllmError(f"KV cache rows of type {layout.block!r} have no CUDA attention")

    def row(t):
        return None if t is None else t[layer, :, 0]

    return AttnPart(layout.data[layer], "" if layout.block in _FLOAT_KINDS else layout.block, row(layout.sink),
                    row(layout.mu), row(layout.scale), layout.rot)


def to_storage(part: AttnPart, x: torch.Tensor) -> torch.Tensor:
    """x [Hkv, hd] (model basis) -> the part's storage basis ((x - mu) / scale) R^T, as kv_cache.py defines it."""
    if part.mu is not None:
        x = x - part.mu
    if part.scale is not None:
        x = x / part.scale
    return x if part.rot is None else x @ part.rot_t


def encode_rows(block: str, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Storage-basis rows y [Hkv, hd] -> what the part stores: ``dtype`` rows, or q8_0 / q4_0 blocks (uint8
    [Hkv, row_bytes]) quantized by kv_cache.py's own functions (no host sync: capturable)."""
    if not block:
        return y.to(dtype)
    from ..runtime import kv_cache

    hkv, hd = y.shape
    quant = kv_cache.quantize_q8_0 if block == "q8_0" else kv_cache.quantize_q4_0
    c, d = quant(y.reshape(hkv, hd // kv_cache.QK, kv_cache.QK))
    return torch.cat((d.unsqueeze(-1).view(torch.uint8), c.view(torch.uint8)), -1).reshape(hkv, -1)


def attend_parts(K, q: torch.Tensor, kp: AttnPart, vp: AttnPart, length: torch.Tensor, scale: float,
                 window: int) -> torch.Tensor:
    """One query row q [H, hd] (model basis) over a layer's stored rows 0..length-1 (length: device int32 [1]):
    the query mapped into the keys' storage basis, csrc/cuda/attention.cu, the output mapped back ([H, hd])."""
    group = q.shape[0] // kp.data.shape[0]
    qs = q
    if kp.scale is not None:
        qs = qs * kp.scale.repeat_interleave(group, 0)
    if kp.rot is not None:
        qs = qs @ kp.rot_t
    a = K.cuda_attn_decode(qs.contiguous(), kp.data, vp.data, length, scale, kp.block, vp.block, kp.sink, vp.sink,
                           window, 0.0)
    if vp.rot is not None:
        a = a @ vp.rot
    if vp.mu is not None:
        a = a + vp.mu.repeat_interleave(group, 0)
    return a


def cache_problem(kv) -> str | None:
    """Why csrc/cuda/attention.cu cannot read ``kv``'s rows (then the torch forms do), or None."""
    if not hasattr(kv, "storage_layout"):
        return "the cache predates the backend seam"
    if kv.head_dim not in HEAD_DIMS:
        return f"head_dim {kv.head_dim} (the attention kernel has {HEAD_DIMS})"
    for p in kv.storage_layout():
        if p.block not in _FLOAT_KINDS + _BLOCK_KINDS:
            return f"cache rows {p.block!r}"
        if getattr(p, "table", None) is not None:
            return "a paged cache (the CUDA kernels read contiguous rows)"
    return None


def cache_parts(kv) -> list[tuple[AttnPart, AttnPart]]:
    """Every layer's (keys, values) of ``kv`` as the attention kernel reads them: views of the cache's live tensors,
    made once per cache storage."""
    key = kv.storage_layout()[0].data
    hit = getattr(kv, "_cuda_parts", None)
    if hit is None or hit[0] is not key:
        k_lay, v_lay = kv.storage_layout()
        hit = (key, [(attn_part(k_lay, i), attn_part(v_lay, i)) for i in range(kv.n_layer)])
        kv._cuda_parts = hit
    return hit[1]


def fused_decode_problem(model, kv) -> str | None:
    """Why the CUDA step cannot run ``model`` over ``kv`` (then the torch path does), or None."""
    if not hasattr(model, "spec") or not hasattr(model, "forward_on_device"):
        return "the model predates the backend seam"
    if getattr(model.spec, "n_expert", 0):
        return "a mixture-of-experts model (the step has no expert routing)"
    gaps = model.spec.fused_step_gaps("cuda") if hasattr(model.spec, "fused_step_gaps") else ()
    if gaps:
        return f"architecture fields the step does not compute: {', '.join(gaps)}"
    return cache_problem(kv)


ROW_KERNELS = ("cuda_gemv_q", "cuda_gemv_q_parts", "cuda_quantize_act", "cuda_residual_norm_quant", "cuda_act_quant",
               "cuda_rope_store")


def row_kernels_problem(kernels, model, act: str) -> str | None:
    """Why CudaDecodeStep cannot use csrc/cuda/step.cu's row kernels for ``model`` (then the model's forward runs), or
    None: they need every row length a multiple of 32 (the int8 codes' blocks) and a SiLU or tanh-GELU MLP.
    PYLLM_CUDA_ROW_KERNELS=0 asks for the model's forward."""
    if os.environ.get("PYLLM_CUDA_ROW_KERNELS", "1") == "0":
        return "PYLLM_CUDA_ROW_KERNELS=0"
    missing = [n for n in ROW_KERNELS if not hasattr(kernels, n)]
    if missing:
        return f"the extension lacks {', '.join(missing)}"
    cfg = model.cfg
    n_ff = model.w["blk.0.ffn_gate.weight"].shape[0] if "blk.0.ffn_gate.weight" in model.w else 0
    for what, n in (("n_embd", cfg.n_embd), ("n_head * head_dim", cfg.n_head * cfg.head_dim), ("n_ff", n_ff)):
        if n <= 0 or n % 32:
            return f"{what} = {n} is not a positive multiple of 32"
    if act not in ("silu", "gelu_tanh"):
        return f"activation {act!r}"
    return None


def _plain_float(part: AttnPart) -> bool:
    return not part.block and part.sink is None and part.mu is None and part.scale is None and part.rot is None


def codes_value(xq: torch.Tensor, xds: torch.Tensor) -> torch.Tensor:
    """What int8 activation codes xq [M, K] (scales xds [M, K/32, 2], cuda_quantize_act's) stand for: each code
    times its block's d, float32 [M, K]."""
    m, k = xq.shape
    return (xq.float().view(m, k // 32, 32) * xds[:, :, :1]).view(m, k)


def output_gemv(K, w: torch.Tensor, qt: int, x: torch.Tensor, xq: torch.Tensor, xds: torch.Tensor,
                out2: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ W^T for the output projection, whose activation error goes straight into the logits: from x's int8
    codes and the codes of what they miss, x - codes_value, each block scaled anew, so the two sums add up to x's
    products within ~1/127 of the int8 rounding, as the CPU's 16-bit output activations do (csrc/cpu/cpu_impl.h
    Q16Row: on SmolLM2 the int8 rounding there was a quarter of the decode path's KL from float32).  xq [2T, K] /
    xds [2T, K/32, 2] hold x's codes in their first T rows; the residual's go in the other T, and one GEMV launch
    (2T <= GEMV_MAX_M) reads W once for both.  out2 [2T, N] / out [T, N]: buffers to fill, for graph capture."""
    t = x.shape[0]
    K.cuda_quantize_act(x - codes_value(xq[:t], xds[:t]), xq[t:], xds[t:])
    y = K.cuda_gemv_q(w, qt, xq, xds, out2)
    return torch.add(y[:t], y[t:], out=out)


class StepBuffers:
    """The fused step's activations for ``rows`` decode rows (one per sequence), allocated once (a captured graph
    replays into the same memory): each row and the int8 codes (xq, xds) the GEMV reads of the rows that feed one.
    The output projection runs in chunks of up to GEMV_MAX_M / 2 rows (output_gemv: each with the codes of what
    its rows' codes miss): oq / ods / logits2 hold one chunk's 2 x chunk rows each."""

    def __init__(self, cfg, n_ff: int, n_vocab: int, dev: torch.device, rows: int = 1):
        def f(n):
            return torch.zeros(rows, n, dtype=torch.float32, device=dev)

        def codes(n):
            return (torch.zeros(rows, n, dtype=torch.int8, device=dev),
                    torch.zeros(rows, n // 32, 2, dtype=torch.float32, device=dev))

        d, qd, kvd = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        self.rows = rows
        self.x, self.h, self.o, self.m = f(d), f(d), f(d), f(d)
        self.q, self.k, self.v, self.g, self.u, self.f = f(qd), f(kvd), f(kvd), f(n_ff), f(n_ff), f(n_ff)
        self.a = f(qd)  # the attention rows, gathered (several sequences)
        self.qr = torch.zeros(rows, cfg.n_head, cfg.head_dim, dtype=torch.float32, device=dev)
        self.logits = f(n_vocab)
        self.hq, self.hds = codes(d)
        self.aq, self.ads = codes(qd)
        self.fq, self.fds = codes(n_ff)
        self.chunk = min(rows, GEMV_MAX_M // 2)
        n = -(-rows // self.chunk)
        # per chunk: the final norm's codes, then those of what they miss (output_gemv), and its two halves' logits
        self.oq = torch.zeros(n, 2 * self.chunk, d, dtype=torch.int8, device=dev)
        self.ods = torch.zeros(n, 2 * self.chunk, d // 32, 2, dtype=torch.float32, device=dev)
        self.logits2 = torch.zeros(n, 2 * self.chunk, n_vocab, dtype=torch.float32, device=dev)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, style: str, rope_dim: int) -> torch.Tensor:
    """x [H, hd] rotated at one position: c, s [rope_dim/2] (models/decoder.py apply_rope for one row)."""
    from ..models.decoder import apply_rope

    return apply_rope(x[None], c[None], s[None], style, rope_dim)[0]


class GraphPolicy:
    """When the step runs eagerly and when it captures / replays its CUDA graph.

    Position 0 always runs eagerly (it writes the sink rows and attends to the fresh value, as the CPU step
    does); the first call past it captures the graph (its warm-up runs write that very token's K/V, so they are
    harmless) and every later call replays it.  PYLLM_CUDA_GRAPH=0 turns graphs off; a failed capture falls back
    to eager for good and remembers why."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = os.environ.get("PYLLM_CUDA_GRAPH", "1") != "0" if enabled is None else enabled
        self.captured = False
        self.failed: str | None = None
        self.replays = 0
        self.eager_calls = 0

    def action(self, pos: int) -> str:
        """"eager", "capture" or "replay" for a step at ``pos``."""
        if pos == 0 or not self.enabled or self.failed:
            return "eager"
        return "replay" if self.captured else "capture"

    def record(self, action: str, error: BaseException | None = None) -> None:
        if error is not None:
            self.failed = f"{type(error).__name__}: {error}"
        elif action == "capture":
            self.captured = True
        elif action == "replay":
            self.replays += 1
        if action == "eager" or error is not None:
            self.eager_calls += 1


class CudaDecodeStep:
    """One token through the model on the GPU, bound to one KV cache; see the module docstring."""

    def __init__(self, backend: CudaBackend, model, kv, layers: range | None = None):
        """``layers``: a run of the model's layers (a split model's GPU side, ``kv`` holding theirs alone): the step
        then enters with a hidden state and leaves one (``hidden``), no embedding, no head."""
        self.b, self.K, self.kv, self.model = backend, backend.K, kv, model
        cfg = model.cfg
        self.cfg, self.w, self.vec, self.out_w = cfg, model.w, model.vec, model.output
        # LoRA terms by tensor name (Decoder.attach_lora), each added after its matrix's GEMV in torch ops
        self.lora = getattr(model, "lora_terms", None) or {}
        self.lora_names = {id(w): n for n, w in model.w.items() if n in self.lora and n != "token_embd.weight"}
        self.n_vocab = cfg.n_vocab
        spec = self.spec = model.spec
        self.bias, self.qk_norm, self.post_norms = spec.qkv_bias, spec.qk_norm, spec.post_norms
        self.embd_scale, self.act, self.final_softcap = spec.embd_scale, spec.act, spec.final_softcap
        dev = backend.device
        self.tables = [(c.to(dev).contiguous(), s.to(dev).contiguous()) for c, s in model.rope_tables]
        n = cfg.n_layer
        self.layers = range(n) if layers is None else layers
        self.whole = layers is None  # embedding to logits; else a run's hidden state in and out
        self.layer_rope = list(model.layer_rope)
        self.layer_window = [layer.window for layer in spec.layers]
        self.scale = spec.attn_scale
        k_lay, v_lay = kv.storage_layout()
        self.k_dtype = k_lay.data.dtype
        self.v_dtype = v_lay.data.dtype
        # by the model's layer number; the cache's own layers are numbered from 0
        self.parts = dict(zip(self.layers, cache_parts(kv)))
        self.group = cfg.n_head // cfg.n_kv_head
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.len = torch.ones(1, dtype=torch.int32, device=dev)
        self.x_in = torch.zeros(1, cfg.n_embd, dtype=torch.float32, device=dev)  # a run's entering hidden state
        self.policy = GraphPolicy()
        self.graph = None
        self.g_logits = self.g_top = None
        self.row_kernels_problem = row_kernels_problem(self.K, model, self.act)
        if self.row_kernels_problem is None:
            from .cpu import decode_arch

            self.arch = decode_arch(self.K, spec, self.layer_rope)  # the row kernels' one struct (common/arch.h)
            self.buf = StepBuffers(cfg, model.w["blk.0.ffn_gate.weight"].shape[0], self.n_vocab, dev)
            # Layers whose new K/V rows one kernel writes: plain float rows with no storage transform or sink row.
            self.store_kernel = {i: all(_plain_float(part) for part in pair) for i, pair in self.parts.items()}
        # Rows of a batched pass (decode_rows) are this step's own bit for bit where every product is an int8-code
        # GEMV, whose row sums do not depend on the number of rows; cuBLAS (a type without a GEMV kernel) and the
        # LoRA terms' matmuls may pick other kernels for other row counts, so those models decode one at a time.
        self.rows_exact = (self.row_kernels_problem is None and not self.lora
                           and all(backend.gemv_qtype(t) is not None for n, t in model.w.items()
                                   if n.startswith("blk.") and n.endswith(".weight") and len(t.shape) == 2)
                           and backend.gemv_qtype(self.out_w) is not None)

    # -- the step's math (device tensors only: capturable) --------------------------------------------------
    def _body(self, first: bool) -> torch.Tensor:
        """The step's logits [1, n_vocab] on the GPU: the row kernels, or the model's own forward with the position
        held on the device (models/transformer.py forward_on_device: the definition the row kernels follow, and the
        path for a model they do not take, row_kernels_problem).  Position 0 goes through the forward's host
        form, which attends to the fresh row as a prompt does."""
        if self.row_kernels_problem:
            return self.model.forward_on_device(self.tok, 0 if first else self.pos, self.kv)
        return self._body_kernels(first)

    def _gemv(self, wt, rows: torch.Tensor, codes: tuple, out: torch.Tensor) -> torch.Tensor:
        """out [1, N] = rows @ W^T: from rows' int8 codes (xq, xds) where W's type has a GEMV kernel, else through
        the backend's linear (its dequantize path)."""
        qt = self.b.gemv_qtype(wt)
        if qt is not None:
            return self.K.cuda_gemv_q(wt.data, qt, codes[0], codes[1], out)
        out.copy_(self.b.linear(rows, wt))
        return out

    def _lora(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += the LoRA term of matrix ``name`` on rows x (none: out as is), in place: the step's buffers stay
        the ones a captured graph replays into."""
        t = self.lora.get(name)
        if t is not None:
            out.add_((x @ t.a.T) @ t.bt)
        return out

    def _embed(self, tok: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding rows [M, D] with their LoRA term (tok: device int64 [M])."""
        x = self.b.embed(self.w["token_embd.weight"], tok, check_ids=False)
        t = self.lora.get("token_embd.weight")
        return x if t is None else x + t.a.index_select(0, tok) @ t.bt

    def _gemvs(self, pairs, rows: torch.Tensor, codes: tuple) -> list[torch.Tensor]:
        """_gemv over (weight, out) pairs that read the same codes: consecutive weights of one type with a GEMV
        kernel share one launch (``cuda_gemv_q_parts``: q/k/v, gate/up), the others go one by one."""
        outs: list[torch.Tensor] = []
        i = 0
        while i < len(pairs):
            qt = self.b.gemv_qtype(pairs[i][0])
            j = i + 1
            while qt is not None and j < len(pairs) and self.b.gemv_qtype(pairs[j][0]) == qt:
                j += 1
            if qt is None:
                outs.append(self._gemv(pairs[i][0], rows, codes, pairs[i][1]))
            else:
                outs += self.K.cuda_gemv_q_parts([w.data for w, _ in pairs[i:j]], qt, codes[0], codes[1],
                                                 [o for _, o in pairs[i:j]])
            i = j
        return outs

    def _body_kernels(self, first: bool, seqs: list | None = None) -> torch.Tensor:
        """The step through csrc/cuda/step.cu's row kernels: norms, activations and RoPE fused with the int8 codes
        the next GEMV reads (the attention's merge writes its output's), q/k/v and gate/up one GEMV launch each
        where their types match (~10 launches per layer).  The residual branch of each block is added by the next
        norm's kernel, so x is touched once per block.

        ``seqs``: the steps (this one first) whose decode rows run together, one row each (at most GEMV_MAX_M):
        every GEMV reads its weights once for all of them, and each row's attention runs over its own sequence's
        cache with its own position.  Each row is what its sequence's step alone computes, bit for bit: the GEMV
        and row kernels sum a row in one order whatever the number of rows (csrc/cuda/gemv.cu, step.cu)."""
        seqs = seqs or [self]
        w, vec, K, arch = self.w, self.vec, self.K, self.arch
        B = self.buf if len(seqs) == 1 else self.b.batch_buffers(self, len(seqs))
        H, hd = self.cfg.n_head, self.cfg.head_dim
        for st in seqs:
            st.len.copy_(st.pos + 1)
        if not self.whole:  # a run of layers (one sequence): the hidden state it enters with
            B.x.copy_(self.x_in)
        else:
            B.x.copy_(self._embed(self.tok if len(seqs) == 1 else torch.cat([st.tok for st in seqs])))
            if self.embd_scale:
                B.x.mul_(self.embd_scale)
        branch, post = None, None  # the block output not yet added to x, and its post-norm weights
        for i in self.layers:
            p = f"blk.{i}."
            K.cuda_residual_norm_quant(arch, B.x, branch, post, vec[p + "attn_norm.weight"], B.h, B.hq, B.hds)
            hc = (B.hq, B.hds)
            q, k, v = self._gemvs([(w[p + "attn_q.weight"], B.q), (w[p + "attn_k.weight"], B.k),
                                   (w[p + "attn_v.weight"], B.v)], B.h, hc)
            q, k, v = (self._lora(p + n, B.h, o) for n, o in (("attn_q.weight", q), ("attn_k.weight", k),
                                                               ("attn_v.weight", v)))
            rows = []
            for r, st in enumerate(seqs):  # attention: each row over its own cache (and the codes of its output)
                qr, kr, vr, aq, ads = q[r:r + 1], k[r:r + 1], v[r:r + 1], B.aq[r:r + 1], B.ads[r:r + 1]
                if st.store_kernel[i] and not first:
                    kp, vp = st.parts[i]
                    bias, norms = self._qk_extras(i)
                    c_tab, s_tab = self.tables[self.layer_rope[i]] if self.layer_rope[i] >= 0 else (None, None)
                    K.cuda_rope_store(arch, i, qr, kr, vr, *bias, *norms, c_tab, s_tab, st.pos, kp.data, vp.data,
                                      B.qr[r])
                    rows.append(K.cuda_attn_decode(B.qr[r], kp.data, vp.data, st.len, self.scale, "", "", None, None,
                                                   self.layer_window[i], 0.0, aq, ads).reshape(1, H * hd))
                else:
                    rows.append(st._attend_torch(i, qr, kr, vr, first).reshape(1, H * hd))
                    K.cuda_quantize_act(rows[-1], aq, ads)
            a = rows[0] if len(rows) == 1 else torch.cat(rows, out=B.a)
            branch = self._gemv(w[p + "attn_output.weight"], a, (B.aq, B.ads), B.o)
            branch = self._lora(p + "attn_output.weight", a, branch)
            post = vec[p + "post_attention_norm.weight"] if self.post_norms else None
            K.cuda_residual_norm_quant(arch, B.x, branch, post, vec[p + "ffn_norm.weight"], B.h, B.hq, B.hds)
            g, u = self._gemvs([(w[p + "ffn_gate.weight"], B.g), (w[p + "ffn_up.weight"], B.u)], B.h, (B.hq, B.hds))
            g, u = self._lora(p + "ffn_gate.weight", B.h, g), self._lora(p + "ffn_up.weight", B.h, u)
            K.cuda_act_quant(arch, g, u, B.f, B.fq, B.fds)
            branch = self._lora(p + "ffn_down.weight", B.f, self._gemv(w[p + "ffn_down.weight"], B.f, (B.fq, B.fds),
                                                                        B.m))
            post = vec[p + "post_ffw_norm.weight"] if self.post_norms else None
        if not self.whole:  # the last block's output into x by the same kernel (its norm of x goes unused)
            K.cuda_residual_norm_quant(arch, B.x, branch, post, vec[p + "ffn_norm.weight"], B.h, B.hq, B.hds)
            return B.x
        qt = self.b.gemv_qtype(self.out_w)
        out_norm = vec["output_norm.weight"]
        if qt is None:
            K.cuda_residual_norm_quant(arch, B.x, branch, post, out_norm, B.h, B.hq, B.hds)
            logits = self._gemv(self.out_w, B.h, (B.hq, B.hds), B.logits)
        else:
            m, c = B.rows, B.chunk
            if m <= c:  # one chunk: the norm writes its codes where output_gemv reads them
                K.cuda_residual_norm_quant(arch, B.x, branch, post, out_norm, B.h, B.oq[0, :m], B.ods[0, :m])
            else:
                K.cuda_residual_norm_quant(arch, B.x, branch, post, out_norm, B.h, B.hq, B.hds)
            for n, a in enumerate(range(0, m, c)):
                t = min(c, m - a)
                if m > c:
                    B.oq[n, :t].copy_(B.hq[a:a + t])
                    B.ods[n, :t].copy_(B.hds[a:a + t])
                output_gemv(K, self.out_w.data, qt, B.h[a:a + t], B.oq[n, :2 * t], B.ods[n, :2 * t],
                            B.logits2[n, :2 * t], B.logits[a:a + t])
            logits = B.logits
        logits = self._lora("output.weight", B.h, logits)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _qk_extras(self, i: int) -> tuple[list, list]:
        """Layer i's ([q, k, v biases], [q, k norm weights]), None where the model has none."""
        p, vec = f"blk.{i}.", self.vec
        bias = [vec[p + n] for n in ("attn_q.bias", "attn_k.bias", "attn_v.bias")] if self.bias else [None] * 3
        norms = [vec[p + "attn_q_norm.weight"], vec[p + "attn_k_norm.weight"]] if self.qk_norm else [None] * 2
        return bias, norms

    def _attend_torch(self, i: int, q, k, v, first: bool) -> torch.Tensor:
        """Layer i's bias, QK norm, RoPE, cache write and attention in torch ops from the q, k, v projections: the
        row-kernel body's for block or transformed cache rows and for position 0 (which writes the sink rows)."""
        cfg, eps = self.cfg, self.cfg.rms_eps
        H, Hkv, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        bias, norms = self._qk_extras(i)
        if self.bias:
            q, k, v = q + bias[0], k + bias[1], v + bias[2]
        q, k, v = q.view(H, hd), k.view(Hkv, hd), v.view(Hkv, hd)
        if self.qk_norm:
            q, k = _rms_norm(q, norms[0], eps), _rms_norm(k, norms[1], eps)
        if self.layer_rope[i] >= 0:  # -1: a layer without rope
            c_tab, s_tab = self.tables[self.layer_rope[i]]
            c, s = c_tab.index_select(0, self.pos)[0], s_tab.index_select(0, self.pos)[0]
            q = _rope(q, c, s, cfg.rope_style, cfg.rope_dim)
            k = _rope(k, c, s, cfg.rope_style, cfg.rope_dim)
        return self._store_attend(i, q, k, v, first)

    def _store_attend(self, i: int, q, k, v, first: bool) -> torch.Tensor:
        """Writes layer i's new K/V rows (storage transform, encoding, sink rows at position 0) and returns the
        attention output [H, hd] in the model's basis."""
        kp, vp = self.parts[i]
        ks, vs = to_storage(kp, k), to_storage(vp, v)
        kp.data.index_copy_(1, self.pos, encode_rows(kp.block, ks, self.k_dtype)[:, None])
        vp.data.index_copy_(1, self.pos, encode_rows(vp.block, vs, self.v_dtype)[:, None])
        if first:  # position 0: the exact sink rows, and attention over one key is its value
            if kp.sink is not None:
                kp.sink.copy_(ks)
            if vp.sink is not None:
                vp.sink.copy_(vs)
            return v.repeat_interleave(self.group, 0)
        return attend_parts(self.K, q, kp, vp, self.len, self.scale, self.layer_window[i])

    def _capture(self) -> None:
        dev = self.b.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: lazy init, allocator pools, cuBLAS handles
            for _ in range(2):
                self._body(False)
        torch.cuda.current_stream(dev).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.g_logits = self._body(False)
            self.g_top = argmax_or_minus1(self.g_logits) if self.whole else None
        self.graph = g

    def _step(self, token: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [1, n_vocab] float32, their argmax or -1 as a device scalar) on the GPU for ``token`` at ``pos``;
        its K/V land in the bound cache."""
        self.tok.fill_(int(token))
        self.pos.fill_(int(pos))
        action = self.policy.action(pos)
        if action == "capture":
            try:
                self._capture()
            except RuntimeError as e:  # capture is an optimization: run eagerly instead, and say why once
                self.graph = None
                self.policy.record(action, e)
                print(f"pyllm: CUDA graph capture failed, decoding without it ({e})", file=sys.stderr)
                logits = self._body(False)
                return logits, argmax_or_minus1(logits) if self.whole else None
            self.policy.record(action)
            action = "replay"
        if action == "replay":
            self.graph.replay()
            self.policy.record(action)
            return self.g_logits, self.g_top
        self.policy.record(action)
        logits = self._body(pos == 0)
        return logits, argmax_or_minus1(logits) if self.whole else None

    def hidden(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """A run's step (``layers``): the hidden state float32 [M, n_embd] on the CPU after its layers, from rows
        ``x`` (the same shape, entering its first layer) at positions pos..pos+M-1, one row at a time (a row reads
        only the rows before it); their K/V land in the bound cache."""
        out = torch.empty_like(x)
        for r in range(x.shape[0]):
            self.x_in.copy_(x[r:r + 1])
            out[r:r + 1].copy_(self._step(0, pos + r)[0])
        return out

    def decode_rows(self, steps: list["CudaDecodeStep"], tokens: list[int],
                    positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode token per step (this one first; each bound to its own cache of this model, rows_exact, at a
        position past 0), up to GEMV_MAX_M, in one pass: (logits [M, n_vocab] float32, their argmax or -1) on the
        GPU.  Eager (no graph): which caches run together changes from step to step."""
        for st, t, p in zip(steps, tokens, positions):
            st.tok.fill_(int(t))
            st.pos.fill_(int(p))
        logits = self._body_kernels(False, steps)
        return logits, argmax_or_minus1(logits)

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        """Logits [1, n_vocab] float32 on the CPU for ``token`` at ``pos``; its K/V land in the bound cache."""
        return self._step(token, pos)[0].float().cpu()

    def with_argmax(self, token: int, pos: int) -> tuple[torch.Tensor, int]:
        """(logits [n_vocab] float32 on the CPU, their first argmax, or -1 where a logit is NaN or infinite): the CPU
        step's contract (Decoder.fused_logits).  The argmax is taken on the GPU, inside the captured graph, so the
        runtime's greedy path reads the vocabulary neither for the check nor for the pick."""
        logits, top = self._step(token, pos)
        return logits[0].float().cpu(), int(top)


def argmax_or_minus1(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its maximum of logits [M, n] (torch.argmax's tie rule, as np.argmax's), or -1 where
    any of the row's logits is NaN or infinite: device int64 [M], no host sync (capturable)."""
    top = logits.argmax(-1)
    return top.masked_fill(~torch.isfinite(logits).all(-1), -1)
