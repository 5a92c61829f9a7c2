"""The backend seam (pyllm/backends): choosing a device, backends held per model (nothing process-global), the
fused step per cache, and the loaders' one path from a checkpoint to an LLM.

References: the "reference" backend (float32 torch over weights dequantized by quant.py, itself tied to
gguf.quants and transformers elsewhere) for the fast backend's logits; bounds as test_model.py's for SmolLM2.
"""

import subprocess
import sys
import types

import pytest
import torch

import pyllm
import pyllm._ext
from pyllm import backends, ops
from pyllm.backends import Backend, BackendUnavailable, DecodeStep
from pyllm.errors import PyllmError


@pytest.fixture(autouse=True, scope="module")
def _extension():
    """The fast backend is the extension: a build that fails is a failure (PyllmError), never a skip."""
    pyllm._ext.load()


def test_cpu_backends_follow_the_protocol():
    for name in ("fast", "reference"):
        b = backends.get(name)
        assert isinstance(b, Backend) and b.name == name and b.device == torch.device("cpu")
        d = b.describe()
        assert d["backend"] == name and d["device"] == "cpu"
    assert backends.get("fast").describe()["isa"] == pyllm.ops.get_isa()


def test_two_llms_with_different_backends_in_one_process(smollm2_path):
    """Loading a reference LLM changes nothing for a fast one loaded before it (and back): each model holds its
    own backend. Reference: the reference LLM's logits; bound 5% of the largest logit (int8 activations in the
    fast GEMV, test_model.py), greedy argmax equal where the reference's top-2 margin exceeds that bound."""
    fast = pyllm.load(smollm2_path, n_ctx=64)
    ref = pyllm.load(smollm2_path, n_ctx=64, kernels="reference")
    assert (fast.kernels, fast.device, ref.kernels, ref.device) == ("fast", "cpu", "reference", "cpu")
    assert fast.backend is fast.model.backend and fast.model.backend is not ref.model.backend
    ids = fast.tokenize("The capital of France is")
    lf, lr = fast.logits(ids), ref.logits(ids)
    atol = 0.05 * float(lr.abs().max())
    torch.testing.assert_close(lf, lr, rtol=0, atol=atol)
    tf = fast.generate(ids, max_tokens=6, temperature=0)
    tr = ref.generate(ids, max_tokens=6, temperature=0)
    assert tf and tr
    # the fast LLM decoded through its fused step, the reference one cannot have one
    assert isinstance(fast.model.fused_step(fast.kv), DecodeStep)
    assert ref.model.fused_step(ref.kv) is None
    assert fast.info()["runtime"]["backend"] == "fast" and ref.info()["runtime"]["backend"] == "reference"
    # and in the other order: the fast model still runs its kernels after the reference one ran
    lf2 = fast.logits(ids)
    torch.testing.assert_close(lf2, lf, rtol=0, atol=0)


def test_fused_step_is_kept_per_cache(smollm2_path):
    """A server holds one cache per slot: each gets its own step, built once."""
    llm = pyllm.load(smollm2_path, n_ctx=32)
    m = llm.model
    a = m.backend.make_kv_cache("f16", m.cfg.n_layer, m.cfg.n_kv_head, 32, m.cfg.head_dim)
    b = m.backend.make_kv_cache("q8_0", m.cfg.n_layer, m.cfg.n_kv_head, 32, m.cfg.head_dim)
    sa = m.fused_step(a)
    assert sa is not None and m.fused_step(a) is sa and m.decode_context(a) is sa.ctx
    assert m.fused_step(b) is None  # a centered cache before its means are fixed
    m.forward(torch.tensor([1, 2, 3]), 0, b)
    sb = m.fused_step(b)
    assert sb is not None and sb is not sa and m.fused_step(a) is sa


# ---- device selection ----------------------------------------------------------------------------------------
def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _fake_cuda_module(monkeypatch, create):
    mod = types.ModuleType("pyllm.backends.cuda")
    mod.create = create
    monkeypatch.setitem(sys.modules, "pyllm.backends.cuda", mod)


def test_device_names_are_checked():
    for bad in ("tpu", "cuda:x", "cpu:0", "", None):
        with pytest.raises(PyllmError, match="device must be one of"):
            backends.select(bad)
    with pytest.raises(PyllmError, match="kernels must be"):
        backends.select("cpu", "turbo")
    with pytest.raises(PyllmError, match="run on the CPU"):
        backends.select("cuda", "reference")


def test_cuda_without_a_gpu_says_why(monkeypatch, smollm2_path):
    _no_gpu(monkeypatch)
    with pytest.raises(BackendUnavailable, match="device 'cuda' is not available: "):
        backends.select("cuda")
    with pytest.raises(PyllmError, match="not available"):
        pyllm.load(smollm2_path, device="cuda")


def test_auto_without_a_gpu_is_the_cpu(monkeypatch):
    _no_gpu(monkeypatch)
    assert backends.select("auto").name == "fast"
    assert backends.select("auto", "reference").name == "reference"


def test_auto_falls_back_when_the_cuda_backend_cannot_start(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken(**kw):
        raise RuntimeError("driver too old")

    _fake_cuda_module(monkeypatch, broken)
    assert backends.select("auto").name == "fast"
    with pytest.raises(BackendUnavailable, match="cannot start: RuntimeError: driver too old"):
        backends.select("cuda")


def test_auto_picks_cuda_when_it_starts(monkeypatch):
    """get("cuda") imports pyllm.backends.cuda lazily and calls its create(device=...)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = {}

    def create(**kw):
        seen.update(kw)
        b = backends.get("reference")
        b.name = "cuda"
        return b

    _fake_cuda_module(monkeypatch, create)
    assert backends.select("auto").name == "cuda" and seen == {"device": "cuda"}
    assert backends.select("cuda:1").name == "cuda" and seen == {"device": "cuda:1"}


def test_missing_cuda_backend_module(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "pyllm.backends.cuda", None)  # import fails as for a missing module
    with pytest.raises(BackendUnavailable):
        backends.get("cuda")
    assert backends.select("auto").name == "fast"


# ---- loaders -------------------------------------------------------------------------------------------------
def test_readers_do_not_import_the_llm():
    """Data flows file -> Checkpoint -> LLM: neither reader imports pyllm.llm (no hidden cycle)."""
    code = ("import sys, pyllm.formats.awq.folder, pyllm.formats.checkpoint, pyllm.backends.cpu, pyllm.models; "
            "assert 'pyllm.llm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('pyllm'))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_from_checkpoint_closes_on_failure(smollm2_path, monkeypatch):
    from pathlib import Path

    from pyllm.formats.checkpoint import read_gguf
    from pyllm.llm import from_checkpoint

    ckpt = read_gguf(Path(smollm2_path))
    closed = []
    monkeypatch.setattr(ckpt.source, "close", lambda: closed.append(1))
    with pytest.raises(PyllmError, match="n_ctx must be at least 8"):
        from_checkpoint(ckpt, backends.get("fast"), n_ctx=4)
    assert closed == [1]


def test_cpu_backend_repacks_only_what_fits_in_half_the_free_memory(monkeypatch):
    """The decode step's interleaved copy of the layer matrices and the output projection is made at load when
    they take at most half of MemAvailable, and skipped above (a copy that swaps costs more than it gains); types
    without the layout and other tensors (an untied model's token embedding) are never copied.  Reference: the byte
    counts of the random matrices themselves."""
    from pyllm.backends import cpu
    from pyllm.formats.gguf import GGMLType
    from pyllm.models.synthetic import random_qtensor

    weights = {"blk.0.attn_q.weight": random_qtensor(GGMLType.Q4_0, 64, 256, "q"),
               "blk.0.ffn_down.weight": random_qtensor(GGMLType.Q5_1, 32, 512, "down"),
               "blk.0.ffn_up.weight": random_qtensor(GGMLType.Q4_K, 64, 256, "up"),
               "blk.0.attn_k.weight": random_qtensor(GGMLType.F16, 64, 256, "k"),
               "output.weight": random_qtensor(GGMLType.Q8_0, 64, 256, "out"),
               "token_embd.weight": random_qtensor(GGMLType.Q4_0, 64, 256, "emb")}
    need = sum(weights[n].data.numel() for n in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight",
                                                  "blk.0.ffn_up.weight", "output.weight"))
    for free, copied in ((2 * need, True), (2 * need - 1, False), (None, True)):
        monkeypatch.setattr(cpu, "available_memory", lambda free=free: free)
        b = cpu.CpuBackend()
        b.prepare_weights(dict(weights))
        assert b.describe().get("repacked_mb") == (round(need / 2**20, 1) if copied else None), free
        data, qtype = b.decode_matrix(weights["blk.0.attn_q.weight"])
        assert (qtype == 60) == copied and (data is weights["blk.0.attn_q.weight"].data) != copied
        if copied:  # one allocation for every copy, from a 2 MiB boundary (huge pages), each repack_rows8's bytes
            names = ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.0.ffn_up.weight", "output.weight")
            copies = [b.decode_matrix(weights[n])[0] for n in names]
            assert len({c.untyped_storage().data_ptr() for c in copies}) == 1
            assert min(c.data_ptr() for c in copies) % (1 << 21) == 0
            for n, c in zip(names, copies):
                w = weights[n]
                assert torch.equal(c, ops._C.repack_rows8(w.data, int(w.qtype))), n
    assert b.decode_matrix(weights["blk.0.attn_k.weight"])[1] == int(GGMLType.F16)
    assert id(weights["token_embd.weight"].data) not in b._rows8


def test_backend_keyword_is_a_deprecated_alias_of_kernels(smollm2_path):
    """``backend=`` (the CPU kernel choice's old name) still loads, with a DeprecationWarning; disagreeing with
    ``kernels=`` is refused."""
    with pytest.warns(DeprecationWarning, match="kernels="):
        llm = pyllm.load(smollm2_path, n_ctx=32, backend="reference")
    assert llm.kernels == "reference" and llm.backend.name == "reference"
    llm.close()
    with pytest.warns(DeprecationWarning), pytest.raises(pyllm.PyllmError, match="disagree"):
        pyllm.load(smollm2_path, n_ctx=32, kernels="reference", backend="fast")


def test_cpu_backend_says_when_the_os_gives_no_huge_pages(monkeypatch):
    """Transparent huge pages switched off ("never") are named in the CPU backend's description and in the runtime
    phrase the CLI prints (decode then streams 4 KiB pages); "always" or "madvise" add nothing.  Reference: the
    mode as Linux reports it, bracketed in /sys/kernel/mm/transparent_hugepage/enabled."""
    from pyllm.backends import cpu
    from pyllm.info import format_runtime

    for mode, off in (("never", True), ("madvise", False), ("always", False), (None, False)):
        monkeypatch.setattr(ops, "huge_pages_mode", lambda mode=mode: mode)
        rt = cpu.CpuBackend().describe()
        assert (rt.get("huge_pages") is False) == off, mode
        assert format_runtime(rt).endswith("no huge pages)") == off, mode
    monkeypatch.undo()
    assert ops.huge_pages_mode() in ("always", "madvise", "never", None)
    import builtins

    real_open = builtins.open
    for text, want in (("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("garbled\n", None)):
        def fake_open(path, *a, text=text, **k):
            if str(path).startswith("/sys/kernel/mm/transparent_hugepage"):
                import io

                return io.StringIO(text)
            return real_open(path, *a, **k)

        monkeypatch.setattr(builtins, "open", fake_open)
        assert ops.huge_pages_mode() == want, text
        monkeypatch.undo()
