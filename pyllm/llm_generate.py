"""LLM's generation calls: logits and prompt scoring, generate_tokens / generate (one request on the LLM's own
sequence through the engine, runtime/batch.py), their argument checks and the non-finite logits report."""

from __future__ import annotations

import math
from typing import Iterator

import torch

from .errors import ModelError, PyllmError
from .llm_args import DEFAULT_SPECULATIVE, check_int, check_sampling
from .runtime.sampler import Sampler, SamplerSettings
from .runtime.stop_strings import stop_list


class GenerationCalls:
    """The generation half of LLM (pyllm/llm.py): what runs the model for one prompt."""

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

    def spec_settings(self, speculative, spec_k, spec_ngram, sampler):
        """What a generation with ``sampler`` speculates with (speculative.SpecSettings), or None: the arguments as
        generate_tokens takes them, "auto" resolved by ``spec_options`` and DEFAULT_SPECULATIVE."""
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
        spec = self.spec_settings(speculative, spec_k, spec_ngram, sampler)
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

        with self._lock:
            self._epoch += 1
            mine = self._epoch
            self._check_file()
            engine = self.engine
            req = Request(ids, max_tokens, sampler, seq=self.generator)
            if spec is not None and max_tokens > 0:
                engine.speculate(req, spec)
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
                items.close()  # which hands this thread's OpenMP workers back (BatchEngine.tokens)
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
