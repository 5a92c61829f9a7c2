"""The paged KV cache (runtime/kv_pool.py): a pool of blocks, block tables, shared prefixes, copy on write.

References.  Logits: a contiguous KVCache of the same kind fed the same tokens; the paged cache stores the same
bytes and every path (the torch forward's prefill and cached attention, the C++ one-token step, its multi-row
pass, the batched step) reads the same values in the same order through the block table, so the tolerance is 0
(torch.equal) for every kind, the sliding window included.  Pool bookkeeping: a model of it kept in plain Python
beside random operation sequences (hypothesis), whose rows must read back exactly what each sequence wrote.
"""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pyllm
from pyllm import ops
from pyllm.errors import PyllmError
from pyllm.runtime import batch
from pyllm.runtime.slots import Slot, decode_rows_with_argmax, prefill_chunk
from pyllm.runtime.kv_cache import KVCache
from pyllm.runtime.kv_kinds import KV_KINDS
from pyllm.runtime.kv_pool import BlockPool, PagedKVCache, PoolFullError, slot_caches

from conftest import pyllm_model


@pytest.fixture(scope="module")
def _extension():
    """The C++ step's tests are about the extension: a build that fails is a failure, never a skip."""
    pyllm._ext.load()


def _pool_for(model, kind, n_blocks=64, block_rows=4):
    c = model.cfg
    return BlockPool(kind, c.n_layer, c.n_kv_head, c.head_dim, n_blocks, block_rows)


def _contiguous(model, kind, n_ctx):
    c = model.cfg
    return KVCache(c.n_layer, c.n_kv_head, n_ctx, c.head_dim, kind)


def _run(model, kv, prompt, steps, cpp):
    """Logits of a prompt prefilled in two chunks (the second attends over the cache), then greedy steps: the C++
    step where ``cpp`` (and the multi-row pass for two tokens at the end), else the torch forward one token at a
    time."""
    assert len(prompt) > 9
    out = [model.forward(torch.tensor(prompt[:9]), 0, kv)[0], model.forward(torch.tensor(prompt[9:]), 9, kv)[0]]
    pos, tok = len(prompt), int(out[-1].argmax())
    model.use_cpp_decode = cpp
    try:
        for _ in range(steps):
            lg = model.forward(torch.tensor([tok]), pos, kv)[0]
            out.append(lg)
            pos, tok = pos + 1, int(lg.argmax())
        if cpp:
            step = model.fused_step(kv)
            assert step is not None, "the C++ step does not apply"
            kv.check_room(pos, 2)
            out += list(step.rows(torch.tensor([tok, 7]), pos))
    finally:
        model.use_cpp_decode = True
    return torch.stack(out)


CASES = [("smollm2", list(KV_KINDS) + ["f16/q8_0", "q4_rot/f16"]), ("qwen2", ["f16", "q4_0"]),
         ("gemma3", ["f16", "q8_0/q4_rot"])]


@pytest.mark.parametrize("key,kinds", CASES)
def test_paged_logits_equal_contiguous(_extension, key, kinds):
    llm = pyllm_model(key, n_ctx=256, n_threads=1)
    model = llm.model
    saved = model.spec
    if key == "gemma3":  # keys leave the local layers' window within the prompt and the steps below
        model.spec = model.spec.with_windows(6, where=lambda layer: layer.window)
    try:
        prompt = llm.tokenize("The quick brown fox jumps over the lazy dog. " * 2)[:21]
        for kind in kinds:
            cpp = kind.split("/")[0] != "bf16" and kind.split("/")[-1] != "bf16"  # bf16: no C++ step
            ref = _run(model, _contiguous(model, kind, 64), prompt, 6, cpp)
            paged = _run(model, _pool_for(model, kind).cache(64), prompt, 6, cpp)
            assert torch.equal(paged, ref), f"{key} {kind}: paged logits differ from the contiguous cache's"
            if cpp:  # and the torch forward's own one-token path
                ref = _run(model, _contiguous(model, kind, 64), prompt, 3, False)
                paged = _run(model, _pool_for(model, kind).cache(64), prompt, 3, False)
                assert torch.equal(paged, ref), f"{key} {kind}: torch path"
    finally:
        model.spec = saved


def test_paged_logits_equal_reference_backend():
    """The reference backend (plain torch forward, the oracle) over a paged cache of its own pool."""
    llm = pyllm.load(pyllm_model("smollm2", n_ctx=64).path, n_ctx=64, kernels="reference")
    model = llm.model
    prompt = llm.tokenize("Paris is the capital of France, and Berlin is the capital of Germany.")[:14]
    for kind in ("f16", "q4_rot"):
        c = model.cfg
        pool = model.backend.make_kv_pool(kind, c.n_layer, c.n_kv_head, c.head_dim, 32, 4)
        ref = _run(model, _contiguous(model, kind, 64), prompt, 3, False)
        assert torch.equal(_run(model, pool.cache(64), prompt, 3, False), ref), kind


def _prefill(model, slot, ids):
    while prefill_chunk(model, slot, ids) is None:
        pass


def test_batched_step_over_one_pool(_extension):
    """decode_batch over caches of one pool, two of them sharing a prompt's blocks: every row equals its sequence
    alone on a contiguous cache, bit for bit, and the shared blocks are copied only where a sequence writes."""
    llm = pyllm_model("smollm2", n_ctx=256, n_threads=1)
    model = llm.model
    for kind in ("f16", "q8_0", "q4_rot/f16"):
        pool = _pool_for(model, kind, n_blocks=256, block_rows=16)
        long = llm.tokenize("Once upon a time, in a small village by the sea, there lived an old fisherman. " * 8)
        assert len(long) >= 75
        prompts = [long[:70], long[:75], llm.tokenize("def fibonacci(n):\n    ")]
        alone = [Slot(i, _contiguous(model, kind, 160)) for i in range(3)]
        paged = [Slot(i, pool.cache(160)) for i in range(3)]
        for s, ids in zip(alone, prompts):
            _prefill(model, s, ids)
        _prefill(model, paged[0], prompts[0])
        paged[1].copy_prefix(paged[0], 64)  # the first whole chunk, by reference
        assert paged[1].kv.seq.blocks == paged[0].kv.seq.blocks[:4]
        assert all(pool.refs[b] == 2 for b in paged[0].kv.seq.blocks[:4])
        _prefill(model, paged[1], prompts[1])
        _prefill(model, paged[2], prompts[2])
        assert paged[1].kv.seq.blocks[:4] == paged[0].kv.seq.blocks[:4], "a read copied a shared block"
        toks = [11, 12, 13]
        for step in range(4):
            ref = []
            for s, t in zip(alone, toks):
                lg = torch.empty(model.cfg.n_vocab)
                s.kv.check_room(len(s.tokens), 1)
                ops._C.decode_step(s.context(model), t, len(s.tokens), lg)
                s.tokens.append(t)
                ref.append(lg)
            got, _ = decode_rows_with_argmax(model, paged, toks)
            for b in range(3):
                assert torch.equal(got[b], ref[b]), f"{kind} step {step} row {b}"
            toks = [int(r.argmax()) for r in ref]


def test_copy_on_write_keeps_the_other_sequence(_extension):
    """A sequence that rewrites a shared block (its prompt diverges inside it) gets its own copy; the other's
    logits stay those of a cache nobody shared."""
    llm = pyllm_model("smollm2", n_ctx=256, n_threads=1)
    model = llm.model
    pool = _pool_for(model, "q8_0", n_blocks=64, block_rows=8)
    a, b = pool.cache(64), pool.cache(64)
    ids = llm.tokenize("The capital of France is Paris. The capital of Italy is Rome. " * 3)[:20]
    model.forward(torch.tensor(ids), 0, a)
    b.copy_prefix_from(a, 20)  # shares blocks 0..2, the last one partly filled
    shared = list(b.seq.blocks)
    assert shared == a.seq.blocks and all(pool.refs[x] == 2 for x in shared)
    model.forward(torch.tensor([5, 6, 7]), 18, b)  # b diverges inside block 2
    assert b.seq.blocks[:2] == shared[:2] and b.seq.blocks[2] != shared[2] and pool.refs[shared[2]] == 1
    ref = _contiguous(model, "q8_0", 64)
    model.forward(torch.tensor(ids), 0, ref)
    for pos, t in enumerate((9, 10, 11), start=20):
        assert torch.equal(model.forward(torch.tensor([t]), pos, a), model.forward(torch.tensor([t]), pos, ref))
    back = _contiguous(model, "q8_0", 64)  # and a paged prefix copies into a contiguous cache
    back.copy_prefix_from(b, 21)
    for layer in range(model.cfg.n_layer):
        assert all(torch.equal(x, y) for x, y in zip(back.view(layer, 21), b.view(layer, 21)))
    a.release()
    b.release()
    assert pool.used_blocks == 0 and pool.free_blocks == pool.n_blocks


def test_pool_bounds_and_errors(_extension):
    pool = BlockPool("f16", 2, 2, 64, n_blocks=3, block_rows=4)
    assert pool.block_bytes == 2 * 2 * 2 * 4 * 64 * 2 and pool.capacity_bytes == 3 * pool.block_bytes
    a = pool.cache(32)
    a.check_room(0, 12)
    assert pool.used_blocks == 3 and pool.reserved_bytes == pool.capacity_bytes
    with pytest.raises(PoolFullError, match="pool is full: all 3 blocks"):
        pool.cache(32).check_room(0, 1)
    with pytest.raises(PyllmError, match="holds 32 positions"):
        a.check_room(30, 3)
    a.trim(5)  # positions 0..4 stay: blocks 0 and 1
    assert a.seq.blocks == [0, 1] and pool.free_blocks == 1
    a.release()
    assert pool.free_blocks == 3 and pool.reserved_bytes == pool.capacity_bytes  # high-water mark
    for bad in (0, 3, 6):
        with pytest.raises(PyllmError, match="power of two" if bad else "at least one"):
            BlockPool("f16", 2, 2, 64, n_blocks=0 if not bad else 4, block_rows=bad or 4)
    with pytest.raises(PyllmError, match="unknown KV cache type"):
        BlockPool("q5_0", 2, 2, 64, 4)


def test_step_checks_the_block_table(_extension):
    """A table entry outside the pool is refused by the step (IndexError), never read."""
    llm = pyllm_model("smollm2", n_ctx=256, n_threads=1)
    model = llm.model
    kv = _pool_for(model, "f16", n_blocks=8).cache(32)
    model.forward(torch.tensor([1, 2, 3]), 0, kv)
    step = model.fused_step(kv)
    assert step is not None
    kv.seq.table[0] = 8
    with pytest.raises(IndexError, match="block table entry 0 is 8, outside the pool's 8 blocks"):
        step(4, 3)
    kv.seq.table[0] = kv.seq.blocks[0]


def _tokens(r, n=None):
    """The tokens request r streams (n of them, or until it ends)."""
    toks = []
    while n is None or len(toks) < n:
        item = r.out.get(timeout=120)
        if item[0] != "token":
            assert item[0] == "end", item
            break
        toks.append(item[1])
    return toks


def test_engine_slots_share_one_pool(_extension):
    """The server's slots take blocks from one pool as they grow: 32 slots of 8192 positions reserve nothing up
    front, a request takes the blocks of its rows, a finished one keeps only its reusable prompt rows, a request
    whose prompt starts like a running one's shares that one's blocks, and a cancelled one gives its blocks back.
    Reference for the tokens: the same greedy request alone (batch invariance)."""
    from pyllm.runtime.sampler import Sampler

    llm = pyllm_model("smollm2", n_ctx=256, n_threads=1)
    cfg = llm.config
    eng = batch.BatchEngine(llm.model, "f16", 8192, 32, llm.tokenizer.is_eog)
    try:
        pool = eng.slots[0].kv.pool
        assert all(s.kv.pool is pool for s in eng.slots)
        per_token = KVCache.bytes_per_token(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, "f16")
        full = 32 * per_token * 8192
        reusable = 64 // pool.block_rows  # blocks of the prompt's reusable rows: one 64-token chunk
        assert pool.capacity_bytes == full and pool.reserved_bytes == 0
        ids = llm.tokenize("The history of the printing press begins in the fifteenth century. " * 8)[:100]

        def request(prompt, n):
            return eng.submit(batch.Request(ids=list(prompt), max_tokens=n, sampler=Sampler(temperature=0)))

        alone = _tokens(request(ids, 4))
        assert pool.used_blocks == reusable  # the finished slot kept its reusable 64 rows
        # a long request holds the slot with those rows; the next one lands in another slot and shares them
        long = request(ids, 4000)
        assert _tokens(long, 4) == alone
        other = ids[:70] + llm.tokenize(" Gutenberg")
        shared = _tokens(request(other, 4))

        def blocks():
            return [list(s.kv.seq.blocks) for s in eng.slots if s.kv.seq.blocks]

        a, b = sorted(eng.call(blocks), key=len, reverse=True)
        assert b == a[:reusable] and all(pool.refs[x] == 2 for x in b), "the second slot copied the prefix"
        long.cancel.set()
        _tokens(long)
        assert eng.call(lambda: pool.used_blocks) == reusable  # the cancelled slot kept its reusable rows only
        r = request(other, 4)
        assert _tokens(r) == shared and eng.cache_hits == 3
        assert pool.reserved_bytes <= 512 * per_token < full / 100
    finally:
        eng.close()


# ---- the pool's bookkeeping under random operations --------------------------------------------------------------
# appends and forks weigh more: a wrong share shows once two holders of one block both write after it
OPS = st.lists(st.tuples(st.sampled_from(["admit", "append", "append", "append", "fork", "fork", "share", "finish",
                                          "cancel", "trim"]),
                         st.integers(0, 3), st.integers(0, 3), st.integers(1, 6)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(OPS, st.sampled_from(list(KV_KINDS) + ["q8_rot/f32"]))
@example([("admit", 0, 0, 5), ("fork", 0, 1, 1), ("append", 0, 0, 2), ("append", 1, 0, 2)], "q4_rot")
@example([("admit", 0, 0, 9), ("admit", 1, 0, 3), ("share", 0, 1, 2), ("append", 1, 0, 3), ("append", 0, 0, 1),
          ("finish", 0, 0, 1), ("admit", 2, 0, 9)], "q8_0")
def test_no_block_leaked_or_shared_wrongly(ops_, kind):
    """Random admit / append / finish / cancel / fork / prefix-share / trim over a small pool, each sequence
    mirrored by a contiguous cache given the same writes.  After every operation: each block's reference count is
    the number of sequences holding it, the free blocks are exactly those of count 0, every sequence reads back
    exactly its mirror's rows (a block shared wrongly, or written without its copy, shows another sequence's
    rows), and once every sequence is gone every block is free."""
    pool = BlockPool(kind, 1, 1, 32, n_blocks=24, block_rows=4)
    seqs: dict[int, tuple[PagedKVCache, KVCache, list[int]]] = {}  # id -> (cache, mirror, [its length])
    gen = torch.Generator().manual_seed(0)

    def write(kv, mirror, n, t):
        need, free = kv.blocks_to_write(n[0], t), pool.free_blocks
        if not kv.reserve(n[0], t):  # all the blocks it needs, or none
            assert need > free == pool.free_blocks
            with pytest.raises(PoolFullError):
                kv.check_room(n[0], t)
            kv.trim(n[0])  # what check_room took before it ran out
            return
        assert free - pool.free_blocks == need and kv.blocks_to_write(n[0], t) == 0
        k, v = torch.randn(t, 1, 32, generator=gen) * 4, torch.randn(t, 1, 32, generator=gen)
        kv.update(0, n[0], k, v)
        mirror.update(0, n[0], k, v)
        n[0] += t

    for op, i, j, t in ops_:
        if op == "admit" and i not in seqs:
            seqs[i] = (pool.cache(40), KVCache(1, 1, 40, 32, kind), [0])
            write(*seqs[i], t)
        elif op == "append" and i in seqs and seqs[i][2][0] + t <= 40:
            write(*seqs[i], t)
        elif op in ("finish", "cancel") and i in seqs:
            seqs.pop(i)[0].release()
        elif op == "fork" and i in seqs and j not in seqs:
            kv, mirror, n = seqs[i]
            twin = KVCache(1, 1, 40, 32, kind)
            twin.copy_prefix_from(mirror, n[0])
            seqs[j] = (kv.fork(), twin, [n[0]])
        elif op == "share" and i in seqs and j in seqs and i != j:
            (src, smirror, sn), (dst, dmirror, dn) = seqs[i], seqs[j]
            dn[0] = min(sn[0], t * 4)
            dst.copy_prefix_from(src, dn[0])
            dmirror.copy_prefix_from(smirror, dn[0])
        elif op == "trim" and i in seqs:
            kv, _, n = seqs[i]
            n[0] = min(n[0], t)
            kv.trim(n[0])
        held: dict[int, int] = {}
        for kv, mirror, (n,) in seqs.values():
            assert len(kv.seq.blocks) * 4 >= n
            assert kv.seq.table[:len(kv.seq.blocks)].tolist() == kv.seq.blocks
            for b in kv.seq.blocks:
                held[b] = held.get(b, 0) + 1
            if n:
                got, want = kv.view(0, n), mirror.view(0, n)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert all(pool.refs[b] == held.get(b, 0) for b in range(pool.n_blocks))
        assert sorted(pool._free) == [b for b in range(pool.n_blocks) if b not in held]
    for kv, _, _ in seqs.values():
        kv.release()
    assert pool.used_blocks == 0 and all(r == 0 for r in pool.refs)


def _engine_tokens(eng, reqs):
    """Each request's streamed tokens, the engine stepped in this thread (thread=False) until all have ended."""
    out = []
    for r in reqs:
        toks = []
        for item in eng.tokens(r):
            if item[0] == "token":
                toks.append(item[1])
        out.append(toks)
    return out


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_small_pool_admits_waits_and_preempts(_extension, kind):
    """Four greedy requests over a pool of one context (64 positions, 4 blocks of 16) with three slots: a request waits
    in the queue until its prompt's blocks are free, and a running one that cannot grow is preempted and resumed
    (its prompt read again, its generated tokens' rows rewritten as decode rows).  Reference: the same requests in
    an engine whose pool holds every slot's context, which never waits nor preempts; every request's tokens must
    be the same, bit for bit the same logits being what makes greedy tokens equal.  Afterwards no block is held
    but the idle slots' kept rows."""
    from pyllm.runtime.sampler import Sampler

    llm = pyllm_model("smollm2", n_ctx=256, n_threads=1)
    prompts = [llm.tokenize(t) for t in ("The river ran past the old mill and", "def add(a, b):\n",
                                         "Paris is the capital of", "One, two, three,")]

    def run(pool_tokens):
        eng = batch.BatchEngine(llm.model, kind, 64, 3, llm.tokenizer.is_eog, thread=False, pool_tokens=pool_tokens,
                                block_rows=16)
        reqs = [eng.submit(batch.Request(ids=list(p), max_tokens=40, sampler=Sampler(temperature=0)))
                for p in prompts]
        return eng, _engine_tokens(eng, reqs)

    big, want = run(None)
    small, got = run(64)
    assert big.preemptions == 0 and small.preemptions > 0
    assert small.pool.n_blocks == 4
    assert got == want
    kept = sum(len(s.kv.seq.blocks) for s in small.slots if not s.busy)
    assert small.pool.used_blocks == kept
    with pytest.raises(PyllmError, match="cannot hold one context"):
        batch.BatchEngine(llm.model, kind, 64, 3, llm.tokenizer.is_eog, thread=False, pool_tokens=63)


class _HistoryModel:
    """A model for the scheduler: a token's K/V row holds the token; the next token is a function of every row the
    cache holds (read back through the block table), so a row lost, misplaced or rewritten wrongly by a
    preemption changes the output.  _history_tokens is the same function without a cache: the reference."""

    VOCAB = 16
    use_cpp_decode = False

    def __init__(self, exact_rows: int | None = None):
        from types import SimpleNamespace

        from pyllm.backends.cpu import CpuBackend

        self.cfg = SimpleNamespace(n_layer=1, n_kv_head=1, head_dim=32)
        self.exact_rows = exact_rows
        self.backend = CpuBackend()

    def fused_step(self, kv):
        return None

    def fused_logits(self, token, pos, kv):
        return None  # no fused step: a lone decode token goes through step, as every other row

    def prefill_exact_rows(self, kv):
        return self.exact_rows  # a row is its token whatever the forward; None: prompts are read a chunk a step

    def step(self, seqs):
        from pyllm.backends.base import StepRows

        out = []
        for sq in seqs:
            sq.kv.check_room(sq.pos, len(sq.tokens))
            rows = torch.tensor(sq.tokens, dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, 32)
            sq.kv.update(0, sq.pos, rows, rows)
            k, _ = sq.kv.view(0, sq.pos + len(sq.tokens))
            stored = k[0, :, 0].round().long().tolist()
            ends = range(sq.pos + 1, sq.pos + len(sq.tokens) + 1) if sq.all_logits else [sq.pos + len(sq.tokens)]
            logits = torch.zeros(len(ends), self.VOCAB)
            for r, n in enumerate(ends):
                logits[r, _next_token(stored[:n])] = 1.0
            out.append(StepRows(logits, None))
        return out


def _next_token(history: list[int]) -> int:
    return (sum((i + 3) * t for i, t in enumerate(history)) * 7 + len(history)) % _HistoryModel.VOCAB


def _history_tokens(prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(_next_token(seq))
        seq.append(out[-1])
    return out


REQUESTS = st.lists(st.tuples(st.lists(st.integers(0, 15), min_size=1, max_size=70), st.integers(1, 60)),
                    min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(REQUESTS, st.integers(1, 4), st.integers(0, 6), st.booleans(), st.booleans(), st.sampled_from([None, 1, 9]))
@example([([1] * 70, 60), ([1] * 70 + [2], 60), ([3], 60)], 3, 0, False, False, None)
@example([([1], 100), ([2] * 143, 10), ([2] * 143, 10)], 3, 0, True, False, None)
@example([([1], 100), ([2] * 143, 10), ([2] * 130, 10)], 3, 0, False, True, 9)
def test_any_load_on_a_small_pool_gives_each_request_its_own_output(requests, n_slots, extra_blocks, fork, stall,
                                                                    exact_rows):
    """Random prompts (some sharing prefixes longer than a reused chunk; with ``fork`` the first one twice: n = 2
    choices of one prefill) and lengths over a pool of one context plus a few blocks, prompts read whole or (with
    ``stall``) a part a step beside the decoding ones, in chunks or (``exact_rows``) spans: every request ends with exactly the tokens it gives alone
    (no error, whatever waits or is preempted, while decoding or reading its prompt, and resumed), and afterwards
    the pool holds only the idle slots' kept rows."""
    from pyllm.runtime.sampler import Sampler

    n_ctx = 160
    if fork and n_slots > 1:
        requests = requests[:1] + requests
    model = _HistoryModel(exact_rows)
    eng = batch.BatchEngine(model, "f16", n_ctx, n_slots, lambda t: False, thread=False,
                            pool_tokens=n_ctx + 16 * extra_blocks)
    reqs, top = batch.make_requests([(p, min(n, n_ctx - len(p)), Sampler(temperature=0)) for p, n in requests],
                                    group=n_slots)
    stall, batch.PREFILL_STALL = batch.PREFILL_STALL, 0.0 if stall else batch.PREFILL_STALL
    try:
        for r in top:
            eng.submit(r)
        got = _engine_tokens(eng, reqs)
    finally:
        batch.PREFILL_STALL = stall
    for (p, n), toks, r in zip(requests, got, reqs):
        assert toks == _history_tokens(p, min(n, n_ctx - len(p))), (p, n, r.stats.finish_reason)
    held = sum(len(s.kv.seq.blocks) for s in eng.slots)
    assert not any(s.busy for s in eng.slots) and eng.pool.used_blocks <= held


@pytest.mark.parametrize("reading", [False, True])
def test_the_request_admitted_last_is_preempted_and_goes_on(reading, monkeypatch):
    """The request admitted last is the one preempted when the oldest needs a block: right after its prompt, when
    it has sent one token and written no row of its own yet (it must go on from that token, not sample a first
    token again), or (``reading``: prompts read a chunk a step beside decoding requests) while it reads its prompt
    (it starts over).  Reference: each request's tokens alone (_history_tokens)."""
    from pyllm.runtime.sampler import Sampler

    if reading:
        monkeypatch.setattr(batch, "PREFILL_STALL", 0.0)
    eng = batch.BatchEngine(_HistoryModel(), "f16", 160, 2, lambda t: False, thread=False, pool_tokens=160,
                            block_rows=16)

    def submit(prompt, n):
        return eng.submit(batch.Request(ids=prompt, max_tokens=n, sampler=Sampler(temperature=0)))

    a = submit([1], 100)
    while a.slot is None or len(a.slot.tokens) < 16 - reading:  # then a's next row but one opens its second block
        eng.step()
    b = submit([2] * 143, 10)  # its prompt's 9 blocks are the last free ones; 3 chunks
    eng.step()
    if reading:
        eng.step()
    assert eng.preemptions == 1 and b.slot is None and b.n == (0 if reading else 1) and b.resume == []
    assert _engine_tokens(eng, [a, b]) == [_history_tokens([1], 100), _history_tokens([2] * 143, 10)]
    assert b.stats.generated_tokens == 10 and b.stats.finish_reason == "length"


def test_slot_caches_without_pools():
    """A backend without pools (CUDA) gives each slot a contiguous cache of its own."""
    class NoPool:
        def make_kv_cache(self, kind, n_layer, n_kv_head, max_seq, head_dim):
            return KVCache(n_layer, n_kv_head, max_seq, head_dim, kind)

    caches = slot_caches(NoPool(), "f16", 2, 2, 64, 32, 3)
    assert len(caches) == 3 and all(type(c) is KVCache and c.max_seq == 32 for c in caches)
