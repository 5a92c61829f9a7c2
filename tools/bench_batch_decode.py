"""The batched decode step alone: ms per step and tok/s for B = 1, 2, 4, 8 sequences decoding together, and each
B's tok/s over B=1's, measured back to back in one process (the server's ratio without HTTP or prefill).

    python tools/bench_batch_decode.py smollm2-135m --threads 1 --prompt-tokens 200
    python tools/bench_batch_decode.py qwen2.5-coder-0.5b --threads 2 --rows 1,4 --profile

--profile: where each B's step goes, from the C++ step's phase timers (pyllm._C.decode_profile, ~1% of a step):
ms per step in the GEMVs (per kind: their row loops and activation quantization), attention (QK-norm, RoPE, KV
store, attention), the other row work (norms, residuals, activation, embedding), and Python (the step's wall
time outside the C++ call: building the step, the cache's room check, the binding's checks), and each phase's
time at B over its time at B=1 (a GEMV pass that reads its weights once costs B=1's time while it is
bandwidth-bound; attention is per row, so B times).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    import pyllm
    from pyllm import ops
    from pyllm.runtime.slots import Slot, decode_rows, prefill_chunk
    from pyllm.runtime.kv_cache import make_kv_cache
    from pyllm.runtime.kv_pool import BLOCK_ROWS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prompt-tokens", type=int, default=200, help="cache rows each sequence attends over")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=8, help="steps per timing (the best of --repeat is kept)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="each B's step by phase (see the module docstring)")
    ap.add_argument("--paged", action="store_true", help="caches from one block pool, as the server's slots")
    ap.add_argument("--kv", default=None, help="KV cache kind (f16, q8_0, q4_0, ...; default: pyllm.load's)")
    a = ap.parse_args(argv)
    rows = [int(x) for x in a.rows.split(",")]
    llm = pyllm.load(a.model, n_ctx=a.prompt_tokens + a.steps + 8, n_threads=a.threads or None, quiet=True,
                     **({"kv_cache": a.kv} if a.kv else {}))
    cfg, model = llm.config, llm.model
    text = "The river ran past the old stone mill and on to the sea. "
    ids = llm.tokenize(text * (a.prompt_tokens // 8 + 1))[:a.prompt_tokens]
    if a.paged:  # the server's: one pool from the backend, blocks of BLOCK_ROWS positions
        pool = model.backend.make_kv_pool(llm.kv.kind, cfg.n_layer, cfg.n_kv_head, cfg.head_dim,
                                          max(rows) * (llm.n_ctx // BLOCK_ROWS + 1), BLOCK_ROWS)
        caches = [pool.cache(llm.n_ctx) for _ in range(max(rows))]
    else:
        caches = [make_kv_cache(llm.kv.kind, cfg.n_layer, cfg.n_kv_head, llm.n_ctx, cfg.head_dim)
                  for _ in range(max(rows))]
    slots = [Slot(i, kv) for i, kv in enumerate(caches)]
    for s in slots:
        while prefill_chunk(model, s, ids) is None:
            pass
    best = {b: float("inf") for b in rows}
    phases: dict[int, dict[str, float]] = {b: {} for b in rows}  # B -> phase -> its least ms per step
    for _ in range(a.repeat):  # levels interleaved, so a load change hits them alike
        for b in rows:
            if a.profile:
                ops._C.decode_profile(True)
            t, c = time.perf_counter(), time.thread_time()
            for _ in range(a.steps):
                decode_rows(model, slots[:b], [ids[-1]] * b)
            dt = (time.perf_counter() - t) / a.steps
            best[b] = min(best[b], dt)
            if a.profile:
                got = step_phases(ops._C.decode_profile_read(), dt, a.steps)
                got["thread cpu"] = (time.thread_time() - c) / a.steps * 1e3
                for k, v in got.items():  # each phase's least: noise on a shared machine only adds time
                    phases[b][k] = min(phases[b].get(k, float("inf")), v)
                ops._C.decode_profile(False)
            for s in slots[:b]:
                del s.tokens[a.prompt_tokens:]
    print(f"{a.model}, {len(ids)}-token caches, {llm.n_threads} threads")
    print(f"{'B':>3} {'ms/step':>8} {'tok/s':>7} {'ratio':>6}")
    for b in rows:
        print(f"{b:>3} {best[b] * 1e3:>8.1f} {b / best[b]:>7.1f} {b / best[b] * best[rows[0]] / rows[0]:>5.2f}x")
    if a.profile:
        print_phases(phases, rows[0])
    return 0


GEMV_KINDS = ("qkv", "wo", "gate_up", "down", "output")


def step_phases(p: dict, wall: float, steps: int) -> dict[str, float]:
    """ms per step of each phase of one profile (decode_profile_read) over ``steps`` steps of ``wall`` s each."""
    ms = lambda ns: ns / steps / 1e6  # noqa: E731
    out = {k: ms(p[k]["wall_ns"] + p[k]["quant_ns"]) for k in GEMV_KINDS}
    out["attention"] = ms(p["attn_ns"])
    out["rows"] = ms(p["norm_ns"] + p["act_ns"] + p["embed_ns"])
    out["python"] = wall * 1e3 - ms(p["step_ns"])
    return out


def print_phases(table: dict[int, dict[str, float]], b0: int) -> None:
    """Each phase's least ms per step over the rounds, and that over B=b0's; "thread cpu": the calling thread's CPU
    time per step (with --threads 1 all of the step's work, and no time the machine gave to others)."""
    for t in table.values():
        t["gemv"] = sum(t[k] for k in GEMV_KINDS)
    print(f"\nms per step by phase (least over the rounds), and over B={b0}'s")
    print(f"{'phase':>10} " + " ".join(f"{'B=' + str(b):>14}" for b in table))
    for n in table[b0]:
        cells = [f"{t[n]:>7.2f} {t[n] / table[b0][n] if table[b0][n] > 0 else 0:>5.2f}x" for t in table.values()]
        print(f"{n:>10} " + " ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
