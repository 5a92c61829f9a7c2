"""One log line per HTTP request (``pyllm serve --log-format text|json``), written when its response has ended (a
stream: after its last event), to stderr.

A line names the method, the path, the status, the prompt and generated tokens of the generation the request ran
(``-`` / null for requests that generate nothing, or whose client left before the worker was done) and the
milliseconds from the request's arrival to its response's end. /health and /metrics are left out, as llama-server
leaves them out: probes and scrapers call them every few seconds. The path is the client's text: it is cut to
MAX_PATH characters and, in text lines, escaped, so no request can write a line of its own into the log.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
QUIET_PATHS = ("/health", "/metrics")
MAX_PATH = 200


def _printable(text: str) -> str:
    """``text`` with what is not printable escaped (a newline would start a forged line), cut to MAX_PATH."""
    cut = text[:MAX_PATH] + ("..." if len(text) > MAX_PATH else "")
    return cut if cut.isprintable() and " " not in cut else cut.encode("unicode_escape").decode().replace(" ", "%20")


def format_line(log_format: str, method: str, path: str, status: int, tokens: tuple[int, int] | None,
                ms: float, client: str | None) -> str:
    when = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    prompt, generated = tokens if tokens is not None else (None, None)
    if log_format == "json":
        return json.dumps({"time": when, "client": client, "method": method, "path": path[:MAX_PATH],
                           "status": status, "prompt_tokens": prompt, "generated_tokens": generated,
                           "ms": round(ms, 1)}, ensure_ascii=False)
    shown = lambda n: "-" if n is None else n  # noqa: E731
    return (f"{when} {client or '-'} {_printable(method)} {_printable(path)} {status} prompt={shown(prompt)} "
            f"generated={shown(generated)} {ms:.0f} ms")


class RequestLog:
    """ASGI middleware writing format_line for each HTTP request to ``stream``. The token counts come from the
    scheduler Job the route left in the request's state (``request.state.job``)."""

    def __init__(self, app, log_format: str = "text", stream=None):
        if log_format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
        self.app, self.log_format, self.stream = app, log_format, stream

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in QUIET_PATHS:
            return await self.app(scope, receive, send)
        start = time.monotonic()
        status = 500  # what the client gets when the app fails before it responds (ServerErrorMiddleware's)

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            job = scope.get("state", {}).get("job")
            client = scope.get("client")
            line = format_line(self.log_format, scope["method"], scope["path"], status,
                               getattr(job, "tokens", None), (time.monotonic() - start) * 1000,
                               client[0] if client else None)
            print(line, file=self.stream or sys.stderr, flush=True)
