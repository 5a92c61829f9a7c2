"""What the CLI shows while it works, and small things a first session meets: the first-use build's [n/m] progress,
bench rows printed as they are measured, `pyllm info`'s quantization label and its question before a download, the
random seed of a sample, GBNF errors in GBNF's terms, PYLLM_ISA naming a family this CPU lacks.

References: ninja's own [finished/total] status lines (a real ninja run on a two-step build file), llama-bench's
order (header, then each row when it is measured), llama.cpp's llama_ftype names for general.file_type, and the
replay contract of a seed (the same seed gives the same text).
"""

from __future__ import annotations

import io
import json
import re
import shutil
from types import SimpleNamespace

import pytest

from conftest import cli_in_process
from pyllm import _ext
from pyllm.errors import PyllmError

# ---- the first-use build ---------------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_build_progress_is_a_line_per_step_in_a_log_and_one_status_line_on_a_terminal():
    log = io.StringIO()
    p = _ext.BuildProgress(log)
    for line in ["[1/3] c++ -MMD -MF gemv.o.d -c /src/csrc/cpu/gemv.cpp -o gemv.o", "warning: unused variable",
                 "[2/3] c++ -c /src/csrc/cpu/gemv_avx512.cpp -o gemv_avx512.o",
                 "[3/3] c++ gemv.o gemv_avx512.o -shared -o pyllm_C.so"]:
        p.line(line)
    p.done(True)
    lines = log.getvalue().splitlines()
    assert [ln.split(",")[0] for ln in lines[:3]] == ["pyllm: compiling [1/3] gemv.cpp",
                                                      "pyllm: compiling [2/3] gemv_avx512.cpp",
                                                      "pyllm: compiling [3/3] pyllm_C.so"]
    assert all(ln.endswith(" s") for ln in lines[:3]) and lines[3].startswith("pyllm: compiled the C++ extension in ")
    tty = _Tty()
    p = _ext.BuildProgress(tty)
    p.line("[1/2] c++ -c /x/a.cpp -o a.o")
    p.show()  # a tick while the next file compiles
    p.line("[2/2] c++ a.o -o pyllm_C.so")
    p.done(True)
    text = tty.getvalue()
    assert text.count("\r\x1b[K") == 3 and text.count("\n") == 2 and "[2/2] pyllm_C.so" in text
    quiet = io.StringIO()
    p = _ext.BuildProgress(quiet)
    p.done(True)  # an up-to-date build ran no step: nothing to say
    assert quiet.getvalue() == ""


@pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja is a build requirement (pyproject.toml)")
def test_ninja_runs_with_progress_and_a_failure_keeps_its_output(tmp_path, capsys):
    (tmp_path / "build.ninja").write_text(
        "rule copy\n  command = cp $in $out\nrule fail\n  command = echo 'error: no such thing' && false\n"
        "build a.out: copy a.in\nbuild b.out: copy a.out\n")
    (tmp_path / "a.in").write_text("x")
    _ext.run_ninja_with_progress(str(tmp_path), False, "Error building extension")
    err = capsys.readouterr().err
    assert "pyllm: compiling [1/2] " in err and "pyllm: compiling [2/2] " in err and "compiled the C++" in err
    assert (tmp_path / "b.out").read_text() == "x"
    (tmp_path / "build.ninja").write_text("rule fail\n  command = echo 'error: no such thing' && false\n"
                                          "build c.out: fail a.in\n")
    with pytest.raises(RuntimeError, match="(?s)^Error building extension: .*error: no such thing"):
        _ext.run_ninja_with_progress(str(tmp_path), False, "Error building extension")
    assert "compiled" not in capsys.readouterr().err


def test_the_build_uses_the_progress_runner_and_puts_torchs_back(monkeypatch):
    from torch.utils import cpp_extension

    original = cpp_extension._run_ninja_build
    monkeypatch.delenv("PYLLM_VERBOSE_BUILD", raising=False)
    with _ext._build_progress():
        assert cpp_extension._run_ninja_build is _ext.run_ninja_with_progress
    assert cpp_extension._run_ninja_build is original
    monkeypatch.setenv("PYLLM_VERBOSE_BUILD", "1")  # the compiler's full output: torch's own runner
    with _ext._build_progress():
        assert cpp_extension._run_ninja_build is original


# ---- PYLLM_ISA --------------------------------------------------------------------------------------------------

def test_pyllm_isa_amx_without_amx_is_an_error(monkeypatch):
    """This machine may have AMX: the family list is what the extension reports (cpu_isa_available), so a module
    reporting a CPU without AMX stands in for one."""
    chosen = []
    no_amx = SimpleNamespace(available_isas=lambda: ["scalar", "avx2", "avx512"], set_isa=chosen.append)
    monkeypatch.setenv("PYLLM_ISA", "amx")
    with pytest.raises(_ext.IsaError, match=r"^PYLLM_ISA=amx: this CPU \(or its OS, or this build\) cannot run it; "
                                            r"available: scalar, avx2, avx512$"):
        _ext._apply_isa_env(no_amx)
    monkeypatch.setenv("PYLLM_ISA", "avx512")
    _ext._apply_isa_env(no_amx)
    assert chosen == ["avx512"]


def test_pyllm_rows8_pairs_env_sets_the_kernels_and_anything_else_is_an_error(monkeypatch):
    """PYLLM_ROWS8_PAIRS=0|1 reaches the extension's switch (a stand-in module records it); unset leaves the CPU's
    default; any other value is the IsaError the CLI prints as one line, not a value silently ignored."""
    chosen = []
    mod = SimpleNamespace(set_rows8_pairs=chosen.append)
    for value in ("0", "1", " 1 "):
        monkeypatch.setenv("PYLLM_ROWS8_PAIRS", value)
        _ext._apply_rows8_pairs_env(mod)
    monkeypatch.delenv("PYLLM_ROWS8_PAIRS")
    _ext._apply_rows8_pairs_env(mod)
    assert chosen == [False, True, True]
    monkeypatch.setenv("PYLLM_ROWS8_PAIRS", "yes")
    with pytest.raises(_ext.IsaError, match=r"^PYLLM_ROWS8_PAIRS=yes: expected 0 \(one 8-row group per register\) "
                                            r"or 1 \(two\)$"):
        _ext._apply_rows8_pairs_env(mod)
    assert chosen == [False, True, True]


# ---- bench ------------------------------------------------------------------------------------------------------

def test_bench_prints_the_header_then_each_row_as_it_is_measured(tmp_path, monkeypatch, capsys):
    from pyllm.cli import bench
    from pyllm.synthetic import write_tiny_llama

    model = str(write_tiny_llama(tmp_path / "tiny.gguf", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_kv_head=1,
                                 n_vocab=320, n_ctx=64))
    roof = dict(cpu="test cpu", threads=1, read_gbs=10.0, read_gbs_1t=5.0, matmul_gflops=100.0)
    monkeypatch.setattr("pyllm.roofline.probe", lambda threads, force=False: roof)
    seen_when_tg_ran = []
    time_tg = bench.time_tg

    def watched_tg(s, n, depth=0):
        seen_when_tg_ran.append(capsys.readouterr().out)
        return time_tg(s, n, depth)

    monkeypatch.setattr(bench, "time_tg", watched_tg)
    res = cli_in_process(monkeypatch, capsys)("bench", "-m", model, "-p", "4", "-n", "2", "-r", "1", "-t", "1",
                                              "--backend", "reference")
    assert res.returncode == 0, res.stderr
    before = seen_when_tg_ran[0]  # the warm-up run of tg: pp's row is already out
    assert before.startswith("roofline (test cpu, 1 threads)") and "| model |" in before
    assert "| pp4 |" in before and "tg2" not in before
    assert "| tg2 |" in res.stdout and "pp4" not in res.stdout


def test_bench_remeasures_a_roofline_a_run_read_faster_than(tmp_path, monkeypatch, capsys):
    """A roofline cached while the machine was busy (3.4 GB/s against 22.3 quiet, seen on a shared VM) made every
    share read 400-700% of BW. bench measures the bandwidth again: a higher figure replaces the cached one (and the
    rows' shares); a machine still busy gets the note naming the cached figure and how to re-measure it."""
    from pyllm.cli import bench
    from pyllm.synthetic import write_tiny_llama

    assert bench.stale_roofline_note([{"bw_share": 0.9}, {"gflops": 1.0}], {"read_gbs": 22.3}) is None
    model = str(write_tiny_llama(tmp_path / "tiny.gguf", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_kv_head=1,
                                 n_vocab=320, n_ctx=64))
    roof = dict(cpu="test cpu", threads=1, read_gbs=1e-6, read_gbs_1t=1e-6, matmul_gflops=100.0, date="2026-01-02")
    monkeypatch.setattr("pyllm.roofline.probe", lambda threads, force=False: roof)
    # the re-measurement finds nothing faster (a machine still busy): the note asks for a quiet probe
    monkeypatch.setattr("pyllm.roofline.measure_read_bandwidth", lambda threads, *a, **k: 1e3)
    run = cli_in_process(monkeypatch, capsys)
    res = run("bench", "-m", model, "-p", "4", "-n", "2", "-r", "1", "-t", "1")
    assert res.returncode == 0, res.stderr
    assert "of the cached read bandwidth" in res.stderr and "measured on 2026-01-02" in res.stderr
    assert "pyllm bench --probe" in res.stderr
    # it finds the bandwidth the run implies: the figure is replaced in the cache and the JSON rows use it
    monkeypatch.setattr("pyllm.roofline.cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr("pyllm.roofline.measure_read_bandwidth", lambda threads, *a, **k: 50e9)
    res = run("bench", "-m", model, "-p", "4", "-n", "2", "-r", "1", "-t", "1", "-o", "json")
    assert res.returncode == 0, res.stderr
    assert "re-measured now: 50.0 GB/s" in res.stderr
    tg = [r for r in json.loads(res.stdout) if r.get("bw_share") is not None]
    assert tg and all(abs(r["bw_share"] - r["gbs"] / 50.0) < 1e-12 for r in tg)
    from pyllm.roofline import _read_cache

    assert any(v.get("read_gbs") == 50.0 for v in _read_cache().values())


# ---- pyllm info ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("file_type, label", [(15, "Q4_K_M"), (7, "Q8_0"), (1, "F16"), (1024 + 18, "Q6_K (guessed)"),
                                              (999, None), (None, None)])
def test_info_names_the_quantization_from_general_file_type(tmp_path, monkeypatch, capsys, file_type, label):
    from pyllm.info import quantization_label

    assert quantization_label({} if file_type is None else {"general.file_type": file_type}) == label
    from pyllm.synthetic import write_tiny_llama

    write_tiny_llama(tmp_path / "m.gguf", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_kv_head=1, n_vocab=320,
                     n_ctx=64, metadata={} if file_type is None else {"general.file_type": file_type})
    from pyllm.formats.gguf import open_gguf
    from pyllm.info import format_info, model_info
    from pyllm.models.config import ModelConfig

    with open_gguf(tmp_path / "m.gguf") as gf:
        cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source="m.gguf")
        info = model_info(gf, cfg)
    assert info["quantization"] == label
    line = next(ln for ln in format_info(info).splitlines() if ln.startswith("quantization:"))
    assert line == f"quantization:    {label or 'not stated (no general.file_type; see the block types)'}"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PYLLM_CACHE_DIR", str(tmp_path / "cache"))
    pulls = []
    monkeypatch.setattr("pyllm.registry.pull", lambda name, **kw: pulls.append(name) or pytest.fail("downloaded"))
    return pulls


def test_info_of_a_model_not_downloaded_says_how_to_pull_it_when_it_cannot_ask(empty_cache, monkeypatch, capsys):
    res = cli_in_process(monkeypatch, capsys)("info", "smollm2-135m")
    assert res.returncode == 1 and empty_cache == []
    assert res.stderr.strip() == ("pyllm: error: smollm2-135m is not downloaded yet; `pyllm pull smollm2-135m` "
                                  "downloads it, then `pyllm info` describes it")


@pytest.mark.parametrize("answer, pulled", [("n\n", False), ("\n", False), ("y\n", True), ("yes\n", True)])
def test_info_asks_before_downloading_on_a_terminal(empty_cache, monkeypatch, capsys, answer, pulled):
    import sys

    monkeypatch.setattr(sys, "stdin", _Tty(answer))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    asked = []
    monkeypatch.setattr("pyllm.registry.resolve", lambda model, **kw: asked.append(model) or
                        (_ for _ in ()).throw(PyllmError("stand-in resolve: stopped here")))
    from pyllm.cli.main import main

    code = main(["info", "smollm2-135m"])
    err = capsys.readouterr().err
    assert "smollm2-135m is not downloaded yet (" in err and "MiB). Download it now? [y/N]" in err
    assert code == 1 and (asked == ["smollm2-135m"]) == pulled, err
    if not pulled:
        assert "not downloaded; `pyllm pull smollm2-135m` downloads it" in err


# ---- a sample's seed ------------------------------------------------------------------------------------------

def test_run_reports_its_random_seed_and_the_seed_replays_the_sample(smollm2_path, monkeypatch, capsys):
    cli = cli_in_process(monkeypatch, capsys)
    args = ("run", smollm2_path, "Once upon a time", "-n", "12", "--temp", "1.5", "-t", "1", "--ctx", "128")
    first = cli(*args, "--json")
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert isinstance(out["seed"], int) and 0 <= out["seed"] < 2**32
    again = cli(*args, "--json", "--seed", str(out["seed"]))
    assert json.loads(again.stdout)["text"] == out["text"]
    verbose = cli(*args, "-v", "--seed", str(out["seed"]))
    assert f"; seed {out['seed']}" in verbose.stderr and verbose.stdout.rstrip("\n") == out["text"]


def test_chat_verbose_reports_what_it_loaded(smollm2_path, monkeypatch, capsys):
    """`pyllm chat -v` says on stderr what it loaded and how: the file, the load time, the threads (chat.py
    _verbose_load, which reads the LLM's attributes)."""
    cli = cli_in_process(monkeypatch, capsys)
    r = cli("chat", smollm2_path, "-v", "-n", "4", "--temp", "0", "-t", "1", "--ctx", "128", stdin=b"Hi\n")
    assert r.returncode == 0, r.stderr
    assert re.search(r"loaded \S+\.gguf in \d+\.\d\ds: llama, weights .* 1 threads, peak RSS", r.stderr), r.stderr


# ---- grammars --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("grammar, message", [
    ("root ::= foo", "invalid grammar: Rule 'foo' not found"),
    ('root ::= "a" (', "invalid grammar: Expected ')' at line 1"),
    ('x ::= "a"', "invalid grammar: No 'root' rule found"),
    ('root := "a"', "invalid grammar: Expected ::= at line 1"),
])
def test_gbnf_errors_speak_gbnf(grammar, message):
    from pyllm.runtime.constraint import Constraint

    with pytest.raises(PyllmError) as e:
        Constraint.from_gbnf(grammar, None)
    assert str(e.value).startswith(message) and "lark" not in str(e.value).lower(), str(e.value)
