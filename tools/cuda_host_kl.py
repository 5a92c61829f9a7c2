"""The CUDA step's accuracy measured on a machine without a GPU: CudaDecodeStep run on the CPU with code-exact
stand-ins for its kernels (int8 activation codes as cuda_quantize_act makes them, each GEMV multiplying what the
codes stand for by the dequantized weights; the row kernels' and attention's float64 definitions), teacher-forced
over a text, mean and max KL of its next-token distributions from the float32 reference backend's, beside the CPU
backend's.  What it cannot see: fp32 summation order inside the kernels (small next to the int8 rounding).

    python tools/cuda_host_kl.py .gpu_models/smollm2-8l.gguf          # SmolLM2 cut to 8 layers (tools/gpu_check.sh)
    python tools/cuda_host_kl.py MODEL --int8-output                  # the output projection from x's codes alone

A change to the CUDA step's numerics can be judged here before a GPU run (tests/gpu/bench_cuda.py --kl-model measures
the same on the GPU).  SmolLM2 cut to 8 layers, 194 positions: 6.7e-4 (9.8e-4 with --int8-output), CPU 6.5e-4; about
a minute for both lines.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]
os.environ["PYLLM_CUDA_GRAPH"] = "0"  # eager: the stand-ins are Python

import torch  # noqa: E402

import pyllm  # noqa: E402
import test_cuda_backend_host as host  # noqa: E402
from bench_cuda import KL_TEXT  # noqa: E402
from pyllm import backends  # noqa: E402
from pyllm.backends import cuda as cb  # noqa: E402
from pyllm.backends import cuda_step  # noqa: E402


class CodeExactKernels(host.TorchKernels):
    """TorchKernels whose GEMVs read the codes, not the float rows they were made from."""

    def cuda_gemv_q(self, w, qt, xq, xds, out=None):
        y = host.CODES_VALUE(xq, xds) @ self.C.dequantize(w, qt).T
        return y if out is None else out.copy_(y)

    def cuda_gemv(self, w, qt, x):
        xq, xds = self.cuda_quantize_act(x.contiguous())
        return self.cuda_gemv_q(w, qt, xq, xds)


class HostCudaBackend(host.FakeCudaBackend):
    def __init__(self):
        cb.CudaBackend.__init__(self, CodeExactKernels(), torch.device("cpu"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--int8-output", action="store_true", help="output projection from x's int8 codes alone")
    a = ap.parse_args()
    ref = pyllm.load(a.model, device="cpu", kernels="reference", n_ctx=256)
    ids = ref.tokenize(KL_TEXT)

    def logits(llm):
        llm.generator.reset()
        return [llm.generator._forward([t])[-1].double() for t in ids]

    want = logits(ref)

    def kl(got) -> tuple[float, float]:
        ks = []
        for w, g in zip(want, got):
            p, q = torch.log_softmax(w, -1), torch.log_softmax(g, -1)
            ks.append(float((p.exp() * (p - q)).sum()))
        return sum(ks) / len(ks), max(ks)

    cpu = pyllm.load(a.model, device="cpu", n_ctx=256)
    kl_cpu = kl(logits(cpu))
    if a.int8_output:
        # the backend's linear_output and the step each call their own imported name
        cb.output_gemv = cuda_step.output_gemv = lambda K, w, qt, x, xq, xds, out2=None, out=None: K.cuda_gemv_q(
            w, qt, xq[:x.shape[0]], xds[:x.shape[0]], out)
    real_select = backends.select
    backends.select = lambda *args, **kw: HostCudaBackend()
    try:
        sim = pyllm.load(a.model, device="cpu", n_ctx=256)
        kl_cuda = kl(logits(sim))
    finally:
        backends.select = real_select
    print(f"{a.model}: {len(ids)} positions; mean / max KL from float32: CUDA step (host) {kl_cuda[0]:.3e} / "
          f"{kl_cuda[1]:.3e}, CPU backend {kl_cpu[0]:.3e} / {kl_cpu[1]:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
