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

from ..errors import ContextFullError


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
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    finish_reason: str = ""  # "eog", "length", "context", "stop", "interrupted"
    ttft: float = 0.0  # seconds from the call to the first generated token

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
                    prompt_tps=self.prompt_tps, decode_tps=self.decode_tps)


@dataclass
class Generator:
    model: object  # has forward(tokens [T] int64, start_pos, kv, all_logits=False) -> logits
    kv: object
    n_ctx: int
    n_batch: int = 512  # prompt tokens per forward pass: bounds activation memory for long prompts
    tokens: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)

    def reset(self) -> None:
        self.tokens = []

    def truncate(self, n: int) -> None:
        """Forget cached tokens from position n on (their cache slots are simply overwritten later)."""
        del self.tokens[n:]

    def _forward(self, toks: list[int], all_logits: bool = False) -> torch.Tensor:
        pos = len(self.tokens)
        if pos + len(toks) > self.n_ctx:
            raise ContextFullError(f"context full: {pos} cached + {len(toks)} new tokens exceed n_ctx={self.n_ctx}")
        with torch.inference_mode():
            logits = self.model.forward(torch.tensor(toks, dtype=torch.int64), pos, self.kv, all_logits=all_logits)
        self.tokens.extend(toks)
        return logits

    def common_prefix(self, ids: list[int]) -> int:
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        return n

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Brings the cache to exactly ``ids`` and returns the logits [n_vocab] after the last one."""
        if not ids:
            raise ValueError("cannot generate from an empty prompt")
        if len(ids) >= self.n_ctx:
            raise ContextFullError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx}; "
                                   f"use a larger n_ctx (--ctx) or a shorter prompt")
        keep = min(self.common_prefix(ids), len(ids) - 1)  # re-evaluate at least one token to get logits
        self.truncate(keep)
        logits = None
        for i in range(keep, len(ids), self.n_batch):
            logits = self._forward(ids[i:i + self.n_batch])
        self.stats.prompt_evaluated = len(ids) - keep
        if len(ids) - keep >= TRIM_AFTER_TOKENS:
            release_free_heap()
        return logits[-1]

    def evaluate_all(self, ids: list[int]) -> torch.Tensor:
        """Fresh evaluation from position 0: logits [len(ids), n_vocab] (for tests and perplexity)."""
        self.reset()
        out = [self._forward(ids[i:i + self.n_batch], all_logits=True) for i in range(0, len(ids), self.n_batch)]
        return torch.cat(out)

    def generate(self, ids: list[int], sample: Callable[[torch.Tensor], int], max_tokens: int,
                 is_eog: Callable[[int], bool], forced_end: Callable[[], int | None] | None = None) -> Iterator[int]:
        """Yields generated ids; stops after an end-of-generation id (yielded), max_tokens, or a full context.

        ``forced_end`` (a grammar constraint's ``end_token``): asked after each token; an id means the structured
        output is complete and only that end id can follow, so it is yielded next without a decode step (the
        same tokens the masked sampler would give, one forward pass sooner).
        """
        st = self.stats = GenerationStats(prompt_tokens=len(ids))
        t0 = time.perf_counter()
        st.finish_reason = "interrupted"
        logits = self.prefill(ids)
        st.prompt_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        forced = None
        for n in range(max_tokens):
            tok = sample(logits) if forced is None else forced
            st.generated_tokens += 1
            if n == 0:
                st.ttft = time.perf_counter() - t0
                t1 = time.perf_counter()
            # the reason is set before the yield: a consumer that stops at this token never resumes us
            if is_eog(tok):
                st.finish_reason = "eog"
            elif n + 1 == max_tokens:
                st.finish_reason = "length"
            elif len(self.tokens) + 1 > self.n_ctx:
                st.finish_reason = "context"
            else:
                st.finish_reason = "interrupted"
            st.decode_seconds = time.perf_counter() - t1
            yield tok
            if st.finish_reason != "interrupted":
                break
            forced = forced_end() if forced_end is not None else None
            if forced is None:
                logits = self._forward([tok])[-1]
        else:
            st.finish_reason = "length"
        st.decode_seconds = time.perf_counter() - t1
