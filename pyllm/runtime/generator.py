"""One caller's sequence: a KV cache kept between calls, its prompts read from any cached prefix.

``Generator`` is what the engine (runtime/batch.py BatchEngine) runs a library call's request on: ``start`` and
``prefill_next`` read a prompt in n_batch-token chunks from where the cached prefix ends, ``_decode`` runs one
token through the fused step.  It owns the KV cache's bookkeeping: ``tokens`` lists exactly the tokens whose keys and values are in
the cache, in order. It is extended only after a forward pass completes, so an interrupt (Ctrl-C, a closed
iterator, an exception) between or inside steps leaves the cache consistent and the next call reuses it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..backends.base import SeqStep
from ..errors import ContextFullError
from .engine import chunk_end, common_prefix


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


def decode_one(model, seq, tok: int) -> tuple[torch.Tensor, int | None]:
    """``tok`` appended to sequence ``seq`` (its ``kv`` and ``tokens``, which is extended): the logits [n_vocab]
    after it and, from the fused step, their argmax (-1: a logit is NaN or infinite), else None.

    A lone decode token takes the fused step's own entry (what the step protocol runs for it, step_one) without the
    protocol's lists and row views: each torch call right after a step runs cold (Decoder.fused_logits), and SmolLM2
    decoded 3-9% slower through them (interleaved bench, depth 1024).  What the engine runs for a batch of one."""
    pos = len(seq.tokens)
    fused = model.fused_logits(tok, pos, seq.kv)
    if fused is None:
        logits, top = model.step([SeqStep(seq.kv, [tok], pos)])[0]
        fused = logits[0], (top[0] if top else None)
    seq.tokens.append(tok)
    return fused


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
    _keep: int = 0  # cached tokens the prompt being read kept (start)

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
        self.check_room(1)
        return decode_one(self.model, self, tok)

    def common_prefix(self, ids: list[int]) -> int:
        return common_prefix(self.tokens, ids)

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Brings the cache to exactly ``ids`` and returns the logits [n_vocab] after the last one."""
        logits = self.start(ids)
        while logits is None:
            logits = self.prefill_next(ids)
        return logits

    def start(self, ids: list[int]) -> torch.Tensor | None:
        """Begins prompt ``ids``: keeps the longest cached prefix (any length: this cache serves one caller, whose
        next prompt usually extends its last), leaving at least one token to evaluate.  Returns the logits after
        the prompt where it is the last prefill's own (nothing to evaluate), else None: ``prefill_next`` then reads
        it a chunk at a time."""
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
        self._keep = keep
        return None

    def prefill_next(self, ids: list[int]) -> torch.Tensor | None:
        """Evaluates the next chunk of ``ids`` (n_batch tokens from where the cache ends; ``start`` began it):
        the logits [n_vocab] after the last prompt token once it is read, else None."""
        i = len(self.tokens)
        end = chunk_end(i, len(ids), self.n_batch, aligned=False)
        logits = self._forward(ids[i:end])
        if end < len(ids):
            return None
        self.stats.prompt_evaluated = len(ids) - self._keep
        if len(ids) - self._keep >= TRIM_AFTER_TOKENS:
            release_free_heap()
        self._prompt_logits = (len(ids), logits[-1].clone())
        return logits[-1]

    def evaluate_all(self, ids: list[int]) -> torch.Tensor:
        """Fresh evaluation from position 0: logits [len(ids), n_vocab] (for tests and perplexity)."""
        return torch.cat(list(self.evaluate_chunks(ids)))

    def evaluate_chunks(self, ids: list[int]) -> Iterator[torch.Tensor]:
        """Fresh evaluation from position 0, as logits [<= n_batch, n_vocab] for each n_batch tokens in turn: a
        caller that reduces each chunk before the next never holds [len(ids), n_vocab] (2.4 GB for 4096 tokens
        of a 151k vocabulary). The cache then holds ``ids``, and a generation from them goes on from the last row's
        logits as after ``prefill(ids)``."""
        self.reset()
        i = 0
        while i < len(ids):
            end = chunk_end(i, len(ids), self.n_batch, aligned=False)
            logits = self._forward(ids[i:end], all_logits=True)
            if end == len(ids):  # the chunks are prefill's and the last row is its (the model's forward): a
                # generation from ids goes on from these logits, as from a plain prefill of them
                self._prompt_logits = (len(ids), logits[-1].clone())
            yield logits
            i = end
