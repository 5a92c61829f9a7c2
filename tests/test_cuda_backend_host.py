"""The CUDA backend's host-side logic, on a machine without a GPU.

- availability: create() raises BackendUnavailable naming why (here: no CUDA torch / no GPU), never a traceback;
- weight planning: tied weights uploaded once, in file order; the VRAM check names need and free memory;
- graph bookkeeping: position 0 eager, first later call captures, then replays; failures fall back to eager;
- cache layout: the step's row writer (storage transform + encoding) writes the bytes kv_cache.py writes, for
  every cache kind, K and V apart (reference: kv_cache.py, the one definition);
- attention: the float64 definition of csrc/cuda/attention.cu (tests/gpu/cuda_testutil.py), fed the step's query
  and output transforms, equals kv_cache.py's own attention over the same cache (reference: KVCache.attend);
- the whole step: CudaDecodeStep's decoder, run on the CPU with torch stand-ins for the CUDA kernels, gives the
  model's own torch forward's logits on llama-family and Gemma 3 models over every cache kind (reference: the
  model's torch path; tolerance 1e-4 relative: both are float32, the kernels' int8 activations are not in play).
- the forward with device-held positions (what the step captures for a model the row kernels do not take) reads
  nothing back to the host and gives the host-position forward's logits;
- the batched step: several sequences' decode rows in one pass give what each sequence's step gives alone.
What only a GPU run can prove (tests/gpu): the kernels themselves, graph capture, bit-exact batched rows, speed.
"""

import math

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from pyllm.backends import cuda as cb
from pyllm.backends import cuda_step as cs
from pyllm.backends.base import BackendUnavailable
from pyllm.errors import PyllmError
from pyllm.runtime import kv_cache
from gpu.cuda_testutil import (reference_act, reference_attn_decode, reference_quantize_act, reference_residual_norm,
                               reference_rope_store)
from test_decode_step_gemma3 import _restore, _snapshot

SEAM = hasattr(kv_cache.KVCache, "storage_layout")
CODES_VALUE = cs.codes_value  # the real one (the fixture below stands a shadow in for it)
needs_seam = pytest.mark.skipif(not SEAM, reason="needs the backend seam (KVCache.storage_layout)")

KINDS = ["f16", "bf16", "f32", "q8_0", "q4_0", "q8_rot", "q4_rot", "f16/q4_rot", "q8_0/f16", "q4_rot/q8_0"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_create_without_gpu_names_why():
    with pytest.raises(BackendUnavailable, match="device 'cuda' is not available: (this torch|torch sees no GPU)"):
        cb.create("cuda")
    assert cb.unavailable_reason("cuda")


def test_cuda_build_problem_is_one_phrase():
    from pyllm import _ext

    why = _ext.cuda_build_problem()
    if torch.version.cuda is None:
        assert "CPU-only" in why
    assert why is None or "\n" not in why


class _W:
    def __init__(self, n):
        self.nbytes = n


def test_upload_plan_dedups_tied_weights_in_order():
    emb, a = _W(100), _W(7)
    plan = cb.upload_plan({"token_embd.weight": emb, "blk.0.attn_q.weight": a, "output.weight": emb})
    assert plan == [("token_embd.weight", 100), ("blk.0.attn_q.weight", 7)]


def test_check_fits():
    cb.check_fits(1 << 30, 8 << 30, "GPU")
    with pytest.raises(PyllmError, match=r"need 7\.75 GiB of GPU memory, but GPU has 8\.00 GiB free"):
        cb.check_fits(int(7.75 * 2**30), 8 << 30, "GPU")


def test_graph_policy():
    p = cs.GraphPolicy(enabled=True)
    assert p.action(0) == "eager"
    assert p.action(5) == "capture"
    p.record("capture")
    assert p.action(6) == "replay" and p.action(0) == "eager"
    p.record("replay")
    assert p.replays == 1
    p.record("replay", RuntimeError("operation not permitted when stream is capturing"))
    assert p.action(7) == "eager" and "not permitted" in p.failed
    assert cs.GraphPolicy(enabled=False).action(9) == "eager"


def _filled_cache(kind, hkv=2, h=4, hd=64, n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = kv_cache.KVCache(2, hkv, 32, hd, kind)
    for layer in range(2):
        k = torch.randn(n, hkv, hd, generator=g) + torch.linspace(-3, 3, hd)  # a common component: centering matters
        v = torch.randn(n, hkv, hd, generator=g)
        q = torch.randn(n, h, hd, generator=g)
        kv.update(layer, 0, k[:5], v[:5], q=q[:5])
        kv.update(layer, 5, k[5:], v[5:], q=q[5:])
    return kv, g


@needs_seam
@pytest.mark.parametrize("kind", KINDS)
def test_row_writer_matches_kv_cache(kind):
    kv, g = _filled_cache(kind)
    k_lay, v_lay = kv.storage_layout()
    x_k, x_v = torch.randn(1, 2, 64, generator=g) * 2, torch.randn(1, 2, 64, generator=g)
    kv.update(1, 11, x_k, x_v)
    for lay, x in ((k_lay, x_k), (v_lay, x_v)):
        part = cs.attn_part(lay, 1)
        row = cs.encode_rows(part.block, cs.to_storage(part, x[0]), lay.data.dtype)
        assert torch.equal(row, lay.data[1, :, 11]), f"{kind}: the step's row differs from kv_cache.py's"


@needs_seam
@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_attention_definition_matches_kv_cache(kind, window):
    from pyllm.models.transformer import attention

    kv, g = _filled_cache(kind, seed=1)
    q = torch.randn(1, 4, 64, generator=g)
    layer, length, scale = 1, 11, 1 / 8
    want = kv.attend(layer, q, length - 1, lambda qq, k, v: attention(qq, k, v, length - 1, scale, window))
    kp, vp = (cs.attn_part(p, layer) for p in kv.storage_layout())
    qs = q[0]
    if kp.scale is not None:
        qs = qs * kp.scale.repeat_interleave(2, 0)
    if kp.rot is not None:
        qs = qs @ kp.rot_t
    a = reference_attn_decode(qs, kp, vp, length, scale, window).float()
    if vp.rot is not None:
        a = a @ vp.rot
    if vp.mu is not None:
        a = a + vp.mu.repeat_interleave(2, 0)
    torch.testing.assert_close(a.reshape(1, -1), want, rtol=1e-4, atol=1e-5)


class TorchKernels:
    """The CUDA kernels' contracts in torch on the CPU (the CPU extension dequantizes weights exactly; the step's row
    kernels are tests/gpu/cuda_testutil.py's definitions).  Activation codes carry a float shadow of the rows they
    encode (keyed by the codes' buffer), and the stand-in GEMV multiplies the shadow: these tests check the step's
    wiring at float32 precision; the codes' int8 rounding is the kernels' own, checked on a GPU (tests/gpu)."""

    shadow: dict[int, torch.Tensor] = {}  # a code row's address -> the float row it encodes (shared: codes_value)

    def __init__(self):
        from pyllm import _ext

        self.C = _ext.load()
        self.DecodeArch = self.C.DecodeArch  # the row kernels' struct: the real one, checked by its constructor
        self.parts_calls: list[int] = []  # matrices per cuda_gemv_q_parts launch
        self.gemv_rows: list[int] = []  # rows per cuda_gemv_q launch

    def _codes(self, x, xq, xds):
        q, d = reference_quantize_act(x.reshape(xq.shape))
        xq.copy_(q)
        xds.copy_(d)
        for i, row in enumerate(x.detach().reshape(xq.shape)):
            self.shadow[xq[i].data_ptr()] = row.clone()

    @classmethod
    def rows(cls, xq):
        return torch.stack([cls.shadow[r.data_ptr()] for r in xq])

    def cuda_quantize_act(self, x, xq=None, xds=None):
        if xq is None:
            xq = torch.empty(x.shape, dtype=torch.int8)
            xds = torch.empty(x.shape[0], x.shape[1] // 32, 2)
        self._codes(x, xq, xds)
        return xq, xds

    def cuda_gemv_q(self, w, qt, xq, xds, out=None):
        self.gemv_rows.append(xq.shape[0])
        y = self.rows(xq) @ self.C.dequantize(w, qt).T
        return y if out is None else out.copy_(y)

    def cuda_gemv_q_parts(self, ws, qt, xq, xds, outs):
        self.parts_calls.append(len(ws))
        return [self.cuda_gemv_q(w, qt, xq, xds, o) for w, o in zip(ws, outs)]

    def cuda_residual_norm_quant(self, arch, x, a, post_w, w, h, xq, xds):
        assert x.shape[1] == arch.n_embd
        xn, hn = reference_residual_norm(x, a, post_w, w, arch.rms_eps)
        x.copy_(xn.float())
        h.copy_(hn.float())
        self._codes(h, xq, xds)

    def cuda_act_quant(self, arch, g, u, h, xq, xds):
        assert g.shape[1] == arch.n_ff
        h.copy_(reference_act(g, u, "gelu_tanh" if arch.gelu_tanh else "silu").float())
        self._codes(h, xq, xds)

    def cuda_rope_store(self, arch, layer, q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, cos, sin, pos, k_cache,
                        v_cache, q_out):
        p = int(pos[0])
        assert (cos is not None) == (arch.layer_rope[layer] >= 0) and (q_bias is not None) == arch.qkv_bias
        qq, kk, vv = reference_rope_store(q, k, v, arch.head_dim, q_bias, k_bias, v_bias, q_norm, k_norm,
                                          arch.rms_eps, cos, sin, arch.neox, p)
        q_out.copy_(qq.float())
        k_cache[:, p] = kk.float().to(k_cache.dtype)
        v_cache[:, p] = vv.float().to(v_cache.dtype)

    def cuda_gemv_supported(self, qt):
        return True

    cuda_dequant_supported = cuda_gemv_supported

    def cuda_gemv(self, w, qt, x):
        return x @ self.C.dequantize(w, qt).T

    def cuda_dequantize(self, w, qt, K, ids=None, half=True, check_ids=True):
        out = self.C.dequantize(w, qt) if ids is None else self.C.dequantize(w, qt, ids)
        return out.half() if half else out

    def cuda_attn_decode(self, q, k, v, length, scale, k_block, v_block, k_sink, v_sink, window, softcap, xq=None,
                         xds=None):
        kp = cs.AttnPart(k, k_block, k_sink, None, None, None)
        vp = cs.AttnPart(v, v_block, v_sink, None, None, None)
        out = reference_attn_decode(q, kp, vp, int(length[0]), scale, window, softcap).float()
        if xq is not None:
            self._codes(out.reshape(1, -1), xq, xds)
        return out


@pytest.fixture(autouse=True)
def shadow_codes_value(monkeypatch):
    """With TorchKernels' float shadows standing for codes, what codes stand for is the shadow itself: so
    output_gemv's residual rows are zeros and the step's logits stay float32-exact for these wiring tests (the
    residual's own arithmetic: test_output_gemv_residual_codes)."""
    monkeypatch.setattr(cs, "codes_value", lambda xq, xds: TorchKernels.rows(xq))
    yield
    TorchKernels.shadow.clear()


def _load_on_fake_cuda(monkeypatch, path, **kw):
    """pyllm.load on FakeCudaBackend (the CUDA backend's logic, torch kernels on the CPU): the step's torch body is
    the model's own forward, so the model must run on the backend whose step it is."""
    import pyllm
    from pyllm import backends

    monkeypatch.setattr(backends, "select", lambda *a, **k: FakeCudaBackend())
    return pyllm.load(str(path), device="cpu", **kw)


@needs_seam
@pytest.mark.parametrize("body", ["row kernels", "torch"])
@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_rot", "f16/q8_rot", "bf16/q4_0", "f32"])
@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma3", "smollm3"])
def test_step_matches_model_torch_path(arch, kind, body, monkeypatch):
    from tiny_models import gguf_path

    llm = _load_on_fake_cuda(monkeypatch, gguf_path(arch, "q8_0"), n_ctx=64, kv_cache="f32")
    model = llm.model
    backend = model.backend
    prompt = torch.tensor([1, 17, 33, 5, 99, 42, 7, 250, 3, 11])
    ref_kv, kv = (kv_cache.KVCache(model.cfg.n_layer, model.cfg.n_kv_head, 64, model.cfg.head_dim, kind)
                  for _ in range(2))
    # The two bodies' float32 keys and values differ in their last bits (their matmuls sum in other orders), which a
    # float cache keeps at ~1e-6 of the logits; a quantized cache can round one of those values to the next code,
    # and one flipped code moves the logits by up to ~5e-4 relative (gemma3 q8_0 at position 14: 5.14e-4, where
    # torch's float32 GEMM runs on Sapphire Rapids): the quantized caches' bound allows about two such flips.  Each
    # step starts from the reference's cache (teacher-forced, as tests/test_conformance.py): a flipped code would
    # otherwise re-round the later rows of every layer above it, and the difference would grow with the model's
    # depth (smollm3 q8_0, 4 layers: one code at position 11, 1.6e-3 two steps later), not with either body's error.
    bound = 5e-4 if kind in ("f16", "f32") else 1e-3
    model.use_cpp_decode = False
    try:
        model.forward(prompt, 0, ref_kv)
        model.forward(prompt, 0, kv)
        step = cs.CudaDecodeStep(backend, model, kv)
        assert step.row_kernels_problem is None
        if body == "torch":
            step.row_kernels_problem = "the test asks for the torch body"
        step.policy.enabled = False
        for i, tok in enumerate([12, 200, 64, 3, 77, 150]):  # past the sliding window (8) of mistral / gemma3
            pos = prompt.numel() + i
            _restore(kv, _snapshot(ref_kv))
            want = model.forward(torch.tensor([tok]), pos, ref_kv)
            got = step(tok, pos)
            assert got.dtype == torch.float32 and got.device.type == "cpu" and got.shape == want.shape
            err = ((got - want).norm() / want.norm()).item()
            assert err <= bound, f"{arch} {kind} pos {pos}: relative error {err:.3g}"
        logits, top = step.with_argmax(5, pos + 1)  # the CPU step's contract: 1-D logits and their first argmax
        assert logits.shape == (model.cfg.n_vocab,) and top == int(np.argmax(logits.numpy()))
    finally:
        model.use_cpp_decode = True
    assert step.policy.eager_calls == 7
    assert not math.isnan(err)
    if body == "row kernels":  # Q8_0 everywhere: q/k/v in one launch, gate/up in one
        assert sorted(set(backend.K.parts_calls)) == [2, 3]


class HostReads(TorchFunctionMode):
    """Counts the tensor calls that read a value back to the host: on a GPU each one waits for the device, and a
    CUDA graph can capture none of them."""

    READS = frozenset(["__bool__", "item", "__int__", "__float__", "__index__", "tolist", "numpy", "cpu"])

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@needs_seam
@pytest.mark.parametrize("arch,kind", [("qwen3", "f16"), ("gemma3", "q8_0"), ("smollm3", "q4_rot"),
                                       ("qwen3", "bf16/q4_0")])
def test_forward_with_held_positions(arch, kind):
    """models/transformer.py forward_on_device with the position in a device tensor (what the CUDA step captures in a
    graph): it reads nothing back to the host, and its logits are the host-position forward's (reference: the
    forward with an int position, teacher-forced from the same cache; tolerance as
    test_step_matches_model_torch_path's: the held form attends over the whole cache under a mask, which sums in
    another order, and a quantized cache may round one of those values to the next code)."""
    import pyllm
    from tiny_models import gguf_path

    llm = pyllm.load(str(gguf_path(arch, "q8_0")), kernels="reference", n_ctx=64, kv_cache="f32")
    model = llm.model
    # an embedding that reads nothing back, as the CUDA kernel's (the reference backend's rows() checks the ids)
    tables = {}

    def embed(w, ids, check_ids=True):
        if id(w) not in tables:
            tables[id(w)] = w.dequantize(torch.float32)
        return tables[id(w)].index_select(0, ids)

    model.embed = embed
    prompt = torch.tensor([1, 17, 33, 5, 99, 42, 7, 250, 3, 11])
    ref_kv, kv = (kv_cache.KVCache(model.cfg.n_layer, model.cfg.n_kv_head, 64, model.cfg.head_dim, kind)
                  for _ in range(2))
    bound = 5e-4 if kind == "f16" else 1e-3
    tok, pos = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        model.forward_on_device(prompt, 0, ref_kv)
        for i, t in enumerate([12, 200, 64, 3, 77, 150]):  # past the sliding window (8) of gemma3
            at = prompt.numel() + i
            _restore(kv, _snapshot(ref_kv))
            with HostReads() as host:  # forward reads the token as an int (to offer it to a fused step)
                want = model.forward(torch.tensor([t]), at, ref_kv)
            assert "__int__" in host.calls, "the counter sees nothing: the check below would prove nothing"
            tok.fill_(t)
            pos.fill_(at)
            with HostReads() as held:
                got = model.forward_on_device(tok, pos, kv)
            assert held.calls == [], f"the held-position forward read {held.calls} back to the host"
            err = ((got - want).norm() / want.norm()).item()
            assert err <= bound, f"{arch} {kind} pos {at}: relative error {err:.3g}"
            k_want, v_want = ref_kv.view(model.cfg.n_layer - 1, at + 1)
            k_got, v_got = kv.view(model.cfg.n_layer - 1, at + 1)
            assert torch.allclose(k_got, k_want, rtol=1e-2, atol=1e-2) and torch.allclose(v_got, v_want, rtol=1e-2,
                                                                                           atol=1e-2)
    llm.close()


@needs_seam
@pytest.mark.parametrize("arch,kind", [("qwen3", "f16"), ("gemma3", "q8_0")])
def test_step_batches_decode_rows(arch, kind, monkeypatch):
    """CudaBackend.step over several sequences: their decode tokens run as one pass (every stand-in GEMV sees all
    the rows), each row's attention over its own cache, a prefill chunk beside them through the forward; each
    sequence's logits, argmax and cache rows are what stepping it alone gives (reference: the same sequences
    stepped one at a time on twin caches; tolerance 1e-4 relative: the stand-ins' float32 matmuls may sum three
    rows in another order than one (~1e-6 a step, carried on through the cache rows), where the GPU's GEMV does
    not: tests/gpu/test_batch_step.py asserts equality)."""
    from tiny_models import gguf_path

    from pyllm.backends.base import SeqStep

    monkeypatch.setenv("PYLLM_CUDA_GRAPH", "0")
    llm = _load_on_fake_cuda(monkeypatch, gguf_path(arch, "q8_0"), n_ctx=64, kv_cache=kind)
    model, backend = llm.model, llm.model.backend
    cfg = model.cfg
    prompts = [[1, 17, 33, 5, 99], [7, 250, 3, 11, 42, 8, 9], [64, 3]]

    def caches(n):
        return [backend.make_kv_cache(kind, cfg.n_layer, cfg.n_kv_head, 64, cfg.head_dim) for _ in range(n)]

    alone, together = caches(4), caches(4)
    for kvs in (alone, together):
        model.step([SeqStep(kv, p, 0, prefill=True) for kv, p in zip(kvs, prompts)])
    toks, pos = [12, 200, 77], [len(p) for p in prompts]
    for n in range(4):
        seqs = [SeqStep(kv, [t], p) for kv, t, p in zip(together, toks, pos)]
        if n == 3:  # a prompt joins: its chunk goes through the forward, beside the decode rows
            seqs.insert(1, SeqStep(together[3], [5, 6, 7], 0, prefill=True))
        backend.K.gemv_rows.clear()
        got = backend.step(model, seqs)
        assert backend.K.gemv_rows.count(3) >= cfg.n_layer, "the decode rows did not run as one pass"
        want = [backend.step(model, [SeqStep(kv, [t], p)])[0] for kv, t, p in zip(alone, toks, pos)]
        if n == 3:
            want.insert(1, backend.step(model, [SeqStep(alone[3], [5, 6, 7], 0, prefill=True)])[0])
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.logits.shape == w.logits.shape
            err = ((g.logits - w.logits).norm() / w.logits.norm()).item()
            assert err <= 1e-4, f"{arch} {kind} step {n}: relative error {err:.3g}"
            assert (g.argmax is None) == (w.argmax is None) and (g.argmax is None or g.argmax == w.argmax)
        for kv_a, kv_t, p in zip(alone, together, pos):
            for layer in range(cfg.n_layer):
                for x, y in zip(kv_t.view(layer, p + 1), kv_a.view(layer, p + 1)):
                    torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)
        toks = [int(w.argmax[0]) for w in (want[:1] + want[2:] if n == 3 else want)]
        pos = [p + 1 for p in pos]
    llm.close()


class CodeKernels:
    """Code-exact stand-ins: cuda_quantize_act writes reference codes, cuda_gemv_q multiplies what the codes stand for
    (the GEMV kernel's block products, float64 here) by a float weight matrix."""

    def cuda_quantize_act(self, x, xq=None, xds=None):
        q, d = reference_quantize_act(x)
        if xq is None:
            return q, d
        xq.copy_(q)
        xds.copy_(d)
        return xq, xds

    def cuda_gemv_q(self, w, qt, xq, xds, out=None):
        y = (CODES_VALUE(xq, xds).double() @ w.double().T).float()
        return y if out is None else out.copy_(y)

    def cuda_gemv_supported(self, qt):
        return True


class _Rows:
    qtype, is_float = 8, False

    def __init__(self, w):
        self.data, self.shape = w, w.shape


@pytest.mark.parametrize("t", [1, 3, 6])
def test_output_gemv_residual_codes(t, monkeypatch):
    """The output projection from x's int8 codes plus the codes of what they miss (output_gemv, through
    CudaBackend.linear_output: one [2T]-row launch for T <= 4, T = 6 in parts) against float64 x @ W^T: the error
    of two 8-bit roundings, the second of the first's residual, is ~1/100 of one rounding's.  Rows carry outliers
    (a few values 30x the rest), where one scale per 32 values rounds the others coarsely."""
    monkeypatch.setattr(cs, "codes_value", CODES_VALUE)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 256, generator=g)
    x[:, ::37] *= 30
    w = torch.randn(96, 256, generator=g)
    want = x.double() @ w.double().T
    kern = CodeKernels()
    got = cb.CudaBackend(kern, torch.device("cpu")).linear_output(x, _Rows(w))
    err = ((got.double() - want).norm() / want.norm()).item()
    xq, xds = kern.cuda_quantize_act(x)
    one = kern.cuda_gemv_q(w, 8, xq, xds)  # x's codes alone: the GEMV the output projection took before
    err_one = ((one.double() - want).norm() / want.norm()).item()
    assert got.shape == (t, 96) and err < 1e-4 and err < err_one / 50, (err, err_one)


def test_gemvs_group_consecutive_weights_of_one_type():
    """CudaDecodeStep._gemvs: consecutive weights of one type with a GEMV kernel share one cuda_gemv_q_parts launch;
    a type change, a float weight or a type without a kernel ends the group (those go through _gemv)."""
    import types

    launches, single = [], []

    class Kern:
        def cuda_gemv_supported(self, qt):
            return qt != 99

        def cuda_gemv_q_parts(self, ws, qt, xq, xds, outs):
            launches.append((qt, len(ws)))
            return list(outs)

    def w(qt, is_float=False):
        return types.SimpleNamespace(qtype=qt, is_float=is_float, data=None)

    kern = Kern()
    me = types.SimpleNamespace(K=kern, b=cb.CudaBackend(kern, torch.device("cpu")),
                               _gemv=lambda wt, rows, codes, out: single.append(wt.qtype) or out)
    pairs = [(w(12), "q"), (w(12), "k"), (w(14), "v"), (w(99), "x"), (w(12, True), "f"), (w(12), "g"), (w(12), "u")]
    assert cs.CudaDecodeStep._gemvs(me, pairs, None, (None, None)) == ["q", "k", "v", "x", "f", "g", "u"]
    assert launches == [(12, 2), (14, 1), (12, 2)]
    assert single == [99, 12]


def test_argmax_or_minus1_is_numpys_argmax_or_minus1():
    """The step's device-side argmax (reference: np.argmax, first of tied maxima) and its non-finite flag (-1 where
    any logit is NaN or +-inf, as the CPU step's RowArgmax)."""
    g = torch.Generator().manual_seed(7)
    for n in (1, 31, 1000, 49152):
        x = torch.randn(1, n, generator=g)
        assert int(cs.argmax_or_minus1(x)) == int(np.argmax(x.numpy()))
    x = torch.zeros(1, 100)
    x[0, [17, 3, 90]] = 2.0
    assert int(cs.argmax_or_minus1(x)) == 3
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in (0, 50, 99):
            y = x.clone()
            y[0, at] = bad
            assert int(cs.argmax_or_minus1(y)) == -1, (bad, at)


def test_awq_weights_go_up_as_rows():
    """AWQ tensors are repacked once into the CPU's row layout (which the CUDA GEMV reads) before upload; a group
    size without a layout stays in AutoAWQ form (multiplied through its own dequantize)."""
    from pyllm import _ext
    from pyllm.formats.awq.repack import repack
    from pyllm.formats.awq.unpack import AWQTensor
    from test_awq import random_awq

    C = _ext.load()
    _, _, s, qw, qz = random_awq(256, 64, 64, seed=3)
    t = AWQTensor(qw, qz, s, 64, name="w")
    up = cb._to_device(t, torch.device("cpu"), C)
    assert isinstance(up, cb.CudaAwqRows) and up.qtype == int(C.awq_qtype(64)) and up.shape == (64, 256)
    assert torch.equal(up.data, repack(t, C).data)
    _, _, s, qw, qz = random_awq(192, 16, 96, seed=4)
    odd = cb._to_device(AWQTensor(qw, qz, s, 96, name="odd"), torch.device("cpu"), C)
    assert isinstance(odd, AWQTensor) and odd.group_size == 96


class FakeCudaBackend(cb.CudaBackend):
    """The CUDA backend on the CPU: torch stand-ins for the kernels, weights planned and converted as for upload."""

    def __init__(self):
        super().__init__(TorchKernels(), torch.device("cpu"))

    def describe(self):
        return {"backend": self.name, "device": "cpu (CUDA backend logic, torch kernels)"}

    def prepare_weights(self, weights, progress=False):
        moved = {id(weights[n]): cb._to_device(weights[n], self.device, self.K.C) for n, _ in cb.upload_plan(weights)}
        return {n: moved[id(w)] for n, w in weights.items()}


@needs_seam
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_runtime_through_the_cuda_step_matches_cpu(arch, monkeypatch):
    """pyllm.load -> runtime -> the CUDA backend's step (eager, torch kernels): 32 greedy tokens equal the CPU
    backend's (Q4_0 weights, q8_0 cache: the fused step runs from the first decoded token on)."""
    import pyllm
    from pyllm import backends
    from tiny_models import gguf_path

    path = str(gguf_path(arch, "q4_0"))
    cpu = pyllm.load(path, device="cpu", n_ctx=128, kv_cache="q8_0")
    monkeypatch.setenv("PYLLM_CUDA_GRAPH", "0")
    monkeypatch.setattr(backends, "select", lambda *a, **k: FakeCudaBackend())
    fake = pyllm.load(path, device="cpu", n_ctx=128, kv_cache="q8_0")
    assert fake.model.backend.name == "cuda"
    prompt = [1, 17, 33, 5, 99, 42, 7, 250, 3, 11]
    want = list(cpu.generate_tokens(prompt, max_tokens=32, temperature=0, speculative="none"))
    got = list(fake.generate_tokens(prompt, max_tokens=32, temperature=0, speculative="none"))
    assert got == want
    step = fake.model.fused_step(fake.kv)
    assert isinstance(step, cs.CudaDecodeStep) and step.policy.eager_calls >= len(want) - 1


def _adapter_for(arch: str, path, tmp_path) -> str:
    """A rank-4 LoRA adapter (tests/test_lora.py's layout) on every matrix of the tiny ``arch`` model at ``path``,
    the output projection and the token embedding included where the model has its own output."""
    from test_lora import ALL, make_pairs, write_adapter

    from pyllm.formats.gguf import open_gguf

    gf = open_gguf(path)
    file_arch, names = gf.metadata["general.architecture"], set(gf.tensors)
    gf.close()
    wanted = [n for n in ALL["mistral"](arch) if n in names] if arch == "mistral" else \
        [f"blk.{i}.{m}.weight" for i in range(2) for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                             "ffn_up", "ffn_down")]
    return write_adapter(tmp_path / f"{arch}-lora.gguf", file_arch, make_pairs(path, wanted, 4, 3), alpha=8.0)


@needs_seam
@pytest.mark.parametrize("body", ["row kernels", "torch"])
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_step_adds_lora_terms(arch, body, tmp_path, monkeypatch):
    """LoRA adapters (pyllm/lora.py) in the step, both bodies: its logits equal the model's own torch forward with
    the same adapters (Decoder.attach_lora's hook, which tests/test_lora.py ties to the adapters merged into the
    weights); tolerance as test_step_matches_model_torch_path's."""
    from tiny_models import gguf_path

    path = gguf_path(arch, "q8_0")
    adapter = _adapter_for(arch, path, tmp_path)
    llm = _load_on_fake_cuda(monkeypatch, path, n_ctx=64, kv_cache="f32", lora=[(adapter, 0.7)])
    model = llm.model
    assert model.lora_terms
    backend = model.backend
    prompt = torch.tensor([1, 17, 33, 5, 99, 42, 7, 250, 3, 11])
    ref_kv, kv = (kv_cache.KVCache(model.cfg.n_layer, model.cfg.n_kv_head, 64, model.cfg.head_dim, "f16")
                  for _ in range(2))
    model.use_cpp_decode = False
    model.forward(prompt, 0, ref_kv)
    model.forward(prompt, 0, kv)
    step = cs.CudaDecodeStep(backend, model, kv)
    if body == "torch":
        step.row_kernels_problem = "the test asks for the torch body"
    step.policy.enabled = False
    for i, tok in enumerate([12, 200, 64, 3, 77]):
        pos = prompt.numel() + i
        want = model.forward(torch.tensor([tok]), pos, ref_kv)
        err = ((step(tok, pos) - want).norm() / want.norm()).item()
        assert err <= 5e-4, f"{arch} {body} pos {pos}: relative error {err:.3g}"
    llm.close()
    if body == "torch":  # the model's own forward: its hook is the model's (tests/test_lora.py)
        return
    # without the terms the step is far from the adapted forward: the terms are what the comparison measures
    step.lora, step.lora_names = {}, {}
    want = model.forward(torch.tensor([5]), pos + 1, ref_kv)
    assert ((step(5, pos + 1) - want).norm() / want.norm()).item() > 100 * 5e-4


@needs_seam
def test_runtime_with_lora_through_the_cuda_step_matches_cpu(monkeypatch, tmp_path):
    """pyllm.load(lora=...) -> the CUDA backend's step (eager, torch kernels): greedy tokens equal the CPU backend's
    C++ step with the same adapter (Q8_0 weights, f16 cache; an 8-token prompt: the CPU's prefill then runs its
    GEMVs, not its bf16 GEMM)."""
    import pyllm
    from pyllm import backends
    from tiny_models import gguf_path

    path = str(gguf_path("mistral", "q8_0"))
    adapter = _adapter_for("mistral", path, tmp_path)
    cpu = pyllm.load(path, device="cpu", n_ctx=128, lora=[(adapter, 0.7)])
    monkeypatch.setenv("PYLLM_CUDA_GRAPH", "0")
    monkeypatch.setattr(backends, "select", lambda *a, **k: FakeCudaBackend())
    fake = pyllm.load(path, device="cpu", n_ctx=128, lora=[(adapter, 0.7)])
    prompt = [1, 17, 33, 5, 99, 42, 7, 250]
    want = list(cpu.generate_tokens(prompt, max_tokens=16, temperature=0, speculative="none"))
    got = list(fake.generate_tokens(prompt, max_tokens=16, temperature=0, speculative="none"))
    assert got == want
    step = fake.model.fused_step(fake.kv)
    assert isinstance(step, cs.CudaDecodeStep) and step.lora and step.policy.eager_calls >= len(want) - 1
