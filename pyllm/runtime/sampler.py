"""The sampler: a fixed chain of small, pure steps over (candidate ids, logits), then a seeded draw.

Order (as llama.cpp's default chain): logit bias -> repetition/frequency/presence penalties over the last
``penalty_last_n`` tokens -> grammar constraint (runtime/constraint.py: drops every id the grammar does not allow)
-> top-k -> typical-p -> top-p -> min-p -> temperature -> draw. Greedy when temperature is 0 (the argmax over the
allowed ids). The RNG lives in the sampler, so the same seed replays the same draws.

Each step takes and returns ``(ids, logits)``: int64 ids of the surviving candidates and their float64 logits,
sorted by descending logit once top-k (or the first step that needs order) has run.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch

from .. import ops
from ..errors import PyllmError
from .sampler_settings import SamplerSettings  # noqa: F401  (re-exported: the sampler's settings)


def apply_logit_bias(ids, logits, bias: dict[int, float]):
    """Adds bias[t] to the logit of id t where ids (ascending: the whole vocabulary, or candidates) hold t."""
    if bias:
        logits = logits.copy()
        for tok, b in bias.items():
            j = int(np.searchsorted(ids, int(tok)))
            if j < len(ids) and ids[j] == int(tok):
                logits[j] += b
    return ids, logits


def penalties_change_logits(recent: list[int], repeat: float, frequency: float, presence: float) -> bool:
    """Whether apply_penalties would change any logit: some penalty is set and the window holds a token."""
    return bool(recent) and (repeat != 1.0 or frequency != 0.0 or presence != 0.0)


def apply_penalties(ids, logits, recent: list[int], repeat: float, frequency: float, presence: float):
    """llama.cpp semantics: repeat divides positive logits and multiplies negative ones; frequency and presence
    subtract count*frequency + presence for tokens that occurred in the window.  ids: ascending (the whole
    vocabulary, or candidates)."""
    if not penalties_change_logits(recent, repeat, frequency, presence):
        return ids, logits
    logits = logits.copy()
    toks, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    idx = np.searchsorted(ids, toks)
    ok = (idx < len(ids)) & (ids[np.minimum(idx, len(ids) - 1)] == toks)
    idx, counts = idx[ok], counts[ok]
    l = logits[idx]
    l = np.where(l > 0, l / repeat, l * repeat)
    l -= counts * frequency + presence
    logits[idx] = l
    return ids, logits


def apply_constraint(ids, logits, allowed):
    """Keeps only the ids a grammar allows (allowed: bool [n_vocab]). Dropping them, rather than setting -inf,
    keeps top-k from filling its k slots with impossible tokens. The grammar always allows at least an
    end-of-generation id, so the result is never empty."""
    n = len(allowed)
    if len(ids) == n:  # still the whole vocabulary in id order (bias and penalties keep it so)
        keep = np.flatnonzero(allowed)
    else:
        keep = np.flatnonzero(allowed[np.minimum(ids, n - 1)] & (ids < n))
    if not len(keep):
        raise PyllmError("the grammar allows no token here (the vocabulary has no token for the next character)")
    return ids[keep], logits[keep]


def sort_desc(ids, logits):
    order = np.argsort(-logits, kind="stable")
    return ids[order], logits[order]


def top_k(ids, logits, k: int):
    """Keeps the k largest (k <= 0 keeps all). Output sorted by descending logit."""
    if 0 < k < len(logits):
        part = np.argpartition(-logits, k - 1)[:k]
        ids, logits = ids[part], logits[part]
    return sort_desc(ids, logits)


def softmax(logits):
    e = np.exp(logits - logits.max())
    return e / e.sum()


def typical_p(ids, logits, p: float, min_keep: int = 1):
    """Locally typical sampling: keep tokens whose surprise is closest to the entropy, up to mass p."""
    if p >= 1.0 or len(logits) <= min_keep:
        return ids, logits
    probs = softmax(logits)
    ent = -(probs * np.log(probs + 1e-30)).sum()
    shift = np.abs(-np.log(probs + 1e-30) - ent)
    order = np.argsort(shift, kind="stable")
    cum = np.cumsum(probs[order])
    # llama.cpp stops at the first token whose cumulative mass exceeds p (strictly), top-p at >= p
    keep = max(min_keep, int(np.searchsorted(cum, p, side="right") + 1))
    sel = np.sort(order[:keep])  # back to descending-logit order (inputs were sorted)
    return ids[sel], logits[sel]


def top_p(ids, logits, p: float, min_keep: int = 1):
    """Smallest prefix (by descending probability) whose mass reaches p. Inputs sorted descending."""
    if p >= 1.0 or len(logits) <= min_keep:
        return ids, logits
    cum = np.cumsum(softmax(logits))
    keep = max(min_keep, int(np.searchsorted(cum, p) + 1))
    return ids[:keep], logits[:keep]


def min_p(ids, logits, p: float, min_keep: int = 1):
    """Drops tokens whose probability is below p times the top token's (logit < max + log p)."""
    if p <= 0.0 or len(logits) <= min_keep:
        return ids, logits
    keep = logits >= logits.max() + math.log(p)
    if keep.sum() < min_keep:
        return ids[:min_keep], logits[:min_keep]
    return ids[keep], logits[keep]


def token_logprobs(logits: torch.Tensor, chosen: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of ``chosen`` and its ``n_top`` most likely tokens as (id, logprob), from the raw
    logits (before bias, penalties and truncation: what OpenAI's ``logprobs`` report).

    logits: [n_vocab] float."""
    return rows_logprobs(logits.reshape(1, -1), [chosen], n_top)[0]


def rows_logprobs(logits: torch.Tensor, chosen: list[int], n_top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """token_logprobs for each row of logits [n, n_vocab] and its token ``chosen[row]``, in one pass."""
    lp = torch.log_softmax(logits.detach().to(torch.float32), dim=-1)
    picked = lp.gather(1, torch.tensor(chosen, dtype=torch.int64).view(-1, 1)).view(-1).tolist()
    if n_top <= 0:
        return [(p, []) for p in picked]
    v, i = torch.topk(lp, min(n_top, lp.shape[-1]), dim=-1)
    return [(p, list(zip(ids, vals))) for p, ids, vals in zip(picked, i.tolist(), v.tolist())]


class Sampler:
    """Turns a logits vector into a token id. Keeps the RNG and the recent-token window for penalties."""

    def __init__(self, settings: SamplerSettings | None = None, constraint=None, **kw):
        self.s = settings or SamplerSettings(**kw)
        # a runtime.constraint.Constraint (or None): masks candidates and advances with every sampled token
        self.constraint = constraint
        self.s.validate()
        self.rng = np.random.Generator(np.random.PCG64(self.s.seed))
        self.recent: deque[int] = deque(maxlen=max(self.s.penalty_last_n, 1))
        # None: no log-probabilities; n >= 0: sample() stores (logprob, top n) of each draw in ``last_logprobs``
        self.logprobs: int | None = None
        self.last_logprobs: tuple[float, list[tuple[int, float]]] | None = None
        # kept between tokens so a vocabulary-sized array is not allocated per token: the id range (read-only)
        # and top-k's partition buffer and mask
        self._ids: np.ndarray | None = None
        self._part: np.ndarray | None = None
        self._mask: np.ndarray | None = None

    def accept(self, token: int) -> None:
        """Records a token of the context (prompt or generated) for the penalty window."""
        if self.s.penalty_last_n:
            self.recent.append(int(token))

    def candidates(self, logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Runs every step before the draw: surviving ids and their final (temperature-scaled) logits."""
        s = self.s
        # numpy, not torch: torch spreads a vocabulary-sized op over its thread pool, whose wake-up costs more than
        # the op and, on cores busy with other threads, many milliseconds per token
        t = logits.detach().cpu()
        f = (t.numpy() if t.dtype in (torch.float32, torch.float64) else t.to(torch.float64).numpy()).reshape(-1)
        if not s.logit_bias and not self._penalizing() and self.constraint is None:
            # Nothing changes a logit before top-k: greedy is the argmax, top-k a partition, both on the model's
            # own floats (float64 keeps their order exactly) and without vocabulary-sized temporaries.  A fresh
            # array of a 150k-262k vocabulary costs ~1-4 ms of page faults per token once torch is loaded (its
            # allocator settings keep glibc from reusing them), a tenth of a decode step.
            if s.temperature == 0:
                j = int(np.argmax(f))
                return np.array([j], dtype=np.int64), np.array([f[j]], dtype=np.float64)
            if 0 < s.top_k < len(f):
                ids = self._top_k_ids(f, s.top_k)
                return self._after_top_k(*sort_desc(ids, f[ids].astype(np.float64)))
        if self.constraint is None and (s.temperature == 0 or 0 < s.top_k < len(f)):
            moved = self._moved_ids(len(f))
            k = 1 if s.temperature == 0 else s.top_k
            if k + len(moved) < len(f):
                return self._moved_candidates(f, moved, k)
        return self._full_chain(f)

    def _full_chain(self, f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every step on a float64 copy of the whole row: the chain's definition (and its path with a grammar)."""
        s = self.s
        lg = f.astype(np.float64)
        ids = self._vocab_ids(len(lg))
        ids, lg = apply_logit_bias(ids, lg, s.logit_bias)
        ids, lg = apply_penalties(ids, lg, list(self.recent), s.repeat_penalty, s.frequency_penalty,
                                  s.presence_penalty)
        if self.constraint is not None:
            ids, lg = apply_constraint(ids, lg, self.constraint.allowed())
        if s.temperature == 0:
            j = int(np.argmax(lg))
            return ids[j:j + 1].copy(), lg[j:j + 1]
        return self._after_top_k(*top_k(ids, lg, s.top_k))

    def _moved_ids(self, n: int) -> np.ndarray:
        """Ids (ascending) whose logits the bias or the penalties change, within the vocabulary of n."""
        s = self.s
        moved = [t for t in s.logit_bias if 0 <= int(t) < n]
        if self._penalizing():
            moved += [t for t in self.recent if 0 <= t < n]
        return np.unique(np.asarray(moved, dtype=np.int64))

    def _moved_candidates(self, f: np.ndarray, moved: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The full chain's result where a bias or the penalties move a few logits: only those ids change, so the k
        best of the changed row are among the k + len(moved) best of the model's row and the moved ids themselves
        (ties at the boundary go to the lowest ids in both).  Bias and penalties then run on those candidates, not
        on a vocabulary-sized float64 copy (1-4 ms of a 262k row, per token)."""
        s = self.s
        ids = np.union1d(self._top_k_ids(f, k + len(moved)), moved)
        ids, lg = apply_logit_bias(ids, f[ids].astype(np.float64), s.logit_bias)
        ids, lg = apply_penalties(ids, lg, list(self.recent), s.repeat_penalty, s.frequency_penalty,
                                  s.presence_penalty)
        if s.temperature == 0:
            j = int(np.argmax(lg))
            return ids[j:j + 1].copy(), lg[j:j + 1]
        return self._after_top_k(*top_k(ids, lg, k))

    def _after_top_k(self, ids: np.ndarray, lg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = self.s
        ids, lg = typical_p(ids, lg, s.typical_p)
        ids, lg = top_p(ids, lg, s.top_p)
        ids, lg = min_p(ids, lg, s.min_p)
        return ids, lg / s.temperature

    def _penalizing(self) -> bool:
        s = self.s
        return penalties_change_logits(self.recent, s.repeat_penalty, s.frequency_penalty, s.presence_penalty)

    def _vocab_ids(self, n: int) -> np.ndarray:
        """0..n-1, kept between tokens (read-only: every step that selects returns new arrays)."""
        ids = self._ids
        if ids is None or len(ids) != n:
            ids = self._ids = np.arange(n, dtype=np.int64)
            ids.flags.writeable = False
        return ids

    def _top_k_ids(self, f: np.ndarray, k: int) -> np.ndarray:
        """Ids of the k largest of ``f`` (any of the tied ones at the k-th value, lowest ids first): the extension's
        one-pass scan for float32 logits, else an in-place partition of a buffer kept between tokens (the
        definition the scan is tested against)."""
        ids = ops.top_k_ids(f, k)
        return ids if ids is not None else self._top_k_ids_numpy(f, k)

    def _top_k_ids_numpy(self, f: np.ndarray, k: int) -> np.ndarray:
        n = len(f)
        buf = self._part
        if buf is None or buf.shape != f.shape or buf.dtype != f.dtype:
            buf = self._part = np.empty_like(f)
            self._mask = np.empty(n, dtype=bool)
        np.copyto(buf, f)
        buf.partition(n - k)
        kth = buf[n - k]
        above = np.flatnonzero(np.greater(f, kth, out=self._mask))
        tied = np.flatnonzero(np.equal(f, kth, out=self._mask))
        return np.concatenate([above, tied[:k - len(above)]])

    def sample_known_argmax(self, logits: torch.Tensor, argmax: int | None) -> int:
        """sample(logits) for logits whose argmax the caller knows (the fused step's; None or -1: unknown).  Greedy
        decoding with nothing that changes a logit takes it without a numpy or torch call: right after a step has
        streamed the weights through the caches each of those costs 10-60 us, cold.  A subclass that overrides
        sample() gets every call."""
        s = self.s
        if argmax is not None and argmax >= 0 and type(self).sample is Sampler.sample and s.temperature == 0 \
                and not s.logit_bias and self.constraint is None and not self._penalizing():
            return self.take(argmax, logits)
        return self.sample(logits)

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [n_vocab] float. Returns the chosen id and records it for the penalty window."""
        ids, lg = self.candidates(logits)
        if len(ids) == 1:
            tok = int(ids[0])
        else:
            probs = softmax(lg)
            cum = np.cumsum(probs)
            u = self.rng.random() * cum[-1]
            tok = int(ids[min(int(np.searchsorted(cum, u, side="right")), len(ids) - 1)])
        return self.take(tok, logits)

    def take(self, tok: int, logits: torch.Tensor) -> int:
        """Records ``tok`` as the token chosen after ``logits`` (sample()'s, or a verified draft's): moves the
        grammar past it, keeps its logprobs when asked for, and adds it to the penalty window."""
        if self.constraint is not None:
            self.constraint.advance(tok)
        if self.logprobs is not None:
            self.last_logprobs = token_logprobs(logits, tok, self.logprobs)
        self.accept(tok)
        return tok
