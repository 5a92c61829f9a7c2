"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE): tiny random transformers checkpoints (2 layers, hidden 256,
8 experts of 256 routed top-2; Qwen2-MoE with its sigmoid-gated shared expert and q/k/v biases), converted by
``pyllm convert``, loaded by pyllm and compared with transformers' float32 forward on the same token ids; and the CPU
kernel behind them (csrc/bindings_kernels.cpp moe_mul_mat, csrc/cpu/gemv.cpp gemv_each_cpu).

References and tolerances, as tests/test_architectures.py derives them for the dense families:
- f16 / f32 files hold the checkpoint exactly (its weights are f16-representable): all-position logits within 1e-3
  relative (max|diff| / max|logit| per position) with the same argmax, and greedy continuations equal.
- q8_0 / q4_k_m: against transformers running the same rounded weights (gguf.quants' dequantization) within 1e-3.
- The fast kernels (int8 / Q8_K activations) against the reference backend on the same file: the mean KL over
  teacher-forced positions at most the quantization's own KL (the reference on the quantized file against the float
  checkpoint): the activations' rounding must cost no more than the weights' did.
- The kernel: bit for bit the existing one-row GEMV (gemv, M = 1) and the grouped mul_mat on each expert's slice.
- The C++ decode step against the torch forward: tests/test_conformance.py, with the other families.
"""

import functools
import math

import numpy as np
import pytest
import torch

import tiny_models as tm

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2) # a longer prompt",
]
ARCHS = ["qwen3moe", "qwen2moe"]


def _config(arch: str):
    import transformers as tf

    common = dict(vocab_size=tm.VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  num_experts=8, num_experts_per_tok=2, initializer_range=0.08, bos_token_id=0, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)
    if arch == "qwen3moe":
        return tf.Qwen3MoeConfig(**common, head_dim=64, norm_topk_prob=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return tf.Qwen2MoeConfig(**common, shared_expert_intermediate_size=512, norm_topk_prob=False)


@functools.lru_cache(maxsize=None)
def hf_dir(arch: str):
    import transformers as tf

    torch.manual_seed(4321 + ARCHS.index(arch))
    model = tf.AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
            if n.endswith("mlp.gate.weight"):  # a router whose top-2 is clear of ties at f16/q8 rounding
                p.mul_(4.0)
            p.copy_(p.half().float())
    d = tm.root() / arch
    model.save_pretrained(d)
    tm.tokenizer().save_pretrained(d)
    return d


@functools.lru_cache(maxsize=None)
def hf_model(arch: str):
    import transformers as tf

    m = tf.AutoModelForCausalLM.from_pretrained(hf_dir(arch), dtype=torch.float32)
    m.eval()
    return m


@functools.lru_cache(maxsize=None)
def gguf_path(arch: str, ftype: str):
    from pyllm.formats.convert import convert

    return convert(hf_dir(arch), tm.root() / f"{arch}-{ftype}.gguf", ftype, log=None)


@functools.lru_cache(maxsize=None)
def model(arch: str, ftype: str, kernels: str = "reference"):
    import pyllm

    return pyllm.load(str(gguf_path(arch, ftype)), kernels=kernels, n_ctx=256, kv_cache="f32")


def rel_per_position(ours, theirs):
    return ((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)).max().item()


def hf_logits(m, ids):
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].double()


def decode_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits after each of ids, one token at a time (teacher forcing): every position through the decode path."""
    g = llm.generator
    g.reset()
    out = [g._forward([t])[-1] for t in ids]
    g.reset()
    return torch.stack(out).double()


def assert_logits_match(llm, hf, label, tol=1e-3, decode=False):
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt)
        ours = decode_logits(llm, ids) if decode else llm.logits(ids).double()
        theirs = hf_logits(hf, ids)
        rel = rel_per_position(ours, theirs)
        print(f"{label} {len(ids)} tokens: max rel {rel:.2e}")
        assert rel < tol, f"{label} {prompt!r}: max|diff|/max|logit| = {rel:.2e}"
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_f16_logits_match_transformers(arch):
    llm = model(arch, "f16")
    spec = llm.model.spec
    assert (spec.n_expert, spec.n_expert_used, spec.n_ff_exp) == (8, 2, 256)
    assert (spec.n_ff_shexp, spec.shexp_gate, spec.norm_top_k) == ((512, True, False) if arch == "qwen2moe"
                                                                    else (0, False, True))
    assert tuple(llm.weights["blk.0.ffn_gate_exps.weight"].shape) == (8, 256, 256)
    assert tuple(llm.weights["blk.1.ffn_down_exps.weight"].shape) == (8, 256, 256)
    assert_logits_match(llm, hf_model(arch), f"{arch} f16")


def _hf_with_file_weights(arch: str, llm):
    """transformers' model with each matrix rounded to the type the GGUF holds it in (dequantized by gguf.quants);
    the stacked experts row by row, as the file's blocks hold them."""
    import copy
    import re

    import gguf

    from pyllm.formats.gguf import GGMLType
    from pyllm.formats.quantize import quantize

    m = copy.deepcopy(hf_model(arch))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], llm.config.n_layer)
    with torch.no_grad():
        for hf_name, p in m.named_parameters():
            if p.ndim == 3:  # experts.gate_up_proj [E, 2F, D] (rows of ffn_gate_exps, then ffn_up_exps), down_proj
                i = re.search(r"layers\.(\d+)\.", hf_name).group(1)
                part = "ffn_down_exps" if hf_name.endswith("down_proj") else "ffn_gate_exps"
                name = f"blk.{i}.{part}.weight"
                if part == "ffn_gate_exps":
                    assert llm.weights[name].qtype == llm.weights[f"blk.{i}.ffn_up_exps.weight"].qtype
            elif p.ndim == 2:
                name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            else:
                continue
            qtype = llm.weights[name].qtype
            if qtype == GGMLType.F32:
                continue
            rows = p.reshape(-1, p.shape[-1]).numpy()
            raw = quantize(rows, qtype)
            p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype)))).reshape(
                p.shape))
    return m


@pytest.mark.parametrize("ftype", ["q8_0", "q4_k_m"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_logits_match_transformers_on_the_same_weights(arch, ftype):
    from pyllm.formats.gguf import GGMLType

    llm = model(arch, ftype)
    types = {n: w.qtype for n, w in llm.weights.items() if len(w.shape) >= 2}
    assert types["blk.0.ffn_gate_inp.weight"] == GGMLType.F32  # routers stay float, as llama.cpp keeps them
    want = {"q8_0": {GGMLType.Q8_0}, "q4_k_m": {GGMLType.Q4_K, GGMLType.Q6_K}}[ftype]
    assert {types[f"blk.{i}.ffn_{p}_exps.weight"] for i in range(2) for p in ("gate", "up", "down")} <= want
    if ftype == "q4_k_m":  # llama.cpp's mix: the last eighth's ffn_down_exps have more bits (of 2 layers: blk.1)
        assert types["blk.1.ffn_down_exps.weight"] == GGMLType.Q6_K and types["blk.1.ffn_up_exps.weight"] == GGMLType.Q4_K
        assert types["blk.0.ffn_down_exps.weight"] == GGMLType.Q4_K
    same = _hf_with_file_weights(arch, llm)
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt)
        ours = llm.logits(ids).double()
        exact = rel_per_position(ours, hf_logits(same, ids))
        vs_float = rel_per_position(ours, hf_logits(hf_model(arch), ids))
        print(f"{arch} {ftype}: vs same weights {exact:.2e}, vs float {vs_float:.2e}")
        assert exact < 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_greedy_through_the_expert_kernels_matches_transformers(arch, monkeypatch):
    """The fast backend on the f32 file: prefill groups the prompt's tokens by expert (moe_mul_mat, counted here),
    each decoded token reads its selected experts' rows in the C++ step (csrc/cpu/decode_step.cpp moe_mlp); 24
    greedy tokens equal transformers'."""
    import pyllm
    from pyllm import ops

    calls = []
    kernel = ops._C.moe_mul_mat
    monkeypatch.setattr(ops._C, "moe_mul_mat", lambda x, ws, qt, ids: calls.append(ids.shape[0]) or kernel(x, ws, qt, ids),
                        raising=False)
    llm = pyllm.load(str(gguf_path(arch, "f32")), kernels="fast", n_ctx=256, kv_cache="f32")
    assert llm.model.fused_step(llm.kv) is not None  # decode runs the C++ step
    hf = hf_model(arch)
    ids = llm.tokenize(PROMPTS[1])
    ours = list(llm.generate_tokens(ids, max_tokens=24, temperature=0))
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, top_k=None, top_p=None,
                          temperature=None, pad_token_id=0, eos_token_id=None)
    theirs = out[0, len(ids):].tolist()
    n = min(len(ours), len(theirs))
    assert n and ours[:n] == theirs[:n] and (n == len(theirs) or llm.tokenizer.is_eog(ours[-1]))
    assert calls == [len(ids)] * 2 * llm.config.n_layer, calls  # gate+up and down per layer, the prompt only


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_f16_prefill_and_decode_match_transformers(arch, fp32_prefill):
    import pyllm

    llm = pyllm.load(str(gguf_path(arch, "f16")), kernels="fast", n_ctx=256, kv_cache="f32")
    assert_logits_match(llm, hf_model(arch), f"{arch} fast f16 prefill")
    assert_logits_match(llm, hf_model(arch), f"{arch} fast f16 decode", decode=True)


@pytest.fixture
def fp32_prefill():
    """The fp32 prefill GEMM (as tests/test_architectures.py: the bf16 GEMMs' rounding is bounded on its own)."""
    from pyllm import _ext

    C = _ext.load()
    default = C.prefill_kernel()
    C.set_prefill_kernel("f32")
    yield
    C.set_prefill_kernel(default)


def _mean_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


@pytest.mark.parametrize("ftype", ["q8_0", "q4_k_m"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fast_decode_costs_no_more_than_the_quantization(arch, ftype):
    """Teacher-forced decode through the int8-activation expert kernels against the reference backend on the same
    file: mean KL at most the quantization's own (reference on the file against the float checkpoint)."""
    import pyllm

    ref = model(arch, ftype)
    fast = pyllm.load(str(gguf_path(arch, ftype)), kernels="fast", n_ctx=256, kv_cache="f32")
    ids = ref.tokenize(PROMPTS[1])
    ours, theirs = decode_logits(fast, ids), ref.logits(ids).double()
    kl_fast = _mean_kl(theirs, ours)
    kl_quant = _mean_kl(hf_logits(hf_model(arch), ids), theirs)
    print(f"{arch} {ftype}: fast vs reference KL {kl_fast:.2e}, quantization KL {kl_quant:.2e}")
    assert kl_fast <= kl_quant


# ---- the kernel: moe_mul_mat against the one-row GEMV and mul_mat on each expert's slice -------------------------
KERNEL_TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "F16"]


def _experts(qtype: str, e: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    from pyllm.formats.gguf import BLOCK_INFO, GGMLType
    from pyllm.synthetic import random_blocks

    t = GGMLType[qtype]
    bs, ts = BLOCK_INFO[t]
    raw = random_blocks(t, e * n * k // bs, np.random.default_rng(seed))
    return torch.from_numpy(raw).reshape(e, n, k // bs * ts)


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_moe_mul_mat_is_the_gemv_on_each_selected_expert(qtype, tokens):
    """T = 1 (decode) and 3 tokens of top-2 over 16 experts take the gathered one-pass path; 40 tokens the grouped
    one (each used expert's slice through mul_mat once).  Reference: gemv (M = 1) on each selection's own slice,
    bit for bit where the path is the one-row GEMV, and mul_mat on each expert's gathered rows for the grouped path
    (the same kernels), also bit for bit.  Unselected experts' blocks hold NaN scales: the outputs never see them."""
    from pyllm import ops
    from pyllm.formats.gguf import GGMLType

    C = ops._C
    qt = int(GGMLType[qtype])
    E, K, N1, N2, k = 16, 512, 96, 64, 2
    w1, w2 = _experts(qtype, E, N1, K, 1), _experts(qtype, E, N2, K, 2)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, K, generator=g)
    x[0, 7] = 40.0  # an outlier: the Q8_K rows take it out and add it back, as the one-row GEMV does
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    unused = sorted(set(range(E)) - set(ids.reshape(-1).tolist()))
    for w in (w1, w2):
        w[unused] = 0xFF  # all-ones bytes: NaN fp16 scales in every block type here
    y1, y2 = C.moe_mul_mat(x, [w1, w2], [qt, qt], ids)
    assert y1.shape == (tokens, k, N1) and y2.shape == (tokens, k, N2)
    (yd,) = C.moe_mul_mat(torch.randn(tokens, k, K, generator=g), [w1], [qt], ids)  # per-slot rows (ffn_down)
    assert yd.isfinite().all()
    grouped = 2 * tokens * k > E and tokens > 1
    for w, y in ((w1, y1), (w2, y2)):
        assert y.isfinite().all()
        for e in ids.unique().tolist():
            t_sel, j_sel = (ids == e).nonzero(as_tuple=True)
            want = C.mul_mat(x[t_sel].contiguous(), w[e], qt) if grouped else \
                torch.stack([C.gemv(x[t:t + 1], w[e], qt)[0] for t in t_sel.tolist()])
            assert torch.equal(y[t_sel, j_sel], want), (qtype, e)


def test_moe_mul_mat_refuses_bad_input_naming_it():
    from pyllm import ops
    from pyllm.formats.gguf import GGMLType

    C = ops._C
    qt = int(GGMLType.Q8_0)
    w = _experts("Q8_0", 4, 32, 64)
    x = torch.randn(2, 64)
    with pytest.raises(IndexError, match=r"ids\[1, 0\] = 4 is out of range for 4 experts"):
        C.moe_mul_mat(x, [w], [qt], torch.tensor([[0, 1], [4, 2]]))
    with pytest.raises(ValueError, match="x has shape"):
        C.moe_mul_mat(torch.randn(3, 64), [w], [qt], torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match="bytes per row"):
        C.moe_mul_mat(torch.randn(2, 96), [w], [qt], torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match="one qtype per weight"):
        C.moe_mul_mat(x, [w, w], [qt], torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match="experts"):
        C.moe_mul_mat(x, [w, w[:3]], [qt, qt], torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(TypeError, match="ids must be"):
        C.moe_mul_mat(x, [w], [qt], torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))


def test_decode_step_kernel_equals_the_grouped_torch_form(monkeypatch):
    """One decoded token's logits through moe_mul_mat (the torch forward's decode) equal those of the backend-neutral
    form (each selected expert's slice through the backend's linear, Decoder.experts), bit for bit: at T = 1 both
    run the one-row GEMV on the same slices."""
    import pyllm
    from pyllm.backends.cpu import CpuBackend

    llm = pyllm.load(str(gguf_path("qwen2moe", "q4_k_m")), kernels="fast", n_ctx=64, kv_cache="f32")
    llm.model.use_cpp_decode = False
    ids = llm.tokenize(PROMPTS[0])
    kernel = decode_logits(llm, ids)
    monkeypatch.setattr(CpuBackend, "linear_experts", staticmethod(lambda x, ws, ids: None))
    assert torch.equal(decode_logits(llm, ids), kernel)


# ---- the spec, the metadata and the converter name what is wrong --------------------------------------------------
def _moe_cfg(**extra):
    from pyllm.models.config import ModelConfig

    cfg = ModelConfig(arch="qwen3moe", n_layer=2, n_embd=256, n_ff=512, n_head=4, n_kv_head=2, head_dim=64,
                      n_vocab=384, n_ctx_train=512, rope_style="neox", qk_norm=True)
    cfg.extra.update(dict(expert_count=8, expert_used_count=2, expert_ff=256, expert_shared_ff=0,
                          expert_shared_gate=False, expert_weights_norm=True), **extra)
    return cfg


def test_spec_validates_the_expert_fields_naming_them():
    import dataclasses

    from pyllm.errors import ModelError
    from pyllm.models.spec import ArchSpec

    spec = ArchSpec.from_config(_moe_cfg())
    names = spec.layer_tensors()
    assert "ffn_gate_exps.weight" in names and "ffn_gate_inp.weight" in names and "ffn_gate.weight" not in names
    assert "ffn_up_shexp.weight" not in names
    for field, value, needle in (("n_expert_used", 9, "n_expert_used = 9 is not an integer in [1, 8]"),
                                 ("n_expert_used", 0, "n_expert_used = 0"), ("n_ff_exp", -1, "n_ff_exp = -1"),
                                 ("shexp_gate", True, "shexp_gate = True needs a shared expert")):
        with pytest.raises(ModelError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            dataclasses.replace(spec, **{field: value})
    with pytest.raises(ModelError, match="n_expert = 0 .* expert fields are set"):
        dataclasses.replace(spec, n_expert=0)
    cfg = _moe_cfg()
    del cfg.extra["expert_ff"]
    with pytest.raises(ModelError, match="qwen3moe.expert_feed_forward_length is missing"):
        ArchSpec.from_config(cfg)


@pytest.mark.parametrize("key, value, needle", [
    ("qwen3moe.expert_used_count", 9, "qwen3moe.expert_used_count = 9 (int) is not an integer in [1, 8]"),
    ("qwen3moe.expert_count", None, "metadata key qwen3moe.expert_count is missing"),
    ("qwen3moe.expert_weights_norm", 1, "qwen3moe.expert_weights_norm = 1 (int) is not true or false"),
])
def test_bad_expert_metadata_is_named_at_load(tmp_path, key, value, needle):
    """The tiny converted file with one expert key changed (or dropped): pyllm.load refuses it naming the key."""
    import re

    import pyllm
    from pyllm.errors import ModelError
    from pyllm.formats.gguf import GGUFFile
    from pyllm.synthetic import write_gguf

    src = GGUFFile(str(gguf_path("qwen3moe", "q8_0")))
    md = {k: v for k, v in src.metadata.items() if k != key}
    if value is not None:
        md[key] = value
    tensors = {n: (t.ggml_type, src.raw(n).numpy(), t.shape) for n, t in src.tensors.items()}
    out = write_gguf(tmp_path / "lying.gguf", md, tensors)
    with pytest.raises(ModelError, match=re.escape(needle)):
        pyllm.load(str(out), kernels="reference", n_ctx=64)


@pytest.mark.parametrize("changes, needle", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than num_experts 8"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers [1]"),
    ({"num_experts_per_tok": "2"}, "num_experts_per_tok = '2' is not an integer"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob = 'yes' is not true or false"),
    ({"num_local_experts": 6}, "config.json has num_experts = 6, but the checkpoint's experts are 8"),
])
def test_convert_refuses_bad_expert_config_in_one_line(tmp_path, changes, needle):
    import json
    import shutil

    from pyllm.formats.convert import ConvertError, convert

    d = tmp_path / "ckpt"
    shutil.copytree(hf_dir("qwen3moe"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError) as e:
        convert(d, tmp_path / "out.gguf", "f16", log=None)
    assert needle in str(e.value) and "\\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "out.gguf").exists()


def test_info_shows_the_experts():
    import json
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "pyllm", "info", str(gguf_path("qwen2moe", "q8_0"))],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("experts:"))
    # per layer: 2 of 8 experts' gate/up/down (3 x 256 x 256 each) active; the rest (attention, shared expert,
    # router, norms, embedding and output) whole
    assert "8, 2 used per token (ff 256), a shared expert (ff 512)" in line, line
    res = subprocess.run([sys.executable, "-m", "pyllm", "info", str(gguf_path("qwen2moe", "q8_0")), "--json"],
                         capture_output=True, text=True, timeout=120)
    info = json.loads(res.stdout)
    ex = info["experts"]
    assert (ex["count"], ex["used_per_token"], ex["shared_feed_forward_length"]) == (8, 2, 512)
    assert ex["active_parameters"] == info["parameters"] - 2 * 6 * 3 * 256 * 256


def test_bench_counts_the_active_bytes_of_a_synthetic_moe(monkeypatch):
    """A scaled-down qwen3-30b-a3b (3 layers, 16 experts, 4 used): bench's bytes per token are every tensor's bytes
    less the unselected experts' (12 of 16 per stacked tensor) and all but one row of the embedding; bench's pp
    and tg runs go through the expert kernels."""
    from types import SimpleNamespace

    from pyllm.cli.bench import load_subject, time_pp, time_tg
    from pyllm.models import synthetic as syn

    monkeypatch.setitem(syn.SHAPES, "tiny-moe", (3, 256, 512, 4, 2, 64, 1000, 1e6, "qwen3moe", False))
    monkeypatch.setitem(syn.MOE_SHAPES, "tiny-moe", (16, 4, 256))
    a = SimpleNamespace(n_depth=0, n_prompt=8, n_gen=4, device="cpu", gpu_layers=None, kernels="fast", threads=None, kv="f16",
                        lora=[], lora_scaled=[])
    s = load_subject(None, "tiny-moe:q4_k_m", a)
    exps = sum(w.nbytes for n, w in s.weights.items() if n.endswith("_exps.weight"))
    embd = s.weights["token_embd.weight"]
    assert s.weight_bytes_per_token() == s.size_bytes - exps * 12 // 16 - embd.nbytes + embd.nbytes // 1000
    assert exps > 0 and s.weights["blk.0.ffn_down_exps.weight"].shape == (16, 256, 256)
    s.gen.reset()
    assert time_pp(s, 8) > 0 and time_tg(s, 2, depth=8) > 0  # bench's own pp and tg runs, a few tokens


def test_synthetic_qwen3_30b_a3b_is_a_known_shape():
    from pyllm.errors import PyllmError
    from pyllm.models.synthetic import MOE_SHAPES, SHAPES, check_synthetic_spec

    assert check_synthetic_spec("qwen3-30b-a3b:q4_k_m") == ("qwen3-30b-a3b", "q4_k_m")
    assert SHAPES["qwen3-30b-a3b"][:7] == (48, 2048, 6144, 32, 4, 128, 151936)
    assert MOE_SHAPES["qwen3-30b-a3b"] == (128, 8, 768)
    with pytest.raises(PyllmError, match="mixture of experts"):
        check_synthetic_spec("qwen3-30b-a3b:awq")


def test_chat_and_serve_run_the_converted_moe(tmp_path):
    """`pyllm chat` (piped) and `pyllm serve` (an OpenAI chat completion on 127.0.0.1) on the tiny q8_0 file: a
    reply of the asked length, exit 0, the server's reply the same greedy text as the library's."""
    import subprocess
    import sys

    import pyllm
    from server_harness import Server

    path = str(gguf_path("qwen3moe", "q8_0"))
    res = subprocess.run([sys.executable, "-m", "pyllm", "chat", path, "-n", "8", "--temp", "0"],
                         input="The quick brown fox", capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    llm = pyllm.load(path, n_ctx=256)
    want = llm.chat([{"role": "user", "content": "The quick brown fox"}], max_tokens=8, temperature=0)
    want = want if isinstance(want, str) else want["choices"][0]["message"]["content"]
    srv = Server(path)
    try:
        r = srv.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "The quick brown fox"}],
                                                 max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want
        assert r.usage.completion_tokens >= 1
    finally:
        srv.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_step_rows_equal_one_token_steps(arch):
    """decode_steps (several tokens in one pass: speculative verification, batched decoding) routes every row by its
    own router: on every kernel path this CPU has, each row of a 3- and an 8-row pass gives the one-token step's
    logits bit for bit (the float32 router runs a row at a time, the experts a GEMV per row and selection, the
    attention and shared-expert matrices are exact row types), so the step says rows_exact."""
    import pyllm
    from pyllm import ops

    llm = pyllm.load(str(gguf_path(arch, "q8_0")), n_ctx=64, n_threads=2, kv_cache="f32")
    step = llm.model.fused_step(llm.kv)
    assert step is not None and step.rows_exact
    toks = torch.tensor([5, 17, 42, 99, 7, 3, 250, 11])
    before = ops.get_isa()
    try:
        for isa in ops._C.available_isas():
            ops.set_isa(isa)
            one = torch.stack([step(int(t), i)[0] for i, t in enumerate(toks.tolist())])
            for m in (3, 8):
                rows = step.rows(toks[:m], 0).clone()
                assert torch.equal(rows, one[:m]), (arch, isa, m, (rows - one[:m]).abs().max())
    finally:
        ops.set_isa(before)
    llm.close()


# ---- the CUDA backend's expert path, on the host (torch stand-ins for its kernels) --------------------------------
def test_cuda_backend_routes_decode_through_the_expert_gemv_on_the_host(monkeypatch):
    """The CUDA backend (on the CPU, tests/test_cuda_backend_host.py's torch stand-ins) with a stand-in for
    cuda_gemv_experts that holds its contract (y[t, j] = x row @ W[ids[t, j]]^T, float32): a short prompt's and each
    decoded token's selections go through one launch per stacked tensor; 8 greedy tokens equal the
    reference backend's, whose logits it matches within 1e-4 relative (both float32: a 4-token prompt, which the
    backend's GEMV takes; longer prompts go through its fp16 dequantize + matmul)."""
    import pyllm
    from pyllm import backends
    from pyllm.backends import cuda as cb
    from pyllm.backends import cuda_step as cs
    from test_cuda_backend_host import FakeCudaBackend, TorchKernels

    # as tests/test_cuda_backend_host.py's shadow_codes_value: codes stand for their float rows (fresh shadows)
    TorchKernels.shadow.clear()
    monkeypatch.setattr(cs, "codes_value", lambda xq, xds: TorchKernels.rows(xq))
    launches = []

    class ExpertKernels(TorchKernels):
        def cuda_gemv_experts(self, w, qtype, x, ids):
            from pyllm.formats.quant import QTensor

            t, k = ids.shape
            rows = (x if x.dim() == 3 else x[:, None].expand(t, k, x.shape[-1])).reshape(t * k, -1)
            out = torch.stack([rows[a] @ QTensor(qtype, (w.shape[1], rows.shape[1]), w[e]).dequantize().T
                               for a, e in enumerate(ids.reshape(-1).tolist())])
            launches.append(t * k)
            return out.view(t, k, -1)

    class ExpertBackend(FakeCudaBackend):
        def __init__(self):
            super().__init__()
            self.K = ExpertKernels()

    path = str(gguf_path("qwen2moe", "q8_0"))
    monkeypatch.setenv("PYLLM_CUDA_GRAPH", "0")
    monkeypatch.setattr(backends, "select", lambda *a, **k: ExpertBackend())
    fake = pyllm.load(path, device="cpu", n_ctx=128, kv_cache="f32")
    assert fake.model.backend.name == "cuda" and fake.model.fused_step(fake.kv) is None  # the CUDA step declines
    ref = model("qwen2moe", "q8_0")
    ids = ref.tokenize(PROMPTS[0])  # 4 tokens: every matrix through the backend's float32 GEMV stand-in
    assert rel_per_position(fake.logits(ids).double(), ref.logits(ids).double()) < 1e-4
    assert launches == [8] * 3 * 2  # 4 tokens x 2 experts: gate, up and down of each of 2 layers, a launch each
    launches.clear()
    want = list(ref.generate_tokens(ids, max_tokens=8, temperature=0, speculative="none"))
    got = list(fake.generate_tokens(ids, max_tokens=8, temperature=0, speculative="none"))
    assert got == want
    assert launches and set(launches) == {2}  # each decoded token: its 2 experts
    TorchKernels.shadow.clear()
