"""Where a prefill's time goes besides the matmuls, and what the CPU backend's prefill kernels save there.

    python tools/experiments/prefill_profile.py smollm2-135m gemma3-270m qwen2.5-coder-0.5b -t 2 -p 512 -r 6
    python tools/experiments/prefill_profile.py smollm2-135m -p 512 -d 1024     # the same prompt after 1024 cached tokens
    python tools/experiments/prefill_profile.py --attention -t 2          # the attention kernel alone vs torch's SDPA

Per model, one process alternates -r times between the backend's kernels (causal_attention, rms_norm, rope, glu)
and torch's forms of all four (the backend's methods answering None), on the same -p random tokens after -d
cached ones (put in the cache untimed, in chunks of 512).  It prints the best and median pp t/s of each, and the time outside ``mul_mat`` (timed around every call),
which is the part the kernels change and drifts less than the total on a shared machine.  --attention times one
attention call per shape (best of 10) on random inputs: the kernel against torch's SDPA with the causal mask.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

KERNELS = ("causal_attention", "rms_norm", "rope", "glu")


def profile_model(name: str, threads: int, n: int, rounds: int, depth: int = 0) -> str:
    import pyllm
    from pyllm import ops
    from pyllm.backends.cpu import CpuBackend

    saved = {k: CpuBackend.__dict__[k] for k in KERNELS}
    llm = pyllm.load(name, n_threads=threads, n_ctx=max(4096, depth + n))
    C, in_mm = ops._C, [0.0]
    raw = C.mul_mat

    def timed_mul_mat(*a):
        t = time.perf_counter()
        out = raw(*a)
        in_mm[0] += time.perf_counter() - t
        return out

    g = llm.generator
    toks = torch.randint(0, min(1000, llm.model.cfg.n_vocab), (n,), generator=torch.Generator().manual_seed(0)).tolist()
    fill = torch.randint(0, min(1000, llm.model.cfg.n_vocab), (depth,), generator=torch.Generator().manual_seed(1)).tolist()
    res = {side: ([], []) for side in ("torch", "kernels")}
    C.mul_mat = timed_mul_mat
    try:
        for _ in range(rounds):
            for side in res:
                for k in KERNELS:
                    setattr(CpuBackend, k, saved[k] if side == "kernels" else staticmethod(lambda *a: None))
                g.reset()
                g.n_batch = 512
                for i in range(0, depth, 512):
                    g._forward(fill[i:i + 512])
                g.n_batch = n
                in_mm[0] = 0.0
                t = time.perf_counter()
                g._forward(toks)
                total = time.perf_counter() - t
                res[side][0].append(total)
                res[side][1].append(total - in_mm[0])
    finally:
        C.mul_mat = raw
        for k in KERNELS:
            setattr(CpuBackend, k, saved[k])
    (ta, oa), (tb, ob) = res["torch"], res["kernels"]
    return (f"| {llm.path.name} | {min(oa):.3f} s | {min(ob):.3f} s | {n / min(ta):.1f} / {n / statistics.median(ta):.1f} "
            f"| {n / min(tb):.1f} / {n / statistics.median(tb):.1f} |")


def profile_attention(threads: int) -> None:
    import torch.nn.functional as F

    from pyllm import _ext

    C = _ext.load()
    C.set_num_threads(threads)
    torch.set_num_threads(threads)

    def best(f, reps=10):
        f()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return min(ts) * 1e3

    print("| T | heads / KV heads x head_dim | torch SDPA (mask, GQA) | pyllm kernel | ratio |")
    print("|---:|---|---:|---:|---:|")
    for T, H, Hkv, hd in [(512, 9, 3, 64), (512, 4, 1, 256), (512, 14, 2, 64), (128, 9, 3, 64), (2048, 9, 3, 64)]:
        q, k, v = torch.randn(T, H, hd), torch.randn(T, Hkv, hd), torch.randn(T, Hkv, hd)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        scale = hd ** -0.5
        ours = best(lambda: C.causal_attention(q, k, v, scale, 0))
        theirs = best(lambda: F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                             v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                                             enable_gqa=True))
        print(f"| {T} | {H} / {Hkv} x {hd} | {theirs:.2f} ms | {ours:.2f} ms | {theirs / ours:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512, help="prompt tokens")
    ap.add_argument("-d", type=int, default=0, help="tokens already cached before the timed prompt")
    ap.add_argument("-r", type=int, default=6, help="rounds (each runs both sides)")
    ap.add_argument("--attention", action="store_true", help="time the attention kernel alone")
    a = ap.parse_args()
    if a.attention:
        profile_attention(a.threads)
    if a.models:
        print("| model | outside mul_mat, torch | with the kernels | pp t/s torch (best / median) | with the kernels |")
        print("|---|---:|---:|---:|---:|")
        for m in a.models:
            print(profile_model(m, a.threads, a.p, a.r, a.d), flush=True)


if __name__ == "__main__":
    main()
