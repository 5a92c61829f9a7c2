"""pyllm: quantized local inference for large language models.

    import pyllm
    llm = pyllm.load("smollm2-135m")            # a registry name or a path to a .gguf file
    print(llm.generate("Once upon a time", max_tokens=32, temperature=0))
    for piece in llm.chat([{"role": "user", "content": "Hi!"}], stream=True):
        print(piece, end="", flush=True)
"""

import os as _os

__version__ = "0.1.0"

# The kernels and torch share one OpenMP runtime. Its default active wait keeps idle workers spinning for
# milliseconds after each parallel region, which starves the main thread on a machine with as many busy
# processes as cores (2-thread decode measured 6x slower than 1-thread that way). Must be set before torch loads.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .errors import PyllmError  # noqa: E402

__all__ = ["LLM", "load", "PyllmError", "__version__"]


def __getattr__(name):
    # torch is imported on first use of the API, so `pyllm --help` and CLI errors return at once
    if name in ("LLM", "load"):
        from . import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pyllm' has no attribute {name!r}")
