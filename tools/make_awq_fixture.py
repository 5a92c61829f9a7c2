"""Build tiny AWQ checkpoints with a real writer (auto-round 0.16.1, format="auto_awq") for tests/test_awq.py.

    python tools/make_awq_fixture.py OUT_DIR [--group-size 64] [--tied] [--arch llama|qwen2]

Steps: a small byte-level BPE tokenizer trained with `tokenizers` on a few sentences (with ChatML specials), a
random 2-layer model built with transformers (hidden 128, intermediate 256), saved dense, then quantized by
auto-round round-to-nearest (iters=0, no calibration data): ~10 s on 2 cores. Nothing is downloaded.
The written folder is returned (auto-round puts it under OUT_DIR/<name>-w4g<G>/ or OUT_DIR itself).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for AWQ tests.",
    "Numbers 0123456789 and symbols: ()[]{}<>,.;:!? - _ + = * / \\ | @ # $ % ^ & ~",
    "Quantization keeps four bits per weight and a scale per group.",
    "Once upon a time there was a small language model that lived in a test.",
    "Ünïcödé: café, naïve, 東京, Привет, 😀",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_tokenizer(vocab_size: int = 384):
    """A transformers PreTrainedTokenizerFast over a freshly trained byte-level BPE (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = CHATML
    return fast


def make_dense(out: Path, arch: str = "llama", tied: bool = False, seed: int = 0, hidden: int = 128,
               intermediate: int = 256, layers: int = 2):
    """A random dense model + tokenizer saved (safetensors) under ``out``; returns (model, tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(seed)
    kw = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256, tie_word_embeddings=tied,
              eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None, rms_norm_eps=1e-6,
              rope_theta=10000.0)
    cfg = AutoConfig.for_model(arch, **kw)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # larger weights than the default init: logits with a visible spread
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.05)
    model.generation_config.eos_token_id = [kw["eos_token_id"], tok.convert_tokens_to_ids("<|endoftext|>")]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model, tok


def quantize_auto_round(model, tok, out: Path, group_size: int) -> Path:
    """auto-round RTN to the auto_awq format; returns the folder holding config.json."""
    os.environ.setdefault("AR_LOG_LEVEL", "WARNING")
    from auto_round import AutoRound

    # auto-round collects garbage in full many times a run (its clear_memory); inside a process that already holds
    # much (a test session: ~0.5 s a pass) those passes cost more than the quantization.  Frozen, what was there
    # before is not walked again; unfrozen after, it is collected as before.
    gc.freeze()
    try:
        ar = AutoRound(model, tok, scheme="W4A16", bits=4, group_size=group_size, sym=False, iters=0,
                       disable_opt_rtn=True, device_map="cpu")
        ar.quantize_and_save(str(out), format="auto_awq")
    finally:
        gc.unfreeze()
    hits = sorted(p.parent for p in out.rglob("config.json")
                  if "quantization_config" in json.loads(p.read_text()))
    if not hits:
        raise RuntimeError(f"auto-round wrote no quantized config.json under {out}")
    return hits[0]


def build(out: Path, group_size: int = 64, arch: str = "llama", tied: bool = False, seed: int = 0) -> Path:
    model, tok = make_dense(out / "dense", arch=arch, tied=tied, seed=seed)
    return quantize_auto_round(model, tok, out / "awq", group_size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen2", "mistral"])
    ap.add_argument("--tied", action="store_true")
    a = ap.parse_args(argv)
    print(build(a.out, a.group_size, a.arch, a.tied))
    return 0


if __name__ == "__main__":
    sys.exit(main())
