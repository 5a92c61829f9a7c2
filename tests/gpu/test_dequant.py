"""CUDA dequantize vs gguf.quants: fp32 output equal bit for bit, fp16 output equal to that value rounded."""

import numpy as np
import pytest
import torch

from pyllm.formats.gguf import GGMLType
from .cuda_testutil import SCALES, random_blocks, reference, to_cuda

TYPES = list(SCALES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_exact(K, qtype):
    rng = np.random.default_rng(int(qtype))
    blocks = random_blocks(qtype, 77, 1024, rng)
    ref = reference(qtype, blocks)
    w = to_cuda(blocks)
    out32 = K.cuda_dequantize(w, int(qtype), 1024, None, False).cpu().numpy()
    assert np.array_equal(out32.view(np.uint32), ref.astype(np.float32).view(np.uint32)), \
        f"{qtype.name}: {np.sum(out32 != ref)} values differ from gguf.quants"
    out16 = K.cuda_dequantize(w, int(qtype), 1024, None, True).cpu().numpy()
    assert np.array_equal(out16, ref.astype(np.float16))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_dequantize_rows(K, qtype):
    blocks = random_blocks(qtype, 50, 512, np.random.default_rng(1))
    ids = torch.tensor([49, 0, 7, 7, 13], device="cuda")
    out = K.cuda_dequantize(to_cuda(blocks), int(qtype), 512, ids, False).cpu().numpy()
    assert np.array_equal(out, reference(qtype, blocks)[ids.cpu().numpy()])
    with pytest.raises(ValueError, match="row index 50 is out of range for 50 rows"):
        K.cuda_dequantize(to_cuda(blocks), int(qtype), 512, torch.tensor([1, 50], device="cuda"), False)


@pytest.mark.parametrize("dtype,qtype", [(torch.float16, GGMLType.F16), (torch.bfloat16, GGMLType.BF16),
                                         (torch.float32, GGMLType.F32)])
def test_float_rows(K, dtype, qtype):
    w = torch.randn(20, 64, device="cuda").to(dtype)
    out = K.cuda_dequantize(w.view(torch.uint8), int(qtype), 64, torch.tensor([3, 19], device="cuda"), False)
    assert torch.equal(out, w[[3, 19]].float())


def test_dequantize_errors(K):
    w = to_cuda(random_blocks(GGMLType.Q4_0, 4, 256, np.random.default_rng(2)))
    with pytest.raises(ValueError, match="IQ2_XXS"):
        K.cuda_dequantize(w, int(GGMLType.IQ2_XXS), 256)
    with pytest.raises(ValueError, match="needs 162"):
        K.cuda_dequantize(w, int(GGMLType.Q4_0), 288)
    with pytest.raises(TypeError, match="ids must be Long"):
        K.cuda_dequantize(w, int(GGMLType.Q4_0), 256, torch.tensor([0], dtype=torch.int32, device="cuda"))
