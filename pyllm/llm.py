"""LLM: the public object. Loads a model file and offers tokenize / logits / generate / chat.

One LLM owns one model, one KV cache and one generation loop; calls are serialized by a lock (CallLock), so two
threads sharing it take turns instead of corrupting the cache.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

from . import lora as lora_adapters
from . import registry
from .errors import ContextFullError, KVCacheMemoryError, ModelError, PyllmError, in_file
from .runtime.engine import check_finite
from .runtime.generator import GenerationStats, Generator
from .runtime.sampler import Sampler, SamplerSettings
from .runtime.stop_strings import stop_list

DEFAULT_SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
# What greedy decoding speculates with when the caller does not say (speculative="auto"), where the model's fused
# step verifies rows exactly (CpuDecodeStep.rows_exact: the tokens are then plain decoding's).  Prompt lookup
# measured 1.03-2.4x plain decoding on every fixture and shipped prompt, open-ended ones included (the controller
# falls back to plain steps when drafts fail; docs/BENCHMARKS.md, "Speculative decoding").
DEFAULT_SPECULATIVE = "lookup"


def _check_policy(policy: str) -> str:
    if policy not in ("stop", "shift"):
        raise PyllmError(f"context_policy must be 'stop' or 'shift', got {policy!r}")
    return policy


def check_int(name: str, value, lo: int = 0, hi: int | None = None) -> int:
    """``value`` as an int in [lo, hi], or a PyllmError naming ``name`` (no bool, float or string slips through)."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PyllmError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise PyllmError(f"{name} must be an integer in [{lo}, {hi if hi is not None else 'inf'}), got {value}"
                         if hi is None else f"{name} must be an integer in [{lo}, {hi}], got {value}")
    return value


def check_seed(seed) -> int | None:
    """None or -1: a random seed (llama.cpp's convention); otherwise an integer in [0, 2**63)."""
    if seed is None:
        return None
    if not isinstance(seed, bool) and isinstance(seed, int) and seed == -1:
        return None
    try:
        return check_int("seed", seed, 0, 2**63 - 1)
    except PyllmError:
        raise PyllmError(f"seed must be an integer >= 0, or -1/None for a random one, got {seed!r}") from None


_REAL_SETTINGS = ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "frequency_penalty",
                  "presence_penalty")
_INT_SETTINGS = ("top_k", "penalty_last_n")


# What generate / chat / generate_tokens take besides the sampler's own settings
_GENERATION_KEYWORDS = ("sampler", "json_schema", "grammar", "constraint", "speculative", "spec_k", "spec_ngram")


def check_sampling(settings: dict, n_vocab: int | None = None) -> dict:
    """Type checks of sampling settings before the sampler compares them (a string or NaN would otherwise end in
    a foreign TypeError, or pass every range check); ranges are the sampler's own (SamplerSettings.validate).
    A keyword that is neither a setting nor a generation option is refused here, when the call is made, naming
    it: it would otherwise be a TypeError from inside SamplerSettings, and only at a stream's first token.
    ``logit_bias`` as create_completion takes it ({token id: bias in [-100, 100]}, ids below ``n_vocab``)."""
    import numbers
    import sys
    from dataclasses import fields

    from .errors import shorten

    known = [f.name for f in fields(SamplerSettings)]
    unknown = [k for k in settings if k not in known and k not in _GENERATION_KEYWORDS]
    if unknown:
        raise PyllmError(f"unknown argument {shorten(unknown[0])!r}; generation takes max_tokens, stop, stream, "
                         f"{', '.join(known)}, {', '.join(_GENERATION_KEYWORDS)}")
    out = dict(settings)
    for k, v in settings.items():
        if k in _REAL_SETTINGS:
            # false for NaN, infinities and integers past a double's range (math.isfinite raises OverflowError
            # for those)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not abs(v) <= sys.float_info.max:
                raise PyllmError(f"{k} must be a finite number, got {shorten(repr(v))}")
            out[k] = float(v)
        elif k in _INT_SETTINGS:
            out[k] = check_int(k, v, 0)
        elif k == "seed":
            out[k] = check_seed(v)
        elif k == "logit_bias":
            # a str key or a list was a TypeError or AttributeError from inside the sampler, and an id past the
            # vocabulary or a NaN bias was taken silently
            from .request_checks import check_logit_bias

            out[k] = check_logit_bias(v, n_vocab if n_vocab is not None else 2**63)
    return out


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan_kv_cache(cfg, n_ctx: int, kv_cache: str, check_memory: bool = True) -> tuple[int, float, float]:
    """Checks n_ctx and the cache kind, and refuses a cache that will not fit in available memory (host memory,
    ``check_memory``: the cache lives there), before any allocation. Returns (n_ctx, bytes per token, total
    bytes)."""
    from .runtime.kv_cache import KVCache, check_kind

    n_ctx = int(n_ctx) if n_ctx else cfg.n_ctx_train
    if n_ctx < 8:
        raise PyllmError(f"n_ctx must be at least 8, got {n_ctx}")
    check_kind(kv_cache, cfg.head_dim)
    per_token = KVCache.bytes_per_token(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, kv_cache)
    need = per_token * n_ctx
    avail = _available_memory() if check_memory else None
    if avail is not None and need > 0.9 * avail:
        raise KVCacheMemoryError(f"a {kv_cache} KV cache for n_ctx={n_ctx} needs {need / 2**30:.2f} GiB but only "
                                 f"{avail / 2**30:.2f} GiB of memory is available")
    return n_ctx, per_token, need


class CallLock:
    """The lock an LLM's calls hold: one call at a time across threads; the thread that holds it may take it again.

    A stream holds it between its tokens, and may be resumed by another thread than the one that started it: a web
    framework drives a sync iterator from a thread pool, a different worker for each ``next()`` (Starlette's
    StreamingResponse does). threading.RLock refuses to be released by another thread, so such a stream ended in
    "RuntimeError: cannot release un-acquired lock" and left the LLM locked for every other thread. Here any thread
    may release it, and the thread that resumes a stream takes over as its holder (``adopt``): another thread's
    call then waits for the stream, and a call from the resuming thread itself supersedes it (LLM._epoch)."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None  # the thread id that holds it, while _depth > 0
        self._depth = 0

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._cond:
            while self._depth and self._owner != me:
                self._cond.wait()
            self._owner = me
            self._depth += 1

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

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


class LLM:
    """Made by ``load`` (from_checkpoint). ``device`` ("cpu", "cuda") and ``kernels`` ("fast", "reference",
    "cuda") name what runs it; ``backend`` (= ``model.backend``) is the backend object (pyllm/backends)."""

    def __init__(self, checkpoint, model, kv, n_ctx: int, n_threads: int, load_seconds: float,
                 context_policy: str = "stop"):
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
        self.context_policy = _check_policy(context_policy)
        self.chat_dropped = 0  # messages the last chat() dropped from the front of its history ("shift")
        self.generator = Generator(model, kv, n_ctx)
        self.draft = None  # the draft LLM for speculative="draft" (set_draft)
        self.lora: list = []  # the LoRA adapters the model runs with (pyllm/lora.py LoraAdapter), set by load
        # What generate_tokens' speculative="auto" / spec_k / spec_ngram default to (the CLI's --spec* flags):
        # {"speculative": "lookup", "spec_k": 5, ...}; empty: DEFAULT_SPECULATIVE for greedy decoding.
        self.spec_options: dict = {}
        self._lock = CallLock()
        self._grammar_vocab = None  # built on the first structured-output call (grammar_vocab)
        # Bumped by every call that changes the cache. The lock lets one thread in twice, so a stream left
        # suspended while the same thread starts another call must notice, not continue from a foreign cache.
        self._epoch = 0

    # ---- text <-> ids -------------------------------------------------------------------------------------------
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
        from . import ops

        return ops.get_isa() or "none"

    def reset(self) -> None:
        """Forget the cached conversation (the next call prefills from scratch)."""
        with self._lock:
            self._epoch += 1
            self.generator.reset()

    # ---- evaluation ---------------------------------------------------------------------------------------------
    def logits(self, ids: list[int]) -> torch.Tensor:
        """float32 [len(ids), n_vocab]: a fresh evaluation from position 0."""
        self.check_generates()
        ids = self._check_ids(ids)
        with self._lock:
            self._epoch += 1
            self._check_file()
            out = self.generator.evaluate_all(ids).float()
        if not bool(torch.isfinite(out).all()):
            raise self._nonfinite_error(out)
        return out

    def prompt_logprobs(self, ids: list[int], n_top: int = 0) -> list[tuple[float, list[tuple[int, float]]]]:
        """For each token of ``ids`` after the first: its log-probability given the tokens before it, and the
        ``n_top`` most likely tokens at its position as (id, logprob) (what OpenAI's ``echo`` with ``logprobs``
        reports). One fresh evaluation from position 0 that keeps every position's logits, reduced a chunk at a
        time; it leaves the cache holding ``ids``, so a generation from them next evaluates only the last again."""
        from .runtime.sampler import rows_logprobs

        self.check_generates()
        ids = self._check_ids(ids)
        out: list[tuple[float, list[tuple[int, float]]]] = []
        with self._lock:
            self._epoch += 1
            self._check_file()
            at = 0
            for logits in self.generator.evaluate_chunks(ids):
                if not bool(torch.isfinite(logits).all()):
                    raise self._nonfinite_error(logits)
                n = min(len(logits), len(ids) - 1 - at)  # the last position predicts no prompt token
                out += rows_logprobs(logits[:n], ids[at + 1:at + 1 + n], n_top)
                at += len(logits)
            self.generator.scored = len(ids)
        return out

    def _check_ids(self, ids) -> list[int]:
        import numbers

        try:
            ids = list(ids)
        except TypeError:
            raise PyllmError(f"the prompt must be text or a list of token ids, got {type(ids).__name__}") from None
        odd = next((i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral)), None)
        if odd is not None:  # int() would turn "7" or 1.5 into some other token
            raise PyllmError(f"the prompt must be text or a list of token ids, got an element {odd!r}")
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.config.n_vocab]
        if bad:
            raise PyllmError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.n_vocab - 1})")
        if not ids:
            raise PyllmError("empty prompt: give at least one token")
        return ids

    @property
    def grammar_vocab(self):
        """The vocabulary as the constrained-decoding engine sees it (runtime/constraint.py), built on first use
        and kept: it walks every token once."""
        with self._lock:
            if self._grammar_vocab is None:
                from .runtime.constraint import GrammarVocab

                self._grammar_vocab = GrammarVocab(self.tokenizer, self.config.n_vocab)
            return self._grammar_vocab

    def make_constraint(self, json_schema=None, grammar=None):
        """A runtime.constraint.Constraint for this model: ``json_schema`` (a dict or JSON text; {"type":
        "object"} is OpenAI's json_object) or ``grammar`` (GBNF text). PyllmError names an invalid one."""
        from .runtime.constraint import make_constraint

        return make_constraint(lambda: self.grammar_vocab, json_schema=json_schema, grammar=grammar)

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

    def _spec_settings(self, speculative, spec_k, spec_ngram, sampler):
        from .runtime.speculative import parse_speculative

        o = self.spec_options
        if speculative == "auto":  # spec_options, else greedy decoding speculates as DEFAULT_SPECULATIVE says
            speculative = o.get("speculative")
            if speculative is None and sampler.s.temperature == 0 and self._rows_exact():
                speculative = DEFAULT_SPECULATIVE
        spec = parse_speculative(speculative, k=o.get("spec_k") if spec_k is None else spec_k,
                                 ngram=o.get("spec_ngram") if spec_ngram is None else spec_ngram, draft=self.draft)
        if spec is not None and spec.mode == "draft" and sampler.constraint is not None:
            # the draft model samples without the grammar: its proposal distributions would need the grammar's
            # state after each drafted token
            return None
        return spec

    def _rows_exact(self) -> bool:
        """Whether a verification pass gives each row a one-token step's logits bit for bit (the CPU's C++ step
        over quantized matrices), so speculating cannot change a greedy reply."""
        if not getattr(self.model, "use_cpp_decode", False):
            return False
        return bool(getattr(self.model.fused_step(self.kv), "rows_exact", False))

    def generate_tokens(self, ids: list[int], max_tokens: int = 256, temperature: float = 0.8, top_k: int = 40,
                        top_p: float = 0.95, min_p: float = 0.05, seed: int | None = None,
                        sampler: Sampler | None = None, json_schema=None, grammar: str | None = None,
                        constraint=None, speculative="auto", spec_k: int | None = None,
                        spec_ngram: int | None = None, **sampling) -> Iterator[int]:
        """Iterator of generated ids (an end-of-generation id is yielded, then it stops). max_tokens None or -1:
        until the context is full. The arguments are checked here, when the call is made (PyllmError), not at the
        iterator's first ``next()``.

        Structured output (at most one): ``json_schema`` (dict or JSON text), ``grammar`` (llama.cpp GBNF text) or
        a prebuilt ``constraint`` (LLM.make_constraint; one per generation). Only tokens the grammar allows are
        sampled; when the output is complete the end-of-generation id is yielded at once (finish_reason "eog").

        speculative: "none"/None/False (one token per step), "lookup"/True (prompt lookup), "draft" (the model set
        by set_draft / load(draft=)), or "auto" (``spec_options``, else DEFAULT_SPECULATIVE for greedy decoding
        where verification is exact (the CPU's C++ step over quantized matrices), else none); spec_k: most tokens
        drafted per step (1..7); spec_ngram: longest suffix looked up (runtime/speculative.py). Under a grammar,
        lookup drafts the tokens the grammar forces where it forces some; a draft model does not speculate there.
        """
        ids, max_tokens, sampler = self.generation_request(
            ids, max_tokens, sampler=sampler, json_schema=json_schema, grammar=grammar, constraint=constraint,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, **sampling)
        spec = self._spec_settings(speculative, spec_k, spec_ngram, sampler)
        return self._token_stream(ids, max_tokens, sampler, spec)

    def generation_request(self, ids, max_tokens=256, sampler: Sampler | None = None, json_schema=None,
                           grammar: str | None = None, constraint=None, **sampling) -> tuple[list[int], int, Sampler]:
        """(ids, max_tokens, sampler) of one generation, checked as generate_tokens checks them (PyllmError): the
        prompt's ids, max_tokens (None or -1: n_ctx), and ``sampler`` or a new one from ``sampling`` (temperature,
        top_k, ...), with the structured-output constraint set and the prompt's tail in its penalty window.  What
        every caller that generates tokens (this LLM, the server's batched engine) starts from."""
        self.check_generates()
        from .runtime.constraint import make_constraint

        ids = self._check_ids(ids)
        max_tokens = self.check_max_tokens(max_tokens)
        constraint = make_constraint(lambda: self.grammar_vocab, json_schema, grammar, constraint)
        if sampler is None:
            sampler = Sampler(SamplerSettings(**check_sampling(dict(sampling), self.n_vocab)))
        if constraint is not None:
            sampler.constraint = constraint
        for t in ids[-sampler.s.penalty_last_n:] if sampler.s.penalty_last_n else ():
            sampler.accept(t)
        return ids, max_tokens, sampler

    def generate_tokens_batch(self, calls: list[dict]) -> list:
        """Several generations at once: ``calls`` holds generate_tokens' keyword arguments for each (ids,
        max_tokens, sampling settings or a sampler, a constraint; no speculation).  Returns one iterator of ids per
        call, each with its own ``stats``.  They run in one engine (runtime/batch.py BatchEngine) in this thread:
        reading any of them steps every running one, their decode tokens batched into one step of the model
        (greedy tokens as each call's alone), calls with the same prompt forked from one prefill.  Each sequence
        has a KV cache of its own, of its prompt + max_tokens positions, for the duration of the call; the LLM's
        own cache (what generate reuses between calls) is left as it was."""
        from .runtime.batch import MAX_BATCH, BatchEngine, BatchStats, TokenStream, make_requests

        prepared = [self.generation_request(**c) for c in calls]
        if not prepared:
            return []
        reqs, top = make_requests(prepared)
        slots = min(len(reqs), max(MAX_BATCH, max(1 + len(r.forks) for r in top)))
        rows = min(self.n_ctx, max(len(r.ids) + r.max_tokens for r in reqs))
        try:  # the caches are this call's own: refused before they are allocated where they cannot fit
            plan_kv_cache(self.config, max(8, slots * rows), self.kv.kind, check_memory=self.device == "cpu")
        except KVCacheMemoryError as e:
            raise KVCacheMemoryError(f"{slots} sequences of {rows} positions at once: {e}") from None
        engine = BatchEngine(self.model, self.kv.kind, self.n_ctx, slots, self.tokenizer.is_eog,
                             nonfinite=self._nonfinite_error, thread=False, max_seq=rows)
        engine.guard = self._lock
        self.generator.stats = BatchStats(reqs, top)
        for r in top:
            engine.submit(r)
        return [TokenStream(r, engine.tokens(r), sampler) for r, (_, _, sampler) in zip(reqs, prepared)]

    def generate_batch(self, prompts: list, max_tokens: int = 256, stop: str | list[str] | None = None,
                       **sampling) -> list[str]:
        """Completions of several ``prompts`` (texts or token-id lists) at once: generate's text for each, the
        sequences decoded together (generate_tokens_batch).  A greedy prompt gets the text it gets alone from
        generate_batch([prompt]); a seeded one draws from its own sampler.  No speculation (``speculative`` is
        ignored): the batch is the speedup."""
        from .api import Run, start_runs

        if not isinstance(prompts, (list, tuple)):
            raise PyllmError(f"generate_batch takes a list of prompts, got {type(prompts).__name__}")
        max_tokens = self.check_max_tokens(max_tokens)
        sampling = check_sampling(sampling, self.n_vocab)
        if "sampler" in sampling or "constraint" in sampling:
            raise PyllmError("generate_batch takes sampling settings (each prompt gets a sampler of its own), not a "
                             "sampler or a constraint")
        stop = stop_list(stop)
        runs = []
        for p in prompts:
            ids = self._prompt_ids(p)
            if len(ids) >= self.n_ctx:
                raise ContextFullError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx}; use "
                                       f"a larger n_ctx (--ctx) or a shorter prompt")
            sampler = Sampler(SamplerSettings(**{**DEFAULT_SAMPLING, **{k: v for k, v in sampling.items()
                                                                      if k not in _GENERATION_KEYWORDS}}))
            constraint = {k: sampling[k] for k in ("json_schema", "grammar") if k in sampling}
            runs.append(Run(self, ids, min(max_tokens, self.n_ctx - len(ids)), stop, sampler,
                            {"constraint": self.make_constraint(**constraint)} if constraint else {}))
        start_runs(self, runs)
        for r in runs:
            for _ in r.pieces():
                pass
        return [r.text for r in runs]

    @property
    def engine(self):
        """The engine (runtime/batch.py BatchEngine) that runs this LLM's own generations, in the caller's thread:
        each a request on ``generator``, the sequence whose cache is kept between calls."""
        engine = self.__dict__.get("_engine")
        if engine is None:
            from .runtime.batch import BatchEngine

            engine = self._engine = BatchEngine(self.model, self.kv.kind, self.n_ctx, 0, self.tokenizer.is_eog,
                                                nonfinite=self._nonfinite_error, thread=False)
        return engine

    def _token_stream(self, ids: list[int], max_tokens: int, sampler: Sampler, spec) -> Iterator[int]:
        """generate_tokens' iterator, over checked arguments: one request on this LLM's sequence (``generator``)
        through the engine, stepped in this thread; holds the LLM's lock from its first ``next()`` to its end or
        ``close()``."""
        from .runtime.batch import Request

        def check(logits, argmax=None):
            check_finite(logits, argmax, self._nonfinite_error)

        def sample(logits, argmax=None):
            check(logits, argmax)
            return sampler.sample_known_argmax(logits, argmax)

        with self._lock:
            self._epoch += 1
            mine = self._epoch
            self._check_file()
            engine = self.engine
            req = Request(ids, max_tokens, sampler, seq=self.generator)
            if spec is not None and max_tokens > 0:
                from .runtime.speculative import SpecDecoder

                req.spec = SpecDecoder(self.generator, ids, spec, sampler, sample, check, max_tokens)
            items = engine.tokens(engine.submit(req))
            read, ended = 0, False
            try:
                while True:
                    self._check_file()  # the next forward pass reads the mapped weights
                    kind, *value = next(items)
                    if kind != "token":
                        ended = True
                        if kind == "error":
                            raise value[0]
                        return
                    read += 1
                    if sampler.logprobs is not None:
                        sampler.last_logprobs = value[1]
                    yield value[0]
                    self._lock.adopt()  # this next() may come from another thread than the last one
                    if self._epoch != mine:
                        raise PyllmError("this generation was superseded: another call on the same LLM (in this "
                                         "thread, while the stream was unfinished) replaced its cache; start it again")
            finally:
                items.close()
                if self._epoch == mine:
                    engine.end(req)
                    if req.spec is not None and not ended and read:
                        # A reader that stops (a stop string) leaves the cache as plain decoding does: without the
                        # last token it read and what the verification accepted after it; otherwise a chat reusing
                        # this prefix would evaluate one row fewer than after plain decoding.
                        self.generator.truncate(min(len(self.generator.tokens), len(ids) + read - 1))

    def _check_file(self) -> None:
        check = getattr(self.gguf, "check_unchanged", None)
        if check is not None:
            check()

    def _nonfinite_error(self, logits) -> ModelError:
        bad = int((~torch.isfinite(logits)).sum())
        where = ""
        culprit = self._find_nonfinite_weight()
        if culprit:
            where = f"; tensor {culprit!r} holds NaN or Inf values"
        elif not all(map(math.isfinite, (self.config.rms_eps, self.config.rope_base))):
            where = "; a hyper-parameter (rms epsilon or rope base) is not finite"
        return ModelError(f"{self.path.name}: the model produced non-finite logits ({bad} of {logits.numel()} "
                          f"are NaN or Inf){where}: the file's weights or hyper-parameters are broken")

    def _find_nonfinite_weight(self) -> str | None:
        """The first weight with a NaN or Inf (only looked for once generation has gone non-finite)."""
        for name, w in self.weights.items():
            try:
                t = w.dequantize() if hasattr(w, "dequantize") else w
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    return name
            except Exception:  # a weight that cannot even be dequantized is not the one to report here
                continue
        return None

    def check_max_tokens(self, max_tokens) -> int:
        """``max_tokens`` as an int >= 0; None or -1: until the context is full (n_ctx, an upper bound the context
        reaches first), as llama-cpp-python and this library's create_completion take it."""
        if max_tokens is None or (isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
                                  and max_tokens == -1):
            return self.n_ctx
        try:
            return check_int("max_tokens", max_tokens, 0)
        except PyllmError:
            raise PyllmError(f"max_tokens must be an integer >= 0, or None/-1 for until the context is full, got "
                             f"{max_tokens!r}") from None

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            self.check_prompt_fits(prompt)
            return self.tokenize(prompt)
        return self._check_ids(prompt)

    def generate(self, prompt: str | list[int], max_tokens: int = 256, stop: str | list[str] | None = None,
                 stream: bool = False, **sampling) -> str | Iterator[str]:
        """Completion of ``prompt`` (text, or token ids). stream=True gives an iterator of text pieces. max_tokens
        None or -1: until the context is full."""
        max_tokens = self.check_max_tokens(max_tokens)  # now, not at the first next() of a stream
        sampling = check_sampling(sampling, self.n_vocab)
        stop = stop_list(stop)
        it = self._stream_text(self._prompt_ids(prompt), max_tokens, stop, sampling)
        return it if stream else "".join(it)

    def _stream_text(self, ids: list[int], max_tokens: int, stop: list[str], sampling: dict) -> Iterator[str]:
        from .runtime.constraint import make_constraint
        from .runtime.stop_strings import OutputText

        sampling = dict(sampling)
        # built here, not in generate_tokens, so that a stop string can ask it whether the output is complete
        constraint = make_constraint(lambda: self.grammar_vocab, sampling.pop("json_schema", None),
                                     sampling.pop("grammar", None), sampling.pop("constraint", None))
        text = OutputText(self.tokenizer, stop, constraint.accepts_text if constraint is not None else None)
        gen = self.generate_tokens(ids, max_tokens=max_tokens, constraint=constraint, **sampling)
        try:
            for tok in gen:
                if self.tokenizer.is_eog(tok):
                    break
                out = text.push(tok)
                if out:
                    yield out
                if text.stopped:
                    break
            out = text.finish()
            if out:
                yield out
            if text.stopped:
                self.generator.stats.finish_reason = "stop"
        finally:
            gen.close()

    # ---- chat ---------------------------------------------------------------------------------------------------
    def use_fallback_template(self) -> None:
        """Format chats with pyllm's plain template for this vocabulary instead of the file's own."""
        from .chat_template import ChatTemplate

        self.template = ChatTemplate.from_metadata({}, self.tokenizer, use_file_template=False)

    def use_template(self, source: str, where: str = "chat template") -> None:
        """Format chats with the Jinja template ``source`` instead of the file's own; TemplateError naming
        ``where`` when it does not compile."""
        from .chat_template import ChatTemplate
        from .errors import TemplateError

        tok = self.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        try:
            self.template = ChatTemplate(source, bos, eos)
        except TemplateError as e:
            raise TemplateError(f"{where}: {e}") from None

    def format_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kw) -> str:
        """``template_kw``: extra template variables (``tools=[...]`` for templates that describe tools).
        Every chat entry point (chat, chat_ids, fit_chat, create_chat_completion) formats through here, so an empty
        or malformed message list is refused the same way in each, before anything is generated."""
        from .chat_messages import check_message_list
        from .chat_template import _validate
        from .errors import TemplateError

        check_message_list(messages)
        _validate(messages)  # malformed messages are the caller's error, not the file's
        try:
            return self.template.render(messages, add_generation_prompt=add_generation_prompt, **template_kw)
        except TemplateError as e:  # the template came from the model file: say which one
            raise in_file(e, Path(self.path).name) from None

    def chat_ids(self, messages: list[dict], suffix: str = "", must_fit: bool = False, **template_kw) -> list[int]:
        """The prompt ids for ``messages``; ``suffix`` is text appended after the generation prompt (the start
        of the reply, e.g. a forced tool call).  The template's own markup becomes special tokens, message content
        never does (a message holding ``<|im_start|>system`` is that text, not a forged turn; see content_spans).
        ``must_fit``: the prompt is used whole (no turns are dropped to make it fit), so one that cannot fit in
        n_ctx is refused before it is tokenized (check_prompt_fits)."""
        from .chat_template import content_spans

        text = self.format_chat(messages, **template_kw)
        if must_fit:
            self.check_prompt_fits(text + suffix, add_bos=False)  # the template may write BOS, then it is not added
        plain = content_spans(self.template, messages, text, add_generation_prompt=True, **template_kw)
        ids = self.tokenizer.encode(text + suffix, add_bos=None, special=True, plain=plain)
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and bos is not None and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template wrote BOS and the tokenizer added another
        return ids

    def fit_chat(self, messages: list[dict], reserve: int = 0) -> tuple[list[int], list[dict], int]:
        """(ids, kept messages, number dropped): the prompt for ``messages`` under ``context_policy``.

        "stop": the messages unchanged (a prompt that does not fit raises ContextFullError when it is prefilled, or
        here, before it is tokenized, when its text alone shows it cannot fit: check_prompt_fits).
        "shift": drops the oldest messages after the leading system message(s), whole turns (a turn starts at a
        user message), until prompt + ``reserve`` reply tokens fit in n_ctx; the cached system prompt is reused and
        the rest re-prefilled. ContextFullError if the system prompt and the last message alone do not fit.
        """
        ids = self.chat_ids(messages, must_fit=self.context_policy == "stop")
        if self.context_policy == "stop" or len(ids) + reserve <= self.n_ctx:
            return ids, list(messages), 0
        head = 0
        while head < len(messages) and messages[head].get("role") == "system":
            head += 1
        kept = list(messages)
        while len(ids) + reserve > self.n_ctx and len(kept) - head > 1:
            del kept[head]
            while len(kept) - head > 1 and kept[head].get("role") != "user":
                del kept[head]  # never start the history with an orphaned assistant/tool reply
            ids = self.chat_ids(kept)
        if len(ids) + reserve > self.n_ctx:
            raise ContextFullError(f"the system prompt and the last message take {len(ids)} tokens; with {reserve} "
                                   f"for the reply they exceed n_ctx={self.n_ctx}: use a larger --ctx or a shorter "
                                   f"message")
        return ids, kept, len(messages) - len(kept)

    def chat(self, messages: list[dict], max_tokens: int = 512, stop: str | list[str] | None = None, stream: bool = False,
             **sampling) -> str | Iterator[str]:
        """Reply to ``messages`` ([{"role": ..., "content": ...}]) formatted with the model's chat template.

        With context_policy "shift", old turns that no longer fit are dropped first (count in ``chat_dropped``;
        room is kept for min(max_tokens, n_ctx // 4) reply tokens). A reply that still fills the context stops
        with finish_reason "context".
        """
        self.check_generates()
        max_tokens = self.check_max_tokens(max_tokens)
        sampling = check_sampling(sampling, self.n_vocab)
        stop = stop_list(stop)
        ids, _, self.chat_dropped = self.fit_chat(messages, reserve=min(max_tokens, self.n_ctx // 4))
        it = self._stream_text(ids, max_tokens, stop, sampling)
        return it if stream else "".join(it)

    # ---- OpenAI-shaped API (pyllm/api.py, pyllm/embed.py) ---------------------------------------------------------
    def create_completion(self, prompt, **kw):
        """OpenAI ``/v1/completions`` as llama-cpp-python's ``Llama.create_completion``: a dict, or an iterator of
        chunk dicts with stream=True."""
        from .api import create_completion

        return create_completion(self, prompt, **kw)

    def __call__(self, prompt, **kw):
        """``create_completion``, as llama-cpp-python's ``Llama.__call__``: ``llm("Q: ... A:", max_tokens=32)``."""
        return self.create_completion(prompt, **kw)

    def create_chat_completion(self, messages: list[dict], **kw):
        """OpenAI ``/v1/chat/completions`` as llama-cpp-python's ``Llama.create_chat_completion``."""
        from .api import create_chat_completion

        return create_chat_completion(self, messages, **kw)

    def embed(self, texts, **kw):
        """L2-normalised pooled embeddings: a list of float lists (one per text; a str gives one list)."""
        from .embed import embed

        return embed(self, texts, **kw)

    def create_embedding(self, input, **kw) -> dict:
        """OpenAI ``/v1/embeddings`` response dict."""
        from .embed import create_embedding

        return create_embedding(self, input, **kw)

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
              context_policy=context_policy)
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
    return LLM(ckpt, mdl, kv, mdl.max_pos, n_threads or torch.get_num_threads(), time.perf_counter() - t0)
