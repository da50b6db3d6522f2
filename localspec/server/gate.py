"""The ASGI layer in front of every route: start the clock, refuse while loading, check the key,
name the server (``Server: localspec/<version>``, even on a 503 while loading, so a client
or ``localspec up`` can tell a loading localspec from another program on the port).

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware: it adds no task or
stream wrapping (which would hide the client's disconnect from the routes) and costs
microseconds per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localspec import __version__
from localspec.server.auth import PUBLIC_PATHS, key_matches, presented_key
from localspec.server.dispatch import T0_KEY
from localspec.server.errors import ApiError, error_body
from localspec.server.results import dumps

# What the gate needs to know of the daemon's state: None when ready, else the error to answer.
StateProbe = Callable[[], ApiError | None]

SERVER_HEADER = (b"server", f"localspec/{__version__}".encode())


class Gate:
    def __init__(self, app: ASGIApp, *, api_key: str | None, not_ready: StateProbe) -> None:
        self.app = app
        self.api_key = api_key
        self.not_ready = not_ready

    async def __call__(self, scope: Scope, receive: Receive, raw_send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, raw_send)
            return
        scope[T0_KEY] = time.perf_counter()

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), SERVER_HEADER]
            await raw_send(message)

        if scope["method"] != "OPTIONS":  # CORS preflights carry no credentials
            err = self.not_ready()
            if err is not None:
                await _send_json(send, err.status, err.body(), err.headers)
                return
            if self.api_key and scope["path"] not in PUBLIC_PATHS and not self._authorized(scope):
                body = error_body("Invalid API Key", "authentication_error")
                await _send_json(send, 401, body, {"WWW-Authenticate": "Bearer"})
                return
        if scope["method"] == "POST":
            scope["headers"] = _as_json(scope["headers"])
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode("latin-1") or None
        x_key = headers.get(b"x-api-key", b"").decode("latin-1") or None
        assert self.api_key is not None
        return key_matches(presented_key(auth, x_key), self.api_key)


def _as_json(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Every POST body is JSON, whatever its Content-Type says (as in llama-server):
    ``curl -d '{...}'`` sends ``application/x-www-form-urlencoded``."""
    kept = [(k, v) for k, v in headers if k.lower() != b"content-type"]
    return [*kept, (b"content-type", b"application/json")]


async def _send_json(send: Send, status: int, obj: object, headers: dict[str, str]) -> None:
    body = dumps(obj)
    raw = [
        (b"content-type", b"application/json; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
