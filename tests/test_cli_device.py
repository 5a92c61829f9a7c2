"""`--device` on every command that runs a model, and where a model ran in what each command prints.

References: argparse's usage-error contract (exit 2, one line naming the flag and its choices); pyllm.load's own
keyword arguments, recorded by a stand-in for pyllm.load (the CLI maps no device value itself, it passes it
through); and the CPU kernel family reported by pyllm.ops.get_isa() for the runtime lines.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import pyllm
import pyllm.llm
from conftest import cli_in_process
from pyllm.cli.main import main
from pyllm.errors import PyllmError

# every subcommand that loads a model, with the arguments that get it as far as pyllm.load
COMMANDS = {
    "run": lambda m, f: ["run", m, "hello", "-n", "2"],
    "chat": lambda m, f: ["chat", m, "-n", "2"],
    "bench": lambda m, f: ["bench", m, "-p", "4", "-n", "2", "-r", "1"],
    "perplexity": lambda m, f: ["perplexity", m, "-f", f, "-c", "32"],
    "serve": lambda m, f: ["serve", m, "--port", "0"],
    "info": lambda m, f: ["info", m],
}


@pytest.fixture
def cli(monkeypatch, capsys):
    return cli_in_process(monkeypatch, capsys, b"hi")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pyllm.synthetic import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("device") / "tiny.gguf", n_layer=1, n_embd=32, n_ff=64,
                                n_head=2, n_kv_head=1, n_vocab=320, n_ctx=64))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("device") / "text.txt"
    p.write_text("the quick brown fox jumps over the lazy dog " * 20)
    return str(p)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_bad_device_is_a_usage_error_naming_the_choices(cli, command, tiny, text_file):
    res = cli(*COMMANDS[command](tiny, text_file), "--device", "gpu")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "--device" in line and "'gpu'" in line and all(c in line for c in ("cpu", "cuda", "auto")), line
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("device", ["cpu", "cuda", "auto", "cuda:1"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_device_reaches_pyllm_load_as_given(cli, monkeypatch, command, device, tiny, text_file):
    """The value goes to pyllm.load unchanged (no default of the CLI's own either: auto when not given); the
    stand-in refuses to load, and its error is what the user sees, in one line."""
    seen = []

    def fake_load(model, **kw):
        seen.append(kw.get("device"))
        raise PyllmError(f"stand-in load refused device {kw.get('device')!r}")

    monkeypatch.setattr(pyllm.llm, "load", fake_load)
    res = cli(*COMMANDS[command](tiny, text_file), "--device", device)
    assert seen == [device], (seen, res.stderr)
    assert res.returncode == 1 and res.stderr.strip() == f"pyllm: error: stand-in load refused device {device!r}"
    if command != "info":  # info describes the file from its header unless --device asks where it runs
        seen.clear()
        cli(*COMMANDS[command](tiny, text_file))
        assert seen == ["auto"]


def test_info_without_device_reads_only_the_header(cli, monkeypatch, tiny):
    def fake_load(model, **kw):
        raise AssertionError("info without --device loaded the model")

    monkeypatch.setattr(pyllm.llm, "load", fake_load)
    res = cli("info", tiny, "--json")
    assert res.returncode == 0, res.stderr
    assert "runtime" not in json.loads(res.stdout)


def _expected_cpu_runtime(backend: str) -> dict:
    from pyllm import ops

    rt = {"device": "cpu", "backend": backend}
    if backend == "fast":
        rt["isa"] = ops.get_isa()
    return rt


def _runtime_matches(rt: dict, backend: str) -> None:
    # the fields every backend's description has; a backend may add more (threads, GPU memory)
    want = _expected_cpu_runtime(backend)
    assert {k: rt.get(k) for k in want} == want, rt


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_run_json_and_info_json_say_where_the_model_ran(cli, tiny, backend):
    res = cli("run", tiny, "hello", "-n", "2", "--temp", "0", "--json", "--device", "cpu", "--backend", backend)
    assert res.returncode == 0, res.stderr
    _runtime_matches(json.loads(res.stdout)["runtime"], backend)
    res = cli("info", tiny, "--json", "--device", "cpu", "--backend", backend)
    assert res.returncode == 0, res.stderr
    _runtime_matches(json.loads(res.stdout)["runtime"], backend)
    res = cli("info", tiny, "--device", "cpu", "--backend", backend)
    assert "runs on:" in res.stdout and f"cpu ({backend}" in res.stdout, res.stdout


def test_device_auto_runs_and_says_where(cli, tiny):
    """--device auto runs on the CUDA backend where torch sees a GPU and the kernels build, else on the CPU, and
    --json says which; --device cuda without a GPU is one clear error naming why (exit 1, no traceback)."""
    import torch

    res = cli("run", tiny, "hello", "-n", "2", "--temp", "0", "--json", "--device", "auto")
    assert res.returncode == 0, res.stderr
    rt = json.loads(res.stdout)["runtime"]
    assert rt["device"] in (("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)), rt
    if not torch.cuda.is_available():
        res = cli("run", tiny, "hello", "-n", "2", "--device", "cuda")
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.startswith("pyllm: error: device 'cuda' is not available"), res.stderr


def test_bench_rows_say_where_they_ran(cli, tiny):
    res = cli("bench", tiny, "-p", "4", "-n", "2", "-r", "1", "-t", "1", "--device", "cpu", "-o", "json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    want = _expected_cpu_runtime("fast")
    assert rows and all(r["backends"] == "cpu" and r["isa"] == want["isa"] and r["gpu"] is None for r in rows)
    res = cli("bench", tiny, "-p", "0", "-n", "2", "-r", "1", "-t", "1", "--device", "cpu")
    assert f"| cpu (fast, {want['isa']}, kv f16) |" in res.stdout, res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_bench_synthetic_on_a_missing_gpu_says_why(cli):
    res = cli("bench", "--synthetic", "llama3-1b:q4_0", "-p", "4", "-n", "2", "-r", "1", "--device", "cuda")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("pyllm: error: device 'cuda' is not available"), res.stderr


def test_bench_synthetic_on_the_cuda_backend(cli, monkeypatch):
    """A synthetic model benchmarks on the CUDA backend (its host logic, torch stand-ins for the kernels): rows say
    where they ran, and tg's GB/s and pp's GFLOP/s are shares of the GPU's measured ceilings (copy bandwidth, fp16
    matmul), stood in here by fixed numbers."""
    from pyllm import backends
    from pyllm.backends import cuda as cb
    from test_cuda_backend_host import FakeCudaBackend

    monkeypatch.setenv("PYLLM_CUDA_GRAPH", "0")
    monkeypatch.setattr(backends, "select", lambda *a, **k: FakeCudaBackend())
    roof = {"gpu": "Stand-in GPU", "read_gbs": 4000.0, "matmul_gflops": 700000.0, "prefill_kernel": "fp16 cuBLAS"}
    monkeypatch.setattr(cb, "roofline", lambda device: dict(roof))
    res = cli("bench", "--synthetic", "smollm2-135m:q4_0", "-p", "4", "-n", "2", "-r", "1", "--device", "cuda",
              "-o", "json")
    assert res.returncode == 0, res.stderr
    pp, tg = json.loads(res.stdout)
    assert pp["test"] == "pp4" and tg["test"] == "tg2" and tg["backends"].startswith("cpu (CUDA backend logic")
    assert tg["bw_share"] == pytest.approx(tg["gbs"] / roof["read_gbs"])
    assert pp["flops_share"] == pytest.approx(pp["gflops"] / roof["matmul_gflops"])
    res = cli("bench", "--synthetic", "smollm2-135m:q4_0", "-p", "0", "-n", "2", "-r", "1", "--device", "cuda")
    assert res.returncode == 0 and "roofline (Stand-in GPU): copy 4000 GB/s" in res.stdout, res.stdout + res.stderr


def test_chat_banner_and_show_say_where_the_model_runs(monkeypatch, capsys, tiny):
    """The REPL's banner and /show name the device, the backend and the CPU kernels, from a real load."""
    from pyllm.cli import chat as chat_mod

    banners = []
    monkeypatch.setattr(chat_mod, "run_repl", lambda chat, banner: banners.append((chat, banner)) or 0)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert main(["chat", tiny, "--device", "cpu", "--ctx", "64"]) == 0
    (chat, banner), = banners
    isa = _expected_cpu_runtime("fast")["isa"]
    assert f"on cpu (fast, {isa} kernels)" in banner, banner
    capsys.readouterr()
    chat.handle("/show")  # the session writes to the terminal's stdout
    shown = capsys.readouterr().out
    assert f"runtime    cpu (fast, {isa} kernels)" in shown, shown
