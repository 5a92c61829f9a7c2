"""pyllm: quantized local inference for large language models.

    import pyllm
    llm = pyllm.load("smollm2-135m")            # a registry name or a path to a .gguf file
    print(llm.generate("Once upon a time", max_tokens=32, temperature=0))
    for piece in llm.chat([{"role": "user", "content": "Hi!"}], stream=True):
        print(piece, end="", flush=True)
"""

from ._version import __version__

# OpenMP wait policy: left at the runtime's default (spin a while, then sleep). A decode step opens ~7 parallel
# regions per layer, and waking sleeping workers for each costs more than the GEMV: on an idle 2-core machine
# OMP_WAIT_POLICY=PASSIVE measured 14.2 ms per SmolLM2 token against 5.6-6.5 ms with spinning workers
# (tools/decode_profile.py). Where every core is busy with other processes the spinning hurts instead; set
# OMP_WAIT_POLICY=PASSIVE there (it must be in the environment before torch loads).

from .errors import PyllmError  # noqa: E402

__all__ = ["LLM", "load", "PyllmError", "__version__"]


def __getattr__(name):
    # torch is imported on first use of the API, so `pyllm --help` and CLI errors return at once
    if name in ("LLM", "load"):
        from . import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pyllm' has no attribute {name!r}")
