"""The prefill MMQ kernel (csrc/cuda/mmq.cu over csrc/common/mmq.h: int8 mma.sync on tiled weights) on the GPU.

References and tolerances:
- bit for bit: the host emulation of the kernel's arithmetic (tests/gemv_tiled_host.cpp mmq_emulate: the same header
  functions, each block's integer dot scaled by an explicit fp32 multiply and FMA, in block order);
- float64 on the gguf.quants-dequantized weights with the kernel's own int8 codes: ||y - ref|| / ||ref|| <= 2e-5 (as
  tests/test_mmq_host.py), and against the unquantized x <= 1.5e-2 (the int8 rounding of x bounds it);
- a whole model's prompt: the tiny Qwen3 (Q8_0, Q4_0, Q4_K_M) logits at every prompt position, through MMQ, as close
  to the float32 reference backend's as the CPU backend's are (mean KL within 1e-3 or 1.25x the CPU's: test_e2e.py's
  rule), and under PYLLM_CUDA_MMQ=0 (dequantize + cuBLAS) as well.
Shapes: one block (8 x 32); 136 rows and K = 576 (a partial CTA of rows, a short last K tile); the 8B's K (4096,
14336) on 256 rows (two CTAs of rows); tokens 9..512 (CTAs of 32 and 64 tokens, whole and with a remainder).
"""

import numpy as np
import pytest
import torch

from pyllm.formats.gguf import GGMLType
from .cuda_testutil import random_blocks, to_cuda
from .test_gemv_tiled import host, weights  # noqa: F401 (host: a fixture) -- the tiled GEMV tests' weights and library

TYPES = [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K]
# (N, K) -> token counts (the host emulation is a scalar loop: the long-K shapes take fewer)
SHAPES = {(8, 32): (9, 33), (136, 576): (9, 32, 33, 64, 100, 512), (256, 4096): (40, 512), (256, 14336): (9, 100)}


def _shapes(qtype):
    unit = 256 if qtype in (GGMLType.Q4_K, GGMLType.Q6_K) else 32
    return [(n, k, ms) for (n, k), ms in SHAPES.items() if k % unit == 0]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_mmq_matches_emulation_and_float64(K, host, qtype):
    from test_mmq_host import mmq_emulate

    dev = torch.cuda.current_device()
    for n, k, tokens in _shapes(qtype):
        _, tiled, wt, tid, w64 = weights(K, qtype, n, k)
        assert K.cuda_mmq_supported(tid, dev), f"{qtype.name}: no MMQ on this GPU (compute capability 8.0+ expected)"
        for m in tokens:
            x = torch.randn(m, k, device="cuda") * torch.empty(m, 1, device="cuda").uniform_(0.1, 10)
            xq, xds = K.cuda_quantize_act(x)
            out = torch.full((m, n), float("nan"), device="cuda")  # poisoned: every element must be written
            y = K.cuda_mmq(wt, tid, xq, xds, out)
            assert y.data_ptr() == out.data_ptr()
            got = y.cpu().numpy()
            xq_h, xds_h = xq.cpu().numpy(), xds.cpu().numpy()
            want = mmq_emulate(host, qtype, tiled, k, xq_h, xds_h)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
                f"{qtype.name} N={n} K={k} M={m}: not the host emulation's bits (max diff " \
                f"{np.nanmax(np.abs(got - want)):.3g}, {np.isnan(got).sum()} unwritten)"
            y64 = got.astype(np.float64)
            xdeq = (xq_h.astype(np.float64).reshape(m, k // 32, 32) * xds_h[..., :1].astype(np.float64)).reshape(m, k)
            ref = xdeq @ w64.T
            rel = np.linalg.norm(y64 - ref) / np.linalg.norm(ref)
            assert rel <= 2e-5, f"{qtype.name} N={n} K={k} M={m}: ||y - W xq|| / ||W xq|| = {rel:.3g}"
            exact = x.double().cpu().numpy() @ w64.T
            rel_x = np.linalg.norm(y64 - exact) / np.linalg.norm(exact)
            assert rel_x <= 1.5e-2, f"{qtype.name} N={n} K={k} M={m}: ||y - W x|| / ||W x|| = {rel_x:.3g}"


def test_mmq_errors(K):
    _, _, wt, tid, _ = weights(K, GGMLType.Q4_K, 136, 512)
    x = torch.randn(20, 512, device="cuda")
    xq, xds = K.cuda_quantize_act(x)
    gguf_rows = to_cuda(random_blocks(GGMLType.Q4_K, 8, 512, np.random.default_rng(1)))
    with pytest.raises(ValueError, match="no MMQ kernel"):
        K.cuda_mmq(gguf_rows, int(GGMLType.Q4_K), xq, xds)
    with pytest.raises(ValueError, match="K=256"):
        K.cuda_mmq(wt, tid, *K.cuda_quantize_act(torch.randn(20, 256, device="cuda")))
    with pytest.raises(ValueError, match="out has shape"):
        K.cuda_mmq(wt, tid, xq, xds, torch.empty(20, 8, device="cuda"))
    assert not K.cuda_mmq_supported(int(GGMLType.Q4_K), torch.cuda.current_device())


class _CountingKernels:
    """The extension, counting cuda_mmq calls (CudaBackend.linear reads its kernels through self.K at each call)."""

    def __init__(self, mod):
        self.mod, self.mmq_calls = mod, 0

    def __getattr__(self, name):
        return getattr(self.mod, name)

    def cuda_mmq(self, *args):
        self.mmq_calls += 1
        return self.mod.cuda_mmq(*args)


@pytest.mark.parametrize("ftype", ["q8_0", "q4_0", "q4_k_m"])
def test_prompt_logits_through_mmq(ftype, monkeypatch):
    import pyllm
    from pyllm.backends import cuda as cb
    from tiny_models import gguf_path

    from .test_e2e import check_as_accurate_as_cpu

    path = str(gguf_path("qwen3", ftype))
    prompt = torch.tensor([1 + (37 * i) % 250 for i in range(45)])

    def logits(llm) -> list[torch.Tensor]:
        m = llm.model
        kv = m.backend.make_kv_cache("f16", m.cfg.n_layer, m.cfg.n_kv_head, 128, m.cfg.head_dim)
        return list(m.forward(prompt, 0, kv, all_logits=True).float().cpu())

    flt = logits(pyllm.load(path, device="cpu", kernels="reference", n_ctx=128))
    cpu = logits(pyllm.load(path, device="cpu", n_ctx=128))
    gpu = pyllm.load(path, device="cuda", n_ctx=128)
    counting = _CountingKernels(gpu.model.backend.K)
    gpu.model.backend.K = counting
    tiled = [n for n, w in gpu.model.w.items() if n.startswith("blk.") and isinstance(w, cb.CudaTiledTensor)]
    check_as_accurate_as_cpu(flt, cpu, logits(gpu), f"qwen3 {ftype} prompt through MMQ")
    assert tiled and counting.mmq_calls >= len(tiled), \
        f"{counting.mmq_calls} cuda_mmq calls for the prompt's {len(tiled)} tiled layer matrices"
    monkeypatch.setenv("PYLLM_CUDA_MMQ", "0")
    counting.mmq_calls = 0
    check_as_accurate_as_cpu(flt, cpu, logits(gpu), f"qwen3 {ftype} prompt through dequantize + cuBLAS")
    assert counting.mmq_calls == 0
