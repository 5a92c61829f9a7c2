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
    python tools/bench_vs_llamacpp.py ~/.cache/pyllm/synthetic/qwen3-30b-a3b-q4_k_m.gguf -p 512 -n 128 -r 3

A model too large for both sides to hold at once (the 17 GB qwen3-30b-a3b:q4_k_m synthetic from
`pyllm bench --synthetic qwen3-30b-a3b:q4_k_m --write-gguf PATH`: llama.cpp repacks its Q4_K experts into memory
of its own, pyllm reads them from the mapped file) runs each side in a process of its own, the sides alternating
once per repetition, each process warming up with one untimed round first (--separate forces this for any model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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


def fits_twice(path: str) -> bool:
    """Whether two copies of the file fit in the memory available now (both sides loaded in one process)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return True
    return 2 * os.path.getsize(path) < 0.8 * avail


def one_side(a, path: str, kernels: list[str]) -> dict[str, float]:
    """--side: this process loads one side, runs one untimed round, then one timed round: {test: t/s}."""
    n_ctx = a.depth + max(a.n_prompt, a.n_gen) + 16
    if a.side == "pyllm":
        from pyllm import _ext

        C = _ext.load()
        default = C.prefill_kernel()
        pp, tg = pyllm_runner(path, a.threads, n_ctx, a.depth)
    else:
        C, default, kernels = None, None, [None]
        pp, tg = llamacpp_runner(path, a.threads, n_ctx, a.depth)
    out = {}
    for rep in range(2):
        for kern in kernels:
            if C is not None:
                C.set_prefill_kernel(kern)
            if a.n_prompt > 0:
                dt = pp(a.n_prompt)
                if rep:
                    out["pp" if kern is None else f"pp {kern}"] = a.n_prompt / dt
        if C is not None:
            C.set_prefill_kernel(default)
        if a.n_gen > 0:
            dt = tg(a.n_gen)
            if rep:
                out["tg"] = a.n_gen / dt
    return out


def separate_rounds(a, path: str, kernels: list[str]) -> tuple[dict, list]:
    """The sides in alternating processes: ({kernel: [pp t/s]} | {"tg": ...}, [llama.cpp rounds])."""
    ours, theirs = [], []
    for _ in range(a.repetitions):
        for side, into in (("pyllm", ours), ("llama.cpp", theirs)):
            cmd = [sys.executable, os.path.abspath(__file__), path, "--side", side, "-t", str(a.threads),
                   "-p", str(a.n_prompt), "-n", str(a.n_gen), "-d", str(a.depth), "--kernels", ",".join(kernels)]
            res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            if res.returncode:
                sys.exit(f"bench_vs_llamacpp: the {side} process failed on {path} (exit {res.returncode})")
            into.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return ours, theirs


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
    ap.add_argument("--separate", action="store_true",
                    help="each side in a process of its own, alternating per repetition (automatic for a model "
                         "whose file does not fit twice in the memory available)")
    ap.add_argument("--side", choices=["pyllm", "llama.cpp"], help=argparse.SUPPRESS)  # a --separate child
    a = ap.parse_args()

    import torch

    from pyllm import _ext, registry

    C = _ext.load()
    kernels = [k for k in a.kernels.split(",") if k] or [C.prefill_kernel()]
    default = C.prefill_kernel()

    torch.set_num_threads(a.threads)
    if a.side:
        print(json.dumps(one_side(a, str(registry.resolve(a.models[0])), kernels)))
        return 0
    print(f"| model | test | pyllm t/s | llama.cpp t/s | ratio |")
    print(f"| --- | --- | ---: | ---: | ---: |")
    for m in a.models:
        path = str(registry.resolve(m))
        name = path.rsplit("/", 1)[-1]
        if a.separate or not fits_twice(path):
            ours, theirs = separate_rounds(a, path, kernels)
            for test, n in (("pp", a.n_prompt), ("tg", a.n_gen)):
                if n <= 0:
                    continue
                st = [r[test] for r in theirs]
                for kern in (kernels if test == "pp" else [None]):
                    so = [r[f"pp {kern}" if test == "pp" else "tg"] for r in ours]
                    print_row(name, test, n, a.depth, kern, so, st)
            continue
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
            for kern in sides:
                print_row(name, test, n, a.depth, kern if test == "pp" else None, so[kern], st)
    return 0


def print_row(name: str, test: str, n: int, depth: int, kern: str | None, so: list[float], st: list[float]) -> None:
    mo, mt = statistics.fmean(so), statistics.fmean(st)
    sdo = statistics.stdev(so) if len(so) > 1 else 0
    sdt = statistics.stdev(st) if len(st) > 1 else 0
    label = f"{test}{n}" + (f" @ d{depth}" if depth else "") + (f" ({kern})" if kern else "")
    print(f"| {name} | {label} | {mo:.1f} ± {sdo:.1f} | {mt:.1f} ± {sdt:.1f} | {mo / mt:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
