"""Errors pyllm reports to its users.

Every error that bad input can cause is a ``PyllmError``: the CLI prints its message on one line and exits
non-zero, and the library raises it instead of an IndexError deep inside a model.
"""


class PyllmError(Exception):
    """Base of every error caused by bad input (files, arguments, settings)."""


class GGUFError(PyllmError):
    """A GGUF file is malformed, truncated or uses something pyllm does not support."""


class ModelError(PyllmError):
    """A model's architecture or tensors are unsupported or inconsistent."""


class AWQError(ModelError):
    """An AWQ folder is incomplete, inconsistent or uses a layout pyllm does not support (pyllm/formats/awq/)."""


class TokenizerError(PyllmError):
    """The vocabulary in a model file cannot be turned into a tokenizer."""


class TemplateError(PyllmError):
    """A chat template failed to render (or tried something the sandbox forbids)."""


class DownloadError(PyllmError):
    """A registry model could not be fetched or failed its checksum."""


class ConvertError(PyllmError):
    """A checkpoint cannot be converted to GGUF (pyllm/formats/convert.py)."""


class ContextFullError(PyllmError):
    """The prompt and the reply would not fit in the model's context window."""


class BadRequest(PyllmError):
    """An argument of an OpenAI-style request is invalid (the server answers 400 naming ``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class KVCacheMemoryError(PyllmError):
    """A KV cache that would not fit in available memory. ``what`` says so; ``fix`` names the way out in the terms
    of the front end that chose the context (``--ctx`` for run/chat/serve; bench sizes it from -d/-p/-n)."""

    FIX = "use a smaller --ctx or a smaller --kv type (q8_0, q4_rot, or -ctk/-ctv per part)"

    def __init__(self, what: str, fix: str = FIX):
        super().__init__(f"{what}; {fix}")
        self.what = what

    def with_fix(self, fix: str) -> "KVCacheMemoryError":
        return KVCacheMemoryError(self.what, fix)


def shorten(text, n: int = 80) -> str:
    """``text`` (a name, path or value the user typed, quoted by a message) on one line and at most ``n``
    characters, cut with '…': a 10 KB paste given as a file or setting name must not bury the error it is in."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 1] + "…"


def in_file(e: PyllmError, name: str) -> PyllmError:
    """``e`` with the model file's name in front, as the reader's own errors have it: checks inside the tokenizer
    or a decoder do not know which file they are reading, and the user must learn which one is wrong."""
    msg = str(e)
    return e if msg.startswith(f"{name}: ") else type(e)(f"{name}: {msg}")
