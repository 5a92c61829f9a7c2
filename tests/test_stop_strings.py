"""pyllm.runtime.stop_strings.StopStrings against a direct definition: the output ends before the first stop string
to appear (under ``accepts``, the first that follows a text it accepts); the reference scans every end position."""

import random

import pytest

from pyllm.runtime.stop_strings import StopStrings

ALPHABET = "ab()\n"


def expected(text: str, stop: list[str], accepts=None) -> tuple[str, bool]:
    """The reference: at the first end position where stop strings complete, the longest (earliest start) ends it."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stop if s and text[:end].endswith(s)
                  and (accepts is None or accepts(text[:end - len(s)]))]
        if starts:
            return text[:min(starts)], True
    return text, False


def feed(text: str, stop: list[str], accepts, sizes) -> tuple[str, bool]:
    st, out, i = StopStrings(stop, accepts), "", 0
    while i < len(text) and not st.stopped:
        n = next(sizes)
        got = st.push(text[i:i + n])
        assert st.released.endswith(got) and text.startswith(st.released)
        out += got
        i += n
    if not st.stopped:
        out += st.flush()
    assert out == st.released
    return out, st.stopped


def test_stop_strings_match_the_direct_definition_on_random_text():
    """Text arriving a character at a time with several stop strings; in random pieces with one (pieces decide
    which of two overlapping stop strings is found first, as tokens do)."""
    rng = random.Random(0)
    balanced = lambda t: t.count("(") == t.count(")")  # noqa: E731 (a stand-in grammar: complete when balanced)
    ones = iter(lambda: 1, None)
    pieces = iter(lambda: rng.randint(0, 4), None)
    for _ in range(3000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 30)))
        stop = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 3))]
        for accepts in (None, balanced):
            assert feed(text, stop, accepts, ones) == expected(text, stop, accepts), (text, stop, accepts)
            assert feed(text, stop[:1], accepts, pieces) == expected(text, stop[:1], accepts), (text, stop, accepts)


def test_text_is_held_back_only_while_a_stop_string_may_be_forming():
    """Only the tail that begins a stop string waits (a stream does not lag by the longest stop string's length
    on text that cannot start one)."""
    st = StopStrings(["END"])
    assert st.push("abcE") == "abc" and st.push("N") == "" and st.push("D") == "" and st.stopped
    assert st.released == "abc"
    st = StopStrings(["END"])
    assert st.push("xEN") == "x" and st.push("d") == "ENd" and st.flush() == "" and not st.stopped
    st = StopStrings(["\n\nUser:", "###"])
    assert st.push("hello") == "hello" and st.push(" #") == " " and st.push("#x") == "##x"
    assert st.push("ok\n") == "ok" and st.push("\nUs") == "" and st.push("ed") == "\n\nUsed"
    assert StopStrings([]).push("abc") == "abc"


def test_stop_list_reads_one_string_as_one_stop_string():
    """OpenAI and llama-cpp-python take stop as a string or a list of strings; iterated, "END" was the stop strings
    "E", "N" and "D". Empty strings would end every output at once and are dropped; other types are refused."""
    import pytest

    from pyllm.errors import PyllmError
    from pyllm.runtime.stop_strings import stop_list

    assert stop_list("END") == ["END"] and stop_list(None) == [] and stop_list("") == []
    assert stop_list(["a", "", "b"]) == ["a", "b"] and stop_list(("a",)) == ["a"]
    for bad in (["x", 5], 5, b"x", {"x": 1}):
        with pytest.raises(PyllmError, match="stop must be a string or a list of strings"):
            stop_list(bad)


# ---- OutputText: tokens -> text, ending with the bytes a generation left incomplete -------------------------------

def _tokenizer(key):
    from conftest import fixture_path

    from pyllm.formats.gguf import open_gguf
    from pyllm.tokenizer import Tokenizer

    with open_gguf(fixture_path(key)) as gf:
        return Tokenizer.from_gguf(gf.metadata)


def _byte_token(tok, byte: int) -> int:
    """The id of the token that is the one byte ``byte``: a byte-fallback token (<0xE2>, SentencePiece) or the
    byte-level BPE symbol for it."""
    from pyllm.tokenizer import _gpt2_byte_table

    tid = tok.token_id(f"<0x{byte:02X}>")
    if tid is None:
        tid = tok.token_id(_gpt2_byte_table()[byte])
    assert tid is not None and tok.token_bytes(tid) == bytes([byte])
    return tid


def _sequences(tok):
    """Token sequences ending inside a character, or holding bytes that never make one, and their bytes."""
    hi, lo = tok.encode("hi", add_bos=False), tok.encode(" there", add_bos=False)
    e2, x82, xac = (_byte_token(tok, b) for b in (0xE2, 0x82, 0xAC))
    return [hi + [e2], hi + [e2, x82], hi + [e2, x82, xac], [e2] + lo, hi + [e2, x82] + lo + [e2],
            hi + [x82], hi + [e2, e2], [e2]]


@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_output_text_ends_an_incomplete_character_as_replacement(key):
    """Generation that ended with a character's first bytes pending (a byte-fallback token, then the stop
    token or max_tokens) lost them: the text ended one character short. Reference: bytes.decode("utf-8",
    errors="replace") of the tokens' bytes, what llama.cpp and Hugging Face's decode(..., errors="replace")
    give, whole or streamed, with and without a stop string that never appears."""
    from pyllm.runtime.stop_strings import OutputText

    tok = _tokenizer(key)
    for ids in _sequences(tok):
        want = tok.decode(ids)
        assert want == b"".join(tok.token_bytes(t) for t in ids).decode("utf-8", errors="replace").removeprefix(
            " " if tok.kind == "spm" and want[:1] != " " else "")
        for stop in ([], ["zz"], ["\ufffdq"]):
            text = OutputText(tok, stop)
            pieces = [text.push(t) for t in ids]
            assert "".join(pieces) + text.finish() == want, (key, ids, stop)
            assert text.finish() == ""  # once: a second call adds nothing


@pytest.fixture(scope="module")
def forced_llm():
    """SmolLM2 whose generate_tokens yields ``forced_llm.forced`` (truncated to max_tokens) instead of sampling:
    every text path above it, library and OpenAI API (the server's), sees those tokens."""
    from conftest import pyllm_model

    llm = pyllm_model("smollm2", n_ctx=256, n_threads=1)

    def generate_tokens(ids, max_tokens=256, **kw):
        llm.generator.stats.finish_reason = "eog"
        yield from llm.forced[:max_tokens]

    llm.generate_tokens = generate_tokens
    yield llm
    del llm.generate_tokens


@pytest.mark.parametrize("end", ["eog", "max_tokens"])
def test_every_text_path_ends_an_incomplete_character_as_replacement(forced_llm, end, monkeypatch, capsys):
    """Reference: tokenizer.decode (errors="replace") of the tokens before the end. The OpenAI API (what the
    server answers) dropped the pending bytes when the stop token ended the reply; the CLI prints the library's."""
    import json

    import pyllm
    from conftest import cli_in_process

    llm, tok = forced_llm, forced_llm.tokenizer
    body = tok.encode("hi", add_bos=False) + [_byte_token(tok, 0xE2), _byte_token(tok, 0x82)]
    llm.forced = body + ([tok.eos_id] if end == "eog" else [])
    n = len(body) if end == "max_tokens" else 20
    want = tok.decode(body)
    assert want.endswith("\ufffd")
    msgs = [{"role": "user", "content": "x"}]
    assert llm.generate("x", max_tokens=n) == want
    assert "".join(llm.generate("x", max_tokens=n, stream=True)) == want
    assert llm.generate("x", max_tokens=n, stop=["zz"]) == want
    assert llm.chat(msgs, max_tokens=n) == want
    assert "".join(llm.chat(msgs, max_tokens=n, stream=True)) == want
    assert llm.create_completion("x", max_tokens=n)["choices"][0]["text"] == want
    chunks = llm.create_completion("x", max_tokens=n, stream=True)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
    assert llm.create_chat_completion(msgs, max_tokens=n)["choices"][0]["message"]["content"] == want
    chunks = llm.create_chat_completion(msgs, max_tokens=n, stream=True)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == want
    # the CLI's run prints what the library streams
    monkeypatch.setattr("pyllm.llm.load", lambda *a, **kw: llm)
    cli = cli_in_process(monkeypatch, capsys)
    res = cli("run", "smollm2-135m", "x", "-n", str(n), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["text"] == want, res
