"""OpenAI-shaped completions over an LLM, as llama-cpp-python's ``Llama.create_completion`` /
``create_chat_completion``: the same keyword arguments, the same response dicts, iterators of chunk dicts when
``stream=True``. The server (pyllm/server/) serves exactly these dicts.

Arguments are checked when the call is made, before anything is generated, so a streaming call with a bad
argument raises at once instead of failing inside the stream.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

from .chat_messages import (CALL_STARTS, TOOL_OPEN, TOOL_SYSTEM_FALLBACK, calls_as_text, check_tools, forced_call,
                            legacy_functions, normalize_messages, parse_tool_calls)
from .errors import BadRequest, ContextFullError, PyllmError, shorten
from .infill import suffix_ids
from .request_checks import check_logit_bias, check_number, refuse_unknown
from .runtime.sampler import Sampler, SamplerSettings
from .runtime.stop_strings import OutputText, stop_list
from .structured_output import structured_output_kwargs


# ---------------------------------------------------------------------------------------------- argument checks


def _flag(name: str, v, param: str | None = None) -> bool:
    """A documented boolean: true, false or null (false). Anything else would pass on its truthiness ("false")."""
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {v!r}", param or name)
    return v


def _stop_list(stop) -> list[str]:
    try:
        return stop_list(stop)
    except PyllmError as e:
        raise BadRequest(str(e), "stop") from None




def _sampler(llm, temperature, top_p, top_k, min_p, typical_p, repeat_penalty, presence_penalty, frequency_penalty,
             logit_bias, seed, n_logprobs: int | None) -> Sampler:
    check_number("temperature", temperature, 0)
    check_number("top_p", top_p, 0, 1)
    check_number("top_k", top_k, 0, integer=True)
    check_number("min_p", min_p, 0, 1)
    check_number("typical_p", typical_p, 0, 1)
    check_number("presence_penalty", presence_penalty, -2, 2)
    check_number("frequency_penalty", frequency_penalty, -2, 2)
    check_number("repeat_penalty", repeat_penalty, 0)
    if seed is not None:
        check_number("seed", seed, integer=True)
    if top_p == 0:  # nothing but the most likely token survives: greedy (the sampler's top_p range is (0, 1])
        temperature, top_p = 0, 1.0
    settings = SamplerSettings(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                               min_p=float(min_p), typical_p=float(typical_p), repeat_penalty=float(repeat_penalty),
                               frequency_penalty=float(frequency_penalty), presence_penalty=float(presence_penalty),
                               logit_bias=check_logit_bias(logit_bias, llm.n_vocab),
                               # -1: a random seed, as in llama.cpp, llama-cpp-python and pyllm's other entry
                               # points; other negative seeds (OpenAI takes any int64) are folded into range
                               seed=None if seed is None or seed == -1 else int(seed) & (2**63 - 1))
    try:
        s = Sampler(settings)
    except PyllmError as e:  # a bound check_number leaves to the sampler (an open end): its message names the setting
        named = re.match(r"sampler setting (\w+)=", str(e))
        raise BadRequest(str(e), named and named.group(1)) from None
    s.logprobs = n_logprobs
    return s


def _max_tokens(llm, n_prompt: int, max_tokens) -> int:
    if n_prompt >= llm.n_ctx:
        raise ContextFullError(f"the prompt has {n_prompt} tokens but the context holds {llm.n_ctx}; use a larger "
                               f"context (--ctx) or a shorter prompt")
    room = llm.n_ctx - n_prompt
    if max_tokens is None or max_tokens == -1:  # llama-cpp-python: None / -1 = until the context is full
        return room
    check_number("max_tokens", max_tokens, 0, integer=True)
    return min(max_tokens, room)


# ------------------------------------------------------------------------------------------------ token stream
@dataclass
class TokenInfo:
    id: int
    text: str
    logprob: float | None = None
    top: list[tuple[str, float]] | None = field(default_factory=list)  # None: not reported (a prompt's first token)
    bytes: list[int] = field(default_factory=list)
    top_bytes: list[list[int]] = field(default_factory=list)  # each of ``top``'s own bytes (its text may hold U+FFFD)
    # Where the token starts in the output text, in characters: the characters the tokens before it decode to.
    # Counting the tokens' own texts instead drifts where a token holds part of a character (its text is U+FFFD).
    offset: int = 0


@dataclass
class Run:
    """One generation: its prompt, its settings, and what it produced (filled in while it streams)."""
    llm: Any
    ids: list[int]
    max_tokens: int
    stop: list[str]
    sampler: Sampler
    constraint: dict
    cancel: Any = None  # a threading.Event: set, the generation stops at its next token
    gen: Any = None  # its token iterator where start_runs started it with others, else made by pieces()
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.ids), "completion_tokens": self.completion_tokens,
                "total_tokens": len(self.ids) + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def pieces(self) -> Iterator[tuple[str, list[TokenInfo]]]:
        """(text, tokens) pieces as they become final: text is held back while a stop string may be forming;
        ``tokens`` are those whose text starts within the text released so far (for logprobs). A token that
        starts where a stop string ended the output is not part of the output, so its logprob is not reported
        (as llama.cpp's server drops the stop string's tokens); one the cut falls inside is kept."""
        llm, tok = self.llm, self.llm.tokenizer
        grammar = self.constraint.get("constraint")
        text = OutputText(tok, self.stop, grammar.accepts_text if grammar is not None else None)
        tail = ""
        # Logprobs wait for their token's text to be released; each starts at ``text.decoded``, the characters
        # decoded before it (the decoder holds back a character's first bytes until it is complete).
        queued: list[TokenInfo] = []

        def ready(end: int) -> list[TokenInfo]:
            n = next((i for i, info in enumerate(queued) if info.offset >= end), len(queued))
            out = queued[:n]
            del queued[:n]
            return out

        self.finish_reason = "length"
        if self.max_tokens == 0:
            return
        gen = self.gen
        if gen is None:
            gen = llm.generate_tokens(self.ids, max_tokens=self.max_tokens, sampler=self.sampler, **self.constraint)

        def stats():  # the run's own generation statistics: a batched stream carries them
            return getattr(gen, "stats", None) or llm.stats

        try:
            for t in gen:
                if self.cancel is not None and self.cancel.is_set():
                    self.finish_reason = "cancelled"
                    break
                self.completion_tokens += 1
                if self.completion_tokens == 1:
                    self.cached_tokens = stats().prompt_cached
                if tok.is_eog(t):
                    self.finish_reason = "stop"
                    break
                if self.sampler.logprobs is not None:
                    queued.append(_token_info(tok, t, *(self.sampler.last_logprobs or (None, [])), text.decoded))
                out = text.push(t)
                if text.stopped:
                    tail = out
                    break
                if out:
                    self.text += out
                    yield out, ready(len(self.text))
            tail += text.finish()  # also after a stop token: its bytes pending make U+FFFD, not nothing
            if text.stopped:
                self.finish_reason = "stop"
                infos = ready(len(self.text) + len(tail))  # the rest start in or after the stop string
            else:
                if stats().finish_reason == "context":
                    self.finish_reason = "length"
                infos = list(queued)
            if tail or infos:
                self.text += tail
                yield tail, infos
        finally:
            gen.close()

    def prompt_infos(self, prefix: str) -> list[TokenInfo]:
        """The prompt's tokens as logprobs entries, for an echoed prompt: each one's log-probability given the
        tokens before it and the sampler's number of most likely tokens there, with offsets into ``prefix`` (the
        echoed text). The first token has neither (nothing precedes it: OpenAI and llama-cpp-python report null),
        and a BOS the tokenizer added, which the echoed text does not show, is left out. Evaluates the prompt."""
        from .tokenizer import StreamDecoder

        tok, ids = self.llm.tokenizer, self.ids
        scored = self.llm.prompt_logprobs(ids, self.sampler.logprobs or 0) if len(ids) > 1 else []
        bos_shown = prefix.startswith(tok.token_bytes(ids[0]).decode("utf-8", "replace"))
        first = int(ids[0] == tok.bos_id and not bos_shown)
        dec = StreamDecoder(tok)
        out, decoded = [], 0
        for k in range(first, len(ids)):
            lp, top = scored[k - 1] if k > first else (None, None)
            out.append(_token_info(tok, ids[k], lp, top, decoded))
            decoded += len(dec.push(ids[k]))
        return out


def _token_info(tok, t: int, logprob: float | None, top: list[tuple[int, float]] | None, offset: int) -> TokenInfo:
    b = tok.token_bytes(t)
    tops = [(tok.token_bytes(i), v) for i, v in top or ()]
    return TokenInfo(t, b.decode("utf-8", errors="replace"), logprob,
                     None if top is None else [(tb.decode("utf-8", errors="replace"), v) for tb, v in tops],
                     list(b), [list(tb) for tb, _ in tops], offset)


def _new_run(llm, ids, max_tokens, stop, sampling: dict, n_logprobs, constraint, cancel=None) -> Run:
    if not ids:
        raise BadRequest("the prompt is empty", "prompt")
    bad = [i for i in ids if not 0 <= i < llm.n_vocab]
    if bad:
        raise BadRequest(f"token id {shorten(bad[0], 40)} is outside the vocabulary (0..{llm.n_vocab - 1})", "prompt")
    return Run(llm, ids, _max_tokens(llm, len(ids), max_tokens), _stop_list(stop),
               _sampler(llm, n_logprobs=n_logprobs, **sampling), constraint, cancel)


def _model_name(llm, model) -> str:
    return model if isinstance(model, str) and model else llm.path.name


# The sampler settings' defaults (create_completion's and create_chat_completion's, llama-cpp-python's).
SAMPLING_DEFAULTS = dict(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, typical_p=1.0, repeat_penalty=1.0,
                         presence_penalty=0.0, frequency_penalty=0.0)


def _sampling(temperature, top_p, top_k, min_p, typical_p, repeat_penalty, presence_penalty, frequency_penalty,
              logit_bias, seed) -> dict:
    """The sampler keyword arguments, null ones at their defaults: OpenAI's API documents its settings (temperature,
    top_p, the penalties) as "number or null", and clients send null for one they leave unset (it was a 400 "must
    be a number"); llama-server's extras (top_k, min_p, ...) take null the same way."""
    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, typical_p=typical_p,
                 repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                 frequency_penalty=frequency_penalty)
    out = {k: SAMPLING_DEFAULTS[k] if v is None else v for k, v in given.items()}
    return {**out, "logit_bias": logit_bias, "seed": seed}




MAX_CHOICES = 64  # prompts x n of one completion request: each is a sequence with a KV cache of its own


def _choices(n, echo: bool) -> int:
    """The number of choices per prompt, ``n`` (None: 1), checked."""
    if n is None:
        return 1
    check_number("n", n, 1, MAX_CHOICES, integer=True)
    if n > 1 and echo:  # each choice would repeat the prompt (and with logprobs score it again)
        raise BadRequest(f"n={n}: several choices cannot be combined with echo", "n")
    return n


def _prompt_list(prompt) -> list:
    """OpenAI's prompt: a string, token ids, or a batch (a list) of strings or of token-id lists."""
    def ids(p):
        return isinstance(p, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in p)

    if isinstance(prompt, str) or ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str) or ids(p) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise BadRequest(f"the prompt is a batch of {len(prompt)} prompts; at most {MAX_CHOICES} are served "
                             f"per request", "prompt")
        return list(prompt)
    raise BadRequest("prompt must be a string, a list of token ids, or a list of those", "prompt")


def start_runs(llm, runs: list["Run"]) -> None:
    """Starts several runs' generations together where ``llm`` can batch them (``generate_tokens_batch``: the
    engine runs them side by side, choices of one prompt forked from one prefill), so that reading one run's
    tokens after another's costs no more than the longest.  A single run starts when its tokens are first read."""
    batch = getattr(llm, "generate_tokens_batch", None)
    runs = [r for r in runs if r.max_tokens > 0]
    if batch is None or len(runs) < 2:
        return
    streams = batch([dict(ids=r.ids, max_tokens=r.max_tokens, sampler=r.sampler, **r.constraint) for r in runs])
    for r, st in zip(runs, streams):
        r.gen = st


def _check_text_output(modalities, audio) -> None:
    """BadRequest for a request of audio output (OpenAI's ``modalities: ["text", "audio"]`` with ``audio``
    settings): answered with text alone, the client would find no ``message.audio`` where it asked for one."""
    if audio is not None:
        raise BadRequest("audio output is not supported: the model generates text only", "audio")
    if modalities is not None and (not isinstance(modalities, list) or any(m != "text" for m in modalities)):
        raise BadRequest(f"modalities={modalities!r}: the model generates text only ([\"text\"])", "modalities")


# --------------------------------------------------------------------------------------------------- completion
def _completion_logprobs(infos: list[TokenInfo], start: int) -> dict:
    """OpenAI's legacy logprobs object; ``start``: where the completion's text begins in the response's text.
    Each top_logprobs entry holds the chosen token too, as OpenAI documents ("up to logprobs+1 elements") and
    llama-cpp-python and vLLM serve it: a sampled token outside the N most likely would otherwise be missing from
    it, and logprobs=0 would give empty entries."""
    out = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
    for t in infos:
        out["tokens"].append(t.text)
        out["text_offset"].append(start + t.offset)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append(None if t.top is None else {**dict(t.top), t.text: t.logprob})
    return out


def create_completion(llm, prompt: str | list[int], suffix: str | None = None, max_tokens: int | None = 16,
                      temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                      typical_p: float = 1.0, stop: str | list[str] | None = None, seed: int | None = None,
                      stream: bool = False, logprobs: int | None = None, echo: bool = False,
                      repeat_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                      logit_bias: dict | None = None, model: str | None = None, n: int | None = None,
                      best_of: int | None = None, response_format: dict | None = None, grammar: str | None = None,
                      json_schema: dict | None = None, stream_options: dict | None = None, cancel=None,
                      **ignored):
    """OpenAI text completion of ``prompt`` (a string, or token ids). Returns the response dict, or with
    ``stream=True`` an iterator of ``text_completion`` chunk dicts (the last one carries finish_reason; with
    ``stream_options={"include_usage": True}`` one more carries usage). ``logprobs=N`` adds the top N per token,
    with ``echo`` the prompt's tokens too (the first one's null), as OpenAI's and llama-cpp-python's do.
    ``cancel``: a threading.Event that stops the generation at its next token (finish_reason "cancelled").
    ``suffix`` (non-empty): the text fills the middle between ``prompt`` and ``suffix``, prompted with the model's
    fill-in-the-middle tokens (pyllm/infill.py); a BadRequest for a model without them."""
    llm.check_generates()
    refuse_unknown(create_completion, ignored)
    if best_of is not None:
        # OpenAI generates best_of candidates and returns the n most likely; answering one of one as if it were the
        # best of several would pass off an ordinary sample as a selected one
        check_number("best_of", best_of, 1, integer=True)
        if best_of != 1:
            raise BadRequest(f"best_of={best_of}: one candidate is generated per request, so best_of must be 1 "
                             f"(or left out)", "best_of")
    stream, echo = _flag("stream", stream), _flag("echo", echo)
    n = _choices(n, echo)
    prompts = _prompt_list(prompt)
    if logprobs is not None:
        check_number("logprobs", logprobs, 0, 20, integer=True)
    sampling = _sampling(temperature, top_p, top_k, min_p, typical_p, repeat_penalty, presence_penalty,
                         frequency_penalty, logit_bias, seed)
    runs, prefixes = [], []
    for p in prompts:
        ids = _completion_ids(llm, p, suffix, echo)
        prefix = (p if isinstance(p, str) else llm.detokenize(ids)) if echo else ""
        for j in range(n):
            # each choice its own seed (seed + j): choice 0 is what the request with n=1 gives
            sj = sampling if j == 0 or seed is None or seed == -1 else {**sampling, "seed": seed + j}
            runs.append(_new_run(llm, ids, max_tokens, stop, sj, logprobs,
                                 structured_output_kwargs(llm, response_format, grammar, json_schema), cancel))
            prefixes.append(prefix)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": _model_name(llm, model), "system_fingerprint": llm.system_fingerprint}
    start_runs(llm, runs)
    if stream:
        return _completion_chunks(runs, n, prefixes, head, echo, logprobs is not None, _include_usage(stream_options))
    choices = []
    for index, (run, prefix) in enumerate(zip(runs, prefixes)):
        lp = _completion_logprobs(run.prompt_infos(prefix), 0) if echo and logprobs is not None else None
        infos = []
        for _, inf in run.pieces():
            infos += inf
        if logprobs is not None:
            completion = _completion_logprobs(infos, len(prefix))
            lp = completion if lp is None else {k: v + completion[k] for k, v in lp.items()}
        choices.append({"text": prefix + run.text, "index": index, "logprobs": lp,
                        "finish_reason": run.finish_reason})
    return {**head, "choices": choices, "usage": _usage(runs, n)}


def _completion_ids(llm, prompt, suffix, echo: bool) -> list[int]:
    """The ids of one completion prompt (text or token ids), or of its fill-in-the-middle prompt with ``suffix``."""
    if isinstance(prompt, str):
        llm.check_prompt_fits(prompt + (suffix if isinstance(suffix, str) else ""))
        ids = llm.tokenize(prompt)
    else:
        ids = list(prompt)
    if suffix is not None and suffix != "":  # fill in the middle, between the prompt and the suffix
        if echo:
            raise BadRequest("echo cannot be combined with suffix (the prompt is the text before the middle)",
                             "echo")
        ids = suffix_ids(llm.tokenizer, prompt, suffix)
    return ids


def _usage(runs: list["Run"], n: int) -> dict:
    """One response's usage over its runs (n choices per prompt): each prompt counted once, as OpenAI counts it."""
    if len(runs) == 1:
        return runs[0].usage()
    prompt = sum(len(r.ids) for r in runs[::n])
    completion = sum(r.completion_tokens for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in runs[::n])}}


def _include_usage(stream_options) -> bool:
    if stream_options is not None and not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return _flag("stream_options.include_usage", (stream_options or {}).get("include_usage"), "stream_options")


def _completion_chunks(runs: list[Run], n: int, prefixes: list[str], head: dict, echo: bool, want_lp: bool,
                       include_usage: bool) -> Iterator[dict]:
    """The chunks of every choice, one choice after another (each chunk names its choice's index): choices that
    were started together (start_runs) generate side by side, so the later ones' tokens are waiting when their
    turn comes."""
    def chunk(index, text, lp, finish):
        c = {**head, "choices": [{"text": text, "index": index, "logprobs": lp, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        return c

    for index, (run, prefix) in enumerate(zip(runs, prefixes)):
        if echo:
            lp = _completion_logprobs(run.prompt_infos(prefix), 0) if want_lp else None
            if prefix or lp:
                yield chunk(index, prefix, lp, None)
        for text, infos in run.pieces():
            yield chunk(index, text, _completion_logprobs(infos, len(prefix)) if want_lp else None, None)
        yield chunk(index, "", None, run.finish_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": _usage(runs, n)}


# --------------------------------------------------------------------------------------------------------- chat
def _chat_logprobs(infos: list[TokenInfo]) -> dict:
    return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": t.bytes,
                         "top_logprobs": [{"token": s, "logprob": v, "bytes": b}
                                          for (s, v), b in zip(t.top, t.top_bytes)]}
                        for t in infos]}


def create_chat_completion(llm, messages: list[dict], tools: list[dict] | None = None, tool_choice=None,
                           max_tokens: int | None = None, max_completion_tokens: int | None = None,
                           temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                           typical_p: float = 1.0, stop: str | list[str] | None = None, seed: int | None = None,
                           stream: bool = False, logprobs: bool = False, top_logprobs: int | None = None,
                           repeat_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                           logit_bias: dict | None = None, model: str | None = None, n: int | None = None,
                           response_format: dict | None = None, grammar: str | None = None,
                           json_schema: dict | None = None, stream_options: dict | None = None,
                           parallel_tool_calls: bool | None = None, modalities: list[str] | None = None,
                           audio: dict | None = None, functions: list[dict] | None = None, function_call=None,
                           web_search_options: dict | None = None, cancel=None, **ignored):
    """OpenAI chat completion of ``messages`` through the model's chat template. ``tools`` / ``tool_choice`` as
    OpenAI (auto, none, required, {"type": "function", "function": {"name": ...}}): calls the model writes come
    back as ``message.tool_calls`` with finish_reason "tool_calls" (only the first with ``parallel_tool_calls``
    false, as OpenAI promises at most one); OpenAI's deprecated ``functions`` / ``function_call`` are tools under
    their old names, and a call comes back as ``message.function_call``, finish_reason "function_call".
    ``max_tokens`` None = until the context is full. ``n``: that many choices, generated side by side from one
    prefill of the prompt (choice j seeded ``seed + j``: choice 0 is what n=1 gives). Returns the response dict, or
    with ``stream=True`` an iterator of ``chat.completion.chunk`` dicts (each names its choice's index)."""
    llm.check_generates()
    refuse_unknown(create_chat_completion, ignored)
    n = _choices(n, echo=False)
    _check_text_output(modalities, audio)
    if web_search_options is not None:  # answered from the model's weights alone, as if it had searched
        raise BadRequest("web search is not supported: the model answers from its weights alone",
                         "web_search_options")
    stream, logprobs = _flag("stream", stream), _flag("logprobs", logprobs)
    if max_completion_tokens not in (None, -1):  # checked here to be named as the request spelled it
        check_number("max_completion_tokens", max_completion_tokens, 0, integer=True)
    if top_logprobs is not None:
        check_number("top_logprobs", top_logprobs, 0, 20, integer=True)
        if not logprobs:  # OpenAI refuses it: read alone it would ask for alternatives and get no logprobs at all
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    msgs = normalize_messages(messages)
    if "developer" not in llm.template.source:  # OpenAI's newer name for system: a template may drop a role it lacks
        msgs = [{**m, "role": "system"} if m["role"] == "developer" else m for m in msgs]
    if "tool_calls" not in llm.template.source:
        msgs = [calls_as_text(m) for m in msgs]
    tools, tool_choice, legacy = legacy_functions(functions, function_call, tools, tool_choice)
    tools, forced = check_tools(tools, tool_choice)
    # null is the default, true; false promises the client at most one call, which it may act on without a loop
    max_calls = 1 if legacy or (parallel_tool_calls is not None and not _flag("parallel_tool_calls",
                                                                               parallel_tool_calls)) else None

    def make_constraint():  # each choice's own: a grammar's state is its sampler's
        c, p = structured_output_kwargs(llm, response_format, grammar, json_schema), ""
        if tools and forced is not None:
            p, c = forced_call(llm, tools, forced, c)
        return c, p

    constraint, prefix = make_constraint()
    constrained_call = bool(tools and forced is not None and constraint)
    template_kw = {}
    if tools:
        if "tools" in llm.template.source:
            template_kw["tools"] = tools
        else:
            desc = "\n".join(json.dumps(t) for t in tools)
            msgs = [{"role": "system", "content": TOOL_SYSTEM_FALLBACK.format(tools=desc)}] + msgs
    try:
        ids = llm.chat_ids(msgs, suffix=prefix, must_fit=True, **template_kw)
    except ContextFullError:
        raise
    except PyllmError as e:
        raise BadRequest(str(e), "messages") from None
    n_lp = (top_logprobs or 0) if logprobs else None
    sampling = _sampling(temperature, top_p, top_k, min_p, typical_p, repeat_penalty, presence_penalty,
                         frequency_penalty, logit_bias, seed)
    limit = max_completion_tokens if max_completion_tokens is not None else max_tokens
    runs = []
    for j in range(n):
        # each choice its own seed (seed + j) and constraint, as completions' choices
        sj = sampling if j == 0 or seed is None or seed == -1 else {**sampling, "seed": seed + j}
        runs.append(_new_run(llm, ids, limit, stop, sj, n_lp, constraint if j == 0 else make_constraint()[0],
                             cancel))
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": _model_name(llm, model),
            "system_fingerprint": llm.system_fingerprint}
    start_runs(llm, runs)
    names = [t["function"]["name"] for t in tools]
    if stream:
        return _chat_choices_chunks(runs, n, head, names, prefix, logprobs, _include_usage(stream_options),
                                    constrained_call, max_calls, legacy)
    choices = []
    for index, run in enumerate(runs):
        infos = []
        for _, inf in run.pieces():
            infos += inf
        message = {"role": "assistant", "content": run.text}
        finish = run.finish_reason
        if tools:
            content, calls = parse_tool_calls(prefix + run.text, names, constrained_call)
            calls = calls[:max_calls]
            if calls and legacy:
                message = {"role": "assistant", "content": content, "function_call": calls[0]["function"]}
                finish = "function_call"
            elif calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls"
        choices.append({"index": index, "message": message, "logprobs": _chat_logprobs(infos) if logprobs else None,
                        "finish_reason": finish})
    return {**head, "object": "chat.completion", "choices": choices, "usage": _usage(runs, n)}


def _chat_choices_chunks(runs: list[Run], n: int, head: dict, tools: list[str], prefix: str, want_lp: bool,
                         include_usage: bool, constrained_call: bool, max_calls: int | None, legacy: bool):
    """The chunks of every choice, one choice after another (each chunk names its index; choices started together
    generate side by side), then the usage of them all."""
    for index, run in enumerate(runs):
        yield from _chat_chunks(run, head, tools, prefix, want_lp, include_usage, constrained_call, max_calls,
                                legacy, index=index)
    if include_usage:
        yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(runs, n)}


def _chat_chunks(run: Run, head: dict, tools: list[str], prefix: str, want_lp: bool, include_usage: bool,
                 constrained_call: bool = False, max_calls: int | None = None, legacy: bool = False,
                 index: int = 0):
    """One choice's chunks (its usage is sent after every choice's, _chat_choices_chunks)."""
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(delta, finish=None, lp=None):
        c = {**head, "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        return c

    yield chunk({"role": "assistant", "content": ""})
    # With tools, content is held back while it may be the start of a call; from a call on, the rest is buffered
    # and sent as tool_calls at the end (or as content, if it does not parse). The logprobs of held text wait
    # with it and go out with the next chunk sent, so that the stream reports every token the response does.
    full, sent, held = prefix, 0, bool(prefix)
    waiting: list[TokenInfo] = []

    def lp_of_waiting():
        out = _chat_logprobs(waiting) if want_lp and waiting else None
        waiting.clear()
        return out

    for text, infos in run.pieces():
        if not tools:
            lp = _chat_logprobs(infos) if want_lp else None
            if text or lp:
                yield chunk({"content": text}, lp=lp)
            continue
        waiting += infos
        full += text
        if not sent and not held:
            start = full.lstrip()
            if any(start.startswith(c) for c in CALL_STARTS):
                held = True
            elif any(c.startswith(start) for c in CALL_STARTS):
                continue  # too short to tell yet
        if not held:
            at = full.find(TOOL_OPEN)
            if at >= 0:
                held = True
                upto = at
            else:
                upto = len(full) - max((k for k in range(1, len(TOOL_OPEN)) if full.endswith(TOOL_OPEN[:k])),
                                       default=0)
            if upto > sent:
                yield chunk({"content": full[sent:upto]}, lp=lp_of_waiting())
                sent = upto
    finish = run.finish_reason
    if tools:
        content, calls = parse_tool_calls(full, tools, constrained_call)
        if calls and legacy:
            yield chunk({"function_call": calls[0]["function"]}, lp=lp_of_waiting())
            finish = "function_call"
        elif calls:
            for i, c in enumerate(calls[:max_calls]):
                yield chunk({"tool_calls": [{"index": i, **c}]}, lp=lp_of_waiting())
            finish = "tool_calls"
        elif len(full) > sent:
            yield chunk({"content": full[sent:]}, lp=lp_of_waiting())
    yield chunk({}, finish, lp=lp_of_waiting())
