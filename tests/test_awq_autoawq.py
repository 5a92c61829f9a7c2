"""AWQ checkpoints written by AutoAWQ 0.2.9 (the writer behind most hub "-AWQ" repos) and by auto-round 0.16.1,
loaded by pyllm and checked against references the writers themselves produce.

Fixtures (tests/conftest.py, built once per machine under the pyllm cache):
- ``autoawq_fixtures``: tools/autoawq_fixture.py runs AutoAWQ 0.2.9 in its own venv (transformers 4.51.3): packed
  layers from ``WQLinear_GEMM.from_linear`` with ``dequantize_gemm``'s output beside them, and two tiny random
  models (llama G=64 hidden 192 tied fp16; qwen2 G=128 with biases, bf16 non-quantized tensors) quantized by
  AutoAWQ's own AWQ search on the CPU (scale search with a cloned snapshot, apply_clip=False) and saved with
  ``save_quantized``; plus ``<name>.ref.safetensors``, the quantized model's weights as AutoAWQ dequantizes them.
  Skips with the reason when the venv cannot be built (no network).
- ``auto_round_awq``: tools/make_awq_fixture.py (auto-round RTN, format="auto_awq"), in the main environment.

References and tolerances:
- unpacking: pyllm's dequantize equals AutoAWQ's ``dequantize_gemm`` bit for bit, in fp16 and fp32;
- logits: transformers (main env, fp32) running the same architecture with the weights AutoAWQ dequantized
  (``dequantize_gemm`` for auto-round's folders); every position: same argmax, max|diff| / max|logit| < 1e-3 on
  the reference backend.  The fast backend runs short prompts through the int4 GEMV with int8 activations
  (tests/test_kernels.py: ~1% of an output's size), so there: < 5e-2, and the argmax may differ only where the
  reference's top-2 gap is below 0.1;
- greedy text: 32 tokens equal to transformers' greedy ``generate`` on at least 3 of 4 prompts, and a divergence
  only where the reference's top-2 logit gap is < 1e-2 (the near-ties are printed, as in tests/test_model.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pyllm.formats.awq.folder import open_awq
from pyllm.formats.awq.unpack import AWQTensor
from test_awq import dequantize_gemm

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "Q: What is 12 * 7?\nA:",
]
AUTOAWQ_MODELS = ["llama-g64", "qwen2-g128"]
BACKENDS = ["reference", "fast"]


# ------------------------------------------------------------------ helpers
def hf_dense(awq_dir: Path, state_dict: dict):
    """transformers (main env) model of the AWQ folder's architecture, float32, holding ``state_dict``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((awq_dir / "config.json").read_text())
    cfg.pop("quantization_config")
    for k in ("torch_dtype", "dtype", "transformers_version", "architectures", "_name_or_path"):
        cfg.pop(k, None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected, unexpected
    assert all("lm_head" in m for m in missing) and (not missing or config.tie_word_embeddings), missing
    if config.tie_word_embeddings:
        model.tie_weights()
        assert torch.equal(model.lm_head.weight, state_dict["model.embed_tokens.weight"])
    return model


def dequantized_state_dict(awq_dir: Path) -> dict:
    """Every tensor of the folder in fp32, quantized linears through AutoAWQ's dequantize_gemm (tests/test_awq.py)."""
    from safetensors.torch import load_file

    g = json.loads((awq_dir / "config.json").read_text())["quantization_config"]["group_size"]
    t = {}
    for shard in sorted(awq_dir.glob("*.safetensors")):  # read by safetensors itself, not by pyllm
        t.update(load_file(str(shard)))
    sd = {}
    for name in t:
        mod, _, suffix = name.rpartition(".")
        if suffix == "qweight":
            qw, qz, s = (t[mod + x] for x in (".qweight", ".qzeros", ".scales"))
            sd[mod + ".weight"] = dequantize_gemm(qw, qz, s.float(), 4, g).T.contiguous()
        elif suffix in ("weight", "bias"):
            sd[name] = t[name].float()
    return sd


def check_logits(llm, ref_model, text: str, tol: float = 1e-3, tie: float = 0.0):
    """Every position: max|diff| / max|logit| < tol, and the same argmax except where the reference's top-2 gap
    is below ``tie``."""
    ids = llm.tokenize(text)
    assert len(ids) > 4
    got = llm.logits(ids).double()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].double()
    rel = ((got - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
    top2 = ref.topk(2, -1).values
    differs = (got.argmax(-1) != ref.argmax(-1)) & (top2[:, 0] - top2[:, 1] >= tie)
    assert not differs.any(), f"argmax differs at positions {differs.nonzero().flatten().tolist()}"
    assert rel < tol, f"worst position max|diff|/max|logit| = {rel:.2e}"
    return rel


def upto_eog(llm, toks: list[int]) -> list[int]:
    end = next((i for i, t in enumerate(toks) if llm.tokenizer.is_eog(t)), None)
    return toks if end is None else toks[: end + 1]


def check_greedy(llm, ref_model, label: str, n: int = 32):
    """Greedy continuations against transformers' generate: >= 3 of 4 equal, divergences only at near-ties."""
    exact, notes = 0, []
    eos = llm.tokenizer.eos_id
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt)
        llm.reset()
        ours = list(llm.generate_tokens(ids, max_tokens=n, temperature=0))
        with torch.no_grad():
            out = ref_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_k=None, top_p=None,
                                     temperature=None, pad_token_id=eos)
        # generation ends at the first end-of-generation token (transformers' model knows only config.eos_token_id)
        ours, theirs = (upto_eog(llm, t) for t in (ours, out[0, len(ids):].tolist()))
        m = min(len(ours), len(theirs))
        diff = next((i for i in range(m) if ours[i] != theirs[i]), None)
        if diff is None:
            assert len(ours) == len(theirs), f"{label} {prompt!r}: {len(ours)} vs {len(theirs)} tokens"
            exact += 1
            continue
        with torch.no_grad():
            logits = ref_model(torch.tensor([ids + theirs[:diff]])).logits[0, -1]
        top2 = logits.topk(2).values
        gap = (top2[0] - top2[1]).item()
        notes.append(f"{label} {prompt!r}: diverges at token {diff}, reference top-2 gap {gap:.3g}")
        assert gap < 1e-2, notes[-1]
    print(f"{label}: {exact}/4 greedy continuations equal transformers'")
    for note in notes:
        print("near-tie:", note)
    assert exact >= 3, f"{label}: only {exact}/4 greedy continuations equal transformers' ({notes})"
    return exact


# ------------------------------------------------------------------ AutoAWQ: packed layers
def test_autoawq_layers_unpack_exactly(autoawq_fixtures):
    from safetensors.torch import load_file

    t = load_file(str(autoawq_fixtures / "layers.safetensors"))
    keys = sorted({k.split(".")[0] for k in t})
    assert {k.split("_")[0] for k in keys} == {"g32", "g64", "g128"} and len(keys) >= 9, keys
    for key in keys:
        g, k, n = (int(p[1:]) for p in key.split("_"))
        qw, qz, s = t[key + ".qweight"], t[key + ".qzeros"], t[key + ".scales"]
        assert qw.shape == (k, n // 8) and qz.shape == (k // g, n // 8) and s.dtype == torch.float16, key
        w = AWQTensor(qw, qz, s, g, name=key)
        assert w.shape == (n, k)
        assert torch.equal(w.dequantize(torch.float16), t[key + ".ref_f16"].T), key
        assert torch.equal(w.dequantize(torch.float32), t[key + ".ref_f32"].T), key
        # and the copy of dequantize_gemm that the other AWQ tests trust agrees with the real one
        assert torch.equal(dequantize_gemm(qw, qz, s, 4, g), t[key + ".ref_f16"]), key


# ------------------------------------------------------------------ AutoAWQ: whole checkpoints
@pytest.fixture(scope="module")
def autoawq_refs(autoawq_fixtures):
    from safetensors.torch import load_file

    return {name: hf_dense(autoawq_fixtures / name, load_file(str(autoawq_fixtures / f"{name}.ref.safetensors")))
            for name in AUTOAWQ_MODELS}


@pytest.mark.parametrize("name", AUTOAWQ_MODELS)
def test_autoawq_folder_is_what_autoawq_writes(autoawq_fixtures, name):
    d = autoawq_fixtures / name
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"] == {"bits": 4, "group_size": int(name.split("-g")[1]), "modules_to_not_convert":
                                          None, "quant_method": "awq", "version": "gemm", "zero_point": True}
    assert cfg["transformers_version"] == "4.51.3"
    info, mcfg, w = open_awq(d)
    assert mcfg.tied_output == cfg["tie_word_embeddings"] == (name == "llama-g64")
    assert sum(isinstance(v, AWQTensor) for v in w.values()) == 14  # 7 linears x 2 layers


@pytest.mark.parametrize("name", AUTOAWQ_MODELS)
def test_autoawq_reference_is_dequantize_gemm(autoawq_fixtures, name):
    """AutoAWQ's own fp32 reading of its model equals the state dict rebuilt here from the folder."""
    from safetensors.torch import load_file

    ref = load_file(str(autoawq_fixtures / f"{name}.ref.safetensors"))
    sd = dequantized_state_dict(autoawq_fixtures / name)
    assert set(sd) <= set(ref) and set(ref) - set(sd) <= {"lm_head.weight"}
    for k in sd:
        assert torch.equal(sd[k], ref[k]), k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", AUTOAWQ_MODELS)
def test_autoawq_logits_match_transformers(autoawq_fixtures, autoawq_refs, name, backend):
    import pyllm

    llm = pyllm.load(autoawq_fixtures / name, kernels=backend, n_ctx=128)
    assert llm.config.rope_style == "neox"
    tol, tie = (1e-3, 0.0) if backend == "reference" else (5e-2, 0.1)
    rel = check_logits(llm, autoawq_refs[name], "Hello world! The quick brown fox jumps over the lazy dog.", tol, tie)
    print(f"{name} {backend}: max rel logit diff {rel:.2e}")


@pytest.mark.parametrize("name", AUTOAWQ_MODELS)
def test_autoawq_greedy_matches_transformers(autoawq_fixtures, autoawq_refs, name):
    import pyllm

    llm = pyllm.load(autoawq_fixtures / name, kernels="reference", n_ctx=128)
    check_greedy(llm, autoawq_refs[name], f"AutoAWQ {name}")


# ------------------------------------------------------------------ auto-round: greedy text
@pytest.mark.parametrize("name", ["llama-g64", "qwen2-g128"])
def test_auto_round_greedy_matches_transformers(auto_round_awq, name):
    import pyllm

    d = auto_round_awq[name]
    ref = hf_dense(d, dequantized_state_dict(d))
    llm = pyllm.load(d, kernels="reference", n_ctx=128)
    check_logits(llm, ref, "Once upon a time there was a small language model.")
    check_greedy(llm, ref, f"auto-round {name}")


# ------------------------------------------------------------------ opt-in: AWQ SmolLM2-135M
SLOW = os.environ.get("PYLLM_SLOW") == "1"


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="opt-in (PYLLM_SLOW=1): builds an AWQ SmolLM2-135M from its GGUF (~1 min)")
def test_smollm2_awq_matches_transformers():
    import pyllm
    from conftest import _tool

    d = _tool("make_awq_smollm2").build_cached()
    ref = hf_dense(d, dequantized_state_dict(d))
    llm = pyllm.load(d, kernels="reference", n_ctx=256)
    for prompt in PROMPTS:
        check_logits(llm, ref, prompt)
    check_greedy(llm, ref, "AWQ SmolLM2-135M")
    from transformers import AutoTokenizer

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert llm.format_chat(msgs) == AutoTokenizer.from_pretrained(d).apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    out = pyllm.load(d, n_ctx=256).generate("The capital of France is", max_tokens=12, temperature=0)
    print("AWQ SmolLM2 (fast backend):", repr(out))
    assert len(out.strip()) > 0
