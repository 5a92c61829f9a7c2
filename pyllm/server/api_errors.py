"""The server's client-facing error: an HTTP status with OpenAI's error object (app.py's handlers send it; on /api
Ollama's middleware rewrites it to Ollama's shape)."""

from __future__ import annotations

from starlette.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
               413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    # after a 408 the rest of the body may still come, or never: the connection cannot carry another request
    headers = {**(headers or {}), "Connection": "close"} if status == 408 else headers
    return JSONResponse({"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                                   "param": param, "code": code}}, status_code=status, headers=headers)
