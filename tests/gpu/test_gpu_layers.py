"""--gpu-layers on a GPU: half the layers (and their KV cache) on CUDA, the rest on the CPU backend.

Models: tests/tiny_models.py's random checkpoints (Qwen3 and Mistral with 2 layers, Gemma 3 with 6, local and
global), Q4_K_M.  References and tolerances, as tests/gpu/test_e2e.py's for the whole model on CUDA:
- logits after a prompt and over teacher-forced decode steps, through the forward and through the split's fused step
  (the CPU's C++ step over its layers and head, the CUDA step over the GPU's layers, graph-captured): mean KL from
  the float32 reference within 1e-3 or 1.25x the CPU backend's own;
- greedy tokens equal to the CPU backend's except after a near-tie (top-2 gap below 1% of the logits' spread);
- each layer's weights and KV rows on its side's device; --device auto with a made-up free memory picks the split
  fit_gpu_layers gives (tests/test_gpu_layers.py holds the function itself).
"""

import pytest
import torch

import pyllm
from pyllm.backends.cuda_step import CudaDecodeStep
from pyllm.backends.split import SplitBackend, SplitDecodeStep, SplitKVCache
from tiny_models import gguf_path

from .test_e2e import PROMPT, cache_logits, check_as_accurate_as_cpu

ARCHS = {"qwen3": 2, "mistral": 2, "gemma3": 6}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_half_the_layers_on_cuda_match_the_cpu(arch):
    path = str(gguf_path(arch, "q4_k_m"))
    n_layer = ARCHS[arch]
    cpu = pyllm.load(path, device="cpu", n_ctx=128)
    split = pyllm.load(path, device="cuda", gpu_layers=n_layer // 2, n_ctx=128)
    b, kv = split.model.backend, split.kv
    assert isinstance(b, SplitBackend) and b.high.name == "cuda" and b.low.name == "fast"
    first = n_layer - n_layer // 2
    for name, w in split.model.w.items():
        if name.startswith("blk."):
            want = "cuda" if int(name.split(".")[1]) >= first else "cpu"
            assert w.data.device.type == want, name
    assert isinstance(kv, SplitKVCache) and kv.high.k_part.data.device.type == "cuda"
    assert kv.low.k_part.data.device.type == "cpu"
    want = list(cpu.generate_tokens(PROMPT, max_tokens=24, temperature=0, speculative="none"))
    got = list(split.generate_tokens(PROMPT, max_tokens=24, temperature=0, speculative="none"))
    tokens = PROMPT + want
    ref = cache_logits(cpu, "f16", tokens, len(PROMPT))
    for i, (a, c) in enumerate(zip(got, want)):
        if a != c:
            top = ref[i].topk(2).values
            spread = float(ref[i].max() - ref[i].min())
            assert float(top[0] - top[1]) < 0.01 * spread, f"{arch}: greedy token {i}: {a} != {c}, not a near-tie"
            break
    flt = cache_logits(pyllm.load(path, device="cpu", kernels="reference", n_ctx=128), "f16", tokens, len(PROMPT))
    check_as_accurate_as_cpu(flt, ref, cache_logits(split, "f16", tokens, len(PROMPT)), f"{arch} split")
    fused, step = fused_logits(split, tokens, len(PROMPT))
    assert isinstance(step, SplitDecodeStep) and isinstance(step.high, CudaDecodeStep)
    assert step.high.row_kernels_problem is None and step.high.policy.captured, "the CUDA part ran without its graph"
    check_as_accurate_as_cpu(flt, ref, fused, f"{arch} split, fused step")


def fused_logits(llm, tokens: list[int], n_prompt: int):
    """cache_logits with the decode positions through the model's fused step (and that step)."""
    m = llm.model
    kv = m.backend.make_kv_cache("f16", m.cfg.n_layer, m.cfg.n_kv_head, 128, m.cfg.head_dim)
    out = [m.forward(torch.tensor(tokens[:n_prompt]), 0, kv)[-1]]
    step = m.fused_step(kv)
    for pos in range(n_prompt, len(tokens)):
        out.append(step.with_argmax(tokens[pos], pos)[0])
    return out, step


def test_auto_splits_a_model_larger_than_free_memory(monkeypatch, capsys):
    from pyllm.backends.split import fit_gpu_layers, gpu_headroom, model_bytes
    from pyllm.formats.checkpoint import read_gguf
    from pyllm.runtime.kv_cache import KVCache

    path = str(gguf_path("gemma3", "q4_k_m"))
    ckpt = read_gguf(path)
    cfg = ckpt.config
    layers, other = model_bytes(ckpt.weights, cfg.n_layer)
    ckpt.close()
    kv_layer = int(KVCache.bytes_per_token(1, cfg.n_kv_head, cfg.head_dim, "f16") * 128)
    free = (256 << 20) + sum(layers[-4:]) + 4 * kv_layer  # room for the last four layers exactly
    assert gpu_headroom(free) == 256 << 20 and fit_gpu_layers(free, layers, other, kv_layer) == 4
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 4 * free))
    llm = pyllm.load(path, device="auto", n_ctx=128, quiet=False)
    assert isinstance(llm.model.backend, SplitBackend) and llm.model.backend.n_high == 4
    assert "layers 2-5 on cuda, 0-1 on cpu (--gpu-layers 4;" in capsys.readouterr().err
    assert len(list(llm.generate_tokens(PROMPT, max_tokens=4, temperature=0))) == 4
