"""pyllm.tokenizer against llama.cpp (pinned ids in tests/data/tokenizer_refs.json) and transformers.

llama.cpp is the reference for GGUF vocabularies; tools/make_tokenizer_refs.py regenerates the pinned ids with
llama-cpp-python, which CI does not install. transformers' GGUF tokenizer is compared too, with the strings
where the two references disagree listed explicitly (and checked to still disagree, so the list stays honest).
"""

from __future__ import annotations

import functools
import json
import os
import re
import time

import pytest

from conftest import fixture_path, hf_tokenizer
from pyllm.errors import TokenizerError
from pyllm.tokenizer import StreamDecoder, Tokenizer

MODELS = ("smollm2", "qwen2", "gemma3")
REFS_PATH = os.path.join(os.path.dirname(__file__), "data", "tokenizer_refs.json")

CORPUS = [
    "",
    " ",
    "Hello world",
    " Hello world",
    "  Hello  world  ",
    "hello\n",
    "\n\n\n",
    "a  1",
    "\n\n  1. Definitions.",
    "   leading spaces and trailing   ",
    "def f(x):\n\tif x:\n\t\treturn x  # tab-indented\n    else:\n        return None\n",
    "for (int i = 0; i < n; ++i) {\n    sum += a[i];\n}",
    "x\t\ty \t z\r\nw",
    "1234567890 3.14159 -42 1e-10 0x1F",
    "The year 2024 had 366 days; 100000000000000000000 is big.",
    "  123 and\t456 and\n789",
    "I'm sure you'll see they've done it, isn't it? He'd say I'M SURE",
    "café naïve résumé Ångström Øresund straße",
    "Ελληνικά и русский текст, עברית, العربية",
    "日本語のテキストと中文文本，한국어 텍스트。",
    "emoji: 🦙🚀👩‍👩‍👧‍👦 🇫🇷 ❤️ 👍🏽",
    "mixed 日本 english 123 😀 end",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after eot",
    "plain </s> in the middle</s>",
    "<s>bos-looking</s>",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk>",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<|fim_prefix|>def a():<|fim_suffix|>\n<|fim_middle|>",
    "<|im_start|<|im_end|>>",
    "fake <|not_a_token|> and <|im_start",
    "!!!??? ... --- *** ### @@@ $$$ %%%",
    "https://example.com/path?q=1&r=2#frag",
    "zero\u200bwidth\u00a0nbsp\u2003emspace\u3000ideographic",
    "                                                                 many spaces",
    "\u2581already escaped\u2581\u2581",
    "trailing newline spaces  \n  ",
    "ÀÉÎÕÜ ĀāĒē ǅǆ ﬁﬂ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 ½ ² Ⅻ",
    "tabs\t\t\tand\n\n\nnewlines\r\r",
]

# Parts of the corpus also checked with special=False (special markers must come out as plain text pieces)
NON_SPECIAL = [
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "plain </s> in the middle</s>",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "\n\n  spaces  and newlines\n\n",
]
WITH_BOS = ["", "Hello world", "<|im_start|>user\nhi", "<bos>already there"]

# Where transformers' GGUF tokenizer and llama.cpp disagree, and why (llama.cpp wins: it is what the GGUF is for).
HF_DIFFERS = {
    "smollm2": {
        # llama.cpp's smollm pre-tokenizer isolates every digit before the GPT-2 regex, so the spaces before a
        # digit stay one "  " piece; transformers runs the regex first and leaves " " + " " + "1".
        "a  1",
        "\n\n  1. Definitions.",
        "  123 and\t456 and\n789",
        # "\p{N}" is every number (No/Nl too): "½", "²", "Ⅻ" are isolated like digits, which transformers'
        # Digits pre-tokenizer (decimal digits only) does not do
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 ½ ² Ⅻ",
    },
    "qwen2": {
        # "</s>" is a normal token in Qwen's vocabulary, but llama.cpp makes it a control token (EOG list)
        "plain </s> in the middle</s>",
        "<s>bos-looking</s>",
    },
    "gemma3": {
        # Gemma stores runs of 2..31 spaces as user-defined tokens spelled with real spaces. llama.cpp cuts
        # user-defined tokens out of the text first, longest first (31 + 31 + 3 spaces); transformers renames
        # them to "▁▁..." and lets BPE merge the escaped spaces (16 + 16 + 16 + 17).
        "                                                                 many spaces",
        # a literal "▁▁" in the text: transformers reaches its renamed two-space token, llama.cpp has no
        # "▁▁" token to merge into and keeps two "▁"
        "\u2581already escaped\u2581\u2581",
    },
}


def ref_cases(key: str):
    """(text, add_special, special) cases pinned per model; shared with tools/make_tokenizer_refs.py."""
    cases = [(t, False, True) for t in CORPUS]
    cases += [(t, False, False) for t in NON_SPECIAL]
    cases += [(t, True, True) for t in WITH_BOS]
    return cases


@functools.lru_cache(maxsize=None)
def gguf_metadata(key: str) -> dict:
    from pyllm.formats.gguf import open_gguf

    gf = open_gguf(fixture_path(key))
    try:
        return dict(gf.metadata)
    finally:
        close = getattr(gf, "close", None)
        if close:
            close()


@functools.lru_cache(maxsize=None)
def pyllm_tokenizer(key: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_metadata(key))


@functools.lru_cache(maxsize=None)
def llama_cpp_refs():
    if not os.path.exists(REFS_PATH):
        return None
    with open(REFS_PATH, encoding="utf-8") as f:
        return json.load(f)


def encode_like(tok: Tokenizer, text: str, add_special: bool, special: bool):
    # llama.cpp's add_special adds BOS only where the vocabulary asks for it: pyllm's add_bos=None
    return tok.encode(text, add_bos=None if add_special else False, special=special)


# ---------------------------------------------------------------------------------------------- llama.cpp
@pytest.mark.parametrize("key", MODELS)
def test_matches_llama_cpp(key):
    refs = llama_cpp_refs()
    if refs is None or key not in refs["models"]:
        pytest.skip("no pinned llama.cpp ids; run tools/make_tokenizer_refs.py")
    tok = pyllm_tokenizer(key)
    cases = refs["models"][key]["cases"]
    assert len(cases) >= 30
    assert {c["text"] for c in cases} >= set(CORPUS), "corpus changed: rerun tools/make_tokenizer_refs.py"
    bad = []
    for c in cases:
        got = encode_like(tok, c["text"], c["add_special"], c["special"])
        if got != c["ids"]:
            bad.append((c["text"], c["add_special"], c["special"], got, c["ids"]))
    assert not bad, "\n".join(f"{t!r} add_special={a} special={s}:\n  pyllm {g}\n  llama {w}" for t, a, s, g, w in bad)


@pytest.mark.parametrize("key", MODELS)
def test_vocab_facts_and_pieces_match_llama_cpp(key):
    refs = llama_cpp_refs()
    if refs is None or "pieces" not in refs["models"].get(key, {}):
        pytest.skip("no pinned llama.cpp vocabulary facts; run tools/make_tokenizer_refs.py")
    ref = refs["models"][key]
    tok = pyllm_tokenizer(key)
    assert (tok.n_vocab, tok.bos_id, tok.eos_id, tok.add_bos) == (ref["n_vocab"], ref["bos"], ref["eos"], ref["add_bos"])
    assert sorted(tok.eog_ids) == ref["eog"]
    for i, with_special, without in ref["pieces"]:
        assert tok.token_bytes(i).hex() == with_special, (i, tok.token_text(i))
        assert tok.token_bytes(i, skip_special=True).hex() == without, (i, tok.token_text(i))


def test_smollm_digits_split_first_like_llama_cpp():
    tok = pyllm_tokenizer("smollm2")
    assert tok.encode("a  1", add_bos=False) == [81, 256, 33]
    assert tok.encode("\n\n  1. Definitions.", add_bos=False) == [39892, 33, 30, 39331, 30]


# ---------------------------------------------------------------------------------------------- transformers
@pytest.mark.parametrize("key", MODELS)
def test_matches_transformers_except_pinned_differences(key):
    hf = hf_tokenizer(key)
    tok = pyllm_tokenizer(key)
    agree_wrong, differ_now = [], []
    for text in CORPUS:
        ours = tok.encode(text, add_bos=False)
        theirs = hf.encode(text, add_special_tokens=False)
        if text in HF_DIFFERS[key]:
            if ours == theirs:
                differ_now.append(text)
        elif ours != theirs:
            agree_wrong.append((text, ours, theirs))
    assert not agree_wrong, "\n".join(f"{t!r}\n  pyllm {o}\n  hf    {h}" for t, o, h in agree_wrong)
    assert not differ_now, f"listed as differing from transformers but now equal: {differ_now}"


# ---------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("key", MODELS)
def test_round_trip(key):
    tok = pyllm_tokenizer(key)
    for text in CORPUS + NON_SPECIAL:
        if tok.kind == "spm" and "\u2581" in text:
            continue  # sentencepiece spells spaces as U+2581, so a literal one decodes as a space (llama.cpp too)
        for special in (True, False):
            ids = tok.encode(text, add_bos=False, special=special)
            assert tok.decode(ids) == text, (text, special, ids)
            assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


@pytest.mark.parametrize("key", MODELS)
def test_stream_decoder_yields_whole_characters(key):
    tok = pyllm_tokenizer(key)
    for text in ["emoji: 🦙🚀👩‍👩‍👧‍👦 🇫🇷 ❤️ 👍🏽", "日本語のテキストと中文文本，한국어 텍스트。", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok"]:
        ids = tok.encode(text, add_bos=False)
        dec = StreamDecoder(tok)
        pieces = [dec.push(i) for i in ids] + [dec.flush()]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)
        # some token must have carried a partial character for this test to mean anything
        assert any(len(tok.token_bytes(i).decode("utf-8", "replace")) != len(tok.token_bytes(i).decode("utf-8", "ignore")) for i in ids) or key == "gemma3"


def test_stream_decoder_holds_back_then_replaces_invalid_bytes():
    tok = pyllm_tokenizer("qwen2")
    byte_ids = {}
    for i in range(tok.n_vocab):
        b = tok.token_bytes(i)
        if len(b) == 1 and b[0] >= 0x80:
            byte_ids[b[0]] = i
    dec = StreamDecoder(tok)
    # "é" = C3 A9: nothing comes out until the second byte arrives
    assert dec.push(byte_ids[0xC3]) == ""
    assert dec.push(byte_ids[0xA9]) == "é"
    # a lone continuation byte can never complete: replaced at once
    assert dec.push(byte_ids[0xA9]) == "\ufffd"
    # a multi-byte sequence's first byte, then ASCII: that first byte is invalid once the ASCII arrives
    assert dec.push(byte_ids[0xE6]) == ""
    assert dec.push(tok.encode("a", add_bos=False)[0]) == "\ufffda"
    # an incomplete sequence at the end comes out as U+FFFD on flush
    assert dec.push(byte_ids[0xF0]) == ""
    assert dec.flush() == "\ufffd"


# ---------------------------------------------------------------------------------------------- vocab facts
def test_special_ids_and_eog():
    s = pyllm_tokenizer("smollm2")
    assert (s.kind, s.n_vocab, s.bos_id, s.eos_id, s.add_bos) == ("bpe", 49152, 1, 2, False)
    assert s.token_text(2) == "<|im_end|>" and s.is_eog(2) and s.is_eog(0)  # <|endoftext|>
    assert not s.is_eog(1)

    q = pyllm_tokenizer("qwen2")
    assert (q.kind, q.bos_id, q.eos_id, q.add_bos) == ("bpe", 151643, 151645, False)
    names = {q.token_text(i) for i in q.eog_ids}
    # llama.cpp: eos, <|endoftext|>, </s>, and the FIM pad/repo/file-separator tokens end generation
    assert names == {"<|im_end|>", "<|endoftext|>", "</s>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
    assert q.encode("</s>", add_bos=False) == [q.token_id("</s>")]
    assert len(q.encode("</s>", add_bos=False, special=False)) > 1
    assert q.decode(q.encode("a</s>b", add_bos=False), skip_special=True) == "ab"

    g = pyllm_tokenizer("gemma3")
    assert (g.kind, g.n_vocab, g.bos_id, g.eos_id, g.add_bos) == ("spm", 262144, 2, 1, True)
    # "</s>" is in Gemma's vocabulary, so llama.cpp's text rule makes it end generation too
    assert {g.token_text(i) for i in g.eog_ids} == {"<eos>", "<end_of_turn>", "</s>"}
    assert g.encode("hi")[0] == 2 and g.encode("hi", add_bos=False)[0] != 2
    assert g.token_bytes(g.token_id("<0x41>")) == b"A"
    assert g.token_bytes(g.token_id("\u2581the")) == b" the"


def test_skip_special_and_token_text():
    tok = pyllm_tokenizer("smollm2")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_bos=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special=True) == "user\nhi"
    assert tok.token_text(ids[0]) == "<|im_start|>"
    assert tok.token_text(tok.encode(" hello", add_bos=False)[0]) == "\u0120hello"
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([tok.n_vocab])


# ---------------------------------------------------------------------------------------------- special tokens
def _st_partition_reference(tok: Tokenizer, text: str, special: bool, plain) -> list:
    """llama.cpp's tokenizer_st_partition written out plainly: special tokens longest first (then by id), each cut
    out of the text still unclaimed wherever it occurs, left to right; inside ``plain`` ranges only user-defined
    tokens, and only wholly inside."""
    table = tok._special_all if special else tok._special_user
    guard = set()
    for a, b in plain:
        guard.update(range(max(a, 0), min(b, len(text))))
    claimed = [False] * len(text)
    accepted = []
    for t, tid in sorted(table.items(), key=lambda kv: (-len(kv[0]), kv[1])):
        p = text.find(t)
        while p >= 0:
            span = range(p, p + len(t))
            allowed = not guard.intersection(span) or (t in tok._special_user and guard.issuperset(span))
            if allowed and not any(claimed[i] for i in span):
                for i in span:
                    claimed[i] = True
                accepted.append((p, p + len(t), tid))
                p = text.find(t, p + len(t))
            else:
                p = text.find(t, p + 1)
    parts, pos = [], 0
    for p, end, tid in sorted(accepted):
        parts += ([text[pos:p]] if p > pos else []) + [tid]
        pos = end
    return parts + ([text[pos:]] if pos < len(text) else [])


def _runs_vocab() -> Tokenizer:
    """Byte-level vocabulary whose special tokens overlap every way: runs of one character (as Gemma's runs of
    spaces), tokens inside longer ones, control and user-defined tokens of one length."""
    base = ["a", "b", " ", "\n", "<", ">", "x"]
    specials = [(" " * k, 4) for k in range(2, 7)] + [
        ("\n", 3), ("\n\n", 3), ("\n\n\n", 4), ("<x>", 3), ("<x><x>", 4), ("x>", 4), ("ab", 3), ("aba", 4),
        ("bab", 3), ("a a", 4), ("  a", 3), ("bbbb", 4), ("b", 4), ("<<", 3)]
    return Tokenizer.from_gguf({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.merges": [],
        "tokenizer.ggml.tokens": base + [t for t, _ in specials],
        "tokenizer.ggml.token_type": [1] * len(base) + [ty for _, ty in specials]})


def test_special_partition_is_llama_cpps():
    """Reference: llama.cpp's partition written out token by token (_st_partition_reference), on random texts
    with random content ranges, special tokens on and off."""
    import random

    tok = _runs_vocab()
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice("ab <x>\n  b") for _ in range(rng.randint(0, 30)))
        plain = [sorted((rng.randint(0, len(text)), rng.randint(0, len(text)))) for _ in range(rng.randint(0, 3))]
        special = rng.random() < 0.7
        assert tok._partition(text, special, plain) == _st_partition_reference(tok, text, special, plain), \
            (text, special, plain)


def test_long_runs_of_a_special_character_take_bounded_memory():
    """Gemma's vocabulary has user-defined tokens for runs of 2-31 spaces, tabs and newlines. Every position of a
    run was a candidate for every run length, so 200,000 spaces took 14 s and 435 MB to cut (bytes the server
    accepts in one request). Reference: the memory of the text itself; the pieces are llama.cpp's (31 spaces
    each, then what is left)."""
    import tracemalloc

    tok = Tokenizer.from_gguf({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.merges": [],
        "tokenizer.ggml.tokens": ["a"] + [" " * k for k in range(2, 32)],
        "tokenizer.ggml.token_type": [1] + [4] * 30})
    text = " " * 50_000
    tracemalloc.start()
    try:
        parts = tok._partition(text, True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert parts == [tok.token_id(" " * 31)] * (50_000 // 31) + [tok.token_id(" " * (50_000 % 31))]
    assert peak < 2**20 + 2 * len(text), peak


@pytest.mark.parametrize("key", MODELS)
def test_min_tokens_is_a_lower_bound(key):
    """Tokenizer.min_tokens refuses prompts that cannot fit without tokenizing them, so it must never exceed the
    true count (a prompt that fits would be refused). Reference: encode()'s own count, on the corpus, on texts of
    the vocabulary's densest tokens (most bytes, letters and digits, non-ASCII bytes), bytes a vocabulary drops
    (SmolLM2 has no token for 0x04), special tokens, and escaped spaces."""
    tok = pyllm_tokenizer(key)
    pieces = [tok.token_bytes(i).decode("utf-8", "replace") for i in range(tok.n_vocab)]
    alnum = re.compile(r"[0-9A-Za-z]")
    texts = list(CORPUS)
    for weight in (lambda p: len(p.encode()), lambda p: len(alnum.findall(p)),
                   lambda p: sum(b >= 0x80 for b in p.encode())):
        dense = sorted(range(tok.n_vocab), key=lambda i: -weight(pieces[i]))[:40]
        texts += ["".join(pieces[i] for i in dense) * 3, " ".join(pieces[i] for i in dense),
                  pieces[dense[0]] * 50]
    specials = [tok.token_text(i) for i in range(tok.n_vocab) if tok.is_special(i)][:200]
    texts += ["\x04" * 500, "a\x04\x06\x13b" * 100, "".join(specials) * 2, "\u2581" * 300,
              "".join(chr(c) for c in range(1, 0x3000, 7)), "\ud800 lone surrogate"]
    for text in texts:
        for add_bos in (False, None):
            assert tok.min_tokens(text, add_bos) <= len(tok.encode(text, add_bos=add_bos)), (text[:80], add_bos)
    assert tok.min_tokens("word " * 10_000) >= 900  # a useful bound, not 0: at most 41 letters in one token


def test_build_is_fast():
    md = dict(gguf_metadata("qwen2"))
    # one token renamed: a vocabulary no tokenizer in this process holds, so the model is built, not reused
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"][:-1] + ["<|not-a-token-of-qwen|>"]
    t = time.process_time()
    Tokenizer.from_gguf(md)
    # ~0.4 s on an idle core; generous so a busy CI box does not flake
    assert time.process_time() - t < 5.0


# ---------------------------------------------------------------------------------------------- bad metadata
def _tiny_md(**over):
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>"],
        "tokenizer.ggml.token_type": [1, 1, 1, 3],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 3,
        "tokenizer.ggml.eos_token_id": 3,
    }
    md.update(over)
    return {k: v for k, v in md.items() if v is not None}


def test_tiny_vocab_works():
    tok = Tokenizer.from_gguf(_tiny_md())
    assert tok.encode("abab<|end|>", add_bos=False) == [2, 2, 3]
    assert tok.is_eog(3)


def _tiny_spm_md(score_a: float, score_ab: float) -> dict:
    # "ab" reads as "\u2581ab": whether "\u2581a" or "ab" merges first follows the two scores
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "\u2581", "a", "b",
                                                                       "\u2581a", "ab"],
            "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1],
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -1.0, -1.0, score_a, score_ab],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


def test_a_vocabulary_in_use_is_built_once_and_any_difference_builds_its_own():
    """Reference: the tokenizers-library model each tokenizer holds (its identity) and what each encodes. A second
    build of a vocabulary while the first tokenizer lives takes the first's model; a vocabulary that differs in one
    token, merge, type or score gets a model of its own, which encodes as that vocabulary alone would."""
    held = Tokenizer.from_gguf(_tiny_md())
    assert Tokenizer.from_gguf(_tiny_md())._backend is held._backend
    variants = {  # metadata, "abab" encoded
        "no merge": (_tiny_md(**{"tokenizer.ggml.merges": []}), [0, 1, 0, 1]),
        "another token": (_tiny_md(**{"tokenizer.ggml.tokens": ["a", "b", "ba", "<|end|>"],
                                      "tokenizer.ggml.merges": ["b a"]}), [0, 2, 1]),
        "another type": (_tiny_md(**{"tokenizer.ggml.token_type": [1, 1, 4, 3]}), [2, 2]),
    }
    for what, (md, ids) in variants.items():
        tok = Tokenizer.from_gguf(md)
        assert tok._backend is not held._backend, what
        assert tok.encode("abab", add_bos=False) == ids, what
    spm_a = Tokenizer.from_gguf(_tiny_spm_md(-0.5, -0.9))
    spm_ab = Tokenizer.from_gguf(_tiny_spm_md(-0.9, -0.5))
    assert spm_ab._backend is not spm_a._backend
    assert (spm_a.encode("ab", add_bos=False), spm_ab.encode("ab", add_bos=False)) == ([6, 5], [3, 7])


@pytest.mark.parametrize(
    "over, match",
    [
        ({"tokenizer.ggml.token_type": [1, 1, 1]}, "token_type has 3 entries but tokenizer.ggml.tokens has 4"),
        ({"tokenizer.ggml.bos_token_id": 99}, "bos_token_id = 99 is out of range"),
        ({"tokenizer.ggml.eos_token_id": -1}, "eos_token_id = -1 is out of range"),
        ({"tokenizer.ggml.model": "t5"}, "tokenizer.ggml.model = 't5' is not supported"),
        ({"tokenizer.ggml.model": None}, "lacks 'tokenizer.ggml.model'"),
        ({"tokenizer.ggml.tokens": None}, "lacks 'tokenizer.ggml.tokens'"),
        ({"tokenizer.ggml.merges": None}, "lacks 'tokenizer.ggml.merges'"),
        ({"tokenizer.ggml.pre": "klingon"}, "tokenizer.ggml.pre = 'klingon' is not supported"),
        ({"tokenizer.ggml.merges": ["ab"]}, r"merges\[0\] = 'ab' is not two tokens"),
        ({"tokenizer.ggml.tokens": "abc"}, "expected an array"),
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": [0.0]}, "scores has 1 entries"),
        # an array of arrays, or of numbers, where the token strings belong
        ({"tokenizer.ggml.tokens": ["a", ["b"], "ab", "<|end|>"]}, r"tokens\[1\] = \['b'\] \(list\) is not a string"),
        ({"tokenizer.ggml.tokens": ["a", "b", 7, "<|end|>"]}, r"tokens\[2\] = 7 \(int\) is not a string"),
        # bytes that are not UTF-8 (kept by the reader as surrogate escapes): named, not a tokenizers-library error
        ({"tokenizer.ggml.tokens": ["a", "b", "ab", "<|\udcff|>"]}, r"tokens\[3\] = b'<\|\\xff\|>' is not valid UTF-8"),
        ({"tokenizer.ggml.token_type": [1, 1, "1", 3]}, r"token_type\[2\] = '1' \(str\) is not an integer"),
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": [0.0, 0.0, "x", 0.0]},
         r"scores\[2\] = 'x' \(str\) is not a number"),
    ],
)
def test_bad_metadata_names_field_and_value(over, match):
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_gguf(_tiny_md(**over))


def test_add_bos_defaults_follow_llama_cpp():
    # llama 3 vocabularies get BOS unless the file says otherwise; the file's flag always wins
    assert Tokenizer.from_gguf(_tiny_md(**{"tokenizer.ggml.pre": "llama-bpe"})).add_bos is True
    md = _tiny_md(**{"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": False})
    assert Tokenizer.from_gguf(md).add_bos is False
    assert Tokenizer.from_gguf(_tiny_md()).add_bos is False
    tok = Tokenizer.from_gguf(_tiny_md(**{"tokenizer.ggml.add_bos_token": True}))
    assert tok.encode("ab") == [3, 2] and tok.encode("ab", add_bos=False) == [2]
