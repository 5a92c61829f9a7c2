"""The browser chat page at ``/`` (as llama-server ships one): static files from pyllm/server/web/, no build step.

The page calls this server's own /v1 routes (same origin, so no CORS), streams replies over
/v1/chat/completions' server-sent events and keeps conversations in the browser's localStorage; nothing is stored
on the server. Every response carries a Content-Security-Policy that lets the page run only its own script files
and send HTML to the DOM only through its markdown renderer (Trusted Types): model text that slips markup past the
renderer still cannot run a script (docs/DESIGN.md, Web chat page).
"""

from __future__ import annotations

import hashlib
from importlib import resources

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# name under /web/ -> content type; a fixed table, so no request path ever names a file
ASSETS = {
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
INDEX = ("index.html", "text/html; charset=utf-8")

# default-src 'none': what is not named here is refused. No 'unsafe-inline' or 'unsafe-eval' anywhere, so no inline
# script, event-handler attribute or style attribute in rendered text takes effect; the one Trusted Types policy
# (created by markdown.js) is the only way to assign HTML.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'; "
       "require-trusted-types-for 'script'; trusted-types pyllm-markdown")
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated by ETag: an upgraded pyllm serves its new page at once
}


def _load(name: str) -> bytes:
    return resources.files(__package__).joinpath("web", name).read_bytes()


def routes() -> list[Route]:
    """GET / (the page) and GET /web/NAME (its script, style and icon files), read once here."""
    files = {f"/web/{name}": (_load(name), kind) for name, kind in ASSETS.items()}
    files["/"] = (_load(INDEX[0]), INDEX[1])
    tags = {path: '"' + hashlib.sha256(body).hexdigest()[:20] + '"' for path, (body, _) in files.items()}

    async def asset(request: Request) -> Response:
        path = request.url.path
        if path not in files:
            raise HTTPException(404)
        body, kind = files[path]
        headers = {**HEADERS, "ETag": tags[path]}
        if request.headers.get("if-none-match") == tags[path]:
            return Response(status_code=304, headers=headers)
        return Response(body, media_type=kind, headers=headers)

    return [Route("/", asset, methods=["GET"]), Route("/web/{name}", asset, methods=["GET"])]
