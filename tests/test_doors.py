"""Bad bytes and values at every door other than the model file: argv, stdin, numeric flags of every subcommand,
library arguments, perplexity's text file, and the REPL's /load and /save.

Reference: each bad input ends in one line starting ``pyllm: error:`` (CLI; exit 2 for a bad flag, before any
model is loaded, so a nonexistent model is never what is reported) or a PyllmError (library), never a traceback,
and reads at most a bounded number of bytes (/dev/zero). Valid edge values (--seed -1 = random) are accepted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_in_process
from pyllm.errors import BadRequest, PyllmError

ROOT = str(Path(__file__).resolve().parent.parent)
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.fixture
def cli(monkeypatch, capsys):
    return cli_in_process(monkeypatch, capsys)


def assert_one_line_error(res, code, *needles):
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.strip().splitlines() if "error" in ln]
    # a usage error (exit 2) names its subcommand as argparse does: "pyllm run: error: argument --ctx: ..."
    head = ("pyllm: error:",) if code != 2 else tuple(f"pyllm {c}: error: argument " for c in
                                                      ("run", "chat", "bench", "info", "perplexity", "serve"))
    assert "Traceback" not in res.stderr and len(lines) == 1 and lines[0].startswith(head), res.stderr
    for n in needles:
        assert n in lines[0], (n, res.stderr)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pyllm.synthetic import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("doors") / "tiny.gguf", n_layer=1, n_embd=32, n_ff=64,
                                n_head=2, n_kv_head=1, n_vocab=320, n_ctx=64))


BAD_FLAGS = [
    (["run", "M", "hi", "--threads", "-1"], "--threads"),
    (["run", "M", "hi", "--threads", "0"], "--threads"),
    (["run", "M", "hi", "--threads", "10000"], "--threads"),
    (["chat", "M", "--threads", "10000"], "--threads"),
    (["bench", "M", "--threads", "-1"], "--threads"),
    (["bench", "M", "-t", "10000"], "--threads"),
    (["run", "M", "hi", "--seed", "-5"], "--seed"),
    (["run", "M", "hi", "--temp", "nan"], "--temp"),
    (["run", "M", "hi", "--temp", "inf"], "--temp"),
    (["run", "M", "hi", "--top-p", "0"], "--top-p"),
    (["run", "M", "hi", "--top-k", "-1"], "--top-k"),
    (["run", "M", "hi", "--min-p", "1"], "--min-p"),
    (["run", "M", "hi", "--repeat-penalty", "0"], "--repeat-penalty"),
    (["run", "M", "hi", "-n", "-2"], "--max-tokens"),
    (["chat", "M", "-n", "0"], "--max-tokens"),
    (["run", "M", "hi", "--ctx", "-1"], "--ctx"),
    (["run", "M", "hi", "--ctx", "1000000000"], "--ctx"),
    (["chat", "M", "--top-p", "nan"], "--top-p"),
    (["info", "M", "--ctx", "-3"], "--ctx"),
    (["perplexity", "M", "-f", "x", "-c", "4"], "--ctx"),
    (["perplexity", "M", "-f", "x", "--chunks", "0"], "--chunks"),
    (["perplexity", "M", "-f", "x", "-t", "-2"], "--threads"),
]


@pytest.mark.parametrize("args, flag", BAD_FLAGS)
def test_numeric_flags_are_checked_before_loading(cli, args, flag):
    args = [("/nonexistent.gguf" if a == "M" else a) for a in args]
    res = cli(*args, stdin=b"hi")
    assert_one_line_error(res, 2, flag)
    assert "nonexistent" not in res.stderr


def test_seed_minus_one_is_random_on_run(cli, tiny):
    res = cli("run", tiny, "hello", "-n", "3", "--seed", "-1", "--temp", "0.8")
    assert res.returncode == 0, res.stderr


def test_max_tokens_minus_one_runs_until_the_context_is_full(cli, tiny):
    """-n -1 is llama.cpp's "until the context is full" (and the library's max_tokens=-1); run and chat refused it
    as below 1. Reference: the tiny model at temperature 0 writes no end-of-generation id within 64 tokens, so the
    reply stops only when prompt and reply fill the context (the last token is not cached: n_ctx + 1)."""
    res = cli("run", tiny, "hello", "-n", "-1", "--ctx", "64", "--temp", "0", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["finish_reason"] == "context" and out["prompt_tokens"] + out["generated_tokens"] == 64 + 1, out
    res = cli("chat", tiny, "-n", "-1", "--ctx", "64", "--temp", "0", stdin=b"hi\n/set max_tokens -1\nhello\n")
    assert res.returncode == 0 and "error" not in res.stderr, res.stderr


def test_seed_random_is_accepted_where_the_error_offers_it(cli, tiny):
    """A bad --seed is refused with "seed must be an integer >= 0, or 'random'", and /set seed random works, but
    argparse parsed --seed as a plain int and refused "random" itself. Reference: the REPL's own seed rule
    (parse_setting): the words it takes are accepted on run and chat, and a non-integer is a one-flag error."""
    from pyllm.cli.common import parse_setting

    for word in ("random", "Random", "none", "off"):
        assert parse_setting("seed", word) == ("seed", None)
        res = cli("run", tiny, "hello", "-n", "2", "--seed", word, "--temp", "0.8")
        assert res.returncode == 0, res.stderr
    res = cli("chat", tiny, "-n", "2", "--seed", "random", stdin=b"hello")
    assert res.returncode == 0, res.stderr
    for bad in ("abc", "1.5"):
        res = cli("run", "/nonexistent.gguf", "hello", "--seed", bad)
        assert res.returncode == 2 and "argument --seed: seed must be an integer >= 0, or 'random'" in res.stderr
        assert "Traceback" not in res.stderr and "nonexistent" not in res.stderr


def test_serve_refuses_an_empty_api_key(cli, monkeypatch):
    """pyllm serve --api-key "" (what --api-key "$KEY" gives when KEY is unset) started a server that answered
    every client without a key, silently. Now it is a one-line error naming --api-key, before the model loads
    or the port opens; an empty $PYLLM_API_KEY still counts as unset. Reference: the one-line error convention
    of this file; the key rule read directly from api_key_from_args."""
    from types import SimpleNamespace

    pytest.importorskip("uvicorn")
    for key in ("", "  "):
        res = cli("serve", "/nonexistent.gguf", "--api-key", key, "--port", "0")
        assert_one_line_error(res, 1, "--api-key is empty")
        assert "nonexistent" not in res.stderr
    from pyllm.cli.main import api_key_from_args

    monkeypatch.setenv("PYLLM_API_KEY", "")
    assert api_key_from_args(SimpleNamespace(api_key=None)) is None
    monkeypatch.setenv("PYLLM_API_KEY", "k1")
    assert api_key_from_args(SimpleNamespace(api_key=None)) == "k1"
    assert api_key_from_args(SimpleNamespace(api_key="k2")) == "k2"


def test_bench_checks_every_synthetic_spec_before_measuring(cli, tiny, monkeypatch):
    """pyllm bench MODEL --synthetic typo measured MODEL (minutes for a big one) and only then said the synthetic
    spec was unknown. Every spec is now checked first: the error comes with nothing loaded. Reference: the
    one-line error convention of this file; a loader that fails the test if it is reached."""
    from pyllm.cli import bench

    monkeypatch.setattr(bench, "load_subject", lambda *a, **k: pytest.fail("a model was loaded"))
    for spec, needle in (("nope:q4_0", "unknown synthetic shape 'nope'"),
                         ("llama3-8b:q9", "unknown synthetic file type 'q9'")):
        res = cli("bench", tiny, "--synthetic", "smollm2-135m:q4_0", "--synthetic", spec, "-p", "1", "-n", "1",
                  "-r", "1")
        assert_one_line_error(res, 1, needle)


def test_non_utf8_prompt_on_stdin_and_argv(cli, tiny):
    res = cli("run", tiny, "-n", "2", "--temp", "0", stdin=b"caf\xe9 \xff\xfe ok")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "not valid UTF-8" in res.stderr
    # argv: Python hands undecodable bytes over as lone surrogates (surrogateescape)
    res = cli("run", tiny, os.fsdecode(b"caf\xe9 \xff"), "-n", "2", "--temp", "0")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr


def test_non_utf8_prompt_in_a_real_process(tiny):
    # the real argv and stdin paths (no monkeypatching): bytes that are not UTF-8 on both
    for args, stdin in (([b"caf\xe9 \xff"], b""), ([], b"\xff\xfe\x00 text")):
        res = subprocess.run([sys.executable, "-m", "pyllm", "run", tiny, *args, "-n", "2", "--temp", "0"],
                             input=stdin, capture_output=True, env=ENV, timeout=300)
        assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr


def test_chat_piped_non_utf8(cli, tiny):
    res = cli("chat", tiny, "-n", "2", "--temp", "0", stdin=b"\xff\xfe hello")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr


def test_perplexity_reads_a_bounded_amount(cli, tmp_path, monkeypatch):
    import pyllm.perplexity as ppl

    monkeypatch.setattr(ppl, "MAX_TEXT_BYTES", 1 << 20)
    res = cli("perplexity", "/nonexistent.gguf", "-f", "/dev/zero")
    assert_one_line_error(res, 1, "/dev/zero", "MiB")
    assert_one_line_error(cli("perplexity", "/nonexistent.gguf", "-f", str(tmp_path / "no.txt")), 1, "no.txt")


def test_library_arguments(tiny):
    import pyllm

    llm = pyllm.load(tiny, n_ctx=32, kernels="reference")
    for bad in (float("nan"), "x", -2, 2.5, True):  # -1 (and None): until the context is full
        with pytest.raises(PyllmError, match="max_tokens"):
            llm.generate("hi", max_tokens=bad)
    with pytest.raises(PyllmError, match="seed"):
        llm.generate("hi", max_tokens=2, seed=-5)
    for name, bad in (("temperature", float("nan")), ("temperature", "hot"), ("top_p", None), ("top_k", 1.5),
                      ("min_p", float("inf")), ("repeat_penalty", "x"), ("temperature", 10**400)):
        with pytest.raises(PyllmError, match=name):
            llm.generate("hi", max_tokens=2, **{name: bad})
    with pytest.raises(PyllmError, match="max_tokens"):
        llm.chat([{"role": "user", "content": "hi"}], max_tokens=float("nan"))
    with pytest.raises(PyllmError, match="stop"):
        llm.generate("hi", max_tokens=2, stop=["x", 5])
    # seed -1 is random; a lone surrogate in the prompt is a replacement character, not a crash
    assert isinstance(llm.generate("hi\udcff", max_tokens=2, seed=-1), str)
    assert llm.tokenize("a\ud800b") == llm.tokenize("a\ufffdb")


def test_unknown_generation_keywords_are_named_when_the_call_is_made(tiny):
    """A misspelled or foreign keyword (max_new_tokens, logprobs) reached SamplerSettings and came out as a
    TypeError about SamplerSettings.__init__, and with stream=True only at the first next(). Now generate, chat
    and generate_tokens refuse it with a PyllmError naming it at the call. Reference: the documented contract
    that every error caused by input is a PyllmError naming the value; the valid keywords still work."""
    import pyllm

    llm = pyllm.load(tiny, n_ctx=32, kernels="reference")
    msgs = [{"role": "user", "content": "hi"}]
    for bad in ("max_new_tokens", "logprobs", "n_predict"):
        for call in (lambda: llm.generate("hi", max_tokens=2, stream=True, **{bad: 1}),
                     lambda: llm.chat(msgs, max_tokens=2, stream=True, **{bad: 1}),
                     lambda: llm.generate_tokens([1, 2], max_tokens=2, **{bad: 1})):
            with pytest.raises(PyllmError, match=f"unknown argument '{bad}'"):
                next(iter(call()))  # a generator raises on its first next(); generate/chat before it
        with pytest.raises(PyllmError, match=f"unknown argument '{bad}'"):
            llm.generate("hi", max_tokens=2, stream=True, **{bad: 1})
    out = llm.generate("hi", max_tokens=2, temperature=0, typical_p=0.9, repeat_penalty=1.1, penalty_last_n=8,
                       frequency_penalty=0.1, presence_penalty=0.1, logit_bias={3: 1.0}, seed=1,
                       speculative="none")
    assert isinstance(out, str)


def test_chat_checks_stop_as_generate_does(tiny):
    """llm.chat took stop unchecked: a bare string was iterated into one-character stop strings (stop="END" ended
    the reply at its first "E", "N" or "D"), and a list holding a non-string was a TypeError from inside the
    stop matcher. One stop_list now serves generate, chat and the OpenAI API: a bare string is one stop string
    (as OpenAI and llama-cpp-python read it), and anything else but a list or tuple of strings is refused with
    the same PyllmError, before anything is generated, streamed or not."""
    import pyllm

    llm = pyllm.load(tiny, n_ctx=32, kernels="reference")
    msgs = [{"role": "user", "content": "hi"}]
    for bad in (["x", 5], 5, b"x", {"x": 1}):
        for stream in (False, True):
            with pytest.raises(PyllmError, match="stop must be a string or a list of strings") as e:
                llm.chat(msgs, max_tokens=2, stop=bad, stream=stream)
            with pytest.raises(PyllmError) as g:
                llm.generate("hi", max_tokens=2, stop=bad, stream=stream)
            assert str(e.value) == str(g.value)
    for ok in (["x"], ("x",), [], None, "x"):
        assert isinstance(llm.chat(msgs, max_tokens=2, stop=ok, temperature=0), str)


def test_max_tokens_none_or_minus_one_runs_until_the_context_is_full(tiny):
    """llama-cpp-python and this library's create_completion take max_tokens None or -1 as "until the context is
    full"; generate, chat and generate_tokens refused both ("must be an integer"). Reference: n_ctx=32 with the
    end-of-generation ids biased away, so the reply can only stop at the context: prompt + reply fill all 32."""
    import pyllm

    llm = pyllm.load(tiny, n_ctx=32, kernels="reference")
    no_end = {t: -100.0 for t in llm.tokenizer.eog_ids}
    msgs = [{"role": "user", "content": "hi"}]
    for max_tokens in (None, -1):
        llm.generate("hi", max_tokens=max_tokens, temperature=0, logit_bias=no_end)
        assert llm.stats.finish_reason == "context"
        assert llm.stats.prompt_tokens + llm.stats.generated_tokens == 32 + 1  # the last token is not cached
        llm.chat(msgs, max_tokens=max_tokens, temperature=0, logit_bias=no_end)
        assert llm.stats.finish_reason == "context"
        out = list(llm.generate_tokens([1, 2], max_tokens=max_tokens, temperature=0, logit_bias=no_end))
        assert len(out) == 32 - 2 + 1
    for bad in (-2, 1.5, "8", True):
        with pytest.raises(PyllmError, match="max_tokens must be an integer >= 0, or None/-1"):
            llm.generate("hi", max_tokens=bad)


def test_generate_tokens_checks_its_arguments_when_called(tiny):
    """generate_tokens was a generator function, so a bad argument raised only at the iterator's first next(),
    far from the call that gave it. Reference: generate(stream=True), which raises at the call; generate_tokens
    now does too, and its iterator still holds the LLM only from its first next() (a call in between runs)."""
    import pyllm

    llm = pyllm.load(tiny, n_ctx=32, kernels="reference")
    for kw in ({"max_tokens": -5}, {"temperature": "hot"}, {"max_new_tokens": 3}, {"speculative": "bogus"}):
        with pytest.raises(PyllmError):
            llm.generate_tokens([1, 2], **{"max_tokens": 2, **kw})
    with pytest.raises(PyllmError, match="outside the vocabulary"):
        llm.generate_tokens([1, 10**6], max_tokens=2)
    it = llm.generate_tokens([1, 2], max_tokens=3, temperature=0)
    want = llm.generate([1, 2], max_tokens=3, temperature=0)  # not superseding: the iterator has not started
    assert llm.detokenize(list(it)) == want


def test_logit_bias_is_checked_as_create_completion_checks_it(tiny):
    """generate's logit_bias went to the sampler unchecked: {"a": 1} was a TypeError and a list an AttributeError
    (neither a PyllmError), an id past the vocabulary or a NaN bias was taken silently. Reference:
    create_completion's checks (BadRequest naming logit_bias: token ids in the vocabulary, biases in [-100, 100]),
    at the call; a valid bias still changes the greedy choice."""
    import pyllm

    llm = pyllm.load(tiny, n_ctx=32, kernels="reference")
    for bad, needle in (({"a": 1}, "key 'a' is not a token id"), ([1, 2], "must be an object"),
                        ({10**6: 1}, "outside the vocabulary"), ({1: float("nan")}, "must be in \\[-100, 100\\]"),
                        ({1: 1000}, "must be in \\[-100, 100\\]")):
        for call in (lambda: llm.generate("hi", max_tokens=2, stream=True, logit_bias=bad),
                     lambda: llm.chat([{"role": "user", "content": "hi"}], max_tokens=2, logit_bias=bad),
                     lambda: llm.generate_tokens([1, 2], max_tokens=2, logit_bias=bad)):
            with pytest.raises(BadRequest, match=needle) as e:
                call()
            assert e.value.param == "logit_bias"
    first = list(llm.generate_tokens([1, 2], max_tokens=1, temperature=0))[0]
    other = (first + 1) % llm.n_vocab
    assert list(llm.generate_tokens([1, 2], max_tokens=1, temperature=0, logit_bias={other: 100.0})) == [other]
