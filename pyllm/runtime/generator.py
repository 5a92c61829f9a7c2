"""The generation loop: prefill a prompt (reusing the cached prefix), then decode one token at a time.

``Generator`` owns the KV cache's bookkeeping: ``tokens`` lists exactly the tokens whose keys and values are in
the cache, in order. It is extended only after a forward pass completes, so an interrupt (Ctrl-C, a closed
iterator, an exception) between or inside steps leaves the cache consistent and the next call reuses it.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..backends.base import SeqStep
from ..errors import ContextFullError
from .engine import chunk_end, common_prefix, finish_reason


def _find_malloc_trim():
    try:
        f = ctypes.CDLL(None).malloc_trim  # glibc; absent elsewhere (musl, macOS): then nothing to do
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_size_t], ctypes.c_int
    return f


_malloc_trim = _find_malloc_trim()
# Prompt tokens from which a prefill's scratch is worth handing back (below it the buffers are small).
TRIM_AFTER_TOKENS = 64
PROBE_EVERY = 16  # plain steps before a draft model that stopped paying is tried again; doubles per failed probe
MAX_PROBE_EVERY = 256


def release_free_heap() -> None:
    """Returns the C heap's free pages to the OS (glibc ``malloc_trim(0)``; a no-op elsewhere).

    Why: a prefill of a few hundred tokens allocates activation and attention-score buffers of 10-40 MiB and frees
    them. glibc raises its mmap threshold after freeing such a buffer, so the next ones come from the heap, and
    the freed heap stays resident (8-21 MiB in tools/soak.py with SmolLM2 at n_ctx 1024, varying with the last
    prefill's size; the 20,000-token soak read it as +6% RSS growth). Trimming after a long prefill keeps the
    resident size flat between calls (docs/SECURITY.md, Soak); it took 0.07 ms, against ~a second of prefill.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # tokens in the prompt
    prompt_evaluated: int = 0  # tokens actually prefilled (the rest came from the cache)
    # of the rest, those a prompt-scoring pass (LLM.prompt_logprobs: echo with logprobs) had just written for this
    # same prompt: the request computed them itself, so they are no reuse of an earlier request's work
    prompt_scored: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    finish_reason: str = ""  # "eog", "length", "context", "stop", "interrupted"
    ttft: float = 0.0  # seconds from the call to the first generated token
    spec: object = None  # speculative.SpecStats when speculation ran, else None

    @property
    def prompt_cached(self) -> int:
        """Prompt tokens reused from the cache an earlier request left (usage's cached_tokens)."""
        return self.prompt_tokens - self.prompt_evaluated - self.prompt_scored

    @property
    def prompt_tps(self) -> float:
        return self.prompt_evaluated / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes out of prefill, so decode speed counts the steps after it
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds and steps else 0.0

    def as_dict(self) -> dict:
        return dict(prompt_tokens=self.prompt_tokens, prompt_evaluated=self.prompt_evaluated,
                    prompt_seconds=self.prompt_seconds, generated_tokens=self.generated_tokens,
                    decode_seconds=self.decode_seconds, finish_reason=self.finish_reason, ttft=self.ttft,
                    prompt_tps=self.prompt_tps, decode_tps=self.decode_tps,
                    spec=self.spec.as_dict() if self.spec is not None else None)


@dataclass
class Generator:
    model: object  # has forward(tokens [T] int64, start_pos, kv, all_logits=False) -> logits
    kv: object
    n_ctx: int
    n_batch: int = 512  # prompt tokens per forward pass: bounds activation memory for long prompts
    tokens: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    # (n, logits after the first n cached tokens) of the last prefill: the same prompt again gets these logits
    # back instead of re-evaluating its last token through the one-token step, whose logits differ from the
    # prefill's in the last bits -- enough to flip a near-tie, so a repeated greedy call would not repeat itself.
    _prompt_logits: tuple[int, torch.Tensor] | None = None
    scored: int = 0  # leading cached tokens a prompt-scoring pass wrote and no generation has used yet

    def reset(self) -> None:
        self.tokens = []
        self._prompt_logits = None
        self.scored = 0

    def truncate(self, n: int) -> None:
        """Forget cached tokens from position n on (their cache slots are simply overwritten later)."""
        del self.tokens[n:]
        self.scored = min(self.scored, n)
        if self._prompt_logits is not None and self._prompt_logits[0] > n:
            self._prompt_logits = None

    def check_room(self, n: int) -> None:
        """ContextFullError unless n more tokens fit after the cached ones."""
        pos = len(self.tokens)
        if pos + n > self.n_ctx:
            raise ContextFullError(f"context full: {pos} cached + {n} new tokens exceed n_ctx={self.n_ctx}")

    def _forward(self, toks: list[int], all_logits: bool = False) -> torch.Tensor:
        """Prompt tokens (a chunk) through the model's step: logits [len(toks) or 1, n_vocab]."""
        if len(toks) == 1:
            return self._decode(toks[0])[0].view(1, -1)
        pos = len(self.tokens)
        self.check_room(len(toks))
        logits = self.model.step([SeqStep(self.kv, toks, pos, all_logits=all_logits, prefill=True)])[0].logits
        self.tokens.extend(toks)
        return logits

    def _decode(self, tok: int) -> tuple[torch.Tensor, int | None]:
        """One token: the logits [n_vocab] after it and, from the fused step, their argmax (-1: a logit is NaN or
        infinite), else None: what ``sample`` and ``check`` take so as not to read the row again."""
        pos = len(self.tokens)
        self.check_room(1)
        # A lone decode token takes the fused step's own entry (what the step protocol runs for it, step_one) without
        # the protocol's lists and row views: each torch call right after a step runs cold (Decoder.fused_logits),
        # and SmolLM2 decoded 3-9% slower through them (interleaved bench, depth 1024).
        fused = self.model.fused_logits(tok, pos, self.kv)
        if fused is None:
            logits, top = self.model.step([SeqStep(self.kv, [tok], pos)])[0]
            fused = logits[0], (top[0] if top else None)
        self.tokens.append(tok)
        return fused

    def common_prefix(self, ids: list[int]) -> int:
        return common_prefix(self.tokens, ids)

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Brings the cache to exactly ``ids`` and returns the logits [n_vocab] after the last one."""
        if not ids:
            raise ValueError("cannot generate from an empty prompt")
        if len(ids) >= self.n_ctx:
            raise ContextFullError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx}; "
                                   f"use a larger n_ctx (--ctx) or a shorter prompt")
        common = self.common_prefix(ids)
        if common == len(ids) and self._prompt_logits is not None and self._prompt_logits[0] == len(ids):
            self.truncate(common)
            self.stats.prompt_evaluated = 0
            self.stats.prompt_scored, self.scored = min(common, self.scored), 0
            return self._prompt_logits[1].clone()  # samplers may edit logits in place
        keep = min(common, len(ids) - 1)  # re-evaluate at least one token to get logits
        self.truncate(keep)
        self.stats.prompt_scored, self.scored = min(keep, self.scored), 0
        logits, i = None, keep
        while i < len(ids):
            end = chunk_end(i, len(ids), self.n_batch, aligned=False)
            logits, i = self._forward(ids[i:end]), end
        self.stats.prompt_evaluated = len(ids) - keep
        if len(ids) - keep >= TRIM_AFTER_TOKENS:
            release_free_heap()
        self._prompt_logits = (len(ids), logits[-1].clone())
        return logits[-1]

    def evaluate_all(self, ids: list[int]) -> torch.Tensor:
        """Fresh evaluation from position 0: logits [len(ids), n_vocab] (for tests and perplexity)."""
        return torch.cat(list(self.evaluate_chunks(ids)))

    def evaluate_chunks(self, ids: list[int]) -> Iterator[torch.Tensor]:
        """Fresh evaluation from position 0, as logits [<= n_batch, n_vocab] for each n_batch tokens in turn: a
        caller that reduces each chunk before the next never holds [len(ids), n_vocab] (2.4 GB for 4096 tokens
        of a 151k vocabulary). The cache then holds ``ids``."""
        self.reset()
        i = 0
        while i < len(ids):
            end = chunk_end(i, len(ids), self.n_batch, aligned=False)
            yield self._forward(ids[i:end], all_logits=True)
            i = end

    def _reason(self, n: int, tok: int, n_prompt: int, max_tokens: int, is_eog) -> str:
        return finish_reason(n, tok, n_prompt, max_tokens, self.n_ctx, is_eog)

    def generate(self, ids: list[int], sample: Callable[[torch.Tensor, int | None], int], max_tokens: int,
                 is_eog: Callable[[int], bool], forced_end: Callable[[], int | None] | None = None, spec=None,
                 sampler=None, check: Callable[[torch.Tensor, int | None], None] | None = None) -> Iterator[int]:
        """Yields generated ids; stops after an end-of-generation id (yielded), max_tokens, or a full context.

        ``forced_end`` (a grammar constraint's ``end_token``): asked after each token; an id means the structured
        output is complete and only that end id can follow, so it is yielded next without a decode step (the
        same tokens the masked sampler would give, one forward pass sooner).
        spec: speculative.SpecSettings to speculate (then ``sampler``, the Sampler behind ``sample``, is needed
        for verification: its grammar, if any, is ``forced_end``'s), or None for one token per step.
        check: raises on logits that must not be sampled (``sample`` runs it on its own); a verification pass runs
        it on each row of logits it uses, and only those: a row after a rejected draft is one plain decoding never
        computes, so it cannot end the generation.  Both take the row and its argmax where the fused step found it
        (-1: a logit is NaN or infinite), else None.
        """
        st = self.stats = GenerationStats(prompt_tokens=len(ids))
        t0 = time.perf_counter()
        st.finish_reason = "interrupted"
        logits = self.prefill(ids)
        st.prompt_seconds = time.perf_counter() - t0
        if spec is not None and max_tokens > 0:
            yield from self._generate_speculative(ids, logits, sample, sampler, max_tokens, is_eog, forced_end,
                                                  spec, t0, check)
            return
        t1 = time.perf_counter()
        forced, top = None, None
        for n in range(max_tokens):
            tok = sample(logits, top) if forced is None else forced
            st.generated_tokens += 1
            if n == 0:
                st.ttft = time.perf_counter() - t0
                t1 = time.perf_counter()
            # the reason is set before the yield: a consumer that stops at this token never resumes us
            st.finish_reason = self._reason(n, tok, len(ids), max_tokens, is_eog)
            st.decode_seconds = time.perf_counter() - t1
            yield tok
            if st.finish_reason != "interrupted":
                break
            forced = forced_end() if forced_end is not None else None
            if forced is None:
                logits, top = self._decode(tok)
        else:
            st.finish_reason = "length"
        st.decode_seconds = time.perf_counter() - t1

    def _generate_speculative(self, ids, logits, sample, sampler, max_tokens, is_eog, forced_end, spec,
                              t0, check=None) -> Iterator[int]:
        """generate() with speculation: after each emitted token, a proposal of k tokens is verified in one
        multi-row forward and the accepted ones (plus the model's own next token) are emitted together.

        Under a grammar (``sampler.constraint``) the tokens it forces are the draft where it forces any, and a
        lookup draft is cut where the grammar would refuse it; a reply that completes the grammar gets its end
        token without a forward pass, as in plain decoding. A sampler that reports logprobs gets each emitted
        token's own (``sampler.last_logprobs`` is set before the token is yielded).

        The cache is rolled back to the accepted tokens by truncating ``tokens``: rows past it are stale and get
        overwritten, and the quantized caches' statistics were fixed by the prompt (speculation waits until
        ``kv.means_ready()``), so nothing else needs undoing.
        """
        from . import speculative as sp

        st = self.stats
        sst = st.spec = sp.SpecStats()
        ctrl = sp.SpecController(max_k=spec.k, adaptive=spec.adaptive)
        draft = spec.mode == "draft"
        prop = sp.DraftProposer(spec.draft) if draft else sp.LookupProposer(spec.ngram)
        ctx = list(ids)  # prompt + generated: what lookup searches
        since_probe, probe_every = 0, PROBE_EVERY
        if draft:
            tp = time.perf_counter()
            with torch.inference_mode():
                prop.prefill(ids)
            ctrl.draft_cost = prop.step_seconds
            st.prompt_seconds += time.perf_counter() - tp
        constraint = sampler.constraint
        lps = [] if sampler.logprobs is not None else None  # per queued token: its (logprob, top)
        queue = [sample(logits, None)]
        if lps is not None:
            lps.append(sampler.last_logprobs)
        st.ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        n = 0
        while True:
            for qi, tok in enumerate(queue):
                if lps is not None:
                    sampler.last_logprobs = lps[qi]
                st.generated_tokens += 1
                st.finish_reason = self._reason(n, tok, len(ids), max_tokens, is_eog)
                st.decode_seconds = time.perf_counter() - t1
                try:
                    yield tok
                except GeneratorExit:
                    # A consumer stopping here (a stop string) leaves the cache as plain decoding does: without
                    # tok and what follows it.  queue[:-1] (the accepted drafts) are cached, its last token not;
                    # otherwise a chat reusing this prefix would evaluate one row fewer than after plain decoding.
                    self.truncate(len(self.tokens) - (len(queue) - 1 - qi))
                    raise
                if st.finish_reason != "interrupted":
                    st.decode_seconds = time.perf_counter() - t1
                    return
                n += 1
                ctx.append(tok)
            forced = forced_end() if forced_end is not None else None
            if forced is not None:  # the grammar is complete: its end token, without a forward pass
                queue = [forced]
                if lps is not None:
                    lps = [None]
                continue
            # tok (the last emitted) is not cached yet; room: drafts that fit after it in the context
            room = min(max_tokens - n - 1, self.n_ctx - len(self.tokens) - 1)
            ready = getattr(self.kv, "means_ready", lambda: True)()
            drafts, q, mlen, k = [], None, 0, 0
            if ready and room > 0:
                if draft:
                    k = ctrl.choose_k(0, room)
                    if k:
                        since_probe, probe_every = 0, PROBE_EVERY
                    else:
                        since_probe += 1
                        # re-measure the draft's acceptance now and then, less often each time it does not pay,
                        # and never once its measured cost rules out any gain (a probe pays the draft's catch-up)
                        if since_probe >= probe_every and ctrl.can_pay():
                            k, since_probe, probe_every = 1, 0, min(2 * probe_every, MAX_PROBE_EVERY)
                    if k:
                        with torch.inference_mode():
                            drafts, q = prop.propose(ctx, k, sampler)
                        # seconds per drafted token: a one-token draft step (measured where the proposal took
                        # more than one), plus this proposal's catch-up pass when it covered only what one
                        # verification emits (a probe's long catch-up is not the steady cost)
                        if drafts:
                            step = prop.step_seconds / (len(drafts) - 1) if len(drafts) > 1 else ctrl.draft_cost
                            steady = prop.catchup_seconds if prop.catchup_rows <= spec.k + 1 else 0.0
                            ctrl.draft_cost = step + steady / len(drafts)
                        k = len(drafts)
                else:
                    drafts, mlen = prop.propose(ctx, spec.k)
                    if constraint is not None:
                        drafts, mlen = sp.grammar_drafts(constraint, drafts, mlen, spec.k)
                    k = ctrl.choose_k(mlen, min(len(drafts), room))
            ts = time.perf_counter()
            if k == 0:
                logits, top = self._decode(tok)
                ctrl.time(1, time.perf_counter() - ts)
                nxt = sample(logits, top)
                if drafts:  # free evidence: would the first drafted token have been accepted?
                    ctrl.observe(mlen, int(drafts[0] == nxt), 1)
                sst.plain_steps += 1
                queue = [nxt]
                if lps is not None:
                    lps = [sampler.last_logprobs]
                continue
            d = drafts[:k]
            with torch.inference_mode():
                rows, tops = sp.forward_rows(self, [tok] + d)
            ctrl.time(k + 1, time.perf_counter() - ts)
            if lps is not None:
                lps = []
            queue = sp.accept(sampler, rows, d, q, logprobs=lps, check=check, argmax=tops)
            a = len(queue) - 1  # accepted drafts
            self.truncate(len(self.tokens) - (k - a))  # keep tok and the accepted drafts
            ctrl.observe(mlen, a, min(a + 1, k))
            sst.drafted += k
            sst.accepted += a
            sst.verifies += 1
