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
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

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

    def make_kv_cache(self, kind: str, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int):
        """A KV cache (pyllm.runtime.kv_cache.KVCache interface) of ``kind`` ("f16", "q8_0", "f16/q4_rot", ...)
        on this backend's device."""

    def fused_decode(self, model, kv) -> DecodeStep | None:
        """A fused one-token step for ``model`` over ``kv``, or None where this backend has none for them (then
        the model's torch forward runs). Built once per (model, cache); the model memoizes it."""


Factory = Callable[..., Backend]
