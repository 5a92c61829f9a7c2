"""What a speculative verification pass of R rows costs, in one-row steps, on the CPU's fused step.

    python tools/bench_verify_passes.py --synthetic qwen3-30b-a3b:q4_k_m --synthetic llama3-8b:q4_k_m -t 2
    python tools/bench_verify_passes.py smollm2-135m --rows 1,4,8 --depth 1024

Each pass puts R random tokens at the next positions of one sequence (all logits, as a verification does) after
--depth random tokens, best of -r rounds, the pass sizes interleaved.  Random tokens matter for a mixture of experts:
each row then routes to experts of its own, the dearest case for speculation (a repeated token would reuse one
row's experts).  A pass of R rows pays when it yields more than its cost in one-row steps (docs/DESIGN.md,
"Speculative decoding"); the controller learns the same costs from the passes it runs.
"""

from __future__ import annotations

import argparse
import time


def load(name: str | None, synthetic: str | None, n_ctx: int, threads: int | None):
    """(model, its cache, n_vocab) of a registry model or file, or of a synthetic shape built in memory."""
    if synthetic is None:
        import pyllm

        llm = pyllm.load(name, n_ctx=n_ctx, n_threads=threads, quiet=True)
        return llm.model, llm.kv, llm.config.n_vocab
    from pyllm import backends
    from pyllm.models import build_model
    from pyllm.models.synthetic import synthetic_model

    cfg, weights = synthetic_model(synthetic)
    model = build_model(cfg, weights, backends.select("cpu", "fast", threads, 0), max_pos=n_ctx)
    return model, model.backend.make_kv_cache("f16", cfg.n_layer, cfg.n_kv_head, n_ctx, cfg.head_dim), cfg.n_vocab


def main() -> int:
    import torch

    from pyllm.backends.base import SeqStep

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="registry names or GGUF paths")
    ap.add_argument("--synthetic", action="append", default=[], metavar="SHAPE:TYPE")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--rows", default="1,2,3,4,6,8", help="pass sizes, comma list (1 first: the unit)")
    ap.add_argument("--depth", type=int, default=256, help="tokens cached before the passes")
    ap.add_argument("-n", type=int, default=3, help="passes per timing")
    ap.add_argument("-r", type=int, default=4, help="rounds (the fastest timing of each size is kept)")
    a = ap.parse_args()
    sizes = sorted({int(x) for x in a.rows.split(",")} | {1})
    subjects = [(m, None) for m in a.models] + [(None, s) for s in a.synthetic]
    if not subjects:
        ap.error("give a model or --synthetic SHAPE:TYPE")
    for name, synthetic in subjects:
        model, kv, n_vocab = load(name, synthetic, a.depth + max(sizes) + 8, a.threads)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, n_vocab, (a.depth,), generator=g).tolist()
        for p0 in range(0, a.depth, 128):
            model.step([SeqStep(kv, ids[p0:p0 + 128], p0, prefill=True)])
        best: dict[int, float] = {}
        for _ in range(a.r):
            for rows in sizes:
                tokens = torch.randint(0, n_vocab, (rows,), generator=g).tolist()
                t = time.perf_counter()
                for _ in range(a.n):
                    model.step([SeqStep(kv, tokens, a.depth, all_logits=True)])
                best[rows] = min(best.get(rows, float("inf")), (time.perf_counter() - t) / a.n)
        print(f"\n{synthetic and f'synthetic {synthetic}' or name}, {a.depth} tokens cached")
        print(f"{'rows':>4} {'ms/pass':>8} {'one-row steps':>14}")
        for rows in sizes:
            print(f"{rows:>4} {best[rows] * 1e3:>8.1f} {best[rows] / best[1]:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
