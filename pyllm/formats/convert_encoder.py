"""Hugging Face embedding encoders (BERT, nomic-bert) -> GGUF, in llama.cpp's convert_hf_to_gguf layout: the
metadata keys and tensor names its bert graph reads, the WordPiece vocabulary in its U+2581 form, and the pooling
a sentence-transformers folder names (modules.json -> 1_Pooling/config.json).  pyllm/formats/convert.py writes the file;
this module says what goes in it.

nomic-bert comes in two spellings, both read here: the original checkpoint (encoder.layers.N.attn.Wqkv,
mlp.fc11/fc12/fc2, norm1/norm2, emb_ln; config n_embd, n_head, n_inner, rotary_emb_base ...) and transformers'
NomicBertModel (layers.N.self_attn.q/k/v_proj, mlp.up/gate/down_proj, post_attention/post_mlp_layernorm; config
hidden_size ...).  Q, K and V are written fused as attn_qkv, as llama.cpp writes them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from ..errors import ConvertError
from ..safe_io import read_json
from ..vocabulary import CONTROL, NORMAL, UNUSED, USER_DEFINED, wordpiece_cased, wordpiece_vocab

ENCODER_TYPES = {"bert": "bert", "nomic_bert": "nomic-bert"}  # config.json model_type -> GGUF architecture
POOLING = {"pooling_mode_mean_tokens": 1, "pooling_mode_cls_token": 2, "pooling_mode_lasttoken": 3}
GELUS = ("gelu", "gelu_new", "gelu_pytorch_tanh")  # BERT's feed-forward: erf GELU (the tanh forms differ < 1e-3)

# HF tensor name -> GGUF name, per architecture (None: not part of an embedding: dropped)
_BERT_NAMES = [
    (r"embeddings\.word_embeddings\.weight", "token_embd.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "token_types.weight"),
    (r"embeddings\.position_embeddings\.weight", "position_embd.weight"),
    (r"embeddings\.LayerNorm\.(weight|bias)", r"token_embd_norm.\1"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)", r"blk.\1.attn_q.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)", r"blk.\1.attn_k.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)", r"blk.\1.attn_v.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)", r"blk.\1.attn_output_norm.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"blk.\1.ffn_up.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"blk.\1.ffn_down.\2"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", r"blk.\1.layer_output_norm.\2"),
    (r"embeddings\.position_ids|pooler\..*|cls\..*", None),  # buffers, the NSP pooler, the masked-LM head
]
_NOMIC_NAMES = [
    (r"embeddings\.word_embeddings\.weight", "token_embd.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "token_types.weight"),
    (r"(?:emb_ln|embeddings\.LayerNorm)\.(weight|bias)", r"token_embd_norm.\1"),
    (r"encoder\.layers\.(\d+)\.attn\.Wqkv\.weight", r"blk.\1.attn_qkv.weight"),
    (r"layers\.(\d+)\.self_attn\.([qkv])_proj\.weight", r"blk.\1.attn_\2.weight"),
    (r"(?:encoder\.layers\.(\d+)\.attn\.out_proj|layers\.(\d+)\.self_attn\.o_proj)\.weight",
     r"blk.\1\2.attn_output.weight"),
    (r"(?:encoder\.layers\.(\d+)\.mlp\.fc11|layers\.(\d+)\.mlp\.up_proj)\.weight", r"blk.\1\2.ffn_up.weight"),
    (r"(?:encoder\.layers\.(\d+)\.mlp\.fc12|layers\.(\d+)\.mlp\.gate_proj)\.weight", r"blk.\1\2.ffn_gate.weight"),
    (r"(?:encoder\.layers\.(\d+)\.mlp\.fc2|layers\.(\d+)\.mlp\.down_proj)\.weight", r"blk.\1\2.ffn_down.weight"),
    (r"(?:encoder\.layers\.(\d+)\.norm1|layers\.(\d+)\.post_attention_layernorm)\.(weight|bias)",
     r"blk.\1\2.attn_output_norm.\3"),
    (r"(?:encoder\.layers\.(\d+)\.norm2|layers\.(\d+)\.post_mlp_layernorm)\.(weight|bias)",
     r"blk.\1\2.layer_output_norm.\3"),
    (r".*rotary_emb\.inv_freq|cls\..*|lm_head\..*|pooler\..*", None),
]
_NAMES = {"bert": [(re.compile(p), r) for p, r in _BERT_NAMES], "nomic-bert": [(re.compile(p), r) for p, r in
                                                                               _NOMIC_NAMES]}


def _int(cfg: dict, keys: tuple[str, ...], source: str, default=None, lo: int = 1) -> int:
    """The first of ``keys`` that config.json has (the two nomic spellings name each value differently)."""
    key = next((k for k in keys if k in cfg), None)
    v = cfg.get(key, default) if key else default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < (1 << 31):
        raise ConvertError(f"{source}: {key or keys[0]} = {v!r} is not an integer in [{lo}, 2**31)")
    return v


def _float(cfg: dict, keys: tuple[str, ...], source: str, default: float) -> float:
    key = next((k for k in keys if k in cfg), None)
    v = cfg.get(key, default) if key else default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConvertError(f"{source}: {key or keys[0]} = {v!r} is not a finite number > 0")
    return float(v)


def encoder_hparams(cfg: dict, arch: str, source: str) -> dict:
    """config.json's hyperparameters, checked, under one spelling; ConvertError naming the first field that is
    missing, malformed, or asks for what the encoder does not compute."""
    hp = dict(n_layer=_int(cfg, ("num_hidden_layers", "n_layer"), source, lo=1),
              n_embd=_int(cfg, ("hidden_size", "n_embd"), source),
              n_head=_int(cfg, ("num_attention_heads", "n_head"), source),
              n_ff=_int(cfg, ("intermediate_size", "n_inner"), source),
              n_ctx=_int(cfg, ("max_position_embeddings", "n_positions"), source, 512 if arch == "bert" else 2048),
              n_types=_int(cfg, ("type_vocab_size",), source, 2),
              eps=_float(cfg, ("layer_norm_eps", "layer_norm_epsilon"), source, 1e-12))
    if hp["n_layer"] > 4096:
        raise ConvertError(f"{source}: num_hidden_layers = {hp['n_layer']} is not an integer in [1, 4096]")
    if hp["n_embd"] % hp["n_head"]:
        raise ConvertError(f"{source}: hidden_size {hp['n_embd']} is not a multiple of num_attention_heads "
                           f"{hp['n_head']}")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != hp["n_embd"] // hp["n_head"]:
        raise ConvertError(f"{source}: head_dim = {head_dim!r} is not hidden_size / num_attention_heads")

    def refuse(key, want):
        if key in cfg and cfg[key] not in want:
            raise ConvertError(f"{source}: {key} = {cfg[key]!r} is not supported for {arch} (supported: "
                               f"{', '.join(map(repr, want))})")

    if arch == "bert":
        refuse("hidden_act", GELUS)
        refuse("position_embedding_type", ("absolute",))
        refuse("is_decoder", (False,))
    else:
        rp = cfg.get("rope_parameters") or {}
        if not isinstance(rp, dict):
            raise ConvertError(f"{source}: rope_parameters = {rp!r} is not an object")
        refuse("hidden_act", ("silu",))
        refuse("activation_function", ("swiglu",))
        refuse("causal", (False,))
        refuse("prenorm", (False,))
        refuse("rotary_emb_fraction", (1, 1.0))
        refuse("rotary_emb_interleaved", (False,))
        refuse("rotary_emb_scale_base", (None,))
        refuse("qkv_proj_bias", (False,))
        refuse("mlp_fc1_bias", (False,))
        refuse("mlp_fc2_bias", (False,))
        if rp.get("rope_type", "default") != "default":
            raise ConvertError(f"{source}: rope_parameters.rope_type = {rp['rope_type']!r} is not supported for "
                               f"{arch} (default)")
        hp["rope_base"] = _float(rp or cfg, ("rope_theta", "rotary_emb_base"), source, 1000.0)
    return hp


def pooling_type(d: Path) -> int | None:
    """llama.cpp's pooling enum from a sentence-transformers folder (modules.json's Pooling module), or None where
    the folder names none (pyllm then mean-pools)."""
    modules = read_json(d / "modules.json", ConvertError, want=list) if (d / "modules.json").exists() else []
    path = next((m.get("path") for m in modules if isinstance(m, dict)
                 and m.get("type") == "sentence_transformers.models.Pooling"), None)
    if path is None:
        return None
    if not isinstance(path, str) or ".." in Path(path).parts or Path(path).is_absolute():
        raise ConvertError(f"{d}/modules.json: the Pooling module's path {path!r} is not a folder of the checkpoint")
    pool = read_json(d / path / "config.json", ConvertError)
    modes = [k for k in POOLING if pool.get(k) is True]
    others = [k for k, v in pool.items() if k.startswith("pooling_mode_") and v is True and k not in POOLING]
    if others or len(modes) != 1:
        raise ConvertError(f"{d}/{path}/config.json: pooling {', '.join(modes + others) or 'none'} is not one of "
                           f"mean, cls, last token")
    return POOLING[modes[0]]


def wordpiece_tokens(d: Path, tj: dict, n_vocab: int) -> tuple[list[str], list[int], dict]:
    """tokenizer.json's WordPiece vocabulary as llama.cpp stores it (a word's first piece "\\u2581piece", a
    continuation without its "##", special tokens as they are), its token types, and the special ids by role."""
    model = tj.get("model") or {}
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(model, dict) or model.get("type") != "WordPiece":
        raise ConvertError(f"{d}/tokenizer.json: an encoder's tokenizer must be WordPiece (model type "
                           f"{model.get('type') if isinstance(model, dict) else model!r})")
    if not (isinstance(vocab, dict) and vocab and all(isinstance(i, int) and not isinstance(i, bool) and
                                                      0 <= i < n_vocab for i in vocab.values())):
        raise ConvertError(f"{d}/tokenizer.json: model.vocab is not a map of token texts to ids below vocab_size "
                           f"{n_vocab}")
    if model.get("continuing_subword_prefix", "##") != "##":
        raise ConvertError(f"{d}/tokenizer.json: continuing_subword_prefix = "
                           f"{model['continuing_subword_prefix']!r} is not '##'")
    added = {a.get("content"): a for a in tj.get("added_tokens") or [] if isinstance(a, dict)}
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [UNUSED] * n_vocab
    for t, i in vocab.items():
        if t in added:
            tokens[i], types[i] = t, CONTROL if added[t].get("special") else USER_DEFINED
        else:
            tokens[i], types[i] = (t[2:], NORMAL) if t.startswith("##") else ("\u2581" + t, NORMAL)
    norm = tj.get("normalizer") or {}
    lowercase = norm.get("lowercase", True) if isinstance(norm, dict) else True
    accents = norm.get("strip_accents") if isinstance(norm, dict) else None
    cased = wordpiece_cased(wordpiece_vocab(tokens, types), types)
    # GGUF records neither: the loader decides from the vocabulary, so the file must agree with it
    if lowercase == cased or (accents is not None and accents != lowercase):
        raise ConvertError(f"{d}/tokenizer.json: normalizer lowercase = {lowercase!r}, strip_accents = {accents!r} "
                           f"with a{' cased' if cased else 'n uncased'} vocabulary: GGUF files do not record "
                           f"lowercasing, which is read from the vocabulary (uncased: lowercase and strip accents)")
    ids = {}
    for role, text in (("cls", "[CLS]"), ("sep", "[SEP]"), ("unk", model.get("unk_token", "[UNK]")),
                       ("pad", "[PAD]"), ("mask", "[MASK]")):
        if text in vocab:
            ids[role] = vocab[text]
    for role in ("cls", "sep", "unk"):
        if role not in ids:
            raise ConvertError(f"{d}/tokenizer.json: the vocabulary has no [{role.upper()}] token")
    return tokens, types, ids


def gguf_tensors(d: Path, arch: str, tensors: dict[str, torch.Tensor], hp: dict) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under their GGUF names, float32, checked against config.json; nomic-bert's Q, K
    and V fused as attn_qkv."""
    out: dict[str, torch.Tensor] = {}
    for hf, t in tensors.items():
        name = re.sub(r"^(?:bert|nomic_bert|model)\.", "", hf)
        for pattern, repl in _NAMES[arch]:
            m = pattern.fullmatch(name)
            if m:
                break
        else:
            raise ConvertError(f"{d}: tensor {hf} has no GGUF name for architecture {arch}")
        if repl is None:
            continue
        out[m.expand(repl)] = t.float()
    n_layer = hp["n_layer"]
    for i in range(n_layer):
        qkv = [out.pop(f"blk.{i}.attn_{x}.weight", None) for x in "qkv"] if arch == "nomic-bert" else []
        if qkv and all(t is not None for t in qkv):
            out[f"blk.{i}.attn_qkv.weight"] = torch.cat(qkv)
    beyond = sorted({int(m.group(1)) for n in out if (m := re.match(r"blk\.(\d+)\.", n)) and int(m.group(1)) >=
                     n_layer})
    if beyond:
        raise ConvertError(f"{d}: the checkpoint has tensors for layer {beyond[0]}, but config.json has "
                           f"{n_layer} layers")
    d_, ff = hp["n_embd"], hp["n_ff"]
    want = {"token_embd_norm.weight": (d_,), "token_types.weight": (hp["n_types"], d_)}
    if arch == "bert":
        want["position_embd.weight"] = (hp["n_ctx"], d_)
    layer = {"attn_output.weight": (d_, d_), "attn_output_norm.weight": (d_,), "ffn_up.weight": (ff, d_),
             "ffn_down.weight": (d_, ff), "layer_output_norm.weight": (d_,)}
    if arch == "bert":
        layer.update({f"attn_{x}.weight": (d_, d_) for x in "qkv"})
    else:
        layer.update({"attn_qkv.weight": (3 * d_, d_), "ffn_gate.weight": (ff, d_)})
    for i in range(n_layer):
        want.update((f"blk.{i}.{n}", s) for n, s in layer.items())
    emb = out.get("token_embd.weight")
    if emb is None or emb.dim() != 2 or emb.shape[1] != d_:
        raise ConvertError(f"{d}: the checkpoint has no token embedding of {d_} columns "
                           f"(embeddings.word_embeddings.weight)")
    for name, shape in want.items():
        t = out.get(name)
        if t is None:
            raise ConvertError(f"{d}: the checkpoint lacks the tensor written as {name}")
        if tuple(t.shape) != shape:
            raise ConvertError(f"{d}: tensor {name} has shape {tuple(t.shape)}, but config.json (hidden_size {d_}, "
                               f"intermediate_size {ff}, max_position_embeddings {hp['n_ctx']}) needs {shape}")
    return list(out.items())


def write_encoder_header(gguf, w, d: Path, cfg: dict, arch: str, tensors: dict, ftype_id: int,
                         name: str) -> list[tuple[str, torch.Tensor]]:
    """Writes the metadata and vocabulary of encoder checkpoint ``d`` into GGUFWriter ``w``; returns the tensors to
    write, GGUF-named."""
    source = f"{d}/config.json"
    hp = encoder_hparams(cfg, arch, source)
    out = gguf_tensors(d, arch, tensors, hp)
    n_vocab = dict(out)["token_embd.weight"].shape[0]
    if not (d / "tokenizer.json").exists():
        raise ConvertError(f"{d}: tokenizer.json is missing (pyllm converts checkpoints with a Hugging Face fast "
                           f"tokenizer file)")
    tokens, types, ids = wordpiece_tokens(d, read_json(d / "tokenizer.json", ConvertError), n_vocab)
    pool = pooling_type(d)
    w.add_name(name)
    w.add_file_type(ftype_id)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(hp["n_ctx"])
    w.add_embedding_length(hp["n_embd"])
    w.add_block_count(hp["n_layer"])
    w.add_feed_forward_length(hp["n_ff"])
    w.add_head_count(hp["n_head"])
    w.add_layer_norm_eps(hp["eps"])
    w.add_causal_attention(False)
    if pool is not None:
        w.add_pooling_type(gguf.PoolingType(pool))
    if "rope_base" in hp:
        w.add_rope_freq_base(hp["rope_base"])
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_type_count(hp["n_types"])
    w.add_bos_token_id(ids["cls"])
    w.add_eos_token_id(ids["sep"])
    w.add_sep_token_id(ids["sep"])
    w.add_unk_token_id(ids["unk"])
    if "pad" in ids:
        w.add_pad_token_id(ids["pad"])
    if "mask" in ids:
        w.add_mask_token_id(ids["mask"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(True)
    return out
