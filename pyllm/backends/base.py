"""The backend protocol: what a model needs from the hardware it runs on.

A backend owns the kernels over quantized weights (linear layers, embedding rows), the KV cache's placement, and
an optional fused one-token decode step. The model definitions (pyllm/models) are written once against it; the
runtime (generator, sampler) only ever sees float32 CPU logits. Nothing process-global decides which backend a
model uses: each model holds its own, so two LLMs with different backends work side by side in one process.

Tensors crossing the protocol:
  activations x      float32 [T, K] on ``backend.device`` (T rows: 1 at decode, up to n_batch at prefill)
  weights w          QTensor-like (``data``, ``qtype``, ``shape`` [N, K], ``dequantize()``, ``rows()``), as
                     ``prepare_weights`` returned them (CPU: the mapped file; CUDA: quantized blocks in VRAM)
  token ids          int64 [T], on the CPU or on ``backend.device``
  linear(x, w)       float32 [T, N] on ``backend.device``: y = x @ W.T
  embed(w, ids)      float32 [T, K] on ``backend.device``: rows ``ids`` of W, only those dequantized
  fused step logits  float32 [1, n_vocab] on the CPU
  step(model, seqs)  one StepRows per SeqStep: float32 CPU logits [rows, n_vocab] and, where the fused step found
                     them, each row's argmax (the multi-sequence step below)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, runtime_checkable

import torch

from ..errors import PyllmError


class BackendUnavailable(PyllmError):
    """A backend cannot run here (no GPU, torch without CUDA, kernels that do not build); the message says why."""


@runtime_checkable
class DecodeStep(Protocol):
    """A fused one-token decode step bound to one model and one KV cache (CPU: the C++ step; CUDA: a graph)."""

    n_vocab: int

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        """Runs ``token`` at position ``pos`` (writing its K/V into the bound cache) and returns float32 CPU
        logits [1, n_vocab]. The caller has checked that pos + 1 <= the cache's max_seq.

        A step may also offer ``with_argmax(token, pos)`` -> (logits [n_vocab], their argmax, -1 where one is NaN
        or infinite): what greedy sampling needs, without reading the logits again (Decoder.fused_logits)."""


@dataclass
class SeqStep:
    """One sequence's part of a multi-sequence step: ``tokens`` (1 for decode, a chunk for prefill, k + 1 for a
    speculative check) run at positions ``pos``.. against the sequence's own cache ``kv`` (their K/V rows are
    written there).  ``prefill``: the tokens are a prompt's, read by the model's forward (the GEMM path whose rows
    prompt reuse relies on); else they are decode rows: the fused step's, each row bit for bit a one-token step's
    where the step says ``rows_exact``.  ``all_logits``: every row's logits, else the last row's only."""

    kv: object
    tokens: list[int]
    pos: int
    all_logits: bool = False
    prefill: bool = False


class StepRows(NamedTuple):
    """What a step returns per sequence: logits float32 [rows, n_vocab] on the CPU (rows: len(tokens) with
    all_logits, else 1) and each row's argmax from the fused step (-1 where a logit is NaN or infinite), or None
    where the rows came from the torch forward."""

    logits: torch.Tensor
    argmax: list[int] | None


def check_seqs(seqs: list[SeqStep]) -> None:
    """ValueError for a step the protocol does not define: no tokens, or two parts over one cache (their rows
    would land in one another's positions)."""
    seen = set()
    for s in seqs:
        if not s.tokens:
            raise ValueError("a step's sequence needs at least one token")
        if id(s.kv) in seen:
            raise ValueError("two sequences of one step share a KV cache")
        seen.add(id(s.kv))


def step_one(model, s: SeqStep, max_rows: int) -> StepRows:
    """One sequence's rows, on any backend: a decode token through the fused step (``model.fused_logits``); decode
    rows (up to ``max_rows``) through the fused step's multi-row pass where it has one; else the model's torch
    forward.  The caller has checked that pos + len(tokens) fits the cache."""
    n = len(s.tokens)
    if not s.prefill:
        if n == 1:
            fused = model.fused_logits(s.tokens[0], s.pos, s.kv)
            if fused is not None:
                return StepRows(fused[0].view(1, -1), None if fused[1] is None else [fused[1]])
        else:
            step = model.fused_step(s.kv) if getattr(model, "use_cpp_decode", False) else None
            rows = getattr(step, "rows_with_argmax", None)
            if rows is not None and n <= max_rows:
                s.kv.check_room(s.pos, n)
                logits, top = rows(torch.tensor(s.tokens, dtype=torch.int64), s.pos, s.all_logits)
                return StepRows(logits, list(top))
    s.kv.check_room(s.pos, n)
    with torch.inference_mode():
        logits = model.forward(torch.tensor(s.tokens, dtype=torch.int64), s.pos, s.kv, all_logits=s.all_logits)
    return StepRows(logits.float(), None)


def step_each(model, seqs: list[SeqStep], max_rows: int) -> list[StepRows]:
    """The multi-sequence step as a loop over its sequences (step_one): what a backend without a batched kernel
    runs, and the oracle the batched ones are tested against."""
    check_seqs(seqs)
    return [step_one(model, s, max_rows) for s in seqs]


@runtime_checkable
class Backend(Protocol):
    name: str              # "fast" (CPU kernels), "reference" (float32 torch), "cuda"
    device: torch.device   # where activations, the KV cache and prepared weights live

    def describe(self) -> dict:
        """For LLM.info() and banners: {"backend": name, "device": "cpu"|"cuda", ...} plus what the hardware is
        (CPU: "isa", "threads"; CUDA: "gpu", "capability", "vram_total", "vram_weights")."""

    def prepare_weights(self, weights: dict, progress: bool = False) -> dict:
        """The weights as this backend reads them, called once at load (CPU: the same dict; CUDA: every tensor
        uploaded once in its quantized block form, with a progress bar when ``progress``)."""

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """x float32 [T, K] @ W.T -> float32 [T, N]."""

    def linear_output(self, x: torch.Tensor, w) -> torch.Tensor:
        """linear for the output projection (its error goes straight into the logits: a backend may keep 16-bit
        activations there); same shapes as linear."""

    def embed(self, w, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 [T]) of W [N, K] as float32 [T, K]."""

    # Optional kernels for a forward's other steps (models/decoder.py), each returning None for input it does not
    # take; a backend without one, or returning None, gets the model's torch form:
    #   causal_attention(q [T, H, hd], k [S, Hkv, hd], v, scale, window) -> [T, H*hd]: T new positions'
    #     causal attention over S >= T keys, the last T theirs;
    #   rms_norm(x [..., D], w [D], eps) -> same shape; rope(x [T, H, hd], cos, sin [T, rope_dim/2], style,
    #     rope_dim) -> x rotated (possibly in place); glu(g, u, gelu_tanh) -> act(g) * u (possibly into g).
    #   linear_experts(x [T, K] or [T, k, K], ws [E, N_i, K] stacked experts, ids [T, k]) -> [y_i [T, k, N_i]]:
    #     a mixture-of-experts layer's selected experts (models/decoder.py Decoder.experts).
    #   prefill_exact_rows(model, kv) -> int | None: the fewest rows from which a prompt forward gives each row
    #     the bits any other forward of at least that many rows gives it (models/decoder.py); none: no such claim.

    def make_kv_cache(self, kind: str, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int):
        """A KV cache (pyllm.runtime.kv_cache.KVCache interface) of ``kind`` ("f16", "q8_0", "f16/q4_rot", ...)
        on this backend's device."""

    def fused_decode(self, model, kv) -> DecodeStep | None:
        """A fused one-token step for ``model`` over ``kv``, or None where this backend has none for them (then
        the model's torch forward runs). Built once per (model, cache); the model memoizes it."""

    def step(self, model, seqs: list[SeqStep]) -> list[StepRows]:
        """The multi-sequence step: one StepRows per SeqStep, in order.  Each sequence's rows are what running it
        alone gives, bit for bit where the backend batches rows whose kernels sum each row in one order (the CPU's
        decode_batch): a greedy sequence's tokens never depend on what else runs beside it.  The caller has
        checked the context; a sequence that does not fit its cache raises PyllmError."""


Factory = Callable[..., Backend]
