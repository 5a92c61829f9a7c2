"""Shared fixtures: the real fixture models (fetched once into the user cache) and the transformers oracle.

The oracle objects are expensive (transformers dequantizes a whole GGUF to float32), so each is built once per
session and shared by every test that needs it.
"""

import functools
import os

import pytest

from pyllm import registry

FIXTURES = {"smollm2": "smollm2-135m", "qwen2": "qwen2.5-coder-0.5b", "gemma3": "gemma3-270m"}


@functools.lru_cache(maxsize=None)
def fixture_path(key: str) -> str:
    return str(registry.pull(FIXTURES[key], quiet=True))


@pytest.fixture(scope="session")
def smollm2_path():
    return fixture_path("smollm2")


@pytest.fixture(scope="session")
def qwen2_path():
    return fixture_path("qwen2")


@pytest.fixture(scope="session")
def gemma3_path():
    return fixture_path("gemma3")


@functools.lru_cache(maxsize=None)
def hf_tokenizer(key: str):
    """transformers' tokenizer converted from the GGUF (the oracle for tokenization and chat templates)."""
    transformers = pytest.importorskip("transformers")
    path = fixture_path(key)
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@functools.lru_cache(maxsize=None)
def hf_model(key: str):
    """transformers' float32 model dequantized from the GGUF (the oracle for logits)."""
    transformers = pytest.importorskip("transformers")
    import torch

    path = fixture_path(key)
    m = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    m.eval()
    return m


@functools.lru_cache(maxsize=None)
def pyllm_model(key: str, **kw):
    """One pyllm.LLM per fixture and settings, shared across tests (loading is cheap, but not free)."""
    import pyllm

    return pyllm.load(fixture_path(key), **kw)
