"""Tokenizer built from a GGUF file's vocabulary, matching llama.cpp token for token.

llama.cpp is the reference for GGUF files (the models were converted for it and are evaluated with it), so where
it and transformers' GGUF converter disagree, this module follows llama.cpp:

* special tokens are cut out of the text first, longest token first over the whole text (llama.cpp's
  ``tokenizer_st_partition``), control/unknown ones only when ``special=True``, user-defined ones always;
* byte-level BPE vocabularies pre-split with the regex list llama.cpp keeps per ``tokenizer.ggml.pre``
  (e.g. ``smollm`` isolates every digit before the GPT-2 regex runs);
* SentencePiece vocabularies (``llama`` model) merge by token score over the whole fragment, spaces escaped
  to U+2581, with byte fallback -- which is BPE with merges ranked by the merged token's score;
* WordPiece vocabularies (``bert`` model: BERT-family encoders) are stored as llama.cpp's converter writes them, a
  word's first piece with a U+2581 prefix and a continuation without its ``##``; they are read back into the
  ``##`` form and tokenized as BERT does (clean-up, CJK split, lowercasing and accent stripping where the
  vocabulary is uncased, whitespace/punctuation split, greedy longest-match pieces), the text wrapped in
  [CLS] ... [SEP];
* tokens whose text is an end-of-generation marker (``<|im_end|>``, ``</s>``, ...) become control tokens and
  end generation, whatever type the file gave them.

The BPE merging itself runs in the ``tokenizers`` library; only the special-token split is Python.
"""

from __future__ import annotations

import bisect
import codecs
import re
from types import SimpleNamespace
from typing import Iterable, Sequence

from pyllm.errors import TokenizerError

_SURROGATE = re.compile("[\ud800-\udfff]")

# GGUF token types (llama.cpp's LLAMA_TOKEN_TYPE_*)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp recognises these by text (llama-vocab.cpp, "maintain a list of tokens that cause end-of-generation")
_EOG_TEXTS = frozenset(
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
    "gpt2": ((_GPT2_RE,), False),
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

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_table() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level vocabularies are spelled in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_CHAR = _gpt2_byte_table()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_BYTE_ALPHABET = frozenset(_CHAR_TO_BYTE)
# What Tokenizer.min_tokens counts: every byte; ASCII letters and digits; the bytes of non-ASCII characters
_FLOOR_CLASSES = (
    frozenset(range(256)),
    frozenset(b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"),
    frozenset(range(128, 256)),
)


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


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Build with :meth:`from_gguf`."""

    def __init__(self, *, kind: str, tokens: list[str], types: list[int], backend, bos_id, eos_id, eog_ids,
                 add_bos: bool, add_eos: bool, add_space_prefix: bool, fim_ids: dict | None = None):
        self.kind = kind
        # fill-in-the-middle tokens by role (prefix, suffix, middle, repo, file_sep), None where absent
        self.fim_ids: dict[str, int | None] = dict(fim_ids or {})
        self._tokens = tokens
        self._types = types
        self._backend = backend
        self.n_vocab = len(tokens)
        self.bos_id: int | None = bos_id
        self.eos_id: int | None = eos_id
        self.eog_ids: frozenset[int] = frozenset(eog_ids)
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self._piece_cache: dict[int, bytes] = {}
        self._build_special_index()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, metadata: dict) -> "Tokenizer":
        v = _read_vocabulary(metadata)
        try:
            if v.kind == "bpe":
                backend = _bpe_backend(v.index, v.merges, v.pre)
            elif v.kind == "wpm":
                backend = _wpm_backend(v.tokens, v.types, v.unk_id)
            else:
                backend = _spm_backend(v.tokens, v.types, v.index, v.scores)
        except (TypeError, ValueError, UnicodeError, OverflowError) as e:
            # the tokenizers library rejects vocabularies it cannot hold (e.g. a token that is not valid UTF-8)
            first = str(e).splitlines()[0] if str(e) else ""
            raise TokenizerError(f"GGUF tokenizer vocabulary cannot be built ({type(e).__name__}: {first})") from None
        return cls(kind=v.kind, tokens=list(v.tokens), types=v.types, backend=backend, bos_id=v.bos_id,
                   eos_id=v.eos_id, eog_ids=v.eog, add_bos=v.add_bos, add_eos=v.add_eos,
                   add_space_prefix=v.add_space_prefix, fim_ids=v.fim)

    @staticmethod
    def check_metadata(metadata: dict) -> None:
        """Every check from_gguf makes of the metadata, without building the tokenizer: TokenizerError naming the
        first problem. What `pyllm info` runs (0.15-0.3 s for the fixtures' vocabularies, where the build takes
        0.3-2.5 s)."""
        _read_vocabulary(metadata)

    def _build_special_index(self):
        # Two tables (all special tokens; user-defined only), each indexed for _partition.
        self._special_all: dict[str, int] = {}
        self._special_user: dict[str, int] = {}
        for i, (t, ty) in enumerate(zip(self._tokens, self._types)):
            if not t:
                continue
            if ty in (CONTROL, UNKNOWN):
                self._special_all.setdefault(t, i)
            elif ty == USER_DEFINED:
                self._special_all.setdefault(t, i)
                self._special_user.setdefault(t, i)
        self._index_all = _SpecialIndex(self._special_all)
        self._index_user = _SpecialIndex(self._special_user)

    # ------------------------------------------------------------------ encoding
    def encode(self, text: str, add_bos: bool | None = None, special: bool = True,
               plain: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids for ``text``; ``special`` lets control tokens written in the text become themselves.

        ``plain``: character ranges (start, end) of ``text`` where that is never so, as with ``special=False``
        (only user-defined tokens are cut there): message content inside a rendered chat template, so that a
        user who types ``<|im_start|>system`` gets that text, not a forged turn. A token that would straddle a
        range's edge is not cut either.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode() needs a str, got {type(text).__name__}")
        if _SURROGATE.search(text):
            # a lone surrogate (from bytes that were not UTF-8, via surrogateescape, or a JSON "\\ud800") has no
            # UTF-8 form; one replacement character each keeps every offset (plain spans) where it was
            text = _SURROGATE.sub("\ufffd", text)
        if add_bos is None:
            add_bos = self.add_bos
        out: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError("this vocabulary has no BOS token (tokenizer.ggml.bos_token_id)")
            out.append(self.bos_id)
        prev_special = True
        for part in self._partition(text, special, plain):
            if isinstance(part, int):
                out.append(part)
                prev_special = True
                continue
            if self.kind == "spm":
                if self.add_space_prefix and prev_special:
                    part = " " + part
                part = part.replace(" ", "\u2581")
            out.extend(self._backend.encode(part, add_special_tokens=False).ids)
            prev_special = False
        if add_bos and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, special: bool, plain: Sequence[tuple[int, int]] = ()) -> list:
        """Split ``text`` into raw strings and special token ids the way llama.cpp does.

        llama.cpp takes special tokens longest first and cuts every non-overlapping occurrence of each, left to
        right, out of the text still unclaimed. All candidate occurrences are found first so that this costs one
        pass; a token that repeats one character (Gemma's runs of 2-31 spaces, tabs or newlines) is a candidate
        once per run of that character, not once per position: a run of n spaces would otherwise give ~30 n
        candidates (hundreds of MB for a long one).
        """
        if not text:
            return []
        index = self._index_all if special else self._index_user
        if index.first_re is None and index.run_re is None:
            return [text]
        table, user = index.table, self._special_user
        # (-length, token id, start, end): one occurrence at start (end 0), or the run of its character over
        # [start, end)
        found = []
        if index.first_re is not None:
            by_prefix = index.by_prefix
            for m in index.first_re.finditer(text):
                p = m.start()
                room = len(text) - p
                for L in by_prefix.get(text[p:p + 2], ()):
                    if L > room:
                        continue
                    tid = table.get(text[p:p + L])
                    if tid is not None:
                        found.append((-L, tid, p, 0))
        guard = None
        if plain:
            guard = bytearray(len(text) + 1)
            for a, b in plain:
                a, b = max(int(a), 0), min(int(b), len(text))
                if b > a:
                    guard[a:b] = b"\x01" * (b - a)
            # inside content only user-defined tokens, and only wholly inside (llama.cpp's parse_special=false)
            found = [(negl, tid, p, e) for negl, tid, p, e in found
                     if not any(guard[p:p - negl]) or (text[p:p - negl] in user and all(guard[p:p - negl]))]
        if index.run_re is not None:
            for s, e in index.run_spans(text):
                neg, lengths = index.runs[text[s]]
                for start, end, inside in _segments(guard, s, e):
                    for L, tid in lengths[bisect.bisect_left(neg, start - end):]:
                        if not inside or self._tokens[tid] in user:
                            found.append((-L, tid, start, end))
        if not found:
            return [text]
        found.sort()
        claimed = bytearray(len(text) + 1)
        accepted = []
        for negl, tid, p, e in found:
            L = -negl
            if not e:
                end = p + L
                if claimed[p] or claimed[end - 1] or (L > 2 and any(claimed[p:end])):
                    continue
                claimed[p:end] = b"\x01" * L
                accepted.append((p, end, tid))
                continue
            # the token's occurrences in the run, left to right: each next one is the first free stretch of L
            free = b"\x00" * L
            q = claimed.find(free, p, e)
            while q >= 0:
                claimed[q:q + L] = b"\x01" * L
                accepted.append((q, q + L, tid))
                q = claimed.find(free, q + L, e)
        accepted.sort()
        parts: list = []
        pos = 0
        for p, end, tid in accepted:
            if p > pos:
                parts.append(text[pos:p])
            parts.append(tid)
            pos = end
        if pos < len(text):
            parts.append(text[pos:])
        return parts

    def min_tokens(self, text: str, add_bos: bool | None = None) -> int:
        """A lower bound on ``len(self.encode(text, add_bos))``, from the text's UTF-8 bytes alone (milliseconds
        for megabytes, where encoding them takes seconds): what refuses a prompt that cannot fit the context.

        It is exact in the sense that it never exceeds the true count. For a class of bytes, every byte of the
        text in it ends up in some token (where the vocabulary covers that byte: _floor_table), and no token holds
        more than the vocabulary's most of them; so the text needs at least (its bytes in the class) / (that most)
        tokens. Over every byte alone the bound is loose where the vocabulary has long whitespace tokens (Qwen2.5:
        256 spaces in one token), so ASCII letters and digits (at most 41 in one Qwen2.5 token, 16 in Gemma 3's)
        and non-ASCII bytes are counted too, and the largest of the three bounds is taken.
        """
        if _SURROGATE.search(text):
            text = _SURROGATE.sub("\ufffd", text)  # as encode() does
        data = text.encode("utf-8")
        least = 0
        for delete, most in self._floor_table():
            if most:
                least = max(least, -(-len(data.translate(None, delete)) // most))
        if self.add_bos if add_bos is None else add_bos:
            least += (self.bos_id is not None) + (self.add_eos and self.eos_id is not None)
        return least

    def _floor_table(self) -> list[tuple[bytes, int]]:
        """For each class of _FLOOR_CLASSES: (the bytes min_tokens does not count, the most counted bytes any one
        token takes from the text). Computed once per vocabulary (a walk over its tokens)."""
        table = getattr(self, "_floor", None)
        if table is not None:
            return table
        if self.kind == "wpm":
            # A WordPiece text's letters may all end up in one [UNK] (a word past 100 characters), but each ASCII
            # punctuation character is a word of its own, so a token at least: only a special token written in
            # the text ([CLS]) takes more than one.
            punct = frozenset(b for b in range(33, 127) if not chr(b).isalnum())
            most = max([1] + [sum(c.isascii() and ord(c) in punct for c in t)
                              for t, ty in zip(self._tokens, self._types) if ty in (CONTROL, UNKNOWN, USER_DEFINED)])
            self._floor = [(bytes(b for b in range(256) if b not in punct), most)]
            return self._floor
        if self.kind == "bpe":
            # a byte whose character is missing from the vocabulary is dropped by the BPE model (no unknown token
            # is set): SmolLM2's vocabulary lacks 0x04, 0x06, 0x13, ...
            covered = {b for b, c in _BYTE_TO_CHAR.items() if self.token_id(c) is not None}
        elif all(self.token_id(f"<0x{b:02X}>") is not None for b in range(256)):
            covered = set(range(256))  # byte fallback: a character without a token becomes its bytes' tokens
        else:  # without it such a character is dropped: count only ASCII that is a token itself
            covered = {b for b in range(128) if self.token_id("\u2581" if b == 0x20 else chr(b)) is not None}
        taken = [x for i, (t, ty) in enumerate(zip(self._tokens, self._types)) for x in self._taken_bytes(t, ty)]
        table = []
        for cls in _FLOOR_CLASSES:
            delete = bytes(b for b in range(256) if b not in covered or b not in cls)
            table.append((delete, max((len(x.translate(None, delete)) for x in taken), default=0)))
        self._floor = table
        return table

    def _taken_bytes(self, t: str, ty: int) -> list[bytes]:
        """The text bytes one occurrence of token ``t`` can stand for (at least one of them, for each way the
        encoder can produce it)."""
        out = []
        if ty in (CONTROL, UNKNOWN, USER_DEFINED):
            out.append(t.encode("utf-8"))  # cut out of the text as written (_partition)
        if self.kind == "bpe":
            if _BYTE_ALPHABET.issuperset(t):  # made by the BPE model from the text's bytes, one character each
                out.append(bytes(_CHAR_TO_BYTE[c] for c in t))
        else:
            m = _BYTE_TOKEN.fullmatch(t) if ty == BYTE else None
            if m:
                out.append(bytes([int(m.group(1), 16)]))
            else:  # "\u2581" stands for a space, or for itself typed in the text
                out += [t.replace("\u2581", " ").encode("utf-8"), t.encode("utf-8")]
        return out

    # ------------------------------------------------------------------ decoding
    def _check_id(self, tid) -> int:
        if isinstance(tid, bool) or not isinstance(tid, int):
            try:
                tid = int(tid)
            except (TypeError, ValueError):
                raise TokenizerError(f"token id {tid!r} is not an integer") from None
        if not 0 <= tid < self.n_vocab:
            raise TokenizerError(f"token id {tid} is out of range for a vocabulary of {self.n_vocab} tokens")
        return tid

    def is_special(self, tid: int) -> bool:
        """Control or unknown token: dropped from text when decoding with ``skip_special``."""
        return self._types[self._check_id(tid)] in (CONTROL, UNKNOWN)

    def token_bytes(self, tid: int, skip_special: bool = False) -> bytes:
        """The raw bytes token ``tid`` contributes to the text (may be part of a UTF-8 character)."""
        tid = self._check_id(tid)
        ty = self._types[tid]
        if ty in (CONTROL, UNKNOWN):
            return b"" if skip_special else self._tokens[tid].encode("utf-8")
        piece = self._piece_cache.get(tid)
        if piece is None:
            piece = self._piece(tid, ty)
            self._piece_cache[tid] = piece
        return piece

    def _piece(self, tid: int, ty: int) -> bytes:
        text = self._tokens[tid]
        if ty == USER_DEFINED:
            return text.encode("utf-8")
        if ty == BYTE:
            m = _BYTE_TOKEN.fullmatch(text)
            if m:
                return bytes([int(m.group(1), 16)])
            if self.kind == "bpe" and len(text) == 1 and text in _CHAR_TO_BYTE:
                return bytes([_CHAR_TO_BYTE[text]])
            return text.encode("utf-8")
        if ty == UNUSED:
            return b""  # llama.cpp renders unused tokens as nothing
        if self.kind in ("spm", "wpm"):
            return text.replace("\u2581", " ").encode("utf-8")
        out = bytearray()
        for ch in text:
            b = _CHAR_TO_BYTE.get(ch)
            if b is None:
                out += ch.encode("utf-8")  # not in the byte alphabet: a mislabelled added token, keep it as text
            else:
                out.append(b)
        return bytes(out)

    def token_text(self, tid: int) -> str:
        """The token's string as the vocabulary spells it (e.g. ``<|im_start|>``, ``Ġhello``, ``▁hi``)."""
        return self._tokens[self._check_id(tid)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        ids = list(ids)
        data = b"".join(self.token_bytes(t, skip_special) for t in ids)
        text = data.decode("utf-8", errors="replace")
        # the prefix space the encoder inserted is not part of the text (a WordPiece text's first word's marker)
        if self.kind == "wpm" and text[:1] == " ":
            text = text[1:]
        if self.kind == "spm" and self.add_space_prefix and ids and not (ids[0] == self.bos_id) and text[:1] == " ":
            text = text[1:]
        return text

    def is_eog(self, tid: int) -> bool:
        return tid in self.eog_ids

    def token_id(self, text: str) -> int | None:
        """Id of the token spelled exactly ``text``, or None."""
        if not hasattr(self, "_index"):
            self._index = {}
            for i, t in enumerate(self._tokens):
                self._index.setdefault(t, i)
        return self._index.get(text)

    def __repr__(self):
        return f"Tokenizer(kind={self.kind!r}, n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"


class StreamDecoder:
    """Turns a stream of token ids into text pieces that never end inside a UTF-8 character.

    Bytes that may still complete a character are held back; bytes that can no longer become valid UTF-8 come
    out as U+FFFD as soon as that is certain (the incremental UTF-8 decoder's "replace" rule).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, tid: int) -> str:
        data = self.tokenizer.token_bytes(tid, self.skip_special)
        text = self._dec.decode(data, final=False)
        tok = self.tokenizer
        if self._first and (data or text):
            self._first = False
            if tok.kind == "spm" and tok.add_space_prefix and tid != tok.bos_id and text[:1] == " ":
                text = text[1:]
        return text

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD); the decoder can be reused after."""
        text = self._dec.decode(b"", final=True)
        self._dec.reset()
        return text


class _SpecialIndex:
    """One table of special tokens (text -> id) indexed for _partition: tokens that repeat one character, by that
    character (its maximal runs are found by ``run_re``), and the others by their first two characters."""

    def __init__(self, table: dict[str, int]):
        self.table = table
        runs: dict[str, dict[int, int]] = {}
        by_prefix: dict[str, set[int]] = {}
        for t, tid in table.items():
            if t.count(t[0]) == len(t):
                runs.setdefault(t[0], {})[len(t)] = tid
            else:
                by_prefix.setdefault(t[:2], set()).add(len(t))
        # (-lengths, [(length, id)]) longest first: a run can be cut by several of them
        self.runs = {c: ([-k for k in sorted(ks, reverse=True)], sorted(ks.items(), reverse=True))
                     for c, ks in runs.items()}
        self.by_prefix = {p: sorted(ls, reverse=True) for p, ls in by_prefix.items()}
        self.first_re = (re.compile("[" + "".join(re.escape(c) for c in sorted({p[0] for p in by_prefix})) + "]")
                         if by_prefix else None)
        # Runs of those characters, at least 2 long where no single one is a token. A run is matched in pieces of
        # at most _RUN_PIECE characters: a longer repetition of a backreference costs sre memory per character.
        single = sorted(c for c, ks in runs.items() if 1 in ks)
        multi = sorted(c for c, ks in runs.items() if 1 not in ks)
        alts = []
        if single:
            alts.append("([" + "".join(map(re.escape, single)) + f"])\\{len(alts) + 1}{{0,{_RUN_PIECE - 1}}}")
        if multi:
            alts.append("([" + "".join(map(re.escape, multi)) + f"])\\{len(alts) + 1}{{1,{_RUN_PIECE - 1}}}")
        self.run_re = re.compile("|".join(alts)) if alts else None
        self._run_tails: dict[str, re.Pattern] = {}

    def run_spans(self, text: str):
        """(start, end) of each maximal run in ``text`` of a character that has run tokens (runs of one character
        shorter than 2 are left out where that character alone is not a token)."""
        pos = 0
        while True:
            m = self.run_re.search(text, pos)
            if m is None:
                return
            s, e = m.span()
            if e - s == _RUN_PIECE:  # the run may go on past the piece
                tail = self._run_tails.get(text[s])
                if tail is None:
                    tail = self._run_tails[text[s]] = re.compile(re.escape(text[s]) + "*")
                e = tail.match(text, e).end()
            yield s, e
            pos = e


_RUN_PIECE = 256


def _segments(guard: bytearray | None, start: int, end: int):
    """(start, end, inside) stretches of [start, end) that lie wholly inside or wholly outside the plain ranges
    marked in ``guard`` (None: no ranges)."""
    if guard is None:
        yield start, end, False
        return
    pos = start
    while pos < end:
        inside = bool(guard[pos])
        nxt = guard.find(b"\x00" if inside else b"\x01", pos, end)
        stop = end if nxt < 0 else nxt
        yield pos, stop, inside
        pos = stop


# Fill-in-the-middle tokens (pyllm/infill.py): the GGUF key llama.cpp reads, its older spelling, then the token
# texts llama.cpp recognises when the file names none (Qwen2.5-Coder's GGUF names none)
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


def _fim_ids(md: dict, n: int, index: dict) -> dict[str, int | None]:
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
    for t in _EOG_TEXTS:
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


def _read_vocabulary(metadata: dict) -> SimpleNamespace:
    """The vocabulary's metadata, checked (TokenizerError naming the first problem), as Tokenizer.from_gguf needs
    it: no tokenizer is built here."""
    md = metadata
    model = _field(md, "tokenizer.ggml.model", str, required=True)
    tokens = _field(md, "tokenizer.ggml.tokens", list, required=True)
    n = len(tokens)
    if n == 0:
        raise TokenizerError("GGUF metadata tokenizer.ggml.tokens is empty")
    _check_items("tokenizer.ggml.tokens", tokens, lambda t: type(t) is str, "a string")
    if _SURROGATE.search("".join(tokens)):
        # the reader keeps bytes that are not UTF-8 as surrogate escapes; the tokenizers library holds only text
        i, t = next((i, t) for i, t in enumerate(tokens) if _SURROGATE.search(t))
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
                           pre=pre, merges=merges, scores=scores, fim=_fim_ids(md, n, index), unk_id=unk_id)


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
