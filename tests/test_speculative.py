"""Speculative decoding (pyllm/runtime/speculative.py, SpecDecoder, run by the engine, ops._C.decode_steps).

References:
- the multi-row C++ step against M one-token steps: bit-identical logits and cache rows (every quantized row
  kernel sums a row in one order whatever M is), on every kernel path the CPU has, for f16, q8_0 and q4_rot caches;
- greedy speculative output against plain decoding (speculative="none") on the real fixtures: identical tokens,
  finish reasons and texts (and logprobs, and under a JSON schema or a GBNF grammar);
- sampling: the joint distribution of the first two tokens of a synthetic model, drafted by another synthetic
  distribution (draft model) or by a fixed guess (lookup), against the exact one: total variation < 0.03 over
  20,000 seeds (its sampling noise is ~0.01); under a grammar, every sampled reply valid for its schema.
"""

import sys
from pathlib import Path

import pytest
import torch

import pyllm
from pyllm import ops
from pyllm.errors import PyllmError
from pyllm.runtime import speculative as sp
from pyllm.runtime.sampler import Sampler, SamplerSettings

from conftest import fixture_path


# ---- prompt lookup ---------------------------------------------------------------------------------------------------
def test_lookup_proposes_what_followed_the_longest_match():
    p = sp.LookupProposer(ngram=3)
    ctx = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix (1, 2, 3) occurred at 0..2, followed by 4 5 9 ...; nothing before it to agree on: evidence 3
    assert p.propose(ctx, 3) == ([4, 5, 9], 3)
    # a shorter suffix only when no longer one matches; (2, 3) was followed by 4 and later by 7: the latest is
    # copied (neither shares the token before), and the evidence is 0, as the next token is a guess
    assert sp.LookupProposer(ngram=3).propose([1, 2, 3, 4, 5, 2, 3, 7, 6, 2, 3], 2) == ([7, 6], 0)
    # growing the same list incrementally gives what a fresh index gives
    ctx2 = ctx + [4, 5]
    assert p.propose(ctx2, 4) == sp.LookupProposer(ngram=3).propose(ctx2, 4)
    # the suffix never matches itself; nothing seen before -> no proposal
    assert sp.LookupProposer(ngram=2).propose([5, 6, 7], 4) == ([], 0)
    # a list that is not an extension restarts the index
    assert p.propose([8, 9, 8], 2) == ([9, 8], 1)


def test_lookup_copies_the_occurrence_sharing_more_context():
    # (1, 2) occurred after 5 (followed by 3 8) and, later, after 9 (followed by 3 7); the context ends 5 1 2, so
    # the earlier occurrence is the text being copied: its continuation 3 8 9 is drafted, not the latest's 3 7 5.
    # Both were followed by 3, so the match is not ambiguous: its evidence is the 3 agreeing tokens (5 1 2).
    ctx = [5, 1, 2, 3, 8, 9, 1, 2, 3, 7, 5, 1, 2]
    assert sp.LookupProposer(ngram=2).propose(ctx, 3) == ([3, 8, 9], 3)
    # a longer ngram finds the same text directly
    assert sp.LookupProposer(ngram=3).propose(ctx, 3) == ([3, 8, 9], 3)
    # the evidence counts agreeing tokens before the suffix too, up to MATCH_CAP
    assert sp.LookupProposer(ngram=4).propose(list(range(20)) + list(range(10)), 2) == ([10, 11], sp.MATCH_CAP)
    assert sp.LookupProposer(ngram=4).propose(list(range(20)) + [7, 0, 1], 2) == ([2, 3], 2)


def test_lookup_split_continuations_are_a_guess_only_when_the_contexts_agree_equally():
    # (1, 2) was followed by 3 after "5 6" and by 4 after "7 8"; the context ends "5 6 1 2": the earlier occurrence
    # agrees 4 tokens back, the latest only 2, so its 3 is copied with evidence 4, not dropped to a guess (0)
    ctx = [5, 6, 1, 2, 3, 9, 7, 8, 1, 2, 4, 9, 5, 6, 1, 2]
    assert sp.LookupProposer(ngram=2).propose(ctx, 2) == ([3, 9], 4)
    # the same contexts one token shorter before each occurrence: both agree 2 back, so it is a guess (the latest)
    assert sp.LookupProposer(ngram=2).propose([6, 1, 2, 3, 9, 8, 1, 2, 4, 9, 5, 1, 2], 2) == ([4, 9], 0)
    # past MATCH_CAP the agreement still chooses (up to SELECT_CAP): the earlier occurrence shares 12 tokens of
    # context, the latest 10, and the evidence stays capped at MATCH_CAP
    run = list(range(100, 112))
    ctx = run + [1, 2, 3] + [0, 0] + run[2:] + [1, 2, 4] + [0] + run + [1, 2]
    assert sp.LookupProposer(ngram=2).propose(ctx, 1) == ([3], sp.MATCH_CAP)


def test_lookup_cost_per_step_does_not_grow_with_the_context():
    # Each position is indexed once (ngram keys), and a proposal compares at most 2 * SELECT_CAP tokens: a
    # 4k-token context copied token by token costs the same dict work per step as a short one.
    ctx = [i % 97 for i in range(4096)]
    p = sp.LookupProposer(ngram=4)
    p.propose(ctx, 7)
    assert len(p.latest) <= 4 * 97 and len(p.previous) <= len(p.latest)
    compared = []
    agree = p._agree_before

    def counting(i, j, most):
        compared.append(most)
        return agree(i, j, most)

    p._agree_before = counting
    for t in range(64):
        ctx.append(ctx[-97])
        drafts, evidence = p.propose(ctx, 7)
        assert drafts == [ctx[len(ctx) - 97 + i] for i in range(7)] and evidence == sp.MATCH_CAP
    assert len(compared) <= 2 * 64 and all(m <= sp.SELECT_CAP for m in compared)


def test_spec_settings_errors():
    with pytest.raises(PyllmError, match="spec-k"):
        sp.parse_speculative("lookup", k=8)
    with pytest.raises(PyllmError, match="draft model"):
        sp.parse_speculative("draft")
    with pytest.raises(PyllmError, match="speculative must be"):
        sp.parse_speculative("ngram")
    assert sp.parse_speculative("none") is None and sp.parse_speculative(False) is None
    assert sp.parse_speculative(True).mode == "lookup"


def test_controller_backs_off_when_lookups_fail_and_drafts_when_they_agree():
    c = sp.SpecController(max_k=7)
    for _ in range(6):
        c.time(1, 0.010)
        c.time(8, 0.016)
        c.time(2, 0.011)
    for _ in range(30):
        c.observe(1, 0, 1)  # one-token matches never agree (open-ended text)
        c.observe(4, 5, 5)  # four-token matches always do (copying)
    assert c.choose_k(1, 7) == 0
    assert c.choose_k(4, 7) == 7
    assert c.choose_k(4, 3) == 3  # never more than proposed
    assert sp.SpecController(adaptive=False).choose_k(1, 5) == 5


def test_controller_trusts_a_longer_match_before_measuring_it():
    # At passes of 1 + 0.2 (M - 1) steps and nothing observed yet: a match of MATCH_CAP tokens (prior 8/9 per
    # token) is drafted deeper than one of 2 (2/3), and a proposal with no evidence (0: prior 0.3) not at all.
    c = sp.SpecController(max_k=7)
    for m in range(1, 9):
        c.time(m, 0.010 * (1 + 0.2 * (m - 1)))
    assert c.choose_k(sp.MATCH_CAP, 7) > c.choose_k(2, 7) > c.choose_k(0, 7) == 0


def test_controller_stops_probing_a_draft_that_cannot_pay():
    # Passes cost t1 * (1 + 0.4 k) for k drafted tokens (this host's measured multi-row slope).  A draft step at
    # 60% of a target step (a same-size draft) cannot beat plain decoding even at full acceptance: per drafted
    # token 0.6 + 0.4 = 1 target step.  One at 5% (a draft ~20x smaller) can.
    c = sp.SpecController(max_k=7)
    for m in range(1, 9):
        c.time(m, 0.010 * (1 + 0.4 * (m - 1)))
    c.draft_cost = 0.006
    assert not c.can_pay()
    for _ in range(30):
        c.observe(0, 5, 5)
    assert c.choose_k(0, 7) == 0  # even when every drafted token agrees
    c.draft_cost = 0.0005
    assert c.can_pay() and c.choose_k(0, 7) > 0


def test_controller_forgets_a_stalled_pass():
    # Reference: the controller's own choice with no pass measured (k > 0 for a long match).  A pass held up by a
    # stall, slower than its rows as one-row steps, is not kept: before t[1] is known (dropped when it is) or after
    # it (never recorded); a slow cost that is never measured again expires after max_age timings.
    c = sp.SpecController(max_k=7)
    fresh = c.choose_k(sp.MATCH_CAP, 7)
    assert fresh > 0
    c.time(4, 1.0)  # the first pass of a reply, stalled; t[1] unknown yet
    c.time(1, 0.010)
    assert 4 not in c.t and c.choose_k(sp.MATCH_CAP, 7) > 0
    c.time(4, 0.050)  # 5 steps' time for 4 rows: a stall, not a cost
    assert 4 not in c.t
    c.time(8, 0.060)  # slow but possible (6 steps for 8 rows), so kept: deep drafts stop paying
    assert c.t[8] == 0.060 and c.choose_k(sp.MATCH_CAP, 7) < 7
    for _ in range(c.max_age + 1):
        c.time(1, 0.010)
    assert 8 not in c.t and c.choose_k(sp.MATCH_CAP, 7) == fresh


def _smollm2_edit_plain(n):
    """SmolLM2 (512-token context), the EDIT prompt's ids, and its greedy reply of n tokens by plain decoding."""
    llm = pyllm.load(fixture_path("smollm2"), n_ctx=512)
    ids = llm.chat_ids(EDIT)
    llm.reset()
    return llm, ids, list(llm.generate_tokens(ids, max_tokens=n, temperature=0, speculative="none"))


def test_a_stall_in_the_first_pass_does_not_end_speculation(monkeypatch):
    """Reference: plain decoding.  The first verification pass of a greedy reply held up for 0.2 s (as a busy
    machine does now and then) used to turn speculation off for the whole reply; it goes on, with the same tokens."""
    import time

    llm, ids, plain = _smollm2_edit_plain(48)
    forward_rows, calls = sp.forward_rows, []

    def stalled_first(gen, toks, all_logits=True):
        calls.append(len(toks))
        if len(calls) == 1:
            time.sleep(0.2)
        return forward_rows(gen, toks, all_logits)

    monkeypatch.setattr(sp, "forward_rows", stalled_first)
    llm.reset()
    assert list(llm.generate_tokens(ids, max_tokens=48, temperature=0)) == plain
    st = llm.stats.spec
    assert len(calls) > 1 and st.verifies > 1 and st.accepted > 0, st


# ---- acceptance: greedy and the sampling distribution ----------------------------------------------------------------
def test_accept_greedy_is_the_argmax_chain():
    s = Sampler(SamplerSettings(temperature=0))
    rows = torch.full((4, 6), -1.0)
    for i, t in enumerate([2, 3, 5, 1]):
        rows[i, t] = 1.0
    assert sp.accept(s, rows, [2, 3, 5]) == [2, 3, 5, 1]  # all accepted + the last row's token
    assert sp.accept(s, rows, [2, 4, 5]) == [2, 3]  # first disagreement: the model's own token, then stop


V = 4


def _target(prefix):  # a synthetic "model": logits of the next token given the prefix
    g = torch.Generator().manual_seed(1000 + hash(tuple(prefix)) % 1000)
    return torch.randn(V, generator=g) * 1.5


def _draft(prefix):
    g = torch.Generator().manual_seed(77 + hash(tuple(prefix)) % 1000)
    return torch.randn(V, generator=g)


def _exact_pair():
    p = torch.softmax(_target([]), -1)
    return {(a, b): float(p[a] * torch.softmax(_target([a]), -1)[b]) for a in range(V) for b in range(V)}


def _speculative_pair(seed, mode):
    """The first two tokens of one speculative run (k = 2) over the synthetic model."""
    s = Sampler(SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
    if mode == "draft":
        drafts, qs, pre = [], [], []
        for _ in range(2):
            ids, q = sp.distribution(s, _draft(pre))
            tok = sp._draw(s, ids, q)
            drafts.append(tok)
            qs.append((ids, q))
            pre = pre + [tok]
    else:  # lookup: a fixed guess, q one-hot
        drafts, qs = [1, 2], None
    rows = torch.stack([_target(drafts[:i]) for i in range(3)])
    out = sp.accept(s, rows, drafts, qs)
    if len(out) < 2:
        out.append(s.sample(_target(out)))
    return tuple(out[:2])


@pytest.mark.parametrize("mode", ["draft", "lookup"])
def test_speculative_sampling_keeps_the_distribution(mode):
    n = 20000
    counts = {}
    for seed in range(n):
        k = _speculative_pair(seed, mode)
        counts[k] = counts.get(k, 0) + 1
    exact = _exact_pair()
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    assert tv < 0.03, tv


# ---- the multi-row C++ step -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,kind", [("smollm2", "f16"), ("smollm2", "q8_0"), ("smollm2", "q4_rot"),
                                      ("gemma3", "f16")])
def test_decode_steps_rows_equal_one_token_steps(key, kind):
    """Reference: M one-token steps.  The multi-row pass gives each row the same logits bit for bit, and stores the
    same cache rows.  The ~40-token prompt gives every M attention work enough for both threads (rows split
    between them), keys in several blocks, and Gemma 3 its QK-norm and 256-wide heads."""
    llm = pyllm.load(fixture_path(key), n_ctx=96, kv_cache=kind, n_threads=2)
    m, kv, g = llm.model, llm.kv, llm.generator
    prompt = llm.tokenize("The quick brown fox jumps over the lazy dog because it was bored, and then it ran "
                          "all the way home to tell the other foxes what it had done.")
    toks = torch.tensor([11, 523, 9071, 42, 3000, 17, 256, 1024], dtype=torch.int64)
    before = ops.get_isa()
    ops._C.emulate_avx512(True)  # where the CPU lacks AVX-512, its VNNI kernels as AVX2 code join the paths
    try:
        # every kernel path this CPU has, every row count: each row sums in the same order whatever M is
        for isa in ops._C.available_isas():
            for M in (1, 2, 3, 8):
                ops.set_isa(before)  # the prompt's rows are the same for both paths: prefill them fast
                g.reset()
                g.prefill(prompt)
                ops.set_isa(isa)
                ctx = m.decode_context(kv)
                assert ctx is not None, "the C++ step must apply to this cache"
                pos = len(g.tokens)
                seq = torch.empty(M, ctx.n_vocab)
                for i in range(M):
                    ops._C.decode_step(ctx, int(toks[i]), pos + i, seq[i:i + 1])
                rows_seq = [p.data[:, :, pos:pos + M].clone() for p in kv.parts]
                bat = torch.empty(M, ctx.n_vocab)
                ops._C.decode_steps(ctx, toks[:M].contiguous(), pos, bat, True)
                assert torch.equal(seq, bat), (isa, M, (seq - bat).abs().max())
                for a, p in zip(rows_seq, kv.parts):
                    assert torch.equal(a, p.data[:, :, pos:pos + M]), (isa, M)
                last = torch.empty(1, ctx.n_vocab)
                ops._C.decode_steps(ctx, toks[:M].contiguous(), pos, last, False)
                assert torch.equal(last[0], seq[-1])
    finally:
        ops._C.emulate_avx512(False)
        ops.set_isa(before)
    with pytest.raises(ValueError, match="1..8"):
        ops._C.decode_steps(ctx, torch.zeros(9, dtype=torch.int64), 20, torch.empty(9, ctx.n_vocab), True)
    with pytest.raises(IndexError, match="out of range"):
        ops._C.decode_steps(ctx, torch.zeros(4, dtype=torch.int64), 94, torch.empty(4, ctx.n_vocab), True)


@pytest.mark.parametrize("key,kind,depth", [("smollm2", "f16", 1020), ("smollm2", "q4_rot", 508), ("gemma3", "f16", 508)])
def test_decode_steps_rows_equal_one_token_steps_past_the_key_parts(key, kind, depth):
    """Reference: M one-token steps, as above, at depths where decode_step.cpp attends to a row's keys in parts
    (from 512 keys, 4 from 1024) and merges them: the 8 rows straddle a change of part count (1 -> 2 at 508, 3 -> 4
    at 1020), q4_rot adds the exact sink row and the rotations to the merge, and Gemma 3 its 512-key window (the
    local layers' first key moves past 0 within the pass) beside its global layers' parts."""
    llm = pyllm.load(fixture_path(key), n_ctx=depth + 16, kv_cache=kind, n_threads=2)
    m, kv, g = llm.model, llm.kv, llm.generator
    g.reset()
    g.prefill([int(t) for t in torch.randint(100, 4000, (depth,), generator=torch.Generator().manual_seed(7))])
    toks = torch.tensor([11, 523, 9071, 42, 3000, 17, 256, 1024], dtype=torch.int64)
    before = ops.get_isa()
    ops._C.emulate_avx512(True)
    try:
        for isa in ops._C.available_isas():
            ops.set_isa(isa)
            ctx = m.decode_context(kv)
            assert ctx is not None, "the C++ step must apply to this cache"
            seq = torch.empty(8, ctx.n_vocab)
            for i in range(8):
                ops._C.decode_step(ctx, int(toks[i]), depth + i, seq[i:i + 1])
            rows_seq = [p.data[:, :, depth:depth + 8].clone() for p in kv.parts]
            for M in (2, 8):
                bat = torch.empty(M, ctx.n_vocab)
                ops._C.decode_steps(ctx, toks[:M].contiguous(), depth, bat, True)
                assert torch.equal(seq[:M], bat), (isa, M, (seq[:M] - bat).abs().max())
            for a, p in zip(rows_seq, kv.parts):
                assert torch.equal(a, p.data[:, :, depth:depth + 8]), isa
    finally:
        ops._C.emulate_avx512(False)
        ops.set_isa(before)


# ---- greedy output equals plain decoding on the fixtures ---------------------------------------------------------------
CODE = '''def moving_average(values, window):
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
EDIT = [{"role": "user", "content": "Here is some code:\n\n" + CODE + "\nRewrite it with moving_average renamed to "
                                    "rolling_mean. Output only the code."}]


def _spec(k, mode="lookup", draft=None):
    return sp.SpecSettings(mode=mode, k=k, draft=draft, adaptive=False)


def _pair(llm, ids, n, spec, **kw):
    """(plain tokens, finish), (speculative tokens, finish, SpecStats), each from a fresh cache."""
    llm.reset()
    a = list(llm.generate_tokens(ids, max_tokens=n, temperature=0, speculative="none", **kw))
    fa = llm.stats.finish_reason
    llm.reset()
    b = list(llm.generate_tokens(ids, max_tokens=n, temperature=0, speculative=spec, **kw))
    return (a, fa), (b, llm.stats.finish_reason, llm.stats.spec)


@pytest.mark.parametrize("key,kind,n", [("smollm2", "f16", 160), ("qwen2", "q8_0", 96), ("gemma3", "q4_rot", 96)])
def test_greedy_lookup_equals_plain(key, kind, n):
    llm = pyllm.load(fixture_path(key), n_ctx=1024, kv_cache=kind)
    ids = llm.chat_ids(EDIT)
    (a, fa), (b, fb, st) = _pair(llm, ids, n, _spec(1))
    assert b == a and fb == fa
    assert st.verifies > 0 and st.accepted > 0, st  # speculation really ran, and copied something


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_slot_requests_speculate_alone_and_batch_beside_others(kind):
    """Reference: each prompt's plain greedy decoding (no speculation) alone on a fresh engine's slot.  On an
    engine's slots (serve --parallel) a greedy request speculates by lookup on the steps where it decodes alone and
    joins the batched pass beside others (BatchEngine.speculate, _decode_step); its tokens are plain decoding's
    either way: alone, beside two others that end sooner (its drafts then fill the batched pass's spare rows), and
    on a pool too small for every slot's whole context."""
    from pyllm.runtime.batch import BatchEngine, Request

    llm = pyllm.load(fixture_path("smollm2"), n_ctx=512, kv_cache=kind)
    prompts = [llm.chat_ids(EDIT), llm.chat_ids([{"role": "user", "content": "Count from 1 to 40: 1, 2, 3,"}]),
               llm.chat_ids([{"role": "user", "content": "Name three rivers."}])]
    lengths = [64, 24, 16]

    def run(engine, which, speculate=True):
        reqs = []
        for i in which:
            r = Request(list(prompts[i]), lengths[i], Sampler(SamplerSettings(temperature=0)))
            # not "auto" (what the server asks for): its controller times passes, and a loaded machine's timings
            # would decide how often it drafts
            reqs.append(engine.speculate(r, _spec(4)) if speculate else r)
            engine.submit(r)
        return [[v[0] for k, *v in engine.tokens(r) if k == "token"] for r in reqs], reqs

    def engine(pool=None):
        return BatchEngine(llm.model, kind, 512, 3, llm.tokenizer.is_eog, thread=False, pool_tokens=pool)

    ref = [run(engine(), [i], speculate=False)[0][0] for i in range(3)]
    for pool in (None, 2 * 512):
        e = engine(pool)
        alone, (r0,) = run(e, [0])
        assert alone == ref[:1]
        assert r0.stats.spec.verifies > 0 and r0.stats.spec.accepted > 0  # it speculated
        passes = []  # each decode step's rows per sequence
        step = llm.model.step
        llm.model.step = lambda seqs: passes.append([len(q.tokens) for q in seqs if not q.prefill]) or step(seqs)
        try:
            together, reqs = run(e, [0, 1, 2])
        finally:
            del llm.model.step
        assert together == ref
        # the longest verified drafts beside the others too: passes of several sequences, one with drafts, none
        # past one pass's rows
        beside = [p for p in passes if len(p) > 1 and max(p) > 1]
        assert beside and all(sum(p) <= 8 for p in beside), passes
        assert reqs[0].stats.spec.accepted > 0


def test_plain_steps_beside_others_teach_the_controller():
    """A slot request whose controller declines to draft beside other streams takes plain rows in their pass; each
    such step still checks the lookup's first proposed token against the token the model chose (free evidence, as
    a plain step alone does), so a controller that stopped drafting can learn that drafting would pay again.
    Reference: the controller's observations, which stay empty if the proposals are dropped."""
    from pyllm.runtime.batch import BatchEngine, Request

    llm = pyllm.load(fixture_path("smollm2"), n_ctx=512)
    e = BatchEngine(llm.model, "f16", 512, 2, llm.tokenizer.is_eog, thread=False)
    reqs = []
    # the second runs longer, so the first never decodes alone (where advance's plain steps observe anyway)
    for ids, n in ((llm.chat_ids(EDIT), 24),
                   (llm.chat_ids([{"role": "user", "content": "Count from 1 to 40: 1, 2, 3,"}]), 64)):
        r = Request(list(ids), n, Sampler(SamplerSettings(temperature=0)))
        e.speculate(r, sp.SpecSettings(mode="lookup", k=4))
        r.spec.ctrl.choose_k = lambda n, available, rows=1: 0  # never drafts
        reqs.append(e.submit(r))
    for r in reqs:
        list(e.tokens(r))
    st, ctrl = reqs[0].stats.spec, reqs[0].spec.ctrl
    assert st.verifies == 0 and st.plain_steps > 0 and reqs[1].n > reqs[0].n
    assert sum(m for _, m in ctrl.hits.values()) > 0, ctrl.hits  # observed trials of unverified proposals


def test_greedy_decoding_speculates_by_default_where_the_check_is_exact():
    """Reference: plain decoding (speculative="none").  Greedy generation with the default speculative="auto"
    drafts by lookup on the CPU's C++ step over quantized matrices (rows_exact) and gives the same tokens; it does
    not where verification is not bit-exact (the float32 reference backend), nor when sampling."""
    llm = pyllm.load(fixture_path("smollm2"), n_ctx=512)
    ids = llm.chat_ids(EDIT)
    assert llm.model.fused_step(llm.kv).rows_exact
    llm.reset()
    plain = list(llm.generate_tokens(ids, max_tokens=48, temperature=0, speculative="none"))
    assert llm.stats.spec is None
    llm.reset()
    auto = list(llm.generate_tokens(ids, max_tokens=48, temperature=0))
    st = llm.stats.spec
    assert auto == plain
    assert st is not None and st.verifies > 0 and st.accepted > 0, st
    llm.reset()
    list(llm.generate_tokens(ids, max_tokens=4, temperature=0.7, seed=1))
    assert llm.stats.spec is None
    ref = pyllm.load(fixture_path("smollm2"), n_ctx=512, kernels="reference")
    list(ref.generate_tokens(ids, max_tokens=2, temperature=0))
    assert ref.stats.spec is None


def _logprob_run(llm, ids, n, speculative, **kw):
    """(tokens, each token's (logprob, top 3) as the sampler reported it when the token was yielded, SpecStats)."""
    s = Sampler(SamplerSettings(temperature=0))
    s.logprobs = 3
    llm.reset()
    toks, lps = [], []
    for t in llm.generate_tokens(ids, max_tokens=n, sampler=s, speculative=speculative, **kw):
        toks.append(t)
        lps.append(s.last_logprobs)
    return toks, lps, llm.stats.spec


EXTRACT = [{"role": "user", "content": "Maria Lopez is a 34-year-old software engineer from Madrid. She knows "
                                       "Python, Rust and SQL. Extract her details as JSON."}]
# Every string bounded, so that a sampled reply closes within the tests' max_tokens whatever it samples (an unbounded
# skill let one seed's reply repeat a phrase past the limit).
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "city": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"},
                                           "skills": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                      "maxItems": 4}},
          "required": ["name", "city", "age", "skills"], "additionalProperties": False}


def test_logprobs_and_grammars_speculate_with_plain_decodings_tokens_and_logprobs():
    """Reference: plain decoding (speculative="none") with the same sampler settings.  A sampler that reports
    logprobs speculates by default and reports, for every token, the logprobs plain decoding reports for it (each
    from its own verification row); under a JSON schema or a GBNF grammar the drafts are the grammar's forced tokens
    or lookup drafts it allows, and the tokens are plain decoding's, ending where the grammar completes."""
    llm = pyllm.load(fixture_path("smollm2"), n_ctx=512)
    edit = llm.chat_ids(EDIT)
    a, lpa, _ = _logprob_run(llm, edit, 40, "none")
    b, lpb, st = _logprob_run(llm, edit, 40, "auto")
    assert b == a and lpb == lpa
    assert st is not None and st.accepted > 0, st
    extract = llm.chat_ids(EXTRACT)
    for kw in (dict(json_schema=PERSON),
               dict(grammar='root ::= "Name: " [A-Za-z ]+ "\\nCity: " [A-Za-z ]+ "\\nAge: " [0-9]+ "\\nDone."')):
        for spec in ("auto", _spec(7)):
            a, lpa, _ = _logprob_run(llm, extract, 96, "none", **kw)
            fa = llm.stats.finish_reason
            b, lpb, st = _logprob_run(llm, extract, 96, spec, **kw)
            assert (b, llm.stats.finish_reason) == (a, fa), kw
            # ended by the grammar: the end token comes without a forward pass, so it has no logprobs of its own
            assert llm.tokenizer.is_eog(b[-1]) and len(b) < 96, kw
            assert lpb[:-1] == lpa[:-1], kw
            assert st is not None and st.accepted > 0, (kw, st)


def test_sampling_under_a_grammar_speculates_within_it():
    """Reference: the JSON schema itself.  Sampled replies drafted by lookup (every proposal verified) advance the
    grammar with each accepted draft, so every reply is valid JSON of the schema."""
    import json

    llm = pyllm.load(fixture_path("smollm2"), n_ctx=512)
    ids = llm.chat_ids(EXTRACT)
    drafted = 0
    for seed in range(4):
        llm.reset()
        toks = list(llm.generate_tokens(ids, max_tokens=200, temperature=0.9, seed=seed, json_schema=PERSON,
                                        speculative=_spec(4)))
        drafted += llm.stats.spec.drafted
        assert llm.tokenizer.is_eog(toks[-1]), seed
        reply = json.loads(llm.tokenizer.decode(toks[:-1]))
        assert set(reply) == set(PERSON["required"]) and isinstance(reply["age"], int), reply
    assert drafted > 0


def test_exact_row_types_are_the_kernels_row_order_independent_ones():
    # pyllm/backends/cpu.py EXACT_ROW_TYPES lists the GGUF types tests/test_kernels.py holds to one summation order
    # per row whatever M is (legacy, MXFP4 and K-quants), and their rows-by-8 copies; no float type
    from pyllm.backends.cpu import EXACT_ROW_TYPES
    from pyllm.formats.gguf import GGMLType

    names = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
    base = {int(GGMLType[n]) for n in names}
    rows8 = {int(ops._C.rows8_qtype(t)) for t in base} - {-1}
    assert EXACT_ROW_TYPES == base | rows8
    assert not {int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)} & EXACT_ROW_TYPES


@pytest.mark.parametrize("isa", ["scalar", "default"])
def test_greedy_lookup_equals_plain_k7(isa):
    """Passes of up to 8 rows on SmolLM2 (Q4_1: the legacy block kernels), on the reference kernels and on the
    ones this CPU runs by default: the same tokens as plain decoding."""
    llm = pyllm.load(fixture_path("smollm2"), n_ctx=512)
    ids = llm.chat_ids(EDIT)
    before = ops.get_isa()
    ops.set_isa(before if isa == "default" else isa)
    try:
        (a, fa), (b, fb, st) = _pair(llm, ids, 32, _spec(7))
    finally:
        ops.set_isa(before)
    assert b == a and fb == fa
    assert st.accepted > 0 and st.drafted > 2 * st.verifies, st  # passes of 3..8 rows ran and agreed


@pytest.mark.parametrize("where", ["used", "unused"])
def test_non_finite_verification_rows_end_generation_only_where_plain_decoding_would(monkeypatch, where):
    """Reference: plain decoding's tokens.  A verification row that is used (the accepted drafts' rows and the row
    giving the model's own token) is checked like a plain step's logits: NaN there ends the generation with the
    non-finite error, where accept would otherwise emit whatever the argmax of NaN is.  A row after the first
    rejected draft is one plain decoding never computes: NaN there changes nothing.  The pass reports the poked
    row's argmax as the C++ pass reports a row with a NaN (-1)."""
    llm, ids, plain = _smollm2_edit_plain(32)
    real, poked = sp.forward_rows, []

    def forward_rows(gen, toks, all_logits=True):
        at = len(gen.tokens) - len(ids)  # toks[0] is plain[at]; toks[1:] are the drafts
        rows, tops = real(gen, toks, all_logits)
        assert tops is not None and len(tops) == len(toks)
        used = 1 + next((j for j, d in enumerate(toks[1:]) if at + 1 + j >= len(plain) or d != plain[at + 1 + j]),
                        len(toks) - 1)  # rows 0 .. accepted drafts
        row = used - 1 if where == "used" else used
        if row < len(toks) and (where == "unused" or used > 1) and not poked:
            rows, tops = rows.clone(), list(tops)
            rows[row, 7] = float("nan")
            tops[row] = -1
            poked.append(row)
        return rows, tops

    monkeypatch.setattr(sp, "forward_rows", forward_rows)
    llm.reset()
    if where == "used":
        with pytest.raises(PyllmError, match="non-finite logits"):
            list(llm.generate_tokens(ids, max_tokens=32, temperature=0, speculative=_spec(7)))
    else:
        assert list(llm.generate_tokens(ids, max_tokens=32, temperature=0, speculative=_spec(7))) == plain
    assert poked, "no pass had a row to poke"


def test_a_non_finite_step_ends_plain_greedy_decoding(monkeypatch):
    """Reference: the non-finite error of a plain step's logits.  A step whose row holds a NaN reports argmax -1
    (tests/test_decode_step.py), and greedy decoding, which otherwise takes the step's argmax without reading the
    row, then reads it and raises; a finite row's argmax is the token (the reply is plain decoding's up to there)."""
    from pyllm.backends import cpu

    llm, ids, plain = _smollm2_edit_plain(12)
    real, steps = cpu.CpuDecodeStep.with_argmax, []

    def with_argmax(self, token, pos):
        logits, top = real(self, token, pos)
        steps.append(top)
        if len(steps) == 5:
            logits[11] = float("nan")
            top = -1
        return logits, top

    monkeypatch.setattr(cpu.CpuDecodeStep, "with_argmax", with_argmax)
    llm.reset()
    got = []
    with pytest.raises(PyllmError, match="non-finite logits"):
        for t in llm.generate_tokens(ids, max_tokens=12, temperature=0, speculative="none"):
            got.append(t)
    assert got == plain[:5] and steps[:4] == plain[1:5]


def test_greedy_lookup_near_the_context_limit():
    llm = pyllm.load(fixture_path("smollm2"), n_ctx=256)
    ids = llm.chat_ids(EDIT)
    n_ctx = len(ids) + 37
    llm = pyllm.load(fixture_path("smollm2"), n_ctx=n_ctx)
    (a, fa), (b, fb, st) = _pair(llm, ids, 100, _spec(1))
    assert fa == "context" and fb == "context"
    assert b == a and len(a) == n_ctx - len(ids) + 1  # the last token is yielded, not cached (it has no room)
    assert len(llm.generator.tokens) <= n_ctx


def test_greedy_lookup_with_stop_strings_and_a_chat_reusing_its_prefix():
    llm = pyllm.load(fixture_path("smollm2"), n_ctx=1024)
    replies = {}
    for mode in ("none", _spec(1)):
        llm.reset()
        text = llm.generate(llm.chat_ids(EDIT), max_tokens=80, temperature=0, stop=["total"], speculative=mode)
        assert llm.stats.finish_reason in ("stop", "eog", "length")
        msgs = EDIT + [{"role": "assistant", "content": text}, {"role": "user", "content": "Now add a docstring."}]
        second = llm.chat(msgs, max_tokens=60, temperature=0, speculative=mode)
        st = llm.stats
        assert st.prompt_evaluated < st.prompt_tokens  # the first turn came from the cache
        replies[mode if mode == "none" else "lookup"] = (text, second)
    assert replies["lookup"] == replies["none"]


def test_draft_model_greedy_equals_plain_and_vocab_is_checked():
    llm = pyllm.load(fixture_path("smollm2"), n_ctx=512, draft=fixture_path("smollm2"))
    ids = llm.chat_ids(EDIT)
    (a, fa), (b, fb, st) = _pair(llm, ids, 48, _spec(1, "draft", llm.draft))
    assert b == a and fb == fa
    assert st.acceptance > 0.9, st  # the same weights draft: nearly everything agrees
    with pytest.raises(PyllmError, match="vocabulary of 151936 tokens"):
        llm.set_draft(fixture_path("qwen2"))


def test_readme_example_and_cli(capsys):
    from pyllm.cli.main import main

    llm = pyllm.load("smollm2-135m", n_ctx=256)
    text = llm.generate("Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown", max_tokens=16,
                        temperature=0, speculative="lookup")
    st = llm.stats.spec
    assert text and st is not None and 0.0 <= st.acceptance <= 1.0 and st.verifies + st.plain_steps > 0
    assert main(["run", "smollm2-135m", "a b c a b c a b", "-n", "8", "--temp", "0", "--ctx", "128", "--spec",
                 "lookup", "-v"]) == 0
    assert "speculative:" in capsys.readouterr().err
    assert main(["run", "smollm2-135m", "hi", "-n", "2", "--ctx", "128", "--spec", "draft"]) == 1
    assert capsys.readouterr().err.strip() == \
        "pyllm: error: speculative mode 'draft' needs a draft model (--draft MODEL)"
    # out of range: a usage error (exit 2) before the model loads, as for every numeric flag
    assert main(["run", "smollm2-135m", "hi", "-n", "2", "--ctx", "128", "--spec", "lookup", "--spec-k", "9"]) == 2
    assert "argument --spec-k: must be in [1, 7], got 9" in capsys.readouterr().err


def test_bench_spec_runs_every_shipped_prompt_and_reports_plain_decodings_tokens(capsys):
    """`pyllm bench --spec lookup`: a row per shipped prompt (grounded, open and JSON-schema ones), each reply the
    same tokens as plain decoding's, and the structured replies valid JSON."""
    import json

    from pyllm.cli.bench import spec_prompts
    from pyllm.cli.main import main

    assert main(["bench", "smollm2-135m", "--spec", "lookup", "-n", "12", "-r", "1", "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    prompts = spec_prompts()
    assert [r["prompt"] for r in rows] == [p["name"] for p in prompts]
    assert {p["kind"] for p in prompts} == {"grounded", "open", "structured"}
    assert all(r["same_tokens"] and r["n_gen"] > 1 for r in rows), rows
    assert all(p["json_schema"]["type"] == "object" for p in prompts if p["kind"] == "structured")
    # the replay drafts without a grammar, so it leaves the JSON-schema prompts out
    assert [p["name"] for p in _spec_replay_tool().load_prompts(None)] == \
        [p["name"] for p in prompts if "json_schema" not in p]


def _spec_replay_tool():
    import importlib.util

    if "spec_replay" not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "tools" / "spec_replay.py"
        spec = importlib.util.spec_from_file_location("spec_replay", path)
        tool = importlib.util.module_from_spec(spec)
        sys.modules["spec_replay"] = tool  # a dataclass looks its annotations up in its module
        spec.loader.exec_module(tool)
    return sys.modules["spec_replay"]


def test_spec_replay_counts_passes_like_the_generator():
    # tools/spec_replay.py's model of a run, on token lists whose answer is known: a reply that copies the prompt
    # verbatim, with free extra rows, is emitted 8 tokens per pass by the oracle (7 drafts + the model's own);
    # a reply of tokens the prompt never had gets no drafts, so every policy is plain decoding (1.00x).
    tool = _spec_replay_tool()
    prompt = list(range(100, 200))
    copy = prompt[:57]  # 56 tokens after the prefill's first: 7 passes of 8
    free = {m: 1.0 for m in range(1, 9)}
    assert tool.replay(prompt, copy, free, "oracle", 4, 7) == pytest.approx(56 / 7)
    linear = {m: 1 + 0.5 * (m - 1) for m in range(1, 9)}
    ctrl = tool.replay(prompt, copy, linear, "controller", 4, 7)
    assert 1.0 < ctrl <= tool.replay(prompt, copy, linear, "oracle", 4, 7) + 1e-9
    fresh = list(range(1000, 1060))
    assert tool.replay(prompt, fresh, linear, "controller", 4, 7) == pytest.approx(1.0)
    assert tool.replay(prompt, fresh, linear, "oracle", 4, 7) == pytest.approx(1.0)
    # the ideal copy drafts the true continuation wherever it occurs: 8 tokens per pass on the verbatim copy, none
    # on tokens never seen
    assert tool.ideal_copy(prompt, copy, free, 7) == pytest.approx(56 / 7)
    assert tool.ideal_copy(prompt, fresh, linear, 7) == pytest.approx(1.0)
    # a reply copying the first of two pieces that start with token 1: after its first token (1, from the prefill)
    # the ideal drafts 2..8 in one pass; the lookup copies the latest 1 (followed by 20), so the oracle takes a
    # plain step (2) and then drafts 3..8: two passes
    prompt2 = [50, 1, 2, 3, 4, 5, 6, 7, 8, 60, 1, 20, 21, 22, 23, 24, 25, 26]
    reply2 = [1, 2, 3, 4, 5, 6, 7, 8]
    assert tool.ideal_copy(prompt2, reply2, free, 7) == pytest.approx(7.0)
    assert tool.replay(prompt2, reply2, free, "oracle", 4, 7) == pytest.approx(3.5)
    # verifying both occurrences of 1 at once (the earlier one is followed by 2..8) drafts like the ideal copy; a
    # reply continuing neither gets nothing from candidates
    assert tool.oracle_candidates(prompt2, reply2, free, 4, 7, False) == pytest.approx(7.0)
    assert tool.oracle_candidates(prompt2, reply2, free, 4, 7, True) == pytest.approx(7.0)
    assert tool.oracle_candidates(prompt, fresh, linear, 4, 7, True) == pytest.approx(1.0)
    # three occurrences of 1: the lookup's pair (the two latest) misses the first, every occurrence finds it
    prompt3 = [50, 1, 2, 3, 4, 5, 6, 7, 8, 60, 1, 20, 21, 61, 1, 30, 31]
    assert tool.oracle_candidates(prompt3, reply2, free, 4, 7, False) == pytest.approx(3.5)
    assert tool.oracle_candidates(prompt3, reply2, free, 4, 7, True) == pytest.approx(7.0)


def test_spec_replay_breakdown_and_hindsight_table():
    # Where a policy's passes went, on token lists whose answer is counted by hand.  The reply copies the first of
    # two pieces starting with token 1; its first token (1) comes from the prefill.
    tool = _spec_replay_tool()
    prompt = [50, 1, 2, 3, 4, 5, 6, 7, 8, 60, 1, 20, 21, 22, 23, 24, 25, 26]
    reply = [1, 2, 3, 4, 5, 6, 7, 8]
    linear = {m: 1 + 0.5 * (m - 1) for m in range(1, 9)}
    # a table drafting 7 only on evidence 0: the first lookup (1 -> 20 or 2: evidence 0) copies the latest (20...),
    # a wholly rejected pass costing cost[8] - cost[1] = 3.5 more than a plain step; every later lookup has
    # evidence >= 2, so six plain steps follow, each with a draft right for 6, 5, .., 1 tokens
    r = tool.replay_passes(prompt, reply, linear, {0: 7}, 4, 7)
    assert (r.passes, r.rejected, r.rejected_cost, r.plain, r.skipped, r.skipped_tokens) == (1, 1, 3.5, 6, 6, 21)
    # k = 3 on evidence 2 (the lookup of "1 2"): the pass stops 3 tokens short of the 6 its draft had right; the
    # lookups after it have evidence 6 and 7 (not in the table): plain steps whose drafts were right for 2 and 1
    r = tool.replay_passes(prompt, reply, linear, {2: 3}, 4, 7)
    assert (r.passes, r.short, r.short_tokens, r.plain, r.skipped, r.skipped_tokens) == (1, 1, 3, 3, 2, 3)
    assert r.speedup == pytest.approx(7 / (3 * 1.0 + linear[4]))
    # drafting past the first wrong token: a verbatim copy of the prompt's first 60 tokens, then tokens of its own;
    # passes of 8 from the second token leave 3 copied ones for the last pass, whose other 4 drafted rows are wasted
    copy = list(range(100, 160)) + [999, 998, 997, 996]
    r = tool.replay_passes(list(range(100, 200)), copy, linear, {e: 7 for e in range(9)}, 4, 7)
    assert (r.over, r.over_rows, r.over_cost, r.rejected) == (1, 4, linear[8] - linear[4], 0)
    # the hindsight table of a verbatim copy with free rows drafts 7 wherever the lookup has evidence: the
    # oracle's 8 tokens per pass; on that two-piece reply it skips the evidence-0 guess and drafts the rest
    free = {m: 1.0 for m in range(1, 9)}
    best, table = tool.hindsight_table(list(range(100, 200)), list(range(100, 157)), free, 4, 7)
    assert best == pytest.approx(8.0)
    best, table = tool.hindsight_table(prompt, reply, linear, 4, 7)
    assert table[0] == 0 and best == pytest.approx(7 / (1.0 + linear[6]))
    assert best >= tool.replay(prompt, reply, linear, "controller", 4, 7)


def test_spec_replay_reads_the_held_out_prompts(tmp_path):
    # the held-out prompts are of the shipped kinds, none of them a shipped prompt; a bad file is one clear error
    tool = _spec_replay_tool()
    root = Path(__file__).resolve().parent.parent
    shipped = tool.load_prompts(None)
    held = tool.load_prompts(str(root / "tools" / "spec_heldout.json"))
    assert {p["kind"] for p in held} == {p["kind"] for p in shipped} == {"grounded", "open"}
    assert not {p["prompt"] for p in held} & {p["prompt"] for p in shipped}
    assert not {p["name"] for p in held} & {p["name"] for p in shipped}
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="cannot read prompts from .*p.json"):
        tool.load_prompts(str(bad))


def test_spec_replay_reads_a_cost_table():
    tool = _spec_replay_tool()
    assert tool.parse_costs("1.13,1.28,1.47,1.83,1.97,2.23,2.49") == {1: 1.0, 2: 1.13, 3: 1.28, 4: 1.47, 5: 1.83,
                                                                       6: 1.97, 7: 2.23, 8: 2.49}
    for text in ("1.1,1.2", "1.1,1.2,x,1,1,1,1", "0.5,1,1,1,1,1,1"):
        with pytest.raises(SystemExit, match="--costs needs 7 numbers"):
            tool.parse_costs(text)
