"""Embedding encoders of the BERT family (``bert``, ``nomic-bert``): a bidirectional transformer whose hidden states
are pooled into one vector per text (pyllm/embed.py pools and normalises them).

EncoderSpec (encoder_spec.py) describes one, as ArchSpec describes a decoder (models/spec.py): derived from the
file's ModelConfig, validated once, each bad value a ModelError naming its field.  Each difference from a decoder
was checked against transformers' BertModel / NomicBertModel and llama.cpp's bert graph (llm_build_bert), whose GGUF
names these files use:

    x = token_embd[ids] + token_types[0] (+ position_embd[pos]: absolute positions) ; x = LayerNorm(x) (token_embd_norm)
    per layer:  q, k, v = x Wq (+ bq), x Wk (+ bk), x Wv (+ bv)  (or one attn_qkv) ; rotary positions: q, k = rope(q, k)
                x = LayerNorm(x + attention(q, k, v) Wo (+ bo))                     (attn_output_norm)
                m = gelu(x Wup + bup) Wdown + bdown  (bert)  |  (silu(x Wgate) * x Wup) Wdown  (nomic-bert)
                x = LayerNorm(x + m)                                                 (layer_output_norm)

Every token attends to every token (no causal mask, no KV cache: a text is encoded in one pass).  Token types are
all "sentence A" (row 0), as llama.cpp and sentence-transformers embed one text.  BERT's GELU is the exact (erf)
one transformers runs (llama.cpp's ggml_gelu is the tanh approximation; the two differ by < 1e-3 per value).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ModelError
from .config import ModelConfig
from .decoder import apply_rope
from .encoder_spec import EncoderSpec


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


class Encoder:
    """The encoder body over ``weights`` (GGUF names -> QTensors, still quantized), run by ``backend``: every
    matrix goes through ``backend.linear``, the embedding tables through ``backend.embed``."""

    is_encoder = True

    def __init__(self, cfg: ModelConfig, weights: dict, backend, max_pos: int):
        self.check_weights(cfg, weights)
        self.cfg = cfg
        self.spec = spec = EncoderSpec.from_config(cfg)
        self.backend = backend
        self.linear = backend.linear
        self.embed = backend.embed
        self.device = backend.device
        self.w = weights
        self.vec = {n: t.dequantize().reshape(-1).to(self.device) for n, t in weights.items() if len(t.shape) == 1}
        types = weights.get("token_types.weight")
        # every text is "sentence A": one row, added to every position
        self.type_row = None if types is None else self.embed(types, torch.zeros(1, dtype=torch.int64,
                                                                                  device=self.device))
        # BERT's position table has no row past n_pos; rotary positions were trained up to it
        self.max_pos = min(max_pos, spec.n_pos)
        if spec.positions == "rope":
            half = spec.head_dim // 2
            inv = 1.0 / (spec.rope_base ** (torch.arange(0, half, dtype=torch.float64) * 2.0 / spec.head_dim))
            ang = torch.arange(self.max_pos, dtype=torch.float64)[:, None] * inv[None, :]
            self.cos, self.sin = ang.cos().float().to(self.device), ang.sin().float().to(self.device)

    @staticmethod
    def check_weights(cfg: ModelConfig, weights: dict) -> None:
        """ModelError naming the first tensor the encoder needs that the file lacks, or whose shape contradicts
        the metadata."""
        spec = EncoderSpec.from_config(cfg)
        types = weights.get("token_types.weight")
        n_types = types.shape[0] if types is not None and len(types.shape) == 2 else None
        if n_types == 0:
            raise ModelError(f"{cfg.arch} tensor 'token_types.weight' has no rows; every text is of type 0")
        want = spec.tensor_shapes("blk.0.attn_qkv.weight" in weights, n_types)
        for name, shape in want.items():
            t = weights.get(name)
            if t is None:
                raise ModelError(f"{cfg.arch} model is missing tensor {name}")
            if tuple(t.shape) != shape:
                raise ModelError(f"{cfg.arch} tensor {name!r} has shape {tuple(t.shape)}, but the metadata (n_embd "
                                 f"{spec.n_embd}, heads {spec.n_head}, n_ff {spec.n_ff}, context {spec.n_pos}, "
                                 f"vocabulary {spec.n_vocab}) needs {shape}")

    @staticmethod
    def arrange_weights(cfg: ModelConfig, weights: dict) -> dict:
        """The file's tensors as the forward names them: a fused attn_qkv split into attn_q/k/v (zero-copy row
        slices: the weights stay quantized), its bias likewise."""
        from ..formats.quant import QTensor

        if "blk.0.attn_qkv.weight" not in weights:
            return weights
        Encoder.check_weights(cfg, weights)
        w, d = dict(weights), cfg.n_embd
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            for suffix in ("weight", "bias"):
                fused = w.pop(f"{p}attn_qkv.{suffix}", None)
                if fused is None:
                    continue
                per = fused.data.shape[0] // 3  # rows of a matrix; bytes of a vector's data
                for j, x in enumerate("qkv"):
                    name = f"{p}attn_{x}.{suffix}"
                    w[name] = QTensor(fused.qtype, (d, *fused.shape[1:]), fused.data[j * per:(j + 1) * per], name)
        return w

    def project(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = self.linear(x, self.w[name + ".weight"])
        return y + self.vec[name + ".bias"] if self.spec.biases else y

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int64 [T] (T <= max_pos) -> the last layer's hidden states, float32 [T, n_embd]."""
        spec, vec, eps = self.spec, self.vec, self.spec.norm_eps
        t, H, hd = ids.shape[0], spec.n_head, spec.head_dim
        if not 1 <= t <= self.max_pos:
            raise ModelError(f"{spec.arch}: a text of {t} tokens; this encoder takes 1 to {self.max_pos}")
        ids = ids.to(self.device)
        x = self.embed(self.w["token_embd.weight"], ids)
        if self.type_row is not None:
            x = x + self.type_row
        if spec.positions == "absolute":
            x = x + self.embed(self.w["position_embd.weight"], torch.arange(t, device=self.device))
        x = layer_norm(x, vec["token_embd_norm.weight"], vec["token_embd_norm.bias"], eps)
        for i in range(spec.n_layer):
            p = f"blk.{i}."
            q, k, v = (self.project(x, f"{p}attn_{n}").view(t, H, hd) for n in "qkv")
            if spec.positions == "rope":
                q = apply_rope(q, self.cos[:t], self.sin[:t], "neox", hd)
                k = apply_rope(k, self.cos[:t], self.sin[:t], "neox", hd)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               scale=hd ** -0.5)  # no mask: every token sees every token
            a = self.project(a.transpose(0, 1).reshape(t, H * hd), p + "attn_output")
            x = layer_norm(x + a, vec[p + "attn_output_norm.weight"], vec[p + "attn_output_norm.bias"], eps)
            if spec.ffn == "swiglu":
                m = F.silu(self.project(x, p + "ffn_gate")) * self.project(x, p + "ffn_up")
            else:
                m = F.gelu(self.project(x, p + "ffn_up"))
            m = self.project(m, p + "ffn_down")
            x = layer_norm(x + m, vec[p + "layer_output_norm.weight"], vec[p + "layer_output_norm.bias"], eps)
        return x.float().cpu()

    def forward(self, tokens: torch.Tensor, start_pos: int, kv, all_logits: bool = False) -> torch.Tensor:
        """A decoder's forward, which an encoder has not: it has no output head to predict a token with.  Every
        generating path refuses an encoder before it gets here (LLM.check_generates); this keeps any other one
        from ending in an AttributeError."""
        raise ModelError(f"{self.spec.arch} is an embedding encoder: it has no output head to predict tokens with")

    def fused_logits(self, token: int, pos: int, kv) -> None:
        return None  # no fused step: the generator then calls forward, which refuses
