#!/usr/bin/env python
"""Decode GEMV (and prefill GEMM) kernel speed against the machine's measured memory read bandwidth.

    python tools/bench_kernels.py                      # default types, 1 and all-core threads, markdown table
    python tools/bench_kernels.py --types Q4_0,Q4_K --threads 1,2 --m 1,8 --repeat 3
    python tools/bench_kernels.py --types Q4_0,AWQ_G128 --cpu-time    # AWQ int4 rows (pyllm/formats/awq/repack.py AWQRows)
    python tools/bench_kernels.py --isa avx2,avx512 --cpu-time        # A/B: kernel paths interleaved per point
    python tools/bench_kernels.py --types Q8_0 --shapes 49152x576 --m 1,4 --precise-x   # the output projection
    python tools/bench_kernels.py --rows8 --isa avx2,avx512 --m 1,4,8 --cpu-time   # the decode step's layout

Decode reads every weight byte once per token, so a GEMV's figure of merit is GB/s of weight bytes read,
compared with a plain streaming read (pyllm.roofline.measure_read_bandwidth: read_sum over 1 GiB on huge pages, with
the same thread count).  Matrices are 4096x14336, 14336x4096 and 4096x4096 (Llama-3-8B's FFN and attention shapes);
enough copies of each are cycled through that every call reads from DRAM, not from the last-level cache, and they lie
on huge pages where Linux gives them (as the decode step's weight copies do).  Numbers
are noisy on a shared machine: each point is the best of --repeat rounds of several calls.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyllm import _ext, roofline  # noqa: E402
from pyllm.runtime.kv_cache import cache_memory  # noqa: E402

# ggml id, block size, bytes per block, fp16 field offsets
TYPES = {
    "F32": (0, 1, 4, []), "F16": (1, 1, 2, []), "BF16": (30, 1, 2, []),
    "Q4_0": (2, 32, 18, [0]), "Q4_1": (3, 32, 20, [0, 2]), "Q5_0": (6, 32, 22, [0]), "Q5_1": (7, 32, 24, [0, 2]),
    "Q8_0": (8, 32, 34, [0]), "Q2_K": (10, 256, 84, [80, 82]), "Q3_K": (11, 256, 110, [108]),
    "Q4_K": (12, 256, 144, [0, 2]), "Q5_K": (13, 256, 176, [0, 2]), "Q6_K": (14, 256, 210, [208]),
    # pyllm's AWQ rows (csrc/common/blocks.h): a "block" is one group; the fp16 scales sit after the codes
    "AWQ_G32": (56, 32, 19, None), "AWQ_G64": (57, 64, 35, None), "AWQ_G128": (58, 128, 67, None),
    "AWQ_G256": (59, 256, 131, None),
}
SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096)]  # (N, K)
OUT_OF_CACHE_BYTES = 256 << 20  # cycle through at least this much weight data (L3 here: 32 MiB)


def random_weight(name: str, N: int, K: int, rng) -> torch.Tensor:
    tid, bs, ts, f16 = TYPES[name]
    if bs == 1:
        v = rng.standard_normal((N, K), dtype=np.float32)
        v = v if name == "F32" else (v.astype(np.float16) if name == "F16" else (v.view(np.uint32) >> 16).astype(np.uint16))
        return torch.from_numpy(v.view(np.uint8).reshape(N, -1).copy())
    if f16 is None:  # AWQ rows: scales fp16 [K/G] | zeros u8 [K/G] | codes [K/2]
        raw = rng.integers(0, 256, (N, K // bs * ts), dtype=np.uint8)
        raw[:, :2 * (K // bs)] = rng.uniform(0.002, 0.02, (N, K // bs)).astype(np.float16).view(np.uint8)
        return torch.from_numpy(raw)
    nb = N * K // bs
    raw = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    for off in f16:
        raw[:, off:off + 2] = rng.uniform(0.002, 0.02, (nb, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(N, -1))


def bench_gemv(C, ws: list[torch.Tensor], tid: int, M: int, repeat: int, gemm: bool = False,
               clock=time.perf_counter, precise_x: bool = False, K: int | None = None) -> float:
    """Best seconds per call, cycling through the copies in ws (K: the row length, where tid is not in TYPES)."""
    K = K or ws[0].shape[1] * TYPES_BY_ID[tid][1] // TYPES_BY_ID[tid][2]
    x = torch.randn(M, K)
    out = torch.empty(M, ws[0].shape[0])
    f = C.gemm if gemm else (lambda x, w, t, o: C.gemv(x, w, t, o, precise_x))
    for w in ws:
        f(x, w, tid, out)
    calls = max(len(ws), 8)
    best = math.inf
    for _ in range(repeat):
        t = clock()
        for i in range(calls):
            f(x, ws[i % len(ws)], tid, out)
        best = min(best, (clock() - t) / calls)
    return best


TYPES_BY_ID = {v[0]: v for v in TYPES.values()}


def positive_ints(text: str, sep: str = ",") -> list[int]:
    """argparse type: "1,4,8" -> [1, 4, 8]; anything else is a usage error, not a traceback."""
    try:
        vals = [int(v) for v in text.split(sep)]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by {sep!r}, got {text!r}")
    return vals


def shape_list(text: str) -> list[tuple[int, int]]:
    """argparse type: "4096x4096,1536x576" -> [(4096, 4096), (1536, 576)]."""
    shapes = [tuple(positive_ints(s, "x")) for s in text.split(",")]
    if any(len(s) != 2 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected NxK,... got {text!r}")
    return shapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K,F16")
    ap.add_argument("--threads", type=positive_ints, default=None, help="comma list (default: 1 and the physical core count)")
    ap.add_argument("--m", type=positive_ints, default=[1], help="activation rows, comma list (<= 8: fused GEMV)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--isa", default=None,
                    help="scalar | avx2 | avx512 | amx, or a comma list to compare: the paths alternate round by "
                         "round at every point and a ratio column gives each one's speed over the first "
                         "(default: the extension's choice)")
    ap.add_argument("--shapes", type=shape_list, default=None, help="NxK,... (default: 14336x4096,4096x14336,4096x4096)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="single-thread rates per CPU-second (time.thread_time) instead of wall time: on a loaded "
                         "machine this still shows the kernel's efficiency against the bus")
    ap.add_argument("--precise-x", action="store_true",
                    help="GEMVs with 16-bit activations (gemv's precise_x: the output projection's Q8_0 kernel)")
    ap.add_argument("--rows8", action="store_true",
                    help="weights with their rows interleaved by 8 (_C.repack_rows8), the copy the decode step and "
                         "a speculative verification pass read")
    a = ap.parse_args()
    if a.rows8 and max(a.m) > 8:
        ap.error("--rows8: the interleaved layout has GEMV kernels only, for up to 8 rows (--m)")

    C = _ext.load()
    isas = a.isa.split(",") if a.isa else [C.get_isa()]
    C.set_isa(isas[0])
    threads = a.threads or sorted({1, C.physical_cores()})
    shapes = a.shapes or SHAPES
    ms = a.m
    rng = np.random.default_rng(0)

    clock = time.perf_counter
    if a.cpu_time:
        threads, clock = [1], time.thread_time
    bw = {}
    for t in threads:
        bw[t] = roofline.measure_read_bandwidth(t, repeats=max(3, a.repeat), clock=clock)
    unit = "GB per CPU-second" if a.cpu_time else "GB/s"
    print(f"# pyllm kernel bench: isa={','.join(isas)}, {'CPU time' if a.cpu_time else 'wall time'}, "
          f"{'int16 activations (precise_x), ' if a.precise_x else ''}"
          f"{'rows interleaved by 8, ' if a.rows8 else ''}load average "
          f"{os.getloadavg()[0]:.1f} (other processes share these cores: numbers are noisy)")
    print("read bandwidth (1 GiB streaming sum): " + ", ".join(f"{t} thread(s) {bw[t] / 1e9:.1f} {unit}" for t in threads))
    print()
    print("| type | N x K | M | threads | isa | weight MB | us/call | GB/s | % of read BW | vs first isa |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in a.types.split(","):
        tid = TYPES[name][0]
        for N, K in shapes:
            w0 = random_weight(name, N, K, rng)
            copies = max(1, math.ceil(OUT_OF_CACHE_BYTES / w0.numel()))
            ws = [w0] + [w0.clone() for _ in range(copies - 1)]
            wid = tid
            if a.rows8:
                try:
                    ws = [C.repack_rows8(w, tid) for w in ws]
                    wid = int(C.rows8_qtype(tid))
                except (ValueError, NotImplementedError) as e:
                    sys.exit(f"bench_kernels: --rows8: {e}")
            # on huge pages, as the decode step's copies are (a 4 KiB page costs a stream a TLB miss)
            ws = [cache_memory(w.shape, w.dtype, "cpu", zero=False).copy_(w) for w in ws]
            for M in ms:
                for t in threads:
                    C.set_num_threads(t)
                    best = {i: math.inf for i in isas}
                    for _ in range(a.repeat):  # interleaved, so load changes hit every path alike
                        for i in isas:
                            C.set_isa(i)
                            best[i] = min(best[i], bench_gemv(C, ws, wid, M, 1, gemm=M > 8, clock=clock,
                                                                  precise_x=a.precise_x, K=K))
                    for i in isas:
                        s = best[i]
                        gbs = w0.numel() / s / 1e9
                        print(f"| {name} | {N}x{K} | {M} | {t} | {i} | {w0.numel() / 1e6:.1f} | {s * 1e6:.0f} | "
                              f"{gbs:.1f} | {100 * gbs * 1e9 / bw[t]:.0f}% | {best[isas[0]] / s:.2f} |", flush=True)
            del ws, w0
    return 0


if __name__ == "__main__":
    sys.exit(main())
