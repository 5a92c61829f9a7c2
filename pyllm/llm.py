"""LLM: the public object. Loads a model file and offers tokenize / logits / generate / chat.

One LLM owns one model, one KV cache and one generation loop; calls are serialized by a lock, so two threads
sharing it take turns instead of corrupting the cache.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

from . import registry
from .errors import ContextFullError, PyllmError
from .runtime.generator import GenerationStats, Generator
from .runtime.sampler import Sampler, SamplerSettings

DEFAULT_SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
# What greedy decoding speculates with when the caller does not say (speculative="auto"): "none" until the
# speedup is measured on a quiet machine (docs/BENCHMARKS.md, Speculative decoding).
DEFAULT_SPECULATIVE = "none"


def check_load_args(device: str, backend: str, context_policy: str) -> None:
    """The checks every loader (GGUF here, AWQ in pyllm/awq.py) makes before touching a file."""
    if device != "cpu":
        raise PyllmError(f"device {device!r} is not available in this build (supported: cpu)")
    if backend not in ("fast", "reference"):
        raise PyllmError(f"backend must be 'fast' or 'reference', got {backend!r}")
    _check_policy(context_policy)


def _check_policy(policy: str) -> str:
    if policy not in ("stop", "shift"):
        raise PyllmError(f"context_policy must be 'stop' or 'shift', got {policy!r}")
    return policy


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan_kv_cache(cfg, n_ctx: int, kv_cache: str) -> tuple[int, float, float]:
    """Checks n_ctx and the cache kind, and refuses a cache that will not fit in available memory, before any
    allocation. Returns (n_ctx, bytes per token, total bytes)."""
    from .runtime.kv_cache import KVCache, check_kind

    n_ctx = int(n_ctx) if n_ctx else cfg.n_ctx_train
    if n_ctx < 8:
        raise PyllmError(f"n_ctx must be at least 8, got {n_ctx}")
    check_kind(kv_cache, cfg.head_dim)
    per_token = KVCache.bytes_per_token(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, kv_cache)
    need = per_token * n_ctx
    avail = _available_memory()
    if avail is not None and need > 0.9 * avail:
        raise PyllmError(f"a {kv_cache} KV cache for n_ctx={n_ctx} needs {need / 2**30:.2f} GiB but only "
                         f"{avail / 2**30:.2f} GiB of memory is available; use a smaller --ctx or a smaller "
                         f"--kv type (q8_0, q4_rot, or -ctk/-ctv per part)")
    return n_ctx, per_token, need


class LLM:
    def __init__(self, path: Path, gguf_file, config, weights: dict, tokenizer, template, model, kv, n_ctx: int,
                 device: str, backend: str, n_threads: int, load_seconds: float, context_policy: str = "stop"):
        self.path = path
        self.gguf = gguf_file
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.template = template
        self.model = model
        self.kv = kv
        self.n_ctx = n_ctx
        self.device = device
        self.backend = backend
        self.n_threads = n_threads
        self.load_seconds = load_seconds
        self.context_policy = _check_policy(context_policy)
        self.chat_dropped = 0  # messages the last chat() dropped from the front of its history ("shift")
        self.generator = Generator(model, kv, n_ctx)
        self.draft = None  # the draft LLM for speculative="draft" (set_draft)
        # What generate_tokens' speculative="auto" / spec_k / spec_ngram default to (the CLI's --spec* flags):
        # {"speculative": "lookup", "spec_k": 5, ...}; empty: DEFAULT_SPECULATIVE for greedy decoding.
        self.spec_options: dict = {}
        self._lock = threading.RLock()
        # Bumped by every call that changes the cache. The RLock lets one thread in twice, so a stream left
        # suspended while the same thread starts another call must notice, not continue from a foreign cache.
        self._epoch = 0

    # ---- text <-> ids -------------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def stats(self) -> GenerationStats:
        return self.generator.stats

    @property
    def n_vocab(self) -> int:
        return self.config.n_vocab

    def reset(self) -> None:
        """Forget the cached conversation (the next call prefills from scratch)."""
        with self._lock:
            self._epoch += 1
            self.generator.reset()

    # ---- evaluation ---------------------------------------------------------------------------------------------
    def logits(self, ids: list[int]) -> torch.Tensor:
        """float32 [len(ids), n_vocab]: a fresh evaluation from position 0."""
        ids = self._check_ids(ids)
        with self._lock:
            self._epoch += 1
            return self.generator.evaluate_all(ids).float()

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.config.n_vocab]
        if bad:
            raise PyllmError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.n_vocab - 1})")
        if not ids:
            raise PyllmError("empty prompt: give at least one token")
        return ids

    def set_draft(self, draft) -> None:
        """Use ``draft`` (an LLM, or a model path / registry name to load) for speculative="draft". It must share
        this model's vocabulary (checked: size and a sample of token texts; PyllmError otherwise)."""
        from .runtime.speculative import check_same_vocab

        if draft is not None and not isinstance(draft, LLM):
            draft = load(draft, n_ctx=self.n_ctx, backend=self.backend, quiet=True)
        if draft is not None:
            check_same_vocab(self, draft)
        self.draft = draft

    def _spec_settings(self, speculative, spec_k, spec_ngram, temperature):
        from .runtime.speculative import parse_speculative

        o = self.spec_options
        if speculative == "auto":  # spec_options, else greedy decoding speculates as DEFAULT_SPECULATIVE says
            speculative = o.get("speculative", DEFAULT_SPECULATIVE if temperature == 0 else None)
        return parse_speculative(speculative, k=o.get("spec_k") if spec_k is None else spec_k,
                                 ngram=o.get("spec_ngram") if spec_ngram is None else spec_ngram, draft=self.draft)

    def generate_tokens(self, ids: list[int], max_tokens: int = 256, temperature: float = 0.8, top_k: int = 40,
                        top_p: float = 0.95, min_p: float = 0.05, seed: int | None = None,
                        sampler: Sampler | None = None, speculative="auto", spec_k: int | None = None,
                        spec_ngram: int | None = None, **sampling) -> Iterator[int]:
        """Iterator of generated ids (an end-of-generation id is yielded, then it stops).

        speculative: "none"/None/False (one token per step), "lookup"/True (prompt lookup), "draft" (the model set
        by set_draft / load(draft=)), or "auto" (DEFAULT_SPECULATIVE for greedy decoding, else none); spec_k: most
        tokens drafted per step (1..7); spec_ngram: longest suffix looked up (runtime/speculative.py).
        """
        ids = self._check_ids(ids)
        spec = self._spec_settings(speculative, spec_k, spec_ngram,
                                   temperature if sampler is None else sampler.s.temperature)
        if max_tokens < 0:
            raise PyllmError(f"max_tokens must be >= 0, got {max_tokens}")
        if sampler is None:
            sampler = Sampler(SamplerSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                              seed=seed, **sampling))
        for t in ids[-sampler.s.penalty_last_n:] if sampler.s.penalty_last_n else ():
            sampler.accept(t)
        with self._lock:
            self._epoch += 1
            mine = self._epoch
            inner = self.generator.generate(ids, sampler.sample, max_tokens, self.tokenizer.is_eog, spec=spec,
                                            sampler=sampler)
            try:
                for tok in inner:
                    yield tok
                    if self._epoch != mine:
                        raise PyllmError("this generation was superseded: another call on the same LLM (in this "
                                         "thread, while the stream was unfinished) replaced its cache; start it again")
            finally:
                inner.close()

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        return list(prompt)

    def generate(self, prompt: str | list[int], max_tokens: int = 256, stop: list[str] | None = None,
                 stream: bool = False, **sampling) -> str | Iterator[str]:
        """Completion of ``prompt`` (text, or token ids). stream=True gives an iterator of text pieces."""
        it = self._stream_text(self._prompt_ids(prompt), max_tokens, stop or [], sampling)
        return it if stream else "".join(it)

    def _stream_text(self, ids: list[int], max_tokens: int, stop: list[str], sampling: dict) -> Iterator[str]:
        from .tokenizer import StreamDecoder

        dec = StreamDecoder(self.tokenizer)
        stop = [s for s in stop if s]
        hold = max((len(s) for s in stop), default=1) - 1  # a stop string may still be forming in the tail
        pending = ""
        gen = self.generate_tokens(ids, max_tokens=max_tokens, **sampling)
        try:
            for tok in gen:
                if self.tokenizer.is_eog(tok):
                    break
                pending += dec.push(tok)
                if stop:
                    cut = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
                    if cut >= 0:
                        if cut:
                            yield pending[:cut]
                        self.generator.stats.finish_reason = "stop"
                        return
                    if len(pending) > hold:
                        yield pending[:len(pending) - hold]
                        pending = pending[len(pending) - hold:]
                elif pending:
                    yield pending
                    pending = ""
            pending += dec.flush()
            if pending:
                yield pending
        finally:
            gen.close()

    # ---- chat ---------------------------------------------------------------------------------------------------
    def use_fallback_template(self) -> None:
        """Format chats with pyllm's plain template for this vocabulary instead of the file's own."""
        from .chat_template import ChatTemplate

        self.template = ChatTemplate.from_metadata({}, self.tokenizer, use_file_template=False)

    def format_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.format_chat(messages)
        ids = self.tokenize(text, add_bos=None, special=True)
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and bos is not None and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template wrote BOS and the tokenizer added another
        return ids

    def fit_chat(self, messages: list[dict], reserve: int = 0) -> tuple[list[int], list[dict], int]:
        """(ids, kept messages, number dropped): the prompt for ``messages`` under ``context_policy``.

        "stop": the messages unchanged (a prompt that does not fit raises ContextFullError when it is prefilled).
        "shift": drops the oldest messages after the leading system message(s), whole turns (a turn starts at a
        user message), until prompt + ``reserve`` reply tokens fit in n_ctx; the cached system prompt is reused and
        the rest re-prefilled. ContextFullError if the system prompt and the last message alone do not fit.
        """
        ids = self.chat_ids(messages)
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

    def chat(self, messages: list[dict], max_tokens: int = 512, stop: list[str] | None = None, stream: bool = False,
             **sampling) -> str | Iterator[str]:
        """Reply to ``messages`` ([{"role": ..., "content": ...}]) formatted with the model's chat template.

        With context_policy "shift", old turns that no longer fit are dropped first (count in ``chat_dropped``;
        room is kept for min(max_tokens, n_ctx // 4) reply tokens). A reply that still fills the context stops
        with finish_reason "context".
        """
        ids, _, self.chat_dropped = self.fit_chat(messages, reserve=min(max_tokens, self.n_ctx // 4))
        it = self._stream_text(ids, max_tokens, stop or [], sampling)
        return it if stream else "".join(it)

    # ---- description --------------------------------------------------------------------------------------------
    def info(self) -> dict:
        from .info import model_info

        return model_info(self.gguf, self.config, self.tokenizer, self.template, n_ctx=self.n_ctx,
                          kv_kind=self.kv.kind)

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load(model: str | os.PathLike = registry.DEFAULT_MODEL, device: str = "cpu", n_ctx: int = 4096,
         kv_cache: str = "f16", n_threads: int | None = None, backend: str = "fast", quiet: bool = True,
         context_policy: str = "stop", verbose: bool = False, draft=None) -> LLM:
    """Load a GGUF file (path) or a registry model (name, fetched on first use).

    kv_cache: f16 (default), bf16, f32, q8_0, q8_rot, q4_0, q4_rot, or "KEY/VALUE" such as "f16/q4_rot" (see
    runtime/kv_cache.py). context_policy: what chat()
    does when the conversation outgrows n_ctx: "stop" (ContextFullError / finish_reason "context") or "shift"
    (drop the oldest turns after the system prompt and re-prefill; see LLM.fit_chat).

    draft: a smaller model (path, registry name or LLM) with the same vocabulary, for speculative="draft".

    backend: "fast" runs the fused kernels; "reference" runs float32 matmuls on weights dequantized by the torch
    reference code (cached per weight on first use: for tests and accuracy baselines, not for speed).
    """
    from .linear import linear_functions
    from .chat_template import ChatTemplate
    from .gguf import open_gguf
    from .models import build_model, model_class
    from .models.config import ModelConfig
    from .quant import qtensor_from_gguf
    from .runtime.kv_cache import make_kv_cache
    from .tokenizer import Tokenizer

    t0 = time.perf_counter()
    check_load_args(device, backend, context_policy)
    path = registry.resolve(model, quiet=quiet)
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face folder: AWQ (pyllm/awq.py)
        from .awq import load_awq; return load_awq(path, device, n_ctx, kv_cache, n_threads, backend, quiet, context_policy)  # noqa: E702
    if path.is_dir():
        raise PyllmError(f"{path}: is a directory, not a model file")
    gf = open_gguf(path)
    try:
        cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
        model_class(cfg)  # an unsupported architecture fails before any other work
        n_ctx, per_token, need = plan_kv_cache(cfg, n_ctx, kv_cache)
        if verbose:
            print(f"KV cache: {kv_cache}, {per_token / 1024:.1f} KiB per token, {need / 2**20:.1f} MiB for "
                  f"n_ctx={n_ctx}", file=sys.stderr)
        weights = {name: qtensor_from_gguf(gf, name) for name in gf.tensors}
        tok = Tokenizer.from_gguf(gf.metadata)
        template = ChatTemplate.from_metadata(gf.metadata, tok)
        if n_threads:
            torch.set_num_threads(n_threads)
        linear, embed = linear_functions(backend, n_threads)
        mdl = build_model(cfg, weights, linear, embed, max_pos=n_ctx)
        kv = make_kv_cache(kv_cache, cfg.n_layer, cfg.n_kv_head, n_ctx, cfg.head_dim)
    except BaseException:
        gf.close()
        raise
    llm = LLM(path, gf, cfg, weights, tok, template, mdl, kv, n_ctx, device, backend,
              n_threads or torch.get_num_threads(), time.perf_counter() - t0, context_policy=context_policy)
    if draft is not None:  # a draft model for speculative decoding (same vocabulary, checked)
        try:
            llm.set_draft(draft)
        except BaseException:
            llm.close()
            raise
    return llm
