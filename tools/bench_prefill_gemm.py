"""The prefill GEMM kernels side by side: y = x[M, K] @ W[N, K]^T for random Q4_0 weights, every kernel this CPU runs
(pyllm._C.prefill_kernels(): f32, avx512-bf16, amx-bf16) plus mul_mat's 8-row GEMV chunks where M <= 32.

Times are CPU seconds of the process (time.process_time), best of -r, on 1 thread by default: on a machine shared
with other work, CPU time is what a kernel costs, while wall time also counts the time other processes held the core.
Dequantization of W is included, as in prefill.

    python tools/bench_prefill_gemm.py                       # the default shapes
    python tools/bench_prefill_gemm.py --shapes 4096x4096 --m 512 -t 2 --wall
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pyllm import _ext  # noqa: E402
from pyllm.formats.gguf import GGMLType  # noqa: E402
from pyllm.roofline import _random_q4_0  # noqa: E402

# (N, K): Llama-3-8B q/o (4096 x 4096) and down (4096 x 14336 -> here 1024 x 8192 to keep it short), SmolLM2
# (1536 x 576), Qwen2.5-0.5B (4864 x 896), a K = 256 extreme.
SHAPES = "2048x4096,1024x8192,1536x576,4864x896,8192x256"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help=f"NxK list (default {SHAPES})")
    ap.add_argument("--m", default="9,16,32,64,512", help="rows of x (default 9,16,32,64,512)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of CPU time")
    a = ap.parse_args()
    clock = time.perf_counter if a.wall else time.process_time
    C = _ext.load()
    C.set_num_threads(a.threads)
    torch.set_num_threads(a.threads)  # the f32 kernel's GEMM is torch's
    q4_0 = int(GGMLType.Q4_0)
    kernels = C.prefill_kernels()
    print(f"threads {a.threads}, {'wall' if a.wall else 'CPU'} time, ms (GFLOP/s); kernels here: {', '.join(kernels)}")
    print("| N x K | M | " + " | ".join(kernels) + " | GEMV chunks |")
    print("| --- | ---: | " + " | ".join("---:" for _ in kernels) + " | ---: |")

    def best(f):
        f()
        b = float("inf")
        for _ in range(a.repetitions):
            t = clock()
            f()
            b = min(b, clock() - t)
        return b

    for shape in a.shapes.split(","):
        N, K = map(int, shape.split("x"))
        w = _random_q4_0(N, K)
        for M in map(int, a.m.split(",")):
            x = torch.randn(M, K)
            cells = []
            for k in kernels:
                dt = best(lambda: C.gemm(x, w, q4_0, None, k))
                cells.append(f"{dt * 1e3:.2f} ({2 * M * N * K / dt / 1e9:.0f})")
            if M <= C.GEMV_CHUNKED_MAX_M:
                chunks = lambda: [C.gemv(x[i:i + 8], w, q4_0) for i in range(0, M, 8)]  # noqa: E731
                dt = best(chunks)
                cells.append(f"{dt * 1e3:.2f} ({2 * M * N * K / dt / 1e9:.0f})")
            else:
                cells.append("")
            print(f"| {N} x {K} | {M} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
