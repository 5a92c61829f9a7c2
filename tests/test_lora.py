"""LoRA adapters in llama.cpp's GGUF format (pyllm/lora.py), applied at run time without merging.

Reference: the same adapters merged into the weights in float32 (W' = W + sum_i s_i (alpha_i / r_i) B_i A_i, the
token embedding's table E' = E + sum_i s_i (alpha_i / r_i) A_i B_i^T), written as a second GGUF and run by the same
backend.  The base models are the tiny float32 checkpoints (tests/tiny_models.py), so the fast backend's GEMVs are
float32 too (for the 8-token prompt, see PROMPT) and the two runs differ only by float32 rounding: the unmerged run sums W x and B (A x) apart, the merged
one rounds W + BA once per weight.  Each dot product of K <= 512 terms then differs by about sqrt(K) u |w||x|
(u = 2^-24: ~1.4e-6 relative), through 2-6 layers of norms and residuals; 1e-4 relative (logits' norm) bounds that
with room, while the adapters move the logits by more than 5e-2 relative (checked: a term applied twice, or not at
all, or with the wrong scale, fails by hundreds of times the tolerance).

The adapters are made here by hand with gguf-py's GGUFWriter, as llama.cpp's convert_lora_to_gguf.py lays them out:
general.type "adapter", adapter.type "lora", adapter.lora.alpha, ``<base tensor>.lora_a`` [r, K] and ``.lora_b``
[N, r] (numpy order), the token embedding's pair flipped (lora_a [n_vocab, r], lora_b [n_embd, r]).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import pyllm
from pyllm.formats.gguf import open_gguf
from pyllm.lora import LoraError, parse_spec
from pyllm.formats.quant import qtensor_from_gguf
from tiny_models import gguf_path

REL_TOL = 1e-4
MIN_EFFECT = 5e-2
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# 8 tokens: the fast backend's prefill of up to GEMV_MAX_M rows runs the float32 GEMVs; longer prompts take its bf16
# prefill GEMM (~3e-3 relative error of its own, csrc/kernels.h), which would round W and W + BA differently.
PROMPT = [1, 17, 33, 5, 99, 42, 7, 250]
DECODED = [12, 200, 64, 3, 77]  # one token at a time after the prompt: the fused decode step where one applies


def base_weights(path) -> dict[str, torch.Tensor]:
    gf = open_gguf(path)
    try:
        return {n: qtensor_from_gguf(gf, n).dequantize() for n in gf.tensors}
    finally:
        gf.close()


def make_pairs(path, names, rank: int, seed: int, std: float = 0.15) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Random (A, B) pairs in the file layout for the base tensors ``names`` of the model at ``path``."""
    gf = open_gguf(path)
    shapes = {name: gf.tensors[name].shape for name in names}
    gf.close()
    g = np.random.default_rng(seed)
    pairs = {}
    for name in names:
        n, k = shapes[name]
        if name == "token_embd.weight":
            pairs[name] = (g.normal(0, std, (n, rank)).astype(np.float32), g.normal(0, std, (k, rank)).astype(np.float32))
        else:
            pairs[name] = (g.normal(0, std / np.sqrt(k), (rank, k)).astype(np.float32) * 4,
                           g.normal(0, std, (n, rank)).astype(np.float32))
    return pairs


def write_adapter(path, arch: str, pairs: dict, alpha: float | None = 16.0, f16: bool = False, extra=None,
                  general_type: str = "adapter") -> str:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", general_type)
    w.add_string("adapter.type", "lora")
    if alpha is not None:
        w.add_float32("adapter.lora.alpha", alpha)
    for name, (a, b) in pairs.items():
        dt = np.float16 if f16 else np.float32
        w.add_tensor(name + ".lora_a", a.astype(dt))
        w.add_tensor(name + ".lora_b", b.astype(dt))
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_merged(base, dst, adapters: list[tuple[dict, float, float]]) -> str:
    """``base`` with each adapter (pairs, alpha, scale) merged into its weights in float32 -> ``dst``; metadata and
    the other tensors copied as they are (tools/requantize_gguf.py's way)."""
    w = base_weights(base)
    merged = {}
    for pairs, alpha, scale in adapters:
        for name, (a, b) in pairs.items():
            a, b = torch.from_numpy(a.astype(np.float32)), torch.from_numpy(b.astype(np.float32))
            if name == "token_embd.weight":
                delta = (scale * alpha / a.shape[1]) * (a @ b.T)
            else:
                delta = (scale * alpha / a.shape[0]) * (b @ a)
            merged[name] = merged.get(name, w[name]) + delta
    reader = gguf.GGUFReader(str(base))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    out = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name in merged:
            out.add_tensor(t.name, merged[t.name].numpy().astype(np.float32))
        else:
            out.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return str(dst)


def logits_run(llm) -> torch.Tensor:
    """Logits of every prompt position (prefill: the torch forward) and of DECODED fed one by one (the fused
    step where the backend has one) -> [len(PROMPT) + len(DECODED), n_vocab]."""
    llm.reset()
    model, kv = llm.model, llm.kv
    with torch.inference_mode():
        rows = [model.forward(torch.tensor(PROMPT), 0, kv, all_logits=True)]
        for i, tok in enumerate(DECODED):
            rows.append(model.forward(torch.tensor([tok]), len(PROMPT) + i, kv))
    return torch.cat(rows).float()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


ALL = {
    # untied output: the output projection and the token embedding take terms too
    "mistral": lambda n: [f"blk.{i}.{m}.weight" for i in range(2) for m in LAYER_MATRICES]
    + ["output.weight", "token_embd.weight"],
    # qk-norm, tied output; only some matrices
    "qwen3": lambda n: [f"blk.{i}.{m}.weight" for i in range(2) for m in ("attn_q", "attn_v", "ffn_down")],
    # fused attn_qkv and [gate; up] rows: the terms are split as the weights are
    "phi3": lambda n: [f"blk.{i}.{m}.weight" for i in range(2) for m in ("attn_qkv", "attn_output", "ffn_up",
                                                                         "ffn_down")],
    # post-norms, embedding scale, sliding windows: every layer matrix
    "gemma3": lambda n: [f"blk.{i}.{m}.weight" for i in range(6) for m in LAYER_MATRICES],
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Per architecture: base path, one adapter, two adapters (their specs), and the merged files of each."""
    d = tmp_path_factory.mktemp("lora")
    out = {}
    for arch, names in ALL.items():
        base = gguf_path(arch, "f32")
        one = make_pairs(base, names(arch), rank=4, seed=1)
        # the second adapter: another rank and alpha, f16 in the file, on an overlapping subset of matrices
        two = make_pairs(base, names(arch)[::2], rank=8, seed=2)
        two = {n: (a.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32))
               for n, (a, b) in two.items()}
        gf = open_gguf(base)
        file_arch = gf.metadata["general.architecture"]  # the tiny mistral is a "llama" GGUF, as llama.cpp writes it
        gf.close()
        p1 = write_adapter(d / f"{arch}-one.gguf", file_arch, one, alpha=8.0)
        p2 = write_adapter(d / f"{arch}-two.gguf", file_arch, two, alpha=32.0, f16=True)
        out[arch] = dict(
            base=str(base), one=[p1], two=[(p1, 0.5), (p2, 1.5)],
            merged_one=write_merged(base, d / f"{arch}-merged-one.gguf", [(one, 8.0, 1.0)]),
            merged_two=write_merged(base, d / f"{arch}-merged-two.gguf", [(one, 8.0, 0.5), (two, 32.0, 1.5)]))
    return out


# Gemma 3 (6 layers, the slowest) on the fast backend only: its prefill there is the same torch hook the reference
# backend runs, and its decode the C++ step's Gemma path.
MATCH_CASES = [(arch, which, backend) for arch in ALL for which in ("one", "two") for backend in ("reference", "fast")
               if (arch, backend) != ("gemma3", "reference")]


@pytest.mark.parametrize("arch,which,backend", MATCH_CASES)
def test_adapters_match_merged_weights(cases, arch, which, backend):
    c = cases[arch]
    kw = dict(kernels=backend, n_ctx=64, kv_cache="f32")
    with pyllm.load(c["base"], lora=c[which], **kw) as llm, pyllm.load(c[f"merged_{which}"], **kw) as merged:
        assert len(llm.lora) == len(c[which]) and llm.info()["lora"][0]["alpha"] == 8.0
        if backend == "fast":  # the C++ step runs the decoded tokens, with the terms in it
            assert llm.model.fused_step(llm.kv) is not None
        got, want = logits_run(llm), logits_run(merged)
    err = rel_err(got, want)
    assert err <= REL_TOL, f"{arch} {which} {backend}: relative error {err:.3g} against the merged weights"
    if backend == "fast":
        with pyllm.load(c["base"], **kw) as plain:
            base = logits_run(plain)
        assert rel_err(base, want) >= MIN_EFFECT, "the adapters barely move the logits: the test would not see them"


def test_fast_step_rows_match_one_token_steps(cases):
    """The C++ step's multi-row pass (speculative verification) gives each row a one-token step's logits, bit for
    bit, with the terms in (csrc/cpu/decode_step.cpp add_lora sums each row in one order whatever M is).  Q8_0
    weights: their row kernels are M-independent (backends/cpu.py EXACT_ROW_TYPES), float32 ones are not."""
    c = cases["mistral"]
    with pyllm.load(str(gguf_path("mistral", "q8_0")), lora=c["two"], n_ctx=64, kv_cache="f32") as llm:
        model = llm.model
        with torch.inference_mode():
            model.forward(torch.tensor(PROMPT), 0, llm.kv)
            step = model.fused_step(llm.kv)
            assert step.rows_exact
            rows = step.rows(torch.tensor(DECODED), len(PROMPT))
            one = [step(tok, len(PROMPT) + i) for i, tok in enumerate(DECODED)]
    assert torch.equal(rows, torch.cat(one))


def test_generation_with_adapter_differs_and_replays(cases):
    c = cases["mistral"]
    args = dict(max_tokens=8, temperature=0)
    with pyllm.load(c["base"], n_ctx=64) as plain, pyllm.load(c["base"], lora=c["one"], n_ctx=64) as llm, \
            pyllm.load(c["merged_one"], n_ctx=64) as merged:
        with_lora = list(llm.generate_tokens(PROMPT, **args))
        assert with_lora == list(merged.generate_tokens(PROMPT, **args))
        assert with_lora != list(plain.generate_tokens(PROMPT, **args))


# ---- bad adapters: one line naming the file and the tensor or key ------------------------------------------------
@pytest.fixture(scope="module")
def mistral_base():
    return str(gguf_path("mistral", "f32"))


def _load_error(base, tmp_path, **kw) -> str:
    with pytest.raises(LoraError) as e:
        pyllm.load(base, kernels="reference", n_ctx=32, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_wrong_architecture(mistral_base, tmp_path):
    pairs = make_pairs(mistral_base, ["blk.0.attn_q.weight"], 4, 0)
    p = write_adapter(tmp_path / "g.gguf", "gemma3", pairs)
    msg = _load_error(mistral_base, tmp_path, lora=p)
    assert "g.gguf" in msg and "'gemma3'" in msg and "'llama'" in msg


def test_wrong_shape_names_tensor(mistral_base, tmp_path):
    a, b = make_pairs(mistral_base, ["blk.1.ffn_down.weight"], 4, 0)["blk.1.ffn_down.weight"]
    p = write_adapter(tmp_path / "s.gguf", "llama", {"blk.1.ffn_down.weight": (a, b[:100])})
    msg = _load_error(mistral_base, tmp_path, lora=p)
    assert "s.gguf" in msg and "'blk.1.ffn_down.weight'" in msg and "[100, 4]" in msg and "[256, 512]" in msg


def test_tensor_missing_from_base(mistral_base, tmp_path):
    a, b = make_pairs(mistral_base, ["blk.1.attn_q.weight"], 4, 0)["blk.1.attn_q.weight"]
    p = write_adapter(tmp_path / "m.gguf", "llama", {"blk.7.attn_q.weight": (a, b)})
    msg = _load_error(mistral_base, tmp_path, lora=p)
    assert "m.gguf" in msg and "'blk.7.attn_q.weight'" in msg and "not in the base model" in msg


def test_missing_alpha(mistral_base, tmp_path):
    p = write_adapter(tmp_path / "a.gguf", "llama", make_pairs(mistral_base, ["blk.0.attn_k.weight"], 4, 0),
                      alpha=None)
    msg = _load_error(mistral_base, tmp_path, lora=p)
    assert "a.gguf" in msg and "'adapter.lora.alpha' is missing" in msg


def test_half_a_pair_and_stray_tensors(mistral_base, tmp_path):
    a, _ = make_pairs(mistral_base, ["blk.0.attn_k.weight"], 4, 0)["blk.0.attn_k.weight"]
    half = write_adapter(tmp_path / "h.gguf", "llama", {}, extra={"blk.0.attn_k.weight.lora_a": a})
    msg = _load_error(mistral_base, tmp_path, lora=half)
    assert "h.gguf" in msg and "tensor blk.0.attn_k.weight.lora_b is missing" in msg
    stray = write_adapter(tmp_path / "x.gguf", "llama", {}, extra={"blk.0.attn_k.weight": a})
    msg = _load_error(mistral_base, tmp_path, lora=stray)
    assert "x.gguf" in msg and "'blk.0.attn_k.weight'" in msg and "neither" in msg


def test_not_an_adapter(mistral_base, tmp_path):
    p = write_adapter(tmp_path / "model.gguf", "llama", make_pairs(mistral_base, ["blk.0.attn_k.weight"], 4, 0),
                      general_type="model")
    msg = _load_error(mistral_base, tmp_path, lora=p)
    assert "model.gguf" in msg and "not a LoRA adapter" in msg
    assert "no such file" in _load_error(mistral_base, tmp_path, lora=str(tmp_path / "absent.gguf"))


def test_lora_argument_forms():
    assert parse_spec(None) == []
    assert parse_spec("a.gguf") == [("a.gguf", 1.0)]
    assert parse_spec([("a.gguf", 0.5), "b.gguf"]) == [("a.gguf", 0.5), ("b.gguf", 1.0)]
    for bad in (3, [("a.gguf",)], [("a.gguf", "x")], [("a.gguf", float("nan"))], [""]):
        with pytest.raises(pyllm.PyllmError, match="lora"):
            parse_spec(bad)


# ---- the command line ------------------------------------------------------------------------------------------------
def test_cli_flags(cases, monkeypatch, capsys):
    from conftest import cli_in_process

    run = cli_in_process(monkeypatch, capsys)
    c = cases["mistral"]
    p1, p2 = c["two"][0][0], c["two"][1][0]
    common = ("run", c["base"], "hello", "-n", "6", "--temp", "0", "--ctx", "64")
    want = run("run", c["merged_two"], *common[2:])
    got = run(*common, "--lora-scaled", p1, "0.5", "--lora-scaled", p2, "1.5")
    assert got.returncode == 0 == want.returncode, got.stderr
    assert got.stdout == want.stdout
    bad = run(*common, "--lora", c["base"])  # a model, not an adapter
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "not a LoRA adapter" in bad.stderr
    usage = run(*common, "--lora-scaled", p1, "half")
    assert usage.returncode == 2 and "--lora-scaled" in usage.stderr


def test_readme_examples(tmp_path, smollm2_path):
    """Runs the README's LoRA examples as written (the registry model resolves from the cache), with a rank-4
    adapter on SmolLM2's attention made here: the library and the command line print the same greedy text."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    gf = open_gguf(smollm2_path)
    arch, n_layer = gf.metadata["general.architecture"], gf.metadata["llama.block_count"]
    gf.close()
    names = [f"blk.{i}.{m}.weight" for i in range(n_layer) for m in ("attn_q", "attn_v")]
    write_adapter(tmp_path / "smollm2-lora.gguf", arch, make_pairs(smollm2_path, names, 4, 0, std=0.05))
    text = (Path(__file__).parents[1] / "README.md").read_text()
    sec = text[text.index("### LoRA adapters"):text.index("### Structured output")]
    py = re.search(r"```python\n(.*?)```", sec, re.S).group(1)
    sh = re.search(r"```bash\n(.*?)```", sec, re.S).group(1).replace("pyllm run", f"{sys.executable} -m pyllm run")
    res = subprocess.run([sys.executable, "-c", py], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    scale, generated = res.stdout.split("\n", 1)
    assert scale == "0.5"
    cli = subprocess.run(["bash", "-ec", sh], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == generated.strip() != ""


def test_non_finite_pair(mistral_base, tmp_path):
    a, b = make_pairs(mistral_base, ["blk.0.attn_v.weight"], 4, 0)["blk.0.attn_v.weight"]
    b[3, 1] = np.nan
    p = write_adapter(tmp_path / "n.gguf", "llama", {"blk.0.attn_v.weight": (a, b)})
    msg = _load_error(mistral_base, tmp_path, lora=p)
    assert "n.gguf" in msg and "'blk.0.attn_v.weight.lora_b'" in msg and "NaN" in msg


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench"])
def test_flags_on_every_command(command):
    """--lora and --lora-scaled (llama.cpp's spellings) on run, chat, serve and bench: the --lora files, then the
    --lora-scaled ones (the terms add up, so the order does not matter)."""
    from pyllm.cli.common import lora_from_args
    from pyllm.cli.main import build_parser

    a = build_parser().parse_args([command, "m.gguf", "--lora", "a.gguf", "--lora-scaled", "b.gguf", "0.25",
                                   "--lora", "c.gguf"])
    assert lora_from_args(a) == [("a.gguf", 1.0), ("c.gguf", 1.0), ("b.gguf", 0.25)]
