"""The batched decode step alone: ms per step and tok/s for B = 1, 2, 4, 8 sequences decoding together, and each
B's tok/s over B=1's, measured back to back in one process (the server's ratio without HTTP or prefill).

    python tools/bench_batch_decode.py smollm2-135m --threads 1 --prompt-tokens 200
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    import pyllm
    from pyllm.runtime import batch
    from pyllm.runtime.kv_cache import make_kv_cache

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prompt-tokens", type=int, default=200, help="cache rows each sequence attends over")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=8, help="steps per timing (the best of --repeat is kept)")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    rows = [int(x) for x in a.rows.split(",")]
    llm = pyllm.load(a.model, n_ctx=a.prompt_tokens + a.steps + 8, n_threads=a.threads or None, quiet=True)
    cfg, model = llm.config, llm.model
    text = "The river ran past the old stone mill and on to the sea. "
    ids = llm.tokenize(text * (a.prompt_tokens // 8 + 1))[:a.prompt_tokens]
    slots = [batch.Slot(i, make_kv_cache(llm.kv.kind, cfg.n_layer, cfg.n_kv_head, llm.n_ctx, cfg.head_dim))
             for i in range(max(rows))]
    for s in slots:
        while batch.prefill_chunk(model, s, ids) is None:
            pass
    best = {b: float("inf") for b in rows}
    for _ in range(a.repeat):  # levels interleaved, so a load change hits them alike
        for b in rows:
            t = time.perf_counter()
            for _ in range(a.steps):
                batch.decode_rows(model, slots[:b], [ids[-1]] * b)
            best[b] = min(best[b], (time.perf_counter() - t) / a.steps)
            for s in slots[:b]:
                del s.tokens[a.prompt_tokens:]
    print(f"{a.model}, {len(ids)}-token caches, {llm.n_threads} threads")
    print(f"{'B':>3} {'ms/step':>8} {'tok/s':>7} {'ratio':>6}")
    for b in rows:
        print(f"{b:>3} {best[b] * 1e3:>8.1f} {b / best[b]:>7.1f} {b / best[b] * best[rows[0]] / rows[0]:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
