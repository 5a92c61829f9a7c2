"""ModelConfig: the numbers a decoder needs, read from GGUF metadata and checked before any tensor is touched."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

from ..errors import ModelError

# llama.cpp's rope type per architecture: "norm" rotates adjacent pairs (x[2i], x[2i+1]) because the converter
# permuted the Q/K rows of llama-arch checkpoints; "neox" rotates the two halves (x[i], x[i + d/2]).
ROPE_STYLE = {
    "llama": "norm",
    "mistral": "norm",
    "granite": "norm",
    "qwen2": "neox",
    "qwen3": "neox",
    "phi3": "neox",
    "gemma3": "neox",
    "nomic-bert": "neox",
    "smollm3": "norm",
    "qwen2moe": "neox",
    "qwen3moe": "neox",
    "gpt-oss": "neox",
}

# Mixture-of-experts architectures and whether their router's top-k weights are renormalised to sum to 1 when the
# file does not say ({arch}.expert_weights_norm): llama.cpp's graphs hard-code it per family (Qwen3-MoE yes, Qwen2-MoE
# no), as their checkpoints' norm_topk_prob defaults do.
# Architectures whose rope may be YaRN-scaled ({arch}.rope.scaling.type = "yarn"): the spec builds its tables
# (models/spec.py YarnSpec); any other architecture's file that says yarn is refused rather than run unscaled.
YARN_ARCHS = ("gpt-oss",)

MOE_NORM_TOP_K = {"qwen2moe": False, "qwen3moe": True, "gpt-oss": False}  # gpt-oss: softmax over the top k (spec.py)


def _show(v) -> str:
    """A metadata value for an error message: type and a bounded repr (a lying file can hold a huge array)."""
    r = repr(v)
    return f"{r[:60]}{'...' if len(r) > 60 else ''} ({type(v).__name__})"


@dataclass
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rope_base: float = 10000.0
    rope_dim: int = 0
    rope_style: str = "norm"
    rms_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_output: bool = False
    sliding_window: int = 0
    extra: dict = field(default_factory=dict)  # architecture-specific values (gemma3: local rope base, pattern, ...)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape (QTensor order: [rows, cols] = [out, in]) each llama-family layer tensor must have, by name
        suffix. Vocabulary-sized tensors are left out (shape_mismatch gives them n_vocab rows)."""
        d, q, kv, ff = self.n_embd, self.n_head * self.head_dim, self.kv_dim, self.n_ff
        return {"attn_norm.weight": (d,), "ffn_norm.weight": (d,), "attn_q.weight": (q, d),
                "attn_k.weight": (kv, d), "attn_v.weight": (kv, d), "attn_output.weight": (d, q),
                "ffn_gate.weight": (ff, d), "ffn_up.weight": (ff, d), "ffn_down.weight": (d, ff),
                "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
                "attn_q_norm.weight": (self.head_dim,), "attn_k_norm.weight": (self.head_dim,),
                "post_attention_norm.weight": (d,), "post_ffw_norm.weight": (d,), "attn_output.bias": (d,),
                "attn_sinks.weight": (self.n_head,), **self.expert_shapes()}

    def active_fraction(self, name: str) -> float:
        """The share of tensor ``name`` one token reads: n_expert_used / n_expert of a stacked expert tensor
        (ffn_*_exps: decode reads only the selected experts' rows), all of any other.  What bench's bytes per token
        and ``pyllm info``'s active parameters count."""
        ex = self.extra
        if ex.get("expert_count") and name.endswith(("_exps.weight", "_exps.bias")):
            return ex["expert_used_count"] / ex["expert_count"]
        return 1.0

    def expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """The mixture-of-experts layer tensors' shapes (none for a dense model): the router [n_expert, n_embd], the
        stacked experts [n_expert, rows, cols] (llama.cpp's ffn_*_exps), the shared expert and its gate."""
        ex = self.extra
        if not ex.get("expert_count"):
            return {}
        d, e, f, fs = self.n_embd, ex["expert_count"], ex["expert_ff"], ex.get("expert_shared_ff", 0)
        return {"ffn_gate_inp.weight": (e, d), "ffn_gate_exps.weight": (e, f, d), "ffn_up_exps.weight": (e, f, d),
                "ffn_down_exps.weight": (e, d, f), "ffn_gate_shexp.weight": (fs, d), "ffn_up_shexp.weight": (fs, d),
                "ffn_down_shexp.weight": (d, fs), "ffn_gate_inp_shexp.weight": (d,), "ffn_gate_inp.bias": (e,),
                "ffn_gate_exps.bias": (e, f), "ffn_up_exps.bias": (e, f), "ffn_down_exps.bias": (e, d)}

    def shape_mismatch(self, weights: dict) -> tuple[str, tuple, tuple] | None:
        """(name, shape, the shape the hyperparameters need) of the first tensor of ``weights`` that contradicts
        them, or None; tensors absent from ``weights`` are not judged. The one rule for every source of weights
        (GGUF metadata, an AWQ folder's config.json), each naming it in its own terms.

        The vocabulary-sized tensors need exactly n_vocab rows, as llama.cpp's loader requires: with fewer, a token
        id past the last row would index out of the table; with more, the logits hold ids that are no token, and
        one sampled ends the reply in an error."""
        d = self.n_embd
        expect = {"token_embd.weight": (self.n_vocab, d), "output.weight": (self.n_vocab, d),
                  "output_norm.weight": (d,), "rope_freqs.weight": (self.rope_dim // 2,)}
        layer = self.layer_shapes()
        for i in range(self.n_layer):
            expect.update((f"blk.{i}.{n}", shape) for n, shape in layer.items())
        for name, shape in expect.items():
            t = weights.get(name)
            if t is not None and tuple(t.shape) != shape:
                return name, tuple(t.shape), shape
        return None

    def check_shapes(self, weights: dict) -> None:
        """ModelError naming the first tensor whose shape disagrees with the metadata's hyperparameters.

        Why: a file is untrusted, and a tensor table that contradicts the header (n_embd, heads, head_dim, n_ff)
        would otherwise load and then fail inside the first forward pass with a torch shape error."""
        bad = self.shape_mismatch(weights)
        if bad is None:
            return
        name, got, want = bad
        if name in ("token_embd.weight", "output.weight") and len(got) == 2 and got[1] == self.n_embd:
            raise ModelError(f"{self.arch} tensor {name!r} has {got[0]} rows but the vocabulary has {self.n_vocab} "
                             f"tokens: every token needs a row, and a row that is no token must not be sampled")
        raise ModelError(f"{self.arch} tensor {name!r} has shape {got}, but the metadata (n_embd "
                         f"{self.n_embd}, heads {self.n_head}/{self.n_kv_head}, head_dim {self.head_dim}, "
                         f"n_ff {self.n_ff}) needs {want}")

    def kv_bytes_per_token(self, bytes_per_elem: float = 2.0) -> int:
        """Bytes the KV cache holds per token: 2 (K and V) x layers x kv heads x head_dim x element size."""
        return int(2 * self.n_layer * self.n_kv_head * self.head_dim * bytes_per_elem)

    # Per-layer tensors a file may have or not (q/k/v biases, q/k norms): the flags are read from layer 0, and the
    # decoders then use every tensor of the group in every layer.
    OPTIONAL_LAYER_TENSORS = {"qkv_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
                              "qk_norm": ("attn_q_norm.weight", "attn_k_norm.weight")}

    @staticmethod
    def _check_optional_layer_tensors(cfg: "ModelConfig", tensor_names: Collection[str], source: str) -> None:
        """ModelError naming the first missing tensor of a group that some layer has: a layer without it would
        fail inside the forward pass (KeyError), and one that has it while layer 0 does not would be ignored."""
        for names in ModelConfig.OPTIONAL_LAYER_TENSORS.values():
            layers = [i for i in range(cfg.n_layer) if any(f"blk.{i}.{n}" in tensor_names for n in names)]
            if not layers:
                continue
            for i in range(cfg.n_layer):
                for n in names:
                    if f"blk.{i}.{n}" not in tensor_names:
                        raise ModelError(f"{source}: tensor blk.{i}.{n} is missing, but blk.{layers[0]} has "
                                         f"{', '.join(names)}: a model has them in every layer or in none")

    @classmethod
    def from_metadata(cls, md: dict, tensor_names: set[str], source: str = "model",
                      supported: Collection[str] | None = None) -> "ModelConfig":
        """``supported``: the architecture names a decoder exists for (pyllm.models.ARCHITECTURES); any other is
        refused before a key is read: another architecture's file lacks the llama family's keys, and "key ... is
        missing" would hide the real reason."""
        arch = md.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelError(f"{source}: metadata has no general.architecture")
        if supported is not None and arch not in supported:
            raise ModelError(f"{source}: unsupported architecture {arch!r} (general.architecture); "
                             f"supported: {', '.join(sorted(supported))}")

        def get(key, default=None, required=False):
            v = md.get(f"{arch}.{key}", default)
            if required and v is None:
                raise ModelError(f"{source}: metadata key {arch}.{key} is missing")
            return v

        # hi: the kernels take these as int32 (a sliding window of 2**31 passed here, then failed every prompt)
        def get_int(key, default=None, required=False, lo=1, hi=(1 << 31) - 1):
            v = get(key, default, required)
            if isinstance(v, list):  # some files store per-layer arrays (e.g. head counts); all equal here
                if not v or len(set(map(repr, v))) != 1:  # repr: elements may be unhashable (nested arrays)
                    raise ModelError(f"{source}: {arch}.{key} varies per layer ({_show(v[:8])}), which is not "
                                     f"supported")
                v = v[0]
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ModelError(f"{source}: {arch}.{key} = {_show(v)} is not an integer in [{lo}, {hi}]")
            return v

        def get_float(key, default, lo=0.0, hi=float("inf"), lo_open=True):
            v = get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                    not (v > lo if lo_open else v >= lo) or not v <= hi:
                want = f"a finite number {'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi < float("inf")
                                                                               else "")
                raise ModelError(f"{source}: {arch}.{key} = {_show(v)} is not {want}")
            return float(v)

        n_embd = get_int("embedding_length", required=True)
        n_head = get_int("attention.head_count", required=True)
        n_kv_head = get_int("attention.head_count_kv", n_head)
        if n_head % n_kv_head:
            raise ModelError(f"{source}: head_count {n_head} is not a multiple of head_count_kv {n_kv_head}")
        if n_embd % n_head and get("attention.key_length") is None:
            raise ModelError(f"{source}: {arch}.embedding_length {n_embd} is not a multiple of {arch}.attention."
                             f"head_count {n_head}, and {arch}.attention.key_length is not given")
        head_dim = get_int("attention.key_length", n_embd // n_head, required=True)
        tokens = md.get("tokenizer.ggml.tokens")
        n_vocab = len(tokens) if isinstance(tokens, list) else get_int("vocab_size", required=True)
        rope_dim = get_int("rope.dimension_count", head_dim)
        if rope_dim > head_dim or rope_dim % 2:
            raise ModelError(f"{source}: rope.dimension_count {rope_dim} does not fit head_dim {head_dim}")
        eps = get_float("attention.layer_norm_rms_epsilon", 1e-5, hi=1.0)
        base = get_float("rope.freq_base", 10000.0)
        if isinstance(tokens, list) and md.get(f"{arch}.vocab_size") is not None:
            declared = get_int("vocab_size")
            if declared < n_vocab:
                raise ModelError(f"{source}: {arch}.vocab_size = {declared} but tokenizer.ggml.tokens has {n_vocab} "
                                 f"tokens")
        cfg = cls(
            arch=arch,
            n_layer=get_int("block_count", required=True, hi=4096),
            n_embd=n_embd,
            n_ff=get_int("feed_forward_length", required=True),
            n_head=n_head,
            n_kv_head=n_kv_head,
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=get_int("context_length", 4096),
            rope_base=float(base),
            rope_dim=rope_dim,
            rope_style=ROPE_STYLE.get(arch, "norm"),
            rms_eps=float(eps),
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            tied_output="output.weight" not in tensor_names,
            sliding_window=get_int("attention.sliding_window", 0, lo=0),
        )
        cls._check_optional_layer_tensors(cfg, tensor_names, source)
        scaling = get("rope.scaling.type")
        factor = get_float("rope.scaling.factor", 1.0)
        yarn_ok = arch in YARN_ARCHS and scaling == "yarn"
        if not isinstance(scaling, (str, type(None))) or scaling not in (None, "none", "linear", "llama3") and \
                not yarn_ok:  # llama3 scaling travels as the rope_freqs tensor
            raise ModelError(f"{source}: {arch}.rope.scaling.type = {scaling!r} is not supported"
                             + (f" (YaRN: only for {', '.join(YARN_ARCHS)})" if scaling == "yarn" else ""))
        if yarn_ok:
            cfg.extra["rope_yarn"] = dict(
                factor=get_float("rope.scaling.factor", 1.0), orig_ctx=get_int("rope.scaling.original_context_length",
                                                                              cfg.n_ctx_train),
                beta_fast=get_float("rope.scaling.yarn_beta_fast", 32.0),
                beta_slow=get_float("rope.scaling.yarn_beta_slow", 1.0))
        if scaling == "linear" and factor != 1.0:
            if arch != "gemma3":
                raise ModelError(f"{source}: linear rope scaling (factor {factor!r}) is not supported for {arch}")
            cfg.extra["rope_scale"] = float(factor)  # gemma3 scales its global layers only
        # encoders (models/encoder.py) say how their LayerNorm, attention mask and pooling differ from a decoder's
        if get("attention.layer_norm_epsilon") is not None:
            cfg.extra["layer_norm_eps"] = get_float("attention.layer_norm_epsilon", 1e-12, hi=1.0)
        if get("pooling_type") is not None:
            cfg.extra["pooling_type"] = get_int("pooling_type", lo=0, hi=4)
        causal = get("attention.causal")
        if causal is not None:
            if not isinstance(causal, bool):
                raise ModelError(f"{source}: {arch}.attention.causal = {_show(causal)} is not true or false")
            cfg.extra["causal"] = causal
        if arch in MOE_NORM_TOP_K:
            n_expert = get_int("expert_count", required=True, hi=1 << 16)
            norm = get("expert_weights_norm", MOE_NORM_TOP_K[arch])
            if not isinstance(norm, bool):
                raise ModelError(f"{source}: {arch}.expert_weights_norm = {_show(norm)} is not true or false")
            shared = "blk.0.ffn_up_shexp.weight" in tensor_names
            cfg.extra.update(expert_count=n_expert, expert_used_count=get_int("expert_used_count", required=True,
                                                                               hi=n_expert),
                             expert_ff=get_int("expert_feed_forward_length", required=True),
                             expert_shared_ff=get_int("expert_shared_feed_forward_length", required=shared)
                             if shared else 0,
                             expert_shared_gate="blk.0.ffn_gate_inp_shexp.weight" in tensor_names,
                             expert_weights_norm=norm)
        if arch == "gemma3":
            # llama.cpp hard-codes these for gemma3 (no metadata keys): local RoPE base 10000, a global layer every
            # 6th, and queries scaled by head_dim**-0.5 except for 27B (62 layers), which uses n_embd / n_head.
            cfg.extra.update(
                rope_local_base=get_float("rope.local_freq_base", 10000.0),
                swa_pattern=6,
                query_pre_attn_scalar=n_embd // n_head if cfg.n_layer == 62 else head_dim,
                final_logit_softcapping=get_float("final_logit_softcapping", 0.0, lo_open=False),
                attn_logit_softcapping=get_float("attn_logit_softcapping", 0.0, lo_open=False),
            )
        return cfg
