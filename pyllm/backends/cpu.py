"""The CPU backend: the C++ extension's kernels (fused dequantize-in-GEMV for decode, dequantized tiles + GEMM for
prefill) and its one-call decode step (csrc/cpu/decode_step.cpp).

Weights stay where the loader mapped them. Types the extension lacks, and every call when the extension cannot
be built, take the torch reference inside ops.qmatmul / ops.embedding (ops.py says how). The one exception is the
decode step's copy of the layer matrices and the output projection: those of every type _C.rows8_qtype maps
(Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants Q4_K/Q5_K/Q6_K) are repacked with their rows interleaved by 8
(csrc/common/blocks.h), which its GEMVs read faster (docs/DESIGN.md, "Rows interleaved by 8"). That copy costs
their size again in RAM; PYLLM_REPACK=0 turns it off. Where mul_mat runs prefill on the int8 GEMVs (CPUs without
bf16 units), the forward's layer matrices are read from that copy too (CpuBackend.qmatmul). A tied output
projection is the token embedding: the copy is the step's output GEMV's only, the embedding lookup (C++ step and
torch path) keeps reading the loaded tensor.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from .. import ops
from ..formats.gguf import GGMLType
from .base import SeqStep, StepRows, check_seqs, step_one

# csrc/kernels.h KVType: how a cache part's rows are encoded (the rotated kinds store q8_0 / q4_0 blocks)
KV_TYPE_IDS = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3}
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


class Rows8Copy(NamedTuple):
    """A matrix's rows interleaved by 8 (the decode step's copy): ``data`` of type ``qtype`` (a QTensor's two fields,
    so ops.qmatmul takes it), and the ``loaded`` tensor it was made from, kept so that its id stays the key."""
    data: torch.Tensor
    qtype: int
    loaded: torch.Tensor


def available_memory() -> int | None:
    """Bytes the OS says can be allocated without swapping (Linux MemAvailable: free plus reclaimable cache), or
    None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# Matrix types whose row kernels sum a row in one order whatever the number of rows (tests/test_kernels.py
# test_gemv_rows_do_not_depend_on_m): the GGUF legacy and K-quant types, MXFP4 (gpt-oss's experts: the legacy
# block kernel), and the rows-by-8 copies (ids 60..67, csrc/common/qtype.h).  A multi-row pass over them gives
# each row a one-token step's logits bit for bit; float matrices unroll by M.
EXACT_ROW_TYPES = frozenset(
    [int(GGMLType[n]) for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                                "Q6_K")]
    + list(range(60, 68)))


def decode_arch(C, spec, layer_rope, layers: range | None = None):
    """``spec`` (models/spec.py ArchSpec) as the extension's DecodeArch: the C++ mirror the decode steps read,
    whose constructor checks every field.  ``layer_rope``: each layer's index into the model's rope tables.
    ``layers``: the run of the model's layers a context holds (all by default)."""
    layers = range(spec.n_layer) if layers is None else layers
    return C.DecodeArch(n_embd=spec.n_embd, n_ff=spec.n_ff_exp if spec.n_expert else spec.n_ff, n_head=spec.n_head, n_kv_head=spec.n_kv_head,
                        head_dim=spec.head_dim, rope_dim=spec.rope_dim, rope_style=spec.rope_style,
                        rms_eps=spec.rms_eps, attn_scale=spec.attn_scale, qkv_bias=spec.qkv_bias,
                        qk_norm=spec.qk_norm, post_norms=spec.post_norms, act=spec.act, embd_scale=spec.embd_scale,
                        final_softcap=spec.final_softcap, layer_rope=[layer_rope[i] for i in layers],
                        layer_window=[spec.layers[i].window for i in layers], n_expert=spec.n_expert,
                        n_expert_used=spec.n_expert_used, n_ff_shexp=spec.n_ff_shexp, shexp_gate=spec.shexp_gate,
                        norm_top_k=spec.norm_top_k, attn_sinks=spec.attn_sinks, attn_out_bias=spec.attn_out_bias,
                        expert_bias=spec.expert_bias, expert_gating=spec.expert_gating,
                        swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit)


class CpuDecodeStep:
    """The C++ decode step bound to one model and one cache: ``step(token, pos)`` -> logits [1, n_vocab] f32;
    ``rows(tokens, pos, all_logits)`` runs up to ops.GEMV_MAX_M consecutive tokens in one pass (speculation).
    ``rows_exact``: every matrix is of EXACT_ROW_TYPES, so each row of ``rows`` is bit for bit a one-token step's.
    ``with_argmax`` (logits [n_vocab]) and ``rows_with_argmax`` also return each row's argmax (-1 where a logit is
    NaN or infinite), found by the output GEMV while its outputs are in cache."""

    def __init__(self, ctx, rows_exact: bool = False):
        self.ctx = ctx
        self.n_vocab = ctx.n_vocab
        self.rows_exact = rows_exact

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        return self.with_argmax(token, pos)[0].view(1, -1)

    def with_argmax(self, token: int, pos: int) -> tuple[torch.Tensor, int]:
        logits = torch.empty(self.n_vocab)
        return logits, ops._C.decode_step(self.ctx, token, pos, logits)

    def rows(self, tokens: torch.Tensor, pos: int, all_logits: bool = True) -> torch.Tensor:
        return self.rows_with_argmax(tokens, pos, all_logits)[0]

    def rows_with_argmax(self, tokens: torch.Tensor, pos: int, all_logits: bool = True
                         ) -> tuple[torch.Tensor, list[int]]:
        out = torch.empty(tokens.shape[0] if all_logits else 1, self.n_vocab)
        return out, ops._C.decode_steps(self.ctx, tokens, pos, out, all_logits)

    # -- part of a model (a context over a run of its layers: CpuBackend.fused_part) ---------------------------
    def hidden(self, x: torch.Tensor, pos: int, first: int = 0, last: int = -1) -> torch.Tensor:
        """The hidden state [M, n_embd] after the context's layers [first, last) (-1: to its last) of rows ``x``
        at positions pos..: token ids int64 [M] (embedded) or the hidden state float32 [M, n_embd] entering layer
        ``first``.  Their K/V land in the bound cache."""
        out = torch.empty(x.shape[0], self.ctx.n_embd)
        ops._C.decode_steps(self.ctx, x, pos, out, True, first, last, False)
        return out

    def head(self, x: torch.Tensor, pos: int, all_logits: bool = True) -> tuple[torch.Tensor, list[int]]:
        """(logits, each row's argmax) after the context's last layer, from rows ``x`` as ``hidden`` takes them: the
        context's head on the hidden state its other layers' side left (no layer runs where it holds none)."""
        out = torch.empty(x.shape[0] if all_logits else 1, self.n_vocab)
        return out, ops._C.decode_steps(self.ctx, x, pos, out, all_logits, self.ctx.n_layer, -1, True)

    @staticmethod
    def batch(steps: list["CpuDecodeStep"], x: torch.Tensor, positions: list[int], head: bool
              ) -> tuple[torch.Tensor, list[int]]:
        """Row b of ``x`` (a token id or a hidden state, as ``hidden`` takes them) through steps[b]'s context at
        positions[b], every context built over the same run of one model's layers, in one decode_batch pass:
        (the hidden state [B, n_embd] after their layers, []), or with ``head`` (the head's logits after the last
        layer, each row's argmax).  Contexts without layers store no rows: their pass is one context's rows."""
        ctx0 = steps[0].ctx
        first = ctx0.n_layer if head else 0
        out = torch.empty(x.shape[0], steps[0].n_vocab if head else ctx0.n_embd)
        if ctx0.n_layer == 0:
            return out, ops._C.decode_steps(ctx0, x, 0, out, True, 0, -1, head)
        tops = ops._C.decode_batch([s.ctx for s in steps], x, torch.tensor(positions, dtype=torch.int64), out,
                                   first, -1, head)
        return out, tops


def _paged(part) -> dict:
    """A paged part's block table for DecodeCachePart (the step reads the live table), or nothing."""
    table = getattr(part, "table", None)
    return {} if table is None else {"block_table": table, "block_rows": part.block_rows}


def _add_lora(ctx, model, layers: range, ends: bool) -> None:
    """The model's LoRA terms (Decoder.attach_lora) into the step over ``layers`` (and the embedding and head where
    ``ends``), which adds each after its matrix's GEMV (csrc/cpu/decode_step.cpp); terms of the other layers are
    the other side's (a split model); KeyError for a term on a matrix the step does not run."""
    terms = getattr(model, "lora_terms", None)
    if not terms:
        return
    n = len(layers)
    slots = {f"blk.{i}.{m}.weight": 7 * k + j for k, i in enumerate(layers) for j, m in enumerate(LAYER_MATRICES)}
    if ends:
        slots.update({"output.weight": 7 * n, "token_embd.weight": 7 * n + 1})
    for name, t in terms.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        if (layer not in layers) if layer is not None else not ends:
            continue
        ctx.set_lora(slots[name], t.a, t.bt)


class CpuBackend:
    name = "fast"
    device = torch.device("cpu")

    def __init__(self, n_threads: int | None = None, decode_copies: bool = True):
        """``decode_copies`` False: no interleaved copies of the weights, for a backend whose layers never run the
        C++ step."""
        if n_threads:
            ops.set_num_threads(n_threads)
        self.decode_copies = decode_copies
        self.linear = self.qmatmul
        self.linear_output = ops.qmatmul_output
        self.embed = ops.embedding
        self._rows8: dict[int, Rows8Copy] = {}  # id(loaded bytes) -> its interleaved copy
        self._repack_fits = True  # prepare_weights: whether the copies fit in memory

    def qmatmul(self, x: torch.Tensor, w, out: torch.Tensor | None = None) -> torch.Tensor:
        """ops.qmatmul, on the decode step's interleaved copy of ``w`` where it has one and mul_mat runs every row
        count on the int8 GEMVs (prefill kernel "int8-gemv", CPUs without bf16 units): the copy's 8-row groups
        decode each code vector once for 4 rows of x, 1.3-1.9x the GEMVs on GGUF rows at 512 rows on Gemma 3's and
        Qwen2.5's Q4_K / Q5_0 / Q8_0 matrices and level on their Q6_K (Zen 3, 2 threads), and a row of x gets the
        same bits in any forward, as on the GGUF rows."""
        copy = self._rows8.get(id(w.data))
        if copy is not None and ops._C.prefill_kernel() == "int8-gemv":
            return ops.qmatmul(x, copy, out)
        return ops.qmatmul(x, w, out)

    @staticmethod
    def linear_experts(x: torch.Tensor, ws: list, ids: torch.Tensor) -> list[torch.Tensor] | None:
        return ops.qmatmul_experts(x, ws, ids)

    @staticmethod
    def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         window: int) -> torch.Tensor | None:
        return ops.causal_attention(q, k, v, scale, window)

    # Prefill's row operations (models/decoder.py Decoder.norm / rope / glu): the decode step's row code.
    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
        return ops.rms_norm(x, w, eps)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str, rope_dim: int) -> torch.Tensor | None:
        return ops.rope_(x, cos, sin, rope_dim, style == "neox")

    @staticmethod
    def glu(g: torch.Tensor, u: torch.Tensor, gelu_tanh: bool) -> torch.Tensor | None:
        return ops.glu_(g, u, gelu_tanh)

    def describe(self) -> dict:
        out = {"backend": self.name, "device": "cpu", "isa": ops.get_isa(), "threads": ops.get_num_threads()}
        if self._rows8:
            out["repacked_mb"] = round(sum(c.data.numel() for c in self._rows8.values()) / 2**20, 1)
        if ops.huge_pages_mode() == "never":  # the decode step's memory on 4 KiB pages: docs/DESIGN.md "Huge pages"
            out["huge_pages"] = False
        return out

    def decode_matrix(self, w) -> tuple[torch.Tensor, int]:
        """(bytes, type id) of a layer matrix or the output projection as the decode step reads it: rows interleaved
        by 8 where the type has that layout and N % 8 == 0 (made once per matrix, kept for every cache's step), else
        as loaded."""
        rid = self._rows8_type(w) if self._repacks() else -1
        if rid < 0:
            return w.data, int(w.qtype)
        key = id(w.data)
        if key not in self._rows8:
            self._rows8[key] = Rows8Copy(ops._C.repack_rows8(w.data.contiguous(), int(w.qtype)), rid, w.data)
        return self._rows8[key].data, rid

    def _repacks(self) -> bool:
        """Whether layer matrices get interleaved copies: they fit in memory (prepare_weights) and PYLLM_REPACK is
        not 0."""
        return self._repack_fits and os.environ.get("PYLLM_REPACK", "1") != "0"

    @staticmethod
    def _rows8_type(w) -> int:
        """The interleaved type id for w's copy, or -1: no such layout, rows not a multiple of 8, not on the CPU,
        or no extension (then the step does not run either)."""
        data = w.data
        if data.dim() != 2 or data.shape[0] % 8 or not data.is_cpu:
            return -1
        try:
            return int(ops._C.rows8_qtype(int(w.qtype)))
        except NotImplementedError:
            return -1

    def prepare_weights(self, weights: dict, progress: bool = False) -> dict:
        """The same dict; AWQ checkpoints' int4 tensors are repacked in place into the extension's row layout.
        Any that stay in checkpoint form (no extension, a group size the layout lacks) are multiplied by their own
        chunked dequantize per call: linear/embed then check each weight's type."""
        if any(hasattr(w, "qzeros") for w in weights.values()):
            from ..formats.awq.repack import repack_weights
            from ..formats.awq.unpack import AWQTensor

            if repack_weights(weights):
                fast_linear, fast_embed = self.linear, self.embed

                def linear(x, w):
                    return w.matmul(x) if isinstance(w, AWQTensor) else fast_linear(x, w)

                def embed(w, ids):
                    return w.rows(ids).float() if isinstance(w, AWQTensor) else fast_embed(w, ids)

                self.linear = self.linear_output = linear
                self.embed = embed
        # The decode step's interleaved copies, made at load like the rest of the model's memory, and only where
        # they fit in half the memory the machine has free: a copy that pushed it into swap (or the mapped file
        # out of the page cache) would cost far more than the kernels gain.
        names = tuple(f".{n}.weight" for n in LAYER_MATRICES)
        mats = [w for name, w in weights.items()
                if name.startswith("blk.") and name.endswith(names) and hasattr(w, "qtype") and hasattr(w, "data")]
        out = weights.get("output.weight", weights.get("token_embd.weight"))
        if hasattr(out, "qtype") and hasattr(out, "data"):
            mats.append(out)
        need = sum(w.data.numel() for w in mats if self._rows8_type(w) >= 0)
        free = available_memory()
        self._repack_fits = self.decode_copies and (free is None or need <= free // 2)
        if self._repacks():
            self._repack_on_huge_pages([w for w in mats if self._rows8_type(w) >= 0])
        for w in mats:
            self.decode_matrix(w)
        return weights

    def _repack_on_huge_pages(self, mats: list) -> None:
        """The interleaved copies of ``mats``, made in one allocation on huge pages where the OS gives them
        (ops.advise_huge_pages).  A decode step streams every copy once, and on 4 KiB pages each page costs a TLB
        miss.  One allocation, because a copy of its own (most are 1-3 MiB) holds few whole 2 MiB pages: with
        one each, Gemma 3 and Qwen2.5 decoded 7-12% faster than on 4 KiB pages; with one for all, 20-35%."""
        huge = 1 << 21
        todo = list({id(w.data): w for w in mats if id(w.data) not in self._rows8}.values())
        spans = [(w.data.numel() + 63) & ~63 for w in todo]  # each copy 64-byte aligned, as an allocation is
        if not todo:
            return
        arena = torch.empty(sum(spans) + huge, dtype=torch.uint8)
        ops.advise_huge_pages(arena)
        off = -arena.data_ptr() % huge
        for w, span in zip(todo, spans):
            out = arena[off:off + w.data.numel()].view(w.data.shape)
            self._rows8[id(w.data)] = Rows8Copy(ops._C.repack_rows8(w.data.contiguous(), int(w.qtype), out),
                                                self._rows8_type(w), w.data)
            off += span

    def make_kv_cache(self, kind: str, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int):
        from ..runtime.kv_cache import KVCache

        return KVCache(n_layer, n_kv_head, max_seq, head_dim, kind, device=self.device)

    def step(self, model, seqs: list[SeqStep]) -> list[StepRows]:
        """The multi-sequence step (backends/base.py): the decode rows of every sequence whose cache has a C++ step
        (a decode token, or the k + 1 rows of a speculative check) go through ``decode_batch`` together, packed
        GEMV_MAX_M rows a pass, every weight read once per pass for all of them.  Each row is bit for bit what its
        sequence's own one-token step or multi-row pass gives (the row kernels sum a row in one order whatever the
        number of rows; tests/test_step.py): a sequence's rows may straddle two passes, the later pass reading the
        K/V rows the earlier one wrote.  Prompt chunks take the forward, one sequence at a time: their K/V rows are
        the forward's, which prompt reuse matches across requests.  A single sequence takes step_one."""
        check_seqs(seqs)
        if len(seqs) == 1:  # nothing to batch
            return [step_one(model, seqs[0], ops.GEMV_MAX_M)]
        batched = []  # (index, its C++ context) of the decode parts the passes take
        if model.use_cpp_decode:
            for i, s in enumerate(seqs):
                if not s.prefill and len(s.tokens) <= ops.GEMV_MAX_M:
                    ctx = getattr(model.fused_step(s.kv), "ctx", None)
                    if ctx is not None:
                        batched.append((i, ctx))
        if len(batched) < 2:  # one sequence's rows: its own step has the same bits
            return [step_one(model, s, ops.GEMV_MAX_M) for s in seqs]
        for i, _ in batched:  # every block taken before any row is written: a full pool stops the step whole
            seqs[i].kv.check_room(seqs[i].pos, len(seqs[i].tokens))
        ctxs, tokens, positions, first = [], [], [], []
        for i, ctx in batched:
            s = seqs[i]
            first.append(len(tokens))
            ctxs += [ctx] * len(s.tokens)
            tokens += s.tokens
            positions += range(s.pos, s.pos + len(s.tokens))
        n = len(tokens)
        logits = torch.empty(n, ctxs[0].n_vocab)
        tokens_t, positions_t = torch.tensor(tokens), torch.tensor(positions)
        tops: list[int] = []
        for r0 in range(0, n, ops.GEMV_MAX_M):
            r1 = min(n, r0 + ops.GEMV_MAX_M)
            tops += ops._C.decode_batch(ctxs[r0:r1], tokens_t[r0:r1], positions_t[r0:r1], logits[r0:r1])
        out: list[StepRows | None] = [None] * len(seqs)
        for (i, _), r in zip(batched, first):
            s = seqs[i]
            r1 = r + len(s.tokens)
            r0 = r if s.all_logits else r1 - 1
            out[i] = StepRows(logits[r0:r1], tops[r0:r1])
        return [o if o is not None else step_one(model, s, ops.GEMV_MAX_M) for o, s in zip(out, seqs)]

    def make_kv_pool(self, kind: str, n_layer: int, n_kv_head: int, head_dim: int, n_blocks: int,
                     block_rows: int):
        """A BlockPool (runtime/kv_pool.py) whose caches the C++ steps read through their block tables."""
        from ..runtime.kv_pool import BlockPool

        return BlockPool(kind, n_layer, n_kv_head, head_dim, n_blocks, block_rows, device=self.device)

    def prefill_exact_rows(self, model, kv) -> int | None:
        """The fewest rows from which a prompt forward gives each row the bits it gets in any other forward of at
        least that many rows (Decoder.prefill_exact_rows): the bf16 prefill GEMMs sum a row in one order whatever
        rows share the call, as the int8 GEMVs' row kernels do for the types of EXACT_ROW_TYPES (from 2 rows: a
        one-row forward is the fused step), and attention, norms and RoPE run row by row over the cache; None where
        that does not hold: the fp32 GEMM (torch's matmul blocks by row count), the int8 GEMVs on float matrices
        (they unroll by M), the reference kernels, experts (a token's expert rows are grouped with the other
        tokens'), LoRA terms (torch matmuls)."""
        if self.linear != self.qmatmul or model.spec.n_expert or getattr(model, "lora_terms", None):
            return None
        try:
            kernel = ops._C.prefill_kernel()
            if kernel == "f32":
                return None
            if kernel == "int8-gemv":  # every forward of 2 rows or more on the row kernels, where no row sees
                # another's (a one-row forward takes the fused step, whose bits are its own)
                mats = [model.w.get(f"blk.{i}.{n}.weight") for i in range(model.spec.n_layer) for n in LAYER_MATRICES]
                return 2 if all(int(getattr(w, "qtype", -1)) in EXACT_ROW_TYPES for w in mats) else None
            return int(ops._C.gemm_min_rows(False))
        except (AttributeError, NotImplementedError):  # no extension
            return None

    def fused_decode(self, model, kv) -> CpuDecodeStep | None:
        """The C++ step for ``model`` over ``kv``, or None where it does not apply: a cache part it does not store
        (bf16), a cache off the CPU, weights in checkpoint form, no extension, or a weight type / layout the
        step does not take, or an architecture field it does not compute (ArchSpec.fused_step_gaps("cpu"))."""
        return self.fused_part(model, kv, range(model.spec.n_layer), True)

    def fused_part(self, model, kv, layers: range, ends: bool, max_seq: int = 0) -> CpuDecodeStep | None:
        """fused_decode over a run of the model's ``layers`` (one side of a split model, backends/split.py): a
        context holding their weights, ``kv`` a cache of theirs alone (None where the run is empty: then
        ``max_seq`` is the positions the model's other caches hold), and the token embedding and output head
        where ``ends``.  Its ``hidden`` and ``head`` run the parts; None where fused_decode's would be."""
        if self.linear != self.qmatmul or (kv is not None and not hasattr(kv, "storage_layout")):
            return None
        if model.spec.fused_step_gaps("cpu"):
            return None
        if kv is None:  # no layers, no rows: empty parts, as long as the other sides' caches
            k = v = _NoRows(torch.empty(0, model.spec.n_kv_head, max_seq, model.spec.head_dim, dtype=torch.float16))
        else:
            k, v = kv.storage_layout()
        if k.block not in KV_TYPE_IDS or v.block not in KV_TYPE_IDS or k.data.device.type != "cpu":
            return None
        spec, w, vec = model.spec, model.w, model.vec
        # the per-layer vectors (norms, biases) by the step's names: the tensor names less ".weight"
        small = {n.removesuffix(".weight"): n for n in spec.layer_tensors() if len(w["blk.0." + n].shape) == 1}
        moe, moe_names = [], ("ffn_gate_inp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
        n_moe = 4 if spec.n_ff_shexp else 1  # each layer's: the router, then the shared expert's matrices
        try:
            if spec.n_expert:
                # The stacked experts as [n_expert * rows, row_bytes] (expert e's rows the e-th slice), in their file
                # form: a rows-by-8 copy would double the largest tensors; the router and shared expert likewise.
                packed = []
                for i in layers:
                    for n in LAYER_MATRICES:
                        t = w[f"blk.{i}.{n}{'_exps' if n.startswith('ffn_') else ''}.weight"]
                        packed.append(self.decode_matrix(t) if t.data.dim() == 2 else
                                      (t.data.reshape(-1, t.data.shape[-1]), int(t.qtype)))
                    moe += [w[f"blk.{i}.{n}.weight"] for n in moe_names[:n_moe]]
            else:
                packed = [self.decode_matrix(w[f"blk.{i}.{n}.weight"]) for i in layers for n in LAYER_MATRICES]
            out_data, out_type = self.decode_matrix(model.output) if ends else (None, 0)
            vectors = {name: [vec[f"blk.{i}.{tensor}"].float().contiguous() for i in layers]
                       for name, tensor in small.items()}
            if spec.expert_bias:  # the stacked experts' biases [n_expert, rows], flat: expert e's at e * rows
                for name in ("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"):
                    vectors[name] = [model.expert_bias[f"blk.{i}.{name}"].float().reshape(-1).contiguous()
                                     for i in layers]
            embd = w["token_embd.weight"]
            ctx = ops._C.DecodeContext(
                decode_arch(ops._C, spec, model.layer_rope, layers), [d for d, _ in packed], [t for _, t in packed],
                vectors, embd.data if ends else None, int(embd.qtype), out_data, out_type,
                vec["output_norm.weight"].float().contiguous() if ends else None,
                # the tables the run's layers use (a DecodeArch counts them from its layers' entries)
                [(c.contiguous(), s.contiguous())
                 for c, s in model.rope_tables[:1 + max((model.layer_rope[i] for i in layers), default=0)]],
                ops._C.DecodeCachePart(k.data, KV_TYPE_IDS[k.block], mu=k.mu,
                                       rot=None if k.rot is None else k.rot.contiguous(), scale=k.scale, sink=k.sink,
                                       **_paged(k)),
                ops._C.DecodeCachePart(v.data, KV_TYPE_IDS[v.block], mu=v.mu,
                                       rot=None if v.rot is None else v.rot.contiguous(), sink=v.sink, **_paged(v)),
                **(dict(moe_weights=[t.data for t in moe], moe_qtypes=[int(t.qtype) for t in moe]) if moe else {}))
            _add_lora(ctx, model, layers, ends)
        except (NotImplementedError, AttributeError, ValueError, TypeError, KeyError):
            # No extension, a GGML type the CPU kernels lack, or a layout the step does not take (LoRA terms on a
            # matrix outside it, an extension without set_lora): torch path.
            return None
        # the routers (the first of each layer's n_moe) run a row at a time in the step (decode_step.cpp moe_mlp),
        # exact whatever their type
        shared_expert = [int(t.qtype) for j, t in enumerate(moe) if j % n_moe]
        types = [t for _, t in packed] + ([out_type] if ends else []) + shared_expert
        return CpuDecodeStep(ctx, rows_exact=all(t in EXACT_ROW_TYPES for t in types))


class _NoRows:
    """The K or V part of a run of no layers, as KVCache.storage_layout describes a part: f16 rows, none stored."""

    block, mu, rot, scale, sink = "f16", None, None, None, None

    def __init__(self, data: torch.Tensor):
        self.data = data
