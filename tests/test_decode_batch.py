"""The batched decode step (csrc/cpu/decode_step.cpp decode_batch_cpu) and the engine's slots (runtime/batch.py).

Reference: the one-sequence step ``decode_step`` on each sequence alone. The GEMV row kernels give a row the same
bits for every row count, and everything else in the step is per row, so row b of a batch must equal its
sequence's own step bit for bit (tolerance 0), for every fixture and cache kind, with the sequences at different
positions.
"""

import numpy as np
import pytest
import torch

import pyllm
from pyllm import ops
from pyllm.backends.base import SeqStep
from pyllm.runtime import batch, prompt_cache
from pyllm.runtime.kv_cache import make_kv_cache
from pyllm.runtime.slots import Slot, decode_rows_with_argmax, prefill_chunk, prefill_part, stacked_logits

from conftest import pyllm_model


@pytest.fixture(autouse=True, scope="module")
def _extension():
    """These tests are about the extension: a build that fails is a failure (PyllmError), never a skip."""
    pyllm._ext.load()


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea,",
           "1, 2, 3, 4,", "Water boils at", "The quick brown fox", "import numpy as np\n", "Dear Sir or Madam,"]


def _slots(llm, kind, n, n_ctx=160):
    cfg, model = llm.config, llm.model
    slots = []
    for i in range(n):
        s = Slot(i, make_kv_cache(kind, cfg.n_layer, cfg.n_kv_head, n_ctx, cfg.head_dim))
        ids = llm.tokenize(PROMPTS[i % len(PROMPTS)] * (1 + i % 3))  # different lengths: different positions
        while prefill_chunk(model, s, ids) is None:
            pass
        slots.append(s)
    return slots


def _clone(slots):
    out = []
    for s in slots:
        c = Slot(s.index, make_kv_cache(s.kv.kind, s.kv.n_layer, s.kv.n_kv_head, s.kv.max_seq, s.kv.head_dim))
        c.copy_prefix(s, len(s.tokens))
        out.append(c)
    return out


@pytest.mark.parametrize("key,kinds", [("smollm2", ["f16", "f32", "q8_0", "q4_rot/f16"]),
                                       ("qwen2", ["f16", "q4_0"]), ("gemma3", ["f16", "q8_0/q4_0"])])
def test_batch_rows_equal_single_steps(key, kinds):
    llm = pyllm_model(key, n_ctx=256, n_threads=1)
    model = llm.model
    for kind in kinds:
        for n in (1, 3, 8):
            alone = _slots(llm, kind, n)
            together = _clone(alone)
            assert all(s.context(model) is not None for s in together), "the C++ step does not apply"
            toks = [int(llm.tokenize("x")[-1]) + i for i in range(n)]
            for step in range(3):
                ref = []
                for s, t in zip(alone, toks):
                    lg = torch.empty(model.cfg.n_vocab)
                    ops._C.decode_step(s.context(model), t, len(s.tokens), lg)
                    s.tokens.append(t)
                    ref.append(lg)
                got, tops = decode_rows_with_argmax(model, together, toks)
                assert got.shape == (n, model.cfg.n_vocab)
                for b in range(n):
                    assert torch.equal(got[b], ref[b]), f"{key} {kind} B={n} step {step} row {b} differs"
                # each row's argmax as the step reports it: numpy's on the row (finite here)
                assert tops == [int(np.argmax(r.numpy())) for r in ref], f"{key} {kind} B={n} step {step}"
                toks = [int(r.argmax()) for r in ref]


def test_stacked_logits_views_consecutive_rows_and_copies_the_rest():
    """Reference: torch.cat of the rows.  Consecutive [1, V] rows of one tensor (a batched pass's) come back as a
    view of it; rows out of order, with a gap, from two tensors or of another shape are copied, so a caller never
    reads a neighbour's row."""
    base = torch.randn(5, 7)
    rows = [base[i:i + 1] for i in range(4)]
    got = stacked_logits(rows)
    assert torch.equal(got, torch.cat(rows)) and got.data_ptr() == base.data_ptr()
    base[2, 3] = 42.0  # a view: the pass's own rows
    assert got[2, 3] == 42.0
    other = torch.randn(1, 7)
    for bad in ([rows[1], rows[0]], [rows[0], rows[2]], [rows[0], other], [base[0:2], base[2:3]],
                [base[0:1, :6], base[1:2, :6]]):
        want = torch.cat(bad)
        got = stacked_logits(bad)
        assert torch.equal(got, want)
        assert all(got.data_ptr() != r.data_ptr() for r in bad), "copied, not a view"
    assert stacked_logits([rows[3]]) is rows[3]


def test_batch_binding_checks():
    llm = pyllm_model("smollm2", n_ctx=256, n_threads=1)
    model = llm.model
    a, b = _slots(llm, "f16", 2)
    ca, cb = a.context(model), b.context(model)
    out = torch.empty(2, model.cfg.n_vocab)
    pos = torch.tensor([len(a.tokens), len(b.tokens)])
    with pytest.raises(ValueError, match="share a KV cache"):
        ops._C.decode_batch([ca, ca], torch.tensor([1, 2]), pos, out)
    with pytest.raises(IndexError, match="out of range"):
        ops._C.decode_batch([ca, cb], torch.tensor([1, 2]), torch.tensor([0, 10_000]), out)
    with pytest.raises(IndexError, match="token"):
        ops._C.decode_batch([ca, cb], torch.tensor([1, 10**9]), pos, out)
    with pytest.raises(ValueError, match="logits_out"):
        ops._C.decode_batch([ca, cb], torch.tensor([1, 2]), pos, torch.empty(3))
    with pytest.raises(ValueError, match="sequences"):
        ops._C.decode_batch([ca] * 9, torch.tensor([1] * 9), torch.tensor([0] * 9), torch.empty(9, 1))
    other = pyllm_model("qwen2", n_ctx=256, n_threads=1)
    s = _slots(other, "f16", 1)[0]
    with pytest.raises(ValueError, match="other weights"):
        ops._C.decode_batch([ca, s.context(other.model)], torch.tensor([1, 2]), pos, out)


def test_reused_prefix_gives_a_fresh_prefill_bits():
    """A prompt whose whole chunks come from another slot's cache gets the same first logits as from scratch."""
    llm = pyllm_model("smollm2", n_ctx=512, n_threads=1)
    model, cfg = llm.model, llm.config
    ids = llm.tokenize("Once upon a time, in a small village by the sea, there lived an old fisherman. " * 8)
    assert len(ids) > 2 * prompt_cache.PREFILL_CHUNK

    def fresh_slot():
        return Slot(0, make_kv_cache("f16", cfg.n_layer, cfg.n_kv_head, 512, cfg.head_dim))

    a = fresh_slot()
    while (ref := prefill_chunk(model, a, ids)) is None:
        pass
    other = ids[:prompt_cache.PREFILL_CHUNK * 2 + 5] + llm.tokenize(" and a dog")
    b = fresh_slot()
    n = batch.reusable(batch.common_prefix(a.tokens, other), len(other), a.exact)
    assert n == 2 * prompt_cache.PREFILL_CHUNK
    b.copy_prefix(a, n)
    c = fresh_slot()
    for s in (b, c):
        while (lg := prefill_chunk(model, s, other)) is None:
            pass
        s.lg = lg
    assert torch.equal(b.lg, c.lg)


@pytest.mark.parametrize("key,kinds", [("smollm2", ["f16", "q8_0", "f16/q4_0"]), ("qwen2", ["f16"]),
                                       ("gemma3", ["f16", "q4_rot"])])
def test_prompt_spans_give_the_bits_of_chunks(key, kinds):
    """Where the backend claims that a prompt forward of at least ``least`` rows gives every row the same bits
    (Decoder.prefill_exact_rows), prompts are read in spans: their last logits and every stored K/V row equal a
    prefill a PREFILL_CHUNK chunk at a time (tolerance 0), for prompts whose last partial chunk is shorter and
    longer than ``least``, fresh and after a reused prefix.  Where it makes no claim, parts are chunks."""
    llm = pyllm_model(key, n_ctx=512, n_threads=1)
    model, cfg = llm.model, llm.config
    base = llm.tokenize("Once upon a time, in a small village by the sea, there lived an old fisherman. " * 20)
    assert len(base) > 5 * prompt_cache.PREFILL_CHUNK
    for kind in kinds:
        def slot():
            return Slot(0, make_kv_cache(kind, cfg.n_layer, cfg.n_kv_head, 512, cfg.head_dim))

        least = model.prefill_exact_rows(slot().kv)
        if least is None:  # no claim (the fp32 GEMM of a host without bf16 kernels): chunks only
            s = slot()
            assert len(prefill_part(model, s, base[:300]).tokens) == prompt_cache.PREFILL_CHUNK
            continue
        for n in (3 * prompt_cache.PREFILL_CHUNK + least - 1, 3 * prompt_cache.PREFILL_CHUNK + least, 5 * prompt_cache.PREFILL_CHUNK):
            ids = base[:n]
            chunked = slot()
            for p in range(0, n, prompt_cache.PREFILL_CHUNK):
                rows = model.step([SeqStep(chunked.kv, ids[p:p + prompt_cache.PREFILL_CHUNK], p, prefill=True)])
            want = rows[0].logits[-1].float()
            spans, lens = slot(), []
            while True:
                lens.append(len(prefill_part(model, spans, ids).tokens))
                if (got := prefill_chunk(model, spans, ids)) is not None:
                    break
            assert len(lens) < n // prompt_cache.PREFILL_CHUNK + 1, lens  # fewer forwards than chunks
            assert torch.equal(got, want), (kind, n, lens)
            assert spans.exact == n - n % prompt_cache.PREFILL_CHUNK
            a, b = chunked.kv.prefix_state(n), spans.kv.prefix_state(n)
            assert all(torch.equal(a[k], b[k]) for k in a), (kind, n)
            reused = slot()  # a prefix of whole chunks from the spans' slot, the rest read in spans
            reused.copy_prefix(spans, prompt_cache.PREFILL_CHUNK * 2)
            while (got := prefill_chunk(model, reused, ids)) is None:
                pass
            assert torch.equal(got, want), (kind, n, "reused")


def test_prompt_cache_files_are_bounded_and_checked(tmp_path, capsys):
    llm = pyllm_model("smollm2", n_ctx=512, n_threads=1)
    model, cfg = llm.model, llm.config

    def slot_for(text):
        s = Slot(0, make_kv_cache("q8_0", cfg.n_layer, cfg.n_kv_head, 512, cfg.head_dim))
        ids = llm.tokenize(text * 12)
        while prefill_chunk(model, s, ids) is None:
            pass
        return s, ids

    template = make_kv_cache("q8_0", cfg.n_layer, cfg.n_kv_head, 1, cfg.head_dim)
    cache = prompt_cache.PromptCache(tmp_path, "ab" * 32, template)
    a, ids_a = slot_for("Rivers run to the sea. ")
    cache.save(a)
    size = next(iter(cache.entries.values())).size
    cache.max_bytes = 2 * size + size // 2  # room for two files
    for text in ("Stones sit by the road. ", "Lanterns glow at night. "):
        cache.save(slot_for(text)[0])
    assert len(cache.entries) == 2 and not any(e.tokens == tuple(ids_a[:len(e.tokens)]) for e in cache.entries.values())
    assert len(list(tmp_path.glob("*.safetensors"))) == 2

    # a reload reads the headers; a hit restores the rows and statistics exactly (means, scales, sink rows)
    b, ids_b = slot_for("Stones sit by the road. ")
    again = prompt_cache.PromptCache(tmp_path, "ab" * 32, template)
    e, n = again.best(ids_b)
    assert n == batch.reusable(len(ids_b), len(ids_b), len(e.tokens)) and n >= prompt_cache.PREFILL_CHUNK
    fresh = Slot(1, make_kv_cache("q8_0", cfg.n_layer, cfg.n_kv_head, 512, cfg.head_dim))
    assert again.load_into(e, fresh, n)
    want, got = b.kv.prefix_state(n), fresh.kv.prefix_state(n)  # rows 0..n-1, means, key scales, sink rows
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert fresh.tokens == ids_b[:n] and fresh.kv.means_ready()

    # another model's file, another cache kind, a damaged file: one log line each, then ignored
    capsys.readouterr()
    assert prompt_cache.PromptCache(tmp_path, "cd" * 32, template).entries == {}
    other_kind = make_kv_cache("f16", cfg.n_layer, cfg.n_kv_head, 1, cfg.head_dim)
    assert prompt_cache.PromptCache(tmp_path, "ab" * 32, other_kind).entries == {}
    err = capsys.readouterr().err
    assert err.count("another model") == 2 and err.count("another KV cache type") == 2
    victim = e.path
    victim.write_bytes(victim.read_bytes()[:-100])
    assert not again.load_into(e, fresh, n) and fresh.tokens == [] and victim not in again.entries
    assert "ignoring" in capsys.readouterr().err


def test_engine_reads_waiting_prompts_before_decoding_further(monkeypatch):
    """Two requests arrive together: both prompts are read whole before the first decode step (a stall bound far
    above the prefill time), not one chunk per decode step, their chunks handed to the backend together, and
    neither text changes. Reference: each request
    alone through the same engine (greedy)."""
    import threading

    from pyllm.runtime.sampler import Sampler, SamplerSettings

    llm = pyllm_model("smollm2", n_ctx=512, n_threads=1)
    monkeypatch.setattr(batch, "PREFILL_STALL", 1e9)
    order = []

    class Logged(Sampler):
        def __init__(self, name):
            super().__init__(SamplerSettings(temperature=0))
            self.name = name

        def sample(self, logits):
            order.append(self.name)
            return super().sample(logits)

    prompts = {"a": llm.tokenize(PROMPTS[2] * 12), "b": llm.tokenize(PROMPTS[0] * 30)}
    assert all(len(p) > 2 * prompt_cache.PREFILL_CHUNK for p in prompts.values())  # several chunks each
    engine = batch.BatchEngine(llm.model, "f16", 512, 2, llm.tokenizer.is_eog)
    try:
        def run(reqs):
            out = {}
            for r in reqs:
                toks = []
                while (item := r.out.get(timeout=300))[0] == "token":
                    toks.append(item[1])
                assert item[0] == "end", item
                out[r.sampler.name] = toks
            return out

        alone = {}
        for k, ids in prompts.items():
            alone.update(run([engine.submit(batch.Request(list(ids), 4, Logged(k)))]))
        order.clear()
        hold, held = threading.Event(), threading.Event()
        waiter = threading.Thread(target=engine.call, args=(lambda: (held.set(), hold.wait(60)),))
        waiter.start()
        assert held.wait(60)  # the engine thread is inside call(): both requests reach it in one batch
        step, parts = llm.model.step, []

        def logged_step(seqs):
            parts.append(sum(s.prefill for s in seqs))
            return step(seqs)

        monkeypatch.setattr(llm.model, "step", logged_step)
        reqs = [engine.submit(batch.Request(list(ids), 4, Logged(k))) for k, ids in prompts.items()]
        hold.set()
        waiter.join(60)
        together = run(reqs)
    finally:
        engine.close()
    assert together == alone
    # both first tokens (the ends of the prompts, read in steps of both prompts' chunks), then both decode together
    assert sorted(order[:2]) == ["a", "b"] and sorted(order[2:4]) == ["a", "b"], order
    assert parts[0] == 2, parts  # the two prompts' chunks went to the backend in one step


def test_prompt_cache_ignores_files_that_are_not_what_they_claim(tmp_path, capsys):
    """Damage never reaches a request: a FIFO (whose open blocked the whole server), a header announcing gigabytes
    of rows over a sparse file, a flipped bit in the rows, NaN statistics under a matching digest, a full disk."""
    import json
    import os
    import resource
    import signal
    import struct

    from safetensors.torch import load_file, save_file

    llm = pyllm_model("smollm2", n_ctx=512, n_threads=1)
    cfg = llm.config

    def kv(n):
        return make_kv_cache("q8_0", cfg.n_layer, cfg.n_kv_head, n, cfg.head_dim)

    s = Slot(0, kv(512))
    ids = llm.tokenize("Rivers run to the sea. " * 12)
    while prefill_chunk(llm.model, s, ids) is None:
        pass
    good = tmp_path / "good"
    prompt_cache.PromptCache(good, "ab" * 32, kv(1)).save(s)
    (src,) = good.glob("*.safetensors")
    raw = src.read_bytes()
    meta = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])["__metadata__"]
    state = load_file(str(src))

    bad = tmp_path / "bad"
    bad.mkdir()
    os.mkfifo(bad / "fifo.safetensors")
    flipped = bytearray(raw)
    flipped[-5000] ^= 0x10
    (bad / "flipped.safetensors").write_bytes(bytes(flipped))
    nan = {k: v.clone().fill_(float("nan")) if v.is_floating_point() else v for k, v in state.items()}
    save_file(nan, str(bad / "nan.safetensors"), metadata=dict(meta, sha256=prompt_cache.tensors_sha256(nan)))
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    off = 0
    for name in sorted(k for k in header if k != "__metadata__"):  # every tensor 20,000 times longer, in place
        e = header[name]
        n = (e["data_offsets"][1] - e["data_offsets"][0]) * 20000
        e["shape"][2 if len(e["shape"]) == 4 else 0] *= 20000
        e["data_offsets"] = [off, off + n]
        off += n
    h = json.dumps(header).encode()
    with open(bad / "huge.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.truncate(8 + len(h) + off)  # sparse: gigabytes announced, nothing on disk
    # more tokens than any context holds, over the real tensors: refused from the text, before it is parsed
    save_file(state, str(bad / "tokens.safetensors"), metadata=dict(meta, tokens="[" + "1," * (1 << 24) + "1]"))
    capsys.readouterr()
    cache = prompt_cache.PromptCache(bad, "ab" * 32, kv(1))  # the FIFO made this hang forever
    err = capsys.readouterr().err
    assert "fifo.safetensors: ValueError: not a regular file" in err and "huge.safetensors: ValueError: tensor" in err
    assert "tokens.safetensors: ValueError: bad token count 16777217" in err
    assert {p.name for p in cache.entries} == {"flipped.safetensors", "nan.safetensors"}
    for name, why in (("flipped", "do not match its digest"), ("nan", "holds NaN/Inf")):
        e = cache.entries[bad / f"{name}.safetensors"]
        slot = Slot(1, kv(512))
        assert not cache.load_into(e, slot, 64) and slot.tokens == []
        assert why in capsys.readouterr().err

    # a full disk while saving: one log line, nothing left behind, the cache goes on
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    full = prompt_cache.PromptCache(tmp_path / "full", "ab" * 32, kv(1))
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old[1]))
        full.save(s)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
    assert "cannot write" in capsys.readouterr().err and full.entries == {}
    assert list((tmp_path / "full").iterdir()) == []
