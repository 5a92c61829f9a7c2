"""Builds and loads the C++ (and later CUDA) extension ``pyllm._C`` on first use.

Why a JIT build (``torch.utils.cpp_extension.load`` + ninja) instead of compiling in ``setup.py``:
- ``pip install -e .`` / ``pip install pyllm`` stay instant and need no compiler at install time;
- an AOT build needs torch at build time, so pip's build isolation would download a second, multi-GB torch
  (or every user must remember ``--no-build-isolation``);
- the extension is compiled with ``-march=native`` for the machine that runs it.
The build is cached under ``pyllm.registry.cache_dir()/ext/<key>`` where the key hashes the sources, flags,
torch/Python versions and the CPU, so a source change, a torch upgrade or a home directory shared between
different machines gets its own build instead of a stale (or SIGILL-ing) one.

Nothing here runs at ``import pyllm``: ``load()`` is first called by the first kernel call in ``pyllm.ops``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import re
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from .errors import PyllmError

# The one source list (setup.py reads it too, to ship exactly these files with a wheel).  Paths are
# relative to the csrc directory; headers are found through the include path.
CPU_SOURCES = [
    "bindings.cpp",
    "bindings_kernels.cpp",
    "bindings_decode_context.cpp",
    "bindings_decode.cpp",
    "bindings_rows.cpp",
    "cpu/gemv.cpp",
    "cpu/q8k_outliers.cpp",
    "cpu/isa.cpp",
    "cpu/gemv_generic.cpp",
    "cpu/gemv_avx2_legacy.cpp",
    "cpu/gemv_avx2_kquants.cpp",
    "cpu/gemv_avx2_awq.cpp",
    "cpu/gemv_avx512.cpp",
    "cpu/gemv_vnni_emulated.cpp",
    "cpu/awq_repack.cpp",
    "cpu/rows8.cpp",
    "cpu/dequant.cpp",
    "cpu/gemm_amx.cpp",
    "cpu/decode_step.cpp",
    "cpu/decode_attention.cpp",
    "cpu/attention.cpp",
    "cpu/attention_int.cpp",
    "cpu/kv_rows.cpp",
    "cpu/glu.cpp",
    "cpu/causal_attention.cpp",
]
# CUDA files (.cu, and cuda/bindings_cuda.cpp which defines pyllm::register_cuda) go here; they are compiled
# only when torch has CUDA (torch.version.cuda) and nvcc exists, with -DPYLLM_CUDA defined for every file so
# bindings.cpp calls register_cuda(m).
CUDA_SOURCES: list[str] = ["cuda/gemv.cu", "cuda/gemv_tiled.cu", "cuda/mmq.cu", "cuda/dequant.cu",
                             "cuda/attention.cu", "cuda/step.cu", "cuda/bindings_cuda.cpp"]

# -march=native: build for this machine (the cache key includes the CPU).  -ffp-contract=off: gcc would
# otherwise fuse a*b-c into FMAs, and dequantize() must match gguf.quants bit for bit; the SIMD kernels
# use explicit FMA intrinsics.  No -ffast-math: it would let gcc reorder the scalar reference kernels
# (their job is to be the plain definition) and assume no NaN/inf in model data.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++17"]
LDFLAGS = ["-fopenmp"]
CUDA_FLAGS = ["-O3", "--use_fast_math", "-DPYLLM_CUDA", "-std=c++17"]

NAME = "pyllm_C"
_module = None
_error: PyllmError | None = None
_cuda_built = False


class IsaError(PyllmError):
    """PYLLM_ISA names kernels this build or CPU cannot run, or PYLLM_ROWS8_PAIRS is neither 0 nor 1."""


class CacheError(PyllmError):
    """The extension cannot be built or kept where the cache is (PYLLM_CACHE_DIR, XDG_CACHE_HOME or ~/.cache): not
    a directory, not creatable, not writable. An error, not a fall-back to the reference kernels: the user set, or
    can set, the variable, and would otherwise decode ten times slower with only a line of stderr to say why.
    Worded for the CLI's "pyllm: error: " (no "pyllm: " of its own)."""


def _apply_isa_env(mod) -> None:
    """PYLLM_ISA=scalar|avx2|avx512|amx forces a CPU kernel family (testing, benchmarking); unset: the best one."""
    name = os.environ.get("PYLLM_ISA", "").strip().lower()
    if not name:
        return
    avail = list(mod.available_isas())
    if name not in ("scalar", "avx2", "avx512", "amx"):
        raise IsaError(f"PYLLM_ISA={name}: not a kernel family; expected one of scalar, avx2, avx512, amx")
    if name not in avail:
        raise IsaError(f"PYLLM_ISA={name}: this CPU (or its OS, or this build) cannot run it; available: "
                       f"{', '.join(avail)}")
    mod.set_isa(name)


def _apply_rows8_pairs_env(mod) -> None:
    """PYLLM_ROWS8_PAIRS=0|1: the AVX-512 rows-by-8 kernels with one 8-row group per ymm register, or two per zmm
    (csrc/kernels.h cpu_rows8_pairs: the same bits; by default two except on AMD, where they are slower)."""
    value = os.environ.get("PYLLM_ROWS8_PAIRS", "").strip()
    if not value:
        return
    if value not in ("0", "1"):
        raise IsaError(f"PYLLM_ROWS8_PAIRS={value}: expected 0 (one 8-row group per register) or 1 (two)")
    mod.set_rows8_pairs(value == "1")


def csrc_dir() -> Path:
    """``<repo>/csrc`` for a source checkout / editable install, else ``pyllm/_csrc`` shipped by setup.py."""
    here = Path(__file__).resolve().parent
    for d in (here.parent / "csrc", here / "_csrc"):
        if (d / "bindings.cpp").is_file():
            return d
    raise PyllmError(f"pyllm: the C++ sources are missing (looked in {here.parent / 'csrc'} and {here / '_csrc'}); "
                     "reinstall pyllm")


def limit(name: str) -> int:
    """The constant ``name`` of csrc/common/limits.h, where the C++ and CUDA kernels read it: each limit the
    kernels and Python share is stated there once (PyllmError if the header does not define it)."""
    import re

    path = csrc_dir() / "common" / "limits.h"
    found = re.search(rf"^constexpr int {re.escape(name)} = (\d+);", path.read_text(encoding="utf-8"), re.M)
    if found is None:
        raise PyllmError(f"pyllm: {path} does not define {name}; reinstall pyllm")
    return int(found.group(1))


def cuda_build_problem() -> str | None:
    """Why this build leaves the CUDA kernels out (one phrase), or None when it compiles them."""
    import torch
    from torch.utils import cpp_extension

    if not CUDA_SOURCES:
        return "this pyllm has no CUDA sources"
    if not torch.version.cuda:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    if not cpp_extension.CUDA_HOME:
        return "the CUDA toolkit was not found (set CUDA_HOME)"
    if not (shutil.which("nvcc") or Path(cpp_extension.CUDA_HOME, "bin", "nvcc").exists()):
        return f"nvcc is missing (not on PATH nor in {cpp_extension.CUDA_HOME}/bin)"
    return None


def _cuda_wanted() -> bool:
    return cuda_build_problem() is None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        model = next((ln for ln in text.splitlines() if ln.startswith("model name")), "")
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        return model + flags
    except OSError:
        return platform.processor() + platform.machine()


def _build_key(src: Path, sources: list[str], cuda: bool) -> str:
    import torch

    # The listed sources and the headers they may include (csrc/cuda's headers only for CUDA builds), so edits
    # to CUDA files do not rebuild a CPU-only extension.
    files = {src / s for s in sources}
    files |= {p for p in src.rglob("*.h") if cuda or "cuda" not in p.relative_to(src).parts}
    files |= {p for p in src.rglob("*.cuh")} if cuda else set()
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(str(p.relative_to(src)).encode())
        h.update(p.read_bytes())
    # The checkout's own path too: torch writes the sources' absolute paths into the build directory's ninja file,
    # so two checkouts of the same content sharing one directory would each rebuild everything the other built.
    h.update(repr((str(src.resolve()), sources, CFLAGS, LDFLAGS, CUDA_FLAGS if cuda else None, torch.__version__,
                   sys.version, _cpu_id())).encode())
    return f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__.replace('+', '_')}-{h.hexdigest()[:16]}"


# The build directory's lock.  torch's cpp_extension guards a build with a file named ``lock`` that it creates and
# deletes itself; a build killed in between (Ctrl-C at the wrong moment, OOM, a closed terminal) leaves the file,
# and every later load waits for it forever.  pyllm therefore holds its own flock(2) on ``build.flock`` around
# the whole load: the kernel drops a flock when its holder dies, so a dead builder never blocks anyone, and while
# we hold it no other pyllm process can be inside torch's build, so a ``lock`` file found then is stale.
LOCK_NAME = "build.flock"
LOCK_WAIT_S = 1800.0  # a cold build with CUDA takes minutes; past this, another process is stuck, not building


@contextlib.contextmanager
def build_lock(build: Path, timeout: float = LOCK_WAIT_S):
    """Holds the build directory's lock (waiting up to ``timeout`` seconds for a live holder) and clears a stale
    torch ``lock`` file left by a killed build.  Raises PyllmError naming the directory if the wait times out."""
    build.mkdir(parents=True, exist_ok=True)
    fd = os.open(build / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # never through a planted link
    try:
        deadline, told = time.monotonic() + timeout, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise PyllmError(f"pyllm: another process has been building the C++ extension in {build} for "
                                     f"over {timeout:.0f} s; if none is running, delete {build} and retry") from None
                if not told:
                    print(f"pyllm: waiting for another process to finish building the C++ extension in {build}...",
                          file=sys.stderr, flush=True)
                    told = True
                time.sleep(0.2)
        with contextlib.suppress(FileNotFoundError):
            (build / "lock").unlink()  # torch's baton: nobody can hold it while we hold the flock
        yield
    finally:
        os.close(fd)  # releases the flock


def _diagnose(exc: BaseException) -> PyllmError:
    """A one-paragraph error naming the missing piece, or the compiler's last lines."""
    from torch.utils import cpp_extension

    missing = []
    if not cpp_extension.is_ninja_available():
        missing.append("ninja (pip install ninja)")
    cxx = os.environ.get("CXX", "c++")
    if not shutil.which(cxx):
        missing.append(f"a C++ compiler ({cxx!r} not on PATH; install g++ or set CXX)")
    inc = sysconfig.get_paths().get("include")
    if inc and not Path(inc, "Python.h").exists():
        missing.append(f"the Python headers ({inc}/Python.h; install python3-dev)")
    if missing:
        return PyllmError("pyllm: cannot build the C++ extension: missing " + ", ".join(missing))
    text = str(exc).strip().splitlines()
    tail = "\n".join(text[-15:])
    return PyllmError(f"pyllm: compiling the C++ extension failed ({type(exc).__name__}); set "
                      f"PYLLM_VERBOSE_BUILD=1 for the full log. Last lines:\n{tail}")


_STEP = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")


def _step_name(command: str) -> str:
    """The file a ninja step makes or compiles, from its command line: 'gemv_avx512.cpp', 'pyllm_C.so'."""
    words = command.split()
    for w in reversed(words):
        if w.endswith((".cpp", ".cu", ".so")):
            return Path(w).name
    return words[0] if words else "?"


class BuildProgress:
    """The first-use build's progress on stderr: ninja's [n/m] with the file and the time so far, as one status line
    rewritten in place on a terminal (ticking while a long file compiles), else one plain line per finished step
    (a log keeps every line)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.step = ""

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def line(self, text: str) -> None:
        m = _STEP.match(text)
        if not m:
            return
        self.step = f"[{m.group(1)}/{m.group(2)}] {_step_name(m.group(3))}"
        self.show(final=not self.tty)

    def show(self, final: bool = False) -> None:
        if not self.step:
            return
        text = f"pyllm: compiling {self.step}, {self.elapsed():.0f} s"
        if self.tty:
            self.stream.write(f"\r\x1b[K{text}")
        elif final:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, ok: bool) -> None:
        if self.tty and self.step:
            self.stream.write("\n")
        if ok and self.step:  # a build that was already complete ran no step: nothing to report
            self.stream.write(f"pyllm: compiled the C++ extension in {self.elapsed():.0f} s\n")
        self.stream.flush()


def run_ninja_with_progress(build_directory: str, verbose: bool, error_prefix: str) -> None:
    """torch.utils.cpp_extension's ninja step, showing BuildProgress instead of one static line for minutes. The
    output is kept and raised as torch raises it (RuntimeError with the compiler's text) when the build fails."""
    import select
    import subprocess

    from torch.utils import cpp_extension

    command = ["ninja", "-v"]
    jobs = cpp_extension._get_num_workers(False) if hasattr(cpp_extension, "_get_num_workers") else None
    if jobs is not None:
        command += ["-j", str(jobs)]
    progress = BuildProgress()
    output: list[bytes] = []
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(command, cwd=build_directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=os.environ.copy())
    ok = False
    try:
        pending = b""
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if not ready:
                progress.show()  # the elapsed time ticks on a terminal while one file compiles
                continue
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            output.append(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for ln in lines:
                progress.line(ln.decode("utf-8", "replace"))
        ok = proc.wait() == 0
    finally:
        if proc.poll() is None:  # interrupted: the compilers go with us
            proc.kill()
            proc.wait()
        progress.done(ok)
    if not ok:
        raise RuntimeError(f"{error_prefix}: {b''.join(output).decode('utf-8', 'replace')}")


@contextlib.contextmanager
def _build_progress():
    """cpp_extension.load with run_ninja_with_progress as its ninja step (torch's own stays for
    PYLLM_VERBOSE_BUILD=1, which streams the compiler's full output, and for a torch without the hook)."""
    from torch.utils import cpp_extension

    original = getattr(cpp_extension, "_run_ninja_build", None)
    if original is None or os.environ.get("PYLLM_VERBOSE_BUILD") == "1":
        yield
        return
    cpp_extension._run_ninja_build = run_ninja_with_progress
    try:
        yield
    finally:
        cpp_extension._run_ninja_build = original


def _load_extension(cpp_extension, src: Path, sources: list[str], build: Path, cuda: bool):
    return cpp_extension.load(
        name=NAME,
        sources=[str(src / s) for s in sources],
        extra_include_paths=[str(src)],
        extra_cflags=CFLAGS + (["-DPYLLM_CUDA"] if cuda else []),
        extra_cuda_cflags=CUDA_FLAGS,
        extra_ldflags=LDFLAGS,
        build_directory=str(build),
        with_cuda=cuda,
        verbose=os.environ.get("PYLLM_VERBOSE_BUILD") == "1",
    )


def load():
    """The extension module (built on first call, then cached in-process and on disk).

    Raises PyllmError if it cannot be built (naming what is missing) or PYLLM_NO_EXT=1 is set.
    """
    global _module, _error, _cuda_built
    if _module is not None:
        return _module
    if _error is not None:
        raise _error
    if os.environ.get("PYLLM_NO_EXT") == "1":
        _error = PyllmError("pyllm: the C++ extension is disabled (PYLLM_NO_EXT=1)")
        raise _error
    try:
        import torch  # noqa: F401  (torch's libgomp must be loaded before ours resolves to it)
        from torch.utils import cpp_extension

        from . import registry

        src = csrc_dir()
        cuda = _cuda_wanted()
        sources = CPU_SOURCES + (CUDA_SOURCES if cuda else [])
        try:
            build = registry.cache_dir() / "ext" / _build_key(src, sources, cuda)
        except PyllmError as e:  # a file where the cache should be, named by its variable
            raise CacheError(str(e)) from None
        try:
            build.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # under a path that cannot hold it (/proc/x), full, or not writable
            raise registry.unwritable_cache_error(e, "build the C++ extension", CacheError) or CacheError(
                f"cannot build the C++ extension: {e.filename or build}: {e.strerror}; the cache "
                f"{registry.cache_dir()} must be a directory it can be written to: set {registry.CACHE_ENV} to "
                f"one") from None
        with build_lock(build):
            if not (build / f"{NAME}.so").exists():
                what = ("with its CUDA kernels " if cuda else "") + "(first use, a few minutes)"
                print(f"pyllm: compiling the C++ extension {what}...", file=sys.stderr, flush=True)
            with _build_progress():
                mod = _load_extension(cpp_extension, src, sources, build, cuda)
    except PyllmError as e:
        _error = e
        raise
    except Exception as e:  # compiler errors arrive as RuntimeError / CalledProcessError / OSError
        from . import registry

        unwritable = (registry.unwritable_cache_error(e, "build the C++ extension", CacheError)
                      if isinstance(e, OSError) else None)
        _error = unwritable or _diagnose(e)
        raise _error from e
    try:
        _apply_isa_env(mod)
        _apply_rows8_pairs_env(mod)
    except IsaError as e:
        _error = e
        raise
    _cuda_built = cuda
    _module = mod
    sys.modules["pyllm._C"] = mod  # `pyllm._C.set_isa(...)` etc. once loaded
    # The package is already imported (this module is inside it); reaching it through sys.modules keeps _ext a
    # leaf of the import graph.
    sys.modules[__package__]._C = mod
    return mod


def has_extension() -> bool:
    """True if the extension is (or can be) built and loaded; builds it on first call."""
    try:
        load()
        return True
    except PyllmError:
        return False


def has_cuda() -> bool:
    """True if the extension was built with CUDA kernels and a CUDA device is usable."""
    if not has_extension() or not _cuda_built:
        return False
    import torch

    return torch.cuda.is_available()


def build_info() -> str:
    """One line for `pyllm --version`: ISA, threads, CUDA, build directory."""
    m = load()
    cuda = "with CUDA" if _cuda_built else "CPU only"
    if m.avx512_emulated():
        cuda += "; avx512 emulated on AVX2 for tests"
    return (f"{m.__name__} ({cuda}; cpu kernels {m.get_isa()} of {'/'.join(m.available_isas())}, "
            f"{m.get_num_threads()} threads) in {Path(m.__file__).parent}")
