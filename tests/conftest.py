"""Shared fixtures: the real fixture models (fetched once into the user cache) and the transformers oracle.

The oracle objects are expensive (transformers dequantizes a whole GGUF to float32), so each is built once per
session and shared by every test that needs it.
"""

import contextlib
import functools
import os
import signal
from pathlib import Path

import pytest

from pyllm import registry

# A shell starts a background job (`pytest -q &` in a script) with SIGINT ignored, and Python then installs no
# KeyboardInterrupt handler; the Ctrl-C tests (in this process, and in the REPLs they spawn, which inherit the
# disposition) would fail for the way pytest was launched.  Ctrl-C is what they test, so give it back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

FIXTURES = {"smollm2": "smollm2-135m", "qwen2": "qwen2.5-coder-0.5b", "gemma3": "gemma3-270m"}


@pytest.fixture(scope="session")
def _machine_threads() -> int:
    import torch

    return torch.get_num_threads()  # before any test: the default, one per physical core (as pyllm.ops' default)


@pytest.fixture(autouse=True)
def _threads_restored(_machine_threads):
    """Each test starts on the machine's default thread count, torch's and the kernels'.  Loading a model with
    n_threads sets both for the whole process, and the models of pyllm_model are loaded once and shared: without
    this, every test after one that loaded a model with n_threads=1 ran on one thread, whichever model it used."""
    import sys

    import torch

    if torch.get_num_threads() != _machine_threads:
        torch.set_num_threads(_machine_threads)
    ops = sys.modules.get("pyllm.ops")
    if ops is not None and not isinstance(ops._C, ops._LazyExtension) and ops.get_num_threads() != _machine_threads:
        ops.set_num_threads(_machine_threads)  # only once the extension is loaded: a test may mean to load it
    yield


@functools.lru_cache(maxsize=None)
def fixture_path(key: str) -> str:
    return str(registry.pull(FIXTURES[key], quiet=True))


@pytest.fixture(scope="session")
def smollm2_path():
    return fixture_path("smollm2")


@pytest.fixture(scope="session")
def qwen2_path():
    return fixture_path("qwen2")


@pytest.fixture(scope="session")
def gemma3_path():
    return fixture_path("gemma3")


@contextlib.contextmanager
def _one_gguf_reader():
    """Within the block, gguf-py's GGUFReader gives one reader per file: transformers parses a GGUF once for the
    config, once for the weights and once for the tokenizer, and each parse walks every vocabulary entry in Python
    (5-17 s a fixture).  The reader is only read (its tensors are views of the mapped file), so sharing it changes
    nothing transformers computes."""
    import gguf

    cls = gguf.GGUFReader
    readers = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = cls(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = cls


def _hf_tokenizer_from(d):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(d)


def _save_model(m, d: Path) -> None:
    # save_pretrained refuses a model converted from GGUF (its config still names the gguf quantizer): the weights
    # go to safetensors (save_model keeps one copy of tied tensors) and the config without the quantizer.
    import json

    from safetensors.torch import save_model

    save_model(m, str(d / "model.safetensors"))
    cfg = m.config.to_dict()
    cfg.pop("quantization_config", None)
    (d / "config.json").write_text(json.dumps(cfg))


def _load_model(d: Path):
    import torch
    import transformers

    m, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, output_loading_info=True)
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):  # else: random weights
        raise ValueError(f"the saved conversion in {d} does not fit the model: {info}")
    return m


def _convert(what: str, path: str):
    import torch
    import transformers

    auto = transformers.AutoTokenizer if what == "tokenizer" else transformers.AutoModelForCausalLM
    kw = {} if what == "tokenizer" else {"dtype": torch.float32}
    return auto.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), **kw)


# what -> (save, load) of transformers' object in the oracle cache
_ORACLE_IO = {"tokenizer": (lambda t, d: t.save_pretrained(d), _hf_tokenizer_from),
              "model": (_save_model, _load_model)}


def _oracle_dir(key: str, what: str) -> Path:
    import torch
    import transformers

    sha = registry.REGISTRY[FIXTURES[key]].sha256
    return (registry.cache_dir() / "hf-oracle" / f"{key}-{sha[:16]}-tf{transformers.__version__}-torch{torch.__version__}"
            / what)


def _convert_and_keep(key: str, what: str):
    import shutil
    import tempfile

    obj = _convert(what, fixture_path(key))
    d = _oracle_dir(key, what)
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{what}-", dir=d.parent))
    try:
        _ORACLE_IO[what][0](obj, tmp)
        tmp.rename(d)
    except (OSError, ValueError, RuntimeError):
        # another process won the race, the disk is full, or this transformers refuses to save the object (as its
        # save_pretrained refuses GGUF-converted models): the conversion in memory still serves
        shutil.rmtree(tmp, ignore_errors=True)
    return obj


def _converted(key: str, what: str):
    """transformers' conversion of fixture ``key``'s GGUF (``what``: "model" or "tokenizer"), kept under the user
    cache: converting a GGUF takes transformers 7-60 s per model and per object (its gguf reader walks every
    tensor and vocabulary entry in Python), loading the saved conversion 0.2-5 s.  The directory is named by the
    GGUF's sha256 and the transformers and torch versions, so any change to the file or the converter converts
    anew; it is written under a temporary name and renamed, so a half-written one is never read.  The other object
    is converted in the same pass when it is not kept yet, so the file is parsed once for both.  The oracle stays
    transformers' own objects: its conversion, saved and loaded back bit for bit (tests/test_model.py's logits and
    tests/test_tokenizer.py's ids are compared against it either way)."""
    import shutil

    d = _oracle_dir(key, what)
    if d.is_dir():
        try:
            return _ORACLE_IO[what][1](d)
        except (OSError, ValueError, RuntimeError):  # unreadable: convert again below
            shutil.rmtree(d, ignore_errors=True)
    other = "model" if what == "tokenizer" else "tokenizer"
    with _one_gguf_reader():
        obj = _convert_and_keep(key, what)
        if not _oracle_dir(key, other).is_dir():
            _convert_and_keep(key, other)
    return obj


@functools.lru_cache(maxsize=None)
def hf_tokenizer(key: str):
    """transformers' tokenizer converted from the GGUF (the oracle for tokenization and chat templates)."""
    pytest.importorskip("transformers")
    return _converted(key, "tokenizer")


@functools.lru_cache(maxsize=None)
def hf_model(key: str):
    """transformers' float32 model dequantized from the GGUF (the oracle for logits)."""
    pytest.importorskip("transformers")
    m = _converted(key, "model")
    m.eval()
    return m


@functools.lru_cache(maxsize=None)
def pyllm_model(key: str, **kw):
    """One pyllm.LLM per fixture and settings, shared across tests (loading is cheap, but not free)."""
    import pyllm

    return pyllm.load(fixture_path(key), **kw)


# ------------------------------------------------------------------ AWQ checkpoints from real writers (cached)
def _tool(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"pyllm_tools_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def autoawq_fixtures():
    """Folder of checkpoints and packed layers written by AutoAWQ 0.2.9 (tools/autoawq_fixture.py) in its own venv
    (transformers 4.51.3), both built once per machine under the pyllm cache. Skips when the venv cannot be built."""
    aw = _tool("autoawq_fixture")
    try:
        return aw.cached_fixtures()
    except aw.VenvUnavailable as e:
        pytest.skip(f"AutoAWQ 0.2.9 venv unavailable: {e}")


@pytest.fixture(scope="session")
def auto_round_awq():
    """{name: folder} of tiny random models quantized by auto-round 0.16.1 to "auto_awq" (tools/make_awq_fixture.py),
    written once per machine under the pyllm cache (keyed by the tool's source and the writer's versions)."""
    auto_round = pytest.importorskip("auto_round", reason="auto-round not installed: no AWQ writer in this env")
    import json

    import torch
    import transformers

    aw, mk = _tool("autoawq_fixture"), _tool("make_awq_fixture")
    specs = {"llama-g64": dict(group_size=64, arch="llama", tied=False, seed=64),
             "qwen2-g128": dict(group_size=128, arch="qwen2", tied=True, seed=128)}

    def build(d):
        torch.set_num_threads(min(2, torch.get_num_threads()))
        for name, kw in specs.items():
            mk.build(d / name, **kw)

    key = aw.source_key(auto_round.__version__, transformers.__version__, torch.__version__, repr(specs))
    root = aw.cached("auto-round-" + auto_round.__version__, key, build)
    out = {}
    for name in specs:
        hits = [p.parent for p in sorted((root / name / "awq").rglob("config.json"))
                if "quantization_config" in json.loads(p.read_text())]
        out[name] = hits[0]
    return out


def cli_in_process(monkeypatch, capsys, default_stdin: bytes = b""):
    """``run(*argv, stdin=bytes)`` -> SimpleNamespace(returncode, stdout, stderr): pyllm's CLI in this process
    (faster than a subprocess; argparse's SystemExit becomes the return code)."""
    import gc
    import io
    import sys
    from types import SimpleNamespace

    from pyllm.cli.main import main

    def run(*args, stdin=default_stdin):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
        # `pyllm bench` collects garbage before it measures: a second in a process holding a test session, unless
        # what the session holds is frozen meanwhile (the CLI's own garbage is still collected)
        gc.freeze()
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
        finally:
            gc.unfreeze()
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


# ------------------------------------------------------------- `pyllm serve` in a subprocess (tests/server_harness.py)
# Module-scoped: each server test module gets its own server, so a module's requests meet an empty prompt cache and
# no other module's traffic in /metrics.
@pytest.fixture(scope="module")
def smol():
    from server_harness import KEY, MAX_BODY, Server

    s = Server(fixture_path("smollm2"), "--alias", "smollm2", "--ctx", "512", "--api-key", KEY,
               "--max-body", str(MAX_BODY))
    yield s
    s.close()


@pytest.fixture(scope="module")
def smol_llm():
    # The session's shared LLM, with whatever conversation an earlier module (test_api) left in its cache: a chat
    # reusing that cached prefix differs from a fresh prefill by up to ~0.5 in the logits (docs/DESIGN.md,
    # Server) and so in its greedy text, while this module's server starts empty.
    llm = pyllm_model("smollm2", n_ctx=512, n_threads=1)
    llm.reset()
    return llm


@pytest.fixture(scope="module")
def qwen():
    from server_harness import Server

    s = Server(fixture_path("qwen2"), "--alias", "qwen", "--ctx", "1024")
    yield s
    s.close()


def unblock_fifo_later(fifo, seconds: float = 3.0):
    """Opens ``fifo`` for writing once a reader waits on it (within ``seconds``) and writes junk: code that opens a
    FIFO blocks until then, so a regression fails with some other error instead of hanging the suite. Returns the
    thread: join it once the code under test has returned (it stops waiting for a reader then, since code that had
    opened the FIFO could not have returned before this thread let it)."""
    import os
    import threading
    import time

    done = threading.Event()

    def run():
        end = time.monotonic() + seconds
        while time.monotonic() < end and not done.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader yet
                time.sleep(0.05)
                continue
            time.sleep(1)
            os.write(fd, b"junk")
            os.close(fd)
            return

    class Unblocker(threading.Thread):
        def join(self, timeout=None):
            done.set()
            super().join(timeout)

    t = Unblocker(target=run, daemon=True)
    t.start()
    return t
