"""What LLM's calls take, checked: sampling settings, seeds, integer arguments, the context policy, and the KV
cache's size against the memory there is (pyllm/llm.py and its parts, the CLI and the server share them)."""

from __future__ import annotations

from .errors import KVCacheMemoryError, PyllmError
from .runtime.sampler import SamplerSettings

DEFAULT_SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
# What greedy decoding speculates with when the caller does not say (speculative="auto"), where the model's fused
# step verifies rows exactly (CpuDecodeStep.rows_exact: the tokens are then plain decoding's).  Prompt lookup
# measured 0.99-3.5x plain decoding on the dense fixtures over seven prompt kinds, open-ended ones included (the
# controller falls back to plain steps when drafts fail; docs/BENCHMARKS.md, "Speculative decoding").
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
