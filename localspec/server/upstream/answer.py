"""An upstream's answer as the editor will get it, and the upstream's errors in llama-server's
shape.

A backend hands the failover an :class:`Answer` only once it is committed to: a whole body
(non-streamed: the upstream answered in full), or a stream whose first chunk has arrived.
Anything that fails before that point is an ``UpstreamFailure``, and the local model can
still answer instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic_core

from localspec.server.errors import ERROR_CODES, ApiError, ErrorType, error_body
from localspec.server.results import dumps
from localspec.server.upstream.config import UpstreamSettings

JSON = b"application/json; charset=utf-8"
SSE = b"text/event-stream"
_TYPES: dict[int, ErrorType] = {code: name for name, code in ERROR_CODES.items()}
_TYPES[400] = "invalid_request_error"  # exceed_context_size_error shares 400


async def _nothing() -> None:
    return None


@dataclass
class Answer:
    status: int
    content_type: bytes = JSON
    body: bytes = b""  # the whole answer (``chunks`` is None)
    chunks: AsyncIterator[bytes] | None = None  # a stream, passed on chunk by chunk
    close: Callable[[], Awaitable[None]] = _nothing  # ends the upstream request (idempotent)
    upstream_ms: float = 0.0  # request sent to answer started
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    upstream_timing: str = ""  # the upstream's own Server-Timing (a localspec upstream's)

    @property
    def streamed(self) -> bool:
        return self.chunks is not None


def json_answer(obj: Any, status: int = 200, upstream_ms: float = 0.0) -> Answer:
    return Answer(status, JSON, dumps(obj), upstream_ms=upstream_ms)


def error_answer(exc: ApiError) -> Answer:
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
    return Answer(exc.status, JSON, dumps(exc.body()), headers=headers)


def error_type(status: int) -> ErrorType:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def upstream_message(raw: bytes) -> str:
    """The message in an upstream's error body: llama-server's and OpenAI's
    ``{"error":{"message"}}``, vLLM's ``{"message"}``, Ollama's ``{"error":"..."}``, or text."""
    try:
        body = pydantic_core.from_json(raw) if raw else None
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        if body.get("message"):
            return str(body["message"])
        if body.get("detail"):
            return str(body["detail"])
    text = raw.decode("utf-8", "replace").strip()
    return text[:500] or "no detail"


def is_llama_error(raw: bytes) -> bool:
    """Whether ``raw`` already is llama-server's error shape (passed on untouched then)."""
    try:
        body = pydantic_core.from_json(raw)
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and {"code", "message", "type"} <= err.keys()


def upstream_error(status: int, raw: bytes, cfg: UpstreamSettings) -> Answer:
    """An upstream's 4xx/5xx in llama-server's shape, saying it came from the upstream (a 401
    says whose key it refused: the editor's own key to localspec is not the one at fault)."""
    if status in (401, 403):
        message = f"{cfg.refused_message()} (it said: {upstream_message(raw)})"
    else:
        message = f"upstream {cfg.url}: {upstream_message(raw)}"
    return Answer(status, JSON, dumps(error_body(message, error_type(status), code=status)))
