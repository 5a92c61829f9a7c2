"""The one thread that touches the model.

An LLM is not thread-safe (one KV cache, one generation loop), and the event loop must never block on a forward
pass, so every request becomes a Job that the worker thread runs to completion, in arrival order. A job's
results travel back to the event loop through an asyncio.Queue; a job whose client went away is cancelled at
its next item (for a stream: the next token).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

DONE = object()  # end of a job's items


@dataclass
class Job:
    fn: Callable[[threading.Event], Any]  # fn(cancel) runs on the worker: a dict, or an iterator of dicts (a stream)
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("item", dict) | ("error", exc) | DONE
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)

    def put(self, x) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, x)


class Scheduler:
    def __init__(self, on_done: Callable[[Job, float], None] | None = None):
        self._q: queue.Queue[Job | None] = queue.Queue()
        self.on_done = on_done
        self.busy = 0  # jobs running now (0 or 1)
        self._thread = threading.Thread(target=self._loop, name="pyllm-worker", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting for the worker."""
        return self._q.qsize()

    def submit(self, fn: Callable[[threading.Event], Any]) -> Job:
        job = Job(fn, asyncio.get_running_loop())
        self._q.put(job)
        return job

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            if job.cancel.is_set():
                continue
            self.busy = 1
            t0 = time.monotonic()
            try:
                self._run(job)
            finally:
                self.busy = 0
                if self.on_done:
                    self.on_done(job, time.monotonic() - t0)

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
        job.put(DONE)
