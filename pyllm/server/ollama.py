"""Ollama's API beside the OpenAI routes: POST /api/chat, /api/generate, /api/embed (and the deprecated
/api/embeddings), /api/show, GET /api/tags, /api/ps, /api/version, for the tools written against Ollama (its
Python and JS clients, Open WebUI, editors).

A request is translated into the keyword arguments of pyllm/api.py's create_chat_completion / create_completion
(or embed.py's create_embedding) and run through app.py's own job, stream and error machinery, so sampling, stop
strings, structured output, tool calls and the request checks are the OpenAI routes'; the result (or each chunk of
a stream) is rewritten in Ollama's shape: ``message`` / ``response``, ``done``, ``done_reason`` and the durations
in nanoseconds. Streams are Ollama's NDJSON (one object a line, ``"stream"`` true unless false, as in Ollama);
every error is Ollama's ``{"error": "..."}`` with its 4xx/5xx status (OllamaErrors).

Ollama's options map to the sampler's settings under the same names (``num_predict`` is max_tokens, -1 or -2:
until the context is full). Options fixed when the server starts (``num_ctx``, ``num_gpu``, ``num_thread``, ...)
and ``keep_alive`` are accepted and change nothing: one model stays loaded with its context while the server runs.
What pyllm cannot do (mirostat, a repeat window other than 64 tokens, images, ``think``, Go ``template``\\s) is a
400 naming it, never dropped in silence.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import datetime, timezone
from typing import Callable, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import api, registry
from .._version import __version__
from ..errors import BadRequest
from ..request_checks import check_number

# The Ollama release whose API these routes follow (clients gate features on /api/version: structured outputs came
# in 0.5, streamed tool calls in 0.8, think in 0.9).
OLLAMA_API_VERSION = "0.9.0"
# Options read under the name create_chat_completion / create_completion take them by.
SAMPLER_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "stop")
# Options that choose how a model is loaded or run, not what it generates (or that Ollama itself now ignores:
# penalize_newline); fixed here when the server starts.
LOAD_OPTIONS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "numa", "low_vram", "f16_kv",
                "logits_all", "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_keep",
                "penalize_newline", "mirostat_tau", "mirostat_eta")
# Options accepted at the one value pyllm's sampler runs with.
FIXED_OPTIONS = {"mirostat": (0, "mirostat sampling is not supported (0: off)"),
                 "tfs_z": (1, "tail-free sampling is not supported (1: off)"),
                 "repeat_last_n": (64, "the repeat penalty looks at the last 64 tokens; other windows are not "
                                       "supported")}
DONE_REASONS = {"length": "length"}  # every other finish (stop, a stop string, tool calls) is Ollama's "stop"
# Go's time.ParseDuration units, as keep_alive takes them ("5m", "1h30m", "-1"); a bare number is seconds.
DURATION = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)|[-+]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))+")
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16"}  # llama.cpp's general.file_type values, named as Ollama shows them


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _flag(data: dict, name: str, default: bool) -> bool:
    v = data.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {v!r:.40}", name)
    return v


def options_kwargs(options) -> dict:
    """Ollama's ``options`` as sampler keyword arguments; BadRequest for an option pyllm cannot honour or does not
    know (Ollama logs those and goes on; here the client learns that its setting did nothing)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise BadRequest("options must be an object of Ollama's option names and values", "options")
    out = {}
    for name, v in options.items():
        if v is None:  # null: the default, as the Ollama client sends an option it leaves unset
            continue
        if name in SAMPLER_OPTIONS:
            out[name] = v
        elif name == "num_predict":
            check_number("options.num_predict", v, -2, integer=True, param="options")
            out["max_tokens"] = None if v < 0 else v  # -1 and -2: until the context is full
        elif name in FIXED_OPTIONS:
            value, why = FIXED_OPTIONS[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != value:
                raise BadRequest(f"options.{name}={v!r:.40}: {why}", "options")
        elif name not in LOAD_OPTIONS:
            raise BadRequest(f"unknown option {name!r:.60} in options (Ollama's are "
                             f"{', '.join(sorted((*SAMPLER_OPTIONS, *LOAD_OPTIONS, *FIXED_OPTIONS, 'num_predict')))})",
                             "options")
    return out


def _check_keep_alive(v) -> None:
    if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
        return
    if not isinstance(v, str) or not DURATION.fullmatch(v.strip()):
        raise BadRequest(f"keep_alive must be seconds or a duration such as \"5m\" or \"-1\", got {v!r:.40}",
                         "keep_alive")


def _refuse_unsupported(data: dict, model: str) -> None:
    think = data.get("think")
    if think not in (None, False, "none"):
        raise BadRequest(f"\"{model}\" does not support thinking", "think")  # Ollama's words for such a model
    if data.get("images"):
        raise BadRequest("images are not supported: the model reads text only", "images")
    if data.get("template"):
        raise BadRequest("template is not supported: the model's own chat template is used (or raw: true, the "
                         "prompt as written)", "template")
    _check_keep_alive(data.get("keep_alive"))


def _format_kwargs(fmt) -> dict:
    """``format``: "json" (any JSON object) or a JSON schema, as the call's structured output."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"json_schema": fmt}
    raise BadRequest(f"format must be \"json\" or a JSON schema object, got {fmt!r:.60}", "format")


def _common_kwargs(data: dict) -> dict:
    """What /api/chat and /api/generate share: options, format, logprobs."""
    kw = {"max_tokens": None, **options_kwargs(data.get("options")), **_format_kwargs(data.get("format"))}
    if _flag(data, "logprobs", False):
        top = data.get("top_logprobs")
        if top is not None:
            check_number("top_logprobs", top, 0, 20, integer=True)
        kw["top_logprobs"] = top or 0
    return kw


def _messages(messages) -> list[dict]:
    """Ollama's messages in the OpenAI form create_chat_completion reads: tool calls' arguments are objects
    there too (normalize_messages takes both), a tool result names its tool in ``tool_name``."""
    if not isinstance(messages, list):
        raise BadRequest("messages must be a list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
        if m.get("images"):
            raise BadRequest(f"messages[{i}].images: images are not supported, the model reads text only",
                             "messages")
        m = {k: v for k, v in m.items() if k not in ("images", "thinking", "tool_name")}
        if messages[i].get("tool_name"):
            m["name"] = messages[i]["tool_name"]
        out.append(m)
    return out


def _tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI tool calls (arguments a JSON string) as Ollama's (arguments an object)."""
    out = []
    for c in calls:
        args = c["function"].get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        out.append({"function": {"name": c["function"]["name"], "arguments": args}})
    return out


def _completion_logprobs(lp: dict | None) -> list[dict]:
    """create_completion's legacy logprobs as Ollama's list of {token, logprob, top_logprobs}."""
    if not lp:
        return []
    return [{"token": t, "logprob": v, "top_logprobs": [{"token": s, "logprob": w} for s, w in (top or {}).items()]}
            for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


def _chat_logprobs(lp: dict | None) -> list[dict]:
    return [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"],
             "top_logprobs": [{"token": s["token"], "logprob": s["logprob"], "bytes": s["bytes"]}
                              for s in t["top_logprobs"]]}
            for t in (lp or {}).get("content") or []]


class Timing:
    """Ollama's durations (nanoseconds) of one request: ``total_duration`` from its arrival, ``load_duration``
    until a worker took it up (the model is loaded: what a request waits for is its turn), the prompt's and the
    generation's from the generator's own statistics."""

    def __init__(self):
        self.arrived = time.monotonic_ns()
        self.started = self.arrived
        self.before = None

    def start(self, target) -> None:
        self.started = time.monotonic_ns()
        self.before = target.stats  # a call that generates nothing (num_predict 0) leaves this object behind

    def fields(self, target, prompt_tokens: int, generated: int) -> dict:
        st = target.stats
        fresh = st is not self.before
        return {"total_duration": time.monotonic_ns() - self.arrived, "load_duration": self.started - self.arrived,
                "prompt_eval_count": prompt_tokens,
                "prompt_eval_duration": int(st.prompt_seconds * 1e9) if fresh else 0,
                "eval_count": generated, "eval_duration": int(st.decode_seconds * 1e9) if fresh else 0}


def _chat_stream(chunks: Iterator[dict], head: dict, timing: Timing, target) -> Iterator[dict]:
    finish, usage = "stop", None
    try:
        for c in chunks:
            if not c["choices"]:  # the last: usage
                usage = c["usage"]
                continue
            choice = c["choices"][0]
            delta, finish = choice["delta"], choice["finish_reason"] or finish
            msg = {"role": "assistant", "content": delta.get("content") or ""}
            if delta.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(delta["tool_calls"])
            lp = _chat_logprobs(choice.get("logprobs"))
            if msg["content"] or "tool_calls" in msg or lp:
                yield {**head, "message": msg, "done": False, **({"logprobs": lp} if lp else {})}
    finally:
        chunks.close()
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0}
    yield {**head, "message": {"role": "assistant", "content": ""}, "done": True,
           "done_reason": DONE_REASONS.get(finish, "stop"),
           **timing.fields(target, usage["prompt_tokens"], usage["completion_tokens"])}


def _chat_reply(result: dict, head: dict, timing: Timing, target, logprobs: bool) -> dict:
    choice, usage = result["choices"][0], result["usage"]
    msg = {"role": "assistant", "content": choice["message"].get("content") or ""}
    if choice["message"].get("tool_calls"):
        msg["tool_calls"] = _tool_calls(choice["message"]["tool_calls"])
    out = {**head, "message": msg, "done": True, "done_reason": DONE_REASONS.get(choice["finish_reason"], "stop"),
           **timing.fields(target, usage["prompt_tokens"], usage["completion_tokens"])}
    if logprobs:
        out["logprobs"] = _chat_logprobs(choice["logprobs"])
    return out


def _generate_stream(chunks: Iterator[dict], head: dict, timing: Timing, target, ids: list[int] | None):
    finish, usage, text = "stop", None, []
    try:
        for c in chunks:
            if not c["choices"]:
                usage = c["usage"]
                continue
            choice = c["choices"][0]
            finish = choice["finish_reason"] or finish
            lp = _completion_logprobs(choice.get("logprobs"))
            if choice["text"] or lp:
                text.append(choice["text"])
                yield {**head, "response": choice["text"], "done": False, **({"logprobs": lp} if lp else {})}
    finally:
        chunks.close()
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0}
    yield {**head, "response": "", "done": True, "done_reason": DONE_REASONS.get(finish, "stop"),
           **_context(target, ids, "".join(text)),
           **timing.fields(target, usage["prompt_tokens"], usage["completion_tokens"])}


def _context(target, ids: list[int] | None, text: str) -> dict:
    """Ollama's ``context`` (deprecated, still read by older clients to continue a /api/generate conversation):
    the prompt's token ids and the reply's, to send back as ``context`` with the next prompt. Not for raw
    prompts, as in Ollama."""
    if ids is None:
        return {}
    return {"context": ids + (target.tokenize(text, add_bos=False, special=False) if text else [])}


def routes(llm, model_name: str, read_json: Callable, submit: Callable, submit_model_call: Callable,
           respond: Callable, api_error: type) -> list[Route]:
    """The /api routes over app.py's machinery: ``read_json(request, served_name)``, ``submit(request, call)``
    (a generation: call(target, cancel) on a worker), ``submit_model_call(request, call)`` (other model work:
    embeddings),
    ``respond(request, route, job, stream, prompt_param, framing)`` and its error, ``api_error(status, message,
    param)``."""
    path = llm.path
    st = path.stat()
    modified_at = datetime.fromtimestamp(st.st_mtime, timezone.utc).isoformat().replace("+00:00", "Z")
    n_params = 0
    for t in llm.gguf.tensors.values():
        n = 1
        for d in t.shape:
            n *= d
        n_params += n
    details = {"parent_model": "", "format": "gguf", "family": llm.config.arch, "families": [llm.config.arch],
               "parameter_size": _human_number(n_params), "quantization_level": _quantization(llm.gguf)}
    digest: list[str] = []  # the file's sha256, hashed once when first asked for

    async def file_digest() -> str:
        if not digest:
            digest.append(await asyncio.to_thread(_sha256, path))
        return digest[0]

    def _bad(e: BadRequest) -> Exception:
        return api_error(400, str(e), e.param)

    def head(data: dict) -> dict:
        # the name the client asked for, as Ollama answers: any name is the served model (read_json)
        return {"model": data.get("model") or model_name, "created_at": _now()}

    async def chat(request: Request) -> Response:
        timing = Timing()
        data = await read_json(request, served_name=False)
        h = head(data)
        try:
            _refuse_unsupported(data, h["model"])
            stream = _flag(data, "stream", True)
            messages = _messages(data.get("messages") or [])
            kwargs = {**_common_kwargs(data), "messages": messages, "tools": data.get("tools") or None,
                      "stream": stream, "stream_options": {"include_usage": True} if stream else None}
        except BadRequest as e:
            raise _bad(e) from None
        if not messages:  # Ollama: a request without messages loads the model and says so
            return JSONResponse({**h, "message": {"role": "assistant", "content": ""}, "done": True,
                                 "done_reason": "load"})
        want_lp = "top_logprobs" in kwargs
        if want_lp:
            kwargs["logprobs"] = True

        def call(target, cancel):
            timing.start(target)
            result = api.create_chat_completion(target, **kwargs, cancel=cancel)
            if stream:
                return _chat_stream(result, h, timing, target)
            return _chat_reply(result, h, timing, target, want_lp)

        return await respond(request, "/api/chat", submit(request, call), stream, "messages", "ndjson")

    async def generate(request: Request) -> Response:
        timing = Timing()
        data = await read_json(request, served_name=False)
        h = head(data)
        try:
            _refuse_unsupported(data, h["model"])
            stream = _flag(data, "stream", True)
            raw = _flag(data, "raw", False)
            prompt, system, suffix, context = (data.get(k) for k in ("prompt", "system", "suffix", "context"))
            for name, v in (("prompt", prompt), ("system", system), ("suffix", suffix)):
                if v is not None and not isinstance(v, str):
                    raise BadRequest(f"{name} must be a string", name)
            if context is not None and not (isinstance(context, list) and all(
                    isinstance(i, int) and not isinstance(i, bool) for i in context)):
                raise BadRequest("context must be the list of token ids a previous response returned", "context")
            kwargs = _common_kwargs(data)
            if "top_logprobs" in kwargs:
                kwargs["logprobs"] = kwargs.pop("top_logprobs")
            kwargs.update(stream=stream, stream_options={"include_usage": True} if stream else None)
        except BadRequest as e:
            raise _bad(e) from None
        if not prompt and not suffix:  # Ollama: an empty prompt loads the model and says so
            return JSONResponse({**h, "response": "", "done": True, "done_reason": "load"})
        templated = not raw and not suffix  # with a suffix the completion builds its fill-in-the-middle prompt

        def call(target, cancel):
            timing.start(target)
            ids = None
            if templated:
                turn = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
                                                                                       "content": prompt}]
                ids = list(context or []) + target.chat_ids(turn, must_fit=True)
                result = api.create_completion(target, ids, **kwargs, cancel=cancel)
            elif context:
                result = api.create_completion(target, list(context) + target.tokenize(prompt, add_bos=False),
                                               **kwargs, cancel=cancel)
            else:
                result = api.create_completion(target, prompt or "", suffix=suffix, **kwargs, cancel=cancel)
            if stream:
                return _generate_stream(result, h, timing, target, ids)
            choice, usage = result["choices"][0], result["usage"]
            out = {**h, "response": choice["text"], "done": True,
                   "done_reason": DONE_REASONS.get(choice["finish_reason"], "stop"),
                   **_context(target, ids, choice["text"]),
                   **timing.fields(target, usage["prompt_tokens"], usage["completion_tokens"])}
            if "logprobs" in kwargs:
                out["logprobs"] = _completion_logprobs(choice["logprobs"])
            return out

        return await respond(request, "/api/generate", submit(request, call), stream, "prompt", "ndjson")

    async def embed(request: Request) -> Response:
        timing = Timing()
        data = await read_json(request, served_name=False)
        h = head(data)
        try:
            options_kwargs(data.get("options"))
            _check_keep_alive(data.get("keep_alive"))
            _flag(data, "truncate", True)
        except BadRequest as e:
            raise _bad(e) from None
        texts = data.get("input")
        if texts is None or texts == "" or texts == []:  # Ollama: no input, no embeddings (the model loaded)
            return JSONResponse({"model": h["model"], "embeddings": []})
        dimensions = data.get("dimensions")

        def call(model, cancel):
            timing.start(model)
            result = model.create_embedding(texts, dimensions=dimensions, cancel=cancel)
            n = result["usage"]["prompt_tokens"]
            return {"model": h["model"], "embeddings": [d["embedding"] for d in result["data"]],
                    **{k: v for k, v in timing.fields(model, n, 0).items()
                       if k in ("total_duration", "load_duration", "prompt_eval_count")}}

        return await respond(request, "/api/embed", submit_model_call(request, call), False, "input")

    async def embeddings(request: Request) -> Response:
        """The deprecated /api/embeddings, which older clients still call: one text's vector, not normalised,
        as Ollama returns it there."""
        data = await read_json(request, served_name=False)
        prompt = data.get("prompt")
        try:
            options_kwargs(data.get("options"))
            _check_keep_alive(data.get("keep_alive"))
            if prompt is not None and not isinstance(prompt, str):
                raise BadRequest("prompt must be a string", "prompt")
        except BadRequest as e:
            raise _bad(e) from None
        if not prompt:
            return JSONResponse({"embedding": []})
        job = submit_model_call(request, lambda model, cancel: {"embedding": model.embed(prompt, normalize=False)})
        return await respond(request, "/api/embeddings", job, False, "prompt")

    def card(name: str, sha256: str) -> dict:
        return {"name": name, "model": name, "modified_at": modified_at, "size": st.st_size, "digest": sha256,
                "details": details}

    async def tags(request: Request) -> Response:
        return JSONResponse({"models": [card(model_name, await file_digest())]})

    async def ps(request: Request) -> Response:
        size = st.st_size + getattr(llm.kv, "nbytes", 0)  # the weights (mapped) and the KV cache
        return JSONResponse({"models": [{**card(model_name, await file_digest()),
                                         "expires_at": "9999-12-31T23:59:59Z",  # loaded while the server runs
                                         "size": size, "size_vram": size if llm.device == "cuda" else 0,
                                         "context_length": llm.n_ctx}]})

    async def show(request: Request) -> Response:
        data = await read_json(request, served_name=False)
        try:
            verbose = _flag(data, "verbose", False)
        except BadRequest as e:
            raise _bad(e) from None
        md = llm.gguf.metadata
        info = {k: v for k, v in md.items() if verbose or not isinstance(v, list)}
        info["general.parameter_count"] = n_params
        template = getattr(llm.template, "source", "") or ""
        return JSONResponse({
            "modelfile": f"# served by pyllm {__version__}\nFROM {path}\nPARAMETER num_ctx {llm.n_ctx}\n",
            "parameters": f"num_ctx {llm.n_ctx}", "template": template, "details": details, "model_info": info,
            # tool calls work with every model: a template without tools gets them in a system prompt; an embedding
            # encoder only embeds (Ollama's word for it: "embedding")
            "capabilities": ["embedding"] if getattr(llm, "is_encoder", False) else ["completion", "tools"],
            "modified_at": modified_at})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION, "pyllm": __version__})

    return [Route("/api/chat", chat, methods=["POST"]), Route("/api/generate", generate, methods=["POST"]),
            Route("/api/embed", embed, methods=["POST"]), Route("/api/embeddings", embeddings, methods=["POST"]),
            Route("/api/show", show, methods=["POST"]),
            Route("/api/tags", tags, methods=["GET"]), Route("/api/ps", ps, methods=["GET"]),
            Route("/api/version", version, methods=["GET"])]


def _human_number(n: int) -> str:
    """A parameter count as Ollama writes it: 135M, 134.52M, 8.0B."""
    for unit, scale, fmt in (("B", 1e9, "{:.1f}"), ("M", 1e6, "{:.2f}"), ("K", 1e3, "{:.1f}")):
        if n >= scale:
            v = n / scale
            return (f"{int(v)}" if v == int(v) else fmt.format(v)) + unit
    return str(n)


def _quantization(gf) -> str:
    """The file's quantization label (llama.cpp's file type), else the tensor type holding most of its bytes."""
    label = FILE_TYPES.get(gf.metadata.get("general.file_type"))
    if label:
        return label
    by_type: dict[str, int] = {}
    for t in gf.tensors.values():
        by_type[t.ggml_type.name] = by_type.get(t.ggml_type.name, 0) + t.nbytes
    return max(by_type, key=by_type.get) if by_type else "unknown"


def _sha256(path) -> str:
    """The file's sha256: the one its download recorded while the file is unchanged, else hashed here."""
    rec = registry.read_record(path)
    s = path.stat()
    if rec and rec.get("size") == s.st_size and rec.get("mtime_ns") == s.st_mtime_ns and rec.get("sha256"):
        return rec["sha256"]
    return registry.sha256_file(path)


class OllamaErrors:
    """ASGI middleware: an error response on an /api route carries Ollama's ``{"error": "message"}`` instead of
    OpenAI's error object, whichever layer made it (a route, the key check, the body limits, a 500)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/api/"):
            return await self.app(scope, receive, send)
        start = None
        body = bytearray()

        async def rewrite(message):
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is whole
                return
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            body.extend(message.get("body", b""))
            if message.get("more_body"):
                return
            try:
                error = json.loads(body)["error"]
                out = json.dumps({"error": error["message"] if isinstance(error, dict) else error},
                                 ensure_ascii=False).encode()
            except (ValueError, KeyError, TypeError):
                out = bytes(body)
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(out)).encode())]})
            await send({"type": "http.response.body", "body": out})

        await self.app(scope, receive, rewrite)
