"""End to end on CUDA: ``pyllm.load(device="cuda")`` against ``device="cpu"`` on the same GGUF.

Models: the tiny random checkpoints of tests/tiny_models.py (llama-family with tied embeddings and QK norm,
sliding-window Mistral, Gemma 3 with local/global layers and final softcap, SmolLM3 with NoPE layers), converted
to Q8_0, Q4_0 and Q4_K_M.
References and tolerances:
- next-token logits after a prompt and over 32 teacher-forced decode steps: the mean KL from the reference
  backend's (float32 torch) within 1e-3 or within 1.25x the CPU backend's own (check_as_accurate_as_cpu);
- 32 greedy tokens equal to the CPU backend's, except after a near-tie in the CPU logits (top-2 gap below 1% of
  their spread), where either pick is right;
- every KV cache kind (K and V apart), through prefill and the captured decode graph.
"""

import pytest
import torch

import pyllm
from tiny_models import gguf_path

ARCHS = ["qwen3", "mistral", "gemma3", "smollm3"]
KINDS = ["f16", "bf16", "q8_0", "q4_0", "q8_rot", "q4_rot", "f16/q4_rot", "q8_0/f16"]
PROMPT = [1, 17, 33, 5, 99, 42, 7, 250, 3, 11, 64, 8, 120, 9]
KL_SPREAD = 1.25


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).max())


def check_as_accurate_as_cpu(flt, cpu, cuda, what: str) -> None:
    """Mean KL of the CUDA logits from the float32 reference's is within 1e-3, or within 1.25x the CPU backend's own
    (both are int8-activation paths; tests/test_fast_accuracy.py explains the 1.25: one mean is one draw of the
    rounding).  A tiny random model's logits amplify int8 rounding, and a 4-bit cache's codes flip under it, so the
    CPU backend's distance, not a constant, says what accuracy the kernels' arithmetic allows."""
    kl_cuda = sum(kl(f, c) for f, c in zip(flt, cuda)) / len(flt)
    kl_cpu = sum(kl(f, c) for f, c in zip(flt, cpu)) / len(flt)
    assert kl_cuda <= max(1e-3, KL_SPREAD * kl_cpu), \
        f"{what}: mean KL(reference || cuda) = {kl_cuda:.3g}, the CPU backend's {kl_cpu:.3g}"


def cache_logits(llm, kind: str, tokens: list[int], n_prompt: int) -> list[torch.Tensor]:
    m = llm.model
    kv = m.backend.make_kv_cache(kind, m.cfg.n_layer, m.cfg.n_kv_head, 128, m.cfg.head_dim)
    out = [m.forward(torch.tensor(tokens[:n_prompt]), 0, kv)[-1]]
    for pos in range(n_prompt, len(tokens)):
        out.append(m.forward(torch.tensor([tokens[pos]]), pos, kv)[-1])
    return out


@pytest.mark.parametrize("ftype", ["q8_0", "q4_0", "q4_k_m"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logits_match_cpu(arch, ftype):
    path = str(gguf_path(arch, ftype))
    cpu = pyllm.load(path, device="cpu", n_ctx=128)
    gpu = pyllm.load(path, device="cuda", n_ctx=128)
    assert gpu.model.backend.name == "cuda" and gpu.model.backend.device.type == "cuda"
    want = cpu.generate_tokens(PROMPT, max_tokens=32, temperature=0, speculative="none")
    got = gpu.generate_tokens(PROMPT, max_tokens=32, temperature=0, speculative="none")
    want, got = list(want), list(got)
    step = gpu.model.fused_step(gpu.kv)
    assert step is not None and step.row_kernels_problem is None, "the CUDA step did not run its row kernels"
    tokens = PROMPT + want
    ref = cache_logits(cpu, "f16", tokens, len(PROMPT))
    exact = pyllm.load(path, device="cpu", kernels="reference", n_ctx=128)
    flt = cache_logits(exact, "f16", tokens, len(PROMPT))
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top = ref[i].topk(2).values
            spread = float(ref[i].max() - ref[i].min())
            assert float(top[0] - top[1]) < 0.01 * spread, f"{arch} {ftype} greedy token {i}: {a} != {b}, not a near-tie"
            break  # after a legitimate divergence the contexts differ
    cuda = cache_logits(gpu, "f16", tokens, len(PROMPT))
    assert all(c.device.type == "cpu" and c.dtype == torch.float32 for c in cuda)
    check_as_accurate_as_cpu(flt, ref, cuda, f"{arch} {ftype}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_every_cache_kind(arch, kind):
    path = str(gguf_path(arch, "q8_0"))
    ref = pyllm.load(path, device="cpu", kernels="reference", n_ctx=128)
    cpu = pyllm.load(path, device="cpu", n_ctx=128)
    gpu = pyllm.load(path, device="cuda", n_ctx=128)
    tokens = PROMPT + [12, 200, 64, 3, 77, 150, 21, 9, 30, 31]  # decode past Gemma 3's sliding window
    r = cache_logits(ref, kind, tokens, len(PROMPT))
    check_as_accurate_as_cpu(r, cache_logits(cpu, kind, tokens, len(PROMPT)),
                             cache_logits(gpu, kind, tokens, len(PROMPT)), f"{arch} {kind}")


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_programmatic_launches_give_the_same_logits(arch, kind, monkeypatch):
    """PYLLM_CUDA_PDL=1 (csrc/cuda/common.cuh) lets each step kernel start while the one before it drains; every
    kernel waits for its predecessor before it reads or writes, so the logits are those of plain launches bit for
    bit, through the captured graph, with only row kernels (f16 cache) or torch's kernels between them (q8_0 rows
    are written by torch ops).  Reference: the same model and tokens without the variable."""
    path = str(gguf_path(arch, "q4_k_m"))
    tokens = PROMPT + [12, 200, 64, 3, 77, 150, 21, 9, 30, 31] * 3
    monkeypatch.delenv("PYLLM_CUDA_PDL", raising=False)
    want = cache_logits(pyllm.load(path, device="cuda", n_ctx=128), kind, tokens, len(PROMPT))
    monkeypatch.setenv("PYLLM_CUDA_PDL", "1")
    gpu = pyllm.load(path, device="cuda", n_ctx=128)
    got = cache_logits(gpu, kind, tokens, len(PROMPT))
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w, g), f"{arch} {kind}: position {i} differs with programmatic launches"


def test_graph_replays_after_first_step():
    gpu = pyllm.load(str(gguf_path("qwen3", "q4_0")), device="cuda", n_ctx=128)
    m = gpu.model
    kv = m.backend.make_kv_cache("q8_0", m.cfg.n_layer, m.cfg.n_kv_head, 128, m.cfg.head_dim)
    m.forward(torch.tensor(PROMPT), 0, kv)
    for pos in range(len(PROMPT), len(PROMPT) + 5):
        m.forward(torch.tensor([5]), pos, kv)
    step = m.backend.fused_decode(m, kv) if not hasattr(m, "fused_step") else m.fused_step(kv)
    assert step is not None and step.policy.failed is None, getattr(step.policy, "failed", None)
    assert step.policy.captured and step.policy.replays >= 4
    logits, top = step.with_argmax(7, pos + 1)  # the argmax taken inside the replayed graph
    assert step.policy.replays >= 5 and top == int(logits.argmax())


def test_weights_stay_quantized_in_vram():
    path = gguf_path("qwen3", "q4_0")
    gpu = pyllm.load(str(path), device="cuda", n_ctx=128)
    d = gpu.model.backend.describe()
    assert d["device"] == "cuda" and d["vram_weights"] <= path.stat().st_size
