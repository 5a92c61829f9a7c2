"""pyllm: quantized local inference for large language models.

    import pyllm
    llm = pyllm.load("smollm2-135m")            # a registry name or a path to a .gguf file
    print(llm.generate("Once upon a time", max_tokens=32, temperature=0))
    for piece in llm.chat([{"role": "user", "content": "Hi!"}], stream=True):
        print(piece, end="", flush=True)
"""

__version__ = "0.1.0"

from .errors import PyllmError  # noqa: E402
from .llm import LLM, load  # noqa: E402

__all__ = ["LLM", "load", "PyllmError", "__version__"]
