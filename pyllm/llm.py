"""LLM: the public object. Loads a model file and offers tokenize / logits / generate / chat.

One LLM owns one model, one KV cache and the engine that runs its generations; calls are serialized by a lock
(CallLock), so two threads sharing it take turns instead of corrupting the cache.  Its calls live by job in
llm_generate.py (logits, generate_tokens, generate), llm_batch.py (several generations at once) and llm_chat.py
(chat and the OpenAI-shaped calls); what they take is checked in llm_args.py.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from . import lora as lora_adapters
from . import ops
from . import registry
from .errors import ContextFullError, ModelError, PyllmError, in_file
from .llm_args import (DEFAULT_SAMPLING, DEFAULT_SPECULATIVE, _check_policy, check_int,  # noqa: F401 (re-exported)
                       check_sampling, check_seed, plan_kv_cache)
from .llm_batch import BatchCalls
from .llm_chat import ChatCalls
from .llm_generate import GenerationCalls
from .runtime.generator import GenerationStats, Generator


class CallLock:
    """The lock an LLM's calls hold: one call at a time across threads; the thread that holds it may take it again.

    A stream holds it between its tokens, and may be resumed by another thread than the one that started it: a web
    framework drives a sync iterator from a thread pool, a different worker for each ``next()`` (Starlette's
    StreamingResponse does). threading.RLock refuses to be released by another thread, so such a stream ended in
    "RuntimeError: cannot release un-acquired lock" and left the LLM locked for every other thread. Here any thread
    may release it, and the thread that resumes a stream takes over as its holder (``adopt``): another thread's
    call then waits for the stream, and a call from the resuming thread itself supersedes it (LLM._epoch)."""

    def __init__(self, on_enter: Callable[[], None] | None = None):
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None  # the thread id that holds it, while _depth > 0
        self._depth = 0
        self._on_enter = on_enter  # run by every acquire and adopt, holding the lock

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._cond:
            while self._depth and self._owner != me:
                self._cond.wait()
            self._owner = me
            self._depth += 1
        if self._on_enter is not None:
            self._on_enter()

    def release(self) -> None:
        with self._cond:
            if not self._depth:
                raise RuntimeError("CallLock released more often than acquired")
            self._depth -= 1
            if not self._depth:
                self._owner = None
                self._cond.notify_all()

    def adopt(self) -> None:
        """The calling thread, resuming a stream that holds the lock, becomes its holder."""
        with self._cond:
            if self._depth:
                self._owner = threading.get_ident()
        if self._on_enter is not None:
            self._on_enter()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


class LLM(GenerationCalls, BatchCalls, ChatCalls):
    """Made by ``load`` (from_checkpoint). ``device`` ("cpu", "cuda") and ``kernels`` ("fast", "reference",
    "cuda") name what runs it; ``backend`` (= ``model.backend``) is the backend object (pyllm/backends)."""

    def __init__(self, checkpoint, model, kv, n_ctx: int, n_threads: int, load_seconds: float,
                 context_policy: str = "stop", own_threads: bool = False):
        self.path = checkpoint.path
        self.gguf = checkpoint.source
        self.config = checkpoint.config
        self.weights = checkpoint.weights
        self.tokenizer = checkpoint.tokenizer
        self.template = checkpoint.template
        self.model = model
        self.kv = kv
        self.n_ctx = n_ctx
        self.device = model.backend.device.type
        self.kernels = model.backend.name
        self.n_threads = n_threads
        self.load_seconds = load_seconds
        # Loaded with n_threads: every call runs on them. torch's and the kernels' thread counts are the process's,
        # so another LLM loaded with its own count would otherwise change this one's (llama-cpp-python applies a
        # Llama's n_threads on each evaluation).  Without: the process's setting, whatever it is at the time.
        self.own_threads = own_threads
        self.context_policy = _check_policy(context_policy)
        self.chat_dropped = 0  # messages the last chat() dropped from the front of its history ("shift")
        self.generator = Generator(model, kv, n_ctx)
        self.draft = None  # the draft LLM for speculative="draft" (set_draft)
        self.lora: list = []  # the LoRA adapters the model runs with (pyllm/lora.py LoraAdapter), set by load
        # What generate_tokens' speculative="auto" / spec_k / spec_ngram default to (the CLI's --spec* flags):
        # {"speculative": "lookup", "spec_k": 5, ...}; empty: DEFAULT_SPECULATIVE for greedy decoding.
        self.spec_options: dict = {}
        self._lock = CallLock(on_enter=self._use_own_threads)
        self._grammar_vocab = None  # built on the first structured-output call (grammar_vocab)
        # Bumped by every call that changes the cache. The lock lets one thread in twice, so a stream left
        # suspended while the same thread starts another call must notice, not continue from a foreign cache.
        self._epoch = 0

    # ---- text <-> ids -------------------------------------------------------------------------------------------
    def _use_own_threads(self) -> None:
        """Puts the LLM's thread count in force where it was loaded with one (own_threads): each call and each
        resumed stream runs this, which costs a read and a write of two settings."""
        if not self.own_threads:
            return
        n = self.n_threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        ops.set_num_threads(n)  # the kernels' setting (read per parallel region); never loads the extension

    def tokenize(self, text: str | bytes, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text``; UTF-8 ``bytes`` too, as llama-cpp-python's ``Llama.tokenize(b"...")`` takes it
        (``detokenize`` gives text back, a str)."""
        if isinstance(text, (bytes, bytearray)):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as e:
                raise PyllmError(f"tokenize: the bytes are not UTF-8 (byte {text[e.start]:#04x} at offset "
                                 f"{e.start})") from None
        elif not isinstance(text, str):
            raise PyllmError(f"tokenize: text must be a str (or UTF-8 bytes), got {type(text).__name__}")
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def check_prompt_fits(self, text: str, add_bos: bool | None = None) -> None:
        """ContextFullError when ``text`` cannot fit in n_ctx whatever it tokenizes to, decided without tokenizing it
        (Tokenizer.min_tokens, a lower bound: a prompt that fits is never refused here). Tokenizing megabytes takes
        seconds (0.2-1 MB/s) only to refuse them after; a server's worker would be held that long."""
        # The bound never exceeds the text's UTF-8 bytes (at most 4 per character) plus BOS and EOS, so a text that
        # short always passes: it skips the vocabulary walk min_tokens makes on first use (0.3-1.7 s), which every
        # short prompt of a process would otherwise wait for.
        if 4 * len(text) + 2 < self.n_ctx:
            return
        least = self.tokenizer.min_tokens(text, add_bos=add_bos)
        if least >= self.n_ctx:
            e = ContextFullError(f"the prompt has at least {least} tokens but the context holds {self.n_ctx}; use "
                                 f"a larger context (--ctx) or a shorter prompt")
            e.least_tokens = least  # for front ends that word their own message
            raise e

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def stats(self) -> GenerationStats:
        return self.generator.stats

    @property
    def n_vocab(self) -> int:
        return self.config.n_vocab

    @property
    def is_encoder(self) -> bool:
        """An embedding encoder (the BERT family, models/encoder.py): it embeds text and generates none."""
        return getattr(self.model, "is_encoder", False)

    def check_generates(self) -> None:
        """BadRequest (param "model") for an embedding encoder: it has no output head to predict a token with."""
        if self.is_encoder:
            from .errors import BadRequest

            raise BadRequest(f"{self.path.name} is an embedding model (a {self.config.arch} encoder): it cannot "
                             f"generate text; use it for embeddings (embed(), /v1/embeddings, /api/embed)", "model")

    @property
    def system_fingerprint(self) -> str:
        """OpenAI's ``system_fingerprint``: "fp_" + 12 hex digits naming what, besides the request, decides the
        output: pyllm's version, the model file (name and size: hashing a multi-GB file would delay the first
        reply by seconds), the KV cache kind, context size, device, backend and kernel family, and the chat
        template. Equal across requests of one loaded model; a client that sees it change knows a seeded or greedy
        reply may change."""
        import hashlib

        from ._version import __version__

        cached = self.__dict__.get("_fingerprint")
        if cached is not None and cached[0] is self.template:  # once per template: no stat per request
            return cached[1]
        template = getattr(self.template, "source", "") or ""
        key = (__version__, self.path.name, self.path.stat().st_size, self.kv.kind, self.n_ctx, self.device,
               self.kernels, self._kernels(), hashlib.sha256(template.encode()).hexdigest())
        fp = "fp_" + hashlib.sha256(repr(key).encode()).hexdigest()[:12]
        self._fingerprint = (self.template, fp)
        return fp

    @property
    def backend(self):
        """The backend object running the model (pyllm/backends); ``kernels`` is its name."""
        return self.model.backend

    def _kernels(self) -> str:
        """The kernels in use: the CPU's kernel family, or the GPU's name."""
        if self.device == "cuda":
            return torch.cuda.get_device_name(self.model.backend.device)
        if self.kernels == "reference":
            return "torch"
        return ops.get_isa() or "none"

    def reset(self) -> None:
        """Forget the cached conversation (the next call prefills from scratch)."""
        with self._lock:
            self._epoch += 1
            self.generator.reset()

    def set_draft(self, draft) -> None:
        """Use ``draft`` (an LLM, or a model path / registry name to load) for speculative="draft". It must share
        this model's vocabulary (checked: size and a sample of token texts; PyllmError otherwise)."""
        from .runtime.speculative import check_same_vocab

        if draft is not None and not isinstance(draft, LLM):
            draft = load(draft, n_ctx=self.n_ctx, device=self.device, quiet=True,
                         kernels="reference" if self.kernels == "reference" else "fast")
        if draft is not None:
            check_same_vocab(self, draft)
        self.draft = draft

    # ---- description --------------------------------------------------------------------------------------------
    def info(self) -> dict:
        from .info import model_info

        out = model_info(self.gguf, self.config, self.tokenizer, self.template, n_ctx=self.n_ctx,
                         kv_kind=self.kv.kind)
        out["runtime"] = self.model.backend.describe()
        if self.lora:
            out["lora"] = [a.describe() for a in self.lora]
        return out

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load(model: str | os.PathLike = registry.DEFAULT_MODEL, device: str | None = None, n_ctx: int = 4096,
         kv_cache: str = "f16", n_threads: int | None = None, kernels: str = "fast", quiet: bool = True,
         context_policy: str = "stop", verbose: bool = False, draft=None, lora=None, backend: str | None = None,
         gpu_layers: int | None = None) -> LLM:
    """Load a GGUF file (path), an AWQ checkpoint folder, or a registry model (name, fetched on first use).

    device: "cpu" (the default), "cuda" (or "cuda:N"; PyllmError naming why when this machine cannot run it), or
    "auto" (CUDA when torch sees a GPU and the CUDA kernels build, else the CPU; a model whose weights and KV cache
    do not fit in the GPU's free memory gets the most layers that fit, the rest on the CPU, said on stderr unless
    ``quiet``); ``llm.device`` says which ran.

    gpu_layers: llama.cpp's n_gpu_layers: the last N layers and their KV cache on the GPU, the others, the
    embedding and the output head on the CPU (backends/split.py); more than the model's layers, or -1, the whole
    model on the GPU (device "cuda"); 0 the CPU.  None (the default): the device decides.  ``llm.info()["runtime"]
    ["placement"]`` says where each layer runs.  Where no GPU is usable, N > 0 is a PyllmError naming it.
    PYLLM_GPU_STANDIN=reference (or fast), a testing aid, runs "the GPU's" layers on that CPU backend instead.

    kv_cache: f16 (default), bf16, f32, q8_0, q8_rot, q4_0, q4_rot, or "KEY/VALUE" such as "f16/q4_rot" (see
    runtime/kv_cache.py). context_policy: what chat()
    does when the conversation outgrows n_ctx: "stop" (ContextFullError / finish_reason "context") or "shift"
    (drop the oldest turns after the system prompt and re-prefill; see LLM.fit_chat).

    draft: a smaller model (path, registry name or LLM) with the same vocabulary, for speculative="draft".

    n_threads: the CPU threads this LLM computes on, put in force by each of its calls (torch's and the kernels'
    counts are the process's, so LLMs loaded with different counts each keep theirs).  None: the process's setting
    at the time of each call (by default the physical cores).

    kernels: the CPU kernels: "fast" runs the fused kernels; "reference" runs float32 matmuls on weights
    dequantized by the torch reference code (cached per weight on first use: for tests and accuracy baselines, not
    for speed; CPU only).  ``backend`` is its old name, deprecated (a DeprecationWarning).

    lora: LoRA adapters in llama.cpp's GGUF format, applied at run time without merging (pyllm/lora.py): a path,
    a (path, scale) pair, or a list of them (scale 1.0 for a bare path); ``llm.lora`` lists them.
    """
    from . import backends
    from .formats.checkpoint import read_gguf

    t0 = time.perf_counter()
    if not isinstance(model, (str, os.PathLike)) or not os.fspath(model):
        raise PyllmError(f"model must be a path to a model file, a registry name or a URL, got {model!r}")
    if n_ctx is not None:
        check_int("n_ctx", n_ctx, 0)  # 0 (or None): the model's own
    if n_threads is not None:  # the CLI's --threads range (cli/common.py, max_threads): more only thrashes
        check_int("n_threads", n_threads, 1, 4 * (os.cpu_count() or 1))
    if backend is not None:
        import warnings

        warnings.warn("pyllm.load(backend=...) is deprecated: the CPU kernel choice is kernels=...",
                      DeprecationWarning, stacklevel=2)
        if kernels != "fast" and backend != kernels:
            raise PyllmError(f"kernels={kernels!r} and its deprecated alias backend={backend!r} disagree; give "
                             f"kernels only")
        kernels = backend
    from .backends import split

    if device is not None:
        backends.check_device(device)
    device, gpu_layers = split.check_gpu_layers(gpu_layers, device)
    backends.check_kernels(kernels)
    _check_policy(context_policy)
    lora_adapters.parse_spec(lora)  # a malformed argument fails before the model is read
    runner = backends.select(device, kernels, n_threads, gpu_layers)
    path = registry.resolve(model, quiet=quiet)
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face folder: AWQ (pyllm/formats/awq/)
        from .formats.awq.folder import read_awq

        ckpt = read_awq(path, quiet=quiet)
    elif path.is_dir():
        raise PyllmError(f"{path}: is a directory, not a model file")
    else:
        ckpt = read_gguf(path)
    try:  # the layers' placement, now that their number and sizes are known
        runner = split.place(runner, ckpt.config, ckpt.weights, device=device, kernels=kernels, n_threads=n_threads,
                             gpu_layers=gpu_layers, n_ctx=n_ctx, kv_cache=kv_cache, quiet=quiet)
    except BaseException:
        ckpt.close()
        raise
    llm = from_checkpoint(ckpt, runner, n_ctx=n_ctx, kv_cache=kv_cache, n_threads=n_threads, quiet=quiet,
                          context_policy=context_policy, verbose=verbose, t0=t0, lora=lora)
    if draft is not None:  # a draft model for speculative decoding (same vocabulary, checked)
        try:
            llm.set_draft(draft)
        except BaseException:
            llm.close()
            raise
    # the model may run on another thread than the one that loaded it (the server's engine): this thread's OpenMP
    # workers, started by the loading's parallel regions, would throttle that thread's kernels (ops.release_thread_pool)
    ops.release_thread_pool()
    return llm


def from_checkpoint(ckpt, backend, n_ctx: int = 4096, kv_cache: str = "f16", n_threads: int | None = None,
                    quiet: bool = True, context_policy: str = "stop", verbose: bool = False,
                    t0: float | None = None, lora=None) -> LLM:
    """The LLM for a file reader's Checkpoint (pyllm/formats/checkpoint.py), run by ``backend`` (pyllm.backends.select):
    plans the KV cache, prepares the weights (CUDA: uploads them), builds the model and its cache. Closes the
    checkpoint if anything fails."""
    from .models import ENCODERS, build_model

    t0 = time.perf_counter() if t0 is None else t0
    try:
        cfg = ckpt.config
        # the adapters are read and checked before the weights are prepared (CUDA: uploaded)
        adapters, terms = lora_adapters.load_adapters(lora, cfg, ckpt.weights)
        if cfg.arch in ENCODERS:
            return _encoder_llm(ckpt, backend, cfg, n_ctx, kv_cache, n_threads, t0, adapters)
        n_ctx, per_token, need = plan_kv_cache(cfg, n_ctx, kv_cache, check_memory=backend.device.type == "cpu")
        if verbose:
            print(f"KV cache: {kv_cache}, {per_token / 1024:.1f} KiB per token, {need / 2**20:.1f} MiB for "
                  f"n_ctx={n_ctx}", file=sys.stderr)
        if n_threads:
            torch.set_num_threads(n_threads)
        try:
            mdl = build_model(cfg, ckpt.weights, backend, max_pos=n_ctx, progress=not quiet)
        except ModelError as e:  # the file lacks a tensor the architecture needs
            raise in_file(e, Path(ckpt.path).name) from None
        if terms:
            mdl.attach_lora(terms)
        kv = backend.make_kv_cache(kv_cache, cfg.n_layer, cfg.n_kv_head, n_ctx, cfg.head_dim)
    except BaseException:
        ckpt.close()
        raise
    llm = LLM(ckpt, mdl, kv, n_ctx, n_threads or torch.get_num_threads(), time.perf_counter() - t0,
              context_policy=context_policy, own_threads=bool(n_threads))
    llm.lora = adapters
    return llm


def _encoder_llm(ckpt, backend, cfg, n_ctx: int, kv_cache: str, n_threads: int | None, t0: float, adapters) -> LLM:
    """The LLM of an embedding encoder: its context is at most the trained one (BERT's position table has no row
    past it), and it keeps no cache between calls (a text is encoded in one pass); the one-position cache only
    gives the LLM the shape every other model's has (its kind, for info), and nothing writes it."""
    from .models import build_model

    if adapters:
        raise PyllmError(f"{Path(ckpt.path).name}: LoRA adapters apply to decoders; this is a {cfg.arch} encoder")
    if n_threads:
        torch.set_num_threads(n_threads)
    try:
        mdl = build_model(cfg, ckpt.weights, backend, max_pos=int(n_ctx) if n_ctx else cfg.n_ctx_train)
    except ModelError as e:
        raise in_file(e, Path(ckpt.path).name) from None
    kv = backend.make_kv_cache(kv_cache, cfg.n_layer, cfg.n_kv_head, 1, cfg.head_dim)
    return LLM(ckpt, mdl, kv, mdl.max_pos, n_threads or torch.get_num_threads(), time.perf_counter() - t0,
               own_threads=bool(n_threads))
