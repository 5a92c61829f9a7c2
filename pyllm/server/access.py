"""Who may reach the server: the API key (--api-key) and, on loopback, the Host names of this machine
(--allow-host), checked by one middleware in front of every route."""

from __future__ import annotations

import hmac

from .api_errors import APIError, error_response

# --api-key leaves these open, as llama-server does: the health check, the model lists (OpenAI's and Ollama's) and
# the web page and its static files under /web/ (a browser cannot send a key with a navigation or a script tag; the
# page's own calls send it). Every other path, /metrics and routes added later included, needs the key.
OPEN_PATHS = frozenset({"/health", "/v1/models", "/api/tags", "/"})
OPEN_PREFIXES = ("/web/",)


def bound_to_loopback(host: str) -> bool:
    """Whether the listening address ``host`` (an address or a name) is this machine's loopback only."""
    import ipaddress
    import socket

    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def host_name(header: str) -> str:
    """The host of a Host header: the port and a trailing dot dropped, an IPv6 literal without its brackets,
    lowercased."""
    h = header.strip().lower()
    if h.startswith("["):
        h = h[1:h.find("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:
        h = h.split(":")[0]
    return h.rstrip(".")


def local_host(name: str, allowed=()) -> bool:
    """Whether a server bound to loopback answers a request whose Host names ``name`` (host_name's form): the
    names a page on this machine reaches it by (localhost and *.localhost, loopback and private addresses, this
    machine's name) and ``allowed`` (--allow-host: names, ``*.domain`` for its subdomains, ``*`` for any). A page
    on another site whose name the attacker re-points at 127.0.0.1 (DNS rebinding) sends its own name, which is
    none of these (Ollama's defence)."""
    import ipaddress
    import socket

    if name in ("", "localhost") or name.endswith(".localhost") or name == socket.gethostname().lower():
        return True
    try:
        ip = ipaddress.ip_address(name.split("%")[0])
    except ValueError:
        ip = None
    if ip is not None and (ip.is_loopback or ip.is_private or ip.is_unspecified or ip.is_link_local):
        return True
    for a in allowed:
        if a == "*" or a == name or (a.startswith("*.") and name.endswith(a[1:])):
            return True
    return False


class AccessControl:
    """ASGI middleware, the one gate every route is behind (routes added later too): a Host header that a server
    bound to loopback does not answer to is a 403 (local_host), and with an API key every path but OPEN_PATHS
    needs it (401). ``on_refused(path, status)`` counts a refusal."""

    def __init__(self, app, api_key: str | None, check_host: bool, allow_hosts=(), on_refused=None):
        self.app, self.api_key, self.check_host = app, api_key, check_host
        self.allow_hosts = tuple(allow_hosts)
        self.on_refused = on_refused

    def refusal(self, scope) -> APIError | None:
        headers = {k: v for k, v in scope.get("headers", ()) if k in (b"host", b"authorization", b"x-api-key")}
        if self.check_host:
            header = headers.get(b"host", b"").decode("latin-1")
            if not local_host(host_name(header), self.allow_hosts):
                return APIError(403, f"this server answers requests for this machine's names only, not for Host "
                                     f"{header[:100]!r} (a page whose name points at 127.0.0.1 must not reach it); "
                                     f"start it with --allow-host NAME to serve that name", None, "host_not_allowed")
        path = scope["path"]
        if self.api_key is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            given = auth[7:] if auth.lower().startswith("bearer ") else headers.get(b"x-api-key", b"").decode(
                "latin-1")
            if not hmac.compare_digest(given.encode("latin-1"), self.api_key.encode()):
                return APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", None,
                                "invalid_api_key")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            e = self.refusal(scope)
            if e is not None:
                if self.on_refused:
                    self.on_refused(scope["path"], e.status)
                await error_response(e.status, e.message, e.param, e.code)(scope, receive, send)
                return
        await self.app(scope, receive, send)
