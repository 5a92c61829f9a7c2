"""Argument checks that the library's OpenAI-shaped calls (api.py, embed.py) and LLM's generation keywords (llm.py)
share: each refuses a bad value with a BadRequest naming the request parameter that holds it. Kept apart from
api.py so that llm.py, below it, can use them without importing the layer above."""

from __future__ import annotations

import math
import operator

from .errors import BadRequest, shorten


def check_number(name: str, v, lo: float | None = None, hi: float | None = None, integer: bool = False,
                 param: str | None = None):
    """``v`` if it is a finite number in [lo, hi]; else BadRequest naming ``param`` (default: ``name``), the
    request's parameter that holds it."""
    param = param or name
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise BadRequest(f"{name} must be {'an integer' if integer else 'a number'}, got {shorten(repr(v), 60)}",
                         param)
    try:
        finite = math.isfinite(v)
    except OverflowError:  # an integer past a double's range: JSON's numbers have no size limit, nor Python's ints
        raise BadRequest(f"{name} must be a number within a double's range, got an integer of {len(str(abs(v)))} "
                         f"digits", param) from None
    if not finite or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise BadRequest(f"{name} must be {rng}, got {shorten(repr(v), 60)}", param)
    return v


def check_logit_bias(bias, n_vocab: int) -> dict[int, float]:
    if not bias:
        return {}
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias must be an object mapping token ids to a bias", "logit_bias")
    out = {}
    for k, v in bias.items():
        # the decimal digits of a token id, as OpenAI's keys are: int() also takes " 7", "0_7" and "٧" (an
        # Arabic-Indic seven), and spends quadratic time on a key of 4000 digits
        try:
            if isinstance(k, str):
                if not (k.isascii() and k.isdigit() and len(k) <= 12):
                    raise ValueError
                tok = int(k)
            elif isinstance(k, bool):
                raise ValueError
            else:
                tok = operator.index(k)  # an int (numpy's too), as the library's callers pass them
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias key {shorten(repr(k), 60)} is not a token id", "logit_bias") from None
        if not 0 <= tok < n_vocab:
            raise BadRequest(f"logit_bias token id {shorten(tok, 40)} is outside the vocabulary (0..{n_vocab - 1})",
                             "logit_bias")
        out[tok] = float(check_number(f"logit_bias[{shorten(repr(k), 40)}]", v, -100, 100, param="logit_bias"))
    return out


# OpenAI parameters that do not change what is generated: taken and ignored, as the server ignores them
NO_EFFECT_PARAMS = ("user", "metadata", "store", "service_tier", "prediction", "safety_identifier",
                    "prompt_cache_key")


def refuse_unknown(fn, given: dict) -> None:
    """BadRequest naming the first keyword in ``given`` (what ``fn``'s ``**ignored`` caught) that ``fn`` does not
    take, with the nearest name it does. A library call's typo (``temprature=0``) or a llama-cpp-python setting
    pyllm lacks (``mirostat_mode=2``, ``logits_processor=``) was dropped silently: the reply came out sampled as
    if it had not been given. The server never gets here: it passes on only the parameters ``fn`` names."""
    import difflib
    import inspect

    unknown = [k for k in given if k not in NO_EFFECT_PARAMS]
    if not unknown:
        return
    names = [p for p in inspect.signature(fn).parameters if p not in ("llm", "ignored", "cancel")]
    near = difflib.get_close_matches(unknown[0], names, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f"; it takes {', '.join(names)}"
    raise BadRequest(f"{fn.__name__}() got an unknown argument {shorten(repr(unknown[0]), 60)}{hint}", unknown[0])
