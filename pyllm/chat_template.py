"""Chat templates: the model's own jinja template from the GGUF, rendered the way transformers renders it.

Templates come from downloaded files, so they are untrusted code: they run in jinja2's immutable sandbox, any
access to an attribute the sandbox forbids is an error (jinja would otherwise quietly render it as empty), and
rendering is capped in output size and wall time so a template cannot hang or exhaust the process.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from typing import Any

from pyllm.errors import TemplateError

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


_FORMAT_NUMBER = re.compile(r"\d{7,}")


def _check_format_widths(fmt: str) -> None:
    """Rejects format strings with a width or precision of a million or more (they allocate that much at once)."""
    from jinja2.exceptions import SecurityError

    if _FORMAT_NUMBER.search(fmt):
        raise SecurityError("the template formats with a width or precision larger than the output limit")


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%"])

        def unsafe_undefined(self, obj, attribute):
            # jinja's default renders a forbidden attribute as empty text; a template reaching for one is hostile
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is not allowed")

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT_CHARS:
                        raise SecurityError("the template builds a sequence larger than the output limit")
            if operator == "**" and isinstance(right, int) and right > 4096:
                raise SecurityError("the template raises a number to a power too large")
            if operator == "%" and isinstance(left, str):
                _check_format_widths(left)  # '%0200000000d' % 1 allocates before any output check
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            # str.ljust(10**9) and friends allocate before any output check could see them
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, int) and not isinstance(a, bool) and a > MAX_OUTPUT_CHARS:
                    raise SecurityError(f"the template passes {a} to a call, larger than the output limit")
            fn = getattr(__obj, "__wrapped__", __obj)  # jinja wraps str.format in a safe formatter
            owner = getattr(fn, "__self__", None)
            name = getattr(fn, "__name__", "")
            if isinstance(owner, str):
                if name in ("format", "format_map"):
                    _check_format_widths(owner)  # '{:>200000000}'.format(1)
                elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                    grow = (owner.count(args[0]) if args[0] else len(owner) + 1) * max(len(args[1]) - len(args[0]), 0)
                    if len(owner) + grow > MAX_OUTPUT_CHARS:
                        raise SecurityError("the template builds a string larger than the output limit (replace)")
            return super().call(__context, __obj, *args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: jinja's own tojson escapes HTML characters, which chat prompts must not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    # lipsum(n) runs in jinja's own code, out of reach of the render deadline; no chat template needs it
    env.globals.pop("lipsum", None)
    jinja_replace = env.filters["replace"]

    def replace(eval_ctx, s, old, new, count=None):
        # the |replace filter bypasses Env.call; bound its result the same way
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            grow = (s.count(old) if old else len(s) + 1) * max(len(new) - len(old), 0)
            if len(s) + grow > MAX_OUTPUT_CHARS:
                raise SecurityError("the template builds a string larger than the output limit (replace)")
        return jinja_replace(eval_ctx, s, old, new, count)

    replace.jinja_pass_arg = jinja_replace.jinja_pass_arg
    env.filters["replace"] = replace
    env.filters["tojson"] = tojson
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
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        import jinja2

        try:
            self._template = _env().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template cannot be compiled: {e}") from None

    @classmethod
    def from_metadata(cls, md: dict, tokenizer, use_file_template: bool = True) -> "ChatTemplate":
        """The file's ``tokenizer.chat_template``, or a fallback fitting the vocabulary's turn markers
        (always the fallback when ``use_file_template`` is False: the way out of a broken or hostile template)."""
        bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        source = md.get("tokenizer.chat_template")
        if use_file_template and isinstance(source, str) and source.strip():
            return cls(source, bos, eos)
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
        import jinja2

        ctx = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        ctx.update(kwargs)
        ctx["messages"] = _validate(messages)
        ctx["add_generation_prompt"] = bool(add_generation_prompt)
        deadline = time.monotonic() + MAX_SECONDS
        out: list[str] = []
        size = 0
        try:
            with _deadline(deadline):
                for chunk in self._template.generate(**ctx):
                    size += len(chunk)
                    if size > MAX_OUTPUT_CHARS:
                        raise TemplateError(
                            f"chat template output exceeds {MAX_OUTPUT_CHARS} characters; the template is runaway"
                        )
                    out.append(chunk)
        except TemplateError:
            raise
        except _Budget:
            raise TemplateError(f"chat template did not finish rendering within {MAX_SECONDS:g} s") from None
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"chat template tried something the sandbox forbids: {e}") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template raised an error: {e}") from None
        except (RecursionError, MemoryError, OverflowError) as e:
            raise TemplateError(f"chat template exhausted a resource: {type(e).__name__}: {e}") from None
        except Exception as e:  # a template bug (TypeError on None + str, ...) is still a bad template
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        return "".join(out)


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
        if frame.f_code.co_filename == "<template>":
            if time.monotonic() > self.deadline:
                raise _Budget()
            return self._local
        return None

    def __enter__(self):
        self._old = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._old)
        return False
