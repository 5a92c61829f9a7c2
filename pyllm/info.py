"""What `pyllm info` prints: a model file described from its header alone (no weights read, no tokenizer built),
and the problems of its vocabulary and chat template found there."""

from __future__ import annotations

from collections import defaultdict

from .runtime.kv_kinds import KV_KINDS, bytes_per_token, check_kind

TOKENIZER_KIND = {"gpt2": "byte-level BPE", "llama": "SentencePiece", "bert": "WordPiece"}


# llama.cpp's llama_ftype (general.file_type): the label a GGUF's quantization goes by (Q4_K_M), which its block
# types alone do not say (Q4_K_M and Q4_K_S hold the same types in different proportions)
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
              26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
              36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE"}
GUESSED = 1024  # llama.cpp's flag: the converter guessed the type


def quantization_label(md: dict) -> str | None:
    """'Q4_K_M' from general.file_type; None when the file does not say (or says a number llama.cpp has not
    named), 'Q4_K_M (guessed)' when the converter guessed it."""
    ft = md.get("general.file_type")
    if type(ft) is not int:
        return None
    label = FILE_TYPES.get(ft & ~GUESSED)
    return None if label is None else label + (" (guessed)" if ft & GUESSED else "")


def model_info(gf, cfg, tokenizer=None, template=None, n_ctx: int | None = None, kv_kind: str = "f16") -> dict:
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    n_params = 0
    for t in gf.tensors.values():
        row = by_type[t.ggml_type.name]
        row[0] += 1
        row[1] += t.nbytes
        n = 1
        for d in t.shape:
            n *= d
        n_params += n
    md = gf.metadata
    tok_model = md.get("tokenizer.ggml.model", "?")
    kv_per_token = bytes_per_token(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, "f16")
    info = {
        "file": str(gf.path),
        "name": md.get("general.name", ""),
        "architecture": cfg.arch,
        "parameters": n_params,
        "quantization": quantization_label(md),
        "file_bytes": gf.path.stat().st_size,
        "tensor_types": {k: {"tensors": v[0], "bytes": v[1]} for k, v in sorted(by_type.items())},
        "context_length": cfg.n_ctx_train,
        "n_layer": cfg.n_layer,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "n_kv_head": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "n_ff": cfg.n_ff,
        "rope": f"{cfg.rope_style}, base {cfg.rope_base:g}",
        "vocab_size": cfg.n_vocab,
        "tokenizer": f"{TOKENIZER_KIND.get(tok_model, tok_model)} ({tok_model}, pre={md.get('tokenizer.ggml.pre', '-')})",
        "chat_template": "yes" if _template_source(md) else "no (plain fallback)",
        "kv_bytes_per_token_f16": int(kv_per_token),
        "kv_bytes_per_token_by_kind": {k: bytes_per_token(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, k)
                                       for k in KV_KINDS if _fits(k, cfg.head_dim)},
    }
    yarn = cfg.extra.get("rope_yarn")
    if yarn:
        info["rope"] += f", YaRN x{yarn['factor']:g} (trained context {yarn['orig_ctx']})"
    embedding = _embedding_info(cfg)
    if embedding is not None:
        info["embedding"] = embedding
        if embedding.get("positions") == "absolute":
            info["rope"] = "none (learned absolute positions)"
    ex = cfg.extra
    if ex.get("expert_count"):
        active = 0
        for name, t in gf.tensors.items():
            n = 1
            for d in t.shape:
                n *= d
            active += int(n * cfg.active_fraction(name))
        info["experts"] = {"count": ex["expert_count"], "used_per_token": ex["expert_used_count"],
                           "feed_forward_length": ex["expert_ff"], "shared_feed_forward_length": ex["expert_shared_ff"],
                           "weights_renormalised": ex["expert_weights_norm"], "active_parameters": active}
    if n_ctx:
        info["n_ctx"] = n_ctx
        info["kv_cache"] = kv_kind
        check_kind(kv_kind, cfg.head_dim)
        info["kv_bytes_per_token"] = bytes_per_token(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, kv_kind)
        info["kv_bytes_total"] = int(info["kv_bytes_per_token"] * n_ctx)
    return info


def _embedding_info(cfg) -> dict | None:
    """For an embedding encoder: how its vectors are made (pooling, dimensions, L2 normalisation, whether a prefix
    may be requested); None for a decoder."""
    from .errors import ModelError
    from .models.encoder_spec import ENCODERS, EncoderSpec

    if cfg.arch not in ENCODERS:
        return None
    try:
        spec = EncoderSpec.from_config(cfg)
    except ModelError as e:
        return {"problem": str(e)}
    return {"pooling": spec.pooling, "dimensions": spec.n_embd, "normalized": spec.normalize,
            "matryoshka": spec.matryoshka, "max_tokens": spec.n_pos, "positions": spec.positions}


def _format_embedding(e: dict) -> str:
    if "problem" in e:
        return e["problem"]
    return (f"{e['dimensions']} dimensions, {e['pooling']} pooling"
            + (", L2-normalised" if e["normalized"] else "") + f", up to {e['max_tokens']} tokens"
            + (f"; Matryoshka: dimensions 1..{e['dimensions']} may be requested" if e["matryoshka"] else ""))


def _template_source(md: dict) -> str | None:
    """The file's chat template as ChatTemplate.from_metadata takes it (anything else gets the fallback)."""
    source = md.get("tokenizer.chat_template")
    return source if isinstance(source, str) and source.strip() else None


def metadata_problems(md: dict) -> list[str]:
    """What keeps the vocabulary or the chat template from working, found from the metadata alone (no weights, no
    tokenizer built): the tokenizer's own checks (pyllm.load would refuse the file), and the file's template
    compiled and rendered for one user message (chat would fail until --plain-template)."""
    from .chat_template import ChatTemplate
    from .errors import TemplateError, TokenizerError
    from .tokenizer import Tokenizer

    problems = []
    try:
        Tokenizer.check_metadata(md)
    except TokenizerError as e:
        problems.append(f"the vocabulary cannot be used: {e}")
    source = _template_source(md)
    if source is not None:
        tokens = md.get("tokenizer.ggml.tokens")

        def text(key):
            i = md.get(key)
            ok = isinstance(tokens, list) and type(i) is int and 0 <= i < len(tokens) and isinstance(tokens[i], str)
            return tokens[i] if ok else ""

        try:
            ChatTemplate(source, text("tokenizer.ggml.bos_token_id"), text("tokenizer.ggml.eos_token_id")).render(
                [{"role": "user", "content": "Hello"}])
        except TemplateError as e:
            problems.append(f"the chat template does not work ({e}); chat needs --plain-template")
    return problems


def _fits(kind: str, head_dim: int) -> bool:
    try:
        check_kind(kind, head_dim)
    except Exception:
        return False
    return True


def format_runtime(rt: dict) -> str:
    """Where a model runs, as one phrase: 'cpu (fast, avx2 kernels)', 'cuda (cuda, NVIDIA H200)', 'cuda+cpu (split,
    avx2 kernels, NVIDIA H200, layers 12-23 on cuda, 0-11 on cpu)'. ``rt`` is a backend's description: "device" and
    "backend", with "isa" (CPU kernels), "gpu" (the GPU's name), "placement" (a split model's layers) and
    "huge_pages" False (the OS gives a CPU backend none)."""
    parts = [str(rt.get("backend", "?"))]
    if rt.get("isa"):
        parts.append(f"{rt['isa']} kernels")
    if rt.get("gpu"):
        parts.append(str(rt["gpu"]))
    if rt.get("placement"):  # a model split between devices (backends/split.py): which layers run where
        parts.append(str(rt["placement"]))
    if rt.get("huge_pages") is False:  # the OS gives none (transparent huge pages "never"): decode runs slower
        parts.append("no huge pages")
    return f"{rt.get('device', '?')} ({', '.join(parts)})"


def _format_experts(ex: dict) -> str:
    shared = f", a shared expert (ff {ex['shared_feed_forward_length']})" if ex["shared_feed_forward_length"] else \
        ", no shared expert"
    return (f"experts:         {ex['count']}, {ex['used_per_token']} used per token (ff {ex['feed_forward_length']})"
            f"{shared}; {ex['active_parameters'] / 1e6:.1f} M parameters active per token")


def format_info(info: dict) -> str:
    def size(b):
        return f"{b / 2**20:.1f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"

    lines = [
        f"file:            {info['file']} ({size(info['file_bytes'])})",
        f"name:            {info['name']}",
        f"architecture:    {info['architecture']}",
        f"parameters:      {info['parameters'] / 1e6:.1f} M",
        f"quantization:    {info.get('quantization') or 'not stated (no general.file_type; see the block types)'}",
        f"layers:          {info['n_layer']} (embd {info['n_embd']}, ff {info['n_ff']}, heads {info['n_head']}, "
        f"kv heads {info['n_kv_head']}, head dim {info['head_dim']})",
        f"rope:            {info['rope']}",
        *([_format_experts(info["experts"])] if "experts" in info else []),
        f"context length:  {info['context_length']} (trained)",
        f"vocabulary:      {info['vocab_size']} tokens, {info['tokenizer']}",
        f"chat template:   {info['chat_template']}",
    ]
    if "embedding" in info:  # an encoder keeps no KV cache
        lines.append(f"embedding model: {_format_embedding(info['embedding'])}")
    else:
        lines.append(f"KV cache:        {info['kv_bytes_per_token_f16'] / 1024:.1f} KiB per token (f16); "
                     + ", ".join(f"{k} {b / 1024:.2f}" for k, b in info["kv_bytes_per_token_by_kind"].items()
                                 if k not in ("f16", "bf16")) + " KiB")
    if "n_ctx" in info and "embedding" not in info:
        lines.append(f"                 {size(info['kv_bytes_total'])} for n_ctx={info['n_ctx']} ({info['kv_cache']})")
    if "runtime" in info:
        lines.append(f"runs on:         {format_runtime(info['runtime'])}")
    lines.append("block types:")
    for name, row in info["tensor_types"].items():
        lines.append(f"  {name:<6} {row['tensors']:>5} tensors  {size(row['bytes']):>12}")
    return "\n".join(lines)
