"""What every decoder shares: its backend, the weights it prepared, and the per-cache fused decode step.

A model is written once against the backend protocol (pyllm/backends/base.py): activations are float32 on
``backend.device``, every weight goes through ``backend.linear`` / ``backend.embed``, and a one-token forward runs
the backend's fused step where it has one for the cache (CPU: the C++ decode step; CUDA: a captured graph).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, D] f32; w: [D]. Computed in float32 like llama.cpp's ggml_rms_norm."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str, rope_dim: int) -> torch.Tensor:
    """x: [T, H, hd]; cos/sin: [T, rope_dim/2]. Rotates the first rope_dim dims of each head."""
    c, s = cos[:, None, :], sin[:, None, :]
    xr = x[..., :rope_dim]
    if style == "neox":
        half = rope_dim // 2
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    if rope_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rope_dim:]), dim=-1)


class Decoder:
    # False forces the torch path for one-token forwards (tests compare the two; embeddings need hidden states).
    use_cpp_decode = True

    def __init__(self, backend, weights: dict):
        self.backend = backend
        self.w = weights
        self.linear = backend.linear
        self.embed = backend.embed  # (QTensor, ids [T]) -> [T, D] f32: dequantizes only the rows looked up
        self.output_linear = backend.linear_output
        self.device = backend.device
        # kv -> (its key storage when the step was built, the step or None): one per cache, so the server's slots
        # each keep theirs; a cache that reallocates its storage gets a new step.
        self._fused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # The per-row operations of a forward: the backend's kernel where it has one (CPU: the decode step's own row
    # code over T rows, csrc/cpu/decode_step.cpp; its methods return None for input they do not take), else torch.
    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [..., D] with weights w [D]."""
        kernel = getattr(self.backend, "rms_norm", None)
        out = kernel(x, w, eps) if kernel is not None else None
        return out if out is not None else rms_norm(x, w, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str, rope_dim: int) -> torch.Tensor:
        """x [T, H, hd] rotated by cos/sin [T, rope_dim/2] (apply_rope); a kernel may rotate x in place."""
        kernel = getattr(self.backend, "rope", None)
        out = kernel(x, cos, sin, style, rope_dim) if kernel is not None else None
        return out if out is not None else apply_rope(x, cos, sin, style, rope_dim)

    def glu(self, g: torch.Tensor, u: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
        """act(g) * u, act SiLU or the tanh-approximated GELU; a kernel may write it into g."""
        kernel = getattr(self.backend, "glu", None)
        out = kernel(g, u, gelu_tanh) if kernel is not None else None
        if out is None:
            out = (F.gelu(g, approximate="tanh") if gelu_tanh else F.silu(g)) * u
        return out

    # Where each layer runs: one device, except where a placement splits the layers between two backends
    # (backends/split.py, --gpu-layers): its backend says which side a layer or a tensor is on.
    def layer_device(self, i: int) -> torch.device:
        """The device layer ``i`` runs on (``i`` = n_layer: the output head's)."""
        side = getattr(self.backend, "layer_device", None)
        return self.device if side is None else side(i)

    def tensor_device(self, name: str) -> torch.device:
        """The device the layer that owns tensor ``name`` runs on (the embedding and the head: the first layer's
        side)."""
        side = getattr(self.backend, "device_of", None)
        return self.device if side is None else side(name)

    def enter_layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x, the activations entering layer ``i`` (``i`` = n_layer: the output head), on that layer's device; the
        backend then runs the layer's weightless steps (norms, rope, attention) with that side's kernels.  A copy
        only where the device changes: once per boundary."""
        enter = getattr(self.backend, "enter_layer", None)
        return x if enter is None else enter(i, x)

    def experts(self, x: torch.Tensor, ws: list, ids: torch.Tensor) -> list[torch.Tensor]:
        """Stacked expert matrices ws ([E, N_i, K] QTensors) over the experts ``ids`` [T, k] selects: y_i [T, k, N_i],
        y_i[t, j] = W_i[ids[t, j]] @ x[t] (x [T, K]) or @ x[t, j] (x [T, k, K]).  The backend's kernel where it has
        one (CPU: MUL_MAT_ID over the expert slices, csrc/bindings_kernels.cpp), else the selections grouped by
        expert and each used expert's slice (a view of its rows, still quantized) through ``linear`` once."""
        kernel = getattr(self.backend, "linear_experts", None)
        out = kernel(x, ws, ids) if kernel is not None else None
        if out is not None:
            return out
        t, k = ids.shape
        rows = (x if x.dim() == 3 else x[:, None, :].expand(t, k, x.shape[-1])).reshape(t * k, x.shape[-1])
        flat = ids.reshape(-1)
        ys = [x.new_empty(t * k, w.shape[1]) for w in ws]
        for e in torch.unique(flat).tolist():
            sel = (flat == e).nonzero().squeeze(1)
            xe = rows.index_select(0, sel)
            for y, w in zip(ys, ws):
                y[sel] = self.linear(xe, self.expert_slice(w, e))
        return [y.view(t, k, -1) for y in ys]

    def expert_slice(self, w, e: int):
        """Expert ``e`` of a stacked expert tensor w [E, N, K] as a matrix [N, K]: a view of its rows' blocks, made
        once per (tensor, expert) so a backend that caches per weight object (the reference's dequantized copies)
        sees the same object every time."""
        views = self.__dict__.setdefault("_expert_views", {})
        key = (id(w), e)
        if key not in views:
            views[key] = type(w)(w.qtype, tuple(w.shape[1:]), w.data[e], f"{w.name}[{e}]")
        return views[key]

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
                         attention) -> torch.Tensor:
        """Causal attention of T new positions over S >= T keys, the last T theirs: q [T, H, hd], k / v [S, Hkv, hd]
        -> [T, H*hd].  The backend's kernel where it has one (CPU: csrc/cpu/causal_attention.cpp, only the tiles a row
        can see), else ``attention``, the model's torch form (q, k [Hkv, S, hd], v, start_pos, scale, window)."""
        kernel = getattr(self.backend, "causal_attention", None)
        out = kernel(q, k, v, scale, window) if kernel is not None else None
        if out is None:
            out = attention(q, k.transpose(0, 1), v.transpose(0, 1), k.shape[0] - q.shape[0], scale, window)
        return out

    def cache_attention(self, scale: float, window: int, attention):
        """causal_attention in the form a KV cache's ``attend`` calls: (q [T, H, hd], k / v [Hkv, S, hd])."""
        return lambda q, k, v: self.causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), scale, window, attention)

    def attend_at(self, kv, layer: int, q: torch.Tensor, pos: torch.Tensor, scale: float, window: int,
                  attention) -> torch.Tensor:
        """Attention of q [T, H, hd] at device-held positions pos.. (int64 [1]) over the cache's rows up to them,
        reading nothing back to the host: the backend's kernel where it has one (CUDA: csrc/cuda/attention.cu over
        the stored rows), else ``attention`` (the model's torch form) over every row of the cache, masked by
        position."""
        kernel = getattr(self.backend, "attend_at", None)
        out = kernel(kv, layer, q, pos, scale, window) if kernel is not None else None
        if out is None:
            out = kv.attend(layer, q, pos, lambda qq, k, v: attention(qq, k, v, pos, scale, window))
        return out

    def attach_lora(self, terms: dict) -> None:
        """Adds LoRA terms at run time, unmerged: ``terms`` maps a matrix's tensor name to its low-rank term
        (pyllm/lora.py LowRank: a, bt), already checked against the weights.  A matrix's product then gets
        (x @ a.T) @ bt added, the token embedding's rows a[ids] @ bt.  The hook wraps ``linear``,
        ``output_linear`` and ``embed``, so every forward takes it unchanged; the fused steps read ``lora_terms``
        (the CPU's C++ step adds the terms itself, the CUDA step in torch ops)."""
        terms = {name: t.to(self.tensor_device(name)) for name, t in terms.items()}
        self.lora_terms = terms
        self._fused = weakref.WeakKeyDictionary()  # a step built before now would lack the terms
        # by the weight object: the forward passes weights, not names (a tied output is the embedding's object,
        # which gets no term: the embedding's term is a lookup, not a product)
        by_weight = {id(self.w[n]): t for n, t in terms.items() if n != "token_embd.weight"}
        embd, embd_w = terms.get("token_embd.weight"), self.w["token_embd.weight"]
        linear, output_linear, embed = self.linear, self.output_linear, self.embed

        def add_term(base):
            def with_term(x: torch.Tensor, w) -> torch.Tensor:
                y, t = base(x, w), by_weight.get(id(w))
                return y if t is None else y + (x @ t.a.T) @ t.bt
            return with_term

        def embed_with_term(w, ids: torch.Tensor, **kw) -> torch.Tensor:
            y = embed(w, ids, **kw)
            if w is not embd_w or embd is None:
                return y
            return y + embd.a.index_select(0, ids.reshape(-1).to(embd.a.device)) @ embd.bt

        self.linear, self.output_linear = add_term(linear), add_term(output_linear)
        self.embed = embed_with_term

    @staticmethod
    def arrange_weights(cfg, weights: dict) -> dict:
        """The file's tensors as this architecture names them (Phi-3 splits its fused ones); by default as is."""
        return weights

    def small_vectors(self, weights: dict) -> dict[str, torch.Tensor]:
        """Norm weights, biases, rope factors: tiny, so float32 1-D tensors on the device of the layer using them."""
        return {n: t.dequantize().reshape(-1).to(self.tensor_device(n)) for n, t in weights.items()
                if len(t.shape) == 1}

    def fused_step(self, kv):
        """The backend's fused one-token step over ``kv`` (built once per cache), or None where it does not apply
        now: the backend has none for this model or cache, or a centered cache has not fixed its means yet (its
        first steps estimate them in torch)."""
        key = kv.storage_layout()[0].data if hasattr(kv, "storage_layout") else None
        hit = self._fused.get(kv)
        if hit is None or hit[0] is not key:
            hit = (key, self.backend.fused_decode(self, kv))
            self._fused[kv] = hit
        return hit[1] if hit[1] is not None and kv.means_ready() else None

    def prefill_exact_rows(self, kv) -> int | None:
        """The fewest rows from which one prompt forward over ``kv`` gives each row the same bits as any other
        forward of at least that many rows that holds it (the backend's claim, None where it makes none): a prompt
        may then be read in spans of any length without changing a bit of its rows or logits."""
        fn = getattr(self.backend, "prefill_exact_rows", None)
        return fn(self, kv) if fn is not None else None

    def step(self, seqs: list) -> list:
        """The multi-sequence step (backends/base.py SeqStep -> StepRows): each sequence's new tokens against its
        own cache, in one call to the backend, which batches what it can.  What the runtime runs every forward
        through."""
        return self.backend.step(self, seqs)

    def decode_context(self, kv):
        """The CPU backend's DecodeContext for ``kv`` (what ops._C's batched steps take), or None."""
        return getattr(self.fused_step(kv), "ctx", None)

    def fused_logits(self, token: int, pos: int, kv) -> tuple[torch.Tensor, int | None] | None:
        """(logits [n_vocab] f32, their argmax) of one token through the fused step, or None where it does not
        apply (then the torch forward runs).  The argmax is -1 where a logit is NaN or infinite, None where the
        step does not report it.  The generator calls it for each decoded token with the id as an int, outside
        inference mode: right after a step has streamed the weights through the caches every Python-side torch call
        runs cold (torch.tensor([t]) took 100-140 us there against 6 us warm: 2% of a SmolLM2 token)."""
        if not self.use_cpp_decode:
            return None
        step = self.fused_step(kv)
        if step is None:
            return None
        kv.check_room(pos, 1)
        with_argmax = getattr(step, "with_argmax", None)
        return with_argmax(token, pos) if with_argmax is not None else (step(token, pos)[-1], None)

    @staticmethod
    def to_cpu(logits: torch.Tensor) -> torch.Tensor:
        """The runtime samples on the CPU: logits leave the backend's device here, as float32."""
        return logits if logits.device.type == "cpu" else logits.float().cpu()
