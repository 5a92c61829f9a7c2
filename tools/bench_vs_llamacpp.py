"""pyllm vs llama.cpp (llama-cpp-python, built from source on this machine) on the same GGUF and thread count.

Runs are interleaved A B A B so machine noise hits both alike; each side times only model evaluation:
pp = one batch of P prompt tokens, tg = N tokens one at a time, both from an empty cache or, with -d D (llama-bench's
depth), after D cached tokens (filled once, untimed).
Prints a markdown table with both speeds and the ratio pyllm / llama.cpp per row.  --kernels runs pyllm's pp once
per prefill GEMM kernel (f32, avx512-bf16, amx-bf16: pyllm._C.prefill_kernels()), interleaved with the rest.

    pip install llama-cpp-python      # slow: compiles llama.cpp
    python tools/bench_vs_llamacpp.py smollm2-135m qwen2.5-coder-0.5b -t 2 -p 512 -n 128 -r 5
    python tools/bench_vs_llamacpp.py smollm2-135m -p 512 -n 0 --kernels f32,amx-bf16
    python tools/bench_vs_llamacpp.py smollm2-135m -p 0 -n 128 -d 1024      # decode with 1024 tokens cached
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def depth_tokens(n: int) -> list[int]:
    return [(i * 7919) % 1000 + 100 for i in range(n)]


def llamacpp_runner(path: str, threads: int, n_ctx: int, depth: int = 0):
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=n_ctx,
                n_ubatch=n_ctx, verbose=False)
    if depth:
        llm.eval(depth_tokens(depth))

    def rewind() -> None:
        # eval() drops the cache cells from n_tokens on: back to the depth's tokens
        if depth:
            llm.n_tokens = depth
        else:
            llm.reset()

    def pp(n: int) -> float:
        toks = [(i * 7919) % 1000 + 100 for i in range(n)]
        rewind()
        t = time.perf_counter()
        llm.eval(toks)
        return time.perf_counter() - t

    def tg(n: int) -> float:
        rewind()
        t = time.perf_counter()
        for _ in range(n):
            llm.eval([1])
        return time.perf_counter() - t

    return pp, tg


def pyllm_runner(path: str, threads: int, n_ctx: int, depth: int = 0):
    import pyllm
    from pyllm.cli.bench import Subject, fill_cache, time_pp, time_tg
    from pyllm.cli.common import runtime_info

    llm = pyllm.load(path, device="cpu", n_ctx=n_ctx, n_threads=threads)
    s = Subject(path, llm.config, llm.weights, llm.model, llm.kv, llm.generator, 0, runtime_info(llm))
    if depth:
        fill_cache(s, depth)
    return (lambda n: time_pp(s, n, depth)), (lambda n: time_tg(s, n, depth))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="GGUF paths or registry names")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("-d", "--depth", type=int, default=0, help="tokens cached before each test (llama-bench's -d)")
    ap.add_argument("--kernels", default="", help="comma-separated pyllm prefill kernels for pp (default: the one "
                    "pyllm picks)")
    a = ap.parse_args()

    import torch

    from pyllm import _ext, registry

    C = _ext.load()
    kernels = [k for k in a.kernels.split(",") if k] or [C.prefill_kernel()]
    default = C.prefill_kernel()

    torch.set_num_threads(a.threads)
    print(f"| model | test | pyllm t/s | llama.cpp t/s | ratio |")
    print(f"| --- | --- | ---: | ---: | ---: |")
    for m in a.models:
        path = str(registry.resolve(m))
        n_ctx = a.depth + max(a.n_prompt, a.n_gen) + 16
        ours = pyllm_runner(path, a.threads, n_ctx, a.depth)
        theirs = llamacpp_runner(path, a.threads, n_ctx, a.depth)
        for test, n, k in (("pp", a.n_prompt, 0), ("tg", a.n_gen, 1)):
            if n <= 0:
                continue
            sides = kernels if test == "pp" else [default]
            so = {kern: [] for kern in sides}
            st = []
            for rep in range(a.repetitions + 1):  # the first round warms both up
                for kern in sides:
                    C.set_prefill_kernel(kern)
                    dt = ours[k](n)
                    if rep:
                        so[kern].append(n / dt)
                dt = theirs[k](n)
                if rep:
                    st.append(n / dt)
            C.set_prefill_kernel(default)
            mt = statistics.fmean(st)
            sdt = statistics.stdev(st) if len(st) > 1 else 0
            name = path.rsplit("/", 1)[-1]
            for kern in sides:
                mo = statistics.fmean(so[kern])
                sdo = statistics.stdev(so[kern]) if len(so[kern]) > 1 else 0
                label = f"{test}{n}" + (f" @ d{a.depth}" if a.depth else "") + (f" ({kern})" if test == "pp" else "")
                print(f"| {name} | {label} | {mo:.1f} ± {sdo:.1f} | {mt:.1f} ± {sdt:.1f} | {mo / mt:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
