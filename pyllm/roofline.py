"""The machine's roofline: measured memory read bandwidth, peak float32 matmul rate and the rate of the prefill
GEMM kernel in use (AMX / AVX-512 bf16 or fp32), cached per machine and kernel.

Decode reads every weight byte once per token, so tg tok/s is bounded by bandwidth / bytes per token; prefill
reuses weights across tokens and is bounded by arithmetic: by the prefill kernel's rate, which on AMX hardware is
many times the fp32 matmul peak. Every bench row is reported against these numbers.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

from .registry import cache_dir
from .safe_io import atomic_write


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def physical_cores() -> int:
    """Physical cores (not hyperthreads), the default thread count for decode."""
    try:
        cores = set()
        phys = core = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip():
                    if core is not None:
                        cores.add((phys, core))
                    phys = core = None
        if cores:
            return min(len(cores), len(os.sched_getaffinity(0)))
    except (OSError, AttributeError):
        pass
    return os.cpu_count() or 1


def probe_buffer(nbytes: int) -> torch.Tensor:
    """nbytes of CPU memory for a read probe, filled, asked onto huge pages before the first write as the weights'
    copies and KV caches the decode step streams are (ops.advise_huge_pages): on 4 KiB pages every page costs a TLB
    miss, and a probe that pays them reads less than the kernels do (a Xeon VM, 2 threads: 23 GB/s against 35 on
    huge pages, while the decode GEMVs read 28-29).  Where the OS gives no huge pages, neither probe nor kernels get
    them."""
    from . import ops

    buf = torch.empty(nbytes, dtype=torch.uint8)
    ops.advise_huge_pages(buf)
    return buf.fill_(1)


def measure_read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5, clock=time.perf_counter) -> float:
    """Bytes/s of a streaming read over a probe_buffer far larger than the last-level cache: the extension's
    read_sum (64-bit words on ``threads`` threads), or a torch float32 sum where the extension is not built.
    ``clock``: what the best of ``repeats`` reads is timed by (tools/bench_kernels.py --cpu-time: thread time)."""
    buf = probe_buffer(int(gib * 2**30))
    try:
        from ._ext import load

        C = load()

        def read():
            C.read_sum(buf, threads)
    except Exception:  # no extension: torch's own sum on its threads
        a = buf.view(torch.float32)

        def read():
            a.sum()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        read()  # every page touched once before the timing
        best = 0.0
        for _ in range(repeats):
            t = clock()
            read()
            best = max(best, buf.numel() / (clock() - t))
        return best
    finally:
        torch.set_num_threads(old)


def measure_matmul_flops(threads: int, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a float32 n x n matmul (oneDNN/MKL: close to the FMA peak)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - t))
        return best
    finally:
        torch.set_num_threads(old)


def _random_q4_0(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, k/32 * 18]: random Q4_0 blocks (random nibbles are valid codes) with fp16 scales of sane size."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * k // 32, 18), dtype=torch.uint8, generator=g)
    d = (torch.rand(n * k // 32, generator=g) * 0.018 + 0.002).to(torch.float16)
    raw[:, :2] = d.view(torch.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def measure_prefill_flops(threads: int, m: int = 512, n: int = 4096, k: int = 4096, repeats: int = 3) -> tuple:
    """(kernel name, FLOP/s) of the prefill GEMM that mul_mat uses above the GEMV rows, on a 512-token batch
    against a 4096 x 4096 Q4_0 weight (one Llama-3-8B projection): dequantization included, as in prefill, and for
    "int8-gemv" on the weight's interleaved copy, which the CPU backend's forward reads under it."""
    from ._ext import load
    from .formats.gguf import GGMLType

    C = load()
    old = C.get_num_threads()
    C.set_num_threads(threads)
    try:
        w = _random_q4_0(n, k)
        x = torch.randn(m, k)
        kernel = C.prefill_kernel()
        qtype = int(GGMLType.Q4_0)
        if kernel == "int8-gemv":
            w, qtype = C.repack_rows8(w, qtype), int(C.rows8_qtype(qtype))
        C.gemm(x, w, qtype, None, kernel)
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            C.gemm(x, w, qtype, None, kernel)
            best = max(best, 2 * m * n * k / (time.perf_counter() - t))
        return kernel, best
    finally:
        C.set_num_threads(old)


def _prefill_kernel() -> str:
    try:
        from ._ext import load

        return load().prefill_kernel()
    except Exception:  # no extension: the reference backend's torch matmul
        return "f32"


# The read probe's kind, part of the cache key: a figure cached by the probe on 4 KiB pages is not reused.
READ_PROBE = "huge-pages"


def _cache_key(threads: int) -> str:
    return f"{_cpu_name()}|{os.cpu_count()}|{threads}|{_prefill_kernel()}|{READ_PROBE}"


def _read_cache() -> dict:
    path = cache_dir() / "roofline.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def _write_cache(cached: dict) -> None:
    path = cache_dir() / "roofline.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(cached, indent=2))  # no planted link followed, no half file read back
    except OSError:
        pass


def probe(threads: int | None = None, force: bool = False) -> dict:
    """Measures (or loads the cached) roofline for 1 and ``threads`` threads."""
    threads = threads or physical_cores()
    key = _cache_key(threads)
    cached = _read_cache()
    if key in cached and not force:
        return cached[key]
    r = {
        "cpu": _cpu_name(),
        "threads": threads,
        "read_gbs_1t": measure_read_bandwidth(1) / 1e9,
        "read_gbs": measure_read_bandwidth(threads) / 1e9,
        "matmul_gflops_1t": measure_matmul_flops(1) / 1e9,
        "matmul_gflops": measure_matmul_flops(threads) / 1e9,
        "date": time.strftime("%Y-%m-%d"),
    }
    if _prefill_kernel() != "f32":
        r["prefill_kernel"], flops = measure_prefill_flops(threads)
        r["prefill_gflops"] = flops / 1e9
    else:  # the fp32 GEMM is the prefill path: its peak is the matmul rate
        r["prefill_kernel"], r["prefill_gflops"] = "f32", r["matmul_gflops"]
    cached[key] = r
    _write_cache(cached)
    return r


def remeasure_read_bandwidth(roof: dict, gain: float = 1.1) -> dict | None:
    """The cached roofline with its read bandwidth measured again, stored when the new figure is ``gain`` times the
    old one or more, else None. A machine under load reads slower, never faster, so the higher figure is the truer
    one: bench calls this when a run read faster than the cached figure allows."""
    threads = roof.get("threads") or physical_cores()
    gbs = measure_read_bandwidth(threads) / 1e9
    if gbs < gain * roof.get("read_gbs", 0.0):
        return None
    r = dict(roof, read_gbs=gbs, read_gbs_1t=max(roof.get("read_gbs_1t", 0.0), measure_read_bandwidth(1) / 1e9),
             date=time.strftime("%Y-%m-%d"))
    cached = _read_cache()
    cached[_cache_key(threads)] = r
    _write_cache(cached)
    return r
