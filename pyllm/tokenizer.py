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
from typing import Iterable, Sequence

from pyllm.errors import TokenizerError
from pyllm.vocabulary import BYTE, CONTROL, SURROGATE, UNKNOWN, UNUSED, USER_DEFINED, build_backend, read_vocabulary

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
        v = read_vocabulary(metadata)
        try:
            backend = build_backend(v)
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
        read_vocabulary(metadata)

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
        if SURROGATE.search(text):
            # a lone surrogate (from bytes that were not UTF-8, via surrogateescape, or a JSON "\\ud800") has no
            # UTF-8 form; one replacement character each keeps every offset (plain spans) where it was
            text = SURROGATE.sub("\ufffd", text)
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
        if SURROGATE.search(text):
            text = SURROGATE.sub("\ufffd", text)  # as encode() does
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
