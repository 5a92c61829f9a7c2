"""A model's layers split between two backends, as llama.cpp's ``-ngl N`` places them (``--gpu-layers N``,
``pyllm.load(gpu_layers=N)``).

    N = 0            every layer on the CPU backend (device "cpu")
    0 < N <= n_layer the last N layers (their weights and their KV cache) on the GPU backend; the first n_layer - N,
                     the token embedding and the output head (final norm + projection) on the CPU backend
    N > n_layer, -1  the whole model on the GPU backend (device "cuda")

``SplitBackend`` is that placement over any two backend objects: the model's one torch forward
(models/transformer.py) asks it, at each layer, to move the activations to the layer's device (``enter_layer``: a
copy only where the device changes, so once per boundary) and runs the layer's matrices on the backend that
prepared them and its norms, rope and attention with that side's kernels.  Nothing in it is CUDA's: on a host
without a GPU the same code runs with the reference backend (or a second fast backend) standing in for the GPU
(PYLLM_GPU_STANDIN, a testing aid), which is how the tests hold it.

Decode rows run fused where both sides have a step over a run of layers (``fused_part``: the CPU's C++ step
today): the CPU side embeds the tokens and runs its layers, the GPU side its layers, the CPU side the output head,
the hidden state crossing each boundary once (SplitDecodeStep).  Each side's step is the whole model's loop over
fewer layers, so with two fast backends the split gives the whole fast model's logits and KV rows bit for bit.
Prompts (and a side without such a step) go through the model's torch forward, each side's matrices through its
own kernels (docs/DESIGN.md, "Layers on two devices").
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch

from ..errors import PyllmError, shorten

STANDIN_VARIABLE = "PYLLM_GPU_STANDIN"
STANDIN_FREE_VARIABLE = "PYLLM_GPU_STANDIN_FREE"
STANDINS = ("reference", "fast")
_SIZE = re.compile(r"(\d+)\s*([kmg]?)(?:i?b)?", re.I)
_LAYER = re.compile(r"blk\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The layer a tensor belongs to ("blk.7.attn_q.weight" -> 7), None for the embedding, the head and others."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


# ---- the choice of N -------------------------------------------------------------------------------------------
def check_gpu_layers(gpu_layers, device: str | None) -> tuple[str, int | None]:
    """(device, gpu_layers) as pyllm.load runs them, or PyllmError naming the bad value.  ``gpu_layers``: None (the
    device decides), -1 (the whole model on the GPU) or a layer count >= 0.  ``device`` None: "cpu", or "cuda" where
    gpu_layers puts layers on the GPU; gpu_layers must agree with a device that is given."""
    import numbers

    if gpu_layers is not None:
        if isinstance(gpu_layers, bool) or not isinstance(gpu_layers, numbers.Integral) or gpu_layers < -1:
            raise PyllmError(f"gpu_layers must be a number of layers >= 0, or -1 for the whole model, got "
                             f"{shorten(repr(gpu_layers))}")
        gpu_layers = int(gpu_layers)
    if gpu_layers == 0:
        if device is not None and device.startswith("cuda"):
            raise PyllmError(f"gpu_layers=0 puts no layer on the GPU but device is {device!r}; drop one of them")
        return "cpu", 0
    if gpu_layers:
        if device == "cpu":
            raise PyllmError(f"gpu_layers={gpu_layers} puts layers on the GPU but device is 'cpu'; drop one of them")
        return device or "cuda", gpu_layers
    return device or "cpu", None


def standin() -> str | None:
    """The backend PYLLM_GPU_STANDIN names to stand in for the GPU ("reference" or "fast"), or None when unset."""
    name = os.environ.get(STANDIN_VARIABLE, "")
    if name and name not in STANDINS:
        raise PyllmError(f"{STANDIN_VARIABLE} must be one of {', '.join(STANDINS)} (or unset), got "
                         f"{shorten(repr(name))}")
    return name or None


def standin_backend(name: str):
    """The CPU backend ``name`` standing in for the GPU: --device auto then places layers on it as on a GPU, with
    standin_free() as its free memory."""
    b = cpu_backend(name)
    b.stands_in_for_gpu = True
    return b


def standin_free() -> int:
    """The stand-in GPU's free memory in bytes: PYLLM_GPU_STANDIN_FREE ("512M", "2G", "2GiB" or a byte count, K/M/G
    binary), else what the host has available; PyllmError naming a value that is none of those."""
    text = os.environ.get(STANDIN_FREE_VARIABLE, "").strip()
    if not text:
        from .cpu import available_memory

        return available_memory() or 0
    m = _SIZE.fullmatch(text)
    if not m:
        raise PyllmError(f"{STANDIN_FREE_VARIABLE} must be a size such as 512M, 2G or a byte count, got "
                         f"{shorten(repr(text))}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def gpu_problem(device: str = "cuda") -> str | None:
    """Why no layer can go to a GPU here, in one line, or None where one can (or a stand-in is set).  Cheap: what
    torch sees; the CUDA backend's own start may still fail later, naming its reason."""
    if standin():
        return None
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return "torch sees no GPU (torch.cuda.is_available() is False)"
    return None


def cpu_backend(kernels: str, n_threads: int | None = None):
    """A CPU backend of ``kernels`` ("fast" or "reference")."""
    if kernels == "fast":
        from .cpu import CpuBackend

        return CpuBackend(n_threads=n_threads)
    from .reference import ReferenceBackend

    return ReferenceBackend()


def gpu_headroom(free: int) -> int:
    """What a GPU with ``free`` bytes free keeps free beyond the weights and the KV cache, for activations and a
    prefill's dequantized layer: 1/16 of it, at least 256 MiB."""
    return max(256 << 20, free // 16)


def fit_gpu_layers(free: int, layer_bytes: list[int], other_bytes: int, kv_layer_bytes: int) -> int:
    """The largest -ngl N that fits in ``free`` bytes of GPU memory less gpu_headroom: n_layer + 1 (the whole model)
    where every tensor and the whole KV cache fit, else the most trailing layers whose weights (``layer_bytes``,
    per layer) and cache (``kv_layer_bytes`` a layer at the requested context) fit, 0 when not even the last one
    does.  ``other_bytes``: the tensors outside the layers (embedding, output head), on the GPU only with the whole
    model."""
    room = free - gpu_headroom(free)
    n = len(layer_bytes)
    if sum(layer_bytes) + other_bytes + n * kv_layer_bytes <= room:
        return n + 1
    used = fitted = 0
    for size in reversed(layer_bytes):
        if used + size + kv_layer_bytes > room:
            break
        used += size + kv_layer_bytes
        fitted += 1
    return fitted


def model_bytes(weights: dict, n_layer: int) -> tuple[list[int], int]:
    """(bytes of each layer's tensors, bytes of the others), each tensor object counted once (a tied output is the
    embedding)."""
    layers, other, seen = [0] * n_layer, 0, set()
    for name, w in weights.items():
        if id(w) in seen:
            continue
        seen.add(id(w))
        i = layer_of(name)
        if i is not None and i < n_layer:
            layers[i] += int(w.nbytes)
        else:
            other += int(w.nbytes)
    return layers, other


def place(backend, cfg, weights: dict, *, device: str, kernels: str, n_threads: int | None, gpu_layers: int | None,
          n_ctx: int, kv_cache: str, quiet: bool = True):
    """The backend that runs the model of ``cfg`` / ``weights`` once its layer count is known: ``backend`` (what
    backends.select returned: the CPU's, the GPU's, or the GPU side of a placement) itself, or a SplitBackend of
    the CPU kernels ``kernels`` and it.  With device "auto", no gpu_layers and a model whose weights and KV cache at
    ``n_ctx`` do not fit in the GPU's free memory, the largest N that does (fit_gpu_layers), said on stderr unless
    ``quiet``."""
    n_layer = cfg.n_layer
    n = gpu_layers
    if n is None:
        stand_in = getattr(backend, "stands_in_for_gpu", False)
        if device != "auto" or (backend.name != "cuda" and not stand_in):
            return backend
        from ..runtime.kv_cache import KVCache, check_kind

        check_kind(kv_cache, cfg.head_dim)
        kv_layer = int(KVCache.bytes_per_token(1, cfg.n_kv_head, cfg.head_dim, kv_cache) * (n_ctx or cfg.n_ctx_train))
        layer_bytes, other = model_bytes(weights, n_layer)
        free = standin_free() if stand_in else torch.cuda.mem_get_info(backend.device)[0]
        n = fit_gpu_layers(free, layer_bytes, other, kv_layer)
        if n > n_layer:
            return backend
        if not quiet:
            need = sum(layer_bytes) + other + n_layer * kv_layer
            gpu = f"cpu ({backend.name}, standing in for the GPU)" if stand_in else "cuda"
            where = "every layer on the CPU" if n == 0 else placement_phrase(n_layer, n, gpu, "cpu")
            print(f"pyllm: the model and its KV cache need {need / 2**30:.2f} GiB but the GPU has {free / 2**30:.2f} "
                  f"GiB free: {where} (--gpu-layers {n}; --gpu-layers chooses another split)", file=sys.stderr)
        if n == 0:
            return cpu_backend(kernels, n_threads)
    if n == 0 or n < 0 or n > n_layer:  # the CPU alone, or the whole model on the GPU side
        return backend
    return SplitBackend(cpu_backend(kernels, n_threads), backend, n_layer, n)


def _span(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}-{b}"


def placement_phrase(n_layer: int, n_high: int, high: str, low: str) -> str:
    """'layers 12-23 on cuda, 0-11 on cpu' (the output head goes with the first layers' side)."""
    first = n_layer - n_high
    rest = f"{_span(0, first - 1)} on {low}" if first else f"the output on {low}"
    return f"{'layer' if n_high == 1 else 'layers'} {_span(first, n_layer - 1)} on {high}, {rest}"


# ---- the split backend ------------------------------------------------------------------------------------------
class SplitBackend:
    """Layers [n_layer - n_high, n_layer) on ``high`` (the GPU's backend, or its stand-in), the others, the token
    embedding and the output head on ``low`` (the CPU's).  The backend protocol (base.py) over the two: each
    matrix goes to the backend that prepared it; the weightless steps (norms, rope, GLU, attention) to the side of
    the layer the forward last entered (``enter_layer``), so a model's forwards must not interleave (an LLM's lock
    serializes them); the KV cache is a SplitKVCache, each layer's rows on its side."""

    name = "split"

    def __init__(self, low, high, n_layer: int, n_high: int):
        if not 0 < n_high <= n_layer:
            raise ValueError(f"a split puts 1..{n_layer} layers on its second backend, not {n_high}")
        self.low, self.high = low, high
        self.n_layer, self.n_high = n_layer, n_high
        self.first_high = n_layer - n_high
        self.device = low.device  # where the tokens are embedded and the logits come from
        self._owner: dict[int, tuple[object, object]] = {}  # id(prepared weight) -> (it, its backend)
        self._active = low

    def side(self, i: int):
        """The backend that runs layer ``i`` (``i`` = n_layer: the output head)."""
        return self.high if self.first_high <= i < self.n_layer else self.low

    def layer_device(self, i: int) -> torch.device:
        return self.side(i).device

    def side_of(self, name: str):
        i = layer_of(name)
        return self.low if i is None else self.side(i)

    def device_of(self, name: str) -> torch.device:
        return self.side_of(name).device

    def placement(self) -> str:
        hi, lo = self.high.device.type, self.low.device.type
        if hi == lo:  # stand-ins: name the kernels
            hi, lo = f"{hi} ({self.high.name})", f"{lo} ({self.low.name})"
        return placement_phrase(self.n_layer, self.n_high, hi, lo)

    def describe(self) -> dict:
        high, low = self.high.describe(), self.low.describe()
        out = {"backend": self.name, "device": f"{high.get('device', '?')}+{low.get('device', '?')}",
               "placement": self.placement(), "gpu_layers": self.n_high, "high": high, "low": low}
        for key in ("isa", "threads"):  # the CPU side's, as format_runtime shows them
            if key in low:
                out[key] = low[key]
        if "gpu" in high:
            out["gpu"] = high["gpu"]
        return out

    def prepare_weights(self, weights: dict, progress: bool = False) -> dict:
        """Each side prepares its own tensors (the GPU's: uploaded); the dict keeps the file's order."""
        low = {n: w for n, w in weights.items() if self.side_of(n) is self.low}
        high = {n: w for n, w in weights.items() if self.side_of(n) is self.high}
        prepared = {}
        for backend, part in ((self.low, low), (self.high, high)):
            for name, w in backend.prepare_weights(part, progress=progress).items():
                prepared[name] = w
                self._owner[id(w)] = (w, backend)
        return {n: prepared[n] for n in weights}

    def _backend_of(self, w):
        hit = self._owner.get(id(w))
        return self._active if hit is None else hit[1]

    def enter_layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x moved to layer ``i``'s device (``i`` = n_layer: the head's), whose side then runs the weightless steps."""
        self._active = self.side(i)
        return x if x.device == self._active.device else x.to(self._active.device)

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        return self._backend_of(w).linear(x, w)

    def linear_output(self, x: torch.Tensor, w) -> torch.Tensor:
        return self._backend_of(w).linear_output(x, w)

    def embed(self, w, ids: torch.Tensor, **kw) -> torch.Tensor:
        self._active = self.low
        return self._backend_of(w).embed(w, ids, **kw)

    # the optional kernels (base.py): the active side's, None where it has none (the model's torch form runs)
    def _kernel(self, name: str):
        return getattr(self._active, name, None)

    def causal_attention(self, q, k, v, scale: float, window: int):
        kernel = self._kernel("causal_attention")
        return None if kernel is None else kernel(q, k, v, scale, window)

    def rms_norm(self, x, w, eps: float):
        kernel = self._kernel("rms_norm")
        return None if kernel is None else kernel(x, w, eps)

    def rope(self, x, cos, sin, style: str, rope_dim: int):
        kernel = self._kernel("rope")
        return None if kernel is None else kernel(x, cos, sin, style, rope_dim)

    def glu(self, g, u, gelu_tanh: bool):
        kernel = self._kernel("glu")
        return None if kernel is None else kernel(g, u, gelu_tanh)

    def make_kv_cache(self, kind: str, n_layer: int, n_kv_head: int, max_seq: int, head_dim: int):
        if n_layer != self.n_layer:
            raise PyllmError(f"this split places {self.n_layer} layers; a cache of {n_layer} does not fit it")
        low = (self.low.make_kv_cache(kind, self.first_high, n_kv_head, max_seq, head_dim) if self.first_high
               else None)
        return SplitKVCache(low, self.high.make_kv_cache(kind, self.n_high, n_kv_head, max_seq, head_dim))

    def fused_decode(self, model, kv) -> "SplitDecodeStep | None":
        """Each side's step over its layers (``fused_part``) chained, or None where a side has none for them (the
        reference backend; then the torch forward runs)."""
        if not isinstance(kv, SplitKVCache):
            return None
        parts = []
        for side, cache, layers, ends in ((self.low, kv.low, range(self.first_high), True),
                                          (self.high, kv.high, range(self.first_high, self.n_layer), False)):
            part = getattr(side, "fused_part", None)
            step = None if part is None else part(model, cache, layers, ends, max_seq=kv.max_seq)
            if step is None:
                return None
            parts.append(step)
        return SplitDecodeStep(*parts)

    def step(self, model, seqs: list):
        """The multi-sequence step (base.py): the single decode tokens of several sequences whose split steps batch
        (both sides CPU steps) in one pass per side, up to GEMV_MAX_M rows, each row bit for bit its sequence's
        one-token step; other decode rows through their sequence's fused step, prompts through the forward."""
        from .. import ops
        from .base import StepRows, check_seqs, step_one

        check_seqs(seqs)
        out = [None] * len(seqs)
        if len(seqs) > 1 and model.use_cpp_decode:
            steps = {i: model.fused_step(s.kv) for i, s in enumerate(seqs) if len(s.tokens) == 1 and not s.prefill}
            group = [i for i, st in steps.items() if isinstance(st, SplitDecodeStep) and st.batches]
            for start in range(0, len(group), ops.GEMV_MAX_M):
                rows = group[start:start + ops.GEMV_MAX_M]
                if len(rows) < 2:
                    continue
                for i in rows:
                    seqs[i].kv.check_room(seqs[i].pos, 1)
                logits, tops = SplitDecodeStep.batch([steps[i] for i in rows], [seqs[i].tokens[0] for i in rows],
                                                     [seqs[i].pos for i in rows])
                for r, (i, top) in enumerate(zip(rows, tops)):
                    out[i] = StepRows(logits[r:r + 1], [top])
        return [o if o is not None else step_one(model, s, ops.GEMV_MAX_M) for o, s in zip(out, seqs)]


class SplitDecodeStep:
    """A split model's fused decode rows (base.py DecodeStep, with ``rows``): the low side's step embeds the tokens
    and runs layers [0, first_high), the high side's the rest, the low side's head turns the hidden state into
    logits; each side's ``hidden`` / ``head`` take and return CPU tensors, so the hidden state crosses each boundary
    once per pass.  ``rows_exact`` where both sides' are."""

    def __init__(self, low, high):
        self.low, self.high = low, high
        self.n_vocab = low.n_vocab
        self.rows_exact = bool(getattr(low, "rows_exact", False) and getattr(high, "rows_exact", False))
        self.batches = hasattr(low, "batch") and hasattr(high, "batch")  # several sequences' rows in one pass

    @staticmethod
    def batch(steps: list["SplitDecodeStep"], tokens: list[int], positions: list[int]
              ) -> tuple[torch.Tensor, list[int]]:
        """(logits [B, n_vocab], each row's argmax) of tokens[b] at positions[b] through steps[b] (steps of one
        model over caches of their own, ``batches``): one pass per side, as the whole model's decode_batch."""
        lows, highs = [s.low for s in steps], [s.high for s in steps]
        x, _ = lows[0].batch(lows, torch.tensor(tokens, dtype=torch.int64), positions, False)
        x, _ = highs[0].batch(highs, x, positions, False)
        return lows[0].batch(lows, x, positions, True)

    def rows_with_argmax(self, tokens: torch.Tensor, pos: int, all_logits: bool = True
                         ) -> tuple[torch.Tensor, list[int]]:
        x = self.high.hidden(self.low.hidden(tokens, pos), pos)
        return self.low.head(x, pos, all_logits)

    def rows(self, tokens: torch.Tensor, pos: int, all_logits: bool = True) -> torch.Tensor:
        return self.rows_with_argmax(tokens, pos, all_logits)[0]

    def with_argmax(self, token: int, pos: int) -> tuple[torch.Tensor, int]:
        logits, top = self.rows_with_argmax(torch.tensor([token], dtype=torch.int64), pos)
        return logits[0], top[0]

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        return self.with_argmax(token, pos)[0].view(1, -1)


class SplitKVCache:
    """A KV cache (runtime/kv_cache.py KVCache's interface) whose layers live on two devices: the model's layers
    [0, first_high) are ``low``'s (a cache of that many layers, None where there are none), the rest ``high``'s,
    layer i there being i - first_high."""

    def __init__(self, low, high):
        self.low, self.high = low, high
        self.first_high = 0 if low is None else low.n_layer
        self.sides = tuple(c for c in (low, high) if c is not None)
        self.kind, self.k_kind, self.v_kind = high.kind, high.k_kind, high.v_kind
        self.n_layer = self.first_high + high.n_layer
        self.n_kv_head, self.max_seq, self.head_dim = high.n_kv_head, high.max_seq, high.head_dim
        self.dtype = high.dtype
        self.centered = high.centered

    def _at(self, layer: int):
        """(the cache holding model layer ``layer``, its index there)."""
        if layer >= self.first_high:
            return self.high, layer - self.first_high
        return self.low, layer

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.sides)

    def check_room(self, pos: int, t: int) -> None:
        self.high.check_room(pos, t)

    def means_ready(self) -> bool:
        return all(c.means_ready() for c in self.sides)

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None) -> None:
        cache, i = self._at(layer)
        cache.update(i, pos, k, v, q=q)

    def view(self, layer: int, upto: int, dtype: torch.dtype = torch.float32):
        cache, i = self._at(layer)
        return cache.view(i, upto, dtype)

    def attend(self, layer: int, q: torch.Tensor, start_pos: int, attn) -> torch.Tensor:
        cache, i = self._at(layer)
        return cache.attend(i, q, start_pos, attn)

    # ---- prefix state (server slots, the prompt cache): each side's, under "low." / "high." --------------------
    def state_layout(self) -> str:
        return json.dumps({"low": None if self.low is None else self.low.state_layout(),
                           "high": self.high.state_layout()})

    def _named(self):
        return [(p, c) for p, c in (("low.", self.low), ("high.", self.high)) if c is not None]

    def prefix_state(self, n: int) -> dict[str, torch.Tensor]:
        return {p + name: t for p, c in self._named() for name, t in c.prefix_state(n).items()}

    def load_prefix_state(self, state: dict[str, torch.Tensor], n: int) -> None:
        """Each side's rows from ``state`` (prefix_state of a split cache of the same layout).  ValueError as
        KVCache's; a side checked after the other was written leaves the rows partly loaded (the server's slot
        then forgets its tokens, as it does for any refused state)."""
        for p, c in self._named():
            c.load_prefix_state({name[len(p):]: t for name, t in state.items() if name.startswith(p)}, n)

    def copy_prefix_from(self, src: "SplitKVCache", n: int) -> None:
        for (_, c), (_, s) in zip(self._named(), src._named()):
            c.copy_prefix_from(s, n)
