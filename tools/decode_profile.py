"""How much of a decode step is spent outside the weight GEMVs (target: under 10%).

    python tools/decode_profile.py smollm2-135m qwen2.5-coder-0.5b gemma3-270m -t 2 --depth 0,512 -r 5

For each model: the wall time of one decode token through the fast path (the C++ decode step) at a given cache
depth, and the wall time of the same token's weight GEMVs called one by one through the same kernels
(pyllm._C.gemv, same thread count, each matrix once with a fresh random x, so the weights stream from memory as
they do in a step). outside = 1 - gemv / step: attention, norms, RoPE, residuals, activation quantization
between GEMVs, the embedding row and the Python call. Each figure is the best of -r rounds (noise on a shared
machine only ever adds time).
"""

from __future__ import annotations

import argparse
import time

import torch

import pyllm
from pyllm import ops


def step_time(llm, depth: int, n: int) -> float:
    g = llm.generator
    g.reset()
    if depth:
        g._forward(list(range(1, depth + 1)))
    t = time.perf_counter()
    for _ in range(n):
        g._forward([1])
    return (time.perf_counter() - t) / n


def gemv_time(llm, n: int) -> float:
    model = llm.model
    mats = [w for name, w in llm.weights.items() if len(w.shape) == 2 and name != "token_embd.weight"]
    if "output.weight" not in llm.weights:
        mats.append(model.output)  # tied embeddings: the output GEMV reads token_embd
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in mats}
    t = time.perf_counter()
    for _ in range(n):
        for w in mats:
            ops._C.gemv(xs[w.shape[1]], w.data, int(w.qtype), None, w is model.output)
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--depth", default="0", help="cache depths (tokens already cached), comma list")
    ap.add_argument("-n", type=int, default=32, help="decode tokens per round")
    ap.add_argument("-r", type=int, default=3, help="rounds (best is kept)")
    a = ap.parse_args()
    depths = [int(d) for d in a.depth.split(",")]
    print("| model | depth | step ms | GEMVs ms | outside |")
    print("|---|---:|---:|---:|---:|")
    for m in a.models:
        llm = pyllm.load(m, n_ctx=max(depths) + a.n + 8, n_threads=a.threads)
        ops._C.set_num_threads(llm.n_threads)
        for d in depths:
            step = min(step_time(llm, d, a.n) for _ in range(a.r))
            gemv = min(gemv_time(llm, a.n) for _ in range(a.r))
            print(f"| {llm.path.name} | {d} | {step * 1e3:.2f} | {gemv * 1e3:.2f} | {1 - gemv / step:.1%} |",
                  flush=True)
        del llm


if __name__ == "__main__":
    main()
