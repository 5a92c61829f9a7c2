"""OpenAI-shaped completions over an LLM, as llama-cpp-python's ``Llama.create_completion`` /
``create_chat_completion``: the same keyword arguments, the same response dicts, iterators of chunk dicts when
``stream=True``. The server (pyllm/server/) serves exactly these dicts.

Arguments are checked when the call is made, before anything is generated, so a streaming call with a bad
argument raises at once instead of failing inside the stream.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

from .errors import BadRequest, ContextFullError, PyllmError
from .runtime.constraint import SCHEMA_DATA
from .runtime.sampler import Sampler, SamplerSettings
from .runtime.stop_strings import OutputText, stop_list
from .structured_output import structured_output_kwargs

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
# Qwen2.5 / Hermes convention: the model writes each call as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>.
# Templates that do not describe tools themselves get this instruction as a system message.
TOOL_SYSTEM_FALLBACK = (
    "You may call one or more functions to assist with the user query. The functions are described in JSON "
    "below:\n<tools>\n{tools}\n</tools>\nFor each function call, return a JSON object with the function name and "
    "arguments within <tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


# ---------------------------------------------------------------------------------------------- argument checks
def _number(name: str, v, lo: float | None = None, hi: float | None = None, integer: bool = False,
            param: str | None = None):
    """``v`` if it is a finite number in [lo, hi]; else BadRequest naming ``param`` (default: ``name``), the
    request's parameter that holds it."""
    param = param or name
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise BadRequest(f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}", param)
    if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise BadRequest(f"{name} must be {rng}, got {v!r}", param)
    return v


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


def _logit_bias(bias, n_vocab: int) -> dict[int, float]:
    if not bias:
        return {}
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias must be an object mapping token ids to a bias", "logit_bias")
    out = {}
    for k, v in bias.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias key {k!r} is not a token id", "logit_bias") from None
        if not 0 <= tok < n_vocab:
            raise BadRequest(f"logit_bias token id {tok} is outside the vocabulary (0..{n_vocab - 1})", "logit_bias")
        out[tok] = float(_number(f"logit_bias[{k!r}]", v, -100, 100, param="logit_bias"))
    return out


def _sampler(llm, temperature, top_p, top_k, min_p, typical_p, repeat_penalty, presence_penalty, frequency_penalty,
             logit_bias, seed, n_logprobs: int | None) -> Sampler:
    _number("temperature", temperature, 0)
    _number("top_p", top_p, 0, 1)
    _number("top_k", top_k, 0, integer=True)
    _number("min_p", min_p, 0, 1)
    _number("typical_p", typical_p, 0, 1)
    _number("presence_penalty", presence_penalty, -2, 2)
    _number("frequency_penalty", frequency_penalty, -2, 2)
    _number("repeat_penalty", repeat_penalty, 0)
    if seed is not None:
        _number("seed", seed, integer=True)
    if top_p == 0:  # nothing but the most likely token survives: greedy (the sampler's top_p range is (0, 1])
        temperature, top_p = 0, 1.0
    settings = SamplerSettings(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                               min_p=float(min_p), typical_p=float(typical_p), repeat_penalty=float(repeat_penalty),
                               frequency_penalty=float(frequency_penalty), presence_penalty=float(presence_penalty),
                               logit_bias=_logit_bias(logit_bias, llm.n_vocab),
                               seed=None if seed is None else int(seed) & (2**63 - 1))
    try:
        s = Sampler(settings)
    except PyllmError as e:  # a bound _number leaves to the sampler (an open end): its message names the setting
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
    _number("max_tokens", max_tokens, 0, integer=True)
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
        gen = llm.generate_tokens(self.ids, max_tokens=self.max_tokens, sampler=self.sampler, **self.constraint)
        try:
            for t in gen:
                if self.cancel is not None and self.cancel.is_set():
                    self.finish_reason = "cancelled"
                    break
                self.completion_tokens += 1
                if self.completion_tokens == 1:
                    st = llm.stats
                    self.cached_tokens = st.prompt_cached
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
                if llm.stats.finish_reason == "context":
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
        raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{llm.n_vocab - 1})", "prompt")
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


def _check_n(n):
    if n not in (None, 1):
        raise BadRequest(f"n={n!r}: only one choice per request is supported", "n")


def _check_text_output(modalities, audio) -> None:
    """BadRequest for a request of audio output (OpenAI's ``modalities: ["text", "audio"]`` with ``audio``
    settings): answered with text alone, the client would find no ``message.audio`` where it asked for one."""
    if audio is not None:
        raise BadRequest("audio output is not supported: the model generates text only", "audio")
    if modalities is not None and (not isinstance(modalities, list) or any(m != "text" for m in modalities)):
        raise BadRequest(f"modalities={modalities!r}: the model generates text only ([\"text\"])", "modalities")


# --------------------------------------------------------------------------------------------------- completion
def _completion_logprobs(infos: list[TokenInfo], start: int) -> dict:
    """OpenAI's legacy logprobs object; ``start``: where the completion's text begins in the response's text."""
    out = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
    for t in infos:
        out["tokens"].append(t.text)
        out["text_offset"].append(start + t.offset)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append(None if t.top is None else dict(t.top))
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
    ``cancel``: a threading.Event that stops the generation at its next token (finish_reason "cancelled")."""
    _check_n(n)
    if best_of is not None:
        # OpenAI generates best_of candidates and returns the n most likely; answering one of one as if it were the
        # best of several would pass off an ordinary sample as a selected one
        _number("best_of", best_of, 1, integer=True)
        if best_of != 1:
            raise BadRequest(f"best_of={best_of}: one candidate is generated per request, so best_of must be 1 "
                             f"(or left out)", "best_of")
    stream, echo = _flag("stream", stream), _flag("echo", echo)
    if suffix:
        raise BadRequest("suffix (fill-in-the-middle) is not supported", "suffix")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI's batch of prompts, holding one (a string, or token ids)
    if isinstance(prompt, str):
        llm.check_prompt_fits(prompt)
        ids = llm.tokenize(prompt)
    elif isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        ids = list(prompt)
    else:
        raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    if logprobs is not None:
        _number("logprobs", logprobs, 0, 20, integer=True)
    run = _new_run(llm, ids, max_tokens, stop, _sampling(temperature, top_p, top_k, min_p, typical_p, repeat_penalty,
                                                         presence_penalty, frequency_penalty, logit_bias, seed),
                   logprobs, structured_output_kwargs(llm, response_format, grammar, json_schema), cancel)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": _model_name(llm, model), "system_fingerprint": llm.system_fingerprint}
    prefix = (prompt if isinstance(prompt, str) else llm.detokenize(ids)) if echo else ""
    if stream:
        return _completion_chunks(run, head, prefix, echo, logprobs is not None, _include_usage(stream_options))
    lp = _completion_logprobs(run.prompt_infos(prefix), 0) if echo and logprobs is not None else None
    infos = []
    for _, inf in run.pieces():
        infos += inf
    if logprobs is not None:
        completion = _completion_logprobs(infos, len(prefix))
        lp = completion if lp is None else {k: v + completion[k] for k, v in lp.items()}
    choice = {"text": prefix + run.text, "index": 0, "logprobs": lp, "finish_reason": run.finish_reason}
    return {**head, "choices": [choice], "usage": run.usage()}


def _include_usage(stream_options) -> bool:
    if stream_options is not None and not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return _flag("stream_options.include_usage", (stream_options or {}).get("include_usage"), "stream_options")


def _completion_chunks(run: Run, head: dict, prefix: str, echo: bool, want_lp: bool,
                       include_usage: bool) -> Iterator[dict]:
    def chunk(text, lp, finish):
        c = {**head, "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        return c

    if echo:
        lp = _completion_logprobs(run.prompt_infos(prefix), 0) if want_lp else None
        if prefix or lp:
            yield chunk(prefix, lp, None)
    for text, infos in run.pieces():
        yield chunk(text, _completion_logprobs(infos, len(prefix)) if want_lp else None, None)
    yield chunk("", None, run.finish_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": run.usage()}


# --------------------------------------------------------------------------------------------------------- chat
def _text_content(content, i: int):
    """OpenAI content: a string, None, or a list of parts of which pyllm reads the text ones, and an assistant's
    refusal parts (what the model said, sent back in a conversation's history)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in ("text", "refusal") and isinstance(p.get(kind), str):
                parts.append(p[kind])
            else:
                raise BadRequest(f"messages[{i}].content: only text parts are supported, got {p!r:.80}", "messages")
        return "".join(parts)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")


ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's message roles


def check_message_list(messages) -> None:
    """BadRequest unless ``messages`` is a non-empty list (or tuple): an empty conversation renders as a bare
    generation prompt, and the model would reply to nothing."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")


def normalize_messages(messages) -> list[dict]:
    """OpenAI messages -> what chat templates read: text content, tool-call arguments as objects (templates write
    them with ``tojson``), a tool result's name where only its call id is given."""
    check_message_list(messages)
    out, names = [], {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
        if m["role"] not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}", "messages")
        m = dict(m)
        m["content"] = _text_content(m.get("content"), i)
        # OpenAI's deprecated function calling: the role "function" is the tool role (what templates render), an
        # assistant's function_call its one tool call
        if m["role"] == "function":
            m["role"] = "tool"
        fc = m.pop("function_call", None)
        if fc is not None and not m.get("tool_calls"):
            if not (isinstance(fc, dict) and isinstance(fc.get("name"), str)):
                raise BadRequest(f"messages[{i}].function_call must be {{\"name\": string, \"arguments\": ...}}, "
                                 f"got {fc!r:.80}", "messages")
            m["tool_calls"] = [{"type": "function", "function": fc}]
        if m.get("tool_calls"):
            calls = []
            if not isinstance(m["tool_calls"], list):
                raise BadRequest(f"messages[{i}].tool_calls must be a list of calls", "messages")
            for j, c in enumerate(m["tool_calls"]):
                if not (isinstance(c, dict) and isinstance(c.get("function"), dict)
                        and isinstance(c["function"].get("name"), str) and isinstance(c.get("id", ""), str)):
                    raise BadRequest(f"messages[{i}].tool_calls[{j}] must be {{\"id\": string, \"type\": "
                                     f"\"function\", \"function\": {{\"name\": string, \"arguments\": ...}}}}, "
                                     f"got {c!r:.80}", "messages")
                fn = dict(c["function"])
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args)
                    except json.JSONDecodeError:
                        pass
                if isinstance(c.get("id"), str):  # a call without an id names no tool result
                    names[c["id"]] = fn.get("name")
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        elif m["content"] is None:
            m["content"] = ""
        if not isinstance(m.get("tool_call_id", ""), str):
            raise BadRequest(f"messages[{i}].tool_call_id must be a string", "messages")
        call_id = m.get("tool_call_id")
        if m["role"] == "tool" and "name" not in m and call_id in names:
            m["name"] = names[call_id]
        out.append(m)
    return out


def _calls_as_text(m: dict) -> dict:
    """``m`` with its tool_calls written into its content in the <tool_call> convention (what TOOL_SYSTEM_FALLBACK
    asks the model to write), for a template that does not render tool_calls: it would drop the calls, or fail on
    the null content that comes with them."""
    if not m.get("tool_calls"):
        return m
    calls = "\n".join(f"{TOOL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                     "arguments": c["function"].get("arguments", {})})
                      + f"\n{TOOL_CLOSE}" for c in m["tool_calls"])
    out = {k: v for k, v in m.items() if k != "tool_calls"}
    out["content"] = f"{m['content']}\n{calls}" if m["content"] else calls
    return out


def _check_tools(tools, tool_choice) -> tuple[list[dict], str | None]:
    """(tools, forced function name) after checking; tool_choice "none" (or no tools) gives ([], None)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return [], None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                              and isinstance((t.get("function") or {}).get("name"), str)
                                              for t in tools):
        raise BadRequest("tools must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
    names = [t["function"]["name"] for t in tools]
    if tool_choice in (None, "auto"):
        return tools, None
    if tool_choice == "none":
        return [], None
    if tool_choice == "required":
        return tools, ""
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict) \
            and tool_choice["function"].get("name") in names:
        return tools, tool_choice["function"]["name"]
    raise BadRequest(f"tool_choice must be \"auto\", \"none\", \"required\" or a function among {names}, got "
                     f"{tool_choice!r}", "tool_choice")


def _legacy_functions(functions, function_call, tools, tool_choice) -> tuple[list | None, Any, bool]:
    """(tools, tool_choice, legacy) of a request that may use OpenAI's deprecated ``functions`` (a list of
    function definitions) and ``function_call`` ("none", "auto" or {"name": ...}); ``legacy``: it did, and a call
    is answered in their shape. Ignored, they left the model unaware of the functions it was offered."""
    if functions is None:
        if function_call is not None:
            raise BadRequest("function_call needs functions", "function_call")
        return tools, tool_choice, False
    if tools:
        raise BadRequest("functions is the deprecated form of tools: send one or the other", "functions")
    if not isinstance(functions, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str)
                                                  for f in functions):
        raise BadRequest("functions must be a list of {\"name\": ..., \"parameters\": ...}", "functions")
    names = [f["name"] for f in functions]
    if isinstance(function_call, dict) and function_call.get("name") in names:
        function_call = {"type": "function", "function": {"name": function_call["name"]}}
    elif function_call not in (None, "none", "auto"):
        raise BadRequest(f"function_call must be \"none\", \"auto\" or {{\"name\": one of {names}}}, got "
                         f"{function_call!r:.80}", "function_call")
    return [{"type": "function", "function": f} for f in functions], function_call, True


def _forced_call(llm, tools, name: str, constraint: dict) -> tuple[str, dict]:
    """(reply prefix, constraint) forcing a tool call: "required" opens a call object; a named function also
    writes the name. Where the runtime can constrain output, the whole call object is constrained: its name is one
    of the tools' (the named one), its arguments follow that tool's JSON schema; otherwise the model continues
    freely after the prefilled name."""
    if constraint:
        raise BadRequest("response_format cannot be combined with a forced tool call", "tool_choice")
    calls, defs = [], {}
    for i, t in enumerate(tools):
        if name and t["function"]["name"] != name:
            continue
        schema = t["function"].get("parameters")
        if schema is None:
            # OpenAI: "omitting parameters defines a function with an empty parameter list". Read as "any JSON
            # value" it let the model write arguments like [1, 2, 3], which no client can pass to the function.
            schema = {"type": "object", "properties": {}, "additionalProperties": False}
        elif schema is False:  # a valid JSON schema that nothing matches (``or {}`` made it "anything")
            raise BadRequest(f"tools: the parameters of {t['function']['name']!r} are false, which no arguments "
                             f"can match", "tools")
        if isinstance(schema, dict):
            # The call object is now the document's root, where the schema's own references ("#/$defs/City",
            # "#") no longer resolve. Each tool's schema moves whole under the root's $defs, its references
            # rebased onto where it now sits: two tools that define one name differently keep their own.
            key = f"tool{i}"
            defs[key] = _rebase_refs(schema, f"#/$defs/{key}")
            schema = {"$ref": f"#/$defs/{key}"}
        # Closed: a call is its name and arguments, and keys past them (small models go on to "type",
        # "parameters", ...) only spend the token budget until the call is cut off, finish_reason "length".
        calls.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "arguments": schema}, "required": ["name", "arguments"],
                      "additionalProperties": False})
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        call = {**call, "$defs": defs}
    try:
        return TOOL_OPEN + "\n", structured_output_kwargs(llm, json_schema=call, param="tools")
    except BadRequest:  # a tool's parameters are not a usable schema
        raise
    except PyllmError:
        pass
    if name:
        return TOOL_OPEN + '\n{"name": "' + name + '", "arguments":', {}
    # The call is opened up to the name's quote: after a bare "<tool_call>\n" small models tend to end the turn.
    return TOOL_OPEN + '\n{"name": "', {}


def _rebase_refs(schema: dict, base: str) -> dict:
    """A copy of ``schema`` whose local references ("#" and "#/..." JSON pointers) point where they pointed once
    the schema sits at ``base`` (a "#/..." pointer) of a larger document. Iterative: a schema may nest deeply.
    The root's ``$id`` goes (an embedded resource the engine would not resolve against), and references spelled
    through it ("https://x/s.json#/$defs/A") become local ones."""
    root_id = schema.get("$id")
    if isinstance(root_id, str):
        schema = {k: v for k, v in schema.items() if k != "$id"}
        root_id = root_id.rstrip("#")
    out: dict = {}
    stack = [(schema, out)]
    while stack:
        src, dst = stack.pop()
        items = src.items() if isinstance(src, dict) else enumerate(src)
        for k, v in items:
            ref = isinstance(src, dict) and k == "$ref" and isinstance(v, str)
            if ref and root_id and (v == root_id or v.startswith(root_id + "#")):
                v = v[len(root_id):] or "#"
            if ref and (v == "#" or v.startswith("#/")):
                v = base + v[1:]
            elif isinstance(v, (dict, list)) and not (isinstance(src, dict) and k in SCHEMA_DATA):
                copy = {} if isinstance(v, dict) else [None] * len(v)
                stack.append((v, copy))
                v = copy
            dst[k] = v
    return out


def _call(obj, names, values: bool = False) -> dict | None:
    """The OpenAI tool call for the call object ``obj``, or None. OpenAI's ``arguments`` is JSON text: a string a
    model wrote there is taken as that text when it holds a JSON object (some models encode the arguments, as the
    API does), else as the value itself. ``values``: the arguments were constrained to the tool's schema, so
    they are the value whatever it is (a schema may admit a string)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or (names and obj["name"] not in names):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not (isinstance(args, str) and not values and _json_object_text(args)):
        args = json.dumps(args)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


def _json_object_text(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


FENCED = re.compile(r"\s*(?:```(?:json)?\s*)?(\{.*\})\s*(?:```)?\s*", re.S)
# A reply that may still turn out to be a call: held back (not streamed) until the reply ends.
CALL_STARTS = (TOOL_OPEN, "{", "```")


def parse_tool_calls(text: str, names: list[str] | None = None,
                     values: bool = False) -> tuple[str | None, list[dict]]:
    """(content before the first call or None, OpenAI tool_calls) from a reply in the <tool_call> convention. A
    call whose JSON does not parse leaves the whole reply as content. Small models sometimes answer with the bare
    call object instead (optionally in a ```json fence): a whole reply that is {"name": <one of names>,
    "arguments": ...} is a call too. ``values``: as ``_call``'s."""
    start = text.find(TOOL_OPEN)
    if start < 0:
        m = FENCED.fullmatch(text)
        if m:
            try:
                call = _call(json.loads(m.group(1)), names or [""], values)
            except json.JSONDecodeError:
                call = None
            if call:
                return None, [call]
        return text, []
    calls = []
    for m in re.finditer(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CLOSE) + r"|$)", text[start:],
                         re.S):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, None, values)
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


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
    ``max_tokens`` None = until the context is full. Returns the response dict, or with ``stream=True`` an iterator
    of ``chat.completion.chunk`` dicts."""
    _check_n(n)
    _check_text_output(modalities, audio)
    if web_search_options is not None:  # answered from the model's weights alone, as if it had searched
        raise BadRequest("web search is not supported: the model answers from its weights alone",
                         "web_search_options")
    stream, logprobs = _flag("stream", stream), _flag("logprobs", logprobs)
    if max_completion_tokens not in (None, -1):  # checked here to be named as the request spelled it
        _number("max_completion_tokens", max_completion_tokens, 0, integer=True)
    if top_logprobs is not None:
        _number("top_logprobs", top_logprobs, 0, 20, integer=True)
        if not logprobs:  # OpenAI refuses it: read alone it would ask for alternatives and get no logprobs at all
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    msgs = normalize_messages(messages)
    if "developer" not in llm.template.source:  # OpenAI's newer name for system: a template may drop a role it lacks
        msgs = [{**m, "role": "system"} if m["role"] == "developer" else m for m in msgs]
    if "tool_calls" not in llm.template.source:
        msgs = [_calls_as_text(m) for m in msgs]
    tools, tool_choice, legacy = _legacy_functions(functions, function_call, tools, tool_choice)
    tools, forced = _check_tools(tools, tool_choice)
    # null is the default, true; false promises the client at most one call, which it may act on without a loop
    max_calls = 1 if legacy or (parallel_tool_calls is not None and not _flag("parallel_tool_calls",
                                                                               parallel_tool_calls)) else None
    constraint = structured_output_kwargs(llm, response_format, grammar, json_schema)
    template_kw, prefix, constrained_call = {}, "", False
    if tools:
        if "tools" in llm.template.source:
            template_kw["tools"] = tools
        else:
            desc = "\n".join(json.dumps(t) for t in tools)
            msgs = [{"role": "system", "content": TOOL_SYSTEM_FALLBACK.format(tools=desc)}] + msgs
        if forced is not None:
            prefix, constraint = _forced_call(llm, tools, forced, constraint)
            constrained_call = bool(constraint)
    try:
        ids = llm.chat_ids(msgs, suffix=prefix, must_fit=True, **template_kw)
    except ContextFullError:
        raise
    except PyllmError as e:
        raise BadRequest(str(e), "messages") from None
    n_lp = (top_logprobs or 0) if logprobs else None
    run = _new_run(llm, ids, max_completion_tokens if max_completion_tokens is not None else max_tokens, stop,
                   _sampling(temperature, top_p, top_k, min_p, typical_p, repeat_penalty, presence_penalty,
                             frequency_penalty, logit_bias, seed), n_lp, constraint, cancel)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": _model_name(llm, model),
            "system_fingerprint": llm.system_fingerprint}
    if stream:
        return _chat_chunks(run, head, [t["function"]["name"] for t in tools], prefix, logprobs,
                            _include_usage(stream_options), constrained_call, max_calls, legacy)
    infos = []
    for _, inf in run.pieces():
        infos += inf
    message = {"role": "assistant", "content": run.text}
    finish = run.finish_reason
    if tools:
        content, calls = parse_tool_calls(prefix + run.text, [t["function"]["name"] for t in tools],
                                          constrained_call)
        calls = calls[:max_calls]
        if calls and legacy:
            message = {"role": "assistant", "content": content, "function_call": calls[0]["function"]}
            finish = "function_call"
        elif calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            finish = "tool_calls"
    choice = {"index": 0, "message": message, "logprobs": _chat_logprobs(infos) if logprobs else None,
              "finish_reason": finish}
    return {**head, "object": "chat.completion", "choices": [choice], "usage": run.usage()}


def _chat_chunks(run: Run, head: dict, tools: list[str], prefix: str, want_lp: bool, include_usage: bool,
                 constrained_call: bool = False, max_calls: int | None = None, legacy: bool = False):
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(delta, finish=None, lp=None):
        c = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
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
    if include_usage:
        yield {**head, "choices": [], "usage": run.usage()}
