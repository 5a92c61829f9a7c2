"""pyllm convert (CLI and errors) and pyllm's own quantizers.

- Q8_0 / Q4_0 equal gguf.quants.quantize bit for bit (on real weights and random blocks).
- Q4_K / Q6_K, which gguf.quants cannot produce: dequantized by gguf.quants, and compared with llama.cpp's own
  blocks in the fixtures. Re-quantizing a fixture tensor's dequantized values must give back llama.cpp's blocks
  (Q4_K: all but a handful; Q6_K: the sub-block search has sign ties on such values, so blocks may differ but
  the values must come back within 0.2% RMS).
"""

import os

import numpy as np
import pytest

import tiny_models as tm
from conftest import fixture_path, unblock_fifo_later
from pyllm.cli.main import main
from pyllm.formats.convert import convert
from pyllm.formats.gguf import GGMLType, open_gguf
from pyllm.formats.quant import qtensor_from_gguf
from pyllm.formats.quantize import quantize

gq = pytest.importorskip("gguf")
BLOCK_BYTES = {GGMLType.Q4_K: 144, GGMLType.Q6_K: 210}


def _real_rows(key="gemma3", name="blk.0.attn_v.weight", rows=256):
    gf = open_gguf(fixture_path(key))
    return qtensor_from_gguf(gf, name).dequantize()[:rows].numpy()


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_0])
def test_block32_quantizers_equal_gguf_py(qtype):
    rng = np.random.default_rng(0)
    x = np.concatenate([_real_rows(), rng.standard_normal((16, 640)).astype(np.float32) * 0.03])
    x[-1, :32] = 0  # an all-zero block: d = 0, no division by zero
    x[-2, :32] = np.linspace(-1, 1, 32)  # the signed-extreme tie for Q4_0
    ours = quantize(x, qtype)
    assert np.array_equal(ours, gq.quants.quantize(x, gq.GGMLQuantizationType(int(qtype))))


@pytest.mark.parametrize("key,qtype", [("gemma3", GGMLType.Q4_K), ("gemma3", GGMLType.Q6_K),
                                       ("qwen2", GGMLType.Q4_K)])
def test_k_quantizers_reproduce_llama_cpp_blocks(key, qtype):
    gf = open_gguf(fixture_path(key))
    name = next(n for n, t in gf.tensors.items() if t.ggml_type == qtype and len(t.shape) == 2)
    w = qtensor_from_gguf(gf, name)
    raw = w.data[:128].numpy()
    x = w.dequantize()[:128].numpy()
    ours = quantize(x, qtype)
    same = (ours.reshape(-1, BLOCK_BYTES[qtype]) == raw.reshape(-1, BLOCK_BYTES[qtype])).all(1).mean()
    back = gq.quants.dequantize(ours, gq.GGMLQuantizationType(int(qtype))).reshape(x.shape)
    rel = np.sqrt(((back - x) ** 2).mean() / (x ** 2).mean())
    print(f"{key} {name} {qtype.name}: {same:.3f} of blocks identical to llama.cpp's, round-trip rel RMS {rel:.1e}")
    assert same > (0.99 if qtype == GGMLType.Q4_K else 0.7)
    assert rel < 1e-2  # the few differing blocks are other local optima of the same search


def test_k_quantizer_error_on_real_weights():
    """On real weights (gemma3's Q8_0 attn_v, within ~0.5% of the original floats), each type's error sits where
    its bits put it (re-quantizing to Q8_0 itself is exact there, so Q8_0 is not compared)."""
    x = _real_rows(rows=256).reshape(-1, 256)  # blocks are independent of the row length; K-quants need 256
    errs = {}
    for qt in (GGMLType.Q6_K, GGMLType.Q4_K, GGMLType.Q4_0):
        back = gq.quants.dequantize(quantize(x, qt), gq.GGMLQuantizationType(int(qt))).reshape(x.shape)
        errs[qt.name] = float(np.sqrt(((back - x) ** 2).mean() / (x ** 2).mean()))
    print(errs)
    assert errs["Q6_K"] < 0.3 * errs["Q4_K"] and errs["Q4_K"] < 0.9 * errs["Q4_0"] < 0.15


def test_cli_convert_writes_a_loadable_gguf(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["convert", str(tm.hf_dir("qwen3")), str(out), "--type", "q8_0", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    gf = open_gguf(out)
    assert gf.metadata["general.architecture"] == "qwen3"
    assert gf.metadata["general.file_type"] == 7 and gf.metadata["tokenizer.ggml.pre"] == "gpt-2"  # llama.cpp's name
    assert gf.tensors["blk.0.attn_q.weight"].ggml_type == GGMLType.Q8_0
    assert gf.tensors["blk.0.attn_q_norm.weight"].ggml_type == GGMLType.F32
    assert "output.weight" not in gf.tensors  # tied embedding
    gf.close()


def test_llama3_rope_freqs_written_and_q_k_permuted():
    gf = open_gguf(tm.gguf_path("llama3", "f16"))
    assert "rope_freqs.weight" in gf.tensors
    freqs = qtensor_from_gguf(gf, "rope_freqs.weight").dequantize()
    assert freqs.min() == 1.0 and freqs.max() == 8.0  # high frequencies kept, low ones divided by the factor


def test_smollm3_file_is_llama_cpps():
    """A smollm3 file as llama.cpp's convert_hf_to_gguf.py writes one (SmolLM3Model, a LlamaModel): architecture
    "smollm3", the llama keys under it, every tensor named by gguf's SMOLLM3 map, Q and K rows permuted for the
    interleaved rotation (llama.cpp's LlamaModel.permute, restated here), and no key for the NoPE layers, which
    llama.cpp's graph fixes at every 4th."""
    import torch
    from safetensors.torch import load_file

    gf = open_gguf(tm.gguf_path("smollm3", "f32"))
    md = gf.metadata
    assert md["general.architecture"] == "smollm3"
    for key in ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base",
                "rope.dimension_count"):
        assert f"smollm3.{key}" in md, key
    assert not [k for k in md if "rope" in k and k not in ("smollm3.rope.freq_base", "smollm3.rope.dimension_count")]
    names = gq.get_tensor_name_map(gq.MODEL_ARCH.SMOLLM3, 4)
    hf = load_file(tm.hf_dir("smollm3") / "model.safetensors")
    assert {names.get_name(n, try_suffixes=(".weight", ".bias")) for n in hf} == set(gf.tensors)
    for proj, heads in (("q_proj", 4), ("k_proj", 2)):
        w = hf[f"model.layers.0.self_attn.{proj}.weight"]
        llama_cpp = w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
        ours = qtensor_from_gguf(gf, f"blk.0.attn_{proj[0]}.weight").dequantize()
        assert torch.equal(ours, llama_cpp), proj
    gf.close()


@pytest.mark.parametrize("changes,needle", [
    (dict(no_rope_layers=[1, 1, 0, 1]), "no_rope_layers = [1, 1, 0, 1] is not every 4th layer without RoPE"),
    (dict(use_sliding_window=True, sliding_window=8), "use_sliding_window = true"),
], ids=["nope-pattern", "sliding-window"])
def test_convert_refuses_smollm3_layers_a_gguf_cannot_hold(tmp_path, capsys, changes, needle):
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(tm.hf_dir("smollm3"), d)
    capsys.readouterr()
    _edit_json(d / "config.json", **changes)
    out = tmp_path / "x.gguf"
    assert needle in _convert_err(capsys, ["convert", str(d), str(out), "-q"])
    assert not out.exists()


def _convert_err(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("pyllm: error:") and "\n" not in err and "Traceback" not in err, err
    return err


def test_convert_errors_are_one_line(tmp_path, capsys):
    out = str(tmp_path / "x.gguf")
    assert "not a directory" in _convert_err(capsys, ["convert", str(tmp_path / "missing"), out])
    assert "config.json" in _convert_err(capsys, ["convert", str(tmp_path), out])
    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    assert "'t5' is not supported" in _convert_err(capsys, ["convert", str(tmp_path), out])
    (tmp_path / "config.json").write_text('{"model_type": "llama"')
    assert "cannot read JSON" in _convert_err(capsys, ["convert", str(tmp_path), out])
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert "num_hidden_layers" in _convert_err(capsys, ["convert", str(tmp_path), out])
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 1, '
        '"intermediate_size": 8}')
    assert "safetensors" in _convert_err(capsys, ["convert", str(tmp_path), out])
    assert "unknown --type" in str(pytest.raises(Exception, convert, tm.hf_dir("qwen3"), out, "q5_x").value)
    assert not os.path.exists(out)


@pytest.mark.parametrize("arch,head", [("mistral", "output.weight"), ("qwen3", "token_embd.weight")])
def test_q4_0_output_head_is_q6_k_as_llama_cpp(tmp_path, arch, head):
    """llama.cpp's quantizer (llama_tensor_get_type) writes the output head (or a tied embedding, which is the
    head) as Q6_K for every type below Q8_0; the other matrices stay Q4_0. The file also carries
    general.quantization_version = 2, as convert_hf_to_gguf.py writes it. Reference: the f16 conversion's head;
    the Q6_K head must be within 0.3x of the error a Q4_0 head of the same weights has (Q6_K ~ 6.6 bits vs 4.5).
    The file must load and give finite logits."""
    import pyllm
    import torch

    out = convert(tm.hf_dir(arch), tmp_path / "m.gguf", "q4_0", log=None)
    gf = open_gguf(out)
    assert gf.tensors[head].ggml_type == GGMLType.Q6_K
    assert gf.tensors["blk.0.attn_q.weight"].ggml_type == GGMLType.Q4_0
    assert gf.metadata["general.quantization_version"] == 2 and gf.metadata["general.file_type"] == 2
    ours = qtensor_from_gguf(gf, head).dequantize().numpy()
    ref_gf = open_gguf(tm.gguf_path(arch, "f16"))
    ref = qtensor_from_gguf(ref_gf, head).dequantize().numpy()
    as_q4_0 = gq.quants.dequantize(quantize(ref, GGMLType.Q4_0), gq.GGMLQuantizationType.Q4_0).reshape(ref.shape)
    gf.close()
    ref_gf.close()

    def rel(x):
        return float(np.sqrt(((x - ref) ** 2).mean() / (ref ** 2).mean()))

    print(f"{arch} {head}: Q6_K rel RMS {rel(ours):.4f}, Q4_0 would be {rel(as_q4_0):.4f}")
    assert rel(ours) < 0.3 * rel(as_q4_0)
    with pyllm.load(str(out), n_ctx=64, kernels="reference") as q:
        assert torch.isfinite(q.logits(list(range(3, 19)))).all()


def test_convert_without_tokenizer_json_names_the_file(tmp_path, capsys):
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(tm.hf_dir("qwen3"), d)
    (d / "tokenizer.json").unlink()
    err = _convert_err(capsys, ["convert", str(d), str(tmp_path / "x.gguf")])
    assert "tokenizer.json is missing" in err and "tokenizer type" not in err
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.part").exists()


def test_convert_output_that_cannot_or_must_not_be_replaced(tmp_path, capsys):
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(tm.hf_dir("qwen3"), d)
    capsys.readouterr()  # what building the checkpoint printed
    inputs = {p.name: p.read_bytes() for p in d.iterdir()}
    for name in ("config.json", "model.safetensors"):  # the finished file was renamed over the input it read
        assert "which the conversion reads" in _convert_err(capsys, ["convert", str(d), str(d / name), "-q"])
    assert "is a directory" in _convert_err(capsys, ["convert", str(d), str(tmp_path), "-q"])
    assert "does not exist" in _convert_err(capsys, ["convert", str(d), str(tmp_path / "no" / "m.gguf"), "-q"])
    fifo = tmp_path / "pipe"  # as /dev/null is: renaming over it would replace the device itself
    os.mkfifo(fifo)
    assert "not a regular file" in _convert_err(capsys, ["convert", str(d), str(fifo), "-q"])
    assert fifo.is_fifo()
    assert {p.name: p.read_bytes() for p in d.iterdir()} == inputs
    assert main(["convert", str(d), str(d / "m.gguf"), "-q"]) == 0  # a new file in the checkpoint folder is fine


def _hf_copy(tmp_path, capsys, name="ckpt"):
    import shutil

    d = tmp_path / name
    shutil.copytree(tm.hf_dir("qwen3"), d)
    capsys.readouterr()  # what building the checkpoint printed
    return d


def _edit_json(path, **changes):
    import json

    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("changes,needle", [
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps = '1e-6' is not a finite number"),
    (dict(rope_theta="1e6"), "rope_theta = '1e6'"),
    (dict(hidden_size=-8), "hidden_size = -8 is not an integer"),
    (dict(num_key_value_heads="2"), "num_key_value_heads = '2'"),
    (dict(max_position_embeddings=2 ** 40), "max_position_embeddings = 1099511627776"),
    (dict(_name_or_path=5), "_name_or_path = 5 is not a string"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": "8"}), "rope_scaling.factor = '8'"),
    (dict(rope_scaling={"rope_type": "llama3", "low_freq_factor": 4.0}), "high_freq_factor 4.0 is not above"),
    (dict(bos_token_id="x"), "bos_token_id = 'x' is not a token id"),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor = 1.5 is not a number in (0, 1]"),
    (dict(partial_rotary_factor=0.01), "gives 0 rotated dimensions; the rotation needs an even number"),
    (dict(head_dim=63), "head_dim 63 with partial_rotary_factor 1 gives 63 rotated dimensions"),
    (dict(num_key_value_heads=3), "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings = 'yes' is not true or false"),
    (dict(rope_scaling={"rope_type": 7}), "rope_scaling.rope_type = 7 is not a string"),
    (dict(rope_parameters={"full_attention": [1]}), "rope_parameters.full_attention = [1] is not an object"),
    (dict(eos_token_id=[1, "x"]), "eos_token_id = [1, 'x'] is not a token id"),
], ids=["eps-string", "theta-string", "negative-size", "heads-string", "ctx-over-int32", "name-int",
        "llama3-factor-string", "llama3-equal-factors", "bos-string", "rotary-over-1", "rotary-to-0", "odd-head-dim",
        "kv-heads-not-dividing", "tie-string", "rope-type-int", "rope-group-list", "eos-list-string"])
def test_convert_bad_config_value_is_one_line(tmp_path, capsys, changes, needle):
    d = _hf_copy(tmp_path, capsys)
    (d / "tokenizer_config.json").write_text("{}")  # bos/eos then come from config.json
    _edit_json(d / "config.json", **changes)
    assert needle in _convert_err(capsys, ["convert", str(d), str(tmp_path / "x.gguf"), "-q"])


@pytest.mark.parametrize("arch,changes,needle", [
    ("qwen3", dict(hidden_size=128), "tensor model.embed_tokens.weight has shape (384, 256), but config.json "
                                     "(hidden_size 128, vocab_size 384) needs (384, 128)"),
    ("qwen3", dict(vocab_size=383), "tensor model.embed_tokens.weight has shape (384, 256), but config.json "
                                    "(hidden_size 256, vocab_size 383) needs (383, 256)"),
    ("qwen3", dict(num_attention_heads=8), "self_attn.o_proj.weight has shape (256, 256), but config.json "
                                           "(hidden_size 256, num_attention_heads 8,"),
    ("qwen3", dict(num_key_value_heads=1), "self_attn.k_proj.weight has shape (128, 256), but config.json"),
    ("qwen3", dict(intermediate_size=256), "mlp.down_proj.weight has shape (256, 512), but config.json"),
    ("qwen3", dict(head_dim=32), "self_attn.k_norm.weight has shape (64,), but config.json"),
    ("qwen3", dict(num_hidden_layers=3), "config.json has num_hidden_layers = 3, but the checkpoint has no tensors "
                                         "for layer 2"),
    ("qwen3", dict(num_hidden_layers=1), "is in layer 1, but config.json has num_hidden_layers = 1"),
    ("mistral", dict(num_attention_heads=3), "num_attention_heads 3 is not a multiple of num_key_value_heads 2"),
    ("phi3", dict(num_key_value_heads=1), "self_attn.qkv_proj.weight has shape (768, 256), but config.json"),
    ("phi3", dict(intermediate_size=256), "has shape (256, 512), but config.json"),
], ids=["hidden", "rows-past-vocab", "heads", "kv-heads", "ffn", "head-dim", "more-layers", "fewer-layers",
        "llama-heads", "phi3-fused-qkv", "phi3-ffn"])
def test_convert_refuses_tensors_that_contradict_the_config(tmp_path, capsys, arch, changes, needle):
    """config.json values the tensors contradict were written as the GGUF's metadata, and loading the file then
    failed on the mismatch (or, for a head count that does not divide the rows, the Q/K permutation raised a
    torch error). Reference: the loader's own shape table (ModelConfig.layer_shapes) and the checkpoint's
    tensors; the error names the tensor, its shape and the config values, and no file is written."""
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(tm.hf_dir(arch), d)
    capsys.readouterr()
    _edit_json(d / "config.json", **changes)
    out = tmp_path / "x.gguf"
    assert needle in _convert_err(capsys, ["convert", str(d), str(out), "-q"])
    assert not out.exists() and not (tmp_path / "x.gguf.part").exists()


def test_convert_bad_input_files_are_one_line(tmp_path, capsys):
    d = _hf_copy(tmp_path, capsys)
    out = str(tmp_path / "x.gguf")
    st = d / "model.safetensors"
    good = st.read_bytes()
    st.write_bytes(good[:1000])
    assert "model.safetensors: not a readable safetensors file" in _convert_err(capsys, ["convert", str(d), out])
    st.write_bytes(good)
    (d / "config.json").write_text("[" * 100_000)
    assert "config.json: cannot read JSON (arrays or objects nest deeper than 64 levels)" in _convert_err(
        capsys, ["convert", str(d), out])
    (d / "config.json").write_text("[1]")
    assert "config.json: is not a JSON object" in _convert_err(capsys, ["convert", str(d), out])
    d2 = _hf_copy(tmp_path, capsys, "ckpt2")
    tj = d2 / "tokenizer.json"
    spec = tj.read_text()
    _edit_json(tj, added_tokens=[{"content": "x"}])
    assert "added_tokens is not a list" in _convert_err(capsys, ["convert", str(d2), out])
    tj.write_text(spec.replace('"vocab"', '"vocabulary"', 1))
    assert "model.vocab is not a map" in _convert_err(capsys, ["convert", str(d2), out])
    tj.write_text(spec)
    (d2 / "tokenizer_config.json").write_text("{}")
    (d2 / "chat_template.jinja").write_bytes(b"\xff{{ messages }}")
    assert "chat_template.jinja: the chat template is not UTF-8 text (byte 0xff at offset 0)" in _convert_err(
        capsys, ["convert", str(d2), out])
    assert not os.path.exists(out)


@pytest.mark.parametrize("edit,needle", [
    (dict(merges=[["a", "b"], ["c"]]), "tokenizer.json: model.merges[1] = ['c'] is not a merge"),
    (dict(merges=["a b", "a b c"]), "tokenizer.json: model.merges[1] = 'a b c' is not a merge"),
    (dict(merges=[5]), "tokenizer.json: model.merges[0] = 5 is not a merge"),
    (dict(merges="a b"), "tokenizer.json: model.merges = 'a b' is not a list"),
    (dict(pre_tokenizer=["x"]), "pre_tokenizer = ['x'] is not an object"),
    (dict(pre_tokenizer={"type": "Sequence", "pretokenizers": [1]}), "pre_tokenizer.pretokenizers = [1] is not a"),
    (dict(add_bos_token="yes"), "tokenizer_config.json: add_bos_token = 'yes' is not true or false"),
    (dict(chat_template=5), "tokenizer_config.json: chat_template = 5 is not a string"),
], ids=["merge-pair-of-one", "merge-of-three", "merge-int", "merges-string", "pretok-list", "pretok-seq-int",
        "add-bos-string", "template-int"])
def test_convert_bad_tokenizer_fields_are_one_line(tmp_path, capsys, edit, needle):
    """Each tokenizer field convert uses, of the wrong type: one line naming file and field (they were an
    AttributeError or TypeError traceback, or a merge the GGUF reader later split wrongly)."""
    import json

    d = _hf_copy(tmp_path, capsys)
    key, value = next(iter(edit.items()))
    if key in ("add_bos_token", "chat_template"):
        _edit_json(d / "tokenizer_config.json", **edit)
    else:
        tj = json.loads((d / "tokenizer.json").read_text())
        (tj["model"] if key == "merges" else tj)[key] = value
        (d / "tokenizer.json").write_text(json.dumps(tj))
    assert needle in _convert_err(capsys, ["convert", str(d), str(tmp_path / "x.gguf"), "-q"])
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
                                  "chat_template.jinja"])
def test_convert_refuses_a_fifo_in_the_checkpoint_before_opening_it(tmp_path, capsys, name):
    d = _hf_copy(tmp_path, capsys)
    (d / name).unlink(missing_ok=True)
    if name == "chat_template.jinja":
        (d / "tokenizer_config.json").write_text("{}")
    os.mkfifo(d / name)
    t = unblock_fifo_later(d / name)
    err = _convert_err(capsys, ["convert", str(d), str(tmp_path / "x.gguf"), "-q"])
    assert f"{name}: is a FIFO, not a regular file" in err, err
    t.join()


def test_requantize_tool_writes_over_its_own_input(tmp_path):
    """tools/requantize_gguf.py copies the 1-D tensors from the input's memory mapping: writing the output in place
    truncated that file under them when both were the same (SIGBUS), and the input was lost."""
    import shutil
    import subprocess
    import sys

    src = tmp_path / "m.gguf"
    shutil.copy(tm.gguf_path("qwen3", "f16"), src)
    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "requantize_gguf.py")
    r = subprocess.run([sys.executable, tool, str(src), "q8_0", str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    gf = open_gguf(src)
    assert gf.tensors["blk.0.attn_q.weight"].ggml_type == GGMLType.Q8_0
    assert gf.tensors["blk.0.attn_norm.weight"].ggml_type == GGMLType.F32
    gf.close()
    assert not (tmp_path / "m.gguf.part").exists()
    r = subprocess.run([sys.executable, tool, str(src), "q8_0", str(tmp_path / "no" / "x.gguf")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.startswith("requantize_gguf: error:") and "Traceback" not in r.stderr


def test_requantize_tool_cuts_to_the_first_layers(tmp_path):
    """`keep --layers N` copies the first N layers and every tensor outside the layers byte for byte, sets the block
    count, and the result loads and decodes as an N-layer model (reference: the source file's own tensors)."""
    import subprocess
    import sys

    import pyllm

    src = tm.gguf_path("qwen3", "q8_0")
    out = tmp_path / "cut.gguf"
    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "requantize_gguf.py")
    r = subprocess.run([sys.executable, tool, str(src), "keep", str(out), "--layers", "1"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    a, b = open_gguf(src), open_gguf(out)
    try:
        assert b.metadata["qwen3.block_count"] == 1 and a.metadata["qwen3.block_count"] > 1
        assert sorted(b.tensors) == sorted(n for n in a.tensors if not n.startswith("blk.") or n.startswith("blk.0."))
        for name, t in b.tensors.items():
            assert t.ggml_type == a.tensors[name].ggml_type, name
            assert b.raw(name).numpy().tobytes() == a.raw(name).numpy().tobytes(), name
    finally:
        a.close()
        b.close()
    llm = pyllm.load(str(out), n_ctx=64)
    assert llm.model.cfg.n_layer == 1 and len(list(llm.generate_tokens([1, 17, 33], max_tokens=4, temperature=0))) == 4
    r = subprocess.run([sys.executable, tool, str(src), "keep", str(tmp_path / "x.gguf"), "--layers", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "--layers 0" in r.stderr and "Traceback" not in r.stderr
