"""KV cache quality and speed per cache kind: the tables for docs/BENCHMARKS.md.

  python tools/kv_quality.py quality MODEL... [-f TEXT] [-c 512] [--chunks 4] [--kinds f16,q8_0,f16/q8_0]
  python tools/kv_quality.py speed MODEL [--depth 2048] [-n 64]                 decode tok/s at a filled context
  python tools/kv_quality.py decode-kl MODEL [--chunks 2] [--torch]               KL with the scored half decoded
                                                                                 token by token (C++ step)
  python tools/kv_quality.py first-batch MODEL [--first 2,8,32,256] [--chunks 2]   KL when the statistics come
                                                                                 from a short first batch

Kinds are cache types, or KEY/VALUE pairs such as f16/q4_rot (keys and values in different types).

quality: llama.cpp's perplexity protocol (pyllm/perplexity.py), every kind scored on the same chunks, KL against
the f16 cache. speed: fills the cache to --depth tokens, then times n single-token decode steps (each reads the
whole cache), min-of-3 to damp noise from other processes; kinds are interleaved so drift hits all alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyllm  # noqa: E402
from pyllm.perplexity import _Tee, chunk_tokens, evaluate, format_table, kl_divergence  # noqa: E402
from pyllm.runtime.kv_cache import make_kv_cache  # noqa: E402

KINDS = ["f16", "q8_0", "q8_rot", "q4_0", "q4_rot"]


def quality(a) -> None:
    text = Path(a.file).read_text(encoding="utf-8", errors="replace")
    for m in a.models:
        llm = pyllm.load(m, n_ctx=a.ctx, kernels=a.backend, n_threads=a.threads)
        t = time.perf_counter()
        stats = evaluate(llm, text, n_ctx=a.ctx, kinds=a.kinds.split(","), kl_base="f16", n_chunks=a.chunks,
                         on_chunk=lambda i, n, s: print(f"  [{i + 1}/{n}] " + " ".join(
                             f"{k} {st.running[-1]:.3f}" for k, st in s.items()), file=sys.stderr, flush=True))
        print(f"\n{llm.path.name}: {a.chunks} chunks x {a.ctx}, {time.perf_counter() - t:.0f} s, backend "
              f"{a.backend}")
        print(format_table(llm.path.name, stats, "f16"), flush=True)


def _chunks(llm, a):
    """The perplexity protocol's chunks of --file (BOS first where the model adds one), at most --chunks."""
    ids, bos = chunk_tokens(llm, Path(a.file).read_text(encoding="utf-8", errors="replace"), a.ctx)
    for c in range(min(a.chunks, len(ids) // a.ctx)):
        chunk = ids[c * a.ctx:(c + 1) * a.ctx]
        if bos is not None:
            chunk[0] = bos
        yield chunk


def first_batch(a) -> None:
    """The perplexity protocol's chunks with the context half written in two batches, the first holding n tokens:
    a cache estimates its means and key scales from that first batch, as a chat that opens with a short prompt
    does. Mean KL divergence against the f16 cache written the same way."""
    llm = pyllm.load(a.models[0], n_ctx=a.ctx, kernels=a.backend, n_threads=a.threads)
    cfg, model, half = llm.config, llm.model, a.ctx // 2
    firsts = [int(x) for x in a.first.split(",")]
    kinds = [k for k in a.kinds.split(",") if k != "f16"]
    kl = {(n, k): [] for n in firsts for k in kinds}
    with torch.inference_mode():
        for chunk in _chunks(llm, a):
            for n in firsts:
                lps = {}
                for k in ["f16"] + kinds:
                    kv = make_kv_cache(k, cfg.n_layer, cfg.n_kv_head, a.ctx, cfg.head_dim)
                    model.forward(torch.tensor(chunk[:n]), 0, kv)
                    if n < half:
                        model.forward(torch.tensor(chunk[n:half]), n, kv)
                    logits = model.forward(torch.tensor(chunk[half:-1]), half, kv, all_logits=True)
                    lps[k] = torch.log_softmax(logits.float(), -1)
                for k in kinds:
                    kl[(n, k)].append(kl_divergence(lps["f16"], lps[k]).mean().item())
    print(f"{llm.path.name}: mean KLD vs f16 by first-batch length, {a.chunks} chunks x {a.ctx}")
    print("| first batch | " + " | ".join(kinds) + " |")
    print("|---:|" + "---:|" * len(kinds))
    for n in firsts:
        print(f"| {n} | " + " | ".join(f"{statistics.fmean(kl[(n, k)]):.5f}" for k in kinds) + " |")


def decode_kl(a) -> None:
    """KL against the f16 cache with the scored half of each chunk decoded one token at a time (teacher forcing)
    through the C++ decode step (--torch: the torch path), so the step's own attention over each cache kind is
    what is measured. Its floor is not 0: the decode GEMVs round activations to int8, so any perturbation of the
    inputs flips some roundings (f32 vs f16 caches already differ by ~0.003 on Qwen2.5)."""
    llm = pyllm.load(a.models[0], n_ctx=a.ctx, kernels=a.backend, n_threads=a.threads)
    cfg, model, half = llm.config, llm.model, a.ctx // 2
    model.use_cpp_decode = not a.torch
    kinds = [k for k in a.kinds.split(",") if k != "f16"]
    kl = {k: [] for k in kinds}
    with torch.inference_mode():
        for chunk in _chunks(llm, a):
            lps = {}
            for k in ["f16"] + kinds:
                kv = make_kv_cache(k, cfg.n_layer, cfg.n_kv_head, a.ctx, cfg.head_dim)
                model.forward(torch.tensor(chunk[:half]), 0, kv)
                out = [model.forward(torch.tensor([chunk[i]]), i, kv)[-1] for i in range(half, a.ctx - 1)]
                lps[k] = torch.log_softmax(torch.stack(out).float(), -1)
            for k in kinds:
                kl[k].append(kl_divergence(lps["f16"], lps[k]).mean().item())
    print(f"{llm.path.name}: mean KLD vs f16, scored half decoded token by token "
          f"({'torch path' if a.torch else 'C++ step'}), {a.chunks} chunks x {a.ctx}")
    for k in kinds:
        print(f"| {k} | {statistics.fmean(kl[k]):.5f} |")


def speed(a) -> None:
    load0 = f"{os.getloadavg()[0]:.2f}"
    llm = pyllm.load(a.models[0], n_ctx=a.depth + a.n + 8, kernels=a.backend, n_threads=a.threads)
    cfg, model = llm.config, llm.model
    ids = torch.randint(0, cfg.n_vocab, (a.depth,), generator=torch.Generator().manual_seed(0))
    kinds = a.kinds.split(",")
    caches = {k: make_kv_cache(k, cfg.n_layer, cfg.n_kv_head, a.depth + a.n + 8, cfg.head_dim) for k in kinds}
    with torch.inference_mode():
        tee = _Tee(list(caches.values()))
        model.forward(ids[:512], 0, tee)  # the first batch attends in float32: compute it once for all kinds
        for k, c in caches.items():
            for i in range(512, a.depth, 512):
                model.forward(ids[i:i + 512], i, c)
        res = {k: [] for k in kinds}
        tok = torch.tensor([1])
        for c in caches.values():  # the first step after a prefill may estimate means (torch path): warm up
            model.forward(tok, a.depth, c)
        for _ in range(3):
            for k, c in caches.items():
                t = time.perf_counter()
                for j in range(a.n):
                    model.forward(tok, a.depth + j, c)
                res[k].append(a.n / (time.perf_counter() - t))
    print(f"load average before/after: {load0} / {os.getloadavg()[0]:.2f}")
    print(f"| model | KV | KV MiB at {a.depth} | tg{a.n} @ depth {a.depth} t/s (best of 3) | median |")
    print("|---|---|---|---|---|")
    for k, c in caches.items():
        mib = c.nbytes / c.max_seq * a.depth / 2**20
        print(f"| {llm.path.name} | {k} | {mib:.1f} | {max(res[k]):.2f} | {statistics.median(res[k]):.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["quality", "speed", "first-batch", "decode-kl"])
    p.add_argument("models", nargs="+")
    p.add_argument("-f", "--file", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("-c", "--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated cache kinds (KEY/VALUE allowed)")
    p.add_argument("--depth", type=int, default=2048)
    p.add_argument("-n", type=int, default=32)
    p.add_argument("--first", default="2,8,32,256", help="first-batch lengths (first-batch mode)")
    p.add_argument("--torch", action="store_true", help="decode-kl: the torch path instead of the C++ step")
    p.add_argument("--backend", default="fast", choices=["fast", "reference"])
    p.add_argument("-t", "--threads", type=int, default=None)
    a = p.parse_args()
    {"quality": quality, "speed": speed, "first-batch": first_batch, "decode-kl": decode_kl}[a.mode](a)


if __name__ == "__main__":
    main()
