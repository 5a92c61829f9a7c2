"""The OpenAI-compatible HTTP API over one LLM (Starlette routes, served by uvicorn; see docs/DESIGN.md, Server).

Routes: GET /v1/models, /v1/models/{model}, POST /v1/chat/completions, /v1/completions, /v1/responses,
/v1/embeddings, GET /health, GET /metrics; Ollama's /api routes beside them (ollama.py); the browser chat page at
/ (webui.py).
Responses are the dicts of pyllm/api.py (/v1/responses: translated by responses.py); streams are OpenAI's
server-sent events ending in ``data: [DONE]`` (/v1/responses: named events, ending in response.completed).
Every error is ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status (on /api: Ollama's
``{"error": "message"}``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import logging
import re
import threading
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import api, request_json
from ..errors import BadRequest, ContextFullError, GGUFError, ModelError, PyllmError
from . import infill, ollama, responses
from .access import AccessControl, bound_to_loopback
from .admission import HOLD, Admission, Hold, MemoryBudget, request_memory
from .api_errors import ERROR_TYPES, APIError, error_response
from .request_log import RequestLog
from .scheduler import DONE, EngineLLM, Job, Scheduler
from .webui import routes as web_routes

MAX_BODY_BYTES = 8 * 2**20  # a request body above this is refused with 413 before it is read whole
SHUTDOWN_GRACE_S = 10  # on SIGTERM, requests in flight get this long to finish before their connections close
MAX_HEAD_BYTES = 64 * 2**10  # request line and headers; a larger head is a 400 and the connection is closed
DISCONNECT_POLL_S = 0.1  # how often a request waiting for its next item checks that its client is still there
# --client-timeout: a request head must arrive whole within this many seconds of the server waiting for it, and a
# body may pause this long at most (nginx's client_header_timeout and client_body_timeout, there 60 s each)
CLIENT_TIMEOUT_S = 30
# Past its first --client-timeout seconds a body must also average this many bytes per second (Apache's
# mod_reqtimeout MinRate): a pause limit alone lets one byte every few seconds hold a request for as long as
# --max-body allows, and a limit on the whole body would cut off a large one on a slow link
MIN_BODY_RATE = 500


def lone_surrogate(data: dict) -> tuple[str, str | None, str] | None:
    """(where, the top-level parameter, the character) of the first lone UTF-16 surrogate in the strings or keys
    of the body ``data`` (what JSON's "\\ud800" escape decodes to when no low half follows), or None."""
    for k, v in data.items():
        m = request_json.SURROGATE.search(k)
        if m:
            return "a parameter name", None, m.group()
        found = request_json.lone_surrogate(v, k)
        if found:
            return found[0], k, found[1]
    return None


def parse_json_body(body: bytes | bytearray, known: request_json.JSONShape | None = None) -> dict:
    """The request body ``body`` as a JSON object, through request_json's bounded parser (``known``: its shape,
    measured already); APIError 400 naming what is wrong. Python's json module alone read NaN, Infinity and numbers
    past a double's range (1e400) as floats that no response can carry back (JSONResponse refuses them: a 500
    where /v1/responses echoes metadata or tools; an event writes them as NaN, which clients' parsers refuse), and
    OpenAI's API refuses them as unparseable; text with a lone surrogate cannot be written back as UTF-8 either
    (a 500, or a stream cut off mid-way), so it is refused here, where it can be named."""
    try:
        data = request_json.loads(body, known)
    except ValueError as e:  # JSONSyntaxError, JSONLimitError
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if request_json.may_hold_surrogate(body):  # only an escape can produce one: most bodies skip the walk
        bad = lone_surrogate(data)
        if bad is not None:
            where, param, ch = bad
            raise APIError(400, f"{where} holds a lone UTF-16 surrogate ({ch!a}), which is not Unicode text", param)
    return data


def call_kwargs(fn, data: dict, required: str) -> dict:
    """The body's parameters that ``fn`` (an OpenAI-shaped function: pyllm/api.py, pyllm/embed.py) takes as
    keywords; APIError 400 when ``required`` is missing. The others are ignored, as OpenAI-compatible servers ignore
    parameters they do not know: passed on, one named like ``fn``'s own first argument would be a TypeError.
    ``cancel`` is the server's own (the job's event), never the client's."""
    if required not in data:
        raise APIError(400, f"missing required parameter '{required}'", required)
    params = list(inspect.signature(fn).parameters.values())[1:]
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"cancel"}
    return {k: v for k, v in data.items() if k in names}


def sse_event(obj: dict, name: str | None = None) -> str:
    """One server-sent event carrying ``obj`` as compact JSON (what OpenAI's API sends), with ``event: name``
    before it when given (the Responses API names each event by its type)."""
    head = f"event: {name}\n" if name else ""
    return head + "data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n\n"


def _as_api_error(e: Exception, prompt_param: str = "messages") -> APIError:
    """``prompt_param``: the parameter that holds the prompt on this route, named when it does not fit."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, BadRequest):
        return APIError(400, str(e), e.param)
    if isinstance(e, ContextFullError):
        return APIError(400, str(e), prompt_param, "context_length_exceeded")
    if isinstance(e, (ModelError, GGUFError)):
        # the served model is at fault (non-finite logits from broken weights, a file changed on disk), not the
        # request: a 400 told the client to fix a request that would fail the same way whatever it sent
        return APIError(500, str(e))
    if isinstance(e, PyllmError):
        return APIError(400, str(e))
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


class Metrics:
    """Counters for GET /metrics (Prometheus text format)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.generated_tokens = self.cached_tokens = self.cache_hits = 0
        self.decode_tps = 0.0
        self.busy_seconds = 0.0
        self.cancelled = 0
        self.engine = None  # the BatchEngine with --parallel > 1 or a prompt cache
        self.budget = None  # the MemoryBudget of request bodies

    def request(self, route: str, status: int) -> None:
        with self.lock:
            self.requests[route, status] = self.requests.get((route, status), 0) + 1

    def text(self, scheduler: Scheduler) -> str:
        rows = [
            ("pyllm_requests_total", "counter", "HTTP requests by route and status",
             [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())]),
            ("pyllm_prompt_tokens_total", "counter", "prompt tokens of completed requests", [("", self.prompt_tokens)]),
            ("pyllm_generated_tokens_total", "counter", "generated tokens", [("", self.generated_tokens)]),
            ("pyllm_requests_cancelled_total", "counter", "generations stopped because the client went away",
             [("", self.cancelled)]),
            ("pyllm_prompt_cache_tokens_total", "counter", "prompt tokens reused from the KV cache",
             [("", self.cached_tokens)]),
            ("pyllm_prompt_cache_hits_total", "counter", "requests that reused a cached prefix",
             [("", self.cache_hits)]),
            ("pyllm_prompt_cache_disk_hits_total", "counter", "requests whose prefix was read from --prompt-cache",
             [("", self.engine.disk_hits if self.engine else 0)]),
            ("pyllm_decode_tokens_per_second", "gauge", "decode speed of the last request", [("", self.decode_tps)]),
            ("pyllm_busy_seconds_total", "counter", "seconds the model worker spent on requests",
             [("", round(self.busy_seconds, 3))]),
            ("pyllm_queue_depth", "gauge", "requests waiting for the model",
             [("", scheduler.depth + (self.engine.waiting if self.engine else 0))]),
            ("pyllm_slots_busy", "gauge", "KV slots holding a running request",
             [("", self.engine.active if self.engine else scheduler.busy)]),
            ("pyllm_requests_processing", "gauge", "requests being generated now", [("", scheduler.busy)]),
            ("pyllm_request_memory_bytes", "gauge", "bytes request bodies in flight hold, read or parsed "
             "(--max-request-memory)", [("", self.budget.used if self.budget else 0)]),
        ]
        out = []
        for name, kind, help_, samples in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            out += [f"{name}{labels} {value}" for labels, value in samples]
        return "\n".join(out) + "\n"


# The pages a browser may call this server from without --cors-origin: Ollama's default (OLLAMA_ORIGINS), which web
# UIs and desktop shells for local models are written against: pages served from this machine (localhost,
# 127.0.0.1, [::1], 0.0.0.0 at any port) and the schemes of desktop apps and editor webviews. Not every origin, as
# llama-server allows: a page on any site the user visits could then read the local model's answers (and spend
# its time), since a server on 127.0.0.1 is reachable from every tab.
LOCAL_ORIGINS = (r"https?://(localhost|127\.0\.0\.1|\[::1\]|0\.0\.0\.0)(:\d+)?",
                 r"(app|file|tauri|vscode-webview|vscode-file)://.*")


def origin_pattern(origin: str) -> str:
    """The regular expression of one --cors-origin value: the origin as written, ``*`` matching any run of
    characters within it (``https://*.example.com``, ``chrome-extension://*``), as in OLLAMA_ORIGINS."""
    return ".*".join(re.escape(part) for part in origin.rstrip("/").split("*"))


class LocalCORS(CORSMiddleware):
    """Starlette's CORS middleware, except that a preflight from an origin it refuses gets no CORS headers at
    all (Starlette's names the methods and headers it would allow): the refusal tells such a page nothing."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if not self.is_allowed_origin(request_headers["origin"]):
            for name in [k for k in response.headers if k.lower().startswith("access-control-")]:
                del response.headers[name]
        return response


def with_cors(app, origins=()):
    """``app`` behind CORS: browsers' pages from LOCAL_ORIGINS or ``origins`` (each an origin, ``*`` a wildcard;
    ``*`` alone: every origin) may call it with any request headers (Authorization, Content-Type, the openai JS
    client's own). Outermost, so a preflight never meets the API-key check and error responses (a 401 too) carry
    the headers a page needs to read them. No credentials (cookies): the API key travels in a header."""
    origins = list(origins)
    return LocalCORS(app, allow_origins=["*"] if "*" in origins else [],
                     allow_origin_regex="|".join(f"(?:{p})" for p in (*LOCAL_ORIGINS, *map(origin_pattern, origins))),
                     allow_methods=["GET", "POST"], allow_headers=["*"], allow_private_network=True)


class API(Starlette):
    """Starlette with CORS (with_cors) outside its ServerErrorMiddleware, which add_middleware cannot reach: the 500
    of an exception no handler caught carries CORS headers too, so a page can read it like every other error."""

    def __init__(self, *args, cors_origins=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.cors_origins = cors_origins

    def build_middleware_stack(self):
        return with_cors(ollama.OllamaErrors(super().build_middleware_stack()), self.cors_origins)


class BodyDeadline:
    """ASGI middleware: a request whose body pauses ``timeout`` seconds, or averages under MIN_BODY_RATE bytes a
    second past its first ``timeout`` seconds, is APIError 408 from ``receive``, raised where the route reads its
    body, before any model work. Once the body is whole ``receive`` has no deadline: a streamed response waits on
    it for the client's disconnect."""

    def __init__(self, app, timeout: float):
        self.app, self.timeout = app, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = last = time.monotonic()
        got, whole = 0, False

        async def timed_receive():
            nonlocal last, got, whole
            if whole:
                return await receive()
            wait = min(last + self.timeout, start + self.timeout + got / MIN_BODY_RATE) - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive in time (--client-timeout {self.timeout:g} "
                                    f"s, at least {MIN_BODY_RATE} bytes/s after that)") from None
            last = time.monotonic()
            got += len(message.get("body", b""))
            whole = not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


def make_engine(llm, parallel: int, prompt_cache=None, prompt_cache_bytes: int = 1 << 30,
                kv_pool_tokens: int | None = None):
    """The BatchEngine serving ``parallel`` requests at once over ``llm``'s model, with the prompt cache in the
    directory ``prompt_cache`` (or None), its slots' KV pool holding ``kv_pool_tokens`` positions (None: every
    slot's context)."""
    from ..runtime.batch import BatchEngine
    from ..runtime.prompt_cache import PromptCache, file_sha256

    cfg = llm.config
    disk = None
    if prompt_cache is not None:
        try:
            disk = PromptCache(prompt_cache, file_sha256(llm.path),
                               llm.model.backend.make_kv_cache(llm.kv.kind, cfg.n_layer, cfg.n_kv_head, 1, cfg.head_dim),
                               max_bytes=prompt_cache_bytes)
        except OSError as e:
            raise PyllmError(f"--prompt-cache {prompt_cache}: {e.strerror or e}") from None
    return BatchEngine(llm.model, llm.kv.kind, llm.n_ctx, parallel, llm.tokenizer.is_eog,
                       prompt_cache=disk, nonfinite=llm._nonfinite_error, pool_tokens=kv_pool_tokens)


def create_app(llm, model_name: str, api_key: str | None = None, max_body: int = MAX_BODY_BYTES, parallel: int = 1,
               prompt_cache=None, cors_origins=(), client_timeout: float = CLIENT_TIMEOUT_S, host: str = "127.0.0.1",
               allow_hosts=(), max_request_memory: int | None = None, log_format: str | None = None,
               kv_pool_tokens: int | None = None) -> Starlette:
    """The ASGI app serving ``llm`` under the model id ``model_name``. ``parallel`` > 1 or a ``prompt_cache``
    directory: requests run in a BatchEngine of that many KV slots (pyllm/runtime/batch.py); else one at a time
    through the LLM itself (which speculates on greedy requests). ``cors_origins``: origins whose pages may call
    it besides the local ones (with_cors). ``client_timeout``: the body's deadline (BodyDeadline). ``host``: the
    address it listens on; bound to loopback, it answers only Host headers naming this machine and
    ``allow_hosts`` (AccessControl). ``max_request_memory``: the MemoryBudget of request bodies in bytes (default:
    default_request_memory); PyllmError if one request within ``max_body`` could not fit in it. ``log_format``:
    "text" or "json", one line per request on stderr (request_log.py); None: no request log.
    ``kv_pool_tokens``: make_engine's."""
    budget = MemoryBudget(request_memory(max_body, max_request_memory))
    metrics = Metrics()
    metrics.budget = budget
    # an embedding encoder generates nothing: its requests run one at a time on the LLM, with no KV slots to batch
    batched = (parallel > 1 or prompt_cache) and not getattr(llm, "is_encoder", False)
    engine = metrics.engine = (make_engine(llm, parallel, prompt_cache, kv_pool_tokens=kv_pool_tokens) if batched
                               else None)

    last_stats = [llm.stats]

    def on_done(job: Job, seconds: float) -> None:
        # Counted from the generator's own statistics, so a cancelled stream's tokens count too; a job that
        # generated nothing (an error, an embedding) leaves the same stats object behind.
        if job.view is not None:
            st, fresh = job.view.stats, job.view.generated
        else:
            st = llm.stats
            fresh = st is not last_stats[0]
            last_stats[0] = st
        with metrics.lock:
            metrics.busy_seconds += seconds
            metrics.cancelled += job.cancel.is_set()
            if fresh:
                job.tokens = st.prompt_tokens, st.generated_tokens
                metrics.prompt_tokens += st.prompt_tokens
                metrics.generated_tokens += st.generated_tokens
                cached = st.prompt_cached
                metrics.cached_tokens += cached
                metrics.cache_hits += cached > 0
                if st.decode_tps:
                    metrics.decode_tps = st.decode_tps

    scheduler = Scheduler(on_done, workers=parallel + 1 if engine else 1)
    created = int(time.time())

    # One thread parses request bodies, off the event loop, which keeps answering (/health too) while it works;
    # one at a time, so that the scan's transient memory (request_json.shape's, before the parse's own is known and
    # taken from the budget) is there once.
    parser = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyllm-parse")

    def parse_held(body: bytearray, hold: Hold) -> dict:
        shape = request_json.shape(body)
        try:
            request_json.check_shape(shape)
        except ValueError as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        need = shape.parsed_bytes + shape.parse_bytes
        hold.take(need, f"a body that takes up to {-(-need >> 20)} MiB to parse")
        try:
            return parse_json_body(body, shape)
        finally:
            hold.give(shape.parse_bytes)  # the parse is over; its value stays counted

    async def read_json(request: Request, served_name: bool = True) -> dict:
        """The request's JSON object, read and parsed within the request's Hold. Its ``model`` may name any
        model: the server serves one, as llama-server does (a server started on a file was asked for the registry
        name its README uses); with ``served_name`` it is replaced by the served model's name, which responses then
        carry."""
        hold: Hold = request.scope[HOLD]
        size = request.headers.get("content-length")
        if size is not None and size.isascii() and size.isdigit():
            if int(size) > max_body:
                raise APIError(413, f"request body of {size} bytes exceeds the limit of {max_body} bytes")
            hold.take(int(size), f"a body of {size} bytes")
        taken = hold.bytes
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body:
                raise APIError(413, f"request body exceeds the limit of {max_body} bytes")
            if len(body) > taken:  # a body sent in chunks, without a Content-Length
                hold.take(len(body) - taken, f"a body of over {taken} bytes")
                taken = len(body)
        data = await asyncio.get_running_loop().run_in_executor(parser, parse_held, body, hold)
        del body
        hold.give(taken)  # the body's bytes are free; its parsed value stays counted
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise APIError(400, f"model must be a string, got {type(model).__name__}", "model")
        if served_name:
            data["model"] = model_name
        return data

    def submit_held(request: Request, fn, cancel: threading.Event | None = None, view=None) -> Job:
        """``fn`` as a job on the scheduler; the request's Hold stays taken until the job is done with the
        parsed body that ``fn`` holds, even after a cancel (it waits in the queue until a worker drops it)."""
        hold: Hold = request.scope[HOLD]
        hold.retain()
        return scheduler.submit(fn, cancel=cancel, view=view, release=hold.release)

    def submit(request: Request, call) -> Job:
        """A job running ``call(target, cancel)`` on a worker: ``target`` is the LLM, or with an engine this
        request's EngineLLM (pyllm/api.py's functions take either; its ``stats`` are this generation's)."""
        if engine is None:
            return submit_held(request, lambda cancel: call(llm, cancel))
        cancel = threading.Event()
        view = EngineLLM(llm, engine, cancel)
        return submit_held(request, lambda c: call(view, c), cancel=cancel, view=view)

    def submit_model_call(request: Request, call) -> Job:
        """A job running ``call(llm, cancel)`` on a worker outside any generation (embeddings): with an engine on
        the engine's thread, between its steps, as one thread runs the model."""
        if engine is None:
            return submit_held(request, lambda cancel: call(llm, cancel))
        return submit_held(request, lambda cancel: engine.call(lambda: call(llm, cancel)))

    async def next_item(request: Request, job: Job):
        """The job's next item; cancels the job if the client disconnects while it waits (checked every
        DISCONNECT_POLL_S: a small model makes a few hundred tokens a second for nobody until then)."""
        while True:
            try:
                return await asyncio.wait_for(job.out.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    raise asyncio.CancelledError from None

    async def respond(request: Request, route: str, job: Job, stream: bool, prompt_param: str = "messages",
                      framing: str = "sse") -> Response:
        """The job's result as the route's response: its one dict as JSON, or with ``stream`` its items as a
        stream in ``framing``: "sse" (OpenAI's events, ending in data: [DONE]), "events" (the Responses API's
        named events), "plain" (unnamed data events without [DONE]: llama-server's own routes) or "ndjson" (one
        JSON object a line, an error as {"error": message}: Ollama's)."""
        request.state.job = job  # the request log's token counts
        try:
            first = await next_item(request, job)
        except asyncio.CancelledError:
            return Response(status_code=499)
        if first is DONE:
            raise APIError(500, "the request produced no result")
        kind, value = first
        if kind == "error":
            raise _as_api_error(value, prompt_param)
        if not stream:
            await job.out.get()  # DONE, which follows at once: on_done has counted the job (the request log)
            metrics.request(route, 200)
            return JSONResponse(value)
        named, ndjson = framing == "events", framing == "ndjson"

        async def events():
            # Every item already waiting goes out in one write: a stream that fell behind (the event loop had
            # other streams to serve) catches up with one send instead of one per token.
            item, seq = first, 0
            try:
                while item is not DONE:
                    out = []
                    while True:
                        kind, value = item
                        if kind == "error":
                            e = _as_api_error(value, prompt_param)
                            error = {"message": e.message, "type": ERROR_TYPES[e.status], "param": e.param,
                                     "code": e.code}
                            # the Responses API's error event: the error's fields at the top, its type "error";
                            # the error's own type (server_error, ...) would be lost under it, so it is the code
                            # when the error has none
                            if ndjson:
                                out.append(json.dumps({"error": e.message}, ensure_ascii=False) + "\n")
                            else:
                                out.append(sse_event({**error, "type": "error", "code": e.code or error["type"],
                                                      "sequence_number": seq + 1}, "error")
                                           if named else sse_event({"error": error}))
                            yield "".join(out)
                            # DONE follows the error once on_done has counted the job: the request log, written
                            # when this response ends, then has the tokens generated before the failure
                            while await job.out.get() is not DONE:
                                pass
                            return
                        if ndjson:
                            out.append(json.dumps(value, separators=(",", ":"), ensure_ascii=False) + "\n")
                        else:
                            out.append(sse_event(value, value["type"]) if named else sse_event(value))
                        seq = value.get("sequence_number", seq)
                        if job.out.empty():
                            item = None
                            break
                        item = job.out.get_nowait()
                        if item is DONE:
                            break
                    yield "".join(out)
                    if item is None:
                        item = await job.out.get()
                if framing == "sse":
                    yield "data: [DONE]\n\n"
            finally:
                job.cancel.set()  # the client went away (or the stream ended): stop at the next token

        metrics.request(route, 200)
        return StreamingResponse(events(), media_type="application/x-ndjson" if ndjson else "text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def generate(request: Request, route: str, fn_name: str, translate=None, plain_events=False) -> Response:
        """``translate``: for a route in another API's shape, data -> (fn's keyword arguments, shape), where
        shape(make) runs make() (the call) on the worker and returns its result in the route's shape.
        ``plain_events``: a translated stream is sent as unnamed data events with no [DONE] (llama-server's own)."""
        data = await read_json(request)
        stream = bool(data.get("stream"))
        prompt_param = ("input" if translate else "messages") if fn_name == "create_chat_completion" else "prompt"
        if translate is None:
            data, shape = call_kwargs(getattr(api, fn_name), data, prompt_param), lambda make: make()
        else:
            try:
                data, shape = translate(data)
            except PyllmError as e:
                raise _as_api_error(e, prompt_param) from None
        fn = getattr(api, fn_name)
        job = submit(request, lambda target, cancel: shape(lambda: fn(target, **data, cancel=cancel)))
        framing = "plain" if plain_events else "events" if translate else "sse"
        return await respond(request, route, job, stream, prompt_param, framing)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions", "create_chat_completion")

    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions", "create_completion")

    async def create_response(request: Request) -> Response:
        return await generate(request, "/v1/responses", "create_chat_completion", responses.translate)

    async def infill_route(request: Request) -> Response:
        return await generate(request, "/infill", "create_completion", lambda data: infill.translate(llm, data),
                              plain_events=True)

    async def embeddings(request: Request) -> Response:
        from ..embed import create_embedding

        data = call_kwargs(create_embedding, await read_json(request), "input")
        job = submit_model_call(request, lambda model, cancel: model.create_embedding(**data, cancel=cancel))
        request.state.job = job
        try:
            kind, value = await next_item(request, job)
        except asyncio.CancelledError:
            return Response(status_code=499)
        if kind == "error":
            e = _as_api_error(value)
            raise APIError(e.status, e.message, e.param or "input", e.code)
        metrics.request("/v1/embeddings", 200)
        return JSONResponse(value)

    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "pyllm",
                  "meta": {"n_ctx": llm.n_ctx, "n_vocab": llm.n_vocab}}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card]})

    async def model(request: Request) -> Response:
        return JSONResponse(model_card)  # every name is the one model served (read_json)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def prometheus(request: Request) -> Response:
        return PlainTextResponse(metrics.text(scheduler), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/infill", infill_route, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        *web_routes(),  # the browser chat page at / (webui.py)
    ]

    async def on_api_error(request: Request, e: APIError) -> Response:
        metrics.request(request.url.path if request.url.path in ROUTES else "other", e.status)
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    async def on_http_error(request: Request, e: HTTPException) -> Response:
        metrics.request("other", e.status_code)
        msg = {404: f"unknown route {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, e.detail)
        return error_response(e.status_code, msg)

    async def on_error(request: Request, e: Exception) -> Response:
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    routes += ollama.routes(llm, model_name, read_json, submit, submit_model_call, respond, APIError)  # /api
    ROUTES = {r.path for r in routes}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()
        parser.shutdown(wait=False, cancel_futures=True)
        if engine is not None:
            engine.close()

    app = API(routes=routes, exception_handlers={APIError: on_api_error, HTTPException: on_http_error,
                                                 Exception: on_error}, lifespan=lifespan, cors_origins=cors_origins)
    app.add_middleware(Admission, budget=budget)
    app.add_middleware(BodyDeadline, timeout=client_timeout)
    app.add_middleware(AccessControl, api_key=api_key, check_host=bound_to_loopback(host), allow_hosts=allow_hosts,
                       on_refused=lambda path, status: metrics.request(path if path in ROUTES else "other", status))
    if log_format is not None:  # outermost of these: it sees the 401s, 403s and 408s too
        app.add_middleware(RequestLog, log_format=log_format)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    return app


def prepare_for_requests(llm) -> None:
    """What the first request would otherwise wait for, done before the port opens: the kernel extension (built if
    this machine has no cached build: a compile that can take minutes) and the tokenizer's table for refusing
    prompts that cannot fit (a walk over the vocabulary, 0.3-1.7 s)."""
    if llm.kernels != "reference":
        from .. import ops

        ops.get_isa()
    llm.tokenizer.min_tokens("")


def listen_socket(host: str, port: int):
    """A listening TCP socket on host:port, in the address family the host resolves to (socket.create_server alone
    is IPv4: it cannot bind ::1 or ::). OSError (socket.gaierror for a name that does not resolve) if it cannot."""
    import socket

    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return socket.create_server(addr, family=family)


def _cut_off_at_shutdown(record) -> bool:
    """uvicorn logs a request it cancels when the shutdown grace runs out with the CancelledError's traceback:
    one line instead (no bug to report; the shutdown was asked for)."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, asyncio.CancelledError):
        record.msg, record.args, record.exc_info, record.exc_text = (
            "a request still in flight was cut off by the shutdown", (), None, None)
    return True


def head_deadline_protocol(timeout: float):
    """uvicorn's h11 protocol with a deadline for each request head: the connection is closed when a head is not
    whole ``timeout`` seconds after the server began waiting for it (the connection opened, or the last response
    ended), with a 408 if part of one came. uvicorn's own timer (timeout_keep_alive) starts only after a response
    and stops at the first byte of the next request, so a client sending its head byte by byte, or never a byte,
    held the connection without end. Never armed while a request runs: a long streamed response is not cut."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):
        timer = waiting_after = None

        def arm(self) -> None:
            self.disarm()
            self.waiting_after = self.cycle  # the next head starts a cycle other than this one
            self.timer = self.loop.call_later(timeout, self.expire)

        def disarm(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

        def expire(self) -> None:
            self.timer = None
            if self.transport.is_closing():
                return
            if self.conn.trailing_data[0]:  # bytes of a head h11 holds unparsed: a client is waiting for a reply
                msg = f"request head not received within {timeout:g} s (--client-timeout)".encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(msg), msg))
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.arm()

        def connection_lost(self, exc) -> None:
            self.disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.timer is not None and self.cycle is not self.waiting_after:
                self.disarm()  # a head arrived

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self.arm()  # before the parent's, which may take a pipelined head at once
            super().on_response_complete()

    return HeadDeadline


def serve(llm, model_name: str, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          max_body: int = MAX_BODY_BYTES, parallel: int = 1, prompt_cache=None, sock=None, cors_origins=(),
          client_timeout: float = CLIENT_TIMEOUT_S, allow_hosts=(), max_request_memory: int | None = None,
          log_format: str | None = "text", kv_pool_tokens: int | None = None) -> None:
    """``sock``: a socket from listen_socket, already bound (else one is bound here). ``client_timeout``: the
    deadline of a request's head (head_deadline_protocol) and body (BodyDeadline). ``allow_hosts``,
    ``max_request_memory``, ``log_format``: create_app's."""
    import sys

    import uvicorn

    prepare_for_requests(llm)
    app = create_app(llm, model_name, api_key=api_key, max_body=max_body, parallel=parallel,
                     prompt_cache=prompt_cache, cors_origins=cors_origins, client_timeout=client_timeout, host=host,
                     allow_hosts=allow_hosts, max_request_memory=max_request_memory, log_format=log_format,
                     kv_pool_tokens=kv_pool_tokens)
    sock = sock or listen_socket(host, port)
    # h11, not httptools (uvicorn's pick when it is installed): httptools keeps a request's header lines however
    # long they grow, so one client sending an endless header took the server's memory (256 MiB of header, +376
    # MiB RSS); h11 refuses a request head over MAX_HEAD_BYTES with 400 and closes the connection. No websockets:
    # no route takes one, and an upgraded connection would leave the head deadline running under another protocol
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            http=head_deadline_protocol(client_timeout), ws="none",
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                            # SIGTERM / Ctrl-C waited without end for a client that never finished sending its body
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    logging.getLogger("uvicorn.error").addFilter(_cut_off_at_shutdown)
    server = uvicorn.Server(config)
    slots = f", {parallel} slots" if parallel > 1 else ""
    cache = f", prompt cache {prompt_cache}" if prompt_cache else ""
    port = sock.getsockname()[1]  # the port the system chose for --port 0
    shown = f"[{host}]" if ":" in host else host
    if getattr(llm, "is_encoder", False):  # no KV cache, no slots: one text at a time
        slots, cache, kv = "", "", f"embedding model, {llm.config.n_embd} dimensions"
    else:
        kv = f"KV {llm.kv.kind}"
    print(f"pyllm serve: {model_name} on http://{shown}:{port}/v1 (context {llm.n_ctx}, {kv}{slots}"
          f"{cache})", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
