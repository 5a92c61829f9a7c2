"""A synthetic model written as GGUF (`pyllm bench --synthetic SHAPE:TYPE --write-gguf PATH`) is the in-memory one.

Reference: synthetic_model, the model `pyllm bench --synthetic` builds in memory. The file written for the same spec
reads back through pyllm's own GGUF reader with every tensor's type, shape and bytes equal to it, the metadata that
llama.cpp's loader and ModelConfig.from_metadata read, and the tokenizer of the file it was taken from (padded to
the shape's vocabulary as convert_hf_to_gguf.py pads one). Loaded with pyllm.load, its logits equal the in-memory
model's exactly (same bytes, same kernels). A tiny shape of each layout (mixture of experts, dense with biases) is
added for the test: the real shapes are gigabytes.
"""

from __future__ import annotations

import pytest
import torch

from pyllm.errors import PyllmError
from pyllm.formats.gguf import GGUFFile
from pyllm.models import synthetic
from pyllm.synthetic import write_tiny_llama

TINY = {
    # name: (n_layer, n_embd, n_ff, n_head, n_kv_head, head_dim, n_vocab, rope_base, arch, tied)
    "tiny-qwen3moe": (2, 256, 512, 4, 2, 64, 384, 1000000.0, "qwen3moe", False),
    "tiny-qwen2": (2, 256, 512, 4, 2, 64, 384, 1000000.0, "qwen2", True),
}


@pytest.fixture
def tiny_shapes(monkeypatch):
    for name, shape in TINY.items():
        monkeypatch.setitem(synthetic.SHAPES, name, shape)
    monkeypatch.setitem(synthetic.MOE_SHAPES, "tiny-qwen3moe", (4, 2, 256))


@pytest.fixture
def tokenizer_file(tmp_path):
    """A model file whose 320-token byte-level BPE tokenizer the synthetic file takes (padded to 384)."""
    return write_tiny_llama(tmp_path / "tok.gguf", n_vocab=320)


@pytest.mark.parametrize("spec", ["tiny-qwen3moe:q4_k_m", "tiny-qwen2:q8_0", "tiny-qwen2:q5_k_m"])
def test_written_file_holds_the_in_memory_model(tiny_shapes, tokenizer_file, tmp_path, spec):
    out = tmp_path / "synthetic.gguf"
    seen = []
    synthetic.write_synthetic_gguf(spec, out, tokenizer_file, progress=lambda done, total: seen.append((done, total)))
    cfg, weights = synthetic.synthetic_model(spec)
    f = GGUFFile(out)
    assert list(f.tensors) == list(weights)  # llama.cpp's order: embeddings, output, then layer by layer
    for name, q in weights.items():
        info = f.info(name)
        assert (info.ggml_type, info.shape) == (q.qtype, q.shape), name
        assert torch.equal(f.raw(name).reshape(q.data.shape), q.data), name
    assert seen[-1][0] == seen[-1][1] == sum(q.data.numel() for q in weights.values())

    arch = cfg.arch
    md = f.metadata
    assert md["general.architecture"] == arch
    assert md["general.file_type"] == synthetic.FILE_TYPE_IDS[spec.split(":")[1]]
    for key, want in (("block_count", cfg.n_layer), ("embedding_length", cfg.n_embd),
                      ("feed_forward_length", cfg.n_ff), ("attention.head_count", cfg.n_head),
                      ("attention.head_count_kv", cfg.n_kv_head), ("attention.key_length", cfg.head_dim),
                      ("attention.value_length", cfg.head_dim), ("rope.freq_base", cfg.rope_base),
                      ("context_length", cfg.n_ctx_train)):
        assert md[f"{arch}.{key}"] == want, key
    if arch == "qwen3moe":
        assert (md["qwen3moe.expert_count"], md["qwen3moe.expert_used_count"],
                md["qwen3moe.expert_feed_forward_length"]) == (4, 2, 256)

    src = GGUFFile(tokenizer_file).metadata
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == cfg.n_vocab == 384
    assert tokens[:320] == src["tokenizer.ggml.tokens"] and tokens[320:] == [f"[PAD{i}]" for i in range(320, 384)]
    assert md["tokenizer.ggml.token_type"] == src["tokenizer.ggml.token_type"] + [5] * 64  # UNUSED
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id",
                "tokenizer.chat_template"):
        assert md[key] == src[key], key
    f.close()


def test_loaded_file_gives_the_in_memory_models_logits(tiny_shapes, tokenizer_file, tmp_path):
    import pyllm
    from pyllm import backends
    from pyllm.models import build_model
    from pyllm.runtime.generator import Generator

    spec, ids = "tiny-qwen3moe:q4_k_m", [5, 77, 300, 12, 9]
    out = synthetic.write_synthetic_gguf(spec, tmp_path / "m.gguf", tokenizer_file)
    llm = pyllm.load(out, device="cpu", n_ctx=64, n_threads=1)
    assert llm.config.extra["expert_count"] == 4 and llm.config.qk_norm
    from_file = llm.logits(ids)

    cfg, weights = synthetic.synthetic_model(spec)
    mdl = build_model(cfg, weights, backends.select("cpu", "fast", 1), max_pos=64)
    kv = mdl.backend.make_kv_cache("f16", cfg.n_layer, cfg.n_kv_head, 64, cfg.head_dim)
    in_memory = Generator(mdl, kv, 64).evaluate_all(ids).float()
    assert torch.isfinite(in_memory).all()
    assert torch.equal(from_file, in_memory)


def test_refusals_name_what_is_wrong(tiny_shapes, tokenizer_file, tmp_path):
    with pytest.raises(PyllmError, match="AutoAWQ checkpoints, not GGUF"):
        synthetic.write_synthetic_gguf("smollm2-135m:awq", tmp_path / "a.gguf", tokenizer_file)
    big = write_tiny_llama(tmp_path / "big.gguf", n_vocab=400)
    with pytest.raises(PyllmError, match="400 tokens, more than the synthetic model's vocabulary of 384"):
        synthetic.write_synthetic_gguf("tiny-qwen2:q8_0", tmp_path / "b.gguf", big)
    with pytest.raises(PyllmError, match="is a directory"):
        synthetic.write_synthetic_gguf("tiny-qwen2:q8_0", tmp_path, tokenizer_file)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a model")
    with pytest.raises(PyllmError, match="cannot read its tokenizer"):
        synthetic.write_synthetic_gguf("tiny-qwen2:q8_0", tmp_path / "c.gguf", not_gguf)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.gguf", "tok.gguf", "x.gguf"]  # no half file left


def test_cli_writes_the_readme_line(tiny_shapes, tokenizer_file, tmp_path, capsys):
    """README: `pyllm bench --synthetic SHAPE:TYPE --write-gguf FILE.gguf` (here with --tokenizer-from, the tiny shape
    having fewer tokens than the default tokenizers); its refusals exit 1 naming the flag."""
    from pyllm.cli.main import main

    out = tmp_path / "cli.gguf"
    assert main(["bench", "--synthetic", "tiny-qwen3moe:q4_k_m", "--write-gguf", str(out), "--tokenizer-from",
                 str(tokenizer_file)]) == 0
    res = capsys.readouterr()
    assert res.out.strip() == str(out) and "wrote" in res.err
    assert GGUFFile(out).metadata["general.name"] == "synthetic tiny-qwen3moe:q4_k_m"
    for argv, needle in (
            (["--synthetic", "tiny-qwen2:q8_0", "--write-gguf", str(tmp_path / "x.gguf")], "fewer than any default"),
            (["--synthetic", "tiny-qwen2:q8_0", "--synthetic", "tiny-qwen2:q8_0", "--write-gguf", str(out)],
             "exactly one --synthetic"),
            (["--synthetic", "tiny-qwen2:q8_0", "--tokenizer-from", str(tokenizer_file)], "goes with --write-gguf")):
        assert main(["bench", *argv]) == 1
        assert needle in capsys.readouterr().err, argv
