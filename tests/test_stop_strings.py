"""pyllm.runtime.stop_strings.StopStrings against a direct definition: the output ends before the first stop string
to appear (under ``accepts``, the first that follows a text it accepts); the reference scans every end position."""

import random

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
