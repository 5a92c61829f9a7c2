#!/usr/bin/env python3
"""Soak test: chat with one model object for N generated tokens, overflowing the context on purpose.

Each turn appends a user message (cycled from a fixed list), renders the conversation with the model's chat template
and generates a sampled reply. When the prompt plus a reply would not fit in n_ctx, the oldest user/assistant pair
is dropped (``--overflow drop``, keeping the system prompt) or the chat restarts from the system prompt
(``--overflow reset``); a ContextFullError from the library counts as a handled overflow too. At the end it reports
resident memory at the start (after the first reply, so lazy initialisation is not counted as growth) and the end,
the growth, tokens/s, the overflows, and whether every reply was valid UTF-8 (no lone surrogates, no U+FFFD that
the model did not produce as a whole token).

    python tools/soak.py                          # SmolLM2, 20,000 tokens, n_ctx 2048
    python tools/soak.py -n 2000 --ctx 512 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

USER_PROMPTS = [
    "Tell me a short story about a lighthouse keeper.",
    "What are three uses for a paperclip? Answer in French.",
    "Write a haiku about winter, then explain it.",
    "List the planets of the solar system with one fact each.",
    "Translate 'good morning, how are you?' into German, Spanish and Japanese.",
    "Explain recursion to a ten-year-old.",
    "Write a Python function that reverses a string, with comments.",
    "Describe the smell of rain using emoji and words 🌧️.",
]


def _mem() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def soak(model: str, tokens: int = 20000, n_ctx: int = 2048, max_reply: int = 256, backend: str = "fast",
         overflow: str = "drop", system: str = "You are a helpful assistant.", seed: int = 0,
         progress: bool = True) -> dict:
    import pyllm
    from pyllm.errors import ContextFullError

    t_load = time.perf_counter()
    llm = pyllm.load(model, n_ctx=n_ctx, backend=backend)
    t_load = time.perf_counter() - t_load
    sys_msgs = [{"role": "system", "content": system}] if system else []
    messages = list(sys_msgs)
    generated = turns = overflows = bad_utf8 = 0
    mem_start = None
    t0 = time.perf_counter()
    gen_seconds = 0.0
    while generated < tokens:
        messages.append({"role": "user", "content": USER_PROMPTS[turns % len(USER_PROMPTS)]})
        # make room: the prompt plus a full reply must fit
        while len(llm.chat_ids(messages)) + max_reply >= n_ctx:
            overflows += 1
            if overflow == "reset" or len(messages) <= len(sys_msgs) + 1:
                messages = sys_msgs + [messages[-1]]
                if len(llm.chat_ids(messages)) + max_reply >= n_ctx:
                    raise SystemExit(f"n_ctx={n_ctx} cannot hold the system prompt, one message and {max_reply} tokens")
                break
            del messages[len(sys_msgs) : len(sys_msgs) + 2]  # the oldest user/assistant pair
        t1 = time.perf_counter()
        try:
            reply = llm.chat(messages, max_tokens=min(max_reply, tokens - generated), temperature=0.8, seed=seed + turns)
        except ContextFullError:
            overflows += 1
            messages = list(sys_msgs)
            continue
        gen_seconds += time.perf_counter() - t1
        n = llm.stats.generated_tokens
        generated += n
        turns += 1
        try:
            reply.encode("utf-8")  # a lone surrogate (a split multi-byte character) fails here
        except UnicodeEncodeError:
            bad_utf8 += 1
        messages.append({"role": "assistant", "content": reply})
        if mem_start is None:
            mem_start = _mem()
        if progress:
            m = _mem()
            print(f"[soak] turn {turns}: {n} tokens ({generated}/{tokens}), {len(messages)} messages, "
                  f"{overflows} overflows, RSS {m['VmRSS'] / 2**20:.1f} MiB (anon {m['RssAnon'] / 2**20:.1f})",
                  file=sys.stderr, flush=True)
    mem_end = _mem()
    growth = {k: (mem_end[k] - mem_start[k]) / mem_start[k] * 100 for k in mem_start}
    return dict(model=str(llm.path.name), backend=backend, n_ctx=n_ctx, max_reply=max_reply, overflow=overflow,
                tokens=generated, turns=turns, overflows=overflows, invalid_utf8_replies=bad_utf8,
                load_seconds=round(t_load, 2), seconds=round(time.perf_counter() - t0, 1),
                tokens_per_second=round(generated / gen_seconds, 2) if gen_seconds else 0.0,
                rss_start_mib=round(mem_start["VmRSS"] / 2**20, 1), rss_end_mib=round(mem_end["VmRSS"] / 2**20, 1),
                anon_start_mib=round(mem_start["RssAnon"] / 2**20, 1),
                anon_end_mib=round(mem_end["RssAnon"] / 2**20, 1),
                rss_growth_percent=round(growth["VmRSS"], 2), anon_growth_percent=round(growth["RssAnon"], 2),
                ok=bad_utf8 == 0 and growth["VmRSS"] < 2.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("-n", "--tokens", type=int, default=20000)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--max-reply", type=int, default=256)
    ap.add_argument("--backend", default="fast", choices=["fast", "reference"])
    ap.add_argument("--overflow", default="drop", choices=["drop", "reset"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = soak(a.model, a.tokens, a.ctx, a.max_reply, a.backend, a.overflow, seed=a.seed)
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        print(" ".join(f"{k}={v}" for k, v in r.items()))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
