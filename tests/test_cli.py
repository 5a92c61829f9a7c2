"""The CLI as a user meets it: subprocesses, exit codes, one-line errors without tracebacks."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import cli_in_process

gguf = pytest.importorskip("gguf")


def pyllm(*args, stdin=None, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "pyllm", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_clean_error(res, *needles):
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    err = res.stderr.strip()
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyllm: error:"), err
    for n in needles:
        assert n.lower() in err.lower(), (n, err)


def write_tiny_gguf(path, arch="llama", qtype=gguf.GGMLQuantizationType.F32):
    """A 1-layer model file with random weights (no tokenizer); enough to reach each loading check."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((100, 32), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((32, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_run_greedy(smollm2_path):
    res = pyllm("run", smollm2_path, "The capital of France is", "-n", "8", "--temp", "0")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_run_json_and_stdin(smollm2_path):
    res = pyllm("run", smollm2_path, "-n", "4", "--temp", "0", "--json", stdin="Hello")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["generated_tokens"] <= 4 and isinstance(out["text"], str)


def test_info(smollm2_path, qwen2_path):
    res = pyllm("info", smollm2_path)
    assert res.returncode == 0, res.stderr
    for needle in ("llama", "Q4_1", "Q8_0", "F32", "49152", "8192", "KV cache", "chat template"):
        assert needle in res.stdout, needle
    res = pyllm("info", qwen2_path, "--json")
    info = json.loads(res.stdout)
    assert info["architecture"] == "qwen2"
    assert set(info["tensor_types"]) == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert 6.0e8 < info["parameters"] < 6.6e8  # 494M + a separate (untied) 136M output head
    # 24 layers x 2 kv heads x 64 dims x 2 (K, V) x 2 bytes
    assert info["kv_bytes_per_token_f16"] == 24 * 2 * 64 * 2 * 2


@pytest.mark.parametrize("metadata, needles", [
    ({"tokenizer.ggml.bos_token_id": 99999}, ["vocabulary cannot be used", "bos_token_id = 99999 is out of range"]),
    ({"tokenizer.ggml.merges": ["ab"]}, ["vocabulary cannot be used", "merges[0] = 'ab' is not two tokens"]),
    ({"tokenizer.ggml.pre": "klingon"}, ["tokenizer.ggml.pre = 'klingon' is not supported"]),
    ({"tokenizer.chat_template": "{% for m in messages %}{{ m.content }"}, ["chat template", "syntax error",
                                                                           "--plain-template"]),
    ({"tokenizer.chat_template": "{{ ''.__class__ }}"}, ["chat template", "forbids", "--plain-template"]),
    ({"tokenizer.chat_template": "{{ raise_exception('no chat here') }}"}, ["no chat here"]),
])
def test_info_reports_a_broken_vocabulary_or_chat_template(tmp_path, monkeypatch, capsys, metadata, needles):
    """`pyllm info` described a file from its header and exited 0 although pyllm.load refuses its vocabulary or
    chat fails on its template. Reference: the errors load and chat give for the same hostile files (built as
    tests/test_robustness.py builds them); the description is still printed, and a sound file exits 0. In this
    process (test_info runs the command as a user does)."""
    from pyllm.synthetic import write_tiny_llama

    def tiny(name, md):
        return str(write_tiny_llama(tmp_path / f"{name}.gguf", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_kv_head=1,
                                    n_vocab=320, n_ctx=64, metadata=md))

    run = cli_in_process(monkeypatch, capsys)
    res = run("info", tiny("broken", metadata))
    assert_clean_error(res, "broken.gguf", *needles)
    assert "architecture:" in res.stdout
    res = run("info", tiny("broken", metadata), "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["problems"]
    res = run("info", tiny("sound", {}), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["problems"] == [], res.stderr


def test_list(smollm2_path):
    res = pyllm("list")
    assert res.returncode == 0
    assert "smollm2-135m" in res.stdout and "qwen2.5-coder-0.5b" in res.stdout


def test_chat_piped(smollm2_path):
    res = pyllm("chat", smollm2_path, "-n", "16", "--temp", "0", "--system", "You are a helpful assistant.",
                stdin="What is the capital of France?")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_missing_file():
    assert_clean_error(pyllm("run", "/nonexistent/model.gguf", "hi"), "/nonexistent/model.gguf")


def test_unknown_registry_name():
    assert_clean_error(pyllm("run", "no-such-model", "hi"), "no-such-model")


def test_directory(tmp_path):
    assert_clean_error(pyllm("run", str(tmp_path), "hi"), "directory")


def test_not_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, I am not a model\n" * 10)
    assert_clean_error(pyllm("run", str(p), "hi"), "GGUF")


def test_truncated_header(tmp_path, smollm2_path):
    p = tmp_path / "trunc_header.gguf"
    with open(smollm2_path, "rb") as f:
        p.write_bytes(f.read(4096))  # inside the metadata (the token list)
    assert_clean_error(pyllm("run", str(p), "hi"), "trunc")


def test_truncated_data(tmp_path):
    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = src.read_bytes()
    p = tmp_path / "trunc_data.gguf"
    p.write_bytes(data[:-1000])
    assert_clean_error(pyllm("run", str(p), "hi"), "trunc")


def test_unknown_architecture(tmp_path):
    p = write_tiny_gguf(tmp_path / "arch.gguf", arch="frobnicator")
    assert_clean_error(pyllm("run", str(p), "hi"), "frobnicator")


def test_unknown_block_type(tmp_path):
    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = bytearray(src.read_bytes())
    # the tensor info of token_embd: name, n_dims=2, dims (32, 100), then the u32 type id (F32 = 0)
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4 + 16
    assert int.from_bytes(data[at:at + 4], "little") == 0
    data[at:at + 4] = (77).to_bytes(4, "little")
    p = tmp_path / "badtype.gguf"
    p.write_bytes(bytes(data))
    assert_clean_error(pyllm("run", str(p), "hi"), "77")


def test_bad_flag_value_is_usage_error(smollm2_path):
    res = pyllm("run", smollm2_path, "hi", "-n", "many")
    assert res.returncode == 2 and "Traceback" not in res.stderr


@pytest.mark.parametrize("argv", [["info", ""], ["rm", ""], ["info", "  "], ["run", "", "hi"], ["bench", ""]])
def test_an_empty_model_name_is_named(argv, monkeypatch, capsys):
    """An empty MODEL is Path(""), the current directory, to a path check: `pyllm info ""` said ".: is a directory,
    not a model file" and `pyllm rm ""` ".: not in the cache". Reference: `pyllm run "" hi`, which names the empty
    argument; every command now does."""
    res = cli_in_process(monkeypatch, capsys)(*argv)
    assert_clean_error(res, "model must be a path to a model file, a registry name or a URL, got '")
    assert ".:" not in res.stderr


@pytest.mark.parametrize("argv, flag", [
    (["run", "smollm2-135m", "hi", "--kv", "q5"], "--kv"), (["run", "smollm2-135m", "hi", "-ctk", "q5"], "--kv-k/-ctk"),
    (["bench", "smollm2-135m", "-ctv", "q5"], "--kv-v/-ctv"), (["info", "smollm2-135m", "--kv", "q5"], "--kv"),
    (["perplexity", "smollm2-135m", "-f", "/dev/null", "--kv", "f16", "--kv", "q5"], "--kv"),
    (["perplexity", "smollm2-135m", "-f", "/dev/null", "--kl-base", "q5"], "--kl-base")])
def test_an_unknown_kv_type_names_its_flag(argv, flag, monkeypatch, capsys):
    """Reference: the cache's own message ("unknown KV cache type 'q5'; choose one of ..."), now after the flag
    that gave it, since one command line may give several (--kv, -ctk, -ctv, --kl-base); refused before the model
    loads (pyllm.load fails the test) or the text is read."""

    monkeypatch.setattr("pyllm.llm.load", lambda *a, **kw: pytest.fail("the model was loaded"))
    res = cli_in_process(monkeypatch, capsys)(*argv)
    assert_clean_error(res, f"pyllm: error: {flag}: unknown KV cache type 'q5'; choose one of")


@pytest.mark.parametrize("argv, stdin, where", [
    (["run", "smollm2-135m", "--chat"], b"", "standard input is empty"),
    (["run", "smollm2-135m", "-", "--system", "Be brief."], b"", "standard input is empty"),
    (["run", "smollm2-135m", "-n", "4"], b"", "standard input is empty"),
    (["run", "smollm2-135m", "", "--chat"], b"ignored", "the prompt argument is empty")])
def test_run_refuses_an_empty_prompt_before_loading(argv, stdin, where, monkeypatch, capsys):
    """`failing_command | pyllm run MODEL --chat` answered an empty message (the chat template's markup is a
    prompt) and exited 0; a raw empty prompt was refused only after the model loaded, as "empty prompt: give at
    least one token" without saying where it came from. Reference: `pyllm chat`, which refuses empty piped input
    before loading; run now does the same, naming the source."""

    monkeypatch.setattr("pyllm.llm.load", lambda *a, **kw: pytest.fail("the model was loaded"))
    res = cli_in_process(monkeypatch, capsys)(*argv, stdin=stdin)
    assert_clean_error(res, f"nothing to complete: {where}")


@pytest.mark.parametrize("argv, spec", [
    (["run", "smollm2-135m", "hi", "--spec", "none", "--draft", "smollm2-135m"], "none"),
    (["chat", "smollm2-135m", "--spec", "lookup", "--draft", "smollm2-135m"], "lookup"),
    (["bench", "smollm2-135m", "--draft", "smollm2-135m"], "not given"),
    (["serve", "smollm2-135m", "--spec", "lookup", "--draft", "smollm2-135m"], "lookup")])
def test_a_draft_model_that_would_go_unused_is_refused(argv, spec, monkeypatch, capsys):
    """--draft with --spec none or lookup (or, in bench, without --spec draft) loaded a second model and never used
    it. Reference: argparse's own conflicting-flag errors, a usage error (exit 2) naming --draft, before any model
    loads; --draft alone in run and chat still means --spec draft."""

    monkeypatch.setattr("pyllm.llm.load", lambda *a, **kw: pytest.fail("the model was loaded"))
    res = cli_in_process(monkeypatch, capsys)(*argv)
    assert res.returncode == 2, res.stderr
    assert f"argument --draft: only --spec draft uses a draft model, and --spec is {spec}" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("spec", [["--spec", "draft", "--draft", "smollm2-135m"], ["--draft", "smollm2-135m"]])
def test_serve_refuses_a_draft_model_its_parallel_slots_cannot_use(spec, monkeypatch, capsys):
    """`serve --parallel 4 --draft M` loaded a draft model that no request used: a draft model keeps one cache, and
    the slots of --parallel speculate by prompt lookup.  Reference: the --draft refusal above, a usage error (exit 2)
    naming the flag and the way out, before any model loads."""
    monkeypatch.setattr("pyllm.llm.load", lambda *a, **kw: pytest.fail("the model was loaded"))
    res = cli_in_process(monkeypatch, capsys)("serve", "smollm2-135m", "--parallel", "4", *spec)
    assert res.returncode == 2, res.stderr
    assert "argument --spec: a draft model drafts for one request at a time, and --parallel is 4" in res.stderr
    assert "--spec lookup, or --parallel 1" in res.stderr


def test_version():
    res = pyllm("--version")
    assert res.returncode == 0 and "pyllm" in res.stdout and "torch" in res.stdout


def test_run_context_policy(smollm2_path, monkeypatch, capsys):
    # a prompt longer than --ctx: "stop" (run's default) is a one-line error naming the fix; "shift" drops the
    # prompt's oldest tokens, says so, and generates
    run = cli_in_process(monkeypatch, capsys)
    prompt = "one two three four five six seven eight nine ten " * 4
    assert_clean_error(run("run", smollm2_path, prompt, "--ctx", "24", "-n", "4", "--temp", "0"),
                       "context", "--context-policy shift")
    res = run("run", smollm2_path, prompt, "--ctx", "24", "-n", "4", "--temp", "0", "--context-policy", "shift")
    assert res.returncode == 0, res.stderr
    assert "dropped its oldest" in res.stderr and res.stdout.strip()


def test_run_refuses_a_prompt_that_cannot_fit_before_tokenizing_it(smollm2_path):
    """Reference: --ctx 64 and the bound's wording ("at least"): 1 MB on standard input is refused from its bytes,
    not after seconds of tokenizing it."""
    res = pyllm("run", smollm2_path, "--ctx", "64", "-n", "1", stdin="word " * 200_000)
    assert_clean_error(res, "at least", "context holds 64")


def test_run_kv_types_per_part(smollm2_path):
    res = pyllm("run", smollm2_path, "The capital of France is", "-n", "6", "--temp", "0", "-ctk", "q8_0", "-ctv",
                "q4_rot")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert_clean_error(pyllm("run", smollm2_path, "Hi", "--kv", "q5_k"), "unknown KV cache type")


def test_bench_at_depth(smollm2_path):
    """-d D (llama-bench's depth): both tests start from D cached tokens and say so in their name."""
    res = pyllm("bench", smollm2_path, "-p", "8", "-n", "4", "-d", "40", "-r", "1", "-t", "1", "--kv", "q4_rot",
                "-o", "json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [r["test"] for r in rows] == ["pp8 @ d40", "tg4 @ d40"]
    assert all(r["n_depth"] == 40 and r["avg_ts"] > 0 and r["kv_type"] == "q4_rot" for r in rows)


def test_bench_rows_say_when_the_os_gives_no_huge_pages(smollm2_path, monkeypatch, capsys):
    """With transparent huge pages "never", bench's markdown rows name it beside the kernels (decode streams 4 KiB
    pages then) and its JSON rows carry huge_pages false; otherwise true and nothing in the row's text."""
    from pyllm import ops

    run = cli_in_process(monkeypatch, capsys)
    for mode, on in (("never", False), ("madvise", True)):
        monkeypatch.setattr(ops, "huge_pages_mode", lambda mode=mode: mode)
        for fmt in ("md", "json"):
            res = run("bench", smollm2_path, "-p", "0", "-n", "2", "-r", "1", "-t", "1", "-o", fmt)
            assert res.returncode == 0, res.stderr
            out = res.stdout
            if fmt == "json":
                assert [r["huge_pages"] for r in json.loads(out)] == [on], mode
            else:
                assert ("no huge pages" in out) != on, (mode, out)


@pytest.mark.parametrize("args, needle", [
    (["-r", str(10**21)], "argument -r/--repetitions: must be in [1, 1000], got 1000000000000000000000"),
    (["-r", "0"], "argument -r/--repetitions: must be in [1, 1000], got 0"),
    (["-p", str(1 << 21)], "argument -p/--n-prompt: must be in [0, 1048576]"),
    (["-n", str(10**12)], "argument -n/--n-gen: must be in [0, 1048576]"),
    (["-d", "-1"], "argument -d/--n-depth: must be in [0, 1048576], got -1"),
])
def test_bench_counts_are_bounded_before_anything_loads(capsys, args, needle):
    """Each bench count multiplies its run time (-r 10**21 ran as asked, i.e. forever) or sizes its KV cache.
    Reference: the ranges `pyllm bench --help` documents. Out of them is a usage error (exit 2, as for --ctx)
    naming the flag and the range, before the model (here a file that does not exist) is touched."""
    from pyllm.cli.main import build_parser, main

    assert main(["bench", "/nonexistent.gguf", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pyllm bench: error: {needle}") and err.count("\n") == 1 and "nonexistent" not in err, err
    usage = " ".join(build_parser()._subparsers._group_actions[0].choices["bench"].format_help().split())
    assert "1..1000" in usage and usage.count("0..1048576") == 3


@pytest.mark.parametrize("args, flag, value", [
    (["run", "m.gguf", "hi", "--temp", "abc"], "--temp", "'abc'"),
    (["run", "m.gguf", "hi", "-n", "x"], "-n/--max-tokens", "'x'"),
    (["run", "m.gguf", "hi", "--ctx", "1e9"], "--ctx/-c", "'1e9'"),
    (["run", "m.gguf", "hi", "--threads", "-3"], "--threads", "-3"),
    (["run", "m.gguf", "hi", "--seed", "abc"], "--seed", "'abc'"),
    (["run", "m.gguf", "hi", "--temp"], "--temp", "expected one argument"),
    (["chat", "m.gguf", "--top-p", "much"], "--top-p", "'much'"),
    (["chat", "m.gguf", "--spec-k", "two"], "--spec-k", "'two'"),
    (["chat", "m.gguf", "--ctx", "-5"], "--ctx", "-5"),
    (["serve", "m.gguf", "--port", "http"], "--port", "'http'"),
    (["serve", "m.gguf", "--port", "70000"], "--port", "70000"),
    (["serve", "m.gguf", "--parallel", "0"], "--parallel", "got 0"),
    (["serve", "m.gguf", "--replicas", "0"], "--replicas", "got 0"),
    (["serve", "m.gguf", "--kv-pool-tokens", "0"], "--kv-pool-tokens", "got 0"),
    (["serve", "m.gguf", "--max-body", "1MB"], "--max-body", "'1MB'"),
    (["serve", "m.gguf", "--max-body", "0"], "--max-body", "got 0"),
    (["info", "m.gguf", "--ctx", "4k"], "--ctx/-c", "'4k'"),
    (["info", "m.gguf", "--device", "tpu"], "--device", "'tpu'"),
    (["bench", "m.gguf", "-p", "x"], "-p/--n-prompt", "'x'"),
    (["bench", "m.gguf", "-r", "0"], "-r/--repetitions", "got 0"),
    (["perplexity", "m.gguf", "-f", "t.txt", "-c", "abc"], "-c/--ctx", "'abc'"),
    (["perplexity", "m.gguf", "-f", "t.txt", "--chunks", "0"], "--chunks", "got 0"),
    (["convert", "hf", "o.gguf", "--type", "q3"], "--type", "'q3'"),
    (["pull", "smollm2-135m", "--sha256"], "--sha256", "expected one argument"),
    (["run", "m.gguf", "hi", "--temp", "x" * 10_000], "--temp", "'xxx"),
    (["serve", "m.gguf", "--port", "'" + "x" * 10_000], "--port", "\"'xxx"),
])
def test_a_bad_flag_value_is_one_line_naming_the_flag(capsys, args, flag, value):
    """argparse printed its whole usage block (a dozen lines) above a value that does not parse, while a value out
    of range was one line, and serve's ranges were an exit-1 error of their own wording. Reference: argparse's own
    line, "pyllm CMD: error: argument FLAG: ...", alone, for both, exit 2 (a usage error), before anything loads,
    the value quoted at most 80 characters long."""
    from pyllm.cli.main import main

    try:
        rc = main(args)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2 and not out, (rc, out, err)
    assert err.count("\n") == 1 and "usage:" not in err and "Traceback" not in err, err
    assert err.startswith(f"pyllm {args[0]}: error: argument {flag}: ") and value in err, err
    assert len(err) < 200, err


@pytest.mark.parametrize("args", [
    ["pull", "Q" * 10_000], ["pull", "smollm2-135m", "--sha256", "Q" * 10_000], ["pull", "hf.co/" + "Q" * 10_000],
    ["run", "smollm2-135m", "hi", "--kv", "Q" * 10_000], ["run", "smollm2-135m", "hi", "--grammar", "Q" * 10_000],
    ["perplexity", "smollm2-135m", "-f", "Q" * 10_000], ["bench", "--synthetic", "Q" * 10_000],
    ["run", "smollm2-135m", "hi", "--device", "Q" * 10_000], ["run", "smollm2-135m", "hi", "Q" * 10_000],
], ids=["pull", "sha256", "hf-ref", "kv", "grammar", "perplexity-file", "synthetic", "device", "extra-argument"])
def test_errors_quote_a_bounded_prefix_of_a_long_argument(capsys, args):
    """A 10 KB name, path or value was echoed whole in the one-line error. Reference: at most 80 characters of
    it are quoted, cut with '…' (the helper errors.shorten), and the exit status says what failed."""
    from pyllm.cli.main import main

    try:
        rc = main(args)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc in (1, 2) and "error:" in err and "QQQ" in err and "…" in err, err
    assert max(len(w) for w in err.split()) <= 90, err


@pytest.mark.parametrize("args", [
    ["run", "Q" * 10_000, "hi"], ["info", "Q" * 10_000], ["rm", "Q" * 10_000], ["convert", "Q" * 10_000, "o.gguf"],
    ["run", "smollm2-135m", "hi", "--spec", "draft", "--draft", "Q" * 10_000], ["pull", "https://" + "Q" * 10_000],
], ids=["run", "info", "rm", "convert", "draft", "url-host"])
def test_a_name_the_system_refuses_is_a_one_line_error(capsys, args):
    """A pasted text given as a model, folder or host name raised OSError 'File name too long' (from
    Path.exists) or UnicodeError (IDNA: a host label over 63 characters) with a traceback. Reference: one line
    naming a bounded prefix of the name and the reason, exit 1."""
    from pyllm.cli.main import main

    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pyllm: error:") and "\n" not in err and "QQQ" in err and "…" in err, err
    assert "File name too long" in err or "not a valid host name" in err, err
    assert len(err) < 300, err


def test_bench_synthetic_refuses_a_kv_cache_larger_than_memory(capsys, monkeypatch):
    """-d/-p/-n within their bounds can still ask for a cache larger than memory (-d 1048576 on llama3-8b is
    128 GiB). Reference: pyllm.load's check (plan_kv_cache), which a model file gets; a synthetic model was built
    without it. Here memory is made to look small (32 MiB) so a 2048-token cache (45 MiB) does not fit."""
    from pyllm import llm_args
    from pyllm.cli.main import main

    monkeypatch.setattr(llm_args, "_available_memory", lambda: 32 << 20)
    assert main(["bench", "--synthetic", "smollm2-135m:q4_0", "-p", "0", "-n", "1", "-d", "2048", "-r", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pyllm: error: a f16 KV cache for n_ctx=2065 needs") and err.count("\n") == 1, err
    assert "smaller -d, -p or -n" in err and "--ctx" not in err, err  # bench has no --ctx to point at


# ---- run's own flags and edges -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_template_gguf(tmp_path_factory):
    """A tiny synthetic llama whose file has an empty chat template (what a base model's file looks like)."""
    from pyllm.synthetic import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("nt") / "base.gguf", n_ctx=64,
                                metadata={"tokenizer.chat_template": ""}))


def test_run_unknown_flag_prints_runs_usage(no_template_gguf):
    res = pyllm("run", no_template_gguf, "hi", "--frobnicate", "x")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "usage: pyllm run" in res.stderr and "pyllm run: error: unrecognized arguments: --frobnicate" in res.stderr


def test_a_long_bad_choice_is_quoted_short():
    """argparse quoted a 10 KB value whole in "invalid choice: '...'"; the error keeps 80 characters of it, and
    still names the argument and the choices."""
    long = "x" * 10_000
    for args, name in ((("bench", "-o", long), "-o/--output"), (("chat", "--context-policy", long),
                                                                "--context-policy"), ((long,), "COMMAND")):
        res = pyllm(*args)
        last = res.stderr.strip().splitlines()[-1]
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert f"argument {name}: invalid choice: 'xxx" in last and "(choose from" in last and len(last) < 400, last


def test_run_system_implies_chat_and_a_base_model_warns_once(no_template_gguf):
    res = pyllm("run", no_template_gguf, "hi", "--system", "Be brief.", "-n", "2", "--backend", "reference",
                "--ctx", "64", "--temp", "0")
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("has no chat template") == 1 and "plain fallback" in res.stderr
    res = pyllm("run", no_template_gguf, "hi", "-n", "2", "--backend", "reference", "--ctx", "64")
    assert res.returncode == 0 and "chat template" not in res.stderr  # raw completion: nothing to warn about


def test_run_reads_a_piped_prompt_and_dash(no_template_gguf):
    for args in ([], ["-"]):
        res = pyllm("run", no_template_gguf, *args, "-n", "2", "--backend", "reference", "--ctx", "64", "--json",
                    stdin="hello there")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["prompt_tokens"] > 1


def test_run_without_prompt_on_a_terminal_opens_the_chat(no_template_gguf, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm-256color",
               XDG_DATA_HOME=str(tmp_path))
    child = pexpect.spawn(sys.executable, ["-m", "pyllm", "run", no_template_gguf, "-n", "2", "--backend",
                                           "reference", "--ctx", "64"], env=env, cwd=str(tmp_path),
                          encoding="utf-8", codec_errors="replace", dimensions=(40, 200), timeout=180)
    try:
        child.expect_exact("Ctrl-D or /bye to quit")
        child.expect_exact(">>>")
        child.send("/bye\r")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_run_prompt_after_the_flags(no_template_gguf, monkeypatch, capsys):
    """Reference: the prompt right after the model. Flags may come before the prompt (as with llama.cpp's and
    Ollama's CLIs), and after `--` a prompt may start with '-'."""
    run = cli_in_process(monkeypatch, capsys)
    flags = ["-n", "3", "--temp", "0", "--backend", "reference", "--ctx", "64", "--json"]
    want = run("run", no_template_gguf, "hello there", *flags)
    assert want.returncode == 0, want.stderr
    want = json.loads(want.stdout)["text"]
    for args in ([*flags, "hello there"], [*flags[:4], "hello there", *flags[4:]], [*flags, "--", "hello there"]):
        res = run("run", no_template_gguf, *args)
        assert res.returncode == 0, (args, res.stderr)
        assert json.loads(res.stdout)["text"] == want, args
    res = run("run", no_template_gguf, *flags, "--", "-n 5")
    assert res.returncode == 0 and json.loads(res.stdout)["prompt_tokens"] > 1, res.stderr


@pytest.mark.parametrize("args, needle", [
    (["--spec-k", "0"], "--spec-k"), (["--spec-k", "100", "--temp", "0.8"], "--spec-k"),
    (["--spec-ngram", "0"], "--spec-ngram"), (["--spec", "none", "--spec-k", "-3"], "--spec-k"),
])
def test_speculation_flags_out_of_range_are_usage_errors(no_template_gguf, monkeypatch, capsys, args, needle):
    """Reference: the ranges in --help (--spec-k 1..7). Out of range is refused whether or not this run happens
    to speculate (sampling at temp 0.8 does not), before the model loads."""
    res = cli_in_process(monkeypatch, capsys)("run", no_template_gguf, "hi", "-n", "2", "--backend", "reference",
                                              "--ctx", "64", *args)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_prompt_and_schema_cannot_both_be_standard_input(no_template_gguf):
    """Reference: cmd_run's rule for a prompt read from standard input; '-' is the same standard input."""
    res = pyllm("run", no_template_gguf, "-", "--json-schema", "-", "-n", "2", stdin='{"type": "object"}')
    assert_clean_error(res, "standard input")


def _as_a_user_permissions_bind():
    """argv prefix that runs a command under file permissions. As root, which bypasses them, that is uid 65534
    through setpriv keeping only CAP_DAC_READ_SEARCH: it still reads this checkout, the Python install and the
    test's directories, but writes only where others may. Skips where setpriv cannot do that."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=+dac_read_search",
              "--ambient-caps=+dac_read_search"]
    try:
        ok = subprocess.run(prefix + [sys.executable, "-c", "import pyllm"], capture_output=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("running as root and setpriv cannot drop to a user that file permissions apply to")
    return prefix


@pytest.mark.parametrize("args", [["pull", "smollm2-135m"], ["run", "smollm2-135m", "hi", "-n", "1"],
                                  ["chat", "smollm2-135m"], ["serve", "smollm2-135m", "--port", "0"]])
def test_cache_dir_without_write_permission_is_a_clean_error(tmp_path, args):
    """Reference: README's PYLLM_CACHE_DIR, a directory pyllm writes models into. One the user may not write
    (here a directory of root's, or mode 0555 for a non-root test run) ended pull, run, chat and serve on a
    registry name in a PermissionError traceback; it is one line naming the directory and the way out."""
    prefix = _as_a_user_permissions_bind()
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o555)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYLLM_CACHE_DIR=str(cache), HOME=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    try:
        res = subprocess.run(prefix + [sys.executable, "-m", "pyllm", *args], capture_output=True, text=True,
                             timeout=300, env=env, input="hi\n", cwd=root)
    finally:
        cache.chmod(0o755)
    assert_clean_error(res, str(cache), "Permission denied", "PYLLM_CACHE_DIR")


def test_extension_build_in_a_cache_without_write_permission_names_it(tmp_path):
    """The compiled extension is cached there too: the build's PermissionError was reported as a failed compile
    with the errno as its "last lines". Reference: the directory and the way out, as for models."""
    prefix = _as_a_user_permissions_bind()
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o555)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYLLM_CACHE_DIR=str(cache), HOME=str(tmp_path),
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "from pyllm import PyllmError, _ext\ntry:\n    _ext.load()\nexcept PyllmError as e:\n    print(e)"
    try:
        res = subprocess.run(prefix + [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env=env, cwd=root)
    finally:
        cache.chmod(0o755)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("cannot build the C++ extension: " + str(cache / "ext")), res.stdout
    assert "PYLLM_CACHE_DIR" in res.stdout and "compiling" not in res.stdout


@pytest.mark.parametrize("cache,needles", [("/dev/null", ["PYLLM_CACHE_DIR=/dev/null", "not a directory"]),
                                           ("/proc/no-such-dir/cache", ["/proc/no-such-dir", "PYLLM_CACHE_DIR"])])
def test_a_cache_the_extension_cannot_be_built_in_is_an_error_not_slow_kernels(smollm2_path, cache, needles):
    """The extension is built into the cache: one that is not a directory or cannot be created printed its error
    and then ran a model file on the reference kernels, ten times slower, exiting 0. Reference: the rest of the
    CLI for a bad PYLLM_CACHE_DIR (one line naming it, exit 1), which the fall-back hid from the user."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYLLM_CACHE_DIR=cache)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PYLLM_NO_EXT", None)
    res = subprocess.run([sys.executable, "-m", "pyllm", "run", smollm2_path, "hi", "-n", "2"], capture_output=True,
                         text=True, timeout=300, env=env, cwd=root)
    assert_clean_error(res, *needles)
    assert res.stdout == "" and "slow" not in res.stderr


def test_a_read_only_cache_still_serves_a_model_that_checks_out(tmp_path, smollm2_path):
    """A cache the user may read but not write (shared, or another user's) holding a registry model: info reads
    it; the record of its sha256 cannot be written, so it is hashed each time instead of refused. Reference: the
    registry's sha256 of the file."""
    prefix = _as_a_user_permissions_bind()
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    held = cache / "models" / os.path.basename(smollm2_path)
    try:
        os.link(smollm2_path, held)
    except OSError:  # another file system
        shutil.copyfile(smollm2_path, held)
    for d in (cache / "models", cache):
        d.chmod(0o555)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYLLM_CACHE_DIR=str(cache), HOME=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    try:
        res = subprocess.run(prefix + [sys.executable, "-m", "pyllm", "info", "smollm2-135m"], capture_output=True,
                             text=True, timeout=300, env=env, cwd=root)
    finally:
        for d in (cache, cache / "models"):
            d.chmod(0o755)
    assert res.returncode == 0, res.stderr
    assert "49152" in res.stdout and not (cache / "verified").exists()


@pytest.mark.parametrize("args", [["pull", "smollm2-135m"], ["list"]])
def test_cache_dir_that_is_a_file_is_a_clean_error(tmp_path, args):
    """Reference: README's PYLLM_CACHE_DIR, a directory. Set to a file (or a path under one), every command that
    uses the cache says so in one line naming the variable, without a traceback."""
    f = tmp_path / "afile"
    f.write_text("x")
    for value in (f, f / "sub"):
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYLLM_CACHE_DIR=str(value))
        res = subprocess.run([sys.executable, "-m", "pyllm", *args], capture_output=True, text=True, timeout=120,
                             env=env)
        assert_clean_error(res, "PYLLM_CACHE_DIR", "not a directory")


def test_xdg_cache_home_is_checked_like_pyllm_cache_dir(tmp_path, monkeypatch):
    """XDG_CACHE_HOME set to a file is one error naming it (it was an errno naming a path the user never typed, and
    the extension fell back to the slow kernels); a relative value is ignored, as the XDG spec says."""
    from pyllm import registry
    from pyllm.errors import PyllmError

    f = tmp_path / "afile"
    f.write_text("x")
    monkeypatch.delenv("PYLLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(f))
    with pytest.raises(PyllmError, match=r"^XDG_CACHE_HOME=.*afile: not a directory"):
        registry.cache_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    assert registry.cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "pyllm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert registry.cache_dir() == tmp_path / "pyllm"
