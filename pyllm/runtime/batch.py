"""The engine: every generation, the library's and the server's, is a request that it schedules and steps.

A request runs on a sequence: one of the engine's ``Slot``s (the server's, a batched library call's) or the
caller's own (``Request.seq``: the LLM's Generator, whose cache a library call reuses from any cached prefix; a
single call is a batch of one).  Each step admits waiting requests, reads prompt chunks, and runs one decode step
of every running request: plain ones together in one step of the model (a lone one through the fused step's own
entry), speculative ones (``Request.spec``, speculative.SpecDecoder) each a plain step or a verification pass of
its own, or, on a slot beside other requests, their drafts in the same step.

Decode is bandwidth-bound: one token of B sequences in one step of the model (backends/base.py; the CPU backend
runs them through its batched decode, csrc/cpu/decode_step.cpp) reads every weight once for all B rows, so B
streams cost about what one does. The server's ``BatchEngine`` runs one thread that owns the model: it admits requests into free ``Slot``s (each its own KV cache), prefills them in
chunks interleaved with batched decode steps of the running ones (streams keep flowing while a long prompt is
read), samples every row with that request's own sampler, and frees the slot when a request ends or is cancelled.

On slots, prompt reuse never changes a result. A prompt is prefilled in chunks that start at multiples of PREFILL_CHUNK,
and only rows of such whole chunks are ever reused (from the slot itself, copied from another slot, or read from
the on-disk ``PromptCache``), so the last partial chunk is always recomputed exactly as a fresh prefill would
compute it: a request's logits are bit-identical whether its prefix came from a cache or not, and whatever else
runs beside it (the batched step gives each row the one-sequence step's bits).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import ops
from ..backends.base import SeqStep
from ..errors import ContextFullError, ModelError, PyllmError
from .engine import check_finite, common_prefix, finish_reason, forced_end
from .generator import GenerationStats, decode_one
from .kv_pool import BLOCK_ROWS, slot_caches
from .prompt_cache import PromptCache, log as cache_log, reusable
from .slots import (STEP_TOKENS, Slot, decode_rows_with_argmax, prefill_chunk, prefill_done, prefill_part,
                    replay_rows)
from .speculative import SlotSequence, SpecDecoder

MAX_BATCH = ops.GEMV_MAX_M  # rows of one batched decode pass (the GEMV kernels' limit)
# Seconds of prefill the running streams may wait for their next token while new prompts are read: long enough
# that a few 200-token prompts on a small model are read in one go (their first tokens come soonest that way),
# short enough that a long prompt does not freeze the other streams.
PREFILL_STALL = 0.25


# ------------------------------------------------------------------------------------------------ the engine
@dataclass
class Request:
    """One generation in the engine. Items on ``out``: ("token", id, logprobs or None), then ("end", None) or
    ("error", exception)."""
    ids: list[int]
    max_tokens: int
    sampler: object  # a runtime.sampler.Sampler used by the engine thread only (callers on other threads pass a copy)
    cancel: threading.Event = field(default_factory=threading.Event)
    also_cancel: threading.Event | None = None  # a second event that stops it (the HTTP client's)
    out: queue.Queue = field(default_factory=queue.Queue)
    stats: GenerationStats = field(default_factory=GenerationStats)
    slot: Slot | None = None
    n: int = 0  # tokens generated so far
    last: int | None = None  # the last generated token, not yet in the cache
    t0: float = field(default_factory=time.perf_counter)
    t1: float = 0.0
    # Other choices of the same prompt (OpenAI's ``n``): each gets a slot of its own when this request is admitted,
    # and the prompt's rows are copied into it once this request has read them: one prefill for all the choices.
    forks: list["Request"] = field(default_factory=list)
    # The caller's own sequence (a runtime.generator.Generator: a library call's cache, kept between its calls and
    # reused from any cached prefix) instead of a slot of the engine's.
    seq: object = None
    spec: object = None  # a speculative.SpecDecoder where the request speculates
    resume: list[int] = field(default_factory=list)  # generated tokens whose rows a preemption gave back (all but
    # the last, which the next decode step feeds)

    def cancelled(self) -> bool:
        return self.cancel.is_set() or (self.also_cancel is not None and self.also_cancel.is_set())


class TokenStream:
    """One request's generated ids as an iterator, read from ``items`` (its queue's items: BatchEngine.tokens, or
    the engine thread's queue).  ``sampler``: the caller's, which gets each token's logprobs as it is yielded (the
    engine samples with its own shallow copy).  ``stats``: the request's.  close() (a consumer that stops early,
    at a stop string) cancels the request: its slot is freed at the engine's next step."""

    def __init__(self, req: Request, items, sampler=None):
        self.req, self._items, self._sampler = req, items, sampler

    @property
    def stats(self) -> GenerationStats:
        return self.req.stats

    def __iter__(self):
        return self

    def __next__(self) -> int:
        kind, *value = next(self._items)
        if kind == "token":
            if self._sampler is not None:
                self._sampler.last_logprobs = value[1]
            return value[0]
        if kind == "error":
            raise value[0]
        raise StopIteration

    def close(self) -> None:
        self.req.cancel.set()
        close = getattr(self._items, "close", None)
        if close is not None:
            close()

    def __del__(self):  # dropped unread: the engine stops generating for nobody
        self.req.cancel.set()


def queue_items(req: Request):
    """The items of ``req`` as the engine thread puts them, up to its "end" or "error"."""
    while True:
        item = req.out.get()
        yield item
        if item[0] != "token":
            return


def make_requests(calls: list[tuple[list[int], int, object]], also_cancel=None,
                  group: int = MAX_BATCH) -> tuple[list[Request], list[Request]]:
    """Requests for ``calls`` ((ids, max_tokens, sampler) each, checked): (every request, in order of calls; those
    to submit).  A call whose prompt an earlier call has too becomes that one's fork: one prefill for both (at most
    ``group`` requests share one, the slots an engine can give them at once).  Each
    request samples with a shallow copy of its sampler (same RNG, penalty window and grammar state), so that its
    last_logprobs is its own."""
    import copy

    out, top, first = [], [], {}
    for ids, max_tokens, sampler in calls:
        r = Request(list(ids), max_tokens, copy.copy(sampler), also_cancel=also_cancel)
        parent = first.get(tuple(ids))
        if parent is not None and 1 + len(parent.forks) < group:
            parent.forks.append(r)
        else:
            first[tuple(ids)] = r
            top.append(r)
        out.append(r)
    return out, top


class BatchStats:
    """GenerationStats summed over the requests of one batched call, read as they progress: every prompt counted
    once (its forks share its prefill), every generated token."""

    def __init__(self, reqs: list[Request], parents: list[Request]):
        self._reqs, self._parents = reqs, parents

    prompt_tokens = property(lambda self: sum(r.stats.prompt_tokens for r in self._parents))
    prompt_evaluated = property(lambda self: sum(r.stats.prompt_evaluated for r in self._parents))
    prompt_scored = 0
    prompt_cached = property(lambda self: self.prompt_tokens - self.prompt_evaluated)
    generated_tokens = property(lambda self: sum(r.stats.generated_tokens for r in self._reqs))
    decode_tps = property(lambda self: self._parents[0].stats.decode_tps if self._parents else 0.0)
    ttft = property(lambda self: min((r.stats.ttft for r in self._reqs if r.stats.generated_tokens), default=0.0))
    finish_reason = property(lambda self: self._reqs[-1].stats.finish_reason if self._reqs else "")
    prompt_seconds = property(lambda self: max((r.stats.prompt_seconds for r in self._parents), default=0.0))
    decode_seconds = property(lambda self: max((r.stats.decode_seconds for r in self._reqs), default=0.0))
    spec = None  # no speculation in a batch

    @property
    def prompt_tps(self) -> float:
        return self.prompt_evaluated / self.prompt_seconds if self.prompt_seconds else 0.0

    def as_dict(self) -> dict:
        return dict(prompt_tokens=self.prompt_tokens, prompt_evaluated=self.prompt_evaluated,
                    prompt_seconds=self.prompt_seconds, generated_tokens=self.generated_tokens,
                    decode_seconds=self.decode_seconds, finish_reason=self.finish_reason, ttft=self.ttft,
                    prompt_tps=self.prompt_tps, decode_tps=self.decode_tps, spec=None)


class BatchEngine:
    """Up to ``n_slots`` generations at once over ``model`` (see the module docstring). is_eog(id) ends one;
    nonfinite(logits) makes the error for logits with NaN/Inf. ``prompt_cache``: a PromptCache or None.

    ``thread``: True (the server) runs the engine on a thread of its own, which submit() feeds; False runs it in
    the caller's thread: ``tokens(request)`` steps the engine until that request has its next item, so a library
    call that generates several sequences batches them without a thread.  ``max_seq``: positions per slot's cache
    (default n_ctx; a caller that knows its longest prompt + max_tokens reserves no more).  ``n_slots`` 0 (with
    thread=False): an engine for requests that bring their own sequence (Request.seq) only: the LLM's own.
    ``pool_tokens``, ``block_rows``: the slots' block pool's cap and positions per block (slot_caches)."""

    def __init__(self, model, kv_kind: str, n_ctx: int, n_slots: int, is_eog: Callable[[int], bool],
                 prompt_cache: PromptCache | None = None,
                 nonfinite: Callable[[torch.Tensor], Exception] | None = None, thread: bool = True,
                 max_seq: int | None = None, pool_tokens: int | None = None, block_rows: int = BLOCK_ROWS):
        if n_slots < (0 if not thread else 1):
            raise PyllmError(f"the number of parallel sequences must be >= 1, got {n_slots}")
        cfg = model.cfg
        self.model, self.n_ctx, self.is_eog = model, n_ctx, is_eog
        rows = n_ctx if max_seq is None else min(max_seq, n_ctx)
        # one pool of KV blocks for every slot where the backend has one (runtime/kv_pool.py)
        self.slots = [Slot(i, kv) for i, kv in enumerate(slot_caches(model.backend, kv_kind, cfg.n_layer, cfg.n_kv_head,
                                                                      cfg.head_dim, rows, n_slots,
                                                                      block_rows, pool_tokens))] if n_slots else []
        # the BlockPool, whose free blocks admission reads (none without slots: a library call's own sequence)
        self.pool = getattr(self.slots[0].kv, "pool", None) if self.slots else None
        self.preemptions = 0
        self.disk = prompt_cache
        self.nonfinite = nonfinite or (lambda lg: ModelError("the model produced non-finite logits"))
        self.cache_hits = self.cached_tokens = self.disk_hits = 0
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: list[Request] = []
        self._prefilling: list[Request] = []
        self._decoding: list[Request] = []
        self._last_decode = 0.0  # when the last decode step ended (perf_counter)
        self._stop = False
        self.guard = contextlib.nullcontext()  # held around each step that tokens() runs (the LLM's lock)
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self._loop, name="pyllm-batch", daemon=True)
            self._thread.start()

    # ---- called from other threads ----------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        if len(req.ids) >= self.n_ctx:
            raise ContextFullError(f"the prompt has {len(req.ids)} tokens but the context holds {self.n_ctx}; "
                                   f"use a larger n_ctx (--ctx) or a shorter prompt")
        if req.seq is None and 1 + len(req.forks) > len(self.slots):
            raise PyllmError(f"{1 + len(req.forks)} choices of one prompt need as many parallel sequences; this "
                             f"engine runs {len(self.slots)} (--parallel)")
        self._inbox.put(req)
        return req

    def speculate(self, req: Request, spec) -> Request:
        """``req`` (before submit) speculates with ``spec`` (speculative.SpecSettings): on its own sequence
        (``req.seq``) every step; on a slot (lookup) by its own passes where it decodes alone, and beside other
        requests with its drafts in their batched pass (_decode_step).  Samples and checks its logits as a plain
        request's (``_emit``)."""
        def check(logits, argmax=None):
            check_finite(logits, argmax, self.nonfinite)

        def sample(logits, argmax=None):
            check(logits, argmax)
            return req.sampler.sample_known_argmax(logits, argmax)

        req.spec = SpecDecoder(req.seq, req.ids, spec, req.sampler, sample, check, req.max_tokens)
        return req

    def tokens(self, req: Request):
        """The items of ``req`` (see Request), stepping the engine in this thread while none is ready (an engine
        made with thread=False); the iterator ends after "end" or raises the "error" item's exception.  Items of
        the other requests wait in their own queues meanwhile.  When it ends (or is closed) this thread hands its
        OpenMP workers back: the caller may go on in another thread (a server's worker, a web framework's pool),
        whose kernels this thread's workers would throttle (ops.release_thread_pool)."""
        try:
            while True:
                try:
                    item = req.out.get_nowait()
                except queue.Empty:
                    if not (self.active or self._waiting or self._inbox.qsize()):
                        raise PyllmError("the engine has nothing to run for this request") from None
                    with self.guard:
                        self.step()
                    continue
                yield item
                if item[0] != "token":
                    return
        finally:
            ops.release_thread_pool()

    def end(self, req: Request) -> None:
        """Ends ``req`` now, between steps (a thread=False engine's request whose reader stopped): its sequence is
        free for the next request at once, not at the next step."""
        if req in self._waiting:
            self._waiting.remove(req)
        if req in self._prefilling or req in self._decoding:
            self._finish(req)

    def call(self, fn: Callable[[], object]):
        """Runs fn() on the engine thread between steps (anything else that uses the model) and returns its
        result or raises its exception."""
        box: queue.Queue = queue.Queue()
        self._inbox.put((fn, box))
        ok, value = box.get()
        if not ok:
            raise value
        return value

    @property
    def active(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    @property
    def waiting(self) -> int:
        return len(self._waiting) + self._inbox.qsize()

    def close(self) -> None:
        self._stop = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- the engine thread (or the caller's, thread=False) ------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            idle = not (self.active or self._waiting)
            if idle:  # until work comes, other threads may run kernels: this one's OpenMP workers must not count
                ops.release_thread_pool()
            self.step(block=idle)

    def step(self, block: bool = False) -> None:
        """One round: take what was submitted (waiting for it with ``block``), drop cancelled requests, admit
        waiting ones into free slots, read prompt chunks, and run one decode step of every running request."""
        try:
            self._take(block=block)
            self._drop_cancelled()
            self._admit()
            if self._prefilling:
                self._prefill()
            if self._decoding:
                self._decode_step()
                self._last_decode = time.perf_counter()
        except Exception as e:  # a bug must not kill the engine silently: fail what runs, keep serving
            for r in self._prefilling + self._decoding:
                self._finish(r, error=e)

    def _take(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return
            block = False
            if item is None:
                self._stop = True
                return
            if isinstance(item, tuple):
                fn, box = item
                try:
                    box.put((True, fn()))
                except Exception as e:
                    box.put((False, e))
            else:
                self._waiting.append(item)

    def _drop_cancelled(self) -> None:
        for r in [r for r in self._waiting if r.cancelled()]:
            self._waiting.remove(r)
            for f in [r] + r.forks:
                f.stats.finish_reason = "interrupted"
                f.out.put(("end", None))
        for r in [r for r in self._prefilling + self._decoding if r.cancelled()]:
            self._finish(r)

    def _admit(self) -> None:
        for r in [r for r in self._waiting if r.seq is not None]:
            self._waiting.remove(r)
            self._admit_own(r)
        while self._waiting:
            free = [s for s in self.slots if not s.busy]
            if len(free) < 1 + len(self._waiting[0].forks) or not self._room_for(self._waiting[0]):
                return  # it waits, first come first served
            r = self._waiting.pop(0)
            ids = r.ids
            # the free slot with the longest reusable prefix (ties: the least recently used keeps its rows)
            own = max(free, key=lambda s: (reusable(common_prefix(s.tokens, ids), len(ids), s.exact),
                                           -s.last_used))
            keep = reusable(common_prefix(own.tokens, ids), len(ids), own.exact)
            donor = max((s for s in self.slots if s.busy), default=None,
                        key=lambda s: reusable(common_prefix(s.tokens, ids), len(ids), s.exact))
            dk = reusable(common_prefix(donor.tokens, ids), len(ids), donor.exact) if donor else 0
            slot = own
            slot.busy = True
            slot.last_used = time.monotonic()
            if dk > keep:
                slot.copy_prefix(donor, dk)
                keep = dk
            if self.disk is not None:
                e, n = self.disk.best(ids)
                if e is not None and n > keep and self.disk.load_into(e, slot, n):
                    keep = n
                    self.disk_hits += 1
            del slot.tokens[keep:]
            slot.exact = min(slot.exact, keep)
            r.slot = slot
            for f in r.forks:  # the least recently used slots: their rows are the least likely to be reused
                f.slot = min((s for s in self.slots if not s.busy), key=lambda s: s.last_used)
                f.slot.busy, f.slot.tokens, f.slot.exact = True, [], 0
            if self.pool is not None:  # the prompt's blocks (and a resumed request's) taken now
                slot.kv.reserve(keep, min(slot.kv.max_seq, len(ids) + len(r.resume) + 1) - keep)
            if r.n:  # preempted after its first tokens: its stats go on
                self._prefilling.append(r)
                continue
            r.stats = GenerationStats(prompt_tokens=len(ids), prompt_evaluated=len(ids) - keep)
            r.stats.finish_reason = "interrupted"
            if keep:
                self.cache_hits += 1
                self.cached_tokens += keep
            self._prefilling.append(r)

    def _admit_own(self, r: Request) -> None:
        """Starts a request on its own sequence: a request still running on that sequence (a stream its reader
        left unfinished) ends first; the sequence keeps the cached prefix it shares with the prompt."""
        for old in [o for o in self._prefilling + self._decoding if o.seq is r.seq]:
            self._finish(old)
        r.stats = r.seq.stats = GenerationStats(prompt_tokens=len(r.ids))
        r.stats.finish_reason = "interrupted"
        try:
            logits = r.seq.start(r.ids)
        except Exception as e:
            self._finish(r, error=e)
            return
        self._prefilling.append(r)
        if logits is not None:  # the prompt and its logits were cached: nothing to read
            self._prefilled(r, logits)

    def _prefill(self) -> None:
        """Steps of prompt chunks (several prompts' in one step, first come first served: _prefill_slots) until
        every admitted prompt is read or, while other requests are decoding, until they have waited PREFILL_STALL
        seconds for their next token. A prompt read whole
        before the next decode step gives the lowest time to first token over all requests (the batch is the
        same size either way); the bound keeps the running streams flowing."""
        while self._prefilling:
            r = self._prefilling[0]
            if r.cancelled():
                return  # dropped by the loop
            if r.seq is not None:  # the caller's own sequence reads its prompt its own way
                self._prefill_step(r)
            elif not self._prefill_slots():
                return
            if self._decoding and time.perf_counter() - self._last_decode >= PREFILL_STALL:
                return

    def _prefill_slots(self) -> bool:
        """One step of prompt chunks on slots: the next chunk of the oldest prompt being read, and of the next ones
        where the chunks before theirs end their prompts (first come first served), up to STEP_TOKENS tokens.  A
        step that fails is run again a prompt at a time, so that only the prompt whose chunk cannot run (a full
        block pool) fails.  False when there was nothing to read."""
        parts, budget = [], STEP_TOKENS
        for r in self._prefilling:
            if r.seq is not None or r.cancelled():
                continue
            part = prefill_part(self.model, r.slot, r.ids, budget if parts else STEP_TOKENS)
            if parts and len(part.tokens) > budget:
                break
            parts.append((r, part))
            budget -= len(part.tokens)
            if part.pos + len(part.tokens) < len(r.ids):
                # strictly first come first served: a later prompt starts only in the step that ends the ones
                # before it (a chunk of each prompt a step read them all side by side and moved every first
                # token to the end: 4 streams' TTFT p50 0.66-0.72 s against 0.41 s prompt after prompt)
                break
        if not parts:
            return False
        if len(parts) == 1:
            self._prefill_step(parts[0][0])
            return True
        try:
            rows = self.model.step([p for _, p in parts])
        except Exception:
            for r, _ in parts:
                self._prefill_step(r)
            return True
        for (r, part), row in zip(parts, rows):
            logits = prefill_done(r.slot, r.ids, part, row.logits)
            if logits is not None:
                self._prefilled(r, logits)
        return True

    def _prefill_step(self, r: Request) -> None:
        try:
            logits = r.seq.prefill_next(r.ids) if r.seq is not None else prefill_chunk(self.model, r.slot, r.ids)
        except Exception as e:
            self._finish(r, error=e)
            return
        if logits is not None:
            self._prefilled(r, logits)

    def _prefilled(self, r: Request, logits: torch.Tensor) -> None:
        self._prefilling.remove(r)
        if r.n:  # preempted: its generated tokens' rows again (all but the last), then on from its last token
            try:
                replay_rows(self.model, r.slot, r.resume)
            except Exception as e:
                self._finish(r, error=e)
                return
            r.resume = []
            self._decoding.append(r)
            return
        r.stats.prompt_seconds = time.perf_counter() - r.t0
        forks, r.forks = r.forks, []
        for f in forks:  # before r samples: a sampler may edit the logits in place
            self._start_fork(r, f, logits)
        self._start_decoding(r, logits)

    def _start_fork(self, r: Request, f: Request, logits: torch.Tensor) -> None:
        """Starts choice ``f`` of r's prompt from r's prefill: its rows copied into f's slot, its first token
        sampled from the same logits."""
        if f.cancelled():
            self._finish(f)
            return
        s = f.slot
        try:
            s.kv.copy_prefix_from(r.slot.kv, len(r.ids))
        except Exception as e:
            self._finish(f, error=e)
            return
        s.tokens, s.exact = list(r.ids), r.slot.exact
        s.last_used = time.monotonic()
        f.stats = GenerationStats(prompt_tokens=len(f.ids), prompt_seconds=r.stats.prompt_seconds)
        f.stats.finish_reason = "interrupted"
        self._start_decoding(f, logits.clone())

    def _start_decoding(self, r: Request, logits: torch.Tensor) -> None:
        if r.max_tokens == 0:
            r.stats.finish_reason = "length"
            self._finish(r)
            return
        if r.spec is not None:
            try:
                r.spec.start(r.stats)
            except Exception as e:
                self._finish(r, error=e)
                return
        self._decoding.append(r)
        if len(self._decoding) == 1:  # no stream was waiting before this one's first token, which goes out now
            self._last_decode = time.perf_counter()
        self._emit(r, logits)

    def _decode_step(self) -> None:
        feed, spec = [], []
        alone = len(self._decoding) == 1
        for r in list(self._decoding):
            forced = forced_end(r.sampler)
            if forced is not None:  # the grammar is complete: its end token follows without a forward pass
                self._emit(r, None, forced)
            elif r.spec is not None and (r.seq is not None or (alone and self._may_verify(r))):
                spec.append(r)
            else:  # a slot's speculating request beside others: its drafts ride in the batched pass (_drafts_beside)
                feed.append(r)
        for r in spec:  # each its own plain step or verification pass (speculative.SpecDecoder)
            self._send_spec(r, lambda: r.spec.advance(r.last, r.n))
        feed = self._make_room(feed)
        if not feed:
            return
        drafts, proposals = self._drafts_beside(feed)
        try:
            if drafts:
                rows = self._step_beside(feed, drafts)
            elif len(feed) == 1:  # a batch of one: the fused step's own entry (generator.decode_one)
                r = feed[0]
                logits, top = r.seq._decode(r.last) if r.seq is not None else decode_one(self.model, r.slot, r.last)
                rows = [(r, logits, top)]
            else:
                logits, tops = decode_rows_with_argmax(self.model, [r.seq or r.slot for r in feed],
                                                       [r.last for r in feed])
                rows = zip(feed, logits, tops)
        except Exception as e:
            for r in feed:
                self._finish(r, error=e)
            return
        for r, lg, top in rows:
            d, mlen = drafts.get(id(r), ([], 0))
            if d:  # its verification rows: the accepted drafts and the model's own token go out together
                self._send_spec(r, lambda: r.spec.settle(d, None, mlen, lg, top))
                continue
            n = r.n
            self._emit(r, lg, top=top)
            if r.spec is not None and r.n > n:
                r.spec.plain_step(*proposals.get(id(r), ([], 0)), r.last)

    def _send_spec(self, r: Request, tokens: Callable[[], tuple[list[int], list | None]]) -> None:
        """Sends the tokens a speculative step of r gives (``tokens()``: SpecDecoder.advance's or .settle's result)
        until r ends; an error in the step ends r."""
        try:
            queue, lps = tokens()
        except Exception as e:
            self._finish(r, error=e)
            return
        for i, tok in enumerate(queue):
            if not self._send(r, tok, lps[i] if lps is not None else None):
                break

    def _drafts_beside(self, feed: list[Request]) -> tuple[dict, dict]:
        """({id(request): (drafts, evidence)} to verify, {id(request): (proposal, evidence)} left for a plain step)
        for the speculating requests of a batched pass (lookup, on slots): the pass's rows up to the next multiple
        of MAX_BATCH cost no extra weight read, so each may fill some of them with drafts to verify, as its
        controller expects to pay (first come first served), where the pool has the blocks."""
        spec = [r for r in feed if r.spec is not None and r.seq is None]
        if not spec or len(feed) < 2:
            return {}, {}
        rows = len(feed)
        free = None if self.pool is None else self.pool.free_blocks - sum(
            r.slot.kv.blocks_to_write(len(r.slot.tokens), 1) for r in feed)
        out, left = {}, {}
        for r in spec:
            self._bind_spec(r)
            proposal, mlen, k = r.spec.propose_beside(r.n, (-rows) % MAX_BATCH, rows)
            d = proposal[:k]
            if d and free is not None:
                n = len(r.slot.tokens)
                while d and r.slot.kv.blocks_to_write(n, 1 + len(d)) - r.slot.kv.blocks_to_write(n, 1) > free:
                    d = d[:-1]
                if d:
                    free -= r.slot.kv.blocks_to_write(n, 1 + len(d)) - r.slot.kv.blocks_to_write(n, 1)
            if d:
                out[id(r)] = (d, mlen)
                rows += len(d)
            else:  # unverified: whether its first token was right is the controller's evidence
                left[id(r)] = (proposal, mlen)
        return out, left

    def _step_beside(self, feed: list[Request], drafts: dict) -> list:
        """One step of the model over ``feed``'s rows: each request's last token, followed by its drafts where
        ``drafts`` has some (every row's logits then).  [(request, logits, argmaxes)]: a plain request's row and
        its argmax, a drafting one's rows and theirs.  Each pass's time is its speculating requests' measure of
        a pass of that many rows."""
        steps = []
        for r in feed:
            seq = r.seq or r.slot
            d = drafts.get(id(r), ([], 0))[0]
            steps.append(SeqStep(seq.kv, [r.last] + d, len(seq.tokens), all_logits=bool(d)))
        t0 = time.perf_counter()
        out = self.model.step(steps)
        seconds = time.perf_counter() - t0
        rows = sum(len(s.tokens) for s in steps)
        res = []
        for r, s, o in zip(feed, steps, out):
            (r.seq or r.slot).tokens.extend(s.tokens)
            if r.spec is not None and r.seq is None:
                r.spec.ctrl.time(rows, seconds)
            if len(s.tokens) > 1:
                res.append((r, o.logits, o.argmax))
            else:
                res.append((r, o.logits[0], o.argmax[0] if o.argmax else None))
        return res

    def _bind_spec(self, r: Request) -> None:
        """r's SpecDecoder bound to the slot r holds now (a preempted request comes back on another)."""
        if r.spec.gen is None or r.spec.gen.slot is not r.slot:
            r.spec.gen = SlotSequence(self.model, r.slot, self.n_ctx)

    def _may_verify(self, r: Request) -> bool:
        """Whether r, on a slot, may speculate this step on its own (bound to its slot): room in the pool for a
        whole verification pass."""
        self._bind_spec(r)
        if self.pool is None:
            return True
        return r.slot.kv.blocks_to_write(len(r.slot.tokens), r.spec.spec.k + 1) <= self.pool.free_blocks

    # ---- a KV pool smaller than every slot's context (runtime/kv_pool.py, "Admission") -------------------------
    def _drop_idle_rows(self) -> bool:
        """Gives back the kept prompt rows of the least recently used idle slot; False when no idle slot holds any."""
        idle = [s for s in self.slots if not s.busy and s.kv.seq.blocks]
        if not idle:
            return False
        s = min(idle, key=lambda s: s.last_used)
        s.kv.trim(0)
        s.tokens, s.exact = [], 0
        return True

    def _room_for(self, r: Request) -> bool:
        """Whether the pool has the blocks r's prompt (and a resumed request's tokens) need, idle slots' rows given
        back when short."""
        if self.pool is None:
            return True
        need = self.pool.blocks_for(min(self.n_ctx, len(r.ids) + len(r.resume) + 1))
        while self.pool.free_blocks < need and self._drop_idle_rows():
            pass
        return self.pool.free_blocks >= need

    def _make_room(self, feed: list[Request]) -> list[Request]:
        """The requests of ``feed`` whose next rows the pool has blocks for: when short, idle slots' rows go first,
        then the most recently submitted running request (decoding or reading its prompt) is preempted, until the
        rest fit.  The oldest is never the one while another runs, and alone it always fits: a pool holds at least
        one whole context."""
        if self.pool is None:
            return feed
        while feed:
            need = sum(r.slot.kv.blocks_to_write(len(r.slot.tokens), 1) for r in feed)
            if need <= self.pool.free_blocks:
                break
            if not self._drop_idle_rows():
                victim = max(self._prefilling + self._decoding, key=lambda r: r.t0)
                if victim in feed:
                    feed.remove(victim)
                self._preempt(victim)
        return feed

    def _preempt(self, r: Request) -> None:
        """Frees r's blocks (and its forks' slots) and queues it again, first: once re-admitted its prompt is read
        again and its generated tokens' rows rewritten as decode rows (replay_rows), so it goes on with the same
        rows and sampler state."""
        s = r.slot
        if r in self._decoding:
            self._decoding.remove(r)
            r.resume = s.tokens[len(r.ids):]
        else:  # reading its prompt (again, after an earlier preemption: r.resume holds what it had generated)
            self._prefilling.remove(r)
        for f in r.forks:  # not started: their slots hold nothing yet
            f.slot.busy, f.slot = False, None
        s.kv.trim(0)
        s.tokens, s.exact, s.busy, s.last_used = [], 0, False, time.monotonic()
        r.slot = None
        self._waiting.insert(0, r)
        self.preemptions += 1

    def _emit(self, r: Request, logits: torch.Tensor | None, tok: int | None = None, top: int | None = None) -> None:
        """Samples r's next token from ``logits`` (or takes ``tok``), sends it, and ends r where it stops.  top: the
        logits' argmax from the fused step (>= 0: every logit is finite), else None."""
        try:
            if tok is None:
                check_finite(logits, top, self.nonfinite)
                tok = r.sampler.sample_known_argmax(logits, top)
                lp = r.sampler.last_logprobs if getattr(r.sampler, "logprobs", None) is not None else None
            else:
                lp = None
        except Exception as e:
            self._finish(r, error=e)
            return
        self._send(r, tok, lp)

    def _send(self, r: Request, tok: int, lp) -> bool:
        """Sends r's next token ``tok`` (its logprobs ``lp``) and ends r where it stops; True while r goes on."""
        st = r.stats
        now = time.perf_counter()
        if r.n == 0:
            st.ttft = now - r.t0
            r.t1 = now
        st.generated_tokens += 1
        st.finish_reason = reason = finish_reason(r.n, tok, len(r.ids), r.max_tokens, self.n_ctx, self.is_eog)
        st.decode_seconds = now - r.t1
        r.n += 1
        r.last = tok
        r.out.put(("token", tok, lp))
        if reason != "interrupted":
            self._finish(r)
            return False
        if r.spec is not None:
            r.spec.ctx.append(tok)
        return True

    def _finish(self, r: Request, error: Exception | None = None) -> None:
        for lst in (self._prefilling, self._decoding):
            if r in lst:
                lst.remove(r)
        forks, r.forks = r.forks, []  # choices of a prompt that was never read: they end with it
        for f in forks:
            f.stats.finish_reason = "interrupted"
            self._finish(f, error=error)
        s = r.slot
        if r.seq is not None:  # the caller's own sequence: its tokens list exactly what its cache holds
            pass
        elif s is not None and s.busy:
            s.busy = False
            s.last_used = time.monotonic()
            if error is not None:  # the cache may be half-written: nothing in it is trusted
                s.tokens, s.exact = [], 0
            elif self.disk is not None:
                try:
                    self.disk.save(s)
                except Exception as e:
                    cache_log(f"not saved: {type(e).__name__}: {e}")
            s.kv.trim(s.exact)  # only the reusable rows are read again: a paged cache gives the rest back
        r.out.put(("error", error) if error is not None else ("end", None))
