"""gpt-oss: a tiny random transformers GptOssForCausalLM (2 layers, hidden 256, 8 experts of 256 routed top-2,
attention sinks, q/k/v/o, router and expert biases, sliding window 8 in the even layers, YaRN rope x32), saved with
save_pretrained, converted by ``pyllm convert`` and compared with transformers' float32 eager forward on the same
token ids (its reference; the prompts are longer than the window, so the local layers' masks matter).

Tolerances:
- f32 / f16 files hold the checkpoint exactly (its weights are rounded to f16 first): all-position logits within
  TOL_FLOAT = 1e-4 relative (max|diff| / max|logit| per position) with the same argmax; both bodies compute in
  float32 (seen ~1e-6: sums in another order), so 1e-4 catches any wrong term (a sink, a bias, the clamp, the
  window or a YaRN frequency moves logits by >= 1e-2 here) and 24 greedy tokens equal transformers' generate.
- q4_0 / mxfp4_moe files: against transformers running the same rounded weights (gguf.quants' dequantization of
  the file's blocks), TOL_FLOAT as well: the reference backend computes on the dequantized weights in float32.
"""

import copy
import functools
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import tiny_models as tm
from test_moe import fp32_prefill  # noqa: F401 (fixture)

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2) # a longer prompt",
]
TOL_FLOAT = 1e-4
N_LAYER, N_EXPERT, WINDOW = 2, 8, 8


def _config():
    import transformers as tf

    return tf.GptOssConfig(
        vocab_size=tm.VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=N_LAYER, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_local_experts=N_EXPERT, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=131072, initializer_range=0.08, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, attn_implementation="eager",
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0})


@functools.lru_cache(maxsize=None)
def hf_dir():
    import transformers as tf

    torch.manual_seed(2025)
    model = tf.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
            elif n.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 2.0)  # sinks large enough to take a real share of each softmax
            elif "bias" in n:
                p.copy_(torch.randn_like(p) * 0.1)
            elif n.endswith("router.weight"):  # a router whose top-2 is clear of ties at f16 / 4-bit rounding
                p.copy_(torch.randn_like(p) * 0.3)
            elif n.endswith(("gate_up_proj", "down_proj")):
                p.copy_(torch.randn_like(p) * 0.12)  # |gate| reaches the clamp (7) now and then
            p.copy_(p.half().float())
    d = tm.root() / "gpt-oss"
    model.save_pretrained(d)
    tm.tokenizer().save_pretrained(d)
    return d


@functools.lru_cache(maxsize=None)
def hf_model():
    import transformers as tf

    m = tf.AutoModelForCausalLM.from_pretrained(hf_dir(), dtype=torch.float32, attn_implementation="eager")
    m.eval()
    return m


@functools.lru_cache(maxsize=None)
def gguf_path(ftype: str):
    from pyllm.formats.convert import convert

    return convert(hf_dir(), tm.root() / f"gpt-oss-{ftype}.gguf", ftype, log=None)


@functools.lru_cache(maxsize=None)
def model(ftype: str, kernels: str = "reference"):
    import pyllm

    return pyllm.load(str(gguf_path(ftype)), kernels=kernels, n_ctx=256, kv_cache="f32")


def rel_per_position(ours, theirs):
    return ((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)).max().item()


def hf_logits(m, ids):
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].double()


def decode_logits(llm, ids):
    """Logits after each of ids, one token at a time: every position through the decode path (the KV cache)."""
    g = llm.generator
    g.reset()
    out = [g._forward([t])[-1] for t in ids]
    g.reset()
    return torch.stack(out).double()


def assert_logits_match(llm, hf, label, decode=False):
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt)
        ours = decode_logits(llm, ids) if decode else llm.logits(ids).double()
        theirs = hf_logits(hf, ids)
        rel = rel_per_position(ours, theirs)
        print(f"{label} {len(ids)} tokens: max rel {rel:.2e}")
        assert rel < TOL_FLOAT, f"{label} {prompt!r}: max|diff|/max|logit| = {rel:.2e}"
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_the_spec_is_gpt_oss():
    from pyllm.models.spec import YarnSpec

    spec = model("f32").model.spec
    assert (spec.n_expert, spec.n_expert_used, spec.n_ff_exp, spec.n_ff_shexp) == (N_EXPERT, 2, 256, 0)
    assert (spec.act, spec.expert_gating, spec.expert_bias, spec.attn_sinks, spec.attn_out_bias, spec.qkv_bias) == \
        ("swiglu_oai", "softmax_weight", True, True, True, True)
    assert [la.window for la in spec.layers] == [WINDOW, 0]
    assert spec.rope_style == "neox" and spec.yarn == YarnSpec(32.0, 4096, 32.0, 1.0)
    assert spec.fused_step_gaps("cpu") == ()  # the C++ step computes every field
    assert set(spec.fused_step_gaps("cuda")) == {"attn_sinks", "attn_out_bias", "expert_bias", "act", "expert_gating"}
    with pytest.raises(ValueError, match="backend must be"):
        spec.fused_step_gaps("gpu")


@pytest.mark.parametrize("ftype", ["f32", "f16"])
def test_float_logits_match_transformers(ftype):
    assert_logits_match(model(ftype), hf_model(), f"gpt-oss {ftype}")


def test_decode_through_the_cache_matches_transformers():
    """One token at a time: the sinks over the cached keys, the window over positions, the yarn tables by position."""
    assert_logits_match(model("f32"), hf_model(), "gpt-oss f32 decode", decode=True)


def test_f32_greedy_on_the_fast_backend_matches_transformers(fp32_prefill):  # noqa: F811
    """The CPU backend: the prompt through the torch forward with the expert kernels (moe_mul_mat), every decoded
    token through the C++ step (sinks, biases, swiglu_oai, the top-k softmax, the window: csrc/cpu/decode_step.cpp);
    24 greedy tokens equal transformers' generate (the fp32 prefill GEMM: the bf16 one's rounding moves these random
    logits by ~0.2%, bounded by tests/test_prefill_gemm.py)."""
    import pyllm

    llm = pyllm.load(str(gguf_path("f32")), kernels="fast", n_ctx=256, kv_cache="f32")
    assert llm.model.fused_step(llm.kv) is not None  # the C++ step decodes
    ids = llm.tokenize(PROMPTS[1])
    ours = list(llm.generate_tokens(ids, max_tokens=24, temperature=0))
    with torch.no_grad():
        out = hf_model().generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, top_k=None, top_p=None,
                                  temperature=None, pad_token_id=0, eos_token_id=None)
    theirs = out[0, len(ids):].tolist()
    n = min(len(ours), len(theirs))
    assert n and ours[:n] == theirs[:n] and (n == len(theirs) or llm.tokenizer.is_eog(ours[-1]))


# ---- the C++ step (csrc/cpu/decode_step.cpp) against the torch forward on the same cache ------------------------
# Tolerances.  With an f16 cache both bodies run the same GEMV kernels on the same activations and attend over the
# same rows in float32, so only summation order differs: TOL_FLOAT of the largest |logit| (seen ~4e-6).  With 8-bit
# keys the step dots them with the query rounded to 8 bits (the torch forward reads them dequantized): 5% of the
# largest |logit|, and 4x that with 4-bit keys, as tests/test_conformance.py derives them (seen ~1% / 5%; with the
# scalar kernels, which dot in float, ~7e-6 for every kind: the centered keys' shift before the sink is exact).  And
# the same greedy token wherever the reference's top-2 margin exceeds the bound.  Measured effect of a missing field
# on these logits: the sinks ~29%, the attention-output bias ~26%, the experts' down bias ~4%.
CONFORMANCE_TOL = {"f16": TOL_FLOAT, "q8_0": 0.05, "q4_rot": 0.2}


@functools.lru_cache(maxsize=None)
def fast_model(ftype: str):
    import pyllm

    return pyllm.load(str(gguf_path(ftype)), kernels="fast", n_ctx=640, kv_cache="f16", n_threads=2)


def assert_conforms(ours: torch.Tensor, ref: torch.Tensor, label: str, tol: float) -> None:
    atol = tol * float(ref.abs().max())
    print(f"{label}: max|diff| {float((ours - ref).abs().max()):.3e}, atol {atol:.3e}")
    torch.testing.assert_close(ours, ref, rtol=0, atol=atol, msg=lambda m: f"{label}: {m}")
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > atol
    assert bool((ours.argmax(-1) == ref.argmax(-1))[clear].all()), label


def torch_steps(model, kv, tokens: list[int], pos: int) -> torch.Tensor:
    """The torch forward's logits of ``tokens`` fed one at a time from ``pos`` on ``kv`` (the reference)."""
    model.use_cpp_decode = False
    try:
        return torch.stack([model.forward(torch.tensor([t]), pos + i, kv)[0] for i, t in enumerate(tokens)])
    finally:
        model.use_cpp_decode = True


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_rot"])
def test_cpu_step_rows_and_batch_match_the_torch_forward(kind):
    """The mxfp4_moe file (experts MXFP4 through the CPU GEMV, the rest Q8_0) after a 530-token prompt: the
    full-attention layer's rows attend in two key parts (csrc/cpu/decode_step.cpp key_parts), merged before the sink
    takes its share; the windowed layer sees 8 keys.  The one-token step, a 4-row pass (speculation's) and a
    decode_batch pass over two sequences (the other one's rows from position 0: the sink against a single key) each
    against the torch forward fed the same tokens from the same cache state.  Quantized caches store centered keys,
    whose scores the step shifts back before the sink joins them (bounds: CONFORMANCE_TOL).  Every matrix is of an
    exact row type (MXFP4 experts, Q8_0) but the float32 router, which the step runs a row at a time: the step says
    rows_exact, and the 4-row pass and this sequence's batch rows are the one-token steps' bits."""
    from pyllm import ops
    from pyllm.runtime.kv_cache import make_kv_cache
    from test_decode_step_gemma3 import _restore, _snapshot

    llm = fast_model("mxfp4_moe")
    model, c = llm.model, llm.config
    tol = CONFORMANCE_TOL[kind]
    g = torch.Generator().manual_seed(49)
    prompt = torch.randint(3, c.n_vocab, (530,), generator=g)
    tokens = torch.randint(3, c.n_vocab, (4,), generator=g).tolist()
    kv = make_kv_cache(kind, c.n_layer, c.n_kv_head, 600, c.head_dim)
    model.use_cpp_decode = False
    model.forward(prompt, 0, kv)
    model.use_cpp_decode = True
    pos = len(prompt)
    start = _snapshot(kv)

    ref = torch_steps(model, kv, tokens, pos)
    _restore(kv, start)
    step = model.fused_step(kv)
    assert step is not None, "no C++ step for gpt-oss"
    assert step.rows_exact
    one = torch.stack([step(t, pos + i)[0] for i, t in enumerate(tokens)])
    assert_conforms(one, ref, f"gpt-oss {kind} one-token steps", tol)
    _restore(kv, start)
    rows = step.rows(torch.tensor(tokens), pos)
    assert torch.equal(rows, one), f"gpt-oss {kind} 4-row pass: {(rows - one).abs().max()}"

    # one decode_batch pass: rows 0-1 this sequence at pos, pos + 1; rows 2-4 a fresh f16 sequence at 0, 1, 2
    fresh = tokens[:3]
    ref_fresh = torch_steps(model, make_kv_cache("f16", c.n_layer, c.n_kv_head, 600, c.head_dim), fresh, 0)
    other = make_kv_cache("f16", c.n_layer, c.n_kv_head, 600, c.head_dim)
    _restore(kv, start)
    ctx_a, ctx_b = model.fused_step(kv).ctx, model.fused_step(other).ctx
    out = torch.empty(5, c.n_vocab)
    ops._C.decode_batch([ctx_a, ctx_a, ctx_b, ctx_b, ctx_b], torch.tensor(tokens[:2] + fresh),
                        torch.tensor([pos, pos + 1, 0, 1, 2]), out)
    assert torch.equal(out[:2], one[:2]), f"gpt-oss {kind} batch rows: {(out[:2] - one[:2]).abs().max()}"
    assert_conforms(out[2:], ref_fresh, "gpt-oss f16 batch rows from position 0", CONFORMANCE_TOL["f16"])


def _hf_with_file_weights(llm):
    """transformers' model with each matrix rounded to the type the GGUF holds it in (dequantized by gguf.quants):
    the experts row by row as the file stores them (out x in, gate and up de-interleaved)."""
    import gguf

    from pyllm.formats.gguf import GGMLType
    from pyllm.formats.quantize import quantize

    def rounded(rows: np.ndarray, qtype) -> np.ndarray:
        if qtype == GGMLType.F32:
            return rows
        raw = quantize(np.ascontiguousarray(rows, dtype=np.float32), qtype)
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype))).reshape(rows.shape)

    m = copy.deepcopy(hf_model())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, N_LAYER)
    with torch.no_grad():
        for hf_name, p in m.named_parameters():
            i = re.search(r"layers\.(\d+)\.", hf_name)
            if hf_name.endswith("gate_up_proj"):  # [E, D, 2F], columns gate 0, up 0, gate 1, ...
                for part, cols in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                    qt = llm.weights[f"blk.{i.group(1)}.ffn_{part}_exps.weight"].qtype
                    w = p[:, :, cols].transpose(1, 2).numpy()  # [E, F, D]
                    r = rounded(w.reshape(-1, w.shape[-1]), qt).reshape(w.shape)
                    p[:, :, cols] = torch.from_numpy(r).transpose(1, 2)
            elif hf_name.endswith("down_proj"):  # [E, F, D]
                qt = llm.weights[f"blk.{i.group(1)}.ffn_down_exps.weight"].qtype
                w = p.transpose(1, 2).numpy()
                p.copy_(torch.from_numpy(rounded(w.reshape(-1, w.shape[-1]), qt).reshape(w.shape)).transpose(1, 2))
            elif p.ndim == 2 and not hf_name.endswith("bias"):  # biases stay float32 (gate_up_proj_bias is 2-D)
                name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                p.copy_(torch.from_numpy(rounded(p.numpy(), llm.weights[name].qtype)))
    return m


@pytest.mark.parametrize("ftype", ["q4_0", "mxfp4_moe"])
def test_quantized_logits_match_transformers_on_the_same_weights(ftype):
    from pyllm.formats.gguf import GGMLType

    llm = model(ftype)
    types = {n: w.qtype for n, w in llm.weights.items() if len(w.shape) >= 2}
    assert types["blk.0.ffn_gate_inp.weight"] == GGMLType.F32 and types["blk.0.ffn_up_exps.bias"] == GGMLType.F32
    want = {"q4_0": GGMLType.Q4_0, "mxfp4_moe": GGMLType.MXFP4}[ftype]
    assert {types[f"blk.{i}.ffn_{p}_exps.weight"] for i in range(N_LAYER) for p in ("gate", "up", "down")} == {want}
    same = _hf_with_file_weights(llm)
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt)
        ours = llm.logits(ids).double()
        exact = rel_per_position(ours, hf_logits(same, ids))
        vs_float = rel_per_position(ours, hf_logits(hf_model(), ids))
        print(f"gpt-oss {ftype}: vs same weights {exact:.2e}, vs float {vs_float:.2e}")
        assert exact < TOL_FLOAT


def test_mxfp4_checkpoint_blocks_are_kept_bit_for_bit(tmp_path):
    """A checkpoint in OpenAI's released form (experts as MXFP4 *_blocks / *_scales, OpenAI's nibble order, rows out x
    in with gate and up interleaved) converts to ggml MXFP4 tensors whose bytes are pyllm's quantizer's on the same
    rows (the quantizer is gguf.quants' bit for bit, tests/test_mxfp4.py): the codes are repacked, not requantized."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pyllm.formats.convert import convert
    from pyllm.formats.gguf import GGMLType, open_gguf
    from pyllm.formats.quantize import quantize

    src = hf_dir()
    d = tmp_path / "mxfp4"
    shutil.copytree(src, d)
    sd = load_file(str(d / "model.safetensors"))
    want = {}
    for name in list(sd):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        rows = sd.pop(name).transpose(1, 2).contiguous()  # [E, out, in]
        e, n, k = rows.shape
        ggml = quantize(rows.reshape(-1, k).numpy(), GGMLType.MXFP4).reshape(e, n, k // 32, 17)
        codes = np.stack((ggml[..., 1:] & 15, ggml[..., 1:] >> 4), axis=-2).reshape(e, n, k // 32, 32)  # element order
        openai = codes[..., 0::2] | (codes[..., 1::2] << 4)
        sd[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(openai))
        sd[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(ggml[..., 0]))
        i = re.search(r"layers\.(\d+)\.", name).group(1)
        flat = ggml.reshape(e, n, -1)
        if name.endswith("gate_up_proj"):
            want[f"blk.{i}.ffn_gate_exps.weight"], want[f"blk.{i}.ffn_up_exps.weight"] = flat[:, 0::2], flat[:, 1::2]
        else:
            want[f"blk.{i}.ffn_down_exps.weight"] = flat
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    out = convert(d, tmp_path / "mxfp4.gguf", "f16", log=None)
    with open_gguf(str(out)) as gf:
        assert len(want) == 3 * N_LAYER
        for name, raw in want.items():
            t = gf.tensors[name]
            assert t.ggml_type == GGMLType.MXFP4 and tuple(t.shape) == (N_EXPERT, raw.shape[1], 256), name
            assert np.array_equal(gf.raw(name).numpy().reshape(raw.shape), raw), name


def test_info_shows_experts_and_yarn():
    res = subprocess.run([sys.executable, "-m", "pyllm", "info", str(gguf_path("mxfp4_moe")), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["architecture"] == "gpt-oss"
    ex = info["experts"]
    assert (ex["count"], ex["used_per_token"], ex["feed_forward_length"]) == (N_EXPERT, 2, 256)
    assert "YaRN x32 (trained context 4096)" in info["rope"]
    # per layer 6 of 8 experts' gate / up / down matrices (256 x 256) and biases (256) idle
    assert ex["active_parameters"] == info["parameters"] - N_LAYER * 6 * 3 * (256 * 256 + 256)


def test_convert_refuses_what_the_file_format_cannot_hold(tmp_path):
    import shutil

    from pyllm.errors import ConvertError
    from pyllm.formats.convert import convert

    for change, needle in (({"swiglu_limit": 5.0}, "swiglu_limit"),
                           ({"layer_types": ["full_attention"] * N_LAYER}, "layer_types"),
                           ({"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "truncate": True,
                                                 "original_max_position_embeddings": 4096, "rope_theta": 1.5e5}},
                            "truncate")):
        d = tmp_path / needle
        shutil.copytree(hf_dir(), d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(change)
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConvertError, match=needle):
            convert(d, tmp_path / "out.gguf", "f16", log=None)


# A template in gpt-oss's harmony format, written here with the constructs its published template relies on: a
# namespace() whose attributes are set in loops, macros (one recursive), strftime_now, raise_exception, `in` tests
# on messages, a slice from loop.index, tojson, dict items() and optional keyword variables (reasoning_effort).
HARMONY_TEMPLATE = """
{%- macro ts_type(spec) -%}
  {%- if spec.type == "array" -%}{{ ts_type(spec["items"]) + "[]" }}
  {%- elif spec.type == "integer" or spec.type == "number" -%}number
  {%- elif spec.enum is defined -%}{{ '"' + spec.enum | join('" | "') + '"' }}
  {%- else -%}{{ spec.type }}{%- endif -%}
{%- endmacro -%}
{{- "<|start|>system<|message|>Knowledge cutoff: 2024-06\\nCurrent date: " + strftime_now("%Y-%m-%d") }}
{{- "\\n\\nReasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final.<|end|>" }}
{%- if messages[0].role in ("system", "developer") %}
  {%- set instructions, loop_messages = messages[0].content, messages[1:] %}
{%- else %}{%- set instructions, loop_messages = "", messages %}{%- endif %}
{%- if instructions or tools %}
  {{- "<|start|>developer<|message|>" }}
  {%- if instructions %}{{ "# Instructions\\n\\n" + instructions + "\\n\\n" }}{% endif %}
  {%- for tool in tools or [] %}{%- set f = tool.function %}
    {{- "type " + f.name + " = (_: {" }}
    {%- for name, spec in f.parameters.properties.items() %}
      {{- name + ("" if name in f.parameters.required else "?") + ": " + ts_type(spec) + ", " }}
    {%- endfor %}{{ "}) => any;\\n" }}
  {%- endfor %}{{- "<|end|>" }}
{%- endif %}
{%- set last_call = namespace(name=none) %}
{%- for message in loop_messages %}
  {%- if message.role == "assistant" and "tool_calls" in message %}
    {%- set later = namespace(final=false) %}
    {%- for m in loop_messages[loop.index:] %}
      {%- if m.role == "assistant" and "tool_calls" not in m %}{% set later.final = true %}{% endif %}
    {%- endfor %}
    {%- if "thinking" in message and not later.final %}
      {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
    {%- endif %}
    {%- set call = message.tool_calls[0].function %}
    {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" }}
    {{- call.arguments | tojson + "<|call|>" }}{%- set last_call.name = call.name %}
  {%- elif message.role == "assistant" %}
    {%- if "<|channel|>" in message.content %}{{ raise_exception("put the analysis in 'thinking'") }}{% endif %}
    {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
  {%- elif message.role == "tool" %}
    {%- if last_call.name is none %}{{ raise_exception("a tool message without a tool call before it") }}{% endif %}
    {{- "<|start|>functions." + last_call.name + " to=assistant<|channel|>commentary<|message|>" }}
    {{- message.content | tojson + "<|end|>" }}
  {%- else %}{{- "<|start|>user<|message|>" + message.content + "<|end|>" }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


def test_harmony_template_renders_in_the_sandbox_as_transformers_renders_it():
    """Reference: transformers' own renderer (render_jinja_template, a jinja2 sandbox with the same globals); a chat
    with a system prompt, tools, a tool call, its result, reasoning_effort; and the template's own refusal as a
    TemplateError naming it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from pyllm.chat_template import ChatTemplate
    from pyllm.errors import TemplateError

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                              "units": {"type": "string", "enum": ["c", "f"]},
                                                              "hours": {"type": "array", "items": {"type": "number"}}}}}}]
    chats = [
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}], {}),
        ([{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "", "thinking": "call the tool",
           "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "content": "sunny"}, {"role": "user", "content": "thanks"}],
         {"tools": tools, "reasoning_effort": "high"}),
    ]
    template = ChatTemplate(HARMONY_TEMPLATE)
    for messages, kwargs in chats:
        ours = template.render(messages, **kwargs)
        theirs, _ = render_jinja_template([messages], chat_template=HARMONY_TEMPLATE, add_generation_prompt=True,
                                          **kwargs)
        assert ours == theirs[0]
        assert ours.endswith(f"<|start|>user<|message|>{messages[-1]['content']}<|end|><|start|>assistant")
    assert "Reasoning: high" in template.render(*chats[1][:1], **chats[1][1])
    with pytest.raises(TemplateError, match="a tool message without a tool call"):
        template.render([{"role": "tool", "content": "x"}, {"role": "user", "content": "u"}])
