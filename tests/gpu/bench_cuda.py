"""GPU benchmarks for tools/gpu_check.sh (not a pytest file): GEMV GB/s against the measured copy bandwidth (the
GGUF-order kernel and the tiled one, csrc/cuda/gemv_tiled.cu, on the same weights; AWQ int4 at group size 128: the AWQ
row kernel and the tiled one), a 512-token prompt chunk's matrix
product through MMQ (csrc/cuda/mmq.cu) and through dequantize + fp16 cuBLAS, and synthetic Llama-3-8B
decode/prefill through the CUDA backend (pyllm/backends/cuda.py: the model's prefill, the graph-captured decode step,
f16 and q8_0 caches; the weights tiled at upload, and with PYLLM_CUDA_TILED=0 in GGUF order) with a torch fp16
baseline. Prints a table last.

Timing follows /work/.library/device/METHOD.md: warm-up first, CUDA events, the GEMV calls captured in a graph
(20 calls rotating over weight copies that together exceed the L2, so launch gaps and cache hits stay out),
random data (never zeros), median of repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pyllm.backends import cuda as cuda_backend  # noqa: E402
from pyllm.formats.awq.repack import AWQRows  # noqa: E402
from pyllm.formats.gguf import BLOCK_INFO, GGMLType  # noqa: E402
from pyllm.formats.quant import QTensor  # noqa: E402

SCALE_OFFSETS = {GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q8_0: (0,),
                 GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,)}
TYPES = list(SCALE_OFFSETS)
SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096), (128256, 4096)]  # (N out, K in)
L2_BYTES = 60 << 20


def random_weight(qtype: GGMLType, n: int, k: int, name: str = "w") -> QTensor:
    """Random blocks made on the GPU, fp16 scales set to a small finite value."""
    bs, ts = BLOCK_INFO[qtype]
    data = torch.randint(0, 256, (n * (k // bs), ts), dtype=torch.uint8, device="cuda")
    s = torch.tensor([0.002], dtype=torch.float16).view(torch.uint8).cuda()
    for off in SCALE_OFFSETS.get(qtype, ()):
        data[:, off:off + 2] = s
    return QTensor(qtype, (n, k), data.view(n, -1), name)


def median_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy, bytes read + written."""
    n = 2 << 30
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a))
    del a, b
    return 2 * n / ms / 1e6


TILED_TYPES = [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K]  # csrc/common/gemv_tiled.h, and AWQ rows
AWQ_GROUP = 128  # AutoAWQ checkpoints' usual group size
GEMV_TYPES = TYPES + [f"AWQ_G{AWQ_GROUP}"]  # the GEMV table's rows: the GGUF types, then AWQ int4


def random_awq(K, n: int, k: int, g: int = AWQ_GROUP, name: str = "w") -> AWQRows:
    """Random AWQ rows (csrc/common/blocks.h AwqRow) made on the GPU: fp16 scales set to a small finite value, zeros
    0..15."""
    ng = k // g
    data = torch.randint(0, 256, (n, 3 * ng + k // 2), dtype=torch.uint8, device="cuda")
    data[:, :2 * ng] = torch.tensor([0.002], dtype=torch.float16).view(torch.uint8).cuda().repeat(ng)
    data[:, 2 * ng:3 * ng] &= 15
    return AWQRows(data, int(K.awq_qtype(g)), (n, k), g, name)
# the GEMV variants measured per (type, shape): the GGUF-order kernel (gemv.cu, 4 rows per CTA), and the tiled one
# (gemv_tiled.cu) with its automatic K split, with programmatic launches (PYLLM_CUDA_PDL=1), and each split forced
VARIANTS = ("gguf", "tiled", "tiled pdl", "tiled W1", "tiled W2", "tiled W4")


def tiled_copy(K, w) -> torch.Tensor:
    """w's blocks (a QTensor) or AWQ rows (AWQRows) in the tiled layout, on the GPU (tiled on the host, as the
    backend's upload does)."""
    return K.cuda_tile_weight(w.data.cpu(), int(w.qtype), w.shape[1]).cuda()


def time_gemv(K, datas: list, qt: int, xq, xds, out, calls: int = 20) -> float:
    """ms per call of cuda_gemv_q over ``datas`` in turn, captured in a graph (launch settings read at capture)."""
    for d in datas:  # warm-up outside capture
        K.cuda_gemv_q(d, qt, xq, xds, out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            K.cuda_gemv_q(datas[i % len(datas)], qt, xq, xds, out)
    ms = median_ms(g.replay) / calls
    del g
    return ms


def bench_gemv(K, bw: float) -> list[dict]:
    """The GEMV alone (cuda_gemv_q on prepared codes, as the step calls it): each VARIANTS entry the type has ("gguf":
    the weights as the file has them, for AWQ its rows through gemv.cu's AWQ kernel)."""
    rows = []
    for t in GEMV_TYPES:
        awq = isinstance(t, str)
        name = t if awq else t.name
        for n, k in SHAPES:
            def make():
                return random_awq(K, n, k) if awq else random_weight(t, n, k)

            w0 = make()
            copies = max(2, min(8, math.ceil(3 * L2_BYTES / w0.nbytes)))
            ws = [w0] + [make() for _ in range(copies - 1)]
            xq, xds = K.cuda_quantize_act(torch.randn(1, k, device="cuda"))
            out = torch.empty(1, n, device="cuda")
            tiled = [tiled_copy(K, w) for w in ws] if awq or t in TILED_TYPES else None
            tid = K.cuda_tiled_qtype(int(w0.qtype)) if tiled else -1
            for v in VARIANTS:
                if v != "gguf" and tiled is None:
                    continue
                if v == "tiled pdl":
                    os.environ["PYLLM_CUDA_PDL"] = "1"
                K.cuda_set_gemv_tiled_split(int(v[-1]) if v.startswith("tiled W") else 0)
                ms = time_gemv(K, [w.data for w in ws] if v == "gguf" else tiled,
                               int(w0.qtype) if v == "gguf" else tid, xq, xds, out)
                os.environ.pop("PYLLM_CUDA_PDL", None)
                K.cuda_set_gemv_tiled_split(0)
                gbs = w0.nbytes / ms / 1e6
                split = K.cuda_gemv_tiled_split(tid, n, k, 1) if v in ("tiled", "tiled pdl") else None
                rows.append(dict(type=name, N=n, K=k, variant=v, us=ms * 1e3, GBs=gbs, pct=100 * gbs / bw,
                                 split=split))
                print(f"gemv {name:8s} {n:6d}x{k:<6d} {v:10s} {ms * 1e3:8.2f} us {gbs:7.0f} GB/s "
                      f"{100 * gbs / bw:5.1f}%" + (f" (split {split})" if split else ""), flush=True)
            del ws, tiled
    return rows


PREFILL_SHAPES = SHAPES[:3]  # the layer matrices (the output projection takes one row per prompt)


def bench_prefill_gemm(K, tokens: int = 512) -> list[dict]:
    """One prompt chunk's matrix product alone, per tiled type and 8B layer shape, on the same weights: MMQ
    (cuda_quantize_act + cuda_mmq, csrc/cuda/mmq.cu) against the backend's other prefill path, dequantize to fp16 +
    cuBLAS (cuda_dequantize + torch.matmul); TOPS count 2 M N K."""
    rows = []
    dev = torch.cuda.current_device()
    for t in TILED_TYPES:
        for n, k in PREFILL_SHAPES:
            w = random_weight(t, n, k)
            wt, tid = tiled_copy(K, w), K.cuda_tiled_qtype(int(t))
            x = torch.randn(tokens, k, device="cuda")
            if not K.cuda_mmq_supported(tid, dev):
                print(f"prefill gemm {t.name}: no MMQ on this GPU", flush=True)
                continue

            def mmq():
                xq, xds = K.cuda_quantize_act(x)
                return K.cuda_mmq(wt, tid, xq, xds)

            def cublas():
                wd = K.cuda_dequantize(wt, tid, k, None, True, True)
                return (x.to(torch.float16) @ wd.T).float()

            res = dict(type=t.name, N=n, K=k, M=tokens)
            for name, fn in (("mmq", mmq), ("cublas", cublas)):
                ms = median_ms(fn)
                res[f"{name} us"], res[f"{name} TOPS"] = ms * 1e3, 2 * tokens * n * k / ms / 1e9
            rows.append(res)
            print(f"prefill gemm {t.name:5s} {n:6d}x{k:<6d} M={tokens}: mmq {res['mmq us']:8.1f} us "
                  f"{res['mmq TOPS']:6.1f} TOPS, dequantize + fp16 cuBLAS {res['cublas us']:8.1f} us "
                  f"{res['cublas TOPS']:6.1f} TOPS, {res['cublas us'] / res['mmq us']:.2f}x", flush=True)
            del w, wt, x
    return rows


def llama3_8b(ftype: str):
    from pyllm.models.config import ModelConfig

    L, D, FF, H, HKV, HD, V = 32, 4096, 14336, 32, 8, 128, 128256
    cfg = ModelConfig(arch="llama", n_layer=L, n_embd=D, n_ff=FF, n_head=H, n_kv_head=HKV, head_dim=HD, n_vocab=V,
                      n_ctx_train=8192, rope_base=500000.0, rope_dim=HD, rope_style="norm", rms_eps=1e-5)
    main = {"q4_k_m": GGMLType.Q4_K, "q4_0": GGMLType.Q4_0}[ftype]
    w = {"token_embd.weight": random_weight(main, V, D), "output.weight": random_weight(GGMLType.Q6_K, V, D),
         "output_norm.weight": QTensor(GGMLType.F32, (D,), torch.ones(D, device="cuda").view(torch.uint8))}
    for i in range(L):
        p = f"blk.{i}."
        more = ftype == "q4_k_m" and (i < L // 8 or i >= 7 * L // 8 or (i - L // 8) % 3 == 2)
        vt = GGMLType.Q6_K if more else main
        for n in ("attn_norm", "ffn_norm"):
            w[p + n + ".weight"] = QTensor(GGMLType.F32, (D,), torch.ones(D, device="cuda").view(torch.uint8))
        w[p + "attn_q.weight"] = random_weight(main, H * HD, D)
        w[p + "attn_k.weight"] = random_weight(main, HKV * HD, D)
        w[p + "attn_v.weight"] = random_weight(vt, HKV * HD, D)
        w[p + "attn_output.weight"] = random_weight(main, D, H * HD)
        w[p + "ffn_gate.weight"] = random_weight(main, FF, D)
        w[p + "ffn_up.weight"] = random_weight(main, FF, D)
        w[p + "ffn_down.weight"] = random_weight(vt, D, FF)
    return cfg, w


BATCHES = (1, 4, 8, 16, 64)  # 8: the most rows one GEMV pass takes; 16 and 64 take several passes


def bench_batched(backend, model, cfg, steps: int = 32) -> dict:
    """Aggregate decode tok/s of B streams (f16 caches, 64-token prompts) through CudaBackend.step, B in BATCHES:
    B decode rows a pass (M-row GEMVs, eager); B = 1 is the captured one-token step."""
    from pyllm.backends.base import SeqStep

    out = {}
    prompt = torch.randint(0, cfg.n_vocab, (64,)).tolist()
    for bsz in BATCHES:
        kvs = [backend.make_kv_cache("f16", cfg.n_layer, cfg.n_kv_head, 64 + steps + 8, cfg.head_dim)
               for _ in range(bsz)]
        model.step([SeqStep(kv, prompt, 0, prefill=True) for kv in kvs])

        def run(first: int, n: int):
            for i in range(n):
                model.step([SeqStep(kv, [1], first + i) for kv in kvs])

        run(64, 4)  # warm: graphs captured, buffers made
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(68, steps)
        out[f"batch{bsz} tok/s"] = bsz * steps / (time.perf_counter() - t0)
        del kvs
    return out


def to_fp16(K, w: dict) -> dict:
    out = {}
    for name, t in w.items():
        if len(t.shape) == 2 and name != "token_embd.weight":
            d = K.cuda_dequantize(t.data, int(t.qtype), t.shape[1], None, True, True)
            out[name] = QTensor(GGMLType.F16, t.shape, d.view(torch.uint8), name)
        else:
            out[name] = t
    return out


def tile_weights(K, w: dict) -> dict:
    """The weights as CudaBackend.prepare_weights uploads them: every matrix a GEMV reads in the tiled layout where
    its type and shape have one."""
    out = {}
    for name, t in w.items():
        if len(t.shape) == 2 and not name.endswith("embd.weight") and K.cuda_tileable(int(t.qtype), *t.shape):
            out[name] = cuda_backend.CudaTiledTensor(K.cuda_tiled_qtype(int(t.qtype)), t.qtype, t.shape,
                                                     tiled_copy(K, t), name)
        else:
            out[name] = t
    return out


def pp512_mmq(backend, model, cfg, prompt, ftype: str, pp512_cublas: float) -> dict:
    """pp512 with the tiled layer matrices through MMQ (csrc/cuda/mmq.cu), beside the same weights' pp512 through
    dequantize + fp16 cuBLAS measured just before (bench_decode runs under PYLLM_CUDA_MMQ=0): the prefill target's
    ratio, from one run.  Last for its model, and a failure is recorded, not raised, so a kernel fault leaves the
    other numbers."""
    out = {"pp512 cublas": pp512_cublas}
    base = GGMLType.Q4_K if ftype == "q4_k_m" else GGMLType.Q4_0
    os.environ.pop("PYLLM_CUDA_MMQ", None)
    try:
        out["mmq"] = "yes" if backend.mmq_wanted(backend.K.cuda_tiled_qtype(int(base))) else "no (dequantize + cuBLAS)"
        kv = backend.make_kv_cache("f16", cfg.n_layer, cfg.n_kv_head, 640, cfg.head_dim)
        out["pp512 mmq"] = 512 / median_ms(lambda: model.forward(prompt, 0, kv), reps=3, warmup=1) * 1e3
    except Exception as e:  # noqa: BLE001 -- reported in the table
        out["pp512 mmq"] = None
        out["mmq"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
    finally:
        os.environ["PYLLM_CUDA_MMQ"] = "0"
    print(json.dumps(out), flush=True)
    return out


def bench_decode(backend, ftype: str, bw: float, ctx: int, fp16_baseline: bool) -> list[dict]:
    from pyllm.models.transformer import Transformer

    K = backend.K
    cfg, w = llama3_8b(ftype)
    rows = []
    variants = [(ftype, w), (f"{ftype} tiled", "tiled")] + ([("fp16 torch", None)] if fp16_baseline else [])
    for label, weights in variants:
        if weights == "tiled":
            weights = tile_weights(K, w)
        if weights is None:
            weights = to_fp16(K, w)
            del w
            torch.cuda.empty_cache()
        per_token = sum(t.nbytes for n, t in weights.items() if n != "token_embd.weight")
        model = Transformer(cfg, weights, backend, max_pos=ctx + 160)
        prompt = torch.randint(0, cfg.n_vocab, (512,))
        res = dict(model=f"llama3-8b {label}", GB_per_token=per_token / 1e9)
        for kind in ("f16", "q8_0"):
            kv = backend.make_kv_cache(kind, cfg.n_layer, cfg.n_kv_head, ctx + 160, cfg.head_dim)
            pp_ms = median_ms(lambda: model.forward(prompt, 0, kv), reps=3, warmup=1)
            if kind == "f16":
                res["pp512"] = 512 / pp_ms * 1e3
            # "pdl": the row kernels launched programmatically (PYLLM_CUDA_PDL=1, csrc/cuda/common.cuh), read at
            # each launch, so baked into the graph the first call captures
            bodies = (["row kernels", "torch", "pdl"] if label == ftype else ["row kernels", "pdl"]
                      if label.endswith("tiled") else ["row kernels"]) if kind == "f16" else ["row kernels"]
            for body in bodies:
                if body == "pdl":
                    os.environ["PYLLM_CUDA_PDL"] = "1"
                step = backend.fused_decode(model, kv)
                if body == "torch":
                    step.row_kernels_problem = "bench: the torch body for comparison"
                suffix = {"row kernels": "", "torch": " torch body", "pdl": " pdl"}[body]
                for pos, key in ((512, "tg128"), (ctx, f"tg128@{ctx}")):
                    for i in range(4):  # warm (the first call captures the graph)
                        step(1, pos + i)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for i in range(128):  # each step returns CPU logits: one sync per token, as in generation
                        step(1, pos + i)
                    res[f"{key} {kind}{suffix}"] = 128 / (time.perf_counter() - t0)
                res[f"graph {kind}{suffix}"] = "replay" if step.policy.captured and not step.policy.failed else \
                    f"eager ({step.policy.failed})"
                res[f"row kernels {kind}{suffix}"] = step.row_kernels_problem or "yes"
                os.environ.pop("PYLLM_CUDA_PDL", None)
                del step
            del kv
        if label == ftype:
            res.update(bench_batched(backend, model, cfg))
        res["roofline_pct"] = 100 * res["tg128 f16"] * per_token / (bw * 1e9)
        if label.endswith("tiled"):
            res.update(pp512_mmq(backend, model, cfg, prompt, ftype, res["pp512"]))
        rows.append(res)
        print(json.dumps(res), flush=True)
        del model, weights
        torch.cuda.empty_cache()
    return rows


# ~190 tokens: a mean over 57 (the first paragraph alone) swung by ~20% with a single position's KL
KL_TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion about "
           "the costs of the new library, the members agreed to postpone the decision until the next meeting, when "
           "the architect will present a revised plan. Meanwhile, volunteers will collect opinions from residents.\n\n"
           "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be "
           "positive')\n    total = sum(values[:window])\n    out = [total / window]\n    for i in range(window, "
           "len(values)):\n        total += values[i] - values[i - window]\n        out.append(total / window)\n"
           "    return out\n\nIn the spring the river rises quickly, and the old bridge near the mill has to be "
           "closed for a few days each year. Farmers on the east bank then drive twenty kilometres to the next "
           "crossing, which is why the council has asked twice for a new bridge.")


def kl_real_model(path: str, n_ctx: int = 256) -> dict:
    """Mean KL from the float32 reference backend's next-token distribution, token by token over KL_TEXT (teacher
    forcing: every position through the decode step), of the CUDA backend and of the CPU backend (the
    target: CUDA <= 1e-3)."""
    import pyllm

    ref = pyllm.load(path, device="cpu", kernels="reference", n_ctx=n_ctx)
    ids = ref.tokenize(KL_TEXT)
    out = {"model": path, "positions": len(ids)}

    def logits(llm):
        llm.generator.reset()
        return [llm.generator._forward([t])[-1].double().cpu() for t in ids]

    want = logits(ref)
    for name, device in (("cuda", "cuda"), ("cpu", "cpu")):
        got = logits(pyllm.load(path, device=device, n_ctx=n_ctx))
        kls = []
        for w, g in zip(want, got):
            p, q = torch.log_softmax(w, -1), torch.log_softmax(g, -1)
            kls.append(float((p.exp() * (p - q)).sum()))
        out[f"mean KL {name}"] = sum(kls) / len(kls)
        out[f"max KL {name}"] = max(kls)
    print(json.dumps(out), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--kl-model", help="a real GGUF (tools/requantize_gguf.py keep --layers N cuts one to size): "
                    "mean KL of CUDA and CPU logits from the float32 reference")
    args = ap.parse_args()
    kl = kl_real_model(args.kl_model) if args.kl_model else None
    backend = cuda_backend.create("cuda")
    K = backend.K
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(f"device {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__} cuda {torch.version.cuda}; "
          f"copy bandwidth {bw:.0f} GB/s", flush=True)
    gemv = bench_gemv(K, bw)
    dec = []
    if not args.no_decode:
        # every model's pp512 through dequantize + fp16 cuBLAS, as before MMQ; pp512_mmq lifts this for its own run
        os.environ["PYLLM_CUDA_MMQ"] = "0"
        for i, ft in enumerate(("q4_k_m", "q4_0")):
            try:
                dec += bench_decode(backend, ft, bw, args.ctx, fp16_baseline=i == 0)
            except Exception as e:  # report and keep the GEMV table
                print(f"decode bench {ft} failed: {type(e).__name__}: {e}", flush=True)
        os.environ.pop("PYLLM_CUDA_MMQ", None)
    try:  # last: a kernel fault here leaves the numbers above
        prefill = bench_prefill_gemm(K)
    except Exception as e:  # noqa: BLE001 -- reported
        print(f"prefill matmul bench failed: {type(e).__name__}: {e}", flush=True)
        prefill = []
    Path(args.out, "bench.json").write_text(json.dumps(dict(copy_GBs=bw, gemv=gemv, prefill_gemm=prefill, decode=dec,
                                                            kl=kl), indent=1))
    print(f"\n=== GEMV (M=1): GB/s and % of copy bandwidth {bw:.0f} GB/s; gguf = gemv.cu (GGUF order; AWQ: its row "
          f"kernel), tiled = gemv_tiled.cu (auto split; pdl: PYLLM_CUDA_PDL=1; W1/W2/W4: split forced) ===")
    print(f"{'type':8s} {'kernel':10s} " + "".join(f"{f'{n}x{k}':>16s}" for n, k in SHAPES))
    for t in GEMV_TYPES:
        name = getattr(t, "name", t)
        for v in VARIANTS:
            cells = [r for r in gemv if r["type"] == name and r["variant"] == v]
            if cells:
                print(f"{name:8s} {v:10s} " + "".join(f"{r['GBs']:9.0f} {r['pct']:4.0f}%" for r in cells))
    if prefill:
        print("=== prefill matmul, M=512 (us; MMQ = csrc/cuda/mmq.cu int8 MMA vs dequantize + fp16 cuBLAS) ===")
        for r in prefill:
            print(f"{r['type']:6s} {r['N']:6d}x{r['K']:<6d} mmq {r['mmq us']:8.1f} ({r['mmq TOPS']:5.0f} TOPS)  "
                  f"cublas {r['cublas us']:8.1f} ({r['cublas TOPS']:5.0f} TFLOPS)  {r['cublas us'] / r['mmq us']:.2f}x")
    if dec:
        print("=== synthetic Llama-3-8B (tok/s) ===")
        for r in dec:
            if "pp512 mmq" in r:
                mmq = r["pp512 mmq"]
                print(f"{r['model']:22s} pp512 MMQ " + (f"{mmq:7.0f}" if mmq else "   n/a") + f" (mmq: {r['mmq']})  "
                      f"dequantize + fp16 cuBLAS {r['pp512 cublas']:7.0f}" +
                      (f"  {mmq / r['pp512 cublas']:.2f}x (target 1.5x)" if mmq else ""))
            if "tg128 f16 torch body" in r:
                print(f"{r['model']:22s} torch body: tg128 {r['tg128 f16 torch body']:6.1f}")
            if "tg128 f16 pdl" in r:
                print(f"{r['model']:22s} programmatic launches (PYLLM_CUDA_PDL=1): tg128 {r['tg128 f16 pdl']:6.1f}  "
                      f"tg128@{args.ctx} {r[f'tg128@{args.ctx} f16 pdl']:6.1f}")
            if "batch1 tok/s" in r:
                print(f"{r['model']:22s} batched decode, aggregate tok/s at " +
                      "  ".join(f"{b} streams {r[f'batch{b} tok/s']:7.1f}" for b in BATCHES))
            print(f"{r['model']:22s} pp512 {r['pp512']:7.0f}  tg128 {r['tg128 f16']:6.1f}  "
                  f"tg128@{args.ctx} f16 {r[f'tg128@{args.ctx} f16']:6.1f} q8_0 {r[f'tg128@{args.ctx} q8_0']:6.1f}  "
                  f"{r['GB_per_token']:.2f} GB/tok  {r['roofline_pct']:.0f}% of copy-BW roofline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
