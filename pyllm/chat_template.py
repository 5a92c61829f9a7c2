"""Chat templates: the model's own jinja template from the GGUF, rendered the way transformers renders it.

Templates come from downloaded files, so they are untrusted code: they run in jinja2's immutable sandbox, any
access to an attribute the sandbox forbids is an error (jinja would otherwise quietly render it as empty), and
rendering is capped in output size and wall time so a template cannot hang or exhaust the process.
"""

from __future__ import annotations

import json
import re
import string
import sys
import threading
import time
from datetime import datetime
from typing import Any

from pyllm.errors import ContextFullError, TemplateError, shorten

MAX_OUTPUT_CHARS = 1 << 20  # a prompt larger than this is surely a runaway template
MAX_SECONDS = 2.0

# Used when the file carries no template, picked by which markers the vocabulary has.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma's published format: no system role, so a system prompt is folded into the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] + eos_token + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


class _Budget(Exception):
    """Raised from the trace hook when a render runs past its deadline."""


# Every intermediate value is bounded, not just the output: one built-in call ('a' * n, str.center, a big-int
# product, |indent with a long prefix) allocates all at once, before the output cap or the deadline can act.
MAX_VALUE_CHARS = MAX_OUTPUT_CHARS
MAX_INT_BITS = 1 << 16  # ~20,000 decimal digits: far above any counter a chat template keeps
MAX_JSON_INDENT = 64
# All the text one render may build, intermediate values included: far above what a real template makes of a
# prompt at the output limit (each message passes through a few filters and concatenations)
MAX_WORK_CHARS = 32 * MAX_OUTPUT_CHARS

_FORMAT_NUMBER = re.compile(r"\d{7,}")


def _refuse(what: str):
    from jinja2.exceptions import SecurityError

    e = SecurityError(f"the template builds {what} larger than the output limit ({MAX_VALUE_CHARS} characters)")
    e.over_size_limit = True  # render() tells a long request from a runaway template
    return e


def _ints(values) -> list[int]:
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _check_format_widths(fmt: str, args=()) -> None:
    """Refuses format strings whose widths or precisions (written in the format, or taken from the arguments by
    ``*`` and ``{:{}}``) add up to more than the limit: they allocate that much at once."""
    from jinja2.exceptions import SecurityError

    if _FORMAT_NUMBER.search(fmt):
        raise SecurityError("the template formats with a width or precision larger than the output limit")
    widths = [abs(v) for v in _ints(args)]
    fields = fmt.count("%") + fmt.count("{")
    if widths and fields * max(widths) > MAX_VALUE_CHARS:
        raise _refuse("a formatted string")


def _format_size(fmt: str, args: tuple, kwargs: dict) -> int:
    """About the length of ``fmt.format(*args, **kwargs)`` before widths: each replacement field prints the
    argument it names, and a format string may name one argument many times ('{0}' * 1000)."""
    total, auto = len(fmt), 0
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(fmt) if f is not None]
    except ValueError:  # str.format raises the same error itself
        return total
    for field in fields:
        key = re.split(r"[.\[]", field, maxsplit=1)[0]
        if key == "":
            key, auto = auto, auto + 1
        elif key.isdigit():
            key = int(key)
        v = (args[key] if key < len(args) else None) if isinstance(key, int) else kwargs.get(key)
        total += _text_size(v)
        if total > MAX_VALUE_CHARS:
            break
    return total


def _percent_size(fmt: str, right) -> int:
    """About the length of ``fmt % right`` before widths: a tuple's items print once each; a mapping's items
    print once per ``%(name)`` that names them; any other value prints once per conversion."""
    plain = fmt.replace("%%", "").count("%")
    if isinstance(right, tuple):
        return len(fmt) + _text_size(right)
    if isinstance(right, dict):
        names = re.findall(r"%\(([^)]*)\)", fmt)
        total = len(fmt) + (plain - len(names)) * _text_size(right)
        for name in names:
            total += _text_size(right.get(name))
            if total > MAX_VALUE_CHARS:
                break
        return total
    return len(fmt) + _text_size(right)  # one conversion: more is Python's TypeError


def _size(x) -> int:
    return len(x) if isinstance(x, (str, list, tuple, dict)) else 0


def _text_size(x, limit: int = MAX_VALUE_CHARS) -> int:
    """About len(str(x)) (repr escapes aside), counted only up to just past ``limit``.

    Why not len(): str() of a container runs in C, all at once, and a list holding one long string a thousand
    times has a thousand elements but prints a thousand copies. Each element visited adds at least one, so the
    walk ends after about ``limit`` steps, cycles included."""
    if isinstance(x, str):
        return len(x)
    from jinja2.utils import Namespace

    total, stack = 0, [x]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, (list, tuple, set, frozenset, _DICT_VIEWS)):
            total += 2 + 2 * len(v)
            if total <= limit:
                stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            if total <= limit:
                stack.extend(v.keys())
                stack.extend(v.values())
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        elif isinstance(v, Namespace):  # prints its attributes
            total += 12
            stack.append(object.__getattribute__(v, "_Namespace__attrs"))
        else:  # floats, None, Undefined, loop and macro objects: short reprs
            total += 32
    return total


_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


def _is_iterator(x) -> bool:
    """A lazy sequence (|map, |select, dict views are not): its length is unknown until it is consumed."""
    return not isinstance(x, (str, list, tuple, dict, set, frozenset, _DICT_VIEWS)) and hasattr(x, "__next__")


def _check_text(values, what: str) -> None:
    """Refuses before the values are turned into text when that text would pass the limit."""
    total = 0
    for v in values:
        total += _text_size(v)
        if total > MAX_VALUE_CHARS:
            raise _refuse(what)


class _Work:
    """The characters of text and elements one render has built so far, over all its intermediate values.

    Why: each value is bounded on its own, but a filter that runs per item (``|map('center', 99999)|list``)
    builds thousands of them in one C call, as fast as memory allows, before the deadline is looked at."""

    local = threading.local()

    def __init__(self):
        self.used = 0

    def __enter__(self):
        self.outer = getattr(_Work.local, "current", None)
        _Work.local.current = self
        return self

    def __exit__(self, *exc):
        _Work.local.current = self.outer
        return False


def _spend(n: int, what: str) -> None:
    work = getattr(_Work.local, "current", None)  # None: jinja folding constants at compile time
    if work is not None:
        work.used += n
        if work.used > MAX_WORK_CHARS:
            from jinja2.exceptions import SecurityError

            e = SecurityError(f"the template builds more than {MAX_WORK_CHARS} characters of values in all "
                              f"(the last one {what})")
            e.over_size_limit = True
            raise e


def _check_result(x, what: str):
    if _size(x) > MAX_VALUE_CHARS:
        raise _refuse(what)
    _spend(_size(x), what)
    return x


def _replace_growth(s: str, old: str, new: str) -> int:
    return (s.count(old) if old else len(s) + 1) * max(len(new) - len(old), 0)


def _check_int_bits(bits: int) -> None:
    from jinja2.exceptions import SecurityError

    if bits > MAX_INT_BITS:
        raise SecurityError(f"the template computes an integer of about {bits} bits (limit {MAX_INT_BITS})")


def _filter_estimate(name: str, value, args: tuple, kwargs: dict) -> int:
    """An upper bound on the size of what filter ``name`` would build, computed before it runs."""

    def arg(i, key, default=None):
        return args[i] if len(args) > i else kwargs.get(key, default)

    n = len(value) if isinstance(value, str) else 0
    if name == "center":
        w = arg(0, "width", 80)
        return max(n, w if isinstance(w, int) else 0)
    if name == "indent":
        w = arg(0, "width", 4)
        per_line = len(w) if isinstance(w, str) else (w if isinstance(w, int) else 0)
        return n + (value.count("\n") + 1 if isinstance(value, str) else 1) * per_line
    if name == "join":
        d = arg(0, "d", "")
        items = len(value) if hasattr(value, "__len__") else 0
        return items * _size(d) + (_text_size(value) if isinstance(value, (list, tuple)) else 0)
    if name == "wordwrap":
        width = arg(0, "width", 79)
        wrap = arg(2, "wrapstring", "\n")
        lines = n // max(width if isinstance(width, int) else 1, 1) + n // 2 + 1
        return n + lines * _size(wrap)
    if name == "replace" and isinstance(value, str):
        old, new = arg(0, "old"), arg(1, "new")
        if isinstance(old, str) and isinstance(new, str):
            return n + _replace_growth(value, old, new)
    if name == "format" and isinstance(value, str):
        _check_format_widths(value, list(args) + list(kwargs.values()))
    if name == "sum" and isinstance(value, (list, tuple)) and any(isinstance(v, (str, list, tuple)) for v in value):
        # sequences are added one by one in C, each copy as long as all before it: the copies are what counts
        built = copied = 0
        for v in value:
            built += _size(v)
            copied += built
            if copied > MAX_WORK_CHARS:
                raise _refuse(f"a sum of {len(value)} sequences copying {MAX_WORK_CHARS} elements or more, "
                              f"which is")
        return built
    if name == "tojson":
        indent = arg(0, "indent")
        if isinstance(indent, str) and len(indent) > MAX_JSON_INDENT or (
                isinstance(indent, int) and indent > MAX_JSON_INDENT):
            from jinja2.exceptions import SecurityError

            raise SecurityError(f"the template asks for a JSON indent larger than {MAX_JSON_INDENT}")
    return 0


# Filters that select, count, order or compare values without turning them into text; every other filter
# (|string, |tojson, |join, |format, |lower, |trim, ...) is checked for the text its inputs would become.
_FILTERS_KEEPING_VALUES = frozenset([
    "abs", "attr", "batch", "bool", "count", "d", "default", "dictsort", "first", "float", "groupby", "int", "items",
    "last", "length", "list", "map", "max", "min", "random", "reject", "rejectattr", "reverse", "round", "select",
    "selectattr", "slice", "sort", "sum", "unique"])


def _bounded_filter(name: str, fn):
    """``fn`` with its arguments checked first and its result checked after (jinja calls filters directly, not
    through Environment.call, and folds them at compile time when the arguments are constants)."""
    import functools

    from jinja2.utils import _PassArg

    pass_arg = _PassArg.from_obj(fn)

    @functools.wraps(fn)
    def wrapped(*a, **kw):
        lead = 1 if pass_arg is not None else 0  # context / eval context / environment comes first
        value, args = (a[lead], a[lead + 1:]) if len(a) > lead else (None, ())
        if name in ("join", "sum") and _is_iterator(value):
            value = list(value)  # C would consume it item by item, past every estimate: measured as a list
            a = (*a[:lead], value, *args)
        for v in _ints(list(args) + list(kw.values())):
            if v > MAX_VALUE_CHARS:
                raise _refuse(f"a value with |{name}({v})")
        if name not in _FILTERS_KEEPING_VALUES:
            _check_text([value, *args, *kw.values()], f"a string with |{name}")
        if _filter_estimate(name, value, args, kw) > MAX_VALUE_CHARS:
            raise _refuse(f"a string with |{name}")
        return _check_result(fn(*a, **kw), f"a value with |{name}")

    return wrapped


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame):
            # `a ~ b` compiles to a plain join that no sandbox hook sees; route it through a bounded one
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%", "+"])
        code_generator_class = Generator

        def unsafe_undefined(self, obj, attribute):
            # jinja's default renders a forbidden attribute as empty text; a template reaching for one is hostile
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is not allowed")

        @staticmethod
        def bounded_concat(values):
            _check_text(values, "a string (~)")  # before str(): a container's text is built in one C call
            return _check_result("".join([str(v) for v in values]), "a string (~)")

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_VALUE_CHARS:
                        raise _refuse("a sequence")
                if isinstance(left, int) and isinstance(right, int):
                    _check_int_bits(left.bit_length() + right.bit_length())
            if operator == "**" and isinstance(left, int) and isinstance(right, int):
                if right > 4096:
                    raise SecurityError("the template raises a number to a power too large")
                _check_int_bits(max(left.bit_length() - 1, 1) * max(right, 0))
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > MAX_VALUE_CHARS:
                    raise _refuse("a sequence (+)")
            if operator == "%" and isinstance(left, str):
                # '%0200000000d' % 1 and '%*d' % (10**6, 1) allocate before any output check
                _check_format_widths(left, right if isinstance(right, tuple) else (right,))
                if _percent_size(left, right) > MAX_VALUE_CHARS:  # ('%(a)s' * 1000) % {'a': long_text}
                    raise _refuse("a formatted string (%)")
            return _check_result(super().call_binop(context, operator, left, right), f"a value ({operator})")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            # str.ljust(10**9) and friends allocate before any output check could see them
            for a in _ints(list(args) + list(kwargs.values())):
                if a > MAX_VALUE_CHARS:
                    raise SecurityError(f"the template passes {a} to a call, larger than the output limit")
            fn = getattr(__obj, "__wrapped__", __obj)  # jinja wraps str.format in a safe formatter
            owner = getattr(fn, "__self__", None)
            name = getattr(fn, "__name__", "")
            if isinstance(owner, str):
                if name == "join" and args and _is_iterator(args[0]):
                    args = (list(args[0]), *args[1:])  # ''.join(generator): measured as a list, below
                if name in ("format", "format_map"):
                    _check_format_widths(owner, list(args) + list(kwargs.values()))  # '{:>200000000}'.format(1)
                    mapping = args[0] if name == "format_map" and args and isinstance(args[0], dict) else kwargs
                    if _format_size(owner, args if name == "format" else (), mapping) > MAX_VALUE_CHARS:
                        raise _refuse("a formatted string")  # ('{0}' * 1000).format(long_text)
                elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                    if len(owner) + _replace_growth(owner, args[0], args[1]) > MAX_VALUE_CHARS:
                        raise _refuse("a string (replace)")
                elif name == "expandtabs":
                    size = _ints(list(args) + list(kwargs.values()))
                    if owner.count("\t") * (size[0] if size else 8) > MAX_VALUE_CHARS:
                        raise _refuse("a string (expandtabs)")
                elif name == "join" and args and hasattr(args[0], "__len__"):
                    items = args[0] if isinstance(args[0], (list, tuple)) else ()
                    if len(owner) * len(args[0]) + _text_size(items) > MAX_VALUE_CHARS:
                        raise _refuse("a string (join)")
                elif name == "translate" and args and isinstance(args[0], dict):
                    # one character may map to a long string: ''.maketrans({'a': 'b' * 1000})
                    longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
                    if len(owner) * longest > MAX_VALUE_CHARS:
                        raise _refuse("a string (translate)")
            elif not isinstance(__obj, jinja2.runtime.Macro):  # a macro takes values as they are
                # list.index(x) and friends quote x in their error, built in C at the raise: a container
                # holding one long string a thousand times would be written out in full
                _check_text([v for v in (*args, *kwargs.values()) if not isinstance(v, str)],
                            f"the arguments of a call ({name or 'call'})")
            return _check_result(super().call(__context, __obj, *args, **kwargs), f"a value ({name or 'call'})")

    def raise_exception(message):
        # the message becomes text in the error: a long or aliased one would be built in full, then shown
        text = message if isinstance(message, str) else repr(message) if _text_size(message, 1000) <= 1000 else \
            f"<a {type(message).__name__} too long to show>"
        raise jinja2.exceptions.TemplateError(text[:1000] + ("..." if len(text) > 1000 else ""))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: jinja's own tojson escapes HTML characters, which chat prompts must not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def finalize(value):
        # what {{ ... }} prints: str() of a container builds all its text at once
        if not isinstance(value, str):
            _check_text([value], "a printed value")
        _spend(len(value) if isinstance(value, str) else 0, "a printed value")
        return value

    class Undefined(jinja2.Undefined):
        """jinja's message for a missing key quotes the key: a long or aliased one would be built in full."""

        __slots__ = ()

        @property
        def _undefined_message(self) -> str:
            name = self._undefined_name
            if self._undefined_hint is None and _text_size(name, 200) > 200:
                return f"{jinja2.utils.object_type_repr(self._undefined_obj)} has no such element (a " \
                       f"{type(name).__name__} key too long to show)"
            return super()._undefined_message

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], finalize=finalize,
              undefined=Undefined)
    # lipsum(n) runs in jinja's own code, out of reach of the render deadline; no chat template needs it
    env.globals.pop("lipsum", None)
    env.filters["tojson"] = tojson
    for name, fn in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, fn)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


_ENV = None


def _env():
    global _ENV
    if _ENV is None:
        _ENV = _environment()
    return _ENV


def _validate(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise TemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise TemplateError(f"messages[{i}]['role'] must be a non-empty string, got {role!r}")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise TemplateError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
    return [dict(m) for m in messages]


class ChatTemplate:
    """A chat template ready to render; ``source=None`` means the ChatML fallback."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.source = source if source is not None else CHATML_TEMPLATE
        self.is_fallback = source is None
        self.error: str | None = None  # set when the file's template could not be compiled
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        _check_utf8(self.source)
        import jinja2

        try:
            with _deadline(time.monotonic() + MAX_SECONDS):
                self._template = _env().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template cannot be compiled: {e}") from None
        except _Budget:
            raise TemplateError(f"chat template did not compile within {MAX_SECONDS:g} s") from None
        except (RecursionError, MemoryError) as e:  # 300 nested parentheses or {% if %} blocks
            raise TemplateError(f"chat template cannot be compiled: it nests too deeply ({type(e).__name__})") from None
        except Exception as e:  # whatever else jinja or Python's compiler raises: still a bad template, not a crash
            raise TemplateError(f"chat template cannot be compiled: {type(e).__name__}: {e}") from None

    @classmethod
    def from_metadata(cls, md: dict, tokenizer, use_file_template: bool = True) -> "ChatTemplate":
        """The file's ``tokenizer.chat_template``, or a fallback fitting the vocabulary's turn markers
        (always the fallback when ``use_file_template`` is False: the way out of a broken or hostile template)."""
        bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        source = md.get("tokenizer.chat_template")
        if use_file_template and isinstance(source, str) and source.strip():
            try:
                return cls(source, bos, eos)
            except TemplateError as e:
                # the model stays loadable: the error comes back at the first render, where the CLI offers
                # --plain-template (use_fallback_template) as the way around it
                return _BrokenTemplate(source, str(e))
        if tokenizer.token_id("<start_of_turn>") is not None and tokenizer.token_id("<end_of_turn>") is not None:
            source = GEMMA_TEMPLATE
        elif tokenizer.token_id("<|im_start|>") is not None and tokenizer.token_id("<|im_end|>") is not None:
            source = CHATML_TEMPLATE
        else:
            source = PLAIN_TEMPLATE
        t = cls(source, bos, eos)
        t.is_fallback = True
        return t

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text. TemplateError when the template fails; ContextFullError when the output limit is
        reached because of the request's own text (its messages, or variables such as ``tools``): the same
        template renders within the limit once that text is taken out, so the request is what is too long."""
        try:
            text = self._render(messages, add_generation_prompt, kwargs)
            _check_user_text_rendered(messages, text)
            return text
        except _OverSizeLimit as e:
            try:
                self._render([_without_text(m) for m in _validate(messages)], add_generation_prompt, {})
            except TemplateError:
                raise TemplateError(str(e)) from None  # runaway on its own
            chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
            raise ContextFullError(f"the chat is too long: its messages hold {chars} characters and its prompt "
                                   f"exceeds {MAX_OUTPUT_CHARS} characters, the most a chat template may render; "
                                   f"shorten the messages") from None

    def _render(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        import jinja2

        if self.error is not None:
            raise TemplateError(self.error)

        ctx = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        ctx.update(kwargs)
        ctx["messages"] = _validate(messages)
        ctx["add_generation_prompt"] = bool(add_generation_prompt)
        deadline = time.monotonic() + MAX_SECONDS
        out: list[str] = []
        size = 0
        chunks = self._template.generate(**ctx)
        try:
            with _Work(), _deadline(deadline):
                for chunk in chunks:
                    size += len(chunk)
                    if size > MAX_OUTPUT_CHARS:
                        raise _OverSizeLimit(
                            f"chat template output exceeds {MAX_OUTPUT_CHARS} characters; the template is runaway"
                        )
                    out.append(chunk)
        except TemplateError:
            raise
        except _Budget:
            raise TemplateError(f"chat template did not finish rendering within {MAX_SECONDS:g} s") from None
        except jinja2.exceptions.SecurityError as e:
            kind = _OverSizeLimit if getattr(e, "over_size_limit", False) else TemplateError
            raise kind(f"chat template tried something the sandbox forbids: {shorten(e, 300)}") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template raised an error: {shorten(e, 300)}") from None
        except (RecursionError, MemoryError, OverflowError) as e:
            raise TemplateError(f"chat template exhausted a resource: {type(e).__name__}: {shorten(e, 300)}") from None
        except Exception as e:  # a template bug (TypeError on None + str, ...); its message may quote a long value
            raise TemplateError(f"chat template failed: {type(e).__name__}: {shorten(e, 300)}") from None
        finally:
            # closed here, with the deadline's tracer gone: resuming the generator to close it is a traced call,
            # and past the deadline the tracer would raise inside the close, which Python prints as a traceback
            chunks.close()
        return "".join(out)


def _check_user_text_rendered(messages: list[dict], text: str) -> None:
    """TemplateError when the prompt lacks the last user message's text: a template that drops it (renders a
    fixed text, or only the markup) would have the model answer something the user never asked, with no error.
    Only the user's turn is looked for: templates may rewrite earlier assistant turns (reasoning is cut out)."""
    last = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    core = last["content"].strip() if last is not None and isinstance(last.get("content"), str) else ""
    if not core or core in text:
        return
    import markupsafe
    from jinja2.utils import htmlsafe_json_dumps

    # or as a template's tojson (Hugging Face's or jinja's) or escape filter writes it
    forms = (json.dumps(core)[1:-1], json.dumps(core, ensure_ascii=False)[1:-1],
             str(htmlsafe_json_dumps(core))[1:-1], str(markupsafe.escape(core)))
    if not any(f in text for f in forms):
        raise TemplateError("chat template does not render the user's message: the prompt it makes lacks the "
                            "last user message's text")


class _OverSizeLimit(TemplateError):
    """A render reached the output limit (or built a value over it)."""


def _without_text(m: dict) -> dict:
    """Message ``m`` with one character of content and no tool calls: what a template makes of the request's
    structure alone."""
    return {**{k: v for k, v in m.items() if k != "tool_calls"}, "content": "x"}


def _marks(contents: list[str]) -> tuple[str, str] | None:
    """Two private-use characters that occur in no content, to delimit placeholders with (None if every pair is
    taken): content holding the delimiters (icon fonts use this range) would otherwise force the fallback."""
    used = set("".join(contents))
    for c in range(0xE000, 0xF8FF, 2):
        if chr(c) not in used and chr(c + 1) not in used:
            return chr(c), chr(c + 1)
    return None


def _placeholder(i: int, content: str, marks: tuple[str, str]) -> str:
    # keeps the content's own leading/trailing whitespace, so a template that trims the content (Gemma, Llama 3)
    # trims the placeholder the same way
    core = content.strip()
    lead = content[:len(content) - len(content.lstrip())]
    trail = content[len(content.rstrip()):] if core else ""
    return f"{lead}{marks[0]}{i}{marks[1]}{trail}"


def content_spans(template: "ChatTemplate", messages: list[dict], text: str,
                  add_generation_prompt: bool, **kwargs: Any) -> list[tuple[int, int]]:
    """The character ranges of ``text`` (``messages`` rendered by ``template``) that came from message content.

    The template is rendered a second time with each content replaced by a placeholder; substituting the
    contents back must give ``text`` exactly, and then the placeholders' positions are the content's. A template
    that transforms content in other ways (or tests it) fails that check, and every occurrence of each content
    in ``text`` is taken instead: safe (content is never markup), at worst also covering some of the template's
    own text when a message repeats it.
    """
    msgs = _validate(messages)
    cores = [m["content"].strip() if isinstance(m.get("content"), str) else "" for m in msgs]
    if not any(cores):
        return []
    marks = _marks([m["content"] for m in msgs if isinstance(m.get("content"), str)])
    if marks is not None:
        marked = [dict(m, content=_placeholder(i, m["content"], marks)) if cores[i] else m for i, m in enumerate(msgs)]
        try:
            rendered = template.render(marked, add_generation_prompt=add_generation_prompt, **kwargs)
        except (TemplateError, ContextFullError):  # placeholders can outgrow one-character contents
            rendered = None
        if rendered is not None:
            spans, out, pos, at = [], [], 0, 0
            for m in re.finditer(re.escape(marks[0]) + r"(\d+)" + re.escape(marks[1]), rendered):
                i = int(m.group(1))
                if i >= len(cores) or not cores[i]:
                    break
                out.append(rendered[pos:m.start()])
                at += m.start() - pos
                spans.append((at, at + len(cores[i])))
                out.append(cores[i])
                at += len(cores[i])
                pos = m.end()
            else:
                out.append(rendered[pos:])
                if "".join(out) == text:
                    return spans
    spans = []
    for core in set(c for c in cores if c):
        start = text.find(core)
        while start >= 0:
            spans.append((start, start + len(core)))
            start = text.find(core, start + 1)
    return sorted(spans)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_utf8(source: str) -> None:
    """TemplateError when the template held bytes that are not UTF-8. The GGUF reader keeps such bytes as lone
    surrogates (U+DC80-U+DCFF) so they survive; rendered, they would reach the tokenizer as U+FFFD and the model
    would see markup its template never meant. Refused, naming the first bad byte's offset in the template."""
    m = _SURROGATE.search(source)
    if m is None:
        return
    ch = ord(m.group())
    offset = len(source[:m.start()].encode("utf-8"))
    what = f"byte {ch - 0xDC00:#04x}" if 0xDC80 <= ch <= 0xDCFF else f"lone surrogate U+{ch:04X}"
    raise TemplateError(f"chat template is not UTF-8 text ({what} at byte offset {offset} of the template)")


class _BrokenTemplate(ChatTemplate):
    """The file's template when it does not compile: renders nothing, raises the compile error every time."""

    def __init__(self, source: str, error: str):
        self.source, self.error, self.is_fallback = source, error, False
        self.bos_token = self.eos_token = ""


class _deadline:
    """Abort template code once ``deadline`` passes, even in loops that print nothing.

    Compiled templates are Python functions whose code object is named ``<template>``; only their frames get a
    line tracer, so everything else runs at full speed. Any tracer already installed (a debugger, coverage) is
    put back afterwards.
    """

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.count = 0

    def _local(self, frame, event, arg):
        self.count += 1
        if self.count & 255 == 0 and time.monotonic() > self.deadline:
            raise _Budget()
        return self._local

    def _global(self, frame, event, arg):
        # checked on every call, not only in template frames: jinja's own Python helpers can loop too
        if time.monotonic() > self.deadline:
            raise _Budget()
        if frame.f_code.co_filename == "<template>":
            return self._local
        return None

    def __enter__(self):
        self._old = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._old)
        return False
