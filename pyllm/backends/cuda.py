"""The CUDA backend: weights in VRAM in their quantized block form, the fused dequantize-in-GEMV kernels for
decode, int8 tensor-core MMA (or dequantize-to-fp16 + cuBLAS) for prefill, and a one-token step captured in a CUDA
graph.

Kernels: csrc/cuda (GEMV for Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K and AWQ int4 rows; dequantize for every GGUF
block type and AWQ; decode attention over every KV cache kind), compiled into the one extension by pyllm/_ext.py
when nvcc and a CUDA torch are present.  ``create()`` raises BackendUnavailable naming what is missing.

Paths, as the physics dictates:
- decode (<= GEMV_MAX_M rows): the fused GEMV reads each weight once per token, still quantized; the decode
  tokens of several sequences (CudaBackend.step) share one pass, each weight read once for all of them;
- prefill: the tiled weights of Q4_0 Q8_0 Q4_K Q6_K through int8 MMA on the tensor cores, read in their quantized
  bytes with the activations as int8 codes (csrc/cuda/mmq.cu, compute capability 8.0+); other types (tiled AWQ
  included) dequantized to fp16 (one matrix at a time) for cuBLAS, as every type under PYLLM_CUDA_MMQ=0;
- types without a GEMV kernel (Q2_K, Q3_K, Q5_1) take the dequantize path at decode too;
- decode attention: csrc/cuda/attention.cu over the cache's stored rows (the CPU step's semantics: storage basis,
  exact sink row, sliding window); prefill attention: the model's torch path (SDPA) over the cache.

The fused step (``CudaDecodeStep``, backends/cuda_step.py) runs csrc/cuda/step.cu's row kernels between the GEMVs, or, for a model they
do not take, the model's own torch forward (models/transformer.py forward_on_device) with the position held on the
device: token and position live in device buffers, so one captured graph serves every position.  Logits come
back as float32 CPU tensors, so the runtime's sampler chain, stop strings, prefix reuse and Ctrl-C are the CPU's.
"""

from __future__ import annotations

import os
import sys

import torch

from ..formats.awq.repack import AWQRows, repack
from ..formats.awq.unpack import AWQTensor
from ..errors import PyllmError
from ..formats.gguf import GGMLType
from ..ops import GEMV_MAX_M  # above it, dequantize + cuBLAS (csrc/common/limits.h)
from .base import BackendUnavailable, SeqStep, StepRows, check_seqs, step_one
from .cuda_step import CudaDecodeStep, StepBuffers, attend_parts, cache_parts, cache_problem, fused_decode_problem, output_gemv, row_kernels_problem



# ---- availability --------------------------------------------------------------------------------------------
def unavailable_reason(device: str = "cuda") -> str | None:
    """Why the CUDA backend cannot run on ``device`` here (one line), or None when it can.  Builds the extension
    on first call (that is how it learns whether the kernels compile)."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return "torch sees no GPU (torch.cuda.is_available() is False)"
    dev = torch.device(device)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"there is no GPU {dev.index} (this machine has {torch.cuda.device_count()})"
    from .. import _ext

    problem = _ext.cuda_build_problem()
    if problem:
        return f"the CUDA kernels are not built: {problem}"
    try:
        mod = _ext.load()
    except PyllmError as e:
        return f"the CUDA kernels failed to build: {str(e).strip().splitlines()[0]}"
    if not hasattr(mod, "cuda_gemv"):
        return "the extension was built without its CUDA kernels (delete its build directory and retry)"
    return None


def create(device: str = "cuda", **_options) -> "CudaBackend":
    """The CUDA backend on ``device`` ("cuda" or "cuda:N"); BackendUnavailable says why it cannot run."""
    why = unavailable_reason(device)
    if why:
        raise BackendUnavailable(f"device {device!r} is not available: {why}")
    from .. import _ext

    dev = torch.device(device)
    return CudaBackend(_ext.load(), torch.device("cuda", dev.index if dev.index is not None else
                                                torch.cuda.current_device()))


# ---- weights -------------------------------------------------------------------------------------------------
def upload_plan(weights: dict) -> list[tuple[str, int]]:
    """(name, bytes) of each distinct weight object in ``weights`` order: a tied output weight (the same object
    under two names) is uploaded once, under its first name."""
    seen, plan = set(), []
    for name, w in weights.items():
        if id(w) in seen:
            continue
        seen.add(id(w))
        plan.append((name, int(w.nbytes)))
    return plan


def check_fits(need: int, free: int, device_name: str) -> None:
    """PyllmError unless ``need`` bytes of weights leave room (1/16 of the free memory, at least 256 MiB) for the
    KV cache and activations on a GPU with ``free`` bytes free."""
    from .split import gpu_headroom  # the same room --device auto's layer count keeps (split.fit_gpu_layers)

    headroom = gpu_headroom(free)
    if need + headroom > free:
        raise PyllmError(f"the model's weights need {need / 2**30:.2f} GiB of GPU memory, but {device_name} has "
                         f"{free / 2**30:.2f} GiB free (and the KV cache needs room too); put fewer layers on it "
                         f"(--gpu-layers N, or --device auto: as many as fit), or use a smaller quantization")


def _to_device(w, dev: torch.device, C, gemv: bool = False):
    """One weight on ``dev`` in its quantized form: a matrix the decode GEMV reads (``gemv``) in the tiled layout where
    its type has one (CudaTiledTensor: GGUF blocks and AWQ rows), other QTensors as raw GGUF blocks, AWQ repacked to
    the CPU's row layout (AWQRows) where it has one, else the AutoAWQ tensors as they are (multiplied through their own
    dequantize)."""
    from ..formats.quant import QTensor

    if isinstance(w, QTensor):
        if gemv and tiled_upload_wanted(w, C):
            return _tiled(w, dev, C)
        return QTensor(w.qtype, w.shape, w.data.to(dev).contiguous(), w.name)
    if hasattr(w, "qzeros"):  # AWQTensor: rows for the GEMV when its group size has a layout
        rows = repack(w, C)
        if rows is None:
            return AWQTensor(w.qweight.to(dev), w.qzeros.to(dev), w.scales.to(dev), w.group_size, w.name)
        w = rows
    if hasattr(w, "group_size") and hasattr(w, "data"):  # AWQRows
        if gemv and tiled_upload_wanted(w, C):
            return _tiled(w, dev, C)
        return CudaAwqRows(w.data.to(dev).contiguous(), w.qtype, w.shape, w.group_size, w.name)
    raise PyllmError(f"{getattr(w, 'name', '?')!r}: weights of type {type(w).__name__} cannot go to the GPU")


def tiled_upload_wanted(w, C) -> bool:
    """Whether matrix w goes to the GPU in the tiled GEMV layout (csrc/common/gemv_tiled.h: Q4_0, Q8_0, Q4_K, Q6_K and
    AWQ rows, with a multiple of 8 rows); PYLLM_CUDA_TILED=0 keeps every weight in GGUF order or AWQ rows (the
    row-per-CTA GEMV, for A/B)."""
    if os.environ.get("PYLLM_CUDA_TILED", "1") == "0" or not hasattr(C, "cuda_tile_weight"):
        return False
    return len(w.shape) == 2 and w.data.dim() == 2 and bool(C.cuda_tileable(int(w.qtype), w.shape[0], w.shape[1]))


def _tiled(w, dev: torch.device, C) -> "CudaTiledTensor":
    """w (a QTensor or AWQRows that tiled_upload_wanted) re-laid on the host, then on ``dev``."""
    data = C.cuda_tile_weight(w.data.cpu().contiguous(), int(w.qtype), w.shape[1])
    return CudaTiledTensor(C.cuda_tiled_qtype(int(w.qtype)), w.qtype, w.shape, data.to(dev), w.name)


class _CudaDequantized:
    """dequantize / rows of a matrix in VRAM through the CUDA dequantizer, for any layout whose ``qtype`` it takes."""

    __slots__ = ()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from .. import _ext

        return _ext.load().cuda_dequantize(self.data, self.qtype, self.shape[1], None, False).to(dtype)

    def rows(self, idx: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from .. import _ext

        idx = torch.as_tensor(idx)
        ids = idx.reshape(-1).to(self.data.device, torch.long)
        out = _ext.load().cuda_dequantize(self.data, self.qtype, self.shape[1], ids, False)
        return out.to(dtype).reshape(*idx.shape, self.shape[1])


class CudaTiledTensor(_CudaDequantized):
    """A matrix in VRAM in the CUDA decode GEMV's tiled layout (csrc/common/gemv_tiled.h), made at upload in place of
    its GGUF rows or AWQ rows: same bytes, in tiles of 8 rows.  ``qtype`` is the layout's own id (Q4_0_TILED ...,
    AWQ_G128_TILED ...), which every cuda_* kernel that takes a type id dispatches on (GEMV, parts, dequantize for
    prefill and embedding rows); ``base`` is the rows' type (a GGMLType, or the extension's AWQ_G* id)."""

    __slots__ = ("qtype", "base", "shape", "data", "name")
    is_float = False

    def __init__(self, qtype: int, base: int, shape: tuple[int, ...], data: torch.Tensor, name: str):
        try:
            base = GGMLType(base)
        except ValueError:  # AWQ rows: the extension's own id
            base = int(base)
        self.qtype, self.base, self.shape, self.data, self.name = int(qtype), base, tuple(shape), data, name

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device


class CudaAwqRows(_CudaDequantized, AWQRows):
    """AWQ rows (csrc/common/blocks.h AwqRow) in VRAM: pyllm.formats.awq.repack.AWQRows dequantized by the CUDA kernel."""


def _progress(done: int, total: int, last: int) -> int:
    pct = int(100 * done / max(total, 1))
    if pct != last:
        print(f"\rpyllm: uploading weights {done / 2**30:6.2f} / {total / 2**30:.2f} GiB ({pct}%)", end="",
              file=sys.stderr, flush=True)
    return pct


# ---- the backend ---------------------------------------------------------------------------------------------
class CudaBackend:
    name = "cuda"

    def __init__(self, kernels, device: torch.device):
        self.K = kernels
        self.device = device
        self.weight_bytes = 0
        self._mmq_types: dict[int, bool] = {}  # weight type id -> whether cuda_mmq takes it on this device

    def describe(self) -> dict:
        p = torch.cuda.get_device_properties(self.device)
        return {"backend": self.name, "device": "cuda", "gpu": p.name, "capability": f"{p.major}.{p.minor}",
                "vram_total": int(p.total_memory), "vram_weights": self.weight_bytes}

    def prepare_weights(self, weights: dict, progress: bool = False) -> dict:
        """Every weight uploaded once, quantized as in the file (no fp16 copy): VRAM ~ the file's size."""
        plan = upload_plan(weights)
        total = sum(n for _, n in plan)
        free, _ = torch.cuda.mem_get_info(self.device)
        check_fits(total, free, torch.cuda.get_device_name(self.device))
        show = progress and sys.stderr.isatty()
        done, last, moved = 0, -1, {}
        # matrices some GEMV reads: all but embedding tables (a tied output is the embedding too: tiled, its rows
        # still dequantize)
        gemv = {id(w) for n, w in weights.items() if not n.endswith("embd.weight")}
        for name, nbytes in plan:
            w = weights[name]
            moved[id(w)] = _to_device(w, self.device, self.K, gemv=id(w) in gemv)
            done += nbytes
            if show:
                last = _progress(done, total, last)
        self.weight_bytes = total
        if show:
            free_after, total_mem = torch.cuda.mem_get_info(self.device)
            print(f"\npyllm: weights in VRAM: {total / 2**30:.2f} GiB (quantized, as in the file); "
                  f"{free_after / 2**30:.1f} of {total_mem / 2**30:.1f} GiB free", file=sys.stderr)
        return {name: moved[id(w)] for name, w in weights.items()}

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """x [T, K] f32 on the GPU @ W^T -> [T, N] f32."""
        qt = getattr(w, "qtype", None)
        if qt is None or not isinstance(qt, int):  # AutoAWQ tensors without a row layout
            return w.matmul(x)
        if getattr(w, "is_float", False):
            wt = w.typed()
            return torch.nn.functional.linear(x.to(wt.dtype), wt).float()
        qt = int(qt)
        x = x.contiguous()
        if x.shape[0] <= GEMV_MAX_M and self.K.cuda_gemv_supported(qt):
            return self.K.cuda_gemv(w.data, qt, x)
        if self.mmq_wanted(qt):
            xq, xds = self.K.cuda_quantize_act(x)
            return self.K.cuda_mmq(w.data, qt, xq, xds)
        if self.K.cuda_dequant_supported(qt) and w.shape[1] % 8 == 0:
            wd = self.K.cuda_dequantize(w.data, qt, w.shape[1], None, True, True)  # [N, K] fp16, then cuBLAS
            return (x.to(torch.float16) @ wd.T).float()
        return x @ w.dequantize(torch.float32).T

    def mmq_wanted(self, qt: int) -> bool:
        """Whether prompt chunks of weight type ``qt`` go through the int8 tensor-core kernel (cuda_mmq,
        csrc/cuda/mmq.cu): the GGUF types' tiled layouts on a GPU of compute capability 8.0 or later (as
        cuda_mmq_supported says); other types (AWQ's tiled layout too), and every type under PYLLM_CUDA_MMQ=0 (the
        A/B), dequantize to fp16 for cuBLAS."""
        if os.environ.get("PYLLM_CUDA_MMQ", "1") == "0" or not hasattr(self.K, "cuda_mmq"):
            return False
        ok = self._mmq_types.get(qt)
        if ok is None:
            ok = self._mmq_types[qt] = bool(self.K.cuda_mmq_supported(qt, self.device.index or 0))
        return ok

    def linear_experts(self, x: torch.Tensor, ws: list, ids: torch.Tensor) -> list[torch.Tensor] | None:
        """A mixture-of-experts layer's selected experts (Decoder.experts): while the selections are few (decode,
        at most 4 x GEMV_MAX_M), one cuda_gemv_experts launch per stacked tensor (llama.cpp's MUL_MAT_ID: the ids
        read on the GPU, only the selected experts' rows read); None otherwise (prefill: the selections grouped by
        expert, each used expert's slice dequantized once for cuBLAS) or where the kernel lacks the type."""
        if ids.numel() > 4 * GEMV_MAX_M or x.shape[-1] % 32 or not hasattr(self.K, "cuda_gemv_experts"):
            return None
        if any(w.data.dim() != 3 or self.gemv_qtype(w) is None or getattr(w, "group_size", None) for w in ws):
            return None
        x, ids = x.contiguous(), ids.to(torch.int64).contiguous()
        return [self.K.cuda_gemv_experts(w.data, int(w.qtype), x, ids) for w in ws]

    def gemv_qtype(self, w) -> int | None:
        """W's GGML type id where the GEMV has a kernel for it (the int8-code path), else None."""
        qt = getattr(w, "qtype", None)
        ok = isinstance(qt, int) and not getattr(w, "is_float", False) and self.K.cuda_gemv_supported(int(qt))
        return int(qt) if ok else None

    def linear_output(self, x: torch.Tensor, w) -> torch.Tensor:
        """linear for the output projection: where W has an int8-code GEMV and x at most GEMV_MAX_M rows, through
        output_gemv (x's codes plus the codes of what they miss), GEMV_MAX_M / 2 rows a launch; else linear."""
        qt = self.gemv_qtype(w)
        if qt is None or x.shape[0] > GEMV_MAX_M:
            return self.linear(x, w)
        x = x.contiguous()
        if 2 * x.shape[0] > GEMV_MAX_M:  # GEMV_MAX_M / 2 rows (and their residual rows) a launch
            return torch.cat([self.linear_output(part, w) for part in x.split(GEMV_MAX_M // 2)])
        t, k = x.shape
        xq = torch.empty(2 * t, k, dtype=torch.int8, device=x.device)
        xds = torch.empty(2 * t, k // 32, 2, dtype=torch.float32, device=x.device)
        self.K.cuda_quantize_act(x, xq[:t], xds[:t])
        return output_gemv(self.K, w.data, qt, x, xq, xds)

    def embed(self, w, ids: torch.Tensor, check_ids: bool = True) -> torch.Tensor:
        """Rows ids [T] of W -> [T, K] f32, dequantizing only those rows.  check_ids=False inside graph capture
        (the range check syncs with the host; the runtime has already checked the tokens)."""
        ids = ids.reshape(-1).to(device=self.device, dtype=torch.long)
        qt = getattr(w, "qtype", None)
        if isinstance(qt, int) and not getattr(w, "is_float", False) and self.K.cuda_dequant_supported(int(qt)) \
                and w.shape[1] % 8 == 0:
            return self.K.cuda_dequantize(w.data, int(qt), w.shape[1], ids, False, check_ids)
        if getattr(w, "is_float", False) and not check_ids:  # QTensor.rows checks the range on the host
            return w.typed().index_select(0, ids).float()
        return w.rows(ids).float()

    def make_kv_cache(self, kind: str, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int):
        from ..runtime.kv_cache import KVCache

        return KVCache(n_layer, n_kv_head, max_seq, head_dim, kind, device=self.device)

    def attend_at(self, kv, layer: int, q: torch.Tensor, pos: torch.Tensor, scale: float,
                  window: int) -> torch.Tensor | None:
        """Decoder.attend_at's kernel: one query row q [1, H, hd] at the device-held position pos over ``kv``'s
        stored rows (the length read on the device: capturable) -> [1, H*hd]; None for several rows or a cache
        the kernel does not read."""
        if q.shape[0] != 1 or cache_problem(kv):
            return None
        kp, vp = cache_parts(kv)[layer]
        return attend_parts(self.K, q[0], kp, vp, (pos + 1).to(torch.int32), scale, window).reshape(1, -1)

    def step(self, model, seqs: list[SeqStep]) -> list[StepRows]:
        """The multi-sequence step: the decode tokens of sequences whose steps give exact rows (rows_exact) run
        together, up to GEMV_MAX_M rows a pass (CudaDecodeStep.decode_rows: each weight read once for all of them,
        each row's attention over its own cache); a lone decode token through its cache's captured step; anything
        else (prefill chunks, position 0, speculative rows) through step_one, one sequence at a time.  Every row is
        what its sequence alone gives, bit for bit."""
        check_seqs(seqs)
        out: list[StepRows | None] = [None] * len(seqs)
        batch = []
        for n, s in enumerate(seqs):
            st = self._batch_step(model, s)
            if st is None:
                out[n] = step_one(model, s, max_rows=0)
            else:
                batch.append((n, st, s))
        for a in range(0, len(batch), GEMV_MAX_M):
            part = batch[a:a + GEMV_MAX_M]
            if len(part) == 1:
                n, _, s = part[0]
                out[n] = step_one(model, s, max_rows=0)
                continue
            logits, top = part[0][1].decode_rows([st for _, st, _ in part], [s.tokens[0] for *_, s in part],
                                                 [s.pos for *_, s in part])
            logits, top = logits.float().cpu(), top.tolist()
            for r, (n, _, _) in enumerate(part):
                out[n] = StepRows(logits[r:r + 1], [top[r]])
        return out

    def _batch_step(self, model, s: SeqStep) -> "CudaDecodeStep | None":
        """The step of ``s``'s cache where its decode token can join a batched pass, else None."""
        if s.prefill or len(s.tokens) != 1 or s.pos == 0 or not getattr(model, "use_cpp_decode", False):
            return None
        st = model.fused_step(s.kv)
        if not isinstance(st, CudaDecodeStep) or not st.rows_exact:
            return None
        s.kv.check_room(s.pos, 1)
        return st

    def batch_buffers(self, step: "CudaDecodeStep", rows: int) -> StepBuffers:
        """StepBuffers for ``rows`` sequences of ``step``'s model, made once per (model, rows) and shared by its
        caches' steps (a batched pass runs eagerly, one at a time)."""
        bufs = self.__dict__.setdefault("_batch_buffers", {})
        key = (id(step.w), rows)
        if key not in bufs:
            bufs[key] = StepBuffers(step.cfg, step.w["blk.0.ffn_gate.weight"].shape[0], step.n_vocab, self.device,
                                    rows)
        return bufs[key]

    def fused_decode(self, model, kv) -> "CudaDecodeStep | None":
        """The graph-captured step for ``model`` over ``kv``, or None where it does not apply (then the model's
        torch forward runs on the GPU): a head size the attention kernel lacks, a cache without a storage
        layout, or a model without an ArchSpec."""
        why = fused_decode_problem(model, kv)
        return None if why else CudaDecodeStep(self, model, kv)

    def fused_part(self, model, kv, layers: range, ends: bool, max_seq: int = 0) -> "CudaDecodeStep | None":
        """The captured step over a run of the model's ``layers`` (the GPU side of a split model, backends/split.py),
        ``kv`` a cache of theirs alone; its ``hidden`` takes and returns the hidden state on the CPU.  None where
        fused_decode's would be, and for the embedding and head (``ends``: the CPU side holds them); None too where
        the row kernels do not take the model (the forward it would fall back on runs whole models only)."""
        if ends or kv is None or fused_decode_problem(model, kv):
            return None
        step = CudaDecodeStep(self, model, kv, layers)
        return None if step.row_kernels_problem else step


def measure_copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), the roofline the GEMV is measured
    against: the best of ``repeats`` copies of ``nbytes``."""
    dev = torch.device(device)
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    return 2 * nbytes / best


def measure_matmul_flops(device: torch.device | str = "cuda", n: int = 8192, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n fp16 matmul through cuBLAS (random operands, best of ``repeats``): the ceiling of
    the prefill path, which dequantizes to fp16 and multiplies there."""
    dev = torch.device(device)
    a = torch.randn(n, n, dtype=torch.float16, device=dev)
    b = torch.randn(n, n, dtype=torch.float16, device=dev)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    return 2 * n ** 3 / best


def roofline(device: torch.device | str = "cuda") -> dict:
    """The GPU's ceilings for `pyllm bench` rows (the CPU's come from pyllm.roofline.probe): copy bandwidth, read
    + write counted, as tg's GB/s roofline, and the fp16 matmul rate as pp's (also where the tiled types' prompt
    chunks run on int8 MMA, whose rate is twice that: the share then says how far MMQ gets past fp16's ceiling)."""
    dev = torch.device(device)
    mmq = os.environ.get("PYLLM_CUDA_MMQ", "1") != "0" and torch.cuda.get_device_capability(dev) >= (8, 0)
    return {"gpu": torch.cuda.get_device_name(dev),
            "read_gbs": measure_copy_bandwidth(device) / 1e9,
            "matmul_gflops": measure_matmul_flops(device) / 1e9,
            "prefill_kernel": "int8 MMQ (Q4_0 Q8_0 Q4_K Q6_K), else fp16 cuBLAS" if mmq else "fp16 cuBLAS"}
