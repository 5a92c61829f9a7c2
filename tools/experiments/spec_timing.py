#!/usr/bin/env python
"""Where a speculative reply's decode time goes, against a plain reply to the same prompt (interleaved).

    python tools/experiments/spec_timing.py smollm2-135m --prompts code-edit,quote-answer -r 3 -t 2

For each shipped prompt (pyllm/data/spec_prompts.json) and round: a plain greedy reply, then a speculative one
(prompt lookup), from a fresh cache, as `pyllm bench --spec` times them.  The speculative run's calls are timed
where they happen: the one-row steps, the verification passes by their row count, the proposals and the
acceptance; what the timers do not cover is the generator's own loop.  A pass's cost is given in plain one-row
steps of the same round, which is what tools/spec_replay.py's cost table assumes: the replay measures it in a
tight loop, this tool inside real replies, so the two can be compared.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--prompts", default=None, help="comma list of shipped prompt names (default: the grounded ones)")
    ap.add_argument("-n", type=int, default=128, help="reply tokens")
    ap.add_argument("-r", type=int, default=3, help="rounds")
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()

    import pyllm
    from pyllm.cli.bench import spec_prompts
    from pyllm.runtime import generator as gm
    from pyllm.runtime import speculative as sp

    prompts = spec_prompts()
    names = a.prompts.split(",") if a.prompts else [p["name"] for p in prompts if p["kind"] == "grounded"]
    unknown = sorted(set(names) - {p["name"] for p in prompts})
    if unknown:
        ap.error(f"unknown prompt(s) {', '.join(unknown)}; shipped: {', '.join(p['name'] for p in prompts)}")

    total = collections.defaultdict(float)
    count = collections.Counter()

    def timed(owner, attr, key):
        f = getattr(owner, attr)

        def wrapper(*args, **kw):
            t = time.perf_counter()
            out = f(*args, **kw)
            k = f"{key}[{len(args[1])}]" if key == "pass" else key  # forward_rows(gen, toks): by rows
            total[k] += time.perf_counter() - t
            count[k] += 1
            return out

        setattr(owner, attr, wrapper)
        return f

    saved = [(sp, "forward_rows", timed(sp, "forward_rows", "pass")), (sp, "accept", timed(sp, "accept", "accept")),
             (sp.LookupProposer, "propose", timed(sp.LookupProposer, "propose", "propose")),
             (gm.Generator, "_decode", timed(gm.Generator, "_decode", "one-row step"))]
    try:
        for model in a.models:
            llm = pyllm.load(model, n_ctx=2048, n_threads=a.threads)
            for p in [p for p in prompts if p["name"] in names]:
                ids = llm.chat_ids([{"role": "user", "content": p["prompt"]}])

                def reply(spec):
                    llm.reset()
                    out = list(llm.generate_tokens(ids, max_tokens=a.n, temperature=0, speculative=spec))
                    return out, llm.stats.decode_seconds

                reply("none")  # warm-up
                for rnd in range(a.r):
                    total.clear()
                    count.clear()
                    ref, t_plain = reply("none")
                    step = total["one-row step"] / max(1, count["one-row step"])
                    total.clear()
                    count.clear()
                    out, t_spec = reply("lookup")
                    speedup = t_plain / t_spec * (len(out) - 1) / max(1, len(ref) - 1)
                    print(f"{llm.path.name} {p['name']} round {rnd + 1}: plain {len(ref)} tokens, "
                          f"{t_plain / max(1, len(ref) - 1) * 1e3:.2f} ms/token (one-row step {step * 1e3:.2f} ms); "
                          f"speculative {t_spec * 1e3:.1f} ms, {speedup:.2f}x, same tokens: {out == ref}")
                    for k in sorted(total, key=lambda k: (k.startswith("pass"), len(k), k)):
                        per = total[k] / count[k]
                        print(f"    {k:14s} {count[k]:4d} calls  {total[k] * 1e3:7.1f} ms  {per * 1e3:6.3f} ms each"
                              f"  ({per / step:.2f} one-row steps)")
                    print(f"    {'the rest':14s}            {(t_spec - sum(total.values())) * 1e3:7.1f} ms")
            llm.close()
    finally:
        for owner, attr, f in saved:
            setattr(owner, attr, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
