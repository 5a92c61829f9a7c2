"""pyllm's version, in a module of its own so that lower layers (the downloader's User-Agent) can read it without
importing the package's top level, whose lazy `pyllm.load` is pyllm/llm.py."""

__version__ = "0.1.0"
