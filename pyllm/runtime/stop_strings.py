"""Stop strings over a generation's decoded text: what is final, and where the output ends.

One implementation for every text-producing path (LLM.generate / chat, and the OpenAI-shaped api.Run behind the
server): text is held back while a stop string may still be forming in its tail (only the tail that begins one), and the output ends before the
first stop string found. Under a constraint (``accepts``: does the output, from its start, completely match?) a
stop string ends the output only after a complete match: cut anywhere else (stop="\\n" inside a JSON reply) it
would be invalid output presented as finished; the other occurrences stay in the text.
"""

from __future__ import annotations

from typing import Callable

from ..errors import PyllmError, shorten
from ..tokenizer import StreamDecoder


def stop_list(stop) -> list[str]:
    """``stop`` as the list of its non-empty strings: None, one string (as OpenAI and llama-cpp-python take it;
    iterated, "END" would be the stop strings "E", "N" and "D"), or a list or tuple of strings. Anything else is a
    PyllmError naming it, before anything is generated."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise PyllmError(f"stop must be a string or a list of strings, got {shorten(repr(stop))}")


class StopStrings:
    def __init__(self, stop: list[str], accepts: Callable[[str], bool] | None = None):
        self.stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self.stop), default=1) - 1
        self.accepts = accepts
        self.released = ""  # the text handed out so far
        self.stopped = False  # a stop string ended the output
        self._pending = ""
        self._skip = 0  # where in _pending the search goes on, past occurrences the constraint did not accept

    def push(self, text: str) -> str:
        """Adds decoded ``text`` and returns what of the output is now final ('' while a stop string may be
        forming). Once a stop string ends the output, ``stopped`` is set and the text before it is returned."""
        self._pending += text
        if not self.stop:
            return self._release(len(self._pending))
        cut = self._stop_at()
        if cut >= 0:
            self.stopped = True
            out = self._pending[:cut]
            self._pending = ""
            self.released += out
            return out
        hold = self._forming()
        if self.accepts is not None:  # every occurrence before the tail was judged; look there no more
            self._skip = max(self._skip, len(self._pending) - hold)
        return self._release(len(self._pending) - hold)

    def _forming(self) -> int:
        """The length of the longest tail of the pending text that begins a stop string: only that much is held
        back (as llama.cpp's server does), so a stream lags only while a stop string may really be forming."""
        p = self._pending
        for k in range(min(self._longest, len(p)), 0, -1):
            tail = p[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def flush(self) -> str:
        """The held-back tail, at the end of a generation that no stop string ended."""
        return self._release(len(self._pending))

    def _release(self, n: int) -> str:
        if n <= 0:
            return ""
        out, self._pending = self._pending[:n], self._pending[n:]
        self._skip = max(0, self._skip - n)
        self.released += out
        return out

    def _stop_at(self) -> int:
        skip = self._skip
        while True:
            cut = min((i for i in (self._pending.find(s, skip) for s in self.stop) if i >= 0), default=-1)
            if cut < 0 or self.accepts is None or self.accepts(self.released + self._pending[:cut]):
                return cut
            skip = cut + 1


class OutputText:
    """A generation's tokens -> its output text, for every text path (LLM.generate / chat, and api.Run behind the
    server): ``push`` each token that is output (not the end-of-generation one) and get what of the text is final;
    ``finish`` when the generation ends, however it ends (a stop token, max_tokens, a full context, a cancel),
    for what was held back. Bytes that do not yet form a character are held back (StreamDecoder), and so is a
    tail that may begin a stop string (StopStrings). At the end, bytes of a character that never completed come
    out as U+FFFD, as ``bytes.decode("utf-8", errors="replace")`` (llama.cpp, Hugging Face) gives them: dropped,
    a reply would silently lose text. One ``finish`` for every path, so that no way out of a loop skips it."""

    def __init__(self, tokenizer, stop: list[str], accepts: Callable[[str], bool] | None = None):
        self._dec = StreamDecoder(tokenizer)
        self._stops = StopStrings(stop, accepts)
        self.decoded = 0  # characters decoded so far, stop strings included: where the next token's text starts

    @property
    def stopped(self) -> bool:
        """A stop string ended the output: nothing more comes out."""
        return self._stops.stopped

    def push(self, tid: int) -> str:
        if self._stops.stopped:
            return ""
        piece = self._dec.push(tid)
        self.decoded += len(piece)
        return self._stops.push(piece)

    def finish(self) -> str:
        if self._stops.stopped:
            return ""
        out = self._stops.push(self._dec.flush())
        return out if self._stops.stopped else out + self._stops.flush()
