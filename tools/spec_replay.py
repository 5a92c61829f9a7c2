"""Prompt-lookup speculation replayed on recorded greedy replies: the speedup a cost model predicts, without timing.

    python tools/spec_replay.py smollm2-135m qwen2.5-coder-0.5b                  # measure the pass costs, replay
    python tools/spec_replay.py qwen2.5-coder-0.5b --slopes 0.38,0.25,0.15       # what cheaper extra rows would give
    python tools/spec_replay.py smollm2-135m --costs 1.13,1.28,1.47,1.83,1.97,2.23,2.49 \
        --prompts tools/spec_heldout.json --hindsight --breakdown                 # a given table, held-out prompts
    python tools/spec_replay.py smollm2-135m --candidates                         # what a tree of drafts could add

Timed speculative runs on a shared 2-core VM drift by more than the effects worth studying, and their outcome mixes
two questions: how often the lookup drafts agree with the model, and what a verification pass over M rows costs.
This tool separates them.  It records each shipped prompt's greedy reply (plain decoding, exactly the tokens
speculation must reproduce), then replays speculation over it: the pyllm LookupProposer drafts from the prompt and
the reply so far, the pyllm SpecController picks k, and the recorded reply says how many drafted tokens are
accepted.  A pass over M rows costs cost[M] steps of one row; the speedup is tokens over summed costs, against one
step per token.  "oracle" picks k as the number that will be accepted (the best a controller can do with these
drafts, step by step).  "ideal copy" bounds what copying can give at all: at each step the draft is the longest
prefix (up to k) of the true continuation found anywhere in the prompt and the reply so far, whichever occurrence
holds it, so the gap between it and "oracle" is the lookup's choice of what to copy.  "hindsight k" (--hindsight)
is the best fixed table evidence -> k for the reply, found knowing it: the gap from the controller to it bounds
roughly what a better model of acceptance per evidence could give (fitted to the very reply, it flatters), and the
gap from it to the oracle is what only foreknowledge of each pass gives (the oracle, drafting exactly what each pass
will accept, is not always the best sequence of passes, so the hindsight table can pass it).  --breakdown counts
where the controller's passes went against what its drafts allowed: passes whose first draft was wrong, rows past
the first wrong draft, k stopping inside a run the draft had right, plain steps whose draft was right.
--candidates bounds what verifying several lookup candidates in one pass (a tree of drafts) could add: the oracle
over the lookup's two latest occurrences, and over every occurrence of every suffix length.

The prompts are the shipped ones (pyllm/data/spec_prompts.json), or --prompts FILE of the same form:
tools/spec_heldout.json holds prompts of the same kinds written apart from them, to check a change to the
controller on text it was not tuned on.

The cost table is measured on the model (the multi-row forward at M = 1..8, best of several rounds; the default),
given as --costs cost[2..8], and/or as --slopes: cost[M] = 1 + slope * (M - 1), one table per slope.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROWS = tuple(range(1, 9))


def load_prompts(path: str | None) -> list[dict]:
    """The shipped prompts (``pyllm bench --spec``'s), or those of a JSON file of the same form; not those with a
    json_schema (the replay drafts as unconstrained lookup does, while their replies draft under the grammar)."""
    import json

    from pyllm.cli.bench import spec_prompts

    if path is None:
        prompts = spec_prompts()
    else:
        try:
            prompts = json.loads(Path(path).read_text())["prompts"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"spec_replay: cannot read prompts from {path}: {e}")
    return [p for p in prompts if "json_schema" not in p]


def record(llm, n: int, prompts: list[dict] | None = None) -> list[dict]:
    out = []
    for p in load_prompts(None) if prompts is None else prompts:
        ids = llm.chat_ids([{"role": "user", "content": p["prompt"]}])
        # From an empty cache, as `pyllm bench --spec` runs each prompt: a prompt prefilled after another one's
        # shared prefix gets other last bits, enough to flip a near-tie and replay a different reply.
        llm.reset()
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


@dataclass
class Replayed:
    """One replay's outcome: the speedup, and where its passes went against what the drafts would have allowed."""

    speedup: float = 0.0
    passes: int = 0  # verification passes
    plain: int = 0  # one-token steps
    rejected: int = 0  # passes whose first draft was wrong: all k rows wasted
    rejected_cost: float = 0.0  # what they cost beyond a plain step
    over: int = 0  # passes drafting past the first wrong token (at least one accepted)
    over_rows: int = 0  # rows verified past it
    over_cost: float = 0.0  # what those rows cost (cost[k + 1] - cost[accepted + 1])
    short: int = 0  # passes whose k stopped inside a run the draft had right
    short_tokens: int = 0  # drafted tokens past k that would have been accepted
    skipped: int = 0  # plain steps where the draft's first token was right
    skipped_tokens: int = 0  # the tokens of those drafts that would have been accepted


def replay_passes(prompt: list[int], reply: list[int], cost: dict[int, float], policy, ngram: int,
                  k_max: int) -> Replayed:
    """Replays speculation over ``reply``: ``policy`` is "controller" (pyllm's SpecController), "oracle" (k = the
    number of drafts that will be accepted) or a dict evidence -> k (a fixed table; missing evidence: k = 0)."""
    from pyllm.runtime import speculative as sp

    prop, ctrl = sp.LookupProposer(ngram), sp.SpecController(max_k=k_max)
    for m, c in cost.items():
        ctrl.time(m, c)
    out = Replayed()
    n, spent = 1, 0.0
    while n < len(reply):
        drafts, match = prop.propose(prompt + reply[:n], k_max)
        truth = reply[n:]
        room = min(len(drafts), len(truth))
        agree = 0
        while agree < room and drafts[agree] == truth[agree]:
            agree += 1
        if policy == "oracle":
            k = agree
        elif policy == "controller":
            k = ctrl.choose_k(match, room)
        else:
            k = min(policy.get(match, 0), room)
        if k == 0:
            spent += cost[1]
            if drafts:
                ctrl.observe(match, int(drafts[0] == truth[0]), 1)
            out.plain += 1
            if agree:
                out.skipped, out.skipped_tokens = out.skipped + 1, out.skipped_tokens + agree
            n += 1
            continue
        a = min(agree, k)
        spent += cost[k + 1]
        ctrl.observe(match, a, min(a + 1, k))
        out.passes += 1
        if a == 0:
            out.rejected, out.rejected_cost = out.rejected + 1, out.rejected_cost + cost[k + 1] - cost[1]
        elif a < k:
            out.over, out.over_rows = out.over + 1, out.over_rows + k - a
            out.over_cost += cost[k + 1] - cost[a + 1]
        elif agree > k:
            out.short, out.short_tokens = out.short + 1, out.short_tokens + agree - k
        n += a + 1
    out.speedup = (len(reply) - 1) / spent if spent else 1.0
    return out


def replay(prompt: list[int], reply: list[int], cost: dict[int, float], policy, ngram: int, k_max: int) -> float:
    """Tokens per unit of one-row step time, over plain decoding's 1 (the first token comes from the prefill)."""
    return replay_passes(prompt, reply, cost, policy, ngram, k_max).speedup


def hindsight_table(prompt: list[int], reply: list[int], cost: dict[int, float], ngram: int,
                    k_max: int) -> tuple[float, dict[int, int]]:
    """The best fixed table evidence -> k found knowing the reply (coordinate ascent from k = 3 everywhere, each
    evidence value in turn, until no single change gains): roughly what any controller whose only input is the
    lookup's evidence could reach on this reply, however it modelled acceptance.  Fitted to the very reply it is
    scored on, so it flatters; the gap from it to "oracle" is what only knowing each pass's outcome gives."""
    from pyllm.runtime.speculative import MATCH_CAP

    table = {e: min(3, k_max) for e in range(MATCH_CAP + 1)}
    best = replay(prompt, reply, cost, table, ngram, k_max)
    improved = True
    while improved:
        improved = False
        for e in table:
            for k in range(k_max + 1):
                if k == table[e]:
                    continue
                trial = {**table, e: k}
                s = replay(prompt, reply, cost, trial, ngram, k_max)
                if s > best + 1e-12:
                    best, table, improved = s, trial, True
    return best, table


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


def oracle_candidates(prompt: list[int], reply: list[int], cost: dict[int, float], ngram: int, k_max: int,
                      every: bool) -> float:
    """The oracle over several lookup candidates at once, as a tree of drafts verified in one pass would see them
    (charged like one candidate: a bound for such a tree).  Candidates: what followed the two latest occurrences of
    the longest suffix found (``every`` False: the lookup's own pair), or every occurrence of every suffix of up to
    ``ngram`` tokens (``every`` True).  Each step drafts the candidate agreeing longest with the reply."""
    n, spent = 1, 0.0
    while n < len(reply):
        ctx, truth = prompt + reply[:n], reply[n:]
        L, best = len(ctx), 0
        for m in range(min(ngram, L), 0, -1):
            suffix = ctx[L - m:]
            ends = [e for e in range(m, L) if ctx[e - m:e] == suffix]
            if not ends:
                continue
            for e in ends if every else ends[-2:]:
                draft, a = ctx[e:e + k_max], 0
                while a < min(len(draft), len(truth)) and draft[a] == truth[a]:
                    a += 1
                best = max(best, a)
            if not every:
                break
        spent += cost[best + 1]
        n += best + 1
    return (len(reply) - 1) / spent


def parse_costs(text: str) -> dict[int, float]:
    """``--costs 1.13,1.28,...``: cost[2..8] in one-row steps (cost[1] = 1)."""
    try:
        vals = [float(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) != len(ROWS) - 1 or any(not v >= 1.0 for v in vals):
        raise SystemExit(f"spec_replay: --costs needs {len(ROWS) - 1} numbers >= 1 (cost[2..8]), got {text!r}")
    return {1: 1.0, **{m: v for m, v in zip(ROWS[1:], vals)}}


def main(argv=None) -> int:
    import pyllm
    from pyllm.runtime.speculative import DEFAULT_K, DEFAULT_NGRAM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("-n", type=int, default=128, help="reply tokens recorded per prompt")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--slopes", default=None, help="comma list: replay cost[M] = 1 + slope (M - 1) instead of measuring")
    ap.add_argument("--costs", default=None, help="cost[2..8] (comma list, one-row steps) instead of measuring")
    ap.add_argument("--spec-k", type=int, default=DEFAULT_K)
    ap.add_argument("--spec-ngram", type=int, default=DEFAULT_NGRAM)
    ap.add_argument("--prompts", default=None,
                    help="JSON file of prompts (as pyllm/data/spec_prompts.json; e.g. tools/spec_heldout.json)")
    ap.add_argument("--hindsight", action="store_true",
                    help="add the best fixed evidence -> k table found knowing each reply (slow)")
    ap.add_argument("--breakdown", action="store_true",
                    help="then a table of where the controller's passes went against what its drafts allowed")
    ap.add_argument("--candidates", action="store_true",
                    help="add the oracle over the lookup's two candidates and over every occurrence (a tree's bound)")
    a = ap.parse_args(argv)
    prompts = load_prompts(a.prompts)
    fixed = [parse_costs(a.costs)] if a.costs else None
    cols = (["controller"] + (["hindsight k"] if a.hindsight else []) + ["oracle"]
            + (["oracle, 2 candidates", "oracle, any occurrence"] if a.candidates else []) + ["ideal copy"])
    print("| model | cost[2..8] (x one row) | prompt | kind | tokens | " + " | ".join(cols) + " |")
    print("|---|---|---|---|---:|" + "---:|" * len(cols))
    breakdowns = []
    for name in a.models:
        llm = pyllm.load(name, n_ctx=2048, n_threads=a.threads, quiet=True)
        replies = record(llm, a.n, prompts)
        tables = (fixed or []) + ([{m: 1 + float(s) * (m - 1) for m in ROWS} for s in a.slopes.split(",")]
                                  if a.slopes else [])
        tables = tables or [measure_costs(llm)]
        for cost in tables:
            label = " ".join(f"{cost[m]:.2f}" for m in ROWS if m > 1)
            for r in replies:
                args = (r["prompt"], r["reply"], cost)
                c = replay_passes(*args, "controller", a.spec_ngram, a.spec_k)
                vals = [c.speedup]
                if a.hindsight:
                    vals.append(hindsight_table(*args, a.spec_ngram, a.spec_k)[0])
                vals.append(replay(*args, "oracle", a.spec_ngram, a.spec_k))
                if a.candidates:
                    vals += [oracle_candidates(*args, a.spec_ngram, a.spec_k, every) for every in (False, True)]
                vals.append(ideal_copy(*args, a.spec_k))
                print(f"| {llm.path.name} | {label} | {r['name']} | {r['kind']} | {len(r['reply'])} | "
                      + " | ".join(f"{v:.2f}x" for v in vals) + " |")
                breakdowns.append((llm.path.name, label, r["name"], c))
        del llm
    if a.breakdown:
        print()
        print("| model | cost[2..8] | prompt | passes | plain | rejected (cost) | over-drafted: rows (cost) | "
              "short: passes, tokens | skipped: steps, tokens |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for model, label, prompt, c in breakdowns:
            print(f"| {model} | {label} | {prompt} | {c.passes} | {c.plain} | {c.rejected} ({c.rejected_cost:.1f}) | "
                  f"{c.over_rows} ({c.over_cost:.1f}) | {c.short}, {c.short_tokens} | {c.skipped}, {c.skipped_tokens} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
