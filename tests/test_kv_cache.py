"""KV cache kinds: round-trip error bounds, attention over each kind, prefix reuse, seeds, sizes, context policy.

Bounds (per 32-value block with absmax A; fp16 scale rounding adds a relative 2^-11 of the scale):
  q8_0: |x - x'| <= A/254 (half a step, step A/127)
  q4_0: |x - x'| <= A/8 (one step: values opposite in sign to the block's extreme clamp at code 15)
  q4_rot, q8_rot: the q4_0 / q8_0 bound holds per value in the stored (centered, rotated) basis; R is
          orthogonal, so each head vector's L2 error in the model basis is at most the L2 norm of those bounds.
  Keys of every block kind are stored centered (minus a per-head mean), so their bound is on x - mu.
"""

import functools

import pytest
import torch

from conftest import pyllm_model
from pyllm.errors import ContextFullError, PyllmError
from pyllm.models.llama import attention
from pyllm.runtime.kv_cache import KV_KINDS, QK, KVCache, hadamard_rotation, make_kv_cache

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
            assert (err.norm(dim=-1) <= bound * 1.0001 + 1e-6).all()
            continue
        bound = (amax * step + amax * 2.0 ** -10).expand(*amax.shape[:-1], QK).flatten(-2)
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
        extra = sum(p.mu.numel() * 4 for p in c.parts if getattr(p, "centered", False))  # the per-head means
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


# ---- the real fixture (SmolLM2, llama arch, 3 KV heads), reference backend shared with test_model --------------
def ref_llm():
    return pyllm_model("smollm2", backend="reference", n_ctx=512)


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
    def __init__(self):
        self.kv = {}

    def update(self, layer, pos, k, v):
        self.kv[layer] = (k.clone(), v.clone())


@functools.lru_cache(maxsize=None)
def _real_kv():
    llm = ref_llm()
    ids = llm.tokenize("The GNU General Public License is a free, copyleft license for software and other kinds "
                       "of works. The licenses for most software are designed to take away your freedom.")
    rec = _Recorder()
    with torch.inference_mode():
        llm.model.forward(torch.tensor(ids), 0, rec)
    return rec.kv


@pytest.mark.parametrize("kind", KV_KINDS)
def test_round_trip_real_kv(kind):
    kv = _real_kv()
    cfg = ref_llm().config
    c = make_kv_cache(kind, cfg.n_layer, cfg.n_kv_head, 64, cfg.head_dim)
    num = den = 0.0
    for layer, (k, v) in kv.items():
        c.update(layer, 0, k, v)
        _check_bounds(c, layer, 0, k, v)
        kk, _ = c.view(layer, k.shape[0])
        num += (kk - k.transpose(0, 1)).pow(2).sum().item()
        den += k.pow(2).sum().item()
    rel = (num / den) ** 0.5
    limit = {"f32": 0, "f16": 1e-3, "bf16": 5e-3, "q8_0": 0.012, "q8_rot": 0.008, "q4_0": 0.2, "q4_rot": 0.1}[kind]
    assert rel <= limit, f"{kind}: relative RMS error of real keys {rel:.4f}"
    if kind == "q4_rot":
        c0 = make_kv_cache("q4_0", cfg.n_layer, cfg.n_kv_head, 64, cfg.head_dim)
        num0 = 0.0
        for layer, (k, v) in kv.items():
            c0.update(layer, 0, k, v)
            num0 += (c0.view(layer, k.shape[0])[0] - k.transpose(0, 1)).pow(2).sum().item()
        # q4_0's keys are centered too (the offset was most of their error), so the rotation's gain is what is
        # left: measured 0.77 of q4_0's squared error on these keys
        assert num < 0.85 * num0, "the rotation should cut q4_0's key error on real keys"


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
