"""The worker threads between the event loop and the model.

The event loop must never block on a forward pass, so every request becomes a Job that a worker thread runs to
completion, in arrival order. With one worker (``--parallel 1``) that thread is the only one that touches the
LLM (one KV cache, one generation loop). With several, each job generates through ``EngineLLM``: the LLM as
pyllm/api.py sees it, except that its tokens come from the BatchEngine (pyllm/runtime/batch.py), whose one
thread decodes every running request together. A job's results travel back to the event loop through an
asyncio.Queue; a job whose client went away is cancelled at its next item (for a stream: the next token), or
while it waits for a slot.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import ops
from ..runtime.batch import BatchEngine, BatchStats, Request, TokenStream, make_requests, queue_items
from ..runtime.generator import GenerationStats
from ..runtime.sampler import Sampler

DONE = object()  # end of a job's items


@dataclass
class Job:
    fn: Callable[[threading.Event], Any]  # fn(cancel) runs on the worker: a dict, or an iterator of dicts (a stream)
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("item", dict) | ("error", exc) | DONE
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)
    view: Any = None  # the EngineLLM the job generates through (its stats), or None: the LLM itself
    tokens: tuple[int, int] | None = None  # (prompt, generated) of the generation it ran, set by on_done
    release: Callable[[], None] | None = None  # called once the job is done with ``fn`` (run, or dropped)

    def put(self, x) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, x)


class Scheduler:
    def __init__(self, on_done: Callable[[Job, float], None] | None = None, workers: int = 1):
        self._q: queue.Queue[Job | None] = queue.Queue()
        self.on_done = on_done
        self.busy = 0  # jobs running now (0..workers)
        self._busy_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, name=f"pyllm-worker-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    @property
    def depth(self) -> int:
        """Jobs waiting for the worker."""
        return self._q.qsize()

    def submit(self, fn: Callable[[threading.Event], Any], cancel: threading.Event | None = None,
               view=None, release: Callable[[], None] | None = None) -> Job:
        job = Job(fn, asyncio.get_running_loop(), cancel=cancel or threading.Event(), view=view, release=release)
        self._q.put(job)
        return job

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout=10)

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            if not job.cancel.is_set():
                with self._busy_lock:
                    self.busy += 1
                t0 = time.monotonic()
                try:
                    self._run(job)
                finally:
                    with self._busy_lock:
                        self.busy -= 1
                    if self.on_done:
                        self.on_done(job, time.monotonic() - t0)
                    # after on_done: when a response ends, its counts (the request log's, /metrics') are in place
                    job.put(DONE)
            # What the job's function holds (a request's parsed body) goes now, not when the next job comes; the
            # request may still hold the Job itself (a stream being sent).
            job.fn, release = None, job.release
            del job
            if release is not None:
                release()
            # Until its next job this thread runs no kernels; the thread that does (the engine's, another worker)
            # keeps its OpenMP spin-waits only while no other thread holds workers (ops.release_thread_pool).
            ops.release_thread_pool()

    @staticmethod
    def _run(job: Job) -> None:
        try:
            result = job.fn(job.cancel)
            if isinstance(result, dict):
                job.put(("item", result))
            else:
                try:
                    for item in result:
                        if job.cancel.is_set():
                            break
                        job.put(("item", item))
                finally:
                    result.close()  # frees the model at once, not when the generator is collected
        except Exception as e:  # reported to the client as an error object; the worker keeps serving
            job.put(("error", e))


class EngineLLM:
    """An LLM whose generate_tokens runs in the BatchEngine: what pyllm/api.py needs of an LLM (tokenizer,
    template, chat_ids, n_ctx, ... delegated), with ``stats`` of this one generation. One per request;
    ``cancel`` (the job's) also stops the request while it waits for a free slot."""

    def __init__(self, llm, engine: BatchEngine, cancel: threading.Event):
        self._llm, self._engine, self._cancel = llm, engine, cancel
        self._req: Request | None = None
        self._batch: BatchStats | None = None  # a generate_tokens_batch call's

    def __getattr__(self, name):
        return getattr(self._llm, name)

    @property
    def stats(self) -> GenerationStats:
        if self._batch is not None:
            return self._batch
        return self._req.stats if self._req is not None else GenerationStats()

    @property
    def generated(self) -> bool:
        return self._req is not None or self._batch is not None

    def prompt_logprobs(self, ids: list[int], n_top: int = 0):
        """As LLM.prompt_logprobs, on the engine's thread between its steps: one thread runs the model."""
        return self._engine.call(lambda: self._llm.prompt_logprobs(ids, n_top))

    def generate_tokens(self, ids: list[int], max_tokens: int = 256, temperature: float = 0.8, top_k: int = 40,
                        top_p: float = 0.95, min_p: float = 0.05, seed: int | None = None,
                        sampler: Sampler | None = None, json_schema=None, grammar: str | None = None,
                        constraint=None, **sampling):
        """As LLM.generate_tokens.  Greedy requests speculate as the LLM's own would (prompt lookup where the
        step's rows are exact; a draft model has one cache, so not here): alone by their own verification passes,
        beside other streams with their drafts in the batched pass (BatchEngine._drafts_beside)."""
        ids, max_tokens, sampler = self._llm.generation_request(
            ids, max_tokens, sampler=sampler, json_schema=json_schema, grammar=grammar, constraint=constraint,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, **sampling)
        req = self._req = Request(list(ids), max_tokens, copy.copy(sampler), also_cancel=self._cancel)
        spec = self._llm.spec_settings("auto", None, None, sampler)
        if spec is not None and spec.mode == "lookup" and max_tokens > 0:
            self._engine.speculate(req, spec)
        self._engine.submit(req)
        return TokenStream(req, queue_items(req), sampler)

    def generate_tokens_batch(self, calls: list[dict]) -> list[TokenStream]:
        """Several generations at once (LLM.generate_tokens_batch), in the engine beside every other request; their
        ``stats`` together are this view's."""
        prepared = [self._llm.generation_request(**c) for c in calls]
        reqs, top = make_requests(prepared, also_cancel=self._cancel, group=len(self._engine.slots))
        self._req = None
        self._batch = BatchStats(reqs, top)
        for r in top:
            self._engine.submit(r)
        return [TokenStream(r, queue_items(r), sampler) for r, (_, _, sampler) in zip(reqs, prepared)]
