"""Speculative decoding: propose a few tokens cheaply, check them all with one forward pass of the model.

Decode reads every weight once per token; a forward over M <= 8 tokens (the model's multi-row decode step, one
GEMV pass per weight for all rows) costs little more than one, so every drafted token the model agrees with is
nearly free. Two proposers:

* ``LookupProposer`` (prompt lookup, "lookup"): the last n tokens (n = ngram..1) are looked up in the prompt and
  the text so far, and the tokens that followed an earlier occurrence (of the two latest, the one sharing more
  context before it) are the draft. No second model; it pays off where the output repeats the input (editing
  code, rewriting or summarising a pasted text).
* ``DraftProposer`` ("draft"): a smaller model with the same vocabulary drafts token by token.

Verification (``accept``) keeps the output distribution exactly that of plain decoding: greedy (temperature 0)
emits the model's own argmax at each row and stops at the first disagreement; sampling uses the standard
speculative-sampling rule (accept a drafted x with probability min(1, p(x)/q(x)), else draw from
norm(max(p - q, 0))), with q one-hot for lookup drafts.

``SpecController`` decides per step whether to speculate and how many tokens: it keeps running estimates of the
acceptance rate per match length (the longer a copy has agreed, the likelier it goes on; updated for free from
plain steps too, by checking what would have been drafted) and of the time of a forward over M rows, and drafts k
tokens only when the expected tokens per second (1 - a^(k+1)) / (1 - a) / t(k+1) beat plain decoding's 1 / t(1) by
a margin. Open-ended text, where lookups rarely agree, therefore falls back to plain steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..backends.base import SeqStep
from ..errors import PyllmError
from ..ops import GEMV_MAX_M
from .generator import Generator, decode_one

SPEC_MODES = ("none", "lookup", "draft")
MAX_ROWS = GEMV_MAX_M  # rows of one verification forward: the fused GEMV's limit
DEFAULT_K = MAX_ROWS - 1  # drafted tokens per verification at most (k + 1 = MAX_ROWS rows)
DEFAULT_NGRAM = 4  # longest suffix looked up; shorter ones are tried down to 1
MATCH_CAP = 8  # a lookup's matched length (its evidence for the controller) is counted up to this
SELECT_CAP = 32  # agreement counted up to this when choosing between a suffix's two latest occurrences
FORCED = MATCH_CAP + 1  # the evidence of a draft a grammar forces (prior acceptance FORCED / (FORCED + 1))
PROBE_EVERY = 16  # plain steps before a draft model that stopped paying is tried again; doubles per failed probe
MAX_PROBE_EVERY = 256


@dataclass
class SpecSettings:
    """What to speculate with. ``draft``: the draft LLM for mode "draft" (pyllm.load'ed, same vocabulary)."""

    mode: str = "lookup"
    k: int = DEFAULT_K
    ngram: int = DEFAULT_NGRAM
    draft: object = None
    adaptive: bool = True  # False: always draft k tokens when a proposal exists (tests, measurements)

    def validate(self) -> "SpecSettings":
        if self.mode not in SPEC_MODES:
            raise PyllmError(f"speculative mode must be one of {', '.join(SPEC_MODES)}, got {self.mode!r}")
        if not isinstance(self.k, int) or not 1 <= self.k <= MAX_ROWS - 1:
            raise PyllmError(f"--spec-k must be an integer in 1..{MAX_ROWS - 1}, got {self.k!r}")
        if not isinstance(self.ngram, int) or not 1 <= self.ngram <= 16:
            raise PyllmError(f"--spec-ngram must be an integer in 1..16, got {self.ngram!r}")
        if self.mode == "draft" and self.draft is None:
            raise PyllmError("speculative mode 'draft' needs a draft model (--draft MODEL)")
        return self


def parse_speculative(value, k: int | None = None, ngram: int | None = None, draft=None) -> SpecSettings | None:
    """``speculative=`` of the library: None/False/"none" -> None; True/"lookup"/"draft" or a SpecSettings."""
    if isinstance(value, SpecSettings):
        return value.validate() if value.mode != "none" else None
    off = value is None or value is False or value == "none"
    mode = "lookup" if value is True or off else value
    if mode not in SPEC_MODES:
        raise PyllmError(f"speculative must be one of {', '.join(SPEC_MODES)} (or True/False), got {value!r}")
    s = SpecSettings(mode=mode, draft=draft)
    if k is not None:
        s.k = k
    if ngram is not None:
        s.ngram = ngram
    s.validate()  # also when off: a bad spec_k must not pass unnoticed until a call that speculates
    return None if off else s


# ---- proposers ---------------------------------------------------------------------------------------------------
class LookupProposer:
    """Prompt lookup over a growing token list: index of n-gram -> positions after its two latest occurrences.

    ``propose(ctx, k)`` looks up the suffix of ``ctx`` (the longest n first) among the earlier positions and returns
    (the up to k tokens that followed it, its evidence), or ([], 0).  Of the two latest occurrences it copies the one
    whose preceding tokens agree with the context's the furthest (counted up to ``SELECT_CAP``; the latest on a
    tie): a suffix of 4 tokens often recurs, and the occurrence sharing more context is the text being copied.  The
    evidence is that agreement's length, the suffix included, counted up to ``MATCH_CAP``: the controller keeps its
    acceptance estimates per evidence, as a copy that has matched longer is likelier to go on (measured on recorded
    greedy replies: about half the drafted tokens accepted after one matched token, 0.85 after four, 0.9+ after
    eight).  It is 0 when the two occurrences agree equally far and were followed by different tokens: the next
    token is then a guess (about a tenth of such drafts are accepted).  Where one agrees further, its next token is
    what the model says: 26 of 29 such drafts on the recorded greedy replies of SmolLM2 and Qwen2.5 to the shipped
    and held-out prompts, 22 of 23 where it agreed 3 or more tokens further (ties: 34 of 283).

    Indexing is incremental: each position is added once, so a step costs O(ngram) dict operations and at most
    2 * SELECT_CAP token comparisons however long the context is.
    """

    def __init__(self, ngram: int = DEFAULT_NGRAM):
        self.ngram = ngram
        self.latest: dict[tuple, int] = {}  # n-gram -> the position after its latest occurrence
        self.previous: dict[tuple, int] = {}  # n-gram -> the position after the occurrence before that
        self.ctx: list[int] = []
        self.done = 0  # ends e (exclusive) 1..done are indexed

    def _sync(self, ctx: list[int]) -> None:
        # The generator only ever appends, or starts over; anything else (a caller's list) restarts the index.
        n = len(self.ctx)
        if len(ctx) < n or ctx[:n] != self.ctx:
            self.latest, self.previous, self.ctx, self.done = {}, {}, [], 0
        self.ctx = list(ctx) if len(self.ctx) == 0 else self.ctx + ctx[n:]

    def propose(self, ctx: list[int], k: int) -> tuple[list[int], int]:
        self._sync(ctx)
        c, L = self.ctx, len(self.ctx)
        latest, previous = self.latest, self.previous
        # index every end e < L: the current suffix (e = L) must not find itself
        for e in range(self.done + 1, L):
            for n in range(1, min(self.ngram, e) + 1):
                key = tuple(c[e - n:e])
                old = latest.get(key)
                if old is not None:
                    previous[key] = old
                latest[key] = e
        self.done = max(self.done, L - 1)
        for n in range(min(self.ngram, L), 0, -1):
            key = tuple(c[L - n:L])
            e = latest.get(key)
            if e is None:
                continue
            match = n + self._agree_before(e - n, L - n, SELECT_CAP - n)
            p = previous.get(key)
            if p is not None:
                mp = n + self._agree_before(p - n, L - n, SELECT_CAP - n)
                if mp == match and c[p] != c[e]:  # nothing tells which of the two is being copied
                    return c[e:e + k], 0
                if mp > match:
                    e, match = p, mp
            return c[e:e + k], min(match, MATCH_CAP)
        return [], 0

    def _agree_before(self, i: int, j: int, most: int) -> int:
        """How many tokens (up to ``most``) before positions i and j of the context are the same."""
        c, m = self.ctx, 0
        while m < most and m < i and c[i - 1 - m] == c[j - 1 - m]:
            m += 1
        return m


def grammar_drafts(constraint, drafts: list[int], evidence: int, k: int) -> tuple[list[int], int]:
    """A lookup proposal (``drafts``, ``evidence``) under a grammar: the tokens the grammar forces, where it
    forces some (evidence FORCED), else the lookup's drafts up to the first one the grammar refuses (a refused
    draft cannot be accepted, so verifying it only costs a row)."""
    forced = constraint.forced_tokens()
    if forced:
        return forced[:k], FORCED
    return drafts[:constraint.valid_prefix(drafts)], evidence


class DraftProposer:
    """A draft model proposing k tokens one at a time (greedy, or sampled from its own distribution ``q``).

    It keeps its own cache in step with the target's tokens (catching up several tokens in one multi-row pass).
    """

    def __init__(self, draft_llm):
        self.llm = draft_llm
        self.gen = draft_llm.generator
        # of the last propose(): the catch-up pass over the target's tokens the draft had not seen (its rows and
        # seconds), and the one-token draft steps after it
        self.catchup_rows, self.catchup_seconds, self.step_seconds = 0, 0.0, 0.0

    def prefill(self, ids: list[int]) -> None:
        """Brings the draft's cache to the prompt, as the target's prefill does for the target: a first proposal
        would otherwise pay the whole prompt inside the decode.  The last prompt token goes through a one-token
        step, timed (``step_seconds``), so the controller knows the draft's cost before it first drafts."""
        if len(ids) > 1:
            self.gen.prefill(ids[:-1])
        t0 = time.perf_counter()
        forward_rows(self.gen, ids[-1:], all_logits=False)
        self.step_seconds = time.perf_counter() - t0

    def propose(self, ctx: list[int], k: int, sampler) -> tuple[list[int], list]:
        """Drafts up to k tokens after ``ctx``; returns (tokens, q) with q[i] = (ids, probs) of the draft's
        distribution at token i (None when greedy)."""
        gen = self.gen
        keep = min(gen.common_prefix(ctx), len(ctx) - 1)
        gen.truncate(keep)
        logits = None
        t0 = time.perf_counter()
        # catch up with the target: the missing tokens in passes of at most MAX_ROWS rows (a long gap: prefill)
        rest = ctx[keep:]
        top = None  # the last row's argmax where the fused pass found it
        if len(rest) > 4 * MAX_ROWS:
            logits = gen.prefill(ctx)
        else:
            for i in range(0, len(rest), MAX_ROWS):
                logits, top = _last_row(forward_rows(gen, rest[i:i + MAX_ROWS], all_logits=False))
        room = gen.n_ctx - len(gen.tokens) - 1
        k = min(k, room)
        out, qs = [], []
        greedy = sampler.s.temperature == 0
        recent = list(sampler.recent)
        t1 = time.perf_counter()
        self.catchup_rows, self.catchup_seconds = len(rest), t1 - t0
        for i in range(k):
            if greedy:
                tok = top if top is not None and top >= 0 else int(torch.argmax(logits))
                qs.append(None)
            else:
                ids, probs = distribution(sampler, logits, recent)
                tok = int(ids[min(int(np.searchsorted(np.cumsum(probs), sampler.rng.random() * probs.sum(),
                                                       side="right")), len(ids) - 1)])
                qs.append((ids, probs))
            out.append(tok)
            recent.append(tok)
            if i + 1 < k:
                logits, top = _last_row(forward_rows(gen, [tok], all_logits=False))
        self.step_seconds = time.perf_counter() - t1
        return out, qs


def _last_row(rows_and_argmax) -> tuple[torch.Tensor, int | None]:
    rows, tops = rows_and_argmax
    return rows[-1], (tops[-1] if tops else None)


# ---- one sequence's speculative steps ------------------------------------------------------------------------------
class SpecDecoder:
    """Speculative decoding of one request in the engine (runtime/batch.py): after each emitted token, a proposal
    of k tokens is verified in one multi-row forward, and the accepted ones (plus the model's own next token) are
    emitted together.

    ``gen``: the request's sequence (a runtime.generator.Generator); ``sample(logits, argmax)`` and ``check(logits,
    argmax)`` as the engine's (``check`` raises on logits that must not be sampled; a verification pass runs it on
    each row it uses, and only those: a row after a rejected draft is one plain decoding never computes, so it
    cannot end the generation).  ``sampler``: the Sampler behind ``sample``, needed for verification.

    Under a grammar (``sampler.constraint``) the tokens it forces are the draft where it forces any, and a lookup
    draft is cut where the grammar would refuse it.  A sampler that reports logprobs gets each emitted token's own.

    The cache is rolled back to the accepted tokens by truncating ``gen.tokens``: rows past it are stale and get
    overwritten, and the quantized caches' statistics were fixed by the prompt (speculation waits until
    ``kv.means_ready()``), so nothing else needs undoing.
    """

    def __init__(self, gen, ids: list[int], spec: SpecSettings, sampler, sample, check, max_tokens: int):
        self.gen, self.spec, self.sampler, self.sample, self.check = gen, spec, sampler, sample, check
        self.max_tokens = max_tokens
        self.stats = SpecStats()
        self.ctrl = SpecController(max_k=spec.k, adaptive=spec.adaptive)
        self.draft = spec.mode == "draft"
        self.prop = DraftProposer(spec.draft) if self.draft else LookupProposer(spec.ngram)
        self.ids = ids
        self.ctx = list(ids)  # prompt + emitted tokens: what lookup searches (the engine appends each one)
        self.since_probe, self.probe_every = 0, PROBE_EVERY

    def start(self, stats) -> None:
        """After the prompt is read: brings a draft model's cache to it (its seconds count as the prompt's)."""
        stats.spec = self.stats
        if self.draft:
            tp = time.perf_counter()
            with torch.inference_mode():
                self.prop.prefill(self.ids)
            self.ctrl.draft_cost = self.prop.step_seconds
            stats.prompt_seconds += time.perf_counter() - tp

    def advance(self, tok: int, n: int) -> tuple[list[int], list | None]:
        """The tokens that follow ``tok`` (the last emitted, the n-th; not cached yet), from one plain step or one
        verification, and each one's logprobs where the sampler reports them (else None).  ``gen.tokens`` then
        holds ``tok`` and the accepted drafts."""
        gen, ctrl = self.gen, self.ctrl
        drafts, q, mlen, k = self._draft_model_proposal(n) if self.draft else self._lookup(n, MAX_ROWS - 1, 1)
        ts = time.perf_counter()
        if k == 0:
            logits, top = gen._decode(tok)
            ctrl.time(1, time.perf_counter() - ts)
            nxt = self.sample(logits, top)
            return [nxt], self.plain_step(drafts, mlen, nxt)
        d = drafts[:k]
        with torch.inference_mode():
            rows, tops = forward_rows(gen, [tok] + d)
        ctrl.time(k + 1, time.perf_counter() - ts)
        return self.settle(d, q, mlen, rows, tops)

    def propose_beside(self, n: int, spare: int, rows: int) -> tuple[list[int], int, int]:
        """(the lookup proposal after the n-th token, its evidence, k of it to verify) for a step whose pass also
        carries ``rows`` rows (this sequence's own token among them) and has ``spare`` rows left before it would
        cost another weight read: k as the controller expects the most tokens per second of that pass
        (SpecController.choose_k with ``rows``).  k = 0: the sequence takes its plain row, and ``plain_step`` gets
        the proposal as evidence."""
        if self.draft:  # a draft model's cache follows one sequence: it drafts alone (advance)
            return [], 0, 0
        drafts, _, mlen, k = self._lookup(n, spare, rows)
        return drafts, mlen, k

    def _room(self, n: int) -> int:
        """Drafts that fit after the n-th token: in max_tokens and in the context; none while a quantized cache's
        means are still being estimated (its first steps run in torch)."""
        if not getattr(self.gen.kv, "means_ready", lambda: True)():
            return 0
        return min(self.max_tokens - n - 1, self.gen.n_ctx - len(self.gen.tokens) - 1)

    def _lookup(self, n: int, spare: int, rows: int) -> tuple[list[int], None, int, int]:
        """(proposal, None, its evidence, k to verify) by prompt lookup, k <= ``spare`` (see propose_beside)."""
        room = min(self._room(n), spare)
        if room <= 0:
            return [], None, 0, 0
        drafts, mlen = self.prop.propose(self.ctx, self.spec.k)
        if self.sampler.constraint is not None:
            drafts, mlen = grammar_drafts(self.sampler.constraint, drafts, mlen, self.spec.k)
        return drafts, None, mlen, self.ctrl.choose_k(mlen, min(len(drafts), room), rows)

    def _draft_model_proposal(self, n: int) -> tuple[list[int], list | None, int, int]:
        """(the draft model's proposal, its distributions, 0, k): k as the controller chooses, with a probe now and
        then once drafting stopped paying."""
        ctrl, spec = self.ctrl, self.spec
        room = self._room(n)
        if room <= 0:
            return [], None, 0, 0
        k = ctrl.choose_k(0, room)
        if k:
            self.since_probe, self.probe_every = 0, PROBE_EVERY
        else:
            self.since_probe += 1
            # re-measure the draft's acceptance now and then, less often each time it does not pay, and never once
            # its measured cost rules out any gain (a probe pays the draft's catch-up)
            if self.since_probe >= self.probe_every and ctrl.can_pay():
                k, self.since_probe = 1, 0
                self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
        if not k:
            return [], None, 0, 0
        with torch.inference_mode():
            drafts, q = self.prop.propose(self.ctx, k, self.sampler)
        # seconds per drafted token: a one-token draft step (measured where the proposal took more than one), plus
        # this proposal's catch-up pass when it covered only what one verification emits (a probe's long catch-up
        # is not the steady cost)
        if drafts:
            prop = self.prop
            step = prop.step_seconds / (len(drafts) - 1) if len(drafts) > 1 else ctrl.draft_cost
            steady = prop.catchup_seconds if prop.catchup_rows <= spec.k + 1 else 0.0
            ctrl.draft_cost = step + steady / len(drafts)
        return drafts, q, 0, len(drafts)

    def plain_step(self, drafts: list[int], mlen: int, nxt: int) -> list | None:
        """Records a plain step that gave ``nxt`` (its proposal ``drafts`` of evidence ``mlen`` left unverified:
        whether the first would have been accepted is free evidence); the token's logprobs where the sampler
        reports them."""
        if drafts:
            self.ctrl.observe(mlen, int(drafts[0] == nxt), 1)
        self.stats.plain_steps += 1
        return [self.sampler.last_logprobs] if self.sampler.logprobs is not None else None

    def settle(self, d: list[int], q, mlen: int, rows: torch.Tensor, tops) -> tuple[list[int], list | None]:
        """After the verification pass over the last token and drafts ``d`` (its logits ``rows`` [len(d) + 1,
        n_vocab] and argmaxes ``tops``; ``gen.tokens`` extended by all of them): the tokens to emit and their
        logprobs (advance's result).  The rows of rejected drafts are dropped from ``gen``."""
        k = len(d)
        lps = [] if self.sampler.logprobs is not None else None
        queue = accept(self.sampler, rows, d, q, logprobs=lps, check=self.check, argmax=tops)
        a = len(queue) - 1  # accepted drafts
        self.gen.truncate(len(self.gen.tokens) - (k - a))  # keep tok and the accepted drafts
        self.ctrl.observe(mlen, a, min(a + 1, k))
        sst = self.stats
        sst.drafted += k
        sst.accepted += a
        sst.verifies += 1
        return queue, lps


class SlotSequence:
    """A slot of the engine (runtime/slots.py Slot: its ``kv``, ``tokens`` and ``exact``) as the sequence a
    speculating request's SpecDecoder steps (what it uses of a Generator): one token through the fused step, or
    k + 1 rows in one verification pass; ``truncate`` forgets rejected rows (overwritten later; the reusable prompt
    rows, ``exact``, never reach past what is kept)."""

    def __init__(self, model, slot, n_ctx: int):
        self.model, self.slot, self.n_ctx = model, slot, n_ctx
        self.kv = slot.kv

    @property
    def tokens(self) -> list[int]:  # the slot's list of the moment: admission and preemption replace it
        return self.slot.tokens

    check_room = Generator.check_room  # what it reads: tokens, n_ctx

    def _decode(self, tok: int) -> tuple[torch.Tensor, int | None]:
        self.check_room(1)
        return decode_one(self.model, self.slot, tok)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]
        self.slot.exact = min(self.slot.exact, n)


# ---- the model's multi-row forward -------------------------------------------------------------------------------
def forward_rows(gen, toks: list[int], all_logits: bool = True) -> tuple[torch.Tensor, list[int] | None]:
    """Runs ``toks`` (1..MAX_ROWS) at the generator's next positions and appends them to its tokens.

    Decode rows of the model's step (backends/base.py): the fused step's multi-row pass where the backend has one
    (CPU: the weights read once for all rows, each row otherwise the one-token step), else the model's forward.
    Returns logits [len(toks) or 1, n_vocab] f32 and, from the fused pass, each row's argmax (-1: a logit is NaN
    or infinite), else None.
    """
    if len(toks) > MAX_ROWS:
        return gen._forward(toks, all_logits=all_logits), None
    pos = len(gen.tokens)
    gen.check_room(len(toks))
    out = gen.model.step([SeqStep(gen.kv, list(toks), pos, all_logits=all_logits)])[0]
    gen.tokens.extend(toks)
    return out.logits, out.argmax


# ---- acceptance ----------------------------------------------------------------------------------------------------
def distribution(sampler, logits: torch.Tensor, recent: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The sampler's final distribution at ``logits`` (ids and probabilities summing to 1), with the penalty
    window ``recent`` (default: the sampler's own)."""
    saved = None
    if recent is not None:
        saved, sampler.recent = sampler.recent, type(sampler.recent)(recent, maxlen=sampler.recent.maxlen)
    try:
        ids, lg = sampler.candidates(logits)
    finally:
        if saved is not None:
            sampler.recent = saved
    e = np.exp(lg - lg.max())
    return ids, e / e.sum()


def _draw(sampler, ids: np.ndarray, probs: np.ndarray) -> int:
    cum = np.cumsum(probs)
    u = sampler.rng.random() * cum[-1]
    return int(ids[min(int(np.searchsorted(cum, u, side="right")), len(ids) - 1)])


def accept(sampler, rows: torch.Tensor, drafts: list[int], q: list | None = None,
           logprobs: list | None = None, check=None, argmax: list[int] | None = None) -> list[int]:
    """The tokens to emit after verifying ``drafts``: the accepted prefix, then one token of the model's own.

    rows: logits [len(drafts) + 1, n_vocab], row i predicting the token after drafts[:i]. q: per draft the
    proposer's distribution (ids, probs), or None for a deterministic proposal (lookup; or greedy). Every
    emitted token is recorded in the sampler as sample() records it (Sampler.take: the grammar moves past it, the
    penalty window gets it), so row i is judged in the grammar state after the tokens before it; a grammar that is
    complete ends the list there (the generator then emits its end token, as plain decoding does). ``logprobs``: a
    list that gets each emitted token's (logprob, top) from its own row, for a sampler that reports them.
    ``check``: run on each row before it is used (the generation's non-finite check), never on the rows after the
    first rejected draft, which plain decoding would not have computed.  ``argmax``: each row's argmax from the
    fused pass (-1: a logit is NaN or infinite), or None; handed to ``check`` and the greedy sampler.
    """
    out = []
    greedy = sampler.s.temperature == 0
    constraint = sampler.constraint

    def emit(tok: int) -> bool:  # whether the pass may go on past tok
        out.append(tok)
        if logprobs is not None:
            logprobs.append(sampler.last_logprobs)
        return constraint is None or not constraint.is_done()

    for i, d in enumerate(drafts + [None]):
        row, top = rows[i], (argmax[i] if argmax is not None else None)
        if check is not None:
            check(row, top)
        if greedy:
            # the argmax after bias/penalties/grammar: exactly plain decoding's choice
            tok = sampler.sample_known_argmax(row, top)
            if not emit(tok) or tok != d:
                return out
            continue
        ids, p = distribution(sampler, row)
        if d is None:  # every draft accepted: the extra token comes from the last row
            tok = _draw(sampler, ids, p)
        else:
            j = np.flatnonzero(ids == d)
            pd = float(p[j[0]]) if len(j) else 0.0
            qi = q[i] if q else None
            if qi is None:
                qd, qv = 1.0, None
            else:
                qj = np.flatnonzero(qi[0] == d)
                qd = float(qi[1][qj[0]]) if len(qj) else 0.0
                qv = qi
            if qd > 0 and sampler.rng.random() < min(1.0, pd / qd):
                sampler.take(d, row)
                if not emit(d):
                    return out
                continue
            # rejected: draw from norm(max(p - q, 0)) over the target's candidates
            resid = p.copy()
            if qv is None:
                if len(j):
                    resid[j[0]] = 0.0
            else:
                qmap = dict(zip(qv[0].tolist(), qv[1].tolist()))
                resid = np.maximum(p - np.array([qmap.get(int(t), 0.0) for t in ids]), 0.0)
            tok = _draw(sampler, ids, resid) if resid.sum() > 0 else _draw(sampler, ids, p)
        sampler.take(tok, row)
        emit(tok)
        return out
    return out


# ---- when to speculate -------------------------------------------------------------------------------------------
@dataclass
class SpecStats:
    drafted: int = 0  # tokens proposed and verified
    accepted: int = 0  # of those, accepted
    verifies: int = 0  # verification passes
    plain_steps: int = 0  # one-token steps (no proposal, or speculation backed off)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per verification pass (accepted drafts + the model's own)."""
        return (self.accepted + self.verifies) / self.verifies if self.verifies else 0.0

    def as_dict(self) -> dict:
        return dict(drafted=self.drafted, accepted=self.accepted, verifies=self.verifies,
                    plain_steps=self.plain_steps, acceptance=self.acceptance, mean_accepted=self.mean_accepted)


@dataclass
class SpecController:
    """Chooses k for each proposal from running estimates (see the module docstring).

    rate[n]: acceptance per drafted token for a lookup of evidence n (LookupProposer: the matched length, 0 for an
    ambiguous one; draft model: n = 0), a Beta-like running mean over ``prior_weight`` observations of a prior,
    decayed so it follows the text.  The prior is n / (n + 1) for n >= 1 (a copy that agreed on n tokens goes on
    about that often in grounded replies, so a long match is drafted deep from its first use) and ``prior`` for
    n = 0, where nothing is known.
    t[M]: seconds of a forward over M rows, a running mean started from a prior ratio to t[1].

    One rate per evidence value, geometric in depth, is enough: on recorded greedy replies (tools/spec_replay.py,
    shipped and held-out prompts) richer online models (acceptance per depth, the previous pass's outcome as
    evidence, the posterior's predictive) gained on one model or prompt set what they lost on another; an
    evidence -> k table fitted knowing the replies does not carry over to other text; and what separates the
    controller from an oracle on SmolLM2 is mostly which pass fails, which the evidence does not tell
    (docs/DESIGN.md, Speculative decoding).
    """

    max_k: int = DEFAULT_K
    adaptive: bool = True
    gain: float = 1.10  # speculate only when the expected speed beats plain decoding by 10%
    decay: float = 0.9
    prior: float = 0.3
    prior_weight: float = 2.0
    draft_cost: float = 0.0  # seconds per drafted token spent by the proposer (draft model)
    max_age: int = 64  # timings after which a pass cost not measured again is forgotten
    hits: dict = field(default_factory=dict)  # n -> (accepted, trials), decayed
    t: dict = field(default_factory=dict)  # M -> seconds
    seen: dict = field(default_factory=dict)  # M -> the count of timings when t[M] was last measured
    clock: int = 0  # timings so far

    def rate(self, n: int) -> float:
        a, m = self.hits.get(n, (0.0, 0.0))
        prior = n / (n + 1.0) if n >= 1 else self.prior
        return (a + prior * self.prior_weight) / (m + self.prior_weight)

    def observe(self, n: int, accepted: int, trials: int) -> None:
        """``trials`` drafted tokens were checked in order and the first ``accepted`` agreed."""
        a, m = self.hits.get(n, (0.0, 0.0))
        self.hits[n] = (a * self.decay + accepted, m * self.decay + trials)

    def time(self, rows: int, seconds: float) -> None:
        """Records a forward over ``rows`` rows.  A pass slower than ``rows`` one-row steps (which do its work with
        more weight reads) was held up by something else, a preemption or page faults, and is not recorded; when
        t[1] is first measured, such earlier passes are dropped.  A cost not measured again within ``max_age``
        timings is forgotten and read off the others.  Without both, one slow pass made that depth look worse than
        plain decoding, so it was never drafted, and so never measured again: a 50 ms stall in the first pass of a
        reply turned speculation off for the rest of it."""
        self.clock += 1
        t1 = self.t.get(1)
        if rows > 1 and t1 is not None and seconds > rows * t1:
            return
        old = self.t.get(rows)
        self.t[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds
        self.seen[rows] = self.clock
        if rows == 1 and t1 is None:
            for m in [m for m, v in self.t.items() if v > m * seconds]:
                del self.t[m]
        for m in [m for m in self.t if self.clock - self.seen[m] > self.max_age]:
            del self.t[m]

    def cost(self, rows: int) -> float:
        """Seconds of a forward over ``rows`` rows: measured, else read off the measured points (linear between
        them, and past the last one along the slope of the last segment), with a prior of +15% of t[1] per row
        where nothing else is known.  Scaling the largest measured M linearly instead (no gain per extra row)
        would keep k from ever growing past the first M it measured, however high the acceptance."""
        if rows in self.t:
            return self.t[rows]
        if not self.t:
            return 1.0 + 0.15 * (rows - 1)
        multi = sorted(m for m in self.t if m > 1)
        t1 = self.t.get(1)
        if t1 is None:  # only multi-row passes measured so far: t[1] from the first one and the prior slope
            t1 = self.t[multi[0]] / (1.0 + 0.15 * (multi[0] - 1))
        if rows == 1:
            return t1
        pts = [(1, t1)] + [(m, self.t[m]) for m in multi]
        for (m0, c0), (m1, c1) in zip(pts, pts[1:]):
            if m0 < rows < m1:
                return c0 + (c1 - c0) * (rows - m0) / (m1 - m0)
        (m0, c0), (m1, c1) = (pts[-2], pts[-1]) if len(pts) > 1 else ((1, t1), (1, t1))
        slope = (c1 - c0) / (m1 - m0) if m1 > m0 else 0.15 * t1
        return c1 + max(slope, 0.0) * (rows - m1)

    def can_pay(self) -> bool:
        """Whether drafting could beat plain decoding by ``gain`` even if every drafted token were accepted, at the
        measured pass and draft costs.  A draft model costing a large share of a target step never can (each
        drafted token costs a draft step plus a verification row): then probing its acceptance is wasted."""
        return self._best_k(1.0, self.max_k) > 0

    def choose_k(self, n: int, available: int, rows: int = 1) -> int:
        """Drafted tokens to verify (0: take a plain step) for a proposal of ``available`` tokens, in a pass of
        ``rows`` rows without them (1: the sequence alone; more: the other sequences' rows of a batched pass too)."""
        kmax = min(self.max_k, available)
        if kmax <= 0:
            return 0
        if not self.adaptive:
            return kmax
        return self._best_k(min(self.rate(n), 0.999), kmax, rows)

    def _best_k(self, a: float, kmax: int, rows: int = 1) -> int:
        """The k <= kmax with the most expected tokens per second at acceptance rate a, if it beats the pass of
        ``rows`` rows without drafts (each row one token) by ``gain``; else 0.  A pass of several sequences' rows
        costs what one sequence's pass of as many rows does: the weights are read once for all of them."""
        best, best_k = self.gain * rows / self.cost(rows), 0
        for k in range(1, kmax + 1):
            # tokens per pass: the accepted prefix (geometric in a) + the model's own token, and the other rows'
            expect = k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
            speed = (rows - 1 + expect) / (self.cost(rows + k) + self.draft_cost * k)
            if speed > best:
                best, best_k = speed, k
        return best_k


def check_same_vocab(target, draft, samples: int = 64) -> None:
    """PyllmError unless ``draft`` (an LLM) tokenizes like ``target``: the same vocabulary size and the same text
    for a spread of token ids (both ends, the special tokens, and evenly spaced ids in between)."""
    tt, dt = target.tokenizer, draft.tokenizer
    name_t, name_d = getattr(target.path, "name", "target"), getattr(draft.path, "name", "draft")
    if tt.n_vocab != dt.n_vocab:
        raise PyllmError(f"draft model {name_d} has a vocabulary of {dt.n_vocab} tokens but {name_t} has "
                         f"{tt.n_vocab}: a draft must use the same tokenizer")
    n = tt.n_vocab
    ids = sorted({0, n - 1, *(i * (n - 1) // samples for i in range(samples + 1)),
                  *(i for i in (tt.bos_id, tt.eos_id) if i is not None)})
    for i in ids:
        a, b = tt.token_text(i), dt.token_text(i)
        if a != b:
            raise PyllmError(f"draft model {name_d} has a different tokenizer than {name_t}: token {i} is {b!r} "
                             f"there and {a!r} here")
