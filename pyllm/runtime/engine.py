"""What the engine (batch.py BatchEngine) decides the same way for every request: a library call's (a request on the
LLM's own sequence, generator.py Generator, stepped in the caller's thread) and the server's (requests on the
engine's slots, stepped by its thread).

Each rule is here once, so a change to when a generation ends, how broken logits are caught, which cached rows a
prompt reuses, when a grammar ends the output or how a prompt is cut into forward passes reaches every caller.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch


def common_prefix(a, b) -> int:
    """How many leading tokens the sequences ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def finish_reason(n: int, tok: int, n_prompt: int, max_tokens: int, n_ctx: int, is_eog: Callable[[int], bool]) -> str:
    """Why generation ends after the n-th (0-based) generated token ``tok`` of a prompt of ``n_prompt`` tokens:
    "eog", "length", "context", or "interrupted" (it goes on: the reason if the caller stops now)."""
    if is_eog(tok):
        return "eog"
    if n + 1 == max_tokens:
        return "length"
    if n_prompt + n + 1 > n_ctx:  # tok would be cached at position n_prompt + n
        return "context"
    return "interrupted"


def check_finite(logits: torch.Tensor, argmax: int | None, error: Callable[[torch.Tensor], Exception]) -> None:
    """Raises ``error(logits)`` where a logit is NaN or infinite: broken weights or hyper-parameters would
    otherwise come out as fluent garbage.  An ``argmax`` >= 0 from the fused step says every logit is finite.
    Else the sum is non-finite whenever an element is (one pass: ~10 us for Qwen's 151,936 logits); only then is
    each element checked.  In numpy, not torch: torch spreads the sum over its thread pool, whose wake-up on cores
    busy with the step or other work cost milliseconds per token."""
    if argmax is not None and argmax >= 0:
        return
    if not math.isfinite(float(logits.detach().cpu().float().numpy().sum(dtype=np.float64))) \
            and not bool(torch.isfinite(logits).all()):
        raise error(logits)


def forced_end(sampler) -> int | None:
    """The end id a grammar-constrained sampler's output must take next (its constraint is complete), else None:
    the loops emit it without a forward pass."""
    c = getattr(sampler, "constraint", None)
    return c.end_token() if c is not None else None


def chunk_end(pos: int, n_ids: int, size: int, aligned: bool) -> int:
    """Where the prefill chunk that starts at ``pos`` of a prompt of ``n_ids`` tokens ends: ``size`` tokens on
    (``aligned``: at the next multiple of ``size``, so that every chunk but the last is a whole aligned one, the
    unit the server's prompt reuse keeps; the library's chunks start where its cached prefix ends), or the end."""
    return min(n_ids, (pos // size + 1) * size if aligned else pos + size)
