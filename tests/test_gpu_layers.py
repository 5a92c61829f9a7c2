"""--gpu-layers N / pyllm.load(gpu_layers=N): a model's layers split between two backends (pyllm/backends/split.py).

On this host two CPU backends stand in for the two devices (PYLLM_GPU_STANDIN names the one that runs "the GPU's"
layers), so the placement code the GPU runs is the code tested here.  References and tolerances:
- a split over two fast backends against the fast backend alone: prompts through the torch forward, decode rows
  through each side's C++ step over its layers (one token, k + 1 rows, several sequences) against the whole
  model's C++ step: the same loop over the same rows, so logits and argmaxes equal bit for bit, and the KV rows of
  each layer equal the single cache's;
- a split over two reference backends against the reference alone: equal bit for bit;
- the GPU's layers on the reference backend and the CPU's on the fast one against the reference: mean KL over the
  decode positions of real text within tests/test_fast_accuracy.py's bound for the fast backend (KL_SPREAD x
  llama.cpp's own distance), and greedy tokens equal to the reference's (and the fast backend's) on a prompt where
  those two agree;
- the choice of N for --device auto: fit_gpu_layers, a pure function, on made-up sizes worked by hand.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import pyllm
from conftest import cli_in_process, fixture_path, pyllm_model
from pyllm.backends import split
from pyllm.backends.split import SplitBackend, SplitKVCache, check_gpu_layers, fit_gpu_layers, model_bytes
from pyllm.errors import PyllmError
from test_fast_accuracy import KL_LLAMA_CPP, KL_SPREAD, decode_logits, real_text

GIB, MIB = 2**30, 2**20
N_LAYER = {"smollm2": 30, "gemma3": 18}


def load(key: str, gpu_layers=None, kernels: str = "fast", **kw):
    return pyllm.load(fixture_path(key), n_ctx=512, kernels=kernels, gpu_layers=gpu_layers, **kw)


def reference(key: str):
    """The session's reference LLM (its weights dequantized once for every test that uses it)."""
    return pyllm_model(key, kernels="reference", n_ctx=512)


@functools.lru_cache(maxsize=None)
def placed(key: str, gpu_layers: int, standin: str, kernels: str = "fast"):
    """An LLM with ``gpu_layers`` of its layers on the ``standin`` backend, shared by this module's tests."""
    saved = os.environ.get(split.STANDIN_VARIABLE)
    os.environ[split.STANDIN_VARIABLE] = standin
    try:
        return load(key, gpu_layers=gpu_layers, kernels=kernels)
    finally:
        if saved is None:
            del os.environ[split.STANDIN_VARIABLE]
        else:
            os.environ[split.STANDIN_VARIABLE] = saved


def prompt_then_decode(llm, ids: list[int], n_prompt: int) -> torch.Tensor:
    """Logits [len(ids) - n_prompt, n_vocab] after each of ids[n_prompt:], the prompt ids[:n_prompt] through the
    forward, the rest one token at a time through the decode path; the rows stay in llm.kv."""
    g = llm.generator
    g.reset()
    g._forward(ids[:n_prompt])
    return torch.stack([g._forward([t])[-1] for t in ids[n_prompt:]])


def same_rows(split_llm, one, n_pos: int, layers) -> None:
    """Each of ``layers``' first n_pos K/V rows in its side's cache equal the single cache's, bit for bit."""
    kv, first_high = split_llm.kv, split_llm.model.backend.first_high
    for i in layers:
        side, j = (kv.low, i) if i < first_high else (kv.high, i - first_high)
        assert all(torch.equal(x, y) for x, y in zip(side.view(j, n_pos), one.kv.view(i, n_pos))), i


# ---- the choice of N -------------------------------------------------------------------------------------------
def test_fit_takes_the_whole_model_when_weights_and_cache_fit():
    # 16 GiB free keeps 1 GiB (1/16); 32 x 0.25 GiB + 1 GiB outside the layers + 32 x 64 MiB of cache = 11 GiB
    assert fit_gpu_layers(16 * GIB, [GIB // 4] * 32, GIB, 64 * MIB) == 33


def test_fit_takes_the_most_trailing_layers_that_fit():
    # 10 GiB free keeps 640 MiB: 9600 MiB of room; a layer is 400 MiB of weights + 32 MiB of cache = 432 MiB, so
    # 22 layers (9504 MiB) fit and 23 (9936 MiB) do not; the whole model (12800 + 1024 + 1024 MiB) does not
    assert fit_gpu_layers(10 * GIB, [400 * MIB] * 32, GIB, 32 * MIB) == 22
    # a longer context's cache leaves room for fewer: 400 + 112 MiB a layer -> 18 (9216 MiB; 19 is 9728)
    assert fit_gpu_layers(10 * GIB, [400 * MIB] * 32, GIB, 112 * MIB) == 18


def test_fit_counts_layers_from_the_last_and_stops_at_the_first_that_does_not_fit():
    # 2 GiB free keeps 256 MiB (more than 1/16): 1792 MiB; from the last layer: 700 + 700 = 1400, + 900 > 1792
    assert fit_gpu_layers(2 * GIB, [100 * MIB, 900 * MIB, 700 * MIB, 700 * MIB], 0, 0) == 2
    assert fit_gpu_layers(2 * GIB, [100 * MIB, 100 * MIB, 100 * MIB, 1800 * MIB], 0, 0) == 0
    assert fit_gpu_layers(200 * MIB, [MIB] * 4, 0, 0) == 0  # not even the headroom fits


def test_fit_matches_the_cuda_loaders_headroom():
    """The whole model is chosen exactly when the CUDA backend's own check (weights + headroom) would pass with the
    cache counted too: one byte more and it is a split."""
    from pyllm.backends.cuda import check_fits

    free, layers, other = 8 * GIB, [200 * MIB] * 10, 300 * MIB
    room = free - split.gpu_headroom(free)
    kv = (room - sum(layers) - other) // 10
    assert fit_gpu_layers(free, layers, other, kv) == 11
    check_fits(sum(layers) + other + 10 * kv, free, "the test GPU")
    assert fit_gpu_layers(free, layers, other, kv + 1) == 10


def test_model_bytes_counts_a_tied_output_once():
    class W:
        def __init__(self, n):
            self.nbytes = n

    embd = W(1000)
    weights = {"token_embd.weight": embd, "output.weight": embd, "output_norm.weight": W(8),
               "blk.0.attn_q.weight": W(100), "blk.0.attn_norm.weight": W(4), "blk.1.ffn_up.weight": W(300)}
    assert model_bytes(weights, 2) == ([104, 300], 1008)


@pytest.mark.parametrize("value", [True, 1.5, "3", -2, -100])
def test_a_bad_gpu_layers_value_is_refused_naming_it(value):
    with pytest.raises(PyllmError, match=r"^gpu_layers must be a number of layers >= 0, or -1 for the whole model"):
        check_gpu_layers(value, None)
    with pytest.raises(PyllmError, match="gpu_layers must be"):
        pyllm.load("smollm2-135m", gpu_layers=value)


@pytest.mark.parametrize("gpu_layers, device, want", [
    (None, None, ("cpu", None)), (None, "auto", ("auto", None)), (0, None, ("cpu", 0)), (0, "auto", ("cpu", 0)),
    (12, None, ("cuda", 12)), (12, "auto", ("auto", 12)), (-1, "cuda:1", ("cuda:1", -1))])
def test_gpu_layers_and_device_resolve(gpu_layers, device, want):
    assert check_gpu_layers(gpu_layers, device) == want


@pytest.mark.parametrize("gpu_layers, device, needle", [
    (0, "cuda", "gpu_layers=0 puts no layer on the GPU but device is 'cuda'"),
    (4, "cpu", "gpu_layers=4 puts layers on the GPU but device is 'cpu'")])
def test_gpu_layers_that_contradict_the_device_are_refused(gpu_layers, device, needle):
    with pytest.raises(PyllmError, match=needle):
        check_gpu_layers(gpu_layers, device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a host without a GPU answers")
def test_layers_on_a_gpu_this_host_lacks_are_an_error_naming_gpu_layers(monkeypatch):
    monkeypatch.delenv(split.STANDIN_VARIABLE, raising=False)
    with pytest.raises(PyllmError, match=r"^gpu_layers=4 puts layers on a GPU, but .*; use gpu_layers=0"):
        pyllm.load("smollm2-135m", gpu_layers=4)
    monkeypatch.setenv(split.STANDIN_VARIABLE, "cuda")
    with pytest.raises(PyllmError, match="PYLLM_GPU_STANDIN must be one of reference, fast"):
        pyllm.load("smollm2-135m", gpu_layers=4)


def test_placement_phrase():
    assert split.placement_phrase(24, 12, "cuda", "cpu") == "layers 12-23 on cuda, 0-11 on cpu"
    assert split.placement_phrase(24, 1, "cuda", "cpu") == "layer 23 on cuda, 0-22 on cpu"
    assert split.placement_phrase(24, 23, "cuda", "cpu") == "layers 1-23 on cuda, 0 on cpu"
    assert split.placement_phrase(24, 24, "cuda", "cpu") == "layers 0-23 on cuda, the output on cpu"


# ---- placements on real models, two CPU backends standing in -------------------------------------------------
@functools.lru_cache(maxsize=None)
def whole(key: str):
    """The fast backend alone (its C++ step over the whole model), shared by this module's tests."""
    return load(key)


@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_half_the_layers_on_a_second_fast_backend_give_the_same_bits(key):
    n = N_LAYER[key] // 2
    one, two = whole(key), placed(key, n, "fast")
    b = two.model.backend
    assert isinstance(b, SplitBackend) and b.low is not b.high and (b.low.name, b.high.name) == ("fast", "fast")
    assert b.first_high == N_LAYER[key] - n
    assert isinstance(two.model.fused_step(two.kv), split.SplitDecodeStep)  # decode rows run fused on both sides
    ids = one.tokenize("The quick brown fox jumps over the lazy dog, and the dog sleeps on.")
    assert torch.equal(one.logits(ids), two.logits(ids))  # prefill, every position
    # each layer's rows live in its side's cache, equal to the single cache's rows of that layer
    kv = two.kv
    assert isinstance(kv, SplitKVCache) and (kv.low.n_layer, kv.high.n_layer) == (N_LAYER[key] - n, n)
    edges = (0, b.first_high - 1, b.first_high, N_LAYER[key] - 1)
    same_rows(two, one, len(ids), edges)
    # a prompt, then one token at a time through each side's C++ step against the whole model's
    assert torch.equal(prompt_then_decode(one, ids, 6), prompt_then_decode(two, ids, 6))
    same_rows(two, one, len(ids), edges)
    assert torch.equal(decode_logits(one, ids[:8]), decode_logits(two, ids[:8]))  # from position 0 (sink rows)


@pytest.mark.parametrize("key, n", [("gemma3", 18), ("smollm2", 1), ("gemma3", 7)])
def test_split_decode_rows_equal_the_whole_models_c_step(key, n, monkeypatch):
    """Decode rows through the split's fused step -- one token, k + 1 rows (speculation's check), and one token of
    each of several sequences (the server's step) -- against the whole model's C++ step: logits and argmaxes bit for
    bit.  n = n_layer: the CPU side holds no layer, only the embedding and the head (and needs neither of Gemma 3's
    rope tables); n = 1: the GPU side one."""
    one, two = whole(key), placed(key, n, "fast")
    ids = one.tokenize("Once upon a time, in a small village, there lived an old clockmaker who")
    assert torch.equal(prompt_then_decode(one, ids, 5), prompt_then_decode(two, ids, 5))
    same_rows(two, one, len(ids), range(N_LAYER[key]))
    steps = [llm.model.fused_step(llm.kv) for llm in (one, two)]
    assert steps[1].rows_exact and steps[0].rows_exact
    for step, llm in zip(steps, (one, two)):  # rewrite positions 10..13 as one pass of 4 rows
        llm.generator.reset()
        llm.generator._forward(ids[:10])
    rows = [s.rows_with_argmax(torch.tensor(ids[10:14]), 10) for s in steps]
    assert torch.equal(rows[0][0], rows[1][0]) and list(rows[0][1]) == list(rows[1][1])
    last = [s.rows_with_argmax(torch.tensor(ids[14:17]), 14, False) for s in steps]  # the last row's logits only
    assert last[0][0].shape == (1, one.n_vocab) and torch.equal(last[0][0], last[1][0])
    same_rows(two, one, 17, range(N_LAYER[key]))
    # three sequences of different lengths, each on its own cache, in one step: one pass per side
    passes = []
    batch = split.SplitDecodeStep.batch
    monkeypatch.setattr(split.SplitDecodeStep, "batch", staticmethod(lambda *a: passes.append(1) or batch(*a)))
    outs = [run_three(llm, ids) for llm in (one, two)]
    assert passes == [1]
    for a, c in zip(*outs):
        assert torch.equal(a.logits, c.logits) and a.argmax == c.argmax


def run_three(llm, ids):
    """One decode token of each of three sequences (prompts of 3, 7 and 11 tokens on caches of their own) in one
    model.step, after the prompts went through it."""
    from pyllm.backends.base import SeqStep

    m, kv = llm.model, llm.kv
    caches = [m.backend.make_kv_cache(kv.kind, kv.n_layer, kv.n_kv_head, 64, kv.head_dim) for _ in range(3)]
    for c, n in zip(caches, (3, 7, 11)):
        m.step([SeqStep(c, ids[:n], 0, prefill=True)])
    return m.step([SeqStep(c, [ids[n]], n) for c, n in zip(caches, (3, 7, 11))])


def test_part_steps_refuse_what_their_context_does_not_hold():
    """Each side's context (csrc/bindings_decode.cpp): tokens where it has no embedding, a head it does not hold, a
    layer range outside it, a hidden state of another width -- one error each, naming it."""
    from pyllm import ops

    llm = placed("smollm2", 15, "fast")
    step = llm.model.fused_step(llm.kv)
    low, high = step.low.ctx, step.high.ctx
    assert (low.n_layer, low.has_embedding, low.has_head) == (15, True, True)
    assert (high.n_layer, high.has_embedding, high.has_head) == (15, False, False)
    d = high.n_embd
    with pytest.raises(ValueError, match="tokens enter at the embedding, which this context does not hold"):
        ops._C.decode_steps(high, torch.tensor([1]), 0, torch.empty(1, d), True, 0, -1, False)
    with pytest.raises(ValueError, match="head=True needs the context's head"):
        ops._C.decode_steps(high, torch.zeros(1, d), 0, torch.empty(1, d), True, 0, -1, True)
    with pytest.raises(ValueError, match="head=True needs the context's head after its last layer"):
        ops._C.decode_steps(low, torch.tensor([1]), 0, torch.empty(1, step.n_vocab), True, 0, 5, True)
    with pytest.raises(IndexError, match="layers 3..16 are not a range of the context's 15"):
        ops._C.decode_steps(high, torch.zeros(1, d), 0, torch.empty(1, d), True, 3, 16, False)
    with pytest.raises(ValueError, match="the hidden state has 7 values a row, the model 576"):
        ops._C.decode_steps(high, torch.zeros(1, 7), 0, torch.empty(1, d), True, 0, -1, False)
    with pytest.raises(ValueError, match=r"logits_out must be a contiguous CPU tensor of 1 x 576 values \(the hidden"):
        ops._C.decode_steps(high, torch.zeros(1, d), 0, torch.empty(1, 5), True, 0, -1, False)
    with pytest.raises(ValueError, match="the context holds part of a model"):
        ops._C.decode_step(high, 1, 0, torch.empty(d))


def test_half_the_layers_on_a_second_reference_backend_give_the_same_bits():
    one = reference("smollm2")
    two = placed("smollm2", 15, "reference", kernels="reference")
    ids = one.tokenize("Once upon a time, in a small village,")
    assert torch.equal(one.logits(ids), two.logits(ids))
    assert torch.equal(decode_logits(one, ids), decode_logits(two, ids))


@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_reference_gpu_half_stays_within_the_fast_backends_distance_from_the_reference(key):
    """The GPU's layers on the reference backend, the CPU's on the fast one, positions 136..199 of real text through
    the decode path (teacher forcing): mean KL from the reference within the bound the fast backend alone is held
    to over 200 (measured on SmolLM2: 1.9e-3 over these positions against the bound 6.6e-3; 2.5e-3 over all 200
    positions, where the fast backend alone measures 4.6e-3)."""
    ref, mixed = reference(key), placed(key, N_LAYER[key] // 2, "reference")
    ids = ref.tokenize(real_text())[:200]
    lr = torch.log_softmax(ref.logits(ids)[136:].double(), -1)
    g = mixed.generator
    g.reset()
    g._forward(ids[:136])
    lm = torch.log_softmax(torch.stack([g._forward([t])[-1] for t in ids[136:]]).double(), -1)
    kl = (lr.exp() * (lr - lm)).sum(-1).mean().item()
    assert kl <= KL_SPREAD * KL_LLAMA_CPP[key], f"{key}: mean KL {kl:.2e}"
    assert (lr.argmax(-1) == lm.argmax(-1)).double().mean().item() >= 0.9


@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_reference_gpu_half_greedy_tokens_equal_each_backends_alone(key):
    """On a prompt where the two backends alone agree for 16 greedy tokens (the reference's top-2 gap along them at
    least 0.14 on SmolLM2, 0.50 on Gemma 3), the split gives those tokens."""
    ref, fast, mixed = reference(key), pyllm_model(key, n_ctx=512), placed(key, N_LAYER[key] // 2, "reference")
    ids = fast.tokenize("Q: What is 12 * 7?\nA:")
    want = list(fast.generate_tokens(ids, max_tokens=16, temperature=0))
    # the reference's greedy choice at each of those positions, in one pass (teacher forcing): its own greedy tokens
    along = ref.logits(ids + want)[len(ids) - 1:-1].argmax(-1).tolist()
    assert along == want, "the reference and fast backends no longer agree on this prompt: choose another"
    assert list(mixed.generate_tokens(ids, max_tokens=16, temperature=0)) == want


def test_placements_at_the_edges(monkeypatch):
    """N = 0: the CPU backend alone; N = n_layer: every layer on the GPU's side, the output head on the CPU's;
    N = n_layer + 1 (or -1, or more): the whole model on the GPU's backend."""
    monkeypatch.setenv(split.STANDIN_VARIABLE, "reference")
    ref = reference("smollm2")
    ids = ref.tokenize("The capital of France is")
    want = ref.logits(ids)
    llm = load("smollm2", gpu_layers=0)
    assert llm.kernels == "fast" and llm.device == "cpu" and "placement" not in llm.info()["runtime"]
    for n in (31, -1, 99):
        llm = load("smollm2", gpu_layers=n)
        assert llm.kernels == "reference" and not isinstance(llm.kv, SplitKVCache)
    assert torch.equal(llm.logits(ids), want)
    llm = placed("smollm2", 30, "reference")
    b, kv = llm.model.backend, llm.kv
    assert isinstance(b, SplitBackend) and b.first_high == 0 and kv.low is None and kv.high.n_layer == 30
    assert llm.info()["runtime"]["placement"] == "layers 0-29 on cpu (reference), the output on cpu (fast)"
    out = llm.logits(ids)
    assert (out - want).abs().max() < 0.05 * want.abs().max()  # only the output head ran on the fast kernels
    assert int(out[-1].argmax()) == int(want[-1].argmax())


def test_info_and_banner_show_the_placement():
    from pyllm.info import format_runtime

    rt = placed("smollm2", 15, "reference").info()["runtime"]
    assert rt["placement"] == "layers 15-29 on cpu (reference), 0-14 on cpu (fast)" and rt["gpu_layers"] == 15
    assert rt["backend"] == "split" and rt["device"] == "cpu+cpu"
    assert format_runtime(rt).endswith(", layers 15-29 on cpu (reference), 0-14 on cpu (fast))")


def test_auto_picks_the_layers_that_fit_and_says_so(monkeypatch, capsys, tmp_path):
    """--device auto's glue (split.place) with the GPU's backend a stand-in named "cuda" and a made-up free
    memory: the largest N fit_gpu_layers gives for the model's own sizes, said on stderr; tokens as the reference's."""
    from pyllm.backends.reference import ReferenceBackend
    from pyllm.formats.checkpoint import read_gguf
    from pyllm.synthetic import write_tiny_llama

    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layer=4, n_embd=64, n_ff=128, n_head=4, n_kv_head=2,
                            n_vocab=320, n_ctx=128)

    class StandInGpu(ReferenceBackend):
        name = "cuda"

    ckpt = read_gguf(path)
    cfg = ckpt.config
    layers, other = model_bytes(ckpt.weights, cfg.n_layer)
    kv_layer = 2 * cfg.n_kv_head * cfg.head_dim * 2 * 64  # f16 K and V, 64 positions
    free = 256 * MIB + sum(layers[-3:]) + 3 * kv_layer + 1  # the headroom and exactly the last 3 layers
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    assert fit_gpu_layers(free, layers, other, kv_layer) == 3
    b = split.place(StandInGpu(), cfg, ckpt.weights, device="auto", kernels="fast", n_threads=None, gpu_layers=None,
                    n_ctx=64, kv_cache="f16", quiet=False)
    assert isinstance(b, SplitBackend) and b.n_high == 3
    err = capsys.readouterr().err
    assert "layers 1-3 on cuda, 0 on cpu (--gpu-layers 3; --gpu-layers chooses another split)" in err, err
    ckpt.close()
    # the same placement through pyllm.load (the CPU's kernels the reference too): the reference's logits
    monkeypatch.setattr("pyllm.backends.select", lambda *a, **k: StandInGpu())
    llm = pyllm.load(str(path), device="auto", kernels="reference", n_ctx=64, quiet=False)
    assert llm.info()["runtime"]["placement"] == "layers 1-3 on cpu (cuda), 0 on cpu (reference)"
    monkeypatch.undo()
    ref = pyllm.load(str(path), kernels="reference", n_ctx=64)
    ids = list(range(5, 15))
    assert torch.equal(llm.logits(ids), ref.logits(ids))


# ---- the command line -------------------------------------------------------------------------------------------
def test_ngl_runs_a_split_model_and_says_where(monkeypatch, capsys):
    same_layouts(monkeypatch)
    monkeypatch.setenv(split.STANDIN_VARIABLE, "fast")
    cli = cli_in_process(monkeypatch, capsys)
    split_run = cli("run", "smollm2-135m", "Once upon a time", "-n", "12", "--temp", "0", "-ngl", "15", "--json")
    assert split_run.returncode == 0, split_run.stderr
    import json

    out = json.loads(split_run.stdout)
    assert out["runtime"]["placement"] == "layers 15-29 on cpu (fast), 0-14 on cpu (fast)"
    plain = cpu_alone(monkeypatch, cli, "run", "smollm2-135m", "Once upon a time", "-n", "12", "--temp", "0",
                      "--json")
    assert json.loads(plain.stdout)["text"] == out["text"]


def same_layouts(monkeypatch):
    """Both runs of a comparison without the decode step's rows-by-8 copies: each backend makes them only where the
    machine's free memory allows at load, and they sum in another order than the loaded rows (SmolLM2's "Once upon a
    time" meets a near tie at its 5th token), so with them the texts could differ by what else ran on the machine."""
    monkeypatch.setenv("PYLLM_REPACK", "0")


def cpu_alone(monkeypatch, cli, *argv):
    """The command on the CPU alone: a split over two fast backends runs its decode rows through the same C++ step
    loop, so its greedy text is this one's."""
    with monkeypatch.context() as m:
        m.delenv(split.STANDIN_VARIABLE, raising=False)
        return cli(*argv, "--device", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a host without a GPU answers")
@pytest.mark.parametrize("command", [["run", "smollm2-135m", "hi"], ["chat", "smollm2-135m"],
                                     ["serve", "smollm2-135m", "--port", "0"],
                                     ["bench", "smollm2-135m", "-p", "4", "-n", "2", "-r", "1"]])
def test_ngl_without_a_gpu_is_one_error_naming_the_flag(monkeypatch, capsys, command):
    monkeypatch.delenv(split.STANDIN_VARIABLE, raising=False)
    res = cli_in_process(monkeypatch, capsys, b"hi")(*command, "-ngl", "12")
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("pyllm: error: -ngl 12: no GPU to put layers on here (") and \
        res.stderr.strip().endswith("use -ngl 0 (the CPU) or leave it out"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_readme_gpu_layers_example_runs_as_written(monkeypatch, capsys):
    """The README's block under "Models larger than the GPU", as written: its variable set, the run line gives the
    text of the same command on the CPU alone (greedy; the split's kernels and step loop are the CPU's own, so the
    bits are the same)."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("**Models larger than the GPU.**"):]
    line, = re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip().splitlines()
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words if "=" in w and w.startswith("PYLLM_"))
    assert env == {split.STANDIN_VARIABLE: "fast"} and words[len(env)] == "pyllm"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    same_layouts(monkeypatch)
    cli = cli_in_process(monkeypatch, capsys)
    res = cli(*words[len(env) + 1:])
    assert res.returncode == 0 and res.stdout.strip(), res.stderr
    plain = cpu_alone(monkeypatch, cli, *words[len(env) + 1:-2])
    assert words[-2:] == ["-ngl", "15"] and plain.returncode == 0 and plain.stdout == res.stdout


def test_split_cache_keeps_the_prefix_state_protocol(monkeypatch, tmp_path):
    """What server slots and the prompt cache do with a cache (runtime/batch.py): state_layout, prefix_state ->
    load_prefix_state into a fresh cache, copy_prefix_from; the rows come back bit for bit on each side, and a state
    from another layout is refused.  Reference: the source cache's own rows."""
    from pyllm.synthetic import write_tiny_llama

    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layer=4, n_embd=64, n_ff=128, n_head=4, n_kv_head=2,
                            n_vocab=320, n_ctx=128)
    monkeypatch.setenv(split.STANDIN_VARIABLE, "reference")
    llm = pyllm.load(str(path), kernels="reference", gpu_layers=2, n_ctx=64)
    m, kv = llm.model, llm.kv
    llm.logits(list(range(5, 25)))
    fresh = [m.backend.make_kv_cache(kv.kind, 4, kv.n_kv_head, 64, kv.head_dim) for _ in range(2)]
    assert all(isinstance(c, SplitKVCache) and c.state_layout() == kv.state_layout() for c in fresh)
    state = kv.prefix_state(16)
    assert {n.split(".")[0] for n in state} == {"low", "high"}
    fresh[0].load_prefix_state(state, 16)
    fresh[1].copy_prefix_from(kv, 16)
    for c in fresh:
        for i in range(4):
            assert all(torch.equal(a, b) for a, b in zip(c.view(i, 16), kv.view(i, 16))), i
    with pytest.raises(ValueError, match="missing"):
        fresh[0].load_prefix_state({k: v for k, v in state.items() if k.startswith("low.")}, 16)


def test_auto_on_a_stand_in_too_small_for_the_model_runs_the_layers_that_fit(monkeypatch, capsys):
    """--device auto with the stand-in GPU and a made-up free memory (PYLLM_GPU_STANDIN_FREE) room for exactly the
    last 10 of SmolLM2's layers and their cache at -c 512: -ngl 10, said on stderr, the placement in --json, and the
    greedy text of the CPU alone (two fast sides: the same bits)."""
    import json
    from pathlib import Path

    from pyllm.formats.checkpoint import read_gguf
    from pyllm.runtime.kv_cache import KVCache

    ckpt = read_gguf(Path(fixture_path("smollm2")))
    cfg = ckpt.config
    layers, _ = model_bytes(ckpt.weights, cfg.n_layer)
    ckpt.close()
    kv_layer = int(KVCache.bytes_per_token(1, cfg.n_kv_head, cfg.head_dim, "f16") * 512)
    free = 256 * MIB + sum(layers[-10:]) + 10 * kv_layer
    monkeypatch.setenv(split.STANDIN_VARIABLE, "fast")
    monkeypatch.setenv(split.STANDIN_FREE_VARIABLE, str(free))
    same_layouts(monkeypatch)
    cli = cli_in_process(monkeypatch, capsys)
    argv = ("run", "smollm2-135m", "Once upon a time", "-n", "8", "--temp", "0", "-c", "512", "--json")
    res = cli(*argv, "--device", "auto")
    assert res.returncode == 0, res.stderr
    assert ("GiB free: layers 20-29 on cpu (fast, standing in for the GPU), 0-19 on cpu (--gpu-layers 10; "
            "--gpu-layers chooses another split)") in res.stderr, res.stderr
    out = json.loads(res.stdout)
    assert out["runtime"]["placement"] == "layers 20-29 on cpu (fast), 0-19 on cpu (fast)"
    monkeypatch.setenv(split.STANDIN_FREE_VARIABLE, str(free - 1))  # a byte less: one layer less
    assert "layers 21-29 on cpu (fast, standing in" in cli(*argv, "--device", "auto").stderr
    plain = cpu_alone(monkeypatch, cli, *argv)
    assert json.loads(plain.stdout)["text"] == out["text"]


@pytest.mark.parametrize("text, want", [("512M", 512 * MIB), ("2G", 2 * GIB), ("2GiB", 2 * GIB), ("1000", 1000),
                                        ("64 kb", 64 << 10)])
def test_stand_in_free_memory_sizes(monkeypatch, text, want):
    monkeypatch.setenv(split.STANDIN_FREE_VARIABLE, text)
    assert split.standin_free() == want


def test_a_bad_stand_in_free_memory_is_one_error_naming_it(monkeypatch, capsys):
    monkeypatch.setenv(split.STANDIN_VARIABLE, "fast")
    monkeypatch.setenv(split.STANDIN_FREE_VARIABLE, "lots")
    res = cli_in_process(monkeypatch, capsys)("run", "smollm2-135m", "hi", "-n", "1", "--device", "auto")
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "PYLLM_GPU_STANDIN_FREE must be a size such as 512M, 2G or a byte count, got 'lots'" in res.stderr


@pytest.mark.parametrize("arch, n", [("qwen3", 1), ("qwen3", 2), ("gemma3", 3)])
def test_cuda_part_of_a_split_on_the_host(arch, n, monkeypatch):
    """The CUDA step over the GPU's run of layers (CudaBackend.fused_part), on the CPU with
    tests/test_cuda_backend_host.py's torch stand-ins for its kernels, chained with the CPU side's C++ step: decode
    logits against the same split's torch forward (the CPU side's matrices through the same row kernels, the GPU
    side's through the stand-ins' float32 products), within 5e-4 relative (test_cuda_backend_host's bound for the
    whole step over a float cache); k + 1 rows, which the CUDA part runs one at a time, equal one-token steps.
    The reference's GPU side starts each decode step from the hidden state the C++ side gave the CUDA part: the
    CPU side's two bodies differ in their last bits, and the row kernels' 8-bit activations can round one of those
    values to the next code (random prompts: 2 of 12 moved the logits 2.5e-3 and 5.2e-3), which is the CPU
    side's rounding, not the CUDA part's error (the CPU side's bodies are compared in tests/test_decode_step.py)."""
    from pyllm import backends
    from pyllm.backends import cuda as cb
    from pyllm.backends import cuda_step as cs
    from test_cuda_backend_host import FakeCudaBackend, TorchKernels
    from tiny_models import gguf_path

    monkeypatch.setattr(cs, "codes_value", lambda xq, xds: TorchKernels.rows(xq))
    monkeypatch.setenv("PYLLM_CUDA_GRAPH", "0")
    monkeypatch.setattr(backends, "select", lambda *a, **k: FakeCudaBackend())
    try:
        llm = pyllm.load(str(gguf_path(arch, "q8_0")), gpu_layers=n, n_ctx=64, kv_cache="f32")
        n_layer = llm.model.cfg.n_layer
        step = llm.model.fused_step(llm.kv)
        assert isinstance(step, split.SplitDecodeStep) and isinstance(step.high, cs.CudaDecodeStep)
        assert step.high.layers == range(n_layer - n, n_layer) and step.high.row_kernels_problem is None
        ids = [1, 17, 33, 5, 99, 42, 7, 250, 3, 11, 12, 200, 64, 3, 77, 150]
        seen = []  # the C++ side's hidden state for the GPU's first layer, each decode step
        low_hidden = step.low.hidden

        def hidden(tokens, pos):
            x = low_hidden(tokens, pos)
            seen.append(x.clone())
            return x

        monkeypatch.setattr(step.low, "hidden", hidden)
        got = prompt_then_decode(llm, ids, 10)
        monkeypatch.setattr(step.low, "hidden", low_hidden)
        first, enter, fed = n_layer - n, llm.model.enter_layer, iter(seen)

        def enter_layer(i, x):
            x = enter(i, x)
            return next(fed).to(x.device, x.dtype).view_as(x) if i == first and x.shape[0] == 1 else x

        llm.model.use_cpp_decode = False
        llm.model.enter_layer = enter_layer
        try:
            want = prompt_then_decode(llm, ids, 10)
        finally:
            del llm.model.enter_layer
        llm.model.use_cpp_decode = True
        assert len(seen) == len(ids) - 10 and next(fed, None) is None
        err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
        assert err <= 5e-4, f"{arch}: relative error {err:.3g}"
        llm.generator.reset()
        llm.generator._forward(ids[:10])
        rows, tops = step.rows_with_argmax(torch.tensor(ids[10:13]), 10)
        llm.generator.reset()
        llm.generator._forward(ids[:10])
        one = torch.stack([step.with_argmax(t, 10 + i)[0] for i, t in enumerate(ids[10:13])])
        assert torch.equal(rows, one) and list(tops) == one.argmax(-1).tolist()
    finally:
        TorchKernels.shadow.clear()
