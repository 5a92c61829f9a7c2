"""Constrained decoding: a token mask from a JSON schema, "any JSON object" or a GBNF grammar, per decode step.

The engine is llguidance (MIT, one abi3 wheel with no Python dependencies; docs/DESIGN.md "Structured output" has
the measurements against xgrammar and outlines-core). Its matcher works on bytes, so the model's vocabulary is
handed over once as the raw bytes of every token id (``GrammarVocab``, cached on the LLM); a ``Constraint`` is one
generation's matcher state over it:

    c = Constraint.from_json_schema(schema, vocab)   # or .json_object(vocab), .from_gbnf(text, vocab)
    c.mask(logits)          # disallowed ids -> -inf, in place (torch or numpy, [n_vocab])
    c.advance(token)        # after the token is chosen
    c.is_done()             # the grammar is complete and can take nothing but an end-of-generation token

In the sampler chain the mask applies after logit bias and penalties and before greedy / top-k / top-p / min-p /
temperature (``Sampler.candidates``), so every sampling setting draws only from tokens the grammar allows.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
from typing import Any

import numpy as np
import torch

from ..errors import PyllmError, shorten
from .schema_formats import exact_formats
from .schema_numbers import deep_bound_refusal, exact_integers, number_bound_refusal, number_digit_cap
from .schema_objects import close_objects, count_refusal, repeated_key_refusal
from .schema_walk import SCHEMA_DATA, resolve_local


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise PyllmError("structured output needs the llguidance package: pip install llguidance") from None
    return llguidance


# JSON whitespace between tokens: nothing, one space, or a newline and an indent of up to 20 (llama.cpp's "space")
JSON_WS = r"(?: |\n[ \t]{0,20})?"
DIGITS = frozenset(b"0123456789")


# The engine compiles grammars recursively, one native stack frame per level of rules that name rules: a chain of
# 3,000 rules (or a schema of 5,000 definitions each naming the next) overflowed the caller's 8 MiB stack and
# killed the process with SIGSEGV (in the server: every client's requests). Compiling on a thread of its own with
# this much stack room (reserved, touched only as deep as the grammar goes) leaves depth to the engine's own size
# limits, which stop such schemas near 20,000 definitions.
COMPILE_STACK_BYTES = 256 << 20
# GBNF is translated to the engine's syntax by Python code whose time grows with the square of the depth of rules
# naming rules (2,000 rules in a chain: 3 s; 20,000: minutes); real grammars have tens of rules.
MAX_GRAMMAR_RULES = 1000
MAX_GRAMMAR_CHARS = 1 << 20
_RULE = re.compile(r"^[ \t]*[A-Za-z_][\w.-]*[ \t]*(?:::=|:)", re.M)  # a GBNF or Lark rule's head


def _on_compile_stack(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run on a thread with COMPILE_STACK_BYTES of stack; its result or its exception."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller's thread as is
            out["error"] = e

    with _STACK_SIZE_LOCK:  # the size applies to threads created while it is set
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            t = threading.Thread(target=run, name="pyllm-grammar-compile", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


_STACK_SIZE_LOCK = threading.Lock()


class _Encoder:
    """The callable llguidance tokenizes forced text with (bytes or str -> ids), plus the ids it needs."""

    def __init__(self, tokenizer, tokens: list[bytes], eos_ids: list[int]):
        self._tok = tokenizer
        self.tokens = tokens
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i, t in enumerate(tokens) if t[:1] == b"\xff"]

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_bos=False, special=False)


_DIGIT_RUNS = re.compile(rb"[0-9]+")


class GrammarVocab:
    """The engine's view of one model's vocabulary: token bytes for every id, and the end-of-generation ids.

    Building it walks the whole vocabulary (0.6-2 s for 49k tokens, 2.5-6 s for 151k on a busy machine), so the
    LLM keeps one (``LLM.grammar_vocab``) and every constraint for that model shares it.
    """

    def __init__(self, tokenizer, n_vocab: int | None = None):
        from ..vocabulary import CONTROL, UNKNOWN

        llg = _llguidance()
        n_vocab = max(int(n_vocab or 0), tokenizer.n_vocab)
        tokens = []
        for i in range(tokenizer.n_vocab):
            if tokenizer._types[i] in (CONTROL, UNKNOWN):
                # llguidance's convention for special tokens: a leading 0xFF byte (never valid UTF-8), so text
                # can never spell them and a grammar names them only on purpose
                tokens.append(b"\xff" + tokenizer.token_text(i).encode("utf-8"))
            else:
                tokens.append(tokenizer.token_bytes(i))
        # the model may have more output rows than the vocabulary has tokens (padding): they stay masked
        tokens += [b""] * (n_vocab - len(tokens))
        # for _JsonScan's rules: the digits each token starts with, its longest run of digits after those, and
        # the tokens by their bytes up to their first quote (those that would close a key being written)
        self.tokens = tokens
        self.quote_prefixes: dict[bytes, list[int]] = {}
        self.lead_digits = np.zeros(n_vocab, dtype=np.int32)
        self.inner_digits = np.zeros(n_vocab, dtype=np.int32)
        for i, t in enumerate(tokens):
            if t[:1] == b"\xff":
                continue
            q = t.find(b'"')
            if q >= 0:
                self.quote_prefixes.setdefault(t[:q + 1], []).append(i)
            if not DIGITS.isdisjoint(t):
                lead = len(t) - len(t.lstrip(b"0123456789"))
                self.lead_digits[i] = lead
                self.inner_digits[i] = max(map(len, _DIGIT_RUNS.findall(t, lead)), default=0)
        self.max_lead_digits = int(self.lead_digits.max(initial=0))
        self.max_inner_digits = int(self.inner_digits.max(initial=0))
        eos = sorted(tokenizer.eog_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        if tokenizer.eos_id in tokenizer.eog_ids:  # the primary EOS first: llguidance reports it as eos_token
            eos.remove(tokenizer.eos_id)
            eos.insert(0, tokenizer.eos_id)
        if not eos:
            raise PyllmError("structured output needs an end-of-generation token, and this vocabulary has none")
        self.n_vocab = n_vocab
        self.eos_ids = eos
        self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_Encoder(tokenizer, tokens, eos)), n_vocab=n_vocab,
                                  eos_token=eos)




# llguidance reads options from the schema's top-level "x-guidance" object. These two relax the schema's meaning
# at the caller's explicit request (coerce_one_of: a oneOf generated as anyOf; lenient: keywords the engine lacks
# are ignored); its others set separators and whitespace, which would make the output other JSON text than pyllm
# promises (standard separators, bounded whitespace), so they are refused.
ENGINE_OPTIONS = ("coerce_one_of", "lenient")


def _engine_options_refusal(schema: dict) -> str | None:
    """Why the schema's "x-guidance" engine options cannot be taken, or None."""
    options = schema.get("x-guidance")
    if options is None:
        return None
    if not isinstance(options, dict):
        return f'"x-guidance" must be an object of engine options, got {type(options).__name__}'
    other = sorted(str(k) for k in options if k not in ENGINE_OPTIONS)
    if other:
        return (f'"x-guidance" option {shorten(other[0])!r} is not supported (only {" and ".join(ENGINE_OPTIONS)}: '
                f'the others change the JSON text itself)')
    return None


def _self_defined(schema: dict) -> str | None:
    """A "$ref" that leads back to where it started through nothing but "$ref"s and "allOf" members
    ({"$ref": "#"}; two $defs that name each other), or None. Such a schema describes no value at all, and the
    engine fails on it with a message of its internals ("NoExtensionBias"), for a forced tool call only once
    generation reaches it. Iterative; each subschema is visited once."""
    def edges(node: dict) -> list[tuple[dict, str]]:
        out = []
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = resolve_local(schema, ref)
            if isinstance(target, dict):
                out.append((target, ref))
        if isinstance(node.get("allOf"), list):
            out += [(m, "allOf") for m in node["allOf"] if isinstance(m, dict)]
        return out

    state: dict[int, int] = {}  # id of a subschema -> 1 on the current chain, 2 finished
    every = [schema]
    while every:
        s = every.pop()
        if isinstance(s, list):
            every.extend(s)
            continue
        if not isinstance(s, dict):
            continue
        every.extend(v for k, v in s.items() if k not in SCHEMA_DATA and isinstance(v, (dict, list)))
        if id(s) in state:
            continue
        state[id(s)] = 1
        chain = [(s, iter(edges(s)))]
        while chain:
            node, it = chain[-1]
            nxt = next(it, None)
            if nxt is None:
                state[id(node)] = 2
                chain.pop()
                continue
            target, label = nxt
            if state.get(id(target)) == 1:
                return label
            if id(target) not in state:
                state[id(target)] = 1
                chain.append((target, iter(edges(target))))
    return None


def _schema_text(schema: Any) -> tuple[str, str]:
    """A JSON schema given as a dict or a JSON string -> (canonical JSON text for the engine, bounds moved where
    it would not keep them; the same before that), a missing additionalProperties read as false in both
    (schema_objects.close_objects); PyllmError naming the problem."""
    if isinstance(schema, (bytes, str)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise PyllmError(f"json_schema is not valid JSON: {e}") from None
        except RecursionError:  # Python's parser recurses once per level: a few kB of '{"items":' exhaust it
            raise PyllmError("json_schema nests too deeply to parse") from None
    if isinstance(schema, bool):  # JSON Schema allows true (anything) and false (nothing)
        if not schema:
            raise PyllmError("json_schema is false: no output can match it")
        schema = {}
    if not isinstance(schema, dict):
        raise PyllmError(f"json_schema must be a JSON object (a dict or its JSON text), got {type(schema).__name__}")
    why = _engine_options_refusal(schema)
    if why:
        raise PyllmError(f"invalid json_schema: {why}")
    ref = _self_defined(schema)
    if ref:
        raise PyllmError(f"invalid json_schema: \"$ref\": {shorten(ref)!r} leads back to itself through nothing but "
                         f"$ref and allOf, so it describes no value")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise PyllmError(f"json_schema cannot be written as JSON: {e}") from None
    except RecursionError:  # a dict nested a thousand levels deep: the encoder recurses per level too
        raise PyllmError("json_schema nests too deeply to write as JSON") from None
    # a fresh copy to edit (the caller's schema stays as given); parsing what was just written cannot fail
    edited = json.loads(text)
    if close_objects(edited):  # a missing additionalProperties is false, as the peers read it
        text = json.dumps(edited)
    why = repeated_key_refusal(edited)
    if why:
        raise PyllmError(f"invalid json_schema: {why}")
    moved = exact_integers(edited) is not None
    guarded = exact_formats(edited)
    return (json.dumps(edited) if moved or guarded else text), text


class Constraint:
    """One generation's grammar state over a GrammarVocab. Not thread-safe: one per generation."""

    def __init__(self, grammar: str, vocab: GrammarVocab, what: str, digit_cap: int | None = None):
        llg = _llguidance()
        self.vocab = vocab
        self.what = what
        # JSON schemas only: most digits in a row outside strings, and where the output stands for that rule and
        # for keys repeated in one object (None: a grammar, neither rule)
        self.digit_cap = digit_cap
        self._scan = _JsonScan(digit_cap) if digit_cap is not None else None
        self.m = _on_compile_stack(llg.LLMatcher, vocab.ll, grammar, log_level=0)
        if self.m.is_error():
            raise PyllmError(f"invalid {what}: {_engine_refusal(self.m.get_error())}")
        # (n_words,) one bit per token id, bit i of word i // 32; refilled for each step
        self._bits = np.zeros((vocab.n_vocab + 31) // 32, dtype=np.int32)
        self._allowed: np.ndarray | None = None
        self._text_m = None  # accepts_text's own matcher, at the start of the output + _text
        self._text = ""

    # ---- constructors -----------------------------------------------------------------------------------------
    @classmethod
    def from_json_schema(cls, schema: Any, vocab: GrammarVocab) -> "Constraint":
        """Output is one JSON value valid under ``schema`` (a dict or JSON text). Whitespace between tokens is
        allowed but bounded, as llama.cpp's json-schema-to-grammar bounds it (one space, or a newline and up to 20
        indent characters): unbounded whitespace lets a small sampled model pad forever and never finish."""
        text, given = _schema_text(schema)
        llg = _llguidance()
        try:
            grammar = _on_compile_stack(llg.LLMatcher.grammar_from_json_schema, text,
                                        defaults={"whitespace_pattern": JSON_WS})
        except (ValueError, TypeError) as e:
            named = count_refusal(str(e), json.loads(given))
            raise PyllmError(f"invalid json_schema: {named or _first_line(str(e))}") from None
        parsed = json.loads(text)
        try:
            return cls(grammar, vocab, "json_schema", number_digit_cap(parsed))
        except PyllmError as e:
            # named as given: a bound moved inwards by exact_integers can still be one the engine cannot write
            refusal = number_bound_refusal(str(e), json.loads(given)) or deep_bound_refusal(
                str(e), json.loads(text), lambda s: cls._compiles(s, vocab))
            named = count_refusal(str(e), json.loads(given))
            refusal = refusal or (f"invalid json_schema: {named}" if named else None)
            if refusal is None:
                raise
        raise PyllmError(refusal)

    @classmethod
    def _compiles(cls, schema: Any, vocab: GrammarVocab) -> bool:
        llg = _llguidance()
        try:
            grammar = _on_compile_stack(llg.LLMatcher.grammar_from_json_schema, json.dumps(schema),
                                        defaults={"whitespace_pattern": JSON_WS})
            cls(grammar, vocab, "json_schema", number_digit_cap(schema))
        except (ValueError, TypeError, PyllmError):
            return False
        return True

    @classmethod
    def json_object(cls, vocab: GrammarVocab) -> "Constraint":
        """Any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
        return cls.from_json_schema({"type": "object"}, vocab)

    @classmethod
    def from_gbnf(cls, text: str, vocab: GrammarVocab) -> "Constraint":
        """A llama.cpp GBNF grammar (``root ::= ...``); llguidance's Lark syntax is accepted too."""
        if not isinstance(text, str) or not text.strip():
            raise PyllmError("grammar must be non-empty GBNF text")
        if len(text) > MAX_GRAMMAR_CHARS:
            raise PyllmError(f"grammar is {len(text)} characters long; at most {MAX_GRAMMAR_CHARS} are supported")
        rules = len(_RULE.findall(text))
        if rules > MAX_GRAMMAR_RULES:
            raise PyllmError(f"grammar has {rules} rules; at most {MAX_GRAMMAR_RULES} are supported")
        llg = _llguidance()
        try:
            grammar = _on_compile_stack(llg.grammar_from, "gbnf", text)
        except ValueError as e:
            raise PyllmError(f"invalid grammar: {_gbnf_message(str(e))}") from None
        why = _on_compile_stack(_unfinishable_rule, text)
        if why:
            raise PyllmError(f"invalid grammar: {why}")
        c = cls(grammar, vocab, "grammar")
        # Lark text (not looked at above) whose start can never finish: the engine says so only as its internal
        # "NoExtensionBias" once asked for a mask, so ask now and name the problem
        if _no_way_to_finish(c):
            raise PyllmError("invalid grammar: it matches no text: its start rule can never finish (every way "
                             "through it refers back to a rule that is still open)")
        return c

    # ---- per step ---------------------------------------------------------------------------------------------
    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the ids the grammar accepts next (computed once per state)."""
        if self._allowed is None:
            self.m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            if self.m.is_error():
                err = self.m.get_error()
                if "NoExtensionBias" in err:
                    raise PyllmError(f"{self.what} constraint failed: the output so far can never be completed: "
                                     f"every way on needs a rule that can never finish")
                raise PyllmError(f"{self.what} constraint failed: {_first_line(err)}")
            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab.n_vocab]
            self._allowed = self._json_rules(bits.view(bool))
        return self._allowed

    def _json_rules(self, allowed: np.ndarray) -> np.ndarray:
        """``allowed`` less the tokens that would break _JsonScan's rules: those that would make a run of digits
        outside a string longer than digit_cap (looked at only where some token could: a long run already
        written, or a vocabulary with long digit tokens), and those that would close the key being written as one
        its object already has (the tokens that start with the rest of that key and its quote). Never empties the
        mask: a schema's own numbers set the cap, and an object can always take another key or close."""
        scan, v = self._scan, self.vocab
        if scan is None:
            return allowed
        out = allowed
        if not scan.in_string and (scan.run + v.max_lead_digits > scan.cap or v.max_inner_digits > scan.cap):
            out = out & ~((v.lead_digits > scan.cap - scan.run) | (v.inner_digits > scan.cap))
        if scan.key is not None and scan.objects[-1]:
            done, pending = _key_text(scan.key)
            repeats = [v.quote_prefixes.get(p, ()) for k in scan.objects[-1] if k.startswith(done)
                       for p in _closings(pending, k[len(done):])]
            repeats = [i for ids in repeats for i in ids]
            if repeats:
                out = out.copy() if out is allowed else out
                out[repeats] = False
        return out if out is allowed or out.any() else allowed

    def mask(self, logits):
        """Sets the logits of disallowed ids to -inf, in place, and returns them. logits: float [n_vocab] (or
        [..., n_vocab]) torch tensor or ndarray; ids past the grammar's vocabulary are disallowed too."""
        allowed = self.allowed()
        n = min(len(allowed), logits.shape[-1])
        if isinstance(logits, torch.Tensor) and logits.device.type == "cpu":
            # numpy on the shared memory: torch's masked_fill_ splits 50-150k elements over the intra-op
            # threads, and waking them cost 20 ms per call on a busy 2-core machine against 0.1 ms here
            self.mask(logits.detach().numpy())
        elif isinstance(logits, torch.Tensor):
            logits[..., :n].masked_fill_(torch.from_numpy(~allowed[:n]).to(logits.device), float("-inf"))
            logits[..., n:] = float("-inf")
        else:
            np.copyto(logits[..., :n], -np.inf, where=~allowed[:n])
            logits[..., n:] = -np.inf
        return logits

    def advance(self, token: int) -> None:
        """Moves the grammar past ``token`` (which the mask allowed)."""
        self._allowed = None
        if not self.m.consume_token(int(token)):
            raise PyllmError(f"token {int(token)} does not fit the {self.what}: "
                             f"{_first_line(self.m.get_error())}")
        if self._scan is not None:
            self._scan.feed(self.vocab.tokens[int(token)])

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next (its only continuation, as the tokenizer splits it; empty when it
        leaves a choice or is complete): a draft to verify, since the model's own split of that text may differ."""
        if self.m.is_stopped():
            return []
        return list(self.m.compute_ff_tokens())

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the first, the grammar would take in turn (the state is not changed)."""
        n = self.m.validate_tokens(list(tokens)) if tokens else 0
        if self._scan is not None:
            scan = self._scan.copy()
            for i, t in enumerate(tokens[:n]):
                if not scan.feed(self.vocab.tokens[int(t)]):
                    return i
        return n

    def is_done(self) -> bool:
        """True when the output is complete and nothing but an end-of-generation token may follow."""
        return self.m.is_stopped()

    def end_token(self) -> int | None:
        """The end-of-generation id to emit when the output is complete (is_done), else None."""
        return self.vocab.eos_ids[0] if self.m.is_stopped() else None

    def accepts_text(self, text: str) -> bool:
        """True when ``text``, from the start of the output, is a complete match (the generation's state is not
        changed). Its own matcher stays at the last text asked about, so a caller asking of ever longer texts (each
        stop string met in a growing output) pays for the new part only, not the whole output each time; the
        matcher takes text however it is split into tokens."""
        if self._text_m is None or not text.startswith(self._text):
            self._text_m = self.m.deep_copy()
            self._text_m.reset()
            self._text = ""
        rest = text[len(self._text):]
        if rest and not self._text_m.consume_tokens(self.vocab.ll.tokenize_str(rest)):
            self._text_m = None
            return False
        self._text = text
        return self._text_m.is_accepting()

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (it may still be extended)."""
        return self.m.is_accepting()


_SHORT_ESCAPES = {ord(k): v.encode() for k, v in zip('"\\/bfnrt', '"\\/\b\f\n\r\t')}


def _key_text(raw: bytes) -> tuple[bytes, bytes]:
    """A JSON string's content as written -> (its text as UTF-8 bytes, escapes replaced: "\\u0061" and "a" are one
    key to a JSON reader; the unfinished escape it ends with, b"" if none). A surrogate pair is one character; a
    lone surrogate keeps its own bytes (surrogatepass), as no plain spelling can match it."""
    out, i = bytearray(), 0
    while i < len(raw):
        c = raw[i]
        if c != 0x5C:
            out.append(c)
            i += 1
        elif i + 1 < len(raw) and raw[i + 1] != 0x75:  # a short escape
            out += _SHORT_ESCAPES.get(raw[i + 1], raw[i:i + 2])
            i += 2
        elif i + 6 <= len(raw):
            u, i = int(raw[i + 2:i + 6], 16), i + 6
            if 0xD800 <= u < 0xDC00 and raw[i:i + 2] == b"\\u" and len(raw) >= i + 6:
                low = int(raw[i + 2:i + 6], 16)
                if 0xDC00 <= low < 0xE000:
                    u, i = 0x10000 + ((u - 0xD800) << 10) + (low - 0xDC00), i + 6
            out += chr(u).encode("utf-8", "surrogatepass")
        else:
            return bytes(out), raw[i:]
    return bytes(out), b""


_ESCAPE_LETTERS = {v: bytes((k,)) for k, v in _SHORT_ESCAPES.items()}


def _closings(pending: bytes, rest: bytes) -> list[bytes]:
    """The token texts up to a closing quote that finish a key whose text so far ends in the unfinished escape
    ``pending`` (b"" if none) with the text ``rest``: the escape finished as rest's first character, in any case
    of hex digit, then the rest of it written plainly. A rest that needs more escapes is left out: its spellings
    span several tokens, and the mask meets them one step at a time."""
    if not pending:
        plain = rest and not any(c in rest for c in b'"\\') and min(rest) >= 0x20
        return [rest + b'"'] if plain or rest == b"" else []
    text = rest.decode("utf-8", "surrogatepass")
    if not text:
        return []
    tail = text[1:].encode("utf-8", "surrogatepass")
    if any(c in tail for c in b'"\\') or min(tail, default=0x20) < 0x20:
        return []
    hex4 = f"{ord(text[0]):04x}" if ord(text[0]) < 0x10000 else None
    typed = pending[1:].decode().lower()  # "", "u", "u0", ...
    out = []
    if typed == "" and text[0].encode() in _ESCAPE_LETTERS:
        out.append(_ESCAPE_LETTERS[text[0].encode()] + tail + b'"')
    if hex4 is not None and ("u" + hex4).startswith(typed):
        u, left = "u"[len(typed):], hex4[max(len(typed) - 1, 0):]
        out += [(u + "".join(v)).encode() + tail + b'"' for v in itertools.product(*({c, c.upper()} for c in left))]
    return out


class _JsonScan:
    """Where a JSON output stands, byte by byte, for the two rules of a JSON schema constraint the engine does not
    keep: at most ``cap`` digits in a row outside strings, and no key twice in one object (the engine keeps the
    named properties distinct, but not the keys additionalProperties or patternProperties admit: JSON readers keep
    the last of repeated keys, so the output would lose a value). Keys are compared as text, escapes decoded."""

    def __init__(self, cap: int):
        self.cap = cap
        self.in_string = self.escaped = self.want_key = False
        self.run = 0  # digits in a row, outside strings
        self.objects: list[set[bytes] | None] = []  # per open container: an object's keys so far, None for an array
        self.key: bytes | None = None  # the key being written (inside its string), else None

    def copy(self) -> "_JsonScan":
        c = copy.copy(self)
        c.objects = [None if keys is None else set(keys) for keys in self.objects]
        return c

    def feed(self, data: bytes) -> bool:
        """Moves past ``data``; False if it broke a rule (a run of digits past the cap, a repeated key). Special
        tokens (a 0xFF first byte) write no text."""
        if data[:1] == b"\xff":
            return True
        ok = True
        for c in data:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == 0x5C:  # backslash
                    self.escaped = True
                elif c == 0x22:  # the closing quote
                    self.in_string = False
                    if self.key is not None:
                        keys, text = self.objects[-1], _key_text(self.key)[0]
                        ok = ok and text not in keys
                        keys.add(text)
                        self.key = None
                    continue
                if self.key is not None:
                    self.key += bytes((c,))
                continue
            if 0x30 <= c <= 0x39:
                self.run += 1
                ok = ok and self.run <= self.cap
                continue
            self.run = 0
            if c == 0x22:
                self.in_string = True
                in_object = bool(self.objects) and self.objects[-1] is not None
                self.key = b"" if in_object and self.want_key else None
            elif c in b"{[":
                self.objects.append(set() if c == 0x7B else None)
                self.want_key = c == 0x7B
            elif c in b"}]":
                if self.objects:
                    self.objects.pop()
                self.want_key = False
            elif c == 0x2C:  # a comma: in an object, a key comes next
                self.want_key = bool(self.objects) and self.objects[-1] is not None
            elif c == 0x3A:  # a colon: its value comes next
                self.want_key = False
        return ok


def _no_way_to_finish(c: "Constraint") -> bool:
    """Whether the engine finds no way through ``c``'s grammar from its start (its first mask fails so)."""
    try:
        c.allowed()
    except PyllmError:
        return "NoExtensionBias" in (c.m.get_error() or "")
    return False


def _unfinishable_rule(text: str) -> str | None:
    """Why a GBNF grammar (already accepted by the engine) has a rule, reachable from root, that no text can
    complete (root ::= root; a ::= "x" a), or None. The engine accepts such grammars and then fails
    mid-generation with its internals ("NoExtensionBias", "Too many items") or writes until max_tokens.

    Standard productivity analysis: every node of the rules' syntax trees is a graph node (a sequence or a
    repetition needing at least one pass: all children; an alternative or a rule reference: any child; literals,
    character classes, optional repetitions: none), finished by propagation from the leaves, linear in the size
    of the grammar. Lark text is left to the engine (None)."""
    try:  # the engine's own GBNF parser, so that both read the text alike
        from llguidance.gbnf_to_lark import (AlternativeNode, GrammarParser, RepetitionNode, RuleRefNode,
                                             SequenceNode, is_lark_syntax)
    except ImportError:  # another engine version, laid out otherwise: the engine's own errors stand
        return None

    if is_lark_syntax(text):
        return None
    try:
        rules = GrammarParser().parse(text)
    except Exception:  # the engine accepted it; a parse that differs is not this check's to judge
        return None
    if "root" not in rules:
        return None
    names = list(rules)
    kind: list[str] = []  # "all", "any" or "leaf"
    kids: list[list[int]] = []
    ref_of: dict[int, str] = {}  # graph node of a rule reference -> the rule's name
    rule_node = {}
    order: list = []  # (ast node, graph node) still to expand

    def add(node) -> int:
        n = len(kind)
        if isinstance(node, SequenceNode):
            kind.append("all")
        elif isinstance(node, RepetitionNode):
            kind.append("all" if node.min_times > 0 else "leaf")
        elif isinstance(node, (AlternativeNode, RuleRefNode)):
            kind.append("any")
        else:  # a literal, a character class, "."
            kind.append("leaf")
        kids.append([])
        order.append((node, n))
        return n

    for name in names:
        rule_node[name] = add(rules[name].alternatives)
    while order:
        node, n = order.pop()
        if isinstance(node, RuleRefNode):
            if node.name not in rule_node:
                return None
            ref_of[n] = node.name
            kids[n].append(rule_node[node.name])
        elif isinstance(node, (SequenceNode, AlternativeNode)) or \
                (isinstance(node, RepetitionNode) and node.min_times > 0):
            kids[n].extend(add(c) for c in node.children())
    parents: list[list[int]] = [[] for _ in kind]
    for n, ks in enumerate(kids):
        for k in ks:
            parents[k].append(n)
    pending = [len(ks) if k == "all" else (1 if k == "any" else 0) for k, ks in zip(kind, kids)]
    done = [p == 0 for p in pending]
    todo = [n for n, d in enumerate(done) if d]
    while todo:
        n = todo.pop()
        for p in parents[n]:
            if not done[p]:
                pending[p] -= 1
                if pending[p] == 0:
                    done[p] = True
                    todo.append(p)

    def refs(name: str, open_only: bool) -> list[str]:
        """The rules ``name``'s body names (only those it cannot finish without, if ``open_only``)."""
        out, stack = [], [rule_node[name]]
        seen = set()
        while stack:
            n = stack.pop()
            if n in seen or (open_only and done[n]):
                continue
            seen.add(n)
            if n in ref_of:
                out.append(ref_of[n])
            else:
                stack.extend(kids[n])
        return out

    reachable, stack = {"root"}, ["root"]
    while stack:
        for r in refs(stack.pop(), False):
            if r not in reachable:
                reachable.add(r)
                stack.append(r)
    stuck = [r for r in names if r in reachable and not done[rule_node[r]]]
    if not stuck:
        return None
    needs = {r: list(dict.fromkeys(refs(r, True))) for r in stuck}
    for r in stuck:  # the first (in the grammar's order) that leads back to itself; one always does
        back: dict[str, str] = {}
        queue = [r]
        while queue and r not in back:
            cur = queue.pop(0)
            for nxt in needs[cur]:
                if nxt not in back:
                    back[nxt] = cur
                    queue.append(nxt)
        if r not in back:
            continue
        path, cur = [], back[r]
        while cur != r:
            path.append(cur)
            cur = back[cur]
        hops = [repr(shorten(p, 40)) for p in reversed(path)]
        if len(hops) > 4:  # a loop through a thousand rules must not make a thousand-rule message
            hops = hops[:2] + [f"{len(hops) - 3} more"] + hops[-1:]
        via = (" through " + " -> ".join(hops)) if hops else ""
        end = (", so the grammar matches no text" if not done[rule_node["root"]]
               else ", and rule 'root' can reach it")
        return f"rule {shorten(r, 40)!r} can never finish: every alternative refers back to itself{via}{end}"
    return None


# The engine refuses a oneOf whose branches it cannot show exclusive (it would have to stop the output matching two
# of them), and its message names an option without saying where it goes: in the schema, as llguidance reads it.
_ONE_OF_REFUSAL = "oneOf constraints are not supported"
_ONE_OF_HELP = ('a oneOf whose branches could both match one value is not supported (the engine cannot keep the '
                'output to exactly one): use anyOf, make the branches exclusive (for objects, a property with a '
                'different "const" in each), or add "x-guidance": {"coerce_one_of": true} at the top of the schema '
                'to generate it as anyOf')


def _engine_refusal(msg: str) -> str:
    """The engine's refusal of a grammar or schema, on one line, in terms a caller can act on."""
    line = _first_line(msg)
    return _ONE_OF_HELP if line.startswith(_ONE_OF_REFUSAL) else line


def _gbnf_message(msg: str) -> str:
    """An engine error about a GBNF grammar in GBNF's terms: the engine converts GBNF to its own Lark dialect first
    and says so ("Failed to convert the grammar from GBNF to Lark: ..."), which names a language the user never
    wrote."""
    msg = re.sub(r"(?i)failed to convert the grammar from GBNF to Lark:\s*", "", _first_line(msg))
    return re.sub(r"(?i)\blark\b", "grammar", msg)


def _first_line(msg: str) -> str:
    """An engine message on one line: its first line plus any "error: ..." detail lines (regex errors put the
    reason after a quoted excerpt and a caret line)."""
    lines = [ln.strip() for ln in (msg or "unknown error").splitlines() if ln.strip()] or ["unknown error"]
    detail = [ln for ln in lines[1:] if ln.lower().startswith("error")]
    return " ".join([lines[0]] + detail)[:400]


def make_constraint(vocab_fn, json_schema=None, grammar=None, constraint: Constraint | None = None):
    """The one constraint a generation call asked for (or None). ``vocab_fn()`` gives the model's GrammarVocab,
    built only when needed. json_schema, grammar and constraint are mutually exclusive."""
    given = [n for n, v in (("json_schema", json_schema), ("grammar", grammar), ("constraint", constraint))
             if v is not None]
    if len(given) > 1:
        raise PyllmError(f"give at most one of json_schema, grammar and constraint, got {' and '.join(given)}")
    if constraint is not None:
        return constraint
    if json_schema is not None:
        return Constraint.from_json_schema(json_schema, vocab_fn())
    if grammar is not None:
        return Constraint.from_gbnf(grammar, vocab_fn())
    return None
