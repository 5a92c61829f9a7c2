"""Conformance: every fused body of an ArchSpec against the torch forward (models/transformer.py), over every
architecture x KV cache kind.  A new family is added by its spec entry, its converter mapping and a row in
tests/tiny_models.py ARCHS (a mixture-of-experts family: tests/test_moe.py ARCHS); this suite then holds its fused
bodies to the reference.

Bodies: the CPU backend's C++ decode step (csrc/cpu/decode_step.cpp, built from the DecodeArch mirror of the spec).
The CUDA step is held to the same reference on a GPU by tests/gpu (its host-side parts in
tests/test_cuda_backend_host.py).

Reference: the torch forward's one-token step from the same cache state (teacher-forced: each step starts from the
torch path's cache and is fed its greedy token), on tiny random checkpoints of each family converted to Q8_0 (the
Qwen MoE families' from tests/test_moe.py; gpt-oss: mxfp4_moe, its experts MXFP4 as OpenAI releases them, the other
matrices Q8_0; tests/test_gpt_oss.py builds it).
Tolerance, as tests/test_decode_step.py's for quantized matrices: 5% of the largest |logit| for 16- and 8-bit
caches (the step rounds GEMV activations to int8 per 32 values where the torch path multiplies in float32; that is
the whole difference), 4x that with a 4-bit cache, where the step dots keys with the query rounded to 8 bits (see
tests/test_decode_step_gemma3.py); and the same greedy token wherever the reference's top-2 margin exceeds the
tolerance.  A missing or misplaced spec entry (a norm, a bias, a rope table, a window, the embedding scale) moves
logits by far more than this.

Mixture-of-experts families: a router's top-k is discontinuous.  Where its k-th and (k+1)-th logits nearly tie, the
step's int8-rounded activations (or a quantized cache's rounding) may pick the other expert, and that token's logits
move by far more than any tolerance (seen: Qwen3-MoE, q8_0 cache, a gap of 0.0035 moved them by 13.7% of the max
|logit|).  A step where any layer's gap (the router's logits, its bias included, k-th minus (k+1)-th: the log ratio
of the two softmax probabilities) is below ROUTER_TIE is not judged (the rounding moves router logits by ~1e-3
here), and at least 4 of the 6 steps must be.
"""

import functools

import pytest
import torch

import pyllm
import tiny_models as tm
import test_gpt_oss
import test_moe
from test_decode_step_gemma3 import _restore, _snapshot

KV_KINDS = ["f16", "q8_0", "q4_rot"]
ROUTER_TIE = 0.05
# family -> its tiny converted file
FAMILIES = {**{arch: functools.partial(tm.gguf_path, arch, "q8_0") for arch in tm.ARCHS},
            **{arch: functools.partial(test_moe.gguf_path, arch, "q8_0") for arch in test_moe.ARCHS},
            "gpt-oss": functools.partial(test_gpt_oss.gguf_path, "mxfp4_moe")}


@pytest.fixture(autouse=True, scope="module")
def _extension():
    """These tests are about the extension's step: a build that fails is a failure, never a skip."""
    pyllm._ext.load()


@pytest.fixture(scope="module", params=list(FAMILIES))
def llm(request):
    llm = pyllm.load(str(FAMILIES[request.param]()), n_ctx=64, n_threads=2)
    yield llm
    llm.close()


def router_gaps(model, gaps: list[float]):
    """model.moe, recording into ``gaps`` each call's smallest gap between the router's k-th and (k+1)-th logits
    over its tokens (Transformer.moe's selection: softmax and topk keep the logits' order)."""
    moe, spec = model.moe, model.spec

    def recording(h, p):
        logits = model.linear(h, model.w[p + "ffn_gate_inp.weight"]).float()
        if spec.expert_bias:
            logits = logits + model.vec[p + "ffn_gate_inp.bias"]
        top = logits.topk(spec.n_expert_used + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))
        return moe(h, p)

    return recording


@pytest.mark.parametrize("kind", KV_KINDS)
def test_cpu_step_conforms_to_the_torch_forward(llm, kind):
    from pyllm.runtime.kv_cache import make_kv_cache

    model, c = llm.model, llm.config
    tol = 0.05 * (4.0 if "q4" in kind else 1.0)
    # past the tiny mistral / gemma3 / gpt-oss windows (8): keys leave the windowed layers within these positions
    prompt, n = [5, 17, 42, 99, 7, 3, 250, 11, 64, 30], 10
    kv = make_kv_cache(kind, c.n_layer, c.n_kv_head, 32, c.head_dim)
    lg_py, lg_c, gaps = [], [], []
    moe = model.moe if model.spec.n_expert else None
    try:
        model.use_cpp_decode = False
        tok = int(model.forward(torch.tensor(prompt), 0, kv)[-1].argmax())
        for i in range(n):
            pos = len(prompt) + i
            before = _snapshot(kv)
            model.use_cpp_decode, step_gaps = False, []
            if moe is not None:
                model.moe = router_gaps(model, step_gaps)
            lg_py.append(model.forward(torch.tensor([tok]), pos, kv)[0])
            if moe is not None:
                model.moe = moe
            gaps.append(min(step_gaps, default=float("inf")))
            after = _snapshot(kv)
            _restore(kv, before)
            model.use_cpp_decode = True
            lg_c.append(model.forward(torch.tensor([tok]), pos, kv)[0])
            assert model.fused_step(kv) is not None, "the C++ step did not run"
            _restore(kv, after)
            tok = int(lg_py[-1].argmax())
    finally:
        model.use_cpp_decode = True
        if moe is not None:
            model.moe = moe
    judged = torch.tensor(gaps) >= ROUTER_TIE
    assert int(judged.sum()) >= 4, f"only {int(judged.sum())} of {n} steps were clear of router ties: {gaps}"
    lg_py, lg_c = torch.stack(lg_py)[judged], torch.stack(lg_c)[judged]
    atol = tol * float(lg_py.abs().max())
    torch.testing.assert_close(lg_c, lg_py, rtol=0, atol=atol)
    top2 = lg_py.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > atol
    assert bool((lg_c.argmax(-1) == lg_py.argmax(-1))[clear].all())


def test_every_architecture_is_one_forward():
    """Every supported decoder architecture runs the one Transformer, every embedding encoder the one Encoder; a
    family is its spec entry."""
    from pyllm.models import ARCHITECTURES, DECODERS, body_class
    from pyllm.models.encoder import Encoder
    from pyllm.models.encoder_spec import ENCODERS
    from pyllm.models.transformer import Transformer

    assert set(ARCHITECTURES) == set(DECODERS) | set(ENCODERS)
    assert {body_class(a) for a in DECODERS} == {Transformer}
    assert {body_class(a) for a in ENCODERS} == {Encoder}
