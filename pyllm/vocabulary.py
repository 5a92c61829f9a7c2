"""A GGUF vocabulary read and checked, and the ``tokenizers`` library model built from it.

What the metadata says (``tokenizer.ggml.*``) is checked here with errors naming the key and element; the special
ids, the end-of-generation set and the fill-in-the-middle tokens are found as llama.cpp finds them; and the
tokenizers-library model is built for each vocabulary kind: byte-level BPE with llama.cpp's pre-split regexes,
SentencePiece as score-ranked BPE with byte fallback, WordPiece in BERT's form. pyllm/tokenizer.py wraps the result
with llama.cpp's special-token split and decoding.
"""

from __future__ import annotations

import hashlib
import re
import weakref
from array import array
from types import SimpleNamespace
from typing import Sequence

from pyllm.errors import TokenizerError

# a lone surrogate: bytes that were not UTF-8 kept as surrogate escapes; they have no UTF-8 form
SURROGATE = re.compile("[\ud800-\udfff]")

# GGUF token types (llama.cpp's LLAMA_TOKEN_TYPE_*)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp recognises these by text (llama-vocab.cpp, "maintain a list of tokens that cause end-of-generation")
EOG_TEXTS = frozenset(
    [
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    ]
)
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)
# fill-in-the-middle pad/repo/separator tokens also end generation in llama.cpp
_FIM_EOG_TEXTS = (
    ("tokenizer.ggml.fim_pad_token_id", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    ("tokenizer.ggml.fim_rep_token_id", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    ("tokenizer.ggml.fim_sep_token_id", ("<|file_sep|>",)),
)

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (regexes applied in turn, each isolating its matches; ignore_merges)
_PRE_SPLITS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"), False),
    "gpt-2": ((_GPT2_RE,), False),
    "gpt2": ((_GPT2_RE,), False),  # what pyllm's converter wrote before it used llama.cpp's name
    "mpt": ((_GPT2_RE,), False),
    "olmo": ((_GPT2_RE,), False),
    "jais": ((_GPT2_RE,), False),
    "llama3": ((_LLAMA3_RE,), True),
    "llama-v3": ((_LLAMA3_RE,), True),
    "llama-bpe": ((_LLAMA3_RE,), True),
    "falcon3": ((_LLAMA3_RE,), True),
    "dbrx": ((_LLAMA3_RE,), False),
    "smaug-bpe": ((_LLAMA3_RE,), False),
    "qwen2": ((_QWEN2_RE,), False),
    "deepseek-r1-qwen": ((_QWEN2_RE,), False),
    "stablelm2": ((_QWEN2_RE,), False),
    "smollm": ((r"\p{N}", _GPT2_RE), False),
    "starcoder": ((r"\p{N}", _GPT2_RE), False),
    "refact": ((r"\p{N}", _GPT2_RE), False),
    "codeshell": ((r"\p{N}", _GPT2_RE), False),
    "exaone": ((r"\p{N}", _GPT2_RE), False),
    "minerva-7b": ((r"\p{N}", _GPT2_RE), False),
}

def _field(md: dict, key: str, kind, default=None, required=False):
    value = md.get(key, default)
    if value is None:
        if required:
            raise TokenizerError(f"GGUF metadata lacks {key!r}, needed to build the tokenizer")
        return None
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise TokenizerError(f"GGUF metadata {key} = {value!r} is not an integer")
    if kind is bool and not isinstance(value, (bool, int)):
        raise TokenizerError(f"GGUF metadata {key} = {value!r} is not a boolean")
    if kind is str and not isinstance(value, str):
        raise TokenizerError(f"GGUF metadata {key} = {value!r} is not a string")
    if kind is list and not isinstance(value, (list, tuple)):
        raise TokenizerError(f"GGUF metadata {key} is a {type(value).__name__}, expected an array")
    return bool(value) if kind is bool else value


def _check_items(key: str, values: Sequence, ok, what: str) -> None:
    """TokenizerError naming the first element of array ``key`` that ``ok`` rejects (a file can store any type in
    any array: numbers or nested arrays where strings belong fail later with no hint of where)."""
    if all(map(ok, values)):
        return
    i, v = next((i, v) for i, v in enumerate(values) if not ok(v))
    raise TokenizerError(f"GGUF metadata {key}[{i}] = {_short(v)} ({type(v).__name__}) is not {what}")


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_FIM_TOKENS = {
    "prefix": (("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
               ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                "\u2581<PRE>", "<|code_prefix|>")),
    "suffix": (("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
               ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                "\u2581<SUF>", "<|code_suffix|>")),
    "middle": (("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
               ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                "\u2581<MID>", "<|code_middle|>")),
    "repo": (("tokenizer.ggml.fim_rep_token_id",), _FIM_EOG_TEXTS[1][1]),
    "file_sep": (("tokenizer.ggml.fim_sep_token_id",), _FIM_EOG_TEXTS[2][1]),
}


def fim_ids(md: dict, n: int, index: dict) -> dict[str, int | None]:
    """{"prefix", "suffix", "middle", "repo", "file_sep"} -> token id or None. An id out of range is passed over
    (llama.cpp warns and ignores it), as the end-of-generation FIM keys are."""
    out = {}
    for name, (keys, texts) in _FIM_TOKENS.items():
        ids = [md.get(k) for k in keys]
        found = next((i for i in ids if _is_int(i) and 0 <= i < n), None)
        out[name] = found if found is not None else next((index[t] for t in texts if t in index), None)
    return out


def _eog_ids(md, tokens, types, index, eos_id, eot_id, eom_id):
    """llama.cpp's end-of-generation set, and token types with every EOG-looking token made a control token."""
    types = list(types)
    eog = set()
    for key, texts in _FIM_EOG_TEXTS:
        tid = md.get(key)
        if not (isinstance(tid, int) and 0 <= tid < len(tokens)):
            tid = next((index[t] for t in texts if t in index), None)
        if tid is not None:
            eog.add(tid)
    for t in EOG_TEXTS:
        tid = index.get(t)
        if tid is not None:
            eog.add(tid)
            if types[tid] != CONTROL:
                types[tid] = CONTROL  # llama.cpp overrides the type: "</s>" in a Qwen vocab is special too
    if eot_id is None:
        eot_id = next((index[t] for t in _EOT_TEXTS if t in index), None)
    if eom_id is None:
        eom_id = index.get("<|eom_id|>")
    for tid in (eos_id, eot_id, eom_id):
        if tid is not None:
            eog.add(tid)
    texts = {tokens[i]: i for i in eog}
    # gpt-oss/solar-open: "<|end|>" ends a message, not the generation
    if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                               or ("<|calls|>" in texts and "<|flush|>" in texts)):
        eog.discard(texts["<|end|>"])
        types[texts["<|end|>"]] = USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        types[texts["</s>"]] = NORMAL
    for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        if t in index:
            types[index[t]] = USER_DEFINED
    return eog, types


def read_vocabulary(metadata: dict) -> SimpleNamespace:
    """The vocabulary's metadata, checked (TokenizerError naming the first problem), as Tokenizer.from_gguf needs
    it: no tokenizer is built here."""
    md = metadata
    model = _field(md, "tokenizer.ggml.model", str, required=True)
    tokens = _field(md, "tokenizer.ggml.tokens", list, required=True)
    n = len(tokens)
    if n == 0:
        raise TokenizerError("GGUF metadata tokenizer.ggml.tokens is empty")
    _check_items("tokenizer.ggml.tokens", tokens, lambda t: type(t) is str, "a string")
    if SURROGATE.search("".join(tokens)):
        # the reader keeps bytes that are not UTF-8 as surrogate escapes; the tokenizers library holds only text
        i, t = next((i, t) for i, t in enumerate(tokens) if SURROGATE.search(t))
        raw = t.encode("utf-8", "surrogateescape")
        raise TokenizerError(f"GGUF metadata tokenizer.ggml.tokens[{i}] = {_short(raw)} is not valid UTF-8")
    types = _field(md, "tokenizer.ggml.token_type", list)
    if types is None:
        types = [NORMAL] * n
    elif len(types) != n:
        raise TokenizerError(
            f"GGUF metadata tokenizer.ggml.token_type has {len(types)} entries but tokenizer.ggml.tokens has {n}"
        )
    else:
        _check_items("tokenizer.ggml.token_type", types, _is_int, "an integer")
    types = list(types)

    if model == "gpt2":
        kind, default_bos, default_eos = "bpe", 11, 11
    elif model == "llama":
        kind, default_bos, default_eos = "spm", 1, 2
    elif model == "bert":  # [CLS] text [SEP]: the ids the file names, else the tokens of those texts
        kind = "wpm"
        default_bos, default_eos = next((i for i, t in enumerate(tokens) if t == "[CLS]"), None), \
            next((i for i, t in enumerate(tokens) if t == "[SEP]"), None)
    else:
        raise TokenizerError(
            f"GGUF metadata tokenizer.ggml.model = {model!r} is not supported (supported: 'gpt2', 'llama', 'bert')"
        )

    def special_id(key, default):
        value = _field(md, key, int)
        if value is None:
            return default if default is not None and 0 <= default < n else None
        if not 0 <= value < n:
            raise TokenizerError(f"GGUF metadata {key} = {value} is out of range for a vocabulary of {n} tokens")
        return value

    bos_id = special_id("tokenizer.ggml.bos_token_id", default_bos)
    eos_id = special_id("tokenizer.ggml.eos_token_id", default_eos)
    eot_id = special_id("tokenizer.ggml.eot_token_id", None)
    eom_id = special_id("tokenizer.ggml.eom_token_id", None)
    unk_id = special_id("tokenizer.ggml.unknown_token_id", None)
    if kind == "wpm":  # a WordPiece text ends in the separator, as llama.cpp and BERT's own tokenizer end it
        eos_id = special_id("tokenizer.ggml.seperator_token_id", eos_id)
        for what, tid in (("[CLS] (tokenizer.ggml.bos_token_id)", bos_id), ("[SEP] (tokenizer.ggml.seperator_token_id)",
                                                                              eos_id)):
            if tid is None:
                raise TokenizerError(f"this WordPiece vocabulary has no {what} token")
        if unk_id is None:
            unk_id = next((i for i, t in enumerate(tokens) if t == "[UNK]"), None)
        if unk_id is None:
            raise TokenizerError("this WordPiece vocabulary has no [UNK] token (tokenizer.ggml.unknown_token_id)")
    special_id("tokenizer.ggml.padding_token_id", None)

    # llama.cpp adds BOS for a sentencepiece or llama-3 vocabulary unless the file says otherwise
    pre = _field(md, "tokenizer.ggml.pre", str) or "default"
    bos_default = kind in ("spm", "wpm") or (kind == "bpe" and _PRE_SPLITS.get(pre, (None, False))[1])
    add_bos = _field(md, "tokenizer.ggml.add_bos_token", bool, default=bos_default)
    add_eos = _field(md, "tokenizer.ggml.add_eos_token", bool, default=False)
    if kind == "wpm":
        add_eos = add_bos and _field(md, "tokenizer.ggml.add_sep_token", bool, default=True)
    add_space_prefix = kind == "spm" and _field(md, "tokenizer.ggml.add_space_prefix", bool, default=True)
    if add_bos and bos_id is None:
        raise TokenizerError("GGUF metadata asks to add a BOS token but tokenizer.ggml.bos_token_id is missing")

    index = {t: i for i, t in enumerate(tokens)}
    eog, types = _eog_ids(md, tokens, types, index, eos_id, eot_id, eom_id)

    merges = scores = None
    if kind == "bpe":
        if pre not in _PRE_SPLITS:
            raise TokenizerError(f"GGUF metadata tokenizer.ggml.pre = {pre!r} is not supported (supported: "
                                 f"{', '.join(sorted(_PRE_SPLITS))})")
        merges = []
        for i, m in enumerate(_field(md, "tokenizer.ggml.merges", list, required=True)):
            if not isinstance(m, str):
                raise TokenizerError(f"GGUF metadata tokenizer.ggml.merges[{i}] = {m!r} is not a string")
            cut = m.find(" ", 1)
            if cut < 0:
                raise TokenizerError(f"GGUF metadata tokenizer.ggml.merges[{i}] = {m!r} is not two tokens")
            merges.append((m[:cut], m[cut + 1:]))
    else:
        scores = _field(md, "tokenizer.ggml.scores", list)
        if scores is not None and len(scores) != n:
            raise TokenizerError(
                f"GGUF metadata tokenizer.ggml.scores has {len(scores)} entries but tokenizer.ggml.tokens has {n}"
            )
        if scores is not None:
            _check_items("tokenizer.ggml.scores", scores, lambda v: _is_int(v) or type(v) is float, "a number")
    return SimpleNamespace(kind=kind, tokens=tokens, types=types, bos_id=bos_id, eos_id=eos_id, eog=eog,
                           add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix, index=index,
                           pre=pre, merges=merges, scores=scores, fim=fim_ids(md, n, index), unk_id=unk_id)


def _bpe_backend(index: dict, merges: Sequence[tuple[str, str]], pre: str):
    from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers

    regexes, ignore_merges = _PRE_SPLITS[pre]
    # a merge whose parts or result are missing could never fire in llama.cpp's output either
    pairs = [(a, b) for a, b in merges if a in index and b in index and (a + b) in index]
    model = models.BPE(index, pairs, ignore_merges=ignore_merges)
    tk = HFTokenizer(model)
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return tk


def _spm_backend(tokens: Sequence[str], types: Sequence[int], index: dict, scores):
    """BPE whose merges are ranked by the merged token's score, as llama.cpp's SPM tokenizer merges."""
    from tokenizers import Tokenizer as HFTokenizer, models

    if scores is None:
        scores = [0.0] * len(tokens)
    # highest score merges first; llama.cpp breaks ties by position, which only id order approximates
    order = sorted(
        (i for i, ty in enumerate(types) if ty != BYTE and len(tokens[i]) > 1), key=lambda i: (-scores[i], i)
    )
    pairs = []
    get = index.get
    for i in order:
        t = tokens[i]
        for k in range(1, len(t)):
            a = t[:k]
            if get(a) is not None:
                b = t[k:]
                if get(b) is not None:
                    pairs.append((a, b))
    model = models.BPE(index, pairs, byte_fallback=True)
    return HFTokenizer(model)


def wordpiece_vocab(tokens: Sequence[str], types: Sequence[int]) -> dict[str, int]:
    """The ``##`` form of a vocabulary llama.cpp's converter stored in its U+2581 form: "\u2581word" is a word's
    first piece ("word"), any other normal token a continuation ("##" + token); special tokens keep their text."""
    vocab: dict[str, int] = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (CONTROL, UNKNOWN, USER_DEFINED) or not t:
            word = t
        elif t.startswith("\u2581"):
            word = t[1:]
        else:
            word = "##" + t
        vocab.setdefault(word, i)
    return vocab


def wordpiece_cased(vocab: dict[str, int], types: Sequence[int]) -> bool:
    """Whether a WordPiece vocabulary keeps case.  GGUF does not say whether the text is lowercased first (llama.cpp
    always lowercases); an uncased vocabulary has no upper-case letter in any normal token, and its tokenizer
    lowercases and strips accents (transformers' BertNormalizer: strip_accents follows lowercase)."""
    return any(w != w.lower() for w, i in vocab.items() if types[i] == NORMAL)


def _wpm_backend(tokens: Sequence[str], types: Sequence[int], unk_id: int):
    """BERT's tokenizer over the vocabulary, in the tokenizers library: its normalizer (control characters
    dropped, CJK characters split, lowercasing and accent stripping where uncased), its pre-tokenizer (whitespace
    and punctuation) and WordPiece (greedy longest match, a word past 100 characters or with an unknown piece is
    [UNK])."""
    from tokenizers import Tokenizer as HFTokenizer, models, normalizers, pre_tokenizers

    vocab = wordpiece_vocab(tokens, types)
    uncased = not wordpiece_cased(vocab, types)
    unk = next((w for w, i in vocab.items() if i == unk_id), tokens[unk_id])
    tk = HFTokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tk.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=uncased,
                                               lowercase=uncased)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tk


# Models built in this process, by what they were built from, while something still holds them: a second load of a
# vocabulary that is in use (a model loaded again, a draft model sharing its target's vocabulary) takes the same
# model instead of building it again (Gemma 3's 262k-token SentencePiece vocabulary takes ~2 s, the merges derived
# from it in Python).  The tokenizers model is only read (encode) after it is built, so sharing it is safe.
_BUILT: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _strings_digest(h, strings: Sequence[str]) -> None:
    # each string's length, then their text: no two different lists give the same bytes
    h.update(array("q", map(len, strings)).tobytes())
    h.update("".join(strings).encode("utf-8", "surrogateescape"))


def _numbers_digest(h, values: Sequence, code: str) -> None:
    try:
        h.update(array(code, values).tobytes())
    except OverflowError:  # a checked value past the array's type (a file's u64 token type): its text
        h.update(repr(list(values)).encode())


def vocabulary_key(v: SimpleNamespace) -> bytes:
    """A digest of everything build_backend reads of ``v`` (20-90 ms for the fixtures' vocabularies)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(repr((v.kind, v.pre, v.unk_id, len(v.tokens))).encode())
    _strings_digest(h, v.tokens)
    _numbers_digest(h, v.types, "q")
    if v.scores is not None:
        _numbers_digest(h, v.scores, "d")
    if v.merges is not None:
        _strings_digest(h, [part for pair in v.merges for part in pair])
    return h.digest()


def build_backend(v: SimpleNamespace):
    """The tokenizers-library model for a vocabulary read_vocabulary checked (the one already built for the same
    vocabulary, while it is in use)."""
    key = vocabulary_key(v)
    built = _BUILT.get(key)
    if built is None:
        if v.kind == "bpe":
            built = _bpe_backend(v.index, v.merges, v.pre)
        elif v.kind == "wpm":
            built = _wpm_backend(v.tokens, v.types, v.unk_id)
        else:
            built = _spm_backend(v.tokens, v.types, v.index, v.scores)
        _BUILT[key] = built
    return built
