"""Admission by memory: request bodies, as they arrive and once parsed, are counted against one budget
(--max-request-memory), and a request past it is answered 503 before it is parsed."""

from __future__ import annotations

import threading

from .. import request_json
from ..errors import PyllmError
from .api_errors import APIError

# Memory that request bodies, read and parsed, may hold at once (--max-request-memory); past it a request is
# answered 503 with Retry-After, as TGI answers past its concurrency limit. A body is counted from its first byte
# (its Content-Length, when given, before any is read) until its request has been answered and the job that holds
# its parsed value has finished: while it waits for the model it is memory all the same.
RETRY_AFTER_S = 1
HOLD = "pyllm.hold"  # the ASGI scope key of a request's Hold


def worst_request_bytes(max_body: int) -> int:
    """The most one request within ``max_body`` can take from the budget: its body, and the largest parsed value
    and parse that request_json's estimates allow a body of that size."""
    rj = request_json
    return max_body + rj.BASE_BYTES + 4 * max_body + rj.VALUE_BYTES * min(rj.MAX_VALUES, max_body + 1) \
        + rj.CONTAINER_BYTES * min(rj.MAX_CONTAINERS, max_body // 2) \
        + 12 * max_body + rj.ESCAPE_BYTES * min(rj.MAX_ESCAPES, max_body)


def default_request_memory(max_body: int) -> int:
    """--max-request-memory's default: 512 MiB, or room for the largest request if that is more."""
    return max(512 << 20, worst_request_bytes(max_body))


def request_memory(max_body: int, limit: int | None) -> int:
    """The MemoryBudget's limit in bytes: ``limit`` (--max-request-memory), None for the default; PyllmError if
    one request within ``max_body`` could not fit in it."""
    limit = default_request_memory(max_body) if limit is None else limit
    if limit < worst_request_bytes(max_body):
        raise PyllmError(f"--max-request-memory {limit >> 20} MiB is less than one request within --max-body "
                         f"{max_body} may hold ({-(-worst_request_bytes(max_body) >> 20)} MiB): raise it or lower "
                         f"--max-body")
    return limit


class MemoryBudget:
    """The bytes requests may hold at once, shared by every request (thread-safe: the worker threads give back
    what their jobs held)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self.lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self.lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self.lock:
            self.used -= n


class Hold:
    """One request's part of the MemoryBudget: taken as its body arrives and once more for its parsed value,
    given back whole when every holder has let go: the request (its response sent) and each job it submitted
    (finished, or dropped after a cancel)."""

    def __init__(self, budget: MemoryBudget):
        self.budget, self.bytes, self.holders = budget, 0, 1
        self.lock = threading.Lock()

    def take(self, n: int, what: str) -> None:
        """Counts ``n`` more bytes, or APIError 503 (Retry-After) when the budget has no room for them."""
        if not self.budget.take(n):
            raise APIError(503, f"the server is busy: {what} does not fit in the memory that requests in flight "
                                f"may hold (--max-request-memory {self.budget.limit >> 20} MiB); retry shortly",
                           None, "server_overloaded", {"Retry-After": str(RETRY_AFTER_S)})
        with self.lock:
            self.bytes += n

    def give(self, n: int) -> None:
        with self.lock:
            self.bytes -= n
        self.budget.give(n)

    def retain(self) -> None:
        with self.lock:
            self.holders += 1

    def release(self) -> None:
        with self.lock:
            self.holders -= 1
            n, self.bytes = (self.bytes, 0) if self.holders == 0 else (0, self.bytes)
        if n:
            self.budget.give(n)


class Admission:
    """ASGI middleware: each HTTP request gets a Hold on ``budget`` (scope[HOLD]), let go once its response has
    been sent; read_json takes from it."""

    def __init__(self, app, budget: MemoryBudget):
        self.app, self.budget = app, budget

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        hold = scope[HOLD] = Hold(self.budget)
        try:
            await self.app(scope, receive, send)
        finally:
            hold.release()
