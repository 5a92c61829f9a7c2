"""How much of a decode step is spent outside the weight reads (target: under 10%), from timers inside the C++ step.

    python tools/decode_profile.py smollm2-135m qwen2.5-coder-0.5b gemma3-270m -t 2 --depth 0,512 -r 5
    python tools/decode_profile.py qwen2.5-coder-0.5b -t 2 --rows 4    # a 4-row verification pass

For each model and cache depth, n decode tokens through the fast path (the C++ decode step) with its phase timers
on (pyllm._C.decode_profile; they cost ~1% of a step), best of -r rounds by step time (noise on a shared machine
only ever adds time).  Two tables:

- per GEMV kind (qkv and gate_up are one fused call each): ms per token, weight MB per token, GB/s over the row
  loop's wall time and its share of the read bandwidth (pyllm's cached roofline probe), the time preparing the
  activations (quant) and the time threads spent outside row kernels inside the region (sync: start, chunk
  hand-out, waiting at its end; threads * wall - busy, per thread).
- per phase: step ms, the GEMVs' row kernels, their sync and activation quantization, norms (+ residual adds,
  biases), attention (QK-norm, RoPE, KV store, attention), activation function, embedding, and "outside": the
  share of the step in which the threads were not reading weights in row kernels (1 - busy / threads / step).
"""

from __future__ import annotations

import argparse

import pyllm
from pyllm import ops, roofline

KINDS = ("qkv", "wo", "gate_up", "down", "output")


def profile(llm, depth: int, n: int, rows: int = 1) -> dict:
    from pyllm.runtime import speculative

    g = llm.generator
    g.reset()
    if depth:
        g._forward(list(range(1, depth + 1)))
    g._forward([1])  # warm: first touch of the scratch and the step's code
    base = len(g.tokens)
    ops._C.decode_profile(True)
    for _ in range(n):
        if rows == 1:
            g._forward([1])
        else:  # a verification pass: M rows at the next positions, all logits, then rolled back
            speculative.forward_rows(g, [1] * rows)
            g.truncate(base)
    p = ops._C.decode_profile_read()
    ops._C.decode_profile(False)
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--depth", default="0", help="cache depths (tokens already cached), comma list")
    ap.add_argument("-n", type=int, default=32, help="decode tokens per round")
    ap.add_argument("-r", type=int, default=3, help="rounds (the fastest is kept)")
    ap.add_argument("--rows", type=int, default=1,
                    help="rows per step: 1 = decode; 2..8 = a speculative verification pass (times are per pass)")
    a = ap.parse_args()
    depths = [int(d) for d in a.depth.split(",")]
    kinds_rows, phase_rows = [], []
    bw = None
    for m in a.models:
        llm = pyllm.load(m, n_ctx=max(depths) + a.n + 8, n_threads=a.threads)
        ops._C.set_num_threads(llm.n_threads)
        nt = llm.n_threads
        if bw is None:
            bw = roofline.probe(nt)["read_gbs"]
        for d in depths:
            p = min((profile(llm, d, a.n, a.rows) for _ in range(a.r)), key=lambda p: p["step_ns"] / max(1, p["steps"]))
            steps = max(1, p["steps"])
            if not p["steps"]:
                raise SystemExit(f"{m}: the C++ decode step did not run (no fast path for this model?)")
            ms = lambda ns: ns / steps / 1e6  # noqa: E731
            busy = quant = sync = wall = 0
            for k in KINDS:
                e = p[k]
                busy += e["busy_ns"]
                quant += e["quant_ns"]
                sync += e["thread_ns"] - e["busy_ns"]
                wall += e["wall_ns"]
                gbs = e["bytes"] / e["wall_ns"] if e["wall_ns"] else 0.0
                kinds_rows.append(
                    f"| {llm.path.name} | {d} | {k} | {ms(e['wall_ns'] + e['quant_ns']):.3f} | "
                    f"{e['bytes'] / steps / 1e6:.1f} | {gbs:.1f} | {gbs / bw:.0%} | {ms(e['quant_ns']):.3f} | "
                    f"{ms((e['thread_ns'] - e['busy_ns']) / nt):.3f} |")
            step = p["step_ns"]
            phase_rows.append(
                f"| {llm.path.name} | {d} | {ms(step):.2f} | {ms(busy / nt):.2f} | {ms(sync / nt):.2f} | "
                f"{ms(quant):.2f} | {ms(p['norm_ns']):.2f} | {ms(p['attn_ns']):.2f} | {ms(p['act_ns']):.2f} | "
                f"{ms(p['embed_ns']):.2f} | {1 - busy / nt / step:.1%} |")
        del llm
    print(f"read bandwidth ({nt} threads, roofline probe): {bw:.1f} GB/s\n")
    print("| model | depth | GEMV | ms/token | MB/token | GB/s | of BW | quant ms | sync ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(kinds_rows))
    print()
    print("| model | depth | step ms | row kernels ms | sync ms | quant ms | norms ms | attention ms | act ms "
          "| embed ms | outside |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(phase_rows))


if __name__ == "__main__":
    main()
