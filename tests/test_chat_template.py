"""pyllm.chat_template: the GGUF's own template rendered exactly as transformers renders it, the fallbacks, and
the sandbox holding against hostile templates."""

from __future__ import annotations

import time

import pytest

from conftest import hf_tokenizer
from pyllm.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, MAX_OUTPUT_CHARS, ChatTemplate
from pyllm.errors import ContextFullError, TemplateError
from test_tokenizer import gguf_metadata, pyllm_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "  How are you?\n\nAnd the weather? 🌧️ <b>&amp;</b>  "},
    ],
    [
        {"role": "user", "content": "Write code"},
        {"role": "assistant", "content": "```python\nprint('hi')\n```"},
        {"role": "user", "content": "Thanks"},
    ],
]


def template_for(key: str) -> ChatTemplate:
    return ChatTemplate.from_metadata(gguf_metadata(key), pyllm_tokenizer(key))


@pytest.mark.parametrize("key", ["smollm2", "qwen2"])
def test_file_template_matches_transformers(key):
    tmpl = template_for(key)
    assert not tmpl.is_fallback
    hf = hf_tokenizer(key)
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert tmpl.render(conv, add_generation_prompt=gen) == want, conv


def test_gemma3_has_no_template_in_file_and_gets_gemma_format():
    md = gguf_metadata("gemma3")
    assert "tokenizer.chat_template" not in md
    tmpl = template_for("gemma3")
    assert tmpl.is_fallback
    got = tmpl.render(CONVERSATIONS[2])
    assert got == (
        "<bos><start_of_turn>user\nYou answer in French.\n\nHello<end_of_turn>\n"
        "<start_of_turn>model\nBonjour !<end_of_turn>\n"
        "<start_of_turn>user\nHow are you?\n\nAnd the weather? 🌧️ <b>&amp;</b><end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    # the rendered prompt starts with the BOS text, which the tokenizer turns into the BOS id
    tok = pyllm_tokenizer("gemma3")
    ids = tok.encode(got, add_bos=False)
    assert ids[:2] == [tok.bos_id, tok.token_id("<start_of_turn>")]


def test_fallbacks():
    chatml = ChatTemplate(None, "", "")
    assert chatml.is_fallback and chatml.source == CHATML_TEMPLATE
    assert chatml.render(CONVERSATIONS[1]) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    class Plain:  # a vocabulary with neither ChatML nor Gemma turn markers
        bos_id, eos_id = 0, 1

        def token_text(self, i):
            return ["<s>", "</s>"][i]

        def token_id(self, text):
            return None

    plain = ChatTemplate.from_metadata({}, Plain())
    assert plain.render(CONVERSATIONS[3], add_generation_prompt=True) == (
        "<s>User: Write code\nAssistant: ```python\nprint('hi')\n```</s>\nUser: Thanks\nAssistant:"
    )


def test_globals_filters_and_kwargs():
    t = ChatTemplate(
        "{{ bos_token }}|{{ messages | tojson }}|{{ {'b': '<&>'} | tojson(indent=1) }}|{{ strftime_now('%Y') }}|{{ x }}",
        bos_token="<B>",
        eos_token="<E>",
    )
    out = t.render([{"role": "user", "content": "é"}], x=7)
    assert out.startswith('<B>|[{"role": "user", "content": "é"}]|{\n "b": "<&>"\n}|')
    assert out.endswith(f"|{time.strftime('%Y')}|7")
    # trim_blocks/lstrip_blocks as in transformers
    t2 = ChatTemplate("{% for m in messages %}\n    {{ m.content }}\n{% endfor %}", "", "")
    assert t2.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "    a\n    b\n"


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "messages must be a list"),
        ([("user", "hi")], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\]\['role'\] must be a non-empty string"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] must be a string, got int"),
        ([{"role": "user", "content": "ok"}, {"role": "user"}], r"messages\[1\]\['content'\]"),
    ],
)
def test_messages_validated(messages, match):
    with pytest.raises(TemplateError, match=match):
        ChatTemplate(None, "", "").render(messages)


@pytest.mark.parametrize(
    "source, match",
    [
        ("{{ ''.__class__.__mro__ }}", "forbids"),
        ("{{ ''.__class__ }}", "forbids"),
        ("{{ cycler.__init__.__globals__ }}", "forbids"),
        ("{{ raise_exception.__globals__ }}", "forbids"),
        ("{{ messages.__class__.__subclasses__() }}", "forbids"),
        ("{{ messages.append(1) }}", "forbids"),
        ("{% for i in range(10**9) %}x{% endfor %}", "range|exhausted|limit|forbids"),
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "within"),
        ("{% for i in range(99999) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}{% endfor %}", "exceeds"),
        ("{{ 'x' * 10**9 }}", "limit|forbids"),
        ("{{ 'x'.ljust(10**10) }}", "limit|forbids"),
        ("{{ 7 ** 999999 }}", "too large"),
        # single operations that allocate hundreds of MB before any output check (docs/SECURITY.md)
        ("{{ '%0200000000d' % 1 }}", "width or precision"),
        ("{{ '{:>200000000}'.format(1) }}", "width or precision"),
        ("{{ ('x' * 100000).replace('x', 'y' * 1000) }}", "larger than the output limit"),
        ("{{ ('a' * 1000000) | replace('a', 'aaaaaaaaaa') }}", "larger than the output limit"),
        ("{{ lipsum(20000) }}", "undefined"),
        ("{{ raise_exception('x') }}", "raised an error: x"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "exhausted|failed"),
        ("{{ messages[0]['content'] + 1 }}", "failed: TypeError"),
        ("{% if %}", "syntax error"),
    ],
)
def test_hostile_or_broken_templates_raise_quickly(source, match):
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match=match):
        ChatTemplate(source, "", "").render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("source", [CHATML_TEMPLATE, GEMMA_TEMPLATE])
@pytest.mark.parametrize("sizes", [[1_200_000], [600_000, 600_000]])
def test_messages_longer_than_the_output_limit_are_a_context_error(source, sizes):
    """Content of over a megabyte reached the sandbox's output limit (or its value limit, in Gemma's |trim) and
    was reported as a runaway template: the request, not the template, is what is too long. Reference: OpenAI's
    context_length_exceeded for too-long input, which the server gives a ContextFullError; the limit is named."""
    msgs = [{"role": ("user", "assistant")[i % 2], "content": "word " * (n // 5)} for i, n in enumerate(sizes)]
    with pytest.raises(ContextFullError, match=f"hold {sum(sizes)} characters .* exceeds {MAX_OUTPUT_CHARS}"):
        ChatTemplate(source, "<bos>", "<eos>").render(msgs)
    # a template that is runaway on its own stays the template's error, whatever the content
    runaway = "{% for i in range(99999) %}{{ messages[0]['content'] * 20 }}{% endfor %}"
    with pytest.raises(TemplateError, match="exceeds|limit"):
        ChatTemplate(runaway, "", "").render(msgs)


def test_ordinary_formatting_still_works():
    src = "{{ '%5d' % 3 }}|{{ '{:>3}'.format(1) }}|{{ 'ab'.replace('a', 'c') }}"
    assert ChatTemplate(src, "", "").render([]) == "    3|  1|cb"


def test_template_errors_do_not_leave_a_tracer_installed():
    import sys

    before = sys.gettrace()
    with pytest.raises(TemplateError):
        ChatTemplate("{{ raise_exception('boom') }}", "", "").render([])
    assert sys.gettrace() is before


@pytest.mark.parametrize("source", [
    "{% for m in messages %}{{ m.content | tojson }}{% endfor %}",
    "{% for m in messages %}{{ m.content | escape }}{% endfor %}",
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{% endfor %}",
])
def test_a_template_that_escapes_the_users_words_still_renders_them(source):
    # the check that a template rendered the user's message looks for its text as written and in the forms a
    # template's tojson / escape filters give it (quotes, newlines, <, &, non-ASCII); a template that drops the
    # message is refused (test_robustness.py HOSTILE)
    words = '  Say "hi" & <b>bold</b>\nin 日本語, it\'s fine  '
    out = ChatTemplate(source, "", "").render([{"role": "user", "content": words}])
    assert "hi" in out
    with pytest.raises(TemplateError, match="does not render the user's message"):
        ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}", "", "").render(
            [{"role": "user", "content": words}])
