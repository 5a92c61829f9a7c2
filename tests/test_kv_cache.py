"""KV cache kinds: round-trip error bounds, attention over each kind, prefix reuse, seeds, sizes, context policy.

Bounds (per 32-value block with absmax A; fp16 scale rounding adds a relative 2^-11 of the scale):
  q8_0: |x - x'| <= A/254 (half a step, step A/127)
  q4_0: |x - x'| <= A/8 (one step: values opposite in sign to the block's extreme clamp at code 15)
  q4_rot, q8_rot: the q4_0 / q8_0 bound holds per value in the stored (centered, rotated) basis; R is
          orthogonal, so each head vector's L2 error in the model basis is at most the L2 norm of those bounds.
  Keys of every block kind are stored centered (minus a per-head mean) and divided by a per-channel scale s, so
  their bound is on (x - mu) / s, times s per channel in the model basis (for rotated keys: the L2 bound times
  at most max(s)).
  Position 0 of every block kind is kept exactly (the sink row).
"""

import functools

import pytest
import torch

from conftest import pyllm_model
from pyllm.errors import ContextFullError, PyllmError
from pyllm.models.transformer import attention
from pyllm.runtime.kv_cache import KVCache, hadamard_rotation, make_kv_cache
from pyllm.runtime.kv_kinds import KV_KINDS, QK

QUANT = ["q8_0", "q8_rot", "q4_0", "q4_rot"]
MIXED = ["f16/q8_0", "q8_0/q4_rot", "q4_rot/f32"]  # KEY/VALUE kinds
FP16_SLACK = 1 + 2.0 ** -10


def _random_kv(t=40, h=3, hd=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, hd, generator=g)
    v = torch.randn(t, h, hd, generator=g)
    k[:, :, 5] *= 25  # outlier channels, as RoPE'd keys have
    k[:, 1, 40] += 10  # and a per-head offset, as Qwen2's K bias gives
    v[3] *= 50  # one outlier token
    return k, v


def _check_bounds(c, layer, pos, k, v):
    kk, vv = c.view(layer, pos + k.shape[0])
    for part, x, y in ((c.k_part, k, kk), (c.v_part, v, vv)):
        x = x.transpose(0, 1).float()  # [Hkv, T, hd]
        y = y[:, pos:]
        err = y - x
        if part.kind in ("f16", "bf16", "f32"):
            tol = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8, "f32": 0.0}[part.kind]
            assert (err.abs() <= x.abs() * tol + 2.0 ** -24).all()  # fp16 subnormal step
            continue
        z = part.to_storage(layer, x)  # the stored basis: x - mu (keys, rotated kinds), times R^T (rotated)
        amax = z.unflatten(-1, (-1, QK)).abs().amax(-1, keepdim=True)  # [Hkv, T, nb, 1]
        step = 1 / 254 if part.q8 else 1 / 8
        if part.rot is not None:
            bound = (QK * (amax[..., 0] * step * FP16_SLACK) ** 2).sum(-1).sqrt()  # L2 per head vector
            if part.scaled:  # the model basis is the stored one times s per channel: at most max(s) times longer
                bound = bound * part.scale[layer].amax(-1)
            assert (err.norm(dim=-1) <= bound * 1.0001 + 1e-6).all()
            continue
        bound = (amax * step + amax * 2.0 ** -10).expand(*amax.shape[:-1], QK).flatten(-2)
        if part.scaled:  # stored per channel divided by s: the model-basis error is s times the stored one
            bound = bound * part.scale[layer]
        assert (err.abs() <= bound + 1e-6).all(), (part.kind, (err.abs() - bound).max())


@pytest.mark.parametrize("kind", list(KV_KINDS) + MIXED)
def test_round_trip_random(kind):
    c = make_kv_cache(kind, 2, 3, 64, 64)
    k, v = _random_kv()
    c.update(1, 5, k, v)
    _check_bounds(c, 1, 5, k, v)
    c.update(1, 45, k[:1], v[:1])  # a decode step appends without disturbing what is stored
    _check_bounds(c, 1, 5, k, v)


def test_rotation_is_orthogonal_and_spreads_outliers():
    for n in (64, 128, 256):
        r = hadamard_rotation(n).double()
        assert torch.allclose(r @ r.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    x = torch.zeros(64)
    x[7] = 8.0  # one outlier channel: rotated, every coordinate has magnitude 1
    assert torch.allclose((x @ hadamard_rotation(64).T).abs(), torch.ones(64))


def test_sizes_and_bad_shapes():
    for kind in list(KV_KINDS) + MIXED:
        c = make_kv_cache(kind, 2, 3, 16, 64)
        # per (layer, head): the means, the key scales and the exact sink rows, hd float32 values each
        per_head = 2 * 3 * 64 * 4
        extra = per_head * sum(getattr(p, "centered", False) + getattr(p, "scaled", False) + hasattr(p, "sink")
                               for p in c.parts)
        assert c.nbytes == KVCache.bytes_per_token(2, 3, 64, kind) * 16 + extra
    assert KVCache.bytes_per_token(30, 3, 64, "q8_0") == 30 * 3 * 2 * 2 * 34
    assert KVCache.bytes_per_token(30, 3, 64, "q4_0") == 30 * 3 * 2 * 2 * 18
    assert KVCache.bytes_per_token(30, 3, 64, "f16/q4_0") == 30 * 3 * (64 * 2 + 2 * 18)  # f16 K row + two q4_0 V blocks
    assert make_kv_cache("q8_0/q8_0", 1, 1, 8, 64).kind == "q8_0"
    for bad in ("q8_0/q5_k", "f16/f16/f16", "q8"):
        with pytest.raises(PyllmError, match="unknown KV cache type"):
            make_kv_cache(bad, 1, 1, 8, 64)
    with pytest.raises(PyllmError, match="multiple of 32"):
        make_kv_cache("q8_0", 1, 1, 8, 80)
    with pytest.raises(PyllmError, match="power of two"):
        make_kv_cache("q4_rot", 1, 1, 8, 96)
    with pytest.raises(PyllmError, match="unknown KV cache type"):
        make_kv_cache("q5_k", 1, 1, 8, 64)
    with pytest.raises(PyllmError, match="cannot write"):
        make_kv_cache("q4_0", 1, 1, 8, 64).update(0, 7, torch.zeros(2, 1, 64), torch.zeros(2, 1, 64))


@pytest.mark.parametrize("kind", list(KV_KINDS) + MIXED)
@pytest.mark.parametrize("t,start", [(1, 37), (5, 20)])
def test_attention_matches_float64_on_dequantized_cache(kind, t, start):
    """kv.attend (the model's path: a rotated cache attends in its own basis) == float64 attention over view()."""
    h, hkv, hd = 6, 3, 64
    c = make_kv_cache(kind, 1, hkv, 64, hd)
    k, v = _random_kv(start + t, hkv, hd, seed=1)
    c.update(0, 0, k[:start], v[:start])
    c.update(0, start, k[start:], v[start:])
    q = torch.randn(t, h, hd, generator=torch.Generator().manual_seed(2))
    scale = hd ** -0.5
    got = c.attend(0, q, start, functools.partial(attention, start_pos=start, scale=scale, window=0)).double()
    kk, vv = (x.double().repeat_interleave(h // hkv, 0) for x in c.view(0, start + t))  # [H, S, hd]
    s = torch.einsum("thd,hsd->hts", q.double(), kk) * scale
    mask = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    want = torch.einsum("hts,hsd->thd", p, vv).reshape(t, h * hd)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 2e-5, f"{kind}: max rel diff {rel:.2e}"


def test_balanced_key_scales_cut_the_4bit_score_error():
    """Keys with a few huge channels that the queries barely use (Qwen2's K bias, turned by RoPE): rotating spreads
    them over every coordinate and sets the 4-bit step; balanced scales (s^2 = rms(k)/rms(q)) shrink them first.
    Reference: float64 q . k on the exact keys. The scaled cache's RMS score error must be < 1/3 of the unscaled
    one's (measured ~1/6), and the scales must not change a score on their own (8-bit check: < 1% error)."""
    import pyllm.runtime.kv_cache as kvc

    g = torch.Generator().manual_seed(5)
    t, hkv, h, hd = 96, 2, 6, 64
    k = torch.randn(t, hkv, hd, generator=g)
    k[:, :, :4] *= 40
    q = torch.randn(t, h, hd, generator=g)
    q[:, :, :4] *= 0.05
    want = torch.einsum("thd,shd->hts", q.double(), k.double().repeat_interleave(h // hkv, 1))

    def score_rms(kind, balanced):
        orig = kvc.balanced_key_scale
        if not balanced:
            kvc.balanced_key_scale = lambda kk, qq: torch.ones(kk.shape[0], 1, kk.shape[2])
        try:
            c = make_kv_cache(kind, 1, hkv, t, hd)
            c.update(0, 0, k, torch.zeros_like(k), q=q)
        finally:
            kvc.balanced_key_scale = orig
        got = c.attend(0, q, 0, lambda qs, ks, vs: torch.einsum("thd,hsd->hts", qs.double(),
                                                                  ks.double().repeat_interleave(h // hkv, 0)))
        # softmax ignores the per-query shift q . mu_k that centering leaves in the scores: compare without it
        mu = c.k_part.mu[0, :, 0].double().repeat_interleave(h // hkv, 0)  # [H, hd]
        err = got - (want - torch.einsum("thd,hd->ht", q.double(), mu)[..., None])
        return err.pow(2).mean().sqrt().item() / want.pow(2).mean().sqrt().item()

    # f32 values: attend() then returns the model's attention output (here: the scores) untouched
    assert score_rms("q4_rot/f32", True) < score_rms("q4_rot/f32", False) / 3
    assert score_rms("q8_rot/f32", True) < 0.01


@pytest.mark.parametrize("kind", QUANT + ["f16/q4_0"])
def test_position_zero_is_kept_exactly(kind):
    """The sink row: view() and attention read position 0 as written (float32), every other row quantized."""
    c = make_kv_cache(kind, 2, 3, 16, 64)
    k, v = _random_kv(10, 3, 64, seed=4)
    c.update(1, 0, k, v)
    kk, vv = c.view(1, 10)
    for part, x, y in zip(c.parts, (k, v), (kk, vv)):
        if part.kind in QUANT:
            torch.testing.assert_close(y[:, 0], x[0].float(), rtol=1e-5, atol=1e-4)
            assert (part.stored(1, 10, sink=False)[:, 0] != part.stored(1, 10)[:, 0]).any()


# ---- the real fixture (SmolLM2, llama arch, 3 KV heads), reference backend shared with test_model --------------
def ref_llm():
    return pyllm_model("smollm2", kernels="reference", n_ctx=512)


@pytest.fixture
def swap_kv():
    """Gives the shared LLM a cache of another kind for one test, then restores it."""
    llm = ref_llm()
    orig = llm.kv

    def use(kind):
        cfg = llm.config
        llm.kv = llm.generator.kv = make_kv_cache(kind, cfg.n_layer, cfg.n_kv_head, llm.n_ctx, cfg.head_dim)
        llm.reset()
        return llm

    yield use
    llm.kv = llm.generator.kv = orig
    llm.reset()


class _Recorder:
    """Records each layer's K/V/Q of a forward; attention runs over a float32 cache of them (exact values)."""

    def __init__(self, cache):
        self.kv, self.cache = {}, cache

    def update(self, layer, pos, k, v, q=None):
        self.kv[layer] = (k.clone(), v.clone(), q.clone())
        self.cache.update(layer, pos, k, v, q=q)

    def attend(self, *args):
        return self.cache.attend(*args)


@functools.lru_cache(maxsize=None)
def _real_kv():
    llm = ref_llm()
    ids = llm.tokenize("The GNU General Public License is a free, copyleft license for software and other kinds "
                       "of works. The licenses for most software are designed to take away your freedom.")
    cfg = llm.config
    rec = _Recorder(make_kv_cache("f32", cfg.n_layer, cfg.n_kv_head, len(ids), cfg.head_dim))
    with torch.inference_mode():
        llm.model.forward(torch.tensor(ids), 0, rec)
    return rec.kv


@pytest.mark.parametrize("kind", KV_KINDS)
def test_round_trip_real_kv(kind):
    """Real K/V/Q of every SmolLM2 layer. Bounds per value as in the module docstring; then what attention sees:
    the relative RMS error of the scores q . k over the stored keys (reference: the same scores on the float
    keys, float64), bounded per kind at ~1.5x what was measured."""
    kv = _real_kv()
    cfg = ref_llm().config
    group = cfg.n_head // cfg.n_kv_head

    def score_error(c):
        num = den = 0.0
        for layer, (k, v, q) in kv.items():
            c.update(layer, 0, k, v, q=q)
            _check_bounds(c, layer, 0, k, v)
            kk, _ = c.view(layer, k.shape[0])
            qh = q.transpose(0, 1).double()  # [H, T, hd]
            exact = qh @ k.transpose(0, 1).double().repeat_interleave(group, 0).transpose(1, 2)
            got = qh @ kk.double().repeat_interleave(group, 0).transpose(1, 2)
            num += (got - exact).pow(2).sum().item()
            den += exact.pow(2).sum().item()
        return (num / den) ** 0.5

    make = functools.partial(make_kv_cache, n_layer=cfg.n_layer, n_kv_head=cfg.n_kv_head, max_seq=64,
                             head_dim=cfg.head_dim)
    rel = score_error(make(kind))
    # measured: f16 2.4e-4, bf16 2.0e-3, q8_0 2.3e-3, q8_rot 2.0e-3, q4_0 0.037, q4_rot 0.032
    limit = {"f32": 0, "f16": 4e-4, "bf16": 3e-3, "q8_0": 3.5e-3, "q8_rot": 3e-3, "q4_0": 0.055, "q4_rot": 0.048}[kind]
    assert rel <= limit, f"{kind}: relative RMS error of the scores on real keys {rel:.4f}"
    if kind == "q4_rot":  # the rotation must pay for itself over q4_0 (centered and scaled as well): measured 0.85
        rel0 = score_error(make("q4_0"))
        assert rel < 0.9 * rel0, f"q4_rot {rel:.4f} vs q4_0 {rel0:.4f}"


@pytest.mark.parametrize("kind", QUANT)
def test_prefix_reuse_equals_fresh_evaluation_quantized(kind, swap_kv):
    """The second call prefills only the new tokens, and its logits equal a fresh evaluation that splits the prompt
    the same way (so both read the same quantized keys); they also stay close to the f16 cache's."""
    llm = swap_kv(kind)
    a = llm.tokenize("The quick brown fox")
    b = llm.tokenize("The quick brown fox jumps over the lazy dog")
    list(llm.generate_tokens(a, max_tokens=1, temperature=0))
    assert llm.stats.prompt_evaluated == len(a)
    gen = llm.generate_tokens(b, max_tokens=1, temperature=0)
    next(gen)
    gen.close()
    assert llm.stats.prompt_evaluated == len(b) - len(a)
    with torch.inference_mode():
        reused = llm.model.forward(torch.tensor(b[len(a):]), len(a), llm.kv)[-1]
        # fresh: from an empty cache, a then the rest as one batch each (a generator.prefill with n_batch=len(a)
        # would cut the rest into len(a)-sized batches, whose K/V round differently at the quantization step)
        llm.reset()
        llm.model.forward(torch.tensor(a), 0, llm.kv)
        fresh = llm.model.forward(torch.tensor(b[len(a):]), len(a), llm.kv)[-1]
    assert torch.allclose(reused, fresh, rtol=0, atol=1e-4 * fresh.abs().max().item())
    exact = llm.logits(b)[-1]  # float32 attention throughout
    rel = ((fresh - exact).abs().max() / exact.abs().max()).item()
    assert rel < {"q8_0": 0.03, "q8_rot": 0.03, "q4_0": 0.3, "q4_rot": 0.25}[kind], f"{kind}: {rel:.3f}"
    if kind != "q4_0":
        assert fresh.argmax() == exact.argmax()


@pytest.mark.parametrize("kind", QUANT)
def test_seeded_sampling_replays_with_each_kind(kind, swap_kv):
    llm = swap_kv(kind)
    ids = llm.tokenize("My favourite food is")
    a = list(llm.generate_tokens(ids, max_tokens=8, temperature=1.0, seed=7))
    llm.reset()
    b = list(llm.generate_tokens(ids, max_tokens=8, temperature=1.0, seed=7))
    assert a == b


def test_context_policy_shift_drops_oldest_turns():
    llm = ref_llm()
    msgs = [{"role": "system", "content": "You are terse."}]
    for i in range(12):
        msgs += [{"role": "user", "content": f"Question {i}: " + "tell me about the weather " * 6},
                 {"role": "assistant", "content": f"Answer {i}: " + "it is sunny " * 8}]
    msgs.append({"role": "user", "content": "And now?"})
    assert len(llm.chat_ids(msgs)) > llm.n_ctx
    policy = llm.context_policy
    try:
        llm.context_policy = "stop"
        ids, kept, dropped = llm.fit_chat(msgs, reserve=64)
        assert dropped == 0 and kept == msgs
        with pytest.raises(ContextFullError, match="context"):
            llm.generator.prefill(ids)
        llm.context_policy = "shift"
        ids, kept, dropped = llm.fit_chat(msgs, reserve=64)
        assert len(ids) + 64 <= llm.n_ctx and dropped > 0
        assert kept[0] == msgs[0] and kept[-1] == msgs[-1] and kept[1]["role"] == "user"
        assert kept[1:] == msgs[len(msgs) - len(kept) + 1:]  # a contiguous suffix of the history
        with pytest.raises(ContextFullError, match="last message"):
            llm.fit_chat([msgs[0], {"role": "user", "content": "word " * 600}], reserve=64)
    finally:
        llm.context_policy = policy
    with pytest.raises(PyllmError, match="context_policy"):
        import pyllm

        pyllm.load("/nonexistent.gguf", context_policy="wrap")


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_rot/f16"])
def test_prefix_state_moves_rows_and_statistics_between_caches(kind):
    """Reference: the source cache itself. A prefix moved by state (or copied directly) reads back identical
    for its first n positions, statistics included; a state of another layout is refused before anything is
    written."""
    torch.manual_seed(3)
    src = KVCache(2, 2, 16, 64, kind)
    for layer in range(2):
        src.update(layer, 0, torch.randn(10, 2, 64), torch.randn(10, 2, 64))
    n = 8
    moved, copied = KVCache(2, 2, 32, 64, kind), KVCache(2, 2, 16, 64, kind)
    moved.load_prefix_state(src.prefix_state(n), n)
    copied.copy_prefix_from(src, n)
    want = src.prefix_state(n)
    for other in (moved, copied):
        got = other.prefix_state(n)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert other.means_ready() and other.state_layout() == src.state_layout()
        for layer in range(2):
            assert all(torch.equal(a, b) for a, b in zip(other.view(layer, n), src.view(layer, n)))
    foreign = KVCache(2, 2, 16, 32, kind).prefix_state(n)  # another head size
    before = moved.prefix_state(n)
    with pytest.raises(ValueError, match="tensor p0b0 has shape"):
        moved.load_prefix_state(foreign, n)
    with pytest.raises(ValueError, match="at least|>="):
        KVCache(2, 2, 16, 64, kind).load_prefix_state(src.prefix_state(4), n)
    assert all(torch.equal(before[k], moved.prefix_state(n)[k]) for k in before)


def test_cpu_cache_memory_is_advised_onto_huge_pages_before_its_first_write(monkeypatch):
    """Every CPU cache's rows (contiguous caches of each kind and a block pool) are asked onto huge pages while
    still untouched, through ops.advise_huge_pages; contiguous rows then read as zeros, a pool's stay unwritten
    (its memory is committed block by block as sequences grow).  Reference: the calls recorded, and torch.zeros."""
    from pyllm import ops
    from pyllm.runtime import kv_cache
    from pyllm.runtime.kv_pool import BlockPool

    advised = []
    monkeypatch.setattr(ops, "advise_huge_pages", lambda t: advised.append((t.data_ptr(), t.numel())) or 0)
    for kind in ("f16", "q8_0", "q4_rot"):
        advised.clear()
        kv = make_kv_cache(kind, 2, 2, 64, 64)
        rows = [p.data for p in (kv.k_part, kv.v_part)]
        assert sorted(advised) == sorted((r.data_ptr(), r.numel()) for r in rows), kind
        assert all(torch.equal(r, torch.zeros_like(r)) for r in rows), kind
    advised.clear()
    pool = BlockPool("f16", 2, 2, 64, 8)
    assert sorted(advised) == sorted((d.data_ptr(), d.numel()) for d in pool.data)
    zeroed = []
    monkeypatch.setattr(torch.Tensor, "zero_", lambda self: zeroed.append(self) or self)
    BlockPool("f16", 2, 2, 64, 8)
    assert zeroed == []
    if torch.cuda.is_available():  # device memory is not the OS's to page
        advised.clear()
        kv_cache.cache_memory((4, 4), torch.float16, "cuda")
        assert advised == []
