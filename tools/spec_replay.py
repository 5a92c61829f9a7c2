"""Prompt-lookup speculation replayed on recorded greedy replies: the speedup a cost model predicts, without timing.

    python tools/spec_replay.py smollm2-135m qwen2.5-coder-0.5b                  # measure the pass costs, replay
    python tools/spec_replay.py qwen2.5-coder-0.5b --slopes 0.38,0.25,0.15       # what cheaper extra rows would give
    python tools/spec_replay.py smollm2-135m --prompts tools/spec_heldout.json   # prompts not tuned on

Timed speculative runs on a shared 2-core VM drift by more than the effects worth studying, and their outcome mixes
two questions: how often the lookup drafts agree with the model, and what a verification pass over M rows costs.
This tool separates them.  It records each shipped prompt's greedy reply (plain decoding, exactly the tokens
speculation must reproduce), then replays speculation over it: the pyllm LookupProposer drafts from the prompt and
the reply so far, the pyllm SpecController picks k, and the recorded reply says how many drafted tokens are
accepted.  A pass over M rows costs cost[M] steps of one row; the speedup is tokens over summed costs, against one
step per token.  "oracle" picks k as the number that will be accepted (the best a controller can do with these
drafts, step by step).  "ideal copy" bounds what copying can give at all: at each step the draft is the longest
prefix (up to k) of the true continuation found anywhere in the prompt and the reply so far, whichever occurrence
holds it, so the gap between it and "oracle" is the lookup's choice of what to copy.

The prompts are the shipped ones (pyllm/data/spec_prompts.json), or --prompts FILE of the same form:
tools/spec_heldout.json holds prompts of the same kinds written apart from them, to check a change to the
controller on text it was not tuned on.

The cost table is measured on the model (the multi-row forward at M = 1..8, best of several rounds; --measure is
the default), or given as slopes: cost[M] = 1 + slope * (M - 1), one table per slope.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROWS = range(1, 9)


def load_prompts(path: str | None) -> list[dict]:
    """The shipped prompts (``pyllm bench --spec``'s), or those of a JSON file of the same form."""
    import json

    from pyllm.cli.bench import spec_prompts

    if path is None:
        return spec_prompts()
    try:
        return json.loads(Path(path).read_text())["prompts"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"spec_replay: cannot read prompts from {path}: {e}")


def record(llm, n: int, prompts: list[dict] | None = None) -> list[dict]:
    out = []
    for p in load_prompts(None) if prompts is None else prompts:
        ids = llm.chat_ids([{"role": "user", "content": p["prompt"]}])
        reply = list(llm.generate_tokens(ids, max_tokens=n, temperature=0))
        out.append(dict(name=p["name"], kind=p["kind"], prompt=ids, reply=reply))
    return out


def measure_costs(llm, rounds: int = 5) -> dict[int, float]:
    """cost[M] / cost[1] of the model's multi-row forward (all logits, as verification runs it) at a 300-token cache."""
    import torch

    from pyllm.runtime import speculative

    g = llm.generator
    ids = llm.tokenize("The river ran past the old stone mill and on to the sea. " * 30)[:300]
    g.reset()
    g.prefill(ids)
    best = {m: math.inf for m in ROWS}
    for _ in range(rounds):  # interleaved, so a change of machine speed hits every M alike
        for m in ROWS:
            t = time.perf_counter()
            with torch.inference_mode():
                speculative.forward_rows(g, ids[:m])
            best[m] = min(best[m], time.perf_counter() - t)
            g.truncate(len(ids))
    return {m: best[m] / best[1] for m in ROWS}


def replay(prompt: list[int], reply: list[int], cost: dict[int, float], policy: str, ngram: int, k_max: int) -> float:
    """Tokens per unit of one-row step time, over plain decoding's 1 (the first token comes from the prefill)."""
    from pyllm.runtime import speculative as sp

    prop, ctrl = sp.LookupProposer(ngram), sp.SpecController(max_k=k_max)
    for m, c in cost.items():
        ctrl.time(m, c)
    n, spent = 1, 0.0
    while n < len(reply):
        drafts, match = prop.propose(prompt + reply[:n], k_max)
        truth = reply[n:]
        agree = 0
        while agree < min(len(drafts), len(truth)) and drafts[agree] == truth[agree]:
            agree += 1
        k = agree if policy == "oracle" else ctrl.choose_k(match, min(len(drafts), len(truth)))
        if k == 0:
            spent += cost[1]
            if drafts:
                ctrl.observe(match, int(drafts[0] == truth[0]), 1)
            n += 1
        else:
            a = min(agree, k)
            spent += cost[k + 1]
            ctrl.observe(match, a, min(a + 1, k))
            n += a + 1
    return (len(reply) - 1) / spent


def ideal_copy(prompt: list[int], reply: list[int], cost: dict[int, float], k_max: int) -> float:
    """The speedup of drafting, at every step, the longest prefix (<= k_max) of the true continuation that occurs
    anywhere in the context (a scan of the whole context per step: a bound to replay, not a proposer)."""
    n, spent = 1, 0.0
    while n < len(reply):
        ctx, truth = prompt + reply[:n], reply[n:]
        best = 0
        for length in range(1, min(k_max, len(truth)) + 1):
            pat = truth[:length]
            if not any(ctx[i:i + length] == pat for i in range(len(ctx) - length + 1)):
                break
            best = length
        spent += cost[best + 1]
        n += best + 1
    return (len(reply) - 1) / spent


def main(argv=None) -> int:
    import pyllm
    from pyllm.runtime.speculative import DEFAULT_K, DEFAULT_NGRAM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("-n", type=int, default=128, help="reply tokens recorded per prompt")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--slopes", default=None, help="comma list: replay cost[M] = 1 + slope (M - 1) instead of measuring")
    ap.add_argument("--spec-k", type=int, default=DEFAULT_K)
    ap.add_argument("--spec-ngram", type=int, default=DEFAULT_NGRAM)
    ap.add_argument("--prompts", default=None,
                    help="JSON file of prompts (as pyllm/data/spec_prompts.json; e.g. tools/spec_heldout.json)")
    a = ap.parse_args(argv)
    prompts = load_prompts(a.prompts)
    print("| model | cost[2..8] (x one row) | prompt | kind | tokens | controller | oracle | ideal copy |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for name in a.models:
        llm = pyllm.load(name, n_ctx=2048, n_threads=a.threads, quiet=True)
        replies = record(llm, a.n, prompts)
        tables = ([{m: 1 + float(s) * (m - 1) for m in ROWS} for s in a.slopes.split(",")] if a.slopes
                  else [measure_costs(llm)])
        for cost in tables:
            label = " ".join(f"{cost[m]:.2f}" for m in ROWS if m > 1)
            for r in replies:
                c, o = (replay(r["prompt"], r["reply"], cost, p, a.spec_ngram, a.spec_k) for p in ("controller", "oracle"))
                i = ideal_copy(r["prompt"], r["reply"], cost, a.spec_k)
                print(f"| {llm.path.name} | {label} | {r['name']} | {r['kind']} | {len(r['reply'])} | {c:.2f}x | {o:.2f}x "
                      f"| {i:.2f}x |")
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
