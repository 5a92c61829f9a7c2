"""The CUDA backend's linear / embed over uploaded weights against float64 on the CPU: every GGUF type the CPU
handles (fused GEMV at 1..8 rows where the type has one, dequantize + cuBLAS otherwise and above 8 rows) and AWQ
(rows from the CPU repacker; a group size without a layout in AutoAWQ form).  Tolerances: the GEMV's int8
activations and the prefill's fp16 operands each cost ~1e-3 relative per matmul; bound 1e-2 relative."""

import numpy as np
import pytest
import torch

from pyllm.formats.awq.unpack import AWQTensor
from pyllm.backends import cuda as cb
from pyllm.formats.gguf import GGMLType
from pyllm.formats.quant import QTensor
from .cuda_testutil import SCALES, random_blocks, reference


@pytest.fixture(scope="module")
def backend(K):
    return cb.create("cuda")


def rel(a, b):
    return float((a.double().cpu() - b).norm() / b.norm())


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("qtype", list(SCALES) + [GGMLType.F16, GGMLType.BF16], ids=lambda t: t.name)
def test_linear_every_type(backend, qtype, rows):
    n, k = 96, 512
    rng = np.random.default_rng(int(qtype) * 10 + rows)
    if qtype in (GGMLType.F16, GGMLType.BF16):
        dt = torch.float16 if qtype == GGMLType.F16 else torch.bfloat16
        w64 = torch.randn(n, k, dtype=torch.float64) / k ** 0.5
        w = QTensor(qtype, (n, k), w64.to(dt).view(torch.uint8).reshape(n, -1), "w")
        w64 = w64.to(dt).double()
    else:
        blocks = random_blocks(qtype, n, k, rng)
        w = QTensor(qtype, (n, k), torch.from_numpy(blocks), "w")
        w64 = torch.from_numpy(reference(qtype, blocks)).double()
    up = backend.prepare_weights({"w": w})["w"]
    assert up.data.device.type == "cuda" and up.nbytes == w.nbytes  # quantized as in the file
    x = torch.randn(rows, k)
    y = backend.linear(x.cuda(), up)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert rel(y, x.double() @ w64.T) <= 1e-2
    ids = torch.tensor([n - 1, 0, 5])
    torch.testing.assert_close(backend.embed(up, ids).cpu().double(), w64[ids], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_linear_output_adds_the_residual_codes(backend, qtype, rows):
    """linear_output (the output projection: x's int8 codes plus the codes of what they miss, cuda.output_gemv)
    against float64 on the same weights: within 1e-4 relative, and under 1/30 of linear's error (x's codes alone),
    on rows with outliers (a few values 30x the rest)."""
    n, k = 96, 512
    rng = np.random.default_rng(int(qtype) + rows)
    blocks = random_blocks(qtype, n, k, rng)
    w64 = torch.from_numpy(reference(qtype, blocks)).double()
    up = backend.prepare_weights({"w": QTensor(qtype, (n, k), torch.from_numpy(blocks), "w")})["w"]
    x = torch.randn(rows, k)
    x[:, ::37] *= 30
    want = x.double() @ w64.T
    err = rel(backend.linear_output(x.cuda(), up), want)
    assert err <= 1e-4 and err < rel(backend.linear(x.cuda(), up), want) / 30, err


@pytest.mark.parametrize("g", [32, 128, 96])
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_linear_awq(backend, g, rows):
    from test_awq import random_awq

    k, n = 384, 256
    q, z, s, qw, qz = random_awq(k, n, g, seed=g + rows)
    t = AWQTensor(qw, qz, s, g, name="w")
    w64 = ((q - z.repeat_interleave(g, 0)).double() * s.double().repeat_interleave(g, 0)).T  # [N, K]
    up = backend.prepare_weights({"w": t})["w"]
    assert isinstance(up, cb.CudaAwqRows) == (g != 96)
    x = torch.randn(rows, k)
    assert rel(backend.linear(x.cuda(), up), x.double() @ w64.T) <= 1e-2
    if g != 96:
        assert torch.equal(up.dequantize().cpu().double(), w64)  # (q - z) * s is exact in fp32
