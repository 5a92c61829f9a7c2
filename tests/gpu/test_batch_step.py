"""The CUDA backend's batched decode: CudaBackend.step over several sequences' decode tokens (one pass of M-row
GEMVs, each row's attention over its own cache) against each sequence stepped alone.

Reference: the same sequences on twin caches, each stepped alone (its captured one-token step).  Tolerance: none.
Each batched row is its sequence's own step bit for bit (logits, argmax and the cache rows it writes): the GEMV and
the row kernels sum a row in one order whatever the number of rows, and each row's attention runs alone over its
own cache (backends/cuda_step.py CudaDecodeStep._body_kernels).  Nine sequences: a pass of GEMV_MAX_M = 8 rows (the
output projection in two chunks of 4) and one alone.
"""

import pytest
import torch

import pyllm
from pyllm.backends import cuda as cb
from pyllm.backends.base import SeqStep
from tiny_models import gguf_path

PROMPT = [1, 17, 33, 5, 99, 42, 7, 250, 3, 11, 64, 8, 120, 9]
LENGTHS = [14, 5, 9, 3, 11, 2, 7, 13, 4]


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_rot"])
@pytest.mark.parametrize("ftype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "smollm3"])
def test_batched_rows_equal_each_alone(arch, ftype, kind, monkeypatch):
    llm = pyllm.load(str(gguf_path(arch, ftype)), device="cuda", n_ctx=128, kv_cache=kind)
    m, b = llm.model, llm.model.backend
    passes = []
    real = cb.CudaDecodeStep.decode_rows
    monkeypatch.setattr(cb.CudaDecodeStep, "decode_rows",
                        lambda self, steps, *a: passes.append(len(steps)) or real(self, steps, *a))

    def caches():
        return [b.make_kv_cache(kind, m.cfg.n_layer, m.cfg.n_kv_head, 128, m.cfg.head_dim) for _ in LENGTHS]

    alone, together = caches(), caches()
    for kvs in (alone, together):
        m.step([SeqStep(kv, PROMPT[:n], 0, prefill=True) for kv, n in zip(kvs, LENGTHS)])
    steps = [m.fused_step(kv) for kv in together]
    assert all(isinstance(st, cb.CudaDecodeStep) and st.rows_exact for st in steps), \
        [getattr(st, "row_kernels_problem", st) for st in steps]
    toks, pos = [5] * len(LENGTHS), list(LENGTHS)
    for n in range(10):
        got = b.step(m, [SeqStep(kv, [t], p) for kv, t, p in zip(together, toks, pos)])
        want = [b.step(m, [SeqStep(kv, [t], p)])[0] for kv, t, p in zip(alone, toks, pos)]
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g.logits, w.logits), f"step {n}, sequence {i}: batched logits differ from alone"
            assert g.argmax == w.argmax
        toks, pos = [w.argmax[0] for w in want], [p + 1 for p in pos]
    for kv_a, kv_t in zip(alone, together):
        for a, t in zip(kv_a.storage_layout(), kv_t.storage_layout()):
            assert torch.equal(a.data, t.data), "the batched pass wrote other cache rows"
    assert passes == [8] * 10, passes
