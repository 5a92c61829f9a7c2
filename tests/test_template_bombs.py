"""Template bombs: templates that do their damage inside one built-in call (big-int arithmetic, string and list
doubling, huge widths, deep nesting), where neither the output cap nor the render deadline can act.

Reference: each template must end in TemplateError -- at compile time or at render -- in well under the render
deadline plus a margin (5 s on a loaded 2-core machine), and the whole corpus must grow a fresh process's peak RSS
by less than 256 MiB (the unbounded versions allocate gigabytes or never finish). A model whose template is a bomb
still loads, and ``use_fallback_template`` (the CLI's --plain-template) routes around it.
"""

from __future__ import annotations

import time

import pytest

from pyllm.chat_template import ChatTemplate
from pyllm.errors import PyllmError, TemplateError

MSGS = [{"role": "user", "content": "hi"}]
NEST = 300

BOMBS = {
    "int squaring": "{% set x = namespace(v=10**4000) %}{% for i in range(40) %}{% set x.v = x.v * x.v %}"
                    "{% endfor %}{{ x.v > 0 }}",
    "power tower": "{{ (999999 ** 4096) ** 4096 }}",
    "int mul chain": "{% set n = namespace(v=7) %}{% for i in range(100000) %}{% set n.v = n.v * 12345678901234567 %}"
                     "{% endfor %}{{ n.v > 1 }}",
    "tilde doubling": "{% set s = namespace(v='ab') %}{% for i in range(40) %}{% set s.v = s.v ~ s.v %}{% endfor %}"
                      "{{ s.v|length }}",
    "plus string doubling": "{% set s = namespace(v='ab') %}{% for i in range(40) %}{% set s.v = s.v + s.v %}"
                            "{% endfor %}{{ s.v|length }}",
    "plus list doubling": "{% set s = namespace(v=[1, 2]) %}{% for i in range(40) %}{% set s.v = s.v + s.v %}"
                          "{% endfor %}{{ s.v|length }}",
    "star repetition": "{{ ('a' * 1000) * 1000000 }}",
    "star list": "{{ ([0] * 1000000) * 1000 }}",
    "format filter width": "{{ '%0999999d%0999999d%0999999d'|format(1, 2, 3) }}",
    "format star width": "{{ ('%*d' * 1000) % ((999999, 1) * 1000) }}",
    "str.format nested width": "{{ ('{:{w}}' * 100000).format('a', w=999999) }}",
    "center filter": "{{ 'x'|center(2000000000) }}",
    "center constant folded": "{{ 'x'|center(999999) ~ 'y'|center(999999) }}",
    "indent huge prefix": "{{ ('a\n' * 100000)|indent('p' * 100000, true) }}",
    "indent width": "{{ ('a\n' * 100000)|indent(999999, true) }}",
    "wordwrap wrapstring": "{{ ('a ' * 400000)|wordwrap(1, true, 'w' * 100000) }}",
    "join separator": "{{ range(100000)|join('s' * 1000000) }}",
    "str.join method": "{{ ('s' * 999999).join(range(100000)|map('string')|list) }}",
    "tojson indent": "{{ [[[[1]]]]|tojson(indent=100000000) }}",
    "tojson indent string": "{{ [[[[1]]]]|tojson(indent='x' * 100000) }}",
    "replace filter": "{{ ('a' * 1000000)|replace('a', 'aaaaaaaaaa')|replace('a', 'aaaaaaaaaa') }}",
    "expandtabs": "{{ ('\t' * 100000).expandtabs(999999) }}",
    "ljust": "{{ 'a'.ljust(2000000000) }}",
    "range": "{{ range(10**12)|list|length }}",
    "nested parens": "{{ " + "(" * NEST + "1" + ")" * NEST + " }}",
    "nested if": "{% if true %}" * NEST + "x" + "{% endif %}" * NEST,
    "nested for": "{% for a in [1] %}" * NEST + "x" + "{% endfor %}" * NEST,
    "nested lists": "{{ " + "[" * NEST + "]" * NEST + " }}",
    "deep filter chain": "{{ 'a'" + "|trim" * 3000 + " }}",
    "percent width": "{{ '%0200000000d' % 1 }}",
    "lipsum": "{{ lipsum(100000) }}",
    # one long string referenced many times: a few elements, whose text C builds all at once (a gigabyte here)
    "aliased list printed": "{% set s = 'a' * 1000000 %}{{ [s] * 1000 }}",
    "aliased list |string": "{% set s = 'a' * 1000000 %}{{ ([s] * 1000)|string|length }}",
    "aliased list |tojson": "{% set s = 'a' * 1000000 %}{{ ([s] * 1000)|tojson|length }}",
    "aliased list |lower": "{% set s = 'a' * 1000000 %}{{ ([s] * 1000)|lower|length }}",
    "aliased list ~": "{% set s = 'a' * 1000000 %}{{ ([s] * 1000) ~ 'x' }}",
    "aliased str.join": "{% set s = 'a' * 1000000 %}{{ ''.join([s] * 1000) }}",
    "aliased % tuple": "{% set s = 'a' * 1000000 %}{{ ('%s' * 1000) % ((s,) * 1000) }}",
    "aliased mapping key in %": "{{ ('%(a)s' * 1000) % {'a': 'a' * 1000000} }}",
    "aliased field in str.format": "{{ ('{0}' * 1000).format('a' * 1000000) }}",
    "aliased dict printed": "{% set s = 'a' * 1000000 %}{{ dict(a=s, b=s, c=s, d=s, e=s, f=s, g=s, h=s) }}",
    "aliased argument quoted by an error": "{% set s = 'a' * 1000000 %}{{ [1].index([s] * 1000) }}",
    "aliased raise_exception message": "{% set s = 'a' * 1000000 %}{{ raise_exception([s] * 1000) }}",
    "translate table": "{{ ('a' * 1000000).translate(''.maketrans({'a': 'b' * 1000})) }}",
    # the same through a lazy sequence, which C consumes item by item past any estimate of a list
    "aliased |map |join": "{% set d = {'k': 'a' * 1000000} %}{{ ([d] * 1000)|map(attribute='k')|join }}",
    "aliased |map str.join": "{% set d = {'k': 'a' * 1000000} %}{{ ''.join(([d] * 1000)|map(attribute='k')) }}",
    "|map |sum of lists": "{% set d = {'k': ['a'] * 100000} %}{{ ([d] * 1000)|map(attribute='k')|sum(start=[]) }}",
    # each value bounded, thousands of them built by one C call
    "map center list": "{{ (['a'] * 100000)|map('center', 100000)|list|length }}",
    # quadratic in C: each addition copies every element added before it
    "sum of lists": "{{ ([[1]] * 60000)|sum(start=[])|length }}",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_template_bomb_is_a_template_error_in_bounded_time(name):
    t0 = time.monotonic()
    with pytest.raises(TemplateError):
        ChatTemplate(BOMBS[name]).render(MSGS)
    assert time.monotonic() - t0 < 5.0, name


# Run in a fresh process: ru_maxrss is the process's peak so far, which earlier tests (a model loaded, a big
# tokenizer) may already have raised past whatever a bomb builds, and the growth would then read as zero.
# The baseline is taken after a plain render, so the imports and the first compile are not counted.
_CORPUS_RSS = """
import json, resource, sys
from pyllm.chat_template import ChatTemplate
from pyllm.errors import TemplateError

msgs = [{"role": "user", "content": "hi"}]
ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}").render(msgs)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
grown = {}
for name, src in json.load(sys.stdin).items():
    try:
        ChatTemplate(src).render(msgs)
    except TemplateError:
        pass
    grown[name] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024  # KiB -> MiB
print(json.dumps(grown))
"""


def run_corpus(bombs: dict) -> dict:
    """{name: MiB the peak RSS of a fresh process had grown by once that bomb was rendered} over ``bombs``."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-c", _CORPUS_RSS], input=json.dumps(bombs), capture_output=True,
                       text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_template_bomb_corpus_bounded_memory():
    grown = run_corpus(BOMBS)
    assert list(grown) == list(BOMBS)
    names = list(grown)
    total = grown[names[-1]]
    step = {n: grown[n] - (grown[names[i - 1]] if i else 0) for i, n in enumerate(names)}
    worst = max(step, key=step.get)  # the bomb that raised the peak the most
    assert total < 256, f"peak RSS grew by {total} MiB over the corpus, {step[worst]} MiB of it at {worst!r}"


def test_an_error_quoting_a_long_value_is_one_short_line():
    # list.index quotes the value it did not find: the message was the whole million-character string
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{% set s = 'a' * 1000000 %}{{ [1].index(s) }}").render(MSGS)
    assert str(e.value).startswith("chat template failed: ValueError: 'aaa") and len(str(e.value)) < 400


def test_a_render_stopped_past_its_deadline_prints_no_traceback(monkeypatch):
    # the deadline passed inside one C call, then the output cap stopped the render: closing the abandoned
    # generator resumed it under the expired deadline's tracer, and Python printed the _Budget it raised there
    import sys

    from pyllm import chat_template

    class SlowText:
        def __str__(self):
            time.sleep(0.3)
            return "a" * (chat_template.MAX_OUTPUT_CHARS + 1)

    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.1)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(PyllmError):
        ChatTemplate("{{ slow }}").render(MSGS, slow=SlowText())
    assert not unraisable, unraisable[0].exc_value


def test_bounds_leave_real_templates_alone():
    # what real templates do: loops, concatenation, tojson with a small indent, |trim, string methods
    src = ("{% for m in messages %}{{ '<|' ~ m['role'] ~ '|>' + m['content']|trim + ('\n' * 2) }}"
           "{{ {'a': [1, 2]}|tojson(indent=2) }}{{ '%5d'|format(42) }}{{ 'x'.center(9) }}{{ 2 ** 64 }}"
           "{% endfor %}{{ '%s=%s' % ('k', 'v') }}{{ '{0}-{0}'.format('z') }}{{ [1, 'b'] }}{{ '+'.join(['p', 'q']) }}"
           "{{ '%(a)s%(a)s' % {'a': 'm'} }}{{ messages|tojson }}{{ ['a', 'b']|map('upper')|join('-') }}"
           "{{ [[1], [2]]|map('list')|sum(start=[]) }}")
    out = ChatTemplate(src).render([{"role": "user", "content": "  hi  "}])
    assert out.startswith("<|user|>hi\n\n{\n  \"a\": [") and "   42" in out and "18446744073709551616" in out
    assert out.endswith("k=vz-z[1, 'b']p+qmm" + '[{"role": "user", "content": "  hi  "}]A-B[1, 2]')


class _Tok:
    bos_id, eos_id = 0, 1

    def token_text(self, i):
        return ["<s>", "</s>"][i]

    def token_id(self, text):
        return None


@pytest.mark.parametrize("name", ["nested parens", "nested if", "center constant folded"])
def test_a_template_that_cannot_compile_still_loads_and_the_plain_template_routes_around_it(name):
    t0 = time.monotonic()
    tmpl = ChatTemplate.from_metadata({"tokenizer.chat_template": BOMBS[name]}, _Tok())
    if name != "center constant folded":
        assert tmpl.error is not None
    with pytest.raises(TemplateError):
        tmpl.render(MSGS)
    plain = ChatTemplate.from_metadata({"tokenizer.chat_template": BOMBS[name]}, _Tok(), use_file_template=False)
    assert plain.render(MSGS) == "<s>User: hi\nAssistant:"
    assert time.monotonic() - t0 < 5.0
