"""Perplexity and KL divergence against a base KV cache, with llama.cpp's protocol (tools/perplexity).

Protocol (as llama.cpp's ``perplexity``): tokenize the whole text once (BOS first where the model adds one), cut
it into ``len(tokens) // n_ctx`` chunks of n_ctx tokens, overwrite each chunk's first token with BOS (where the
model adds one), evaluate the chunk from position 0 and score only its second half: the logits at positions
first .. n_ctx-2 (first = n_ctx // 2) against the tokens at first+1 .. n_ctx-1, i.e. n_ctx - 1 - first tokens per
chunk. PPL = exp(mean NLL); its standard error, as llama.cpp prints it, is ppl * sqrt((E[nll^2] - E[nll]^2) /
(count - 1)). KL divergence is KL(base || kind) = sum_v p_base (log p_base - log p_kind) per scored token, its mean
± standard error, plus how often the top-1 token agrees.

Reading the cache. ``Transformer.forward`` attends a fresh prompt's first rows to their own float32 keys, so a chunk
evaluated in one pass would read the cache little, and every cache type would score alike there.  Each chunk is
therefore evaluated in two passes: the context half (positions 0..first-1, stored into every cache being compared;
its own attention runs over a float32 cache, so that it is the same for all of them) and then the scored half
(positions first..n_ctx-2) in one batch at start_pos = first, which reads every key and value -- the context half's and its own -- back from the
cache. All scored logits thus come from attention over the cache type being measured, as in llama.cpp where
attention always reads the (quantized) cache. The context half is computed once and stored into every cache
type being compared (its result does not depend on the cache), which saves a third of the work for 4 types.

Uses the model's forward pass like ``LLM.logits`` does, with caches of its own: the LLM's cache and cached
conversation are left untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import PyllmError
from .runtime.kv_cache import KVCache


@dataclass
class Stats:
    """Running sums of one cache type's scores."""

    kind: str
    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0
    kld: float = 0.0
    kld2: float = 0.0
    same_top1: int = 0
    running: list = field(default_factory=list)  # PPL after each chunk

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count) if self.count else float("nan")

    @property
    def ppl_err(self) -> float:
        """llama.cpp's: ppl * sqrt(var(nll) / (count - 1))."""
        if self.count < 2:
            return float("nan")
        m = self.nll / self.count
        var = self.nll2 / self.count - m * m
        return self.ppl * math.sqrt(var / (self.count - 1)) if var > 0 else 0.0

    @property
    def kld_mean(self) -> float:
        return self.kld / self.count if self.count else float("nan")

    @property
    def kld_err(self) -> float:
        if self.count < 2:
            return float("nan")
        m = self.kld / self.count
        var = self.kld2 / self.count - m * m
        return math.sqrt(max(var, 0.0) / (self.count - 1))

    def as_dict(self, with_kl: bool) -> dict:
        d = dict(kv=self.kind, ppl=self.ppl, ppl_err=self.ppl_err, tokens=self.count, running=self.running)
        if with_kl:
            d.update(kld=self.kld_mean, kld_err=self.kld_err, same_top1=self.same_top1 / max(self.count, 1))
        return d


class _Tee:
    """Stores a context half into several caches at once; its own attention runs over the first of them, a float32
    cache (what the half's result must not depend on: the caches being compared)."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches

    def update(self, layer, pos, k, v, q=None) -> None:
        for c in self.caches:
            c.update(layer, pos, k, v, q=q)

    def attend(self, *args):
        return self.caches[0].attend(*args)


MAX_TEXT_BYTES = 64 << 20  # the most text `pyllm perplexity -f` reads (~16M tokens: far more than any run scores)


def chunk_tokens(llm, text: str, n_ctx: int) -> tuple[list[int], int | None]:
    """The text's tokens (BOS first where the model adds one) and the BOS id to put at each chunk start (or None)."""
    tok = llm.tokenizer
    add_bos = bool(tok.add_bos and tok.bos_id is not None)
    ids = llm.tokenize(text, add_bos=add_bos, special=False)
    if len(ids) < 2 * n_ctx:
        raise PyllmError(f"the text has {len(ids)} tokens; perplexity with a context of {n_ctx} needs at least "
                         f"{2 * n_ctx} (2 x context): use a smaller -c or a longer text")
    return ids, tok.bos_id if add_bos else None


def kl_divergence(base_lp: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """KL(base || other) per row, from log-probabilities [..., n_vocab] (llama.cpp's --kl-divergence)."""
    return (base_lp.exp() * (base_lp - lp)).sum(-1)


def evaluate(llm, text: str, n_ctx: int = 512, kinds: list[str] | tuple[str, ...] = ("f16",),
             kl_base: str | None = None, n_chunks: int | None = None,
             on_chunk: Callable[[int, int, dict[str, Stats]], None] | None = None) -> dict[str, Stats]:
    """Perplexity of ``llm`` on ``text`` with each KV cache kind in ``kinds`` (and KL against ``kl_base``).

    Returns {kind: Stats}; the base kind is included when kl_base is given. on_chunk(i, n, stats) is called after
    each chunk (for running output).
    """
    if n_ctx < 8 or n_ctx % 2:
        raise PyllmError(f"perplexity context must be an even number >= 8, got {n_ctx}")
    if n_ctx > llm.n_ctx:
        raise PyllmError(f"perplexity context {n_ctx} exceeds the model's loaded n_ctx={llm.n_ctx}")
    ids, bos = chunk_tokens(llm, text, n_ctx)
    n = len(ids) // n_ctx
    if n_chunks is not None and n_chunks > 0:
        n = min(n, n_chunks)
    order = ([kl_base] if kl_base else []) + [k for k in kinds if k != kl_base]
    cfg = llm.config
    # on the model's device: the backend places its caches
    caches = {k: llm.model.backend.make_kv_cache(k, cfg.n_layer, cfg.n_kv_head, n_ctx, cfg.head_dim) for k in order}
    exact = llm.model.backend.make_kv_cache("f32", cfg.n_layer, cfg.n_kv_head, n_ctx, cfg.head_dim)
    stats = {k: Stats(k) for k in order}
    first = n_ctx // 2
    model = llm.model
    with llm._lock, torch.inference_mode():
        for i in range(n):
            chunk = ids[i * n_ctx:(i + 1) * n_ctx]
            if bos is not None:
                chunk[0] = bos
            target = torch.tensor(chunk[first + 1:], dtype=torch.int64)  # [n_ctx - 1 - first]
            model.forward(torch.tensor(chunk[:first], dtype=torch.int64), 0, _Tee([exact] + list(caches.values())))
            base_lp = None
            for kind in order:
                logits = model.forward(torch.tensor(chunk[first:-1], dtype=torch.int64), first, caches[kind],
                                       all_logits=True)
                lp = torch.log_softmax(logits.float(), dim=-1)  # [n_ctx - 1 - first, n_vocab]
                nll = -lp.gather(1, target[:, None]).squeeze(1).double()
                st = stats[kind]
                st.nll += nll.sum().item()
                st.nll2 += nll.pow(2).sum().item()
                st.count += nll.numel()
                if kl_base and kind == kl_base:
                    base_lp = lp
                elif base_lp is not None:
                    kl = kl_divergence(base_lp, lp).double()  # [scored]
                    st.kld += kl.sum().item()
                    st.kld2 += kl.pow(2).sum().item()
                    st.same_top1 += int((base_lp.argmax(-1) == lp.argmax(-1)).sum())
                st.running.append(st.ppl)
                del logits, lp
            if on_chunk:
                on_chunk(i, n, stats)
    return stats


def format_table(model_name: str, stats: dict[str, Stats], kl_base: str | None) -> str:
    """Markdown rows: kind | PPL ± err | ΔPPL vs base | mean KLD ± err | same top-1."""
    base = stats.get(kl_base) if kl_base else None
    lines = [f"| model | KV | PPL | ΔPPL vs {kl_base or '-'} | mean KLD vs {kl_base or '-'} | same top-1 |",
             "|---|---|---|---|---|---|"]
    for kind, st in stats.items():
        dppl = f"{(st.ppl / base.ppl - 1) * 100:+.2f}%" if base else "-"
        if base is None or kind == kl_base:
            kl = top = "-"
        else:
            kl = f"{st.kld_mean:.5f} ± {st.kld_err:.5f}"
            top = f"{100 * st.same_top1 / max(st.count, 1):.1f}%"
        lines.append(f"| {model_name} | {kind} | {st.ppl:.4f} ± {st.ppl_err:.4f} | {dppl} | {kl} | {top} |")
    return "\n".join(lines)
