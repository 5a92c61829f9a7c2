"""Tiny random Hugging Face checkpoints per architecture (2-6 layers, hidden 256: whole Q4_K blocks), built with transformers' own
config classes, saved with save_pretrained and shared by the architecture and convert tests.

All share one byte-level BPE tokenizer trained here with the ``tokenizers`` library (GPT-2 pre-tokenizer), so the
converted GGUFs carry a real vocabulary, merges, special tokens and a chat template.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time, in a small village, there lived an old clockmaker named Pierre.",
    "Q: What is 12 * 7?\nA: 84. Q: What is the capital of France? A: Paris.",
    "Numbers 0123456789, accents café naïve, CJK 漢字, emoji 🙂 and tabs\tand  spaces.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 384  # the trained vocabulary is smaller; the rest are [PADn] rows, as in real checkpoints


@functools.lru_cache(maxsize=None)
def root() -> Path:
    d = Path(tempfile.mkdtemp(prefix="pyllm-tiny-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


@functools.lru_cache(maxsize=None)
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def _configs():
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.08, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    return {
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=64, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=8, tie_word_embeddings=False),
        "llama3": lambda: tf.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "phi3": lambda: tf.Phi3Config(**{**common, "num_key_value_heads": 4}, partial_rotary_factor=0.5,
                                      tie_word_embeddings=False),
        "gemma3": lambda: tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=64, sliding_window=8,
                                              query_pre_attn_scalar=64, rope_parameters={
                                                  "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                  "sliding_attention": {"rope_type": "default",
                                                                        "rope_theta": 10000.0}}),
        # 4 layers: the 4th has no RoPE (no_rope_layers [1, 1, 1, 0], transformers' default)
        "smollm3": lambda: tf.SmolLM3Config(**{**common, "num_hidden_layers": 4}, rope_parameters={
            "rope_type": "default", "rope_theta": 1e6}),
    }


ARCHS = ["qwen3", "mistral", "llama3", "phi3", "gemma3", "smollm3"]


@functools.lru_cache(maxsize=None)
def hf_dir(arch: str) -> Path:
    """Build, randomize and save the tiny model once per session; returns its checkpoint directory."""
    import transformers as tf

    cfg = _configs()[arch]()
    torch.manual_seed(1234 + ARCHS.index(arch))
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random norm weights too: a converter that drops or misplaces them must show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if arch == "gemma3" else 1.0))
            # f16-representable weights: the f16 GGUF then holds the checkpoint exactly, so the comparison
            # measures the runtime, not the f16 rounding of the conversion.
            p.copy_(p.half().float())
    d = root() / arch
    model.save_pretrained(d)
    tokenizer().save_pretrained(d)
    return d


@functools.lru_cache(maxsize=None)
def hf_model(arch: str):
    import transformers as tf

    m = tf.AutoModelForCausalLM.from_pretrained(hf_dir(arch), dtype=torch.float32)
    m.eval()
    return m


@functools.lru_cache(maxsize=None)
def gguf_path(arch: str, ftype: str) -> Path:
    from pyllm.formats.convert import convert

    return convert(hf_dir(arch), root() / f"{arch}-{ftype}.gguf", ftype, log=None)


@functools.lru_cache(maxsize=None)
def pyllm_model(arch: str, ftype: str):
    import pyllm

    return pyllm.load(str(gguf_path(arch, ftype)), kernels="reference", n_ctx=256, kv_cache="f32")
