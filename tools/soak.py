#!/usr/bin/env python3
"""Soak test: chat with one model object for N generated tokens, overflowing the context on purpose.

Each turn appends a user message (cycled from a fixed list), renders the conversation with the model's chat template
and generates a sampled reply. When the prompt plus a reply would not fit in n_ctx, the oldest user/assistant pair
is dropped (``--overflow drop``, keeping the system prompt) or the chat restarts from the system prompt
(``--overflow reset``); a ContextFullError from the library counts as a handled overflow too.

What "start" means. Memory is first measured after load and a warm-up that drives the runtime to its steady-state
footprint: one prompt of n_ctx - 2 tokens (the largest prefill there is, then one decode step at the last position)
and the chat loop itself until the first overflow has been handled and one more reply generated. The warm-up's
tokens are reported separately and are not part of the N. Everything the runtime allocates once (extension load,
per-thread kernel buffers, the allocator's arenas at their largest prefill size, template and tokenizer caches)
is therefore in the start figure; what grows after it is growth.

Catching a leak. Resident memory is sampled after every turn (``--log FILE`` writes the samples as CSV, or JSON
lines for any other suffix, with the glibc allocator's totals, the Python object count and, with ``--tracemalloc``,
Python's traced heap). The report gives start, end and peak RSS, the growth, and the least-squares slope of RSS
over the last half of the run in MiB per 1,000 generated tokens: a per-token leak shows as a positive slope even
when the end-start difference is small, so the run passes only when the growth is < 2% *and* the slope projected
over the whole run is < 2% of the start. The ``diagnosis`` compares the RSS slope with the slope of the bytes
glibc has handed out (``mallinfo2`` in-use): a leak moves both, allocator high-water only RSS.
``--leak-bytes-per-token B`` leaks B bytes per generated token on purpose (a self-test of the detector). Every reply must also be valid UTF-8 (no lone surrogates).

    python tools/soak.py smollm2-135m -n 20000 --ctx 1024 --log /tmp/soak.csv --json   # the record run
    python tools/soak.py -n 2000 --ctx 512 --json
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import ctypes.util
import gc
import json
import sys
import time
import tracemalloc
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
MIB = 2**20


def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc_mallinfo():
    """glibc's mallinfo2 (summed over all arenas), or None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        f = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype = _Mallinfo2
    return f


_MALLINFO = _libc_mallinfo()


def sample(trace: bool) -> dict:
    """One memory sample: RSS (total, anonymous, file-backed), the allocator's view, Python objects."""
    s = _proc_status()
    r = dict(rss_mib=s["VmRSS"] / MIB, anon_mib=s["RssAnon"] / MIB, file_mib=s["RssFile"] / MIB,
             hwm_mib=s["VmHWM"] / MIB)
    if _MALLINFO is not None:
        m = _MALLINFO()
        # heap = memory malloc got from sbrk/arenas, in use + free-but-kept; mmapped = big blocks mapped one by one
        r.update(malloc_heap_mib=m.arena / MIB, malloc_used_mib=(m.uordblks + m.hblkhd) / MIB,
                 malloc_free_mib=m.fordblks / MIB, malloc_mmap_mib=m.hblkhd / MIB)
    r["py_objects"] = len(gc.get_objects())
    if trace:
        r["py_traced_mib"] = tracemalloc.get_traced_memory()[0] / MIB
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}


def slope_per_1k(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs, times 1000 (MiB per 1,000 tokens when xs are tokens, ys MiB)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def diagnose(growth: float, projected: float, rss_slope: float, used_slope: float | None) -> str:
    """Name what RSS growth is: a leak grows the bytes malloc has handed out (in use) along with RSS; allocator
    high-water grows RSS while the in-use bytes stay flat (freed memory the heap keeps resident)."""
    if growth < 2.0 and projected < 2.0:
        return "flat"
    if used_slope is None:
        return "growing (no allocator statistics here to tell a leak from allocator high-water)"
    if rss_slope > 0 and used_slope >= 0.5 * rss_slope:
        return "leak: the allocated (in-use) bytes grow with the tokens"
    return "allocator high-water: RSS grows while the allocated (in-use) bytes do not"


class _Log:
    def __init__(self, path: str | None):
        self.f = open(path, "w", newline="") if path else None
        self.csv = path is not None and path.endswith(".csv")
        self.w = None

    def write(self, row: dict) -> None:
        if self.f is None:
            return
        if self.csv:
            if self.w is None:
                self.w = csv.DictWriter(self.f, fieldnames=list(row))
                self.w.writeheader()
            self.w.writerow(row)
        else:
            self.f.write(json.dumps(row) + "\n")
        self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def soak(model: str, tokens: int = 20000, n_ctx: int = 2048, max_reply: int = 256, backend: str = "fast",
         overflow: str = "drop", system: str = "You are a helpful assistant.", seed: int = 0,
         progress: bool = True, warmup: bool = True, log: str | None = None, trace: bool = False,
         leak_bytes_per_token: int = 0) -> dict:
    import pyllm
    from pyllm.errors import ContextFullError

    if trace:
        tracemalloc.start()
    t_load = time.perf_counter()
    llm = pyllm.load(model, n_ctx=n_ctx, kernels=backend)
    t_load = time.perf_counter() - t_load
    sys_msgs = [{"role": "system", "content": system}] if system else []
    out = _Log(log)
    leaked = []  # --leak-bytes-per-token: the detector's self-test
    st = dict(messages=list(sys_msgs), turns=0, overflows=0, bad_utf8=0)

    def turn() -> tuple[int, int]:
        """One user message and one reply; returns (generated tokens, overflows handled before it)."""
        messages = st["messages"]
        messages.append({"role": "user", "content": USER_PROMPTS[st["turns"] % len(USER_PROMPTS)]})
        over = 0
        # make room: the prompt plus a full reply must fit
        while len(llm.chat_ids(messages)) + max_reply >= n_ctx:
            over += 1
            if overflow == "reset" or len(messages) <= len(sys_msgs) + 1:
                messages[:] = sys_msgs + [messages[-1]]
                if len(llm.chat_ids(messages)) + max_reply >= n_ctx:
                    raise SystemExit(f"n_ctx={n_ctx} cannot hold the system prompt, one message and {max_reply} tokens")
                break
            del messages[len(sys_msgs) : len(sys_msgs) + 2]  # the oldest user/assistant pair
        try:
            reply = llm.chat(messages, max_tokens=max_reply, temperature=0.8, seed=seed + st["turns"])
        except ContextFullError:
            messages[:] = sys_msgs
            return 0, over + 1
        n = llm.stats.generated_tokens
        st["turns"] += 1
        try:
            reply.encode("utf-8")  # a lone surrogate (a split multi-byte character) fails here
        except UnicodeEncodeError:
            st["bad_utf8"] += 1
        messages.append({"role": "assistant", "content": reply})
        if leak_bytes_per_token:
            leaked.append(bytearray(b"x" * (leak_bytes_per_token * n)))  # touched, so resident
        return n, over

    # ---- warm-up: the largest prefill, a decode step at the last position, the chat loop through one overflow --
    t_warm = time.perf_counter()
    warm_tokens = warm_overflows = 0
    if warmup:
        filler = llm.tokenize(" ".join(USER_PROMPTS) * 200, add_bos=True)[: n_ctx - 2]
        warm_tokens += sum(1 for _ in llm.generate_tokens(filler, max_tokens=2, temperature=0.0))
        llm.reset()
        after_overflow = False
        while True:
            n, over = turn()
            warm_tokens += n
            warm_overflows += over
            if after_overflow and n:
                break
            after_overflow = after_overflow or over > 0
    t_warm = time.perf_counter() - t_warm
    gc.collect()
    snap0 = tracemalloc.take_snapshot() if trace else None
    start = sample(trace)
    start_turns = st["turns"]
    out.write(dict(turn=0, tokens=0, turn_tokens=0, prompt_tokens=0, prefilled=0, messages=len(st["messages"]),
                   overflows=0, seconds=0.0, **start))
    if progress:
        print(f"[soak] start (after load + warm-up of {warm_tokens} tokens, {warm_overflows} overflows): "
              f"RSS {start['rss_mib']:.1f} MiB", file=sys.stderr, flush=True)

    # ---- the measured run -------------------------------------------------------------------------------------------
    generated = overflows = 0
    samples = []  # (generated tokens, rss MiB, malloc in-use MiB or None)
    peak = start["rss_mib"]
    t0 = time.perf_counter()
    gen_seconds = 0.0
    while generated < tokens:
        t1 = time.perf_counter()
        n, over = turn()
        gen_seconds += time.perf_counter() - t1
        generated += n
        overflows += over
        if not n:
            continue
        s = sample(trace)
        peak = max(peak, s["rss_mib"])
        samples.append((generated, s["rss_mib"], s.get("malloc_used_mib")))
        stats = llm.stats
        out.write(dict(turn=st["turns"] - start_turns, tokens=generated, turn_tokens=n,
                       prompt_tokens=stats.prompt_tokens, prefilled=stats.prompt_evaluated,
                       messages=len(st["messages"]), overflows=overflows,
                       seconds=round(time.perf_counter() - t0, 1), **s))
        if progress:
            print(f"[soak] turn {st['turns'] - start_turns}: {n} tokens ({generated}/{tokens}), "
                  f"{len(st['messages'])} messages, {overflows} overflows, RSS {s['rss_mib']:.1f} MiB "
                  f"(anon {s['anon_mib']:.1f}, malloc free {s.get('malloc_free_mib', 0):.1f})",
                  file=sys.stderr, flush=True)
    end = samples[-1][1] if samples else start["rss_mib"]
    end_s = sample(trace)
    out.close()
    top = []
    if trace:  # where Python's heap grew between the start and the end, by line
        gc.collect()
        diff = tracemalloc.take_snapshot().compare_to(snap0, "lineno")
        top = [f"{d.size_diff / 1024:+.1f} KiB ({d.count_diff:+d} blocks) {d.traceback[0].filename}:"
               f"{d.traceback[0].lineno}" for d in diff[:8]]
    half = [t for t in samples if t[0] > generated / 2]
    slope = slope_per_1k([t[0] for t in half], [t[1] for t in half])
    used = [t for t in half if t[2] is not None]
    used_slope = slope_per_1k([t[0] for t in used], [t[2] for t in used]) if used else None
    growth = (end - start["rss_mib"]) / start["rss_mib"] * 100
    projected = slope * generated / 1000 / start["rss_mib"] * 100
    diagnosis = diagnose(growth, projected, slope, used_slope)
    return dict(model=str(llm.path.name), backend=backend, n_ctx=n_ctx, max_reply=max_reply, overflow=overflow,
                start="after load and a warm-up (a prompt of n_ctx-2 tokens + 1 decode step, then chat turns "
                      "through the first overflow and one more reply)",
                warmup_tokens=warm_tokens, warmup_overflows=warm_overflows, warmup_seconds=round(t_warm, 1),
                tokens=generated, turns=st["turns"] - start_turns, overflows=overflows,
                invalid_utf8_replies=st["bad_utf8"],
                load_seconds=round(t_load, 2), seconds=round(time.perf_counter() - t0, 1),
                tokens_per_second=round(generated / gen_seconds, 2) if gen_seconds else 0.0,
                rss_start_mib=start["rss_mib"], rss_end_mib=end, rss_peak_mib=round(peak, 2),
                rss_growth_percent=round(growth, 2),
                anon_start_mib=start["anon_mib"], anon_end_mib=end_s["anon_mib"],
                py_objects_start=start["py_objects"], py_objects_end=end_s["py_objects"],
                malloc_free_start_mib=start.get("malloc_free_mib"), malloc_free_end_mib=end_s.get("malloc_free_mib"),
                slope_mib_per_1k_tokens_last_half=round(slope, 4), slope_samples=len(half),
                malloc_used_slope_mib_per_1k_tokens_last_half=None if used_slope is None else round(used_slope, 4),
                diagnosis=diagnosis,
                projected_growth_percent=round(projected, 2),
                **(dict(py_traced_start_mib=start["py_traced_mib"], py_traced_end_mib=end_s["py_traced_mib"],
                        py_heap_growth_by_line=top) if trace else {}),
                ok=st["bad_utf8"] == 0 and growth < 2.0 and projected < 2.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("-n", "--tokens", type=int, default=20000)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--max-reply", type=int, default=256)
    ap.add_argument("--backend", default="fast", choices=["fast", "reference"])
    ap.add_argument("--overflow", default="drop", choices=["drop", "reset"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", action="store_true", help="measure the start right after load (shows warm-up)")
    ap.add_argument("--log", default=None, help="per-turn samples: CSV if the name ends in .csv, else JSON lines")
    ap.add_argument("--tracemalloc", action="store_true", help="also trace Python's heap (slower)")
    ap.add_argument("--leak-bytes-per-token", type=int, default=0, help="leak on purpose (tests the detector)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = soak(a.model, a.tokens, a.ctx, a.max_reply, a.backend, a.overflow, seed=a.seed, warmup=not a.no_warmup,
             log=a.log, trace=a.tracemalloc, leak_bytes_per_token=a.leak_bytes_per_token)
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        print(" ".join(f"{k}={v}" for k, v in r.items()))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
