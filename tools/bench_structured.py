"""Constrained-decoding engines on pyllm's fixture vocabularies: mask cost per token against a decode step.

For each vocabulary (SmolLM2 49k, Qwen2.5 151k) and each engine that is installed (llguidance, xgrammar,
outlines-core), it reports the vocabulary set-up time, the compile time of each schema, and the per-token cost of
a realistic JSON-schema generation: the tokens of a valid document are fed one by one, and each step computes the
mask, applies it to a logits vector and advances the grammar (what one decode step pays). SmolLM2's own decode
step is timed in the same process, interleaved with the engine runs, so a busy machine slows both alike and the
ratio stays meaningful.

    python tools/bench_structured.py [--engines llguidance,xgrammar,outlines] [--rounds 3] [--threads 2]

xgrammar pulls torch, transformers, triton and apache-tvm-ffi; to measure it without touching the project's
environment: python -m venv --system-site-packages /tmp/xg && /tmp/xg/bin/pip install --no-deps xgrammar
apache-tvm-ffi outlines-core && /tmp/xg/bin/python tools/bench_structured.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {
                "type": "object",
                "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"],
            },
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "score": {"type": "number"},
        },
        "required": ["name", "age", "email", "role", "address", "tags", "score"],
    },
    "items": {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {
            "type": "object", "properties": {"id": {"type": "integer"}, "label": {"type": "string"},
                                             "done": {"type": "boolean"}},
            "required": ["id", "label", "done"]}}},
        "required": ["items"],
    },
}
DOCS = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "admin",
               "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
               "tags": ["math", "poetry", "engines"], "score": 97.5},
    "items": {"items": [{"id": i, "label": f"task number {i}", "done": i % 2 == 0} for i in range(8)]},
}


def vocab_bytes(tok, n_vocab):
    """Token bytes per id; special (control/unknown) tokens as None."""
    from pyllm.vocabulary import CONTROL, UNKNOWN

    out = [None if tok._types[i] in (CONTROL, UNKNOWN) else tok.token_bytes(i) for i in range(tok.n_vocab)]
    return out + [None] * (n_vocab - len(out))


class LLG:
    name = "llguidance"

    def __init__(self, tok, n_vocab):
        from pyllm.runtime.constraint import GrammarVocab

        self.vocab = GrammarVocab(tok, n_vocab)

    def compile(self, schema):
        from pyllm.runtime.constraint import Constraint

        return Constraint.from_json_schema(schema, self.vocab)

    def step(self, c, logits, token):
        c.mask(logits)
        c.advance(token)


class XGR:
    name = "xgrammar"

    def __init__(self, tok, n_vocab):
        import xgrammar as xgr

        vb = vocab_bytes(tok, n_vocab)
        eos = sorted(tok.eog_ids)
        info = xgr.TokenizerInfo([b if b is not None else b"" for b in vb], xgr.VocabType.RAW, vocab_size=n_vocab,
                                 stop_token_ids=eos)
        self.xgr = xgr
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.n_vocab = n_vocab

    def compile(self, schema):
        cg = self.compiler.compile_json_schema(json.dumps(schema))
        return self.xgr.GrammarMatcher(cg), self.xgr.allocate_token_bitmask(1, self.n_vocab)

    def step(self, c, logits, token):
        m, bm = c
        m.fill_next_token_bitmask(bm)
        self.xgr.apply_token_bitmask_inplace(logits[None], bm)
        if not m.accept_token(token):
            raise RuntimeError(f"xgrammar rejected token {token}")


class OUT:
    name = "outlines-core"

    def __init__(self, tok, n_vocab):
        import outlines_core as oc

        vb = vocab_bytes(tok, n_vocab)
        eos = tok.eos_id
        m: dict[bytes, list[int]] = {}
        for i, b in enumerate(vb):
            if b and i != eos:
                m.setdefault(b, []).append(i)
        self.oc = oc
        self.vocab = oc.Vocabulary(eos, m)
        self.n_vocab = n_vocab

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        idx = self.oc.Index(build_regex_from_schema(json.dumps(schema)), self.vocab)
        return self.oc.Guide(idx), torch.full(((self.n_vocab + 31) // 32,), -1, dtype=torch.int32)

    def step(self, c, logits, token):
        g, bm = c
        g.write_mask_into(bm.data_ptr(), bm.numel(), 4)
        allowed = np.unpackbits(bm.numpy().view(np.uint8), bitorder="little")[:self.n_vocab].view(bool)
        np.copyto(logits.numpy(), -np.inf, where=~allowed)  # as Constraint.mask: no intra-op thread wake-up
        g.advance(token)


ENGINES = {"llguidance": LLG, "xgrammar": XGR, "outlines": OUT}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run_doc(engine, c, ids, n_vocab):
    """Per-token seconds for one pass over ``ids``."""
    times = []
    logits = torch.randn(n_vocab)
    for t in ids:
        lg = logits.clone()
        t0 = time.perf_counter()
        engine.step(c, lg, t)
        times.append(time.perf_counter() - t0)
        if not torch.isfinite(lg[t]):
            raise RuntimeError(f"{engine.name} masked out token {t} of a valid document")
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines")
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16, help="SmolLM2 decode steps per interleaved timing")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import pyllm

    step_llm = pyllm.load("smollm2-135m", n_ctx=512, n_threads=a.threads)
    step_ids = step_llm.tokenize("The quick brown fox")

    def decode_steps(n=16):
        """Seconds per SmolLM2 decode step (forward of one token, greedy pick), n steps after a short prompt."""
        gen = step_llm.generate_tokens(step_ids, max_tokens=n + 1, temperature=0)
        next(gen)
        t0 = time.perf_counter()
        k = sum(1 for _ in gen)
        return (time.perf_counter() - t0) / max(k, 1)

    rows, steps = [], []
    for model in a.models.split(","):
        llm = step_llm if model == "smollm2-135m" else pyllm.load(model, n_ctx=64, n_threads=a.threads)
        tok, n_vocab = llm.tokenizer, llm.n_vocab
        for ename in a.engines.split(","):
            try:
                t0 = time.perf_counter()
                eng = ENGINES[ename](tok, n_vocab)
                setup = time.perf_counter() - t0
            except ImportError as e:
                print(f"# {ename}: not installed ({e})")
                continue
            for sname, schema in SCHEMAS.items():
                ids = tok.encode(json.dumps(DOCS[sname]), add_bos=False, special=False)
                comp, per_tok = [], []
                for _ in range(a.rounds):
                    steps.append(decode_steps(a.steps))
                    t0 = time.perf_counter()
                    c = eng.compile(schema)
                    comp.append(time.perf_counter() - t0)
                    per_tok += run_doc(eng, c, ids, n_vocab)
                rows.append((model, ename, sname, len(ids), setup, statistics.median(comp), pct(per_tok, 50),
                             pct(per_tok, 99), statistics.mean(per_tok)))
                print(f"# {model} {ename} {sname}: done", flush=True)
    step = statistics.median(steps)
    print(f"\nSmolLM2 decode step (median of {len(steps)} interleaved runs of {a.steps} steps, {a.threads} threads): "
          f"{step * 1e3:.2f} ms\n")
    print("| vocabulary | engine | schema | tokens | vocab set-up s | compile ms | mask p50 ms | mask p99 ms | "
          "mean ms | p50 / step | p99 / step |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model, e, s, n, setup, comp, p50, p99, mean in rows:
        print(f"| {model} | {e} | {s} | {n} | {setup:.2f} | {comp * 1e3:.1f} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} | "
              f"{mean * 1e3:.3f} | {p50 / step:.1%} | {p99 / step:.1%} |")


if __name__ == "__main__":
    main()
