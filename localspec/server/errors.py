"""llama-server's error body ``{"error":{"code","message","type"}}`` and exceptions mapping to it.

Clients (llama-vscode, llama.vim, OpenAI SDKs) branch on ``type`` and ``code``; the pairs below
are llama-server's ``format_error_response`` table.
"""

from __future__ import annotations

from typing import Any, Literal

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "not_found_error",
    "server_error",
    "permission_error",
    "not_supported_error",
    "unavailable_error",
    "exceed_context_size_error",
]

ERROR_CODES: dict[ErrorType, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "not_found_error": 404,
    "server_error": 500,
    "permission_error": 403,
    "not_supported_error": 501,
    "unavailable_error": 503,
    "exceed_context_size_error": 400,
}


def error_body(message: str, type_: ErrorType, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": ERROR_CODES[type_], "message": message, "type": type_, **extra}}


class ApiError(Exception):
    """An error answered to the client in llama-server's format; never fatal to the daemon."""

    type_: ErrorType = "server_error"

    def __init__(
        self,
        message: str,
        type_: ErrorType | None = None,
        *,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if type_ is not None:
            self.type_ = type_
        self.headers = headers or {}
        self.extra = extra or {}

    @property
    def status(self) -> int:
        return ERROR_CODES[self.type_]

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type_, **self.extra)


class InvalidRequest(ApiError):
    type_ = "invalid_request_error"


class NotSupported(ApiError):
    type_ = "not_supported_error"


class Unavailable(ApiError):
    type_ = "unavailable_error"


class ContextExceeded(ApiError):
    type_ = "exceed_context_size_error"

    def __init__(self, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"request ({n_prompt_tokens} tokens) exceeds the available context size "
            f"({n_ctx} tokens), try increasing it",
            extra={"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx},
        )
