"""Well-formed GGUF files that lie, and files that change under a loaded model.

Reference: every hyper-parameter the config reads, given a value of the wrong type or out of range (string,
array, bool, NaN, Inf, negative, huge), is a ModelError at load naming the key and the value; a vocabulary larger
than the embedding (or declared vocab_size) is refused at load naming both sizes; NaN weights end generation with a
PyllmError naming the tensor instead of fluent garbage; a model file truncated or rewritten while loaded is a
GGUFError at the next call (checked in a subprocess: without the check the process dies of SIGBUS, which the test
also demonstrates, so it fails if the check is removed).
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pyllm
from pyllm.errors import ModelError, PyllmError, TemplateError, TokenizerError
from pyllm.synthetic import Typed, tiny_vocab, write_tiny_llama
from pyllm.formats.gguf import ValueType, open_gguf

ROOT = str(Path(__file__).resolve().parent.parent)
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
SMALL = dict(n_layer=1, n_embd=32, n_ff=64, n_head=2, n_kv_head=1, n_vocab=320, n_ctx=64)

INT_KEYS = ["embedding_length", "attention.head_count", "attention.head_count_kv", "attention.key_length",
            "block_count", "feed_forward_length", "context_length", "rope.dimension_count",
            "attention.sliding_window"]
FLOAT_KEYS = ["attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor"]
LIES = {
    "string": "12", "string array": ["a", "b"], "bool": Typed(ValueType.BOOL, True), "nan": math.nan,
    "inf": math.inf, "negative": Typed(ValueType.INT32, -4), "huge": Typed(ValueType.UINT64, 2**63),
    "nested array": Typed(ValueType.ARRAY, [[1], [2]], ValueType.ARRAY),
}


def lies_for(key):
    for name, value in LIES.items():
        if key in FLOAT_KEYS and name == "bool":
            continue
        if key in ("rope.freq_base", "rope.scaling.factor") and name == "huge":
            continue  # a huge base or factor is odd but well defined
        if key == "attention.sliding_window" and name == "negative":
            value = Typed(ValueType.INT32, -1)
        yield name, value


CASES = [(k, n, v) for k in INT_KEYS + FLOAT_KEYS for n, v in lies_for(k)] + [("rope.scaling.type", "int", 3)]


@pytest.mark.parametrize("key, what, value", CASES, ids=[f"{k}-{n}" for k, n, _ in CASES])
def test_hyperparameter_of_wrong_type_or_range_is_refused_naming_it(tmp_path, key, what, value):
    p = write_tiny_llama(tmp_path / "m.gguf", metadata={f"llama.{key}": value}, **SMALL)
    with pytest.raises(ModelError, match=f"llama.{key}"):
        pyllm.load(p, n_ctx=32, kernels="reference")


@pytest.mark.parametrize("key", INT_KEYS)
def test_hyperparameter_just_past_int32_is_refused_at_load(tmp_path, key):
    # 2**31 fits a u32 field but not the int32 the kernels take (a sliding window of 2**31 loaded, then every
    # prompt failed in causal_attention with a ValueError traceback); refused when the file is read
    p = write_tiny_llama(tmp_path / "m.gguf", metadata={f"llama.{key}": Typed(ValueType.UINT32, 2**31)}, **SMALL)
    with pytest.raises(ModelError, match=f"llama.{key} = 2147483648"):
        pyllm.load(p, n_ctx=32, kernels="reference")


@pytest.mark.parametrize("metadata, error, match", [
    ({"tokenizer.ggml.bos_token_id": 320}, TokenizerError, r"bos_token_id = 320 is out of range"),
    ({"llama.feed_forward_length": 96}, ModelError, r"tensor 'blk.0.ffn_gate.weight' has shape \(64, 32\)"),
    ({"llama.block_count": 2}, ModelError, r"missing tensors: blk.1.attn_norm.weight"),
    # a head size the tensors contradict is that contradiction, not a KV cache of 2 TiB to shrink with --ctx
    ({"llama.attention.key_length": 2**30}, ModelError, r"tensor 'blk.0.attn_q.weight' has shape \(32, 32\)"),
], ids=["tokenizer", "shape", "missing", "head-size"])
def test_errors_in_the_files_contents_name_the_file(tmp_path, metadata, error, match):
    p = write_tiny_llama(tmp_path / "liar.gguf", metadata=metadata, **SMALL)
    with pytest.raises(error, match="^liar.gguf: .*" + match):
        pyllm.load(p, n_ctx=32, kernels="reference")


def test_unsupported_architecture_is_named_before_its_keys_are_read(tmp_path):
    # a file of an architecture pyllm lacks carries that architecture's own keys, not all of the llama family's:
    # the error must say the architecture is unsupported, not that some key is missing
    md = {"general.architecture": "mamba", "mamba.embedding_length": 32, "mamba.block_count": 1}
    p = write_tiny_llama(tmp_path / "m.gguf", metadata=md, **SMALL)
    with pytest.raises(ModelError, match=r"^m.gguf: unsupported architecture 'mamba' \(general.architecture\)"):
        pyllm.load(p, n_ctx=32, kernels="reference")
    assert subprocess.run([sys.executable, "-m", "pyllm", "info", str(p)], env=ENV, capture_output=True,
                          text=True).stderr.startswith("pyllm: error: m.gguf: unsupported architecture 'mamba'")


def test_heads_that_do_not_divide_the_embedding_are_named(tmp_path):
    p = write_tiny_llama(tmp_path / "m.gguf", metadata={"llama.attention.head_count": 3}, **SMALL)
    with pytest.raises(ModelError, match=r"llama.embedding_length 32 is not a multiple of llama.attention.head_count "
                                         r"3, and llama.attention.key_length is not given"):
        pyllm.load(p, n_ctx=32, kernels="reference")


@pytest.mark.parametrize("template", ["{{ raise_exception('no chat here') }}", "{% for %}", "{{ 'x' * 10**9 }}"])
def test_a_failing_chat_template_names_the_file(tmp_path, template):
    # the model loads (raw completion works); the first chat says which file's template is at fault
    p = write_tiny_llama(tmp_path / "m.gguf", metadata={"tokenizer.chat_template": template}, **SMALL)
    with pyllm.load(p, n_ctx=32, kernels="reference") as llm:
        with pytest.raises(TemplateError, match=r"^m.gguf: chat template"):
            llm.chat([{"role": "user", "content": "hi"}], max_tokens=2)


def test_a_chat_template_with_bytes_that_are_not_utf8_is_refused(tmp_path):
    """Template bytes that are not UTF-8 (kept by the reader as surrogates) rendered silently, reaching the
    tokenizer as U+FFFD. Decision (docs/SECURITY.md): the template is refused when the model loads; the model still
    loads for raw completion, every chat use is one error naming the byte and its offset, `pyllm info` lists it,
    and `run --chat` offers --plain-template. Reference: the byte and offset written into the file."""
    template = b"{% for m in messages %}caf\xe9 {{ m['content'] }}{% endfor %}"
    p = write_tiny_llama(tmp_path / "m.gguf", metadata={"tokenizer.chat_template": template}, **SMALL)
    want = r"chat template is not UTF-8 text \(byte 0xe9 at byte offset 26 of the template\)"
    with pyllm.load(p, n_ctx=32, kernels="reference") as llm:
        with pytest.raises(TemplateError, match=r"^m.gguf: " + want):
            llm.chat([{"role": "user", "content": "hi"}], max_tokens=2)
        assert len(llm.generate("hi", max_tokens=2, temperature=0)) >= 0  # raw completion is unaffected
    info = subprocess.run([sys.executable, "-m", "pyllm", "info", str(p)], capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert "chat template does not work (chat template is not UTF-8 text" in info.stdout + info.stderr
    r = subprocess.run([sys.executable, "-m", "pyllm", "run", str(p), "--chat", "hi", "-n", "2", "--backend",
                        "reference"], capture_output=True, text=True, env=ENV, timeout=120)
    err = r.stderr.strip()
    assert r.returncode == 1 and "\n" not in err and "not UTF-8" in err and "--plain-template" in err, err


def test_vocabulary_larger_than_the_embedding_is_refused_naming_both(tmp_path):
    p = write_tiny_llama(tmp_path / "m.gguf", metadata={**tiny_vocab(336), "llama.vocab_size": 336}, **SMALL)
    with pytest.raises(ModelError, match=r"'token_embd.weight' has 320 rows but the vocabulary has 336"):
        pyllm.load(p, n_ctx=32, kernels="reference")
    p = write_tiny_llama(tmp_path / "m2.gguf", metadata=tiny_vocab(336), **SMALL)  # vocab_size says 320
    with pytest.raises(ModelError, match=r"vocab_size = 320 but tokenizer.ggml.tokens has 336"):
        pyllm.load(p, n_ctx=32, kernels="reference")


def test_embedding_rows_past_the_vocabulary_are_refused(tmp_path):
    """An embedding (and output) with more rows than the vocabulary has tokens loaded, and its logits then held
    ids that are no token: sampling one ended the reply in "token id 308 is out of range". Reference: llama.cpp's
    loader, which requires exactly n_vocab rows, and pyllm's AWQ loader, which did."""
    p = write_tiny_llama(tmp_path / "m.gguf", metadata={**tiny_vocab(300), "llama.vocab_size": 320}, **SMALL)
    with pytest.raises(ModelError, match=r"^m.gguf: llama tensor 'token_embd.weight' has 320 rows but the "
                                         r"vocabulary has 300 tokens"):
        pyllm.load(p, n_ctx=32, kernels="reference")


@pytest.mark.parametrize("tensor", ["blk.1.attn_k.bias", "blk.0.attn_q.bias"])
def test_optional_layer_tensors_missing_from_some_layers_are_named(tmp_path, tensor):
    # biases are read from layer 0's presence: one missing in a later layer was a KeyError traceback in the first
    # forward pass, and one missing from layer 0 only made the others silently ignored
    p = write_tiny_llama(tmp_path / "m.gguf", **{**SMALL, "n_layer": 2}, qkv_bias=True)
    raw = p.read_bytes()
    assert raw.count(tensor.encode()) == 1
    p.write_bytes(raw.replace(tensor.encode(), tensor[:-4].encode() + b"xxxx"))  # same length: now unused
    with pytest.raises(ModelError, match=rf"^m.gguf: tensor {tensor} is missing, but blk.\d has attn_q.bias, "
                                         r"attn_k.bias, attn_v.bias"):
        pyllm.load(p, n_ctx=32)


def poke(path, tensor, data: bytes):
    with open_gguf(path) as gf:
        at = gf.tensors[tensor].offset  # absolute
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_norm_is_refused_at_load(tmp_path, value):
    p = write_tiny_llama(tmp_path / "m.gguf", **SMALL)
    poke(p, "blk.0.ffn_norm.weight", struct.pack("<f", value))
    with pytest.raises(ModelError, match=r"'blk.0.ffn_norm.weight' holds 1 NaN or Inf"):
        pyllm.load(p, n_ctx=32, kernels="reference")


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_nan_in_quantized_weights_ends_generation_naming_the_tensor(tmp_path, backend):
    p = write_tiny_llama(tmp_path / "m.gguf", **SMALL)  # Q8_0: each block starts with its fp16 scale
    poke(p, "output.weight", struct.pack("<e", math.nan))
    llm = pyllm.load(p, n_ctx=32, kernels=backend)
    with pytest.raises(PyllmError, match=r"non-finite logits.*'output.weight'"):
        llm.generate("hello", max_tokens=4, temperature=0)
    with pytest.raises(PyllmError, match="non-finite logits"):
        llm.logits([1, 2])


CHANGE = textwrap.dedent('''
    import os, sys
    import pyllm
    from pyllm.errors import PyllmError
    path, how, check = sys.argv[1], sys.argv[2], sys.argv[3] == "check"
    llm = pyllm.load(path, n_ctx=64, kernels="fast")
    if not check:
        llm.gguf.check_unchanged = lambda: None  # what happened before the check existed
    print("first:", repr(llm.generate("hello there", max_tokens=2, temperature=0)), flush=True)
    size = os.path.getsize(path)
    if how == "truncate":
        os.truncate(path, 4096)
    else:  # rewritten in place, same size
        with open(path, "r+b") as f:
            f.seek(size - 64)
            f.write(b"\\x7f" * 64)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    llm.reset()
    try:
        llm.generate("a different prompt entirely", max_tokens=4, temperature=0)
    except PyllmError as e:
        print("pyllm: error:", e, flush=True)
        sys.exit(3)
    print("no error", flush=True)
''')


def run_change(tmp_path, how, check):
    # big enough that the weights span many pages past the 4 KiB the truncation keeps
    p = write_tiny_llama(tmp_path / f"{how}.gguf", n_layer=2, n_embd=256, n_ff=512, n_head=4, n_kv_head=2,
                         n_vocab=512, n_ctx=64)
    script = tmp_path / "change.py"
    script.write_text(CHANGE)
    return subprocess.run([sys.executable, str(script), str(p), how, "check" if check else "nocheck"],
                          capture_output=True, text=True, env=ENV, timeout=600)


def test_truncated_model_file_is_one_clean_error(tmp_path):
    res = run_change(tmp_path, "truncate", check=True)
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
    assert "changed size while loaded" in res.stdout and "Traceback" not in res.stderr, res.stdout
    # the premise: without the check the same steps kill the process with SIGBUS
    res = run_change(tmp_path, "truncate", check=False)
    assert res.returncode == -7, (res.returncode, res.stdout, res.stderr[-2000:])


def test_model_file_rewritten_in_place_is_an_error(tmp_path):
    res = run_change(tmp_path, "rewrite", check=True)
    assert res.returncode == 3 and "was modified while loaded" in res.stdout, (res.stdout, res.stderr[-2000:])
