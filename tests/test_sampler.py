"""Sampler steps against hand-computed cases; seed determinism; the draw's distribution.

Reference: the numbers below are worked out by hand from the definitions in llama.cpp's sampler chain.
"""

import math

import numpy as np
import pytest
import torch

from pyllm.errors import PyllmError
from pyllm.runtime import sampler as S


def arr(*x):
    return np.array(x, dtype=np.float64)


def test_top_k_keeps_k_largest_sorted():
    ids, lg = S.top_k(np.arange(5), arr(1, 5, 3, 4, 2), 3)
    assert ids.tolist() == [1, 3, 2] and lg.tolist() == [5, 4, 3]
    ids, lg = S.top_k(np.arange(3), arr(1, 3, 2), 0)  # 0 = off, still sorted
    assert ids.tolist() == [1, 2, 0]


def test_top_p_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.3, 0.2 (logits are their logs): p=0.75 needs the first two
    lg = np.log(arr(0.5, 0.3, 0.2))
    ids, _ = S.top_p(np.arange(3), lg, 0.75)
    assert ids.tolist() == [0, 1]
    ids, _ = S.top_p(np.arange(3), lg, 0.45)
    assert ids.tolist() == [0]
    ids, _ = S.top_p(np.arange(3), lg, 1.0)
    assert ids.tolist() == [0, 1, 2]


def test_min_p_relative_to_top():
    lg = np.log(arr(0.5, 0.3, 0.04, 0.16))
    ids, _ = S.min_p(np.arange(4), lg, 0.1)  # threshold 0.05: drops 0.04
    assert sorted(ids.tolist()) == [0, 1, 3]


def test_typical_p_keeps_tokens_nearest_entropy():
    p = arr(0.4, 0.3, 0.2, 0.1)
    ids, lg = S.top_k(np.arange(4), np.log(p), 0)
    ent = -(p * np.log(p)).sum()  # 1.2799
    # |surprise - entropy|: 0.363, 0.076, 0.330, 1.023 -> order 1, 2, 0, 3; mass 0.3, 0.5, 0.9
    kept, _ = S.typical_p(ids, lg, 0.45)
    assert sorted(kept.tolist()) == [1, 2]
    kept, _ = S.typical_p(ids, lg, 0.6)
    assert sorted(kept.tolist()) == [0, 1, 2]
    assert math.isclose(ent, 1.2798542258336676)


def test_penalties_llama_cpp_semantics():
    ids = np.arange(4)
    lg = arr(2.0, -2.0, 1.0, 0.5)
    _, out = S.apply_penalties(ids, lg, [0, 1, 0], repeat=2.0, frequency=0.1, presence=0.5)
    # token 0 (count 2): 2/2 - 0.2 - 0.5 = 0.3; token 1 (count 1): -2*2 - 0.1 - 0.5 = -4.6; others unchanged
    assert np.allclose(out, [0.3, -4.6, 1.0, 0.5])


def test_logit_bias():
    _, out = S.apply_logit_bias(np.arange(3), arr(0, 0, 0), {2: -math.inf, 0: 1.5})
    assert out[0] == 1.5 and out[2] == -math.inf


def test_greedy_is_argmax_and_ignores_seed():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    for seed in (1, 2, 3):
        assert S.Sampler(temperature=0, seed=seed).sample(logits) == 1


def test_same_seed_same_draws_and_distribution():
    logits = torch.randn(1000)
    a = S.Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    b = S.Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    da = [a.sample(logits) for _ in range(50)]
    db = [b.sample(logits) for _ in range(50)]
    assert da == db
    c = S.Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=43)
    assert [c.sample(logits) for _ in range(50)] != da


def test_draw_matches_softmax_frequencies():
    logits = torch.tensor([0.0, math.log(3.0), math.log(6.0)])  # p = 0.1, 0.3, 0.6
    s = S.Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    counts = np.bincount([s.sample(logits) for _ in range(20000)], minlength=3) / 20000
    assert np.allclose(counts, [0.1, 0.3, 0.6], atol=0.015)


def test_temperature_sharpens():
    logits = torch.tensor([0.0, 1.0])
    s = S.Sampler(temperature=0.25, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    freq1 = np.mean([s.sample(logits) for _ in range(4000)])
    assert abs(freq1 - 1 / (1 + math.exp(-4))) < 0.02  # p(1) = sigmoid(1 / 0.25)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(min_p=1.0), dict(top_k=-2),
                                 dict(repeat_penalty=0)])
def test_bad_settings_raise(bad):
    with pytest.raises(PyllmError):
        S.Sampler(**bad)


@pytest.mark.parametrize("vocab", [1000, 151936])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_fast_candidates_equal_the_full_chain(vocab, temperature):
    # Reference: the same settings through the full chain (every step on a float64 copy of the row).  The fast path
    # (no bias, penalty or grammar) must give the same ids and logits, greedy and top-k.
    g = torch.Generator().manual_seed(vocab)
    for trial in range(5):
        logits = torch.randn(vocab, generator=g) * 3
        kw = dict(temperature=temperature, top_k=40, top_p=0.9, min_p=0.02)
        fast = S.Sampler(S.SamplerSettings(**kw)).candidates(logits)
        full = S.Sampler(S.SamplerSettings(**kw))._full_chain(logits.numpy())
        assert fast[0].tolist() == full[0].tolist(), trial
        assert np.array_equal(fast[1], full[1]), trial


def test_fast_top_k_with_ties_keeps_exactly_k_and_everything_above():
    logits = torch.zeros(5000)
    logits[[10, 20, 30]] = 2.0  # 3 above the tie, 37 of the 4997 zeros fill top_k=40
    s = S.Sampler(S.SamplerSettings(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0))
    ids, lg = s.candidates(logits)
    assert len(ids) == 40 and {10, 20, 30} <= set(ids.tolist()) and len(set(ids.tolist())) == 40
    assert lg[:3].tolist() == [2.0, 2.0, 2.0] and not lg[3:].any()
    again = s.candidates(logits * 2)  # the buffers kept between calls do not leak into earlier results
    assert lg[:3].tolist() == [2.0, 2.0, 2.0] and again[1][:3].tolist() == [4.0, 4.0, 4.0]


def test_a_known_argmax_is_taken_only_where_greedy_sampling_would_take_the_argmax():
    """Reference: sample() on the same logits.  sample_known_argmax takes the caller's argmax (the fused step's)
    only for greedy decoding with nothing that changes a logit; everywhere else (a logit bias, a penalty with a
    token in its window, temperature > 0, an unknown argmax: None or -1, a subclass overriding sample) it is
    sample().  A deliberately wrong hint (index 3, not the argmax 5) shows which path ran."""
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 2.0, 0.0])
    greedy = S.Sampler(S.SamplerSettings(temperature=0))
    assert greedy.sample_known_argmax(logits, 3) == 3  # trusted: the step's argmax is the logits' own
    assert list(greedy.recent) == [3]  # recorded as sample() records its choice
    for hint in (None, -1):
        assert S.Sampler(S.SamplerSettings(temperature=0)).sample_known_argmax(logits, hint) == 5
    cases = [dict(temperature=0, logit_bias={0: 5.0}), dict(temperature=0, repeat_penalty=1.5),
             dict(temperature=0.8, seed=1)]
    for kw in cases:
        a, b = S.Sampler(S.SamplerSettings(**kw)), S.Sampler(S.SamplerSettings(**kw))
        if "repeat_penalty" in kw:
            a.accept(5)
            b.accept(5)
        want = b.sample(logits)
        assert want != 3 and a.sample_known_argmax(logits, 3) == want, kw

    class Logged(S.Sampler):
        def sample(self, logits):
            self.called = True
            return super().sample(logits)

    s = Logged(S.SamplerSettings(temperature=0))
    assert s.sample_known_argmax(logits, 3) == 5 and s.called


def _values(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":
        return (rng.standard_normal(n) * 3).astype(np.float32)
    if kind == "ties":  # a tenth-step grid: many equal values at the k-th largest
        return np.round(rng.standard_normal(n), 1).astype(np.float32)
    if kind == "zeros":  # -0.0 and +0.0 compare equal: one tie class
        return np.where(rng.random(n) < 0.5, -0.0, 0.0).astype(np.float32)
    return np.sort(rng.standard_normal(n)).astype(np.float32)  # ascending: every value enters and leaves


@pytest.mark.parametrize("kind", ["random", "ties", "zeros", "ascending"])
@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 129, 1000, 49152])
def test_top_k_scan_is_the_numpy_partitions_choice(kind, n):
    """Reference: the sampler's numpy top-k (partition, then every id above the k-th value and the lowest tied ids
    at it).  The extension's one-pass scan must choose the same ids, for k from 1 to n, around its 64-value chunks,
    over ties, signed zeros and an ascending row (which replaces its weakest at every value)."""
    from pyllm import ops

    rng = np.random.default_rng(n * 7 + len(kind))
    f = _values(kind, n, rng)
    s = S.Sampler(S.SamplerSettings())
    for k in sorted({1, 2, 40, n - 1, n} & set(range(1, n + 1))):
        got = ops.top_k_ids(f, k)
        assert got is not None, (kind, n, k)
        want = np.sort(s._top_k_ids_numpy(f, k))
        assert got.tolist() == want.tolist(), (kind, n, k)


def test_top_k_scan_leaves_non_finite_rows_to_numpy():
    from pyllm import ops

    f = np.random.default_rng(3).standard_normal(500).astype(np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        g = f.copy()
        g[123] = bad
        assert ops.top_k_ids(g, 40) is None, bad
    assert ops.top_k_ids(f.astype(np.float64), 40) is None and ops.top_k_ids(f, 0) is None


def test_sampled_tokens_do_not_depend_on_the_top_k_path(monkeypatch):
    """Reference: the same seeded sampler with the numpy top-k.  The default chain (temperature 0.8, top-k 40,
    top-p 0.95, min-p 0.05) draws the same 200 tokens through the extension's scan."""
    from pyllm import ops

    g = torch.Generator().manual_seed(11)
    rows = [torch.randn(32000, generator=g) * 2 for _ in range(200)]
    fast = S.Sampler(S.SamplerSettings(seed=5))
    want_sampler = S.Sampler(S.SamplerSettings(seed=5))
    got = [fast.sample(r) for r in rows]
    monkeypatch.setattr(ops, "top_k_ids", lambda f, k: None)
    want = [want_sampler.sample(r) for r in rows]
    assert got == want


@pytest.mark.parametrize("vocab", [1000, 151936])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("moves", ["bias", "penalties", "both"])
def test_candidates_with_a_bias_or_penalties_equal_the_full_chain(vocab, temperature, moves):
    """Reference: the full chain (bias and penalties over a float64 copy of the whole row, then top-k).  With a bias
    or penalties only the moved ids' logits change, and the candidates path must give the same ids and logits: a
    bias that lifts a low id into the top-k and one that bans the best, penalties over a window holding the best
    ids and some low ones, greedy and sampled."""
    g = torch.Generator().manual_seed(vocab + len(moves))
    for trial in range(5):
        logits = torch.randn(vocab, generator=g) * 3
        order = torch.argsort(logits, descending=True).tolist()
        kw = dict(temperature=temperature, top_k=40, top_p=0.9, min_p=0.02)
        if moves in ("bias", "both"):
            kw["logit_bias"] = {order[-1]: 25.0, order[0]: -math.inf, order[500 % vocab]: 2.0}
        if moves in ("penalties", "both"):
            kw.update(repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
        s = S.Sampler(S.SamplerSettings(**kw))
        for t in order[:5] + order[-3:] + order[:2]:
            s.accept(t)
        got = s.candidates(logits)
        want = s._full_chain(logits.numpy())
        assert got[0].tolist() == want[0].tolist(), (trial, moves)
        assert np.array_equal(got[1], want[1]), (trial, moves)
