"""A slot of the engine (runtime/batch.py): one sequence's KV cache and the tokens it holds, and the steps of the
model over slots: decode rows of several slots in one step, a prompt read in chunks (or spans of them, where the
backend reads a prompt's rows with the same bits in any forward), and the rows of a preempted request's tokens
written again."""

from __future__ import annotations

import torch

from .. import ops
from ..backends.base import SeqStep
from .engine import chunk_end
from .prompt_cache import PREFILL_CHUNK

# Prompt tokens one step reads at most: the chunks of several prompts, first come first served, go to the backend
# in one step (one pass over the weights where it batches them); the first prompt's chunk always goes.
STEP_TOKENS = 4 * PREFILL_CHUNK


class Slot:
    """One sequence's KV cache. ``tokens``: the tokens whose K/V rows it holds, in order; ``exact``: how many
    leading rows came from whole aligned prefill chunks (what may be reused, see the module docstring)."""

    def __init__(self, index: int, kv):
        self.index = index
        self.kv = kv
        self.tokens: list[int] = []
        self.exact = 0
        self.busy = False
        self.last_used = 0.0

    def context(self, model):
        """The CPU extension's DecodeContext for this slot's cache (built once), or None where the C++ step does not
        apply (another backend or device, or a centered cache whose means are not estimated yet).  The engine
        never calls it (its forwards go through ``model.step``); tests reach the C++ step through it."""
        return model.decode_context(self.kv)

    def copy_prefix(self, src: "Slot", n: int) -> None:
        """Rows 0..n-1 of ``src`` (and its statistics: means, key scales, sink rows) into this slot."""
        self.kv.copy_prefix_from(src.kv, n)
        self.tokens = src.tokens[:n]
        self.exact = n


def decode_rows(model, slots: list[Slot], tokens: list[int]) -> torch.Tensor:
    """Logits [B, n_vocab] of tokens[b] appended to slots[b] (K/V stored at len(slots[b].tokens)); the slots'
    token lists are extended. One step of the model over all of them (the backend batches what it can)."""
    return decode_rows_with_argmax(model, slots, tokens)[0]


def decode_rows_with_argmax(model, slots: list[Slot], tokens: list[int]) -> tuple[torch.Tensor, list[int | None]]:
    """decode_rows' logits and each row's argmax where the fused step found it (-1: a logit is NaN or infinite),
    else None (what Sampler.sample_known_argmax and the non-finite check take)."""
    rows = model.step([SeqStep(s.kv, [t], len(s.tokens)) for s, t in zip(slots, tokens)])
    for s, t in zip(slots, tokens):
        s.tokens.append(t)
    return stacked_logits([r.logits for r in rows]), [r.argmax[0] if r.argmax else None for r in rows]


def stacked_logits(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows [1, n_vocab] as one [B, n_vocab] tensor: a view where they are consecutive rows of one tensor (what a
    batched pass of the CPU backend returns: no copy of B x n_vocab floats a step, 0.1 ms at 4 rows of SmolLM2),
    else their copy."""
    first = rows[0]
    if len(rows) == 1:
        return first
    n = first.shape[-1]
    base, step = first.untyped_storage().data_ptr(), n * first.element_size()
    if all(r.shape == (1, n) and r.dtype == first.dtype and r.is_contiguous()
           and r.untyped_storage().data_ptr() == base and r.data_ptr() == first.data_ptr() + i * step
           for i, r in enumerate(rows)):
        return first.as_strided((len(rows), n), (n, 1))
    return torch.cat(rows)


def prefill_chunk(model, slot: Slot, ids: list[int]) -> torch.Tensor | None:
    """Evaluates the next part of ``ids`` past the slot's tokens (it must hold a prefix of ids; prefill_part).
    Returns the logits [n_vocab] after the last prompt token once it is evaluated, else None."""
    part = prefill_part(model, slot, ids)
    return prefill_done(slot, ids, part, model.step([part])[0].logits)


def prefill_part(model, slot: Slot, ids: list[int], limit: int = STEP_TOKENS) -> SeqStep:
    """The slot's next part of prompt ``ids`` as a part of a step: the next PREFILL_CHUNK-aligned chunk, or, where
    the model reads a prompt's rows with the same bits in any forward of at least ``least`` rows
    (Decoder.prefill_exact_rows), a span of whole chunks up to ``limit`` tokens, the prompt's last partial chunk
    with them unless it is shorter than ``least`` (a prompt reused up to there reads it alone, so a fresh one does
    too).  A forward costs a pass over the weights whatever its rows: a 244-token prompt on Qwen2.5-0.5B read in one
    span took 211 ms against 435 ms in four chunks.  A centered (quantized) cache's first chunk stays a chunk: it
    fixes the cache's means, which must not depend on the span."""
    pos, n = len(slot.tokens), len(ids)
    end = chunk_end(pos, n, PREFILL_CHUNK, aligned=True)
    least = model.prefill_exact_rows(slot.kv)
    if least is not None and (pos or not getattr(slot.kv, "centered", False)):
        body = n - n % PREFILL_CHUNK
        far = pos + limit
        if end < body:
            end = max(end, min(body, far - far % PREFILL_CHUNK))
        if end == body and n - body >= least and n <= far:
            end = n
    return SeqStep(slot.kv, ids[pos:end], pos, prefill=True)


def prefill_done(slot: Slot, ids: list[int], part: SeqStep, logits: torch.Tensor) -> torch.Tensor | None:
    """Records that ``part`` (prefill_part's) ran, its rows' ``logits``: prefill_chunk's result.  The slot's rows
    reusable by a later prompt (``exact``) grow to the last whole chunk the part ended: prefill rows of whole
    chunks have a fresh prefill's bits however the prompt was cut into parts."""
    end = part.pos + len(part.tokens)
    slot.tokens.extend(part.tokens)
    if slot.exact == part.pos:
        slot.exact = max(slot.exact, end - end % PREFILL_CHUNK)
    return logits[-1].float() if end == len(ids) else None


def replay_rows(model, slot: Slot, tokens: list[int]) -> None:
    """Writes the K/V rows of ``tokens``, decoded before, past the slot's tokens as decode rows (what a preempted
    request's resumption runs): GEMV_MAX_M rows a pass where the step's rows are exact, each then the bits of the
    one-token step that first wrote it, else one token a step."""
    n = ops.GEMV_MAX_M if getattr(model.fused_step(slot.kv), "rows_exact", False) else 1
    for i in range(0, len(tokens), n):
        model.step([SeqStep(slot.kv, tokens[i:i + n], len(slot.tokens))])
        slot.tokens.extend(tokens[i:i + n])
