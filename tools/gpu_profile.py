"""Where one decode token's GPU time goes: the CUDA step of a synthetic Llama-3-8B (tests/gpu/bench_cuda.py's
weights, random blocks made on the GPU) timed as a replayed graph, through step() (with the logits' copy to the
host), eagerly, and under torch.profiler, which lists every kernel's share of an eager step.

    python tools/gpu_profile.py [--ftype q4_k_m|q4_0] [--kv f16|q8_0|...] [--pos 320] [--torch-body] [--pdl]

For a device call (/work/.library/device/README.md): ~40 s on an H200 after the extension is built.  The table is
what the kernel work is ranked by (on the H200, 2026-12-04: the decode attention's chunk kernel held 62% of a token).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]

from bench_cuda import llama3_8b  # noqa: E402
from pyllm.backends import cuda as cb  # noqa: E402
from pyllm.models.transformer import Transformer  # noqa: E402


def per_token_ms(fn, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ftype", default="q4_k_m", choices=["q4_k_m", "q4_0"])
    ap.add_argument("--kv", default="f16", help="KV cache kind (f16, q8_0, q4_0, q8_rot, ...)")
    ap.add_argument("--pos", type=int, default=320, help="position of the profiled tokens")
    ap.add_argument("--torch-body", action="store_true", help="the step in torch ops, not the row kernels")
    ap.add_argument("--pdl", action="store_true",
                    help="programmatic dependent launches (PYLLM_CUDA_PDL=1: csrc/cuda/common.cuh)")
    a = ap.parse_args()
    if a.pdl:
        os.environ["PYLLM_CUDA_PDL"] = "1"  # read at each launch, so also by the graph's capture
    try:
        backend = cb.create("cuda")
    except cb.BackendUnavailable as e:
        sys.exit(f"gpu_profile: {e}")
    cfg, w = llama3_8b(a.ftype)
    max_seq = a.pos + 256
    model = Transformer(cfg, w, backend, max_pos=max_seq)
    kv = backend.make_kv_cache(a.kv, cfg.n_layer, cfg.n_kv_head, max_seq, cfg.head_dim)
    step = backend.fused_decode(model, kv)
    if a.torch_body:
        step.row_kernels_problem = "asked for the torch body"
    print(f"llama3-8b {a.ftype}, kv {a.kv}, position {a.pos}; row kernels: {step.row_kernels_problem or 'yes'}; "
          f"programmatic launches: {'asked' if a.pdl else 'no'}")
    for i in range(6):  # position 0 eager, then the capture
        step(1, i if i == 0 else a.pos - 100 + i)
    print(f"graph replay only:        {per_token_ms(lambda i: step.graph.replay(), 50):7.3f} ms/token")
    print(f"step() + logits to host:  {per_token_ms(lambda i: step(1, a.pos - 60 + i), 50):7.3f} ms/token")
    step.policy.enabled = False
    step(1, a.pos - 5)
    print(f"eager step:               {per_token_ms(lambda i: step(1, a.pos - 4 + i), 3):7.3f} ms/token")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            step(1, a.pos + i)
        torch.cuda.synchronize()
    ev = prof.key_averages()
    total = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in ev)
    print(f"eager profile: {sum(e.count for e in ev) / 3:.0f} device ops and {total / 3e3:.3f} ms of kernel time "
          f"per token")
    for key in ("self_device_time_total", "self_cuda_time_total"):  # the name changed across torch versions
        try:
            print(ev.table(sort_by=key, row_limit=20, max_name_column_width=70))
            break
        except (AttributeError, KeyError, ValueError):
            continue
    return 0


if __name__ == "__main__":
    sys.exit(main())
