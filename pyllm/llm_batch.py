"""LLM's batch calls: several generations at once in one engine (runtime/batch.py), in the caller's thread."""

from __future__ import annotations

from .errors import ContextFullError, KVCacheMemoryError, PyllmError
from .llm_args import _GENERATION_KEYWORDS, DEFAULT_SAMPLING, check_sampling, plan_kv_cache
from .runtime.sampler import Sampler, SamplerSettings
from .runtime.stop_strings import stop_list


class BatchCalls:
    """The batch half of LLM (pyllm/llm.py): generate_tokens_batch and generate_batch."""

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
