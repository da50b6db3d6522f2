"""The ASGI layer in front of every route: start the clock, refuse while loading, check the key,
bound the body, name the server (``Server: localspec/<version>``, even on a 503 while loading,
so a client or ``localspec up`` can tell a loading localspec from another program on the
port), and when the answer is out, log one line and count it.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware: it adds no task or
stream wrapping around the routes (which would hide the client's disconnect from them) and
costs microseconds per request; only the body is read under a timeout (``asyncio.wait_for``,
~20 us).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localspec import __version__
from localspec.server import logs
from localspec.server.auth import PUBLIC_PATHS, key_matches, presented_key
from localspec.server.dispatch import LOG_KEY, T0_KEY
from localspec.server.errors import ApiError, error_body
from localspec.server.results import dumps

# What the gate needs to know of the daemon's state: None when ready, else the error to answer.
StateProbe = Callable[[], ApiError | None]
# Called once per finished request (metrics); the log line is written by the gate itself.
Observer = Callable[[logs.RequestLog], None]

SERVER_HEADER = (b"server", f"localspec/{__version__}".encode())
CLIENT_GONE = 499  # nginx's code for "the client closed the connection"


class Gate:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        not_ready: StateProbe,
        max_body: int = 8 * 1024 * 1024,
        body_timeout_s: float = 30.0,
        routes: frozenset[str] = frozenset(),
        observer: Observer | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.not_ready = not_ready
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s
        self.routes = routes
        self.observer = observer

    async def __call__(self, scope: Scope, receive: Receive, raw_send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, raw_send)
            return
        t0 = time.perf_counter()
        scope[T0_KEY] = t0
        path = scope["path"]
        entry = logs.RequestLog(
            scope["method"], path, route=path if path in self.routes else "other"
        )
        scope[LOG_KEY] = entry

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                entry.status = message["status"]
                message["headers"] = [*message.get("headers", ()), SERVER_HEADER]
            await raw_send(message)

        try:
            await self._handle(scope, receive, send)
        except BaseException:
            entry.status = entry.status or 500
            entry.outcome = entry.outcome or "error"
            raise
        finally:
            entry.status = entry.status or CLIENT_GONE
            entry.total_ms = (time.perf_counter() - t0) * 1e3
            logs.log_request(entry)
            if self.observer is not None:
                self.observer(entry)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "OPTIONS":  # CORS preflights carry no credentials
            err = self.not_ready()
            if err is not None:
                await _send_json(send, err.status, err.body(), err.headers)
                return
            if self.api_key and scope["path"] not in PUBLIC_PATHS and not self._authorized(scope):
                body = error_body("Invalid API Key", "authentication_error")
                await _send_json(send, 401, body, {"WWW-Authenticate": "Bearer"})
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            scope["headers"] = _as_json(scope["headers"])
            body = await self._read_body(scope, receive, send)
            if body is None:
                return
            logs.log_body(scope["method"], scope["path"], body)
            receive = replay_body(body, receive)
        await self.app(scope, receive, send)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None once a 413 or 408 went out (or the client left while
        sending). A client that trickles its body or stops half way would otherwise hold a
        connection and up to ``max_body`` of memory for as long as it likes."""
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await self._too_large(send, int(declared))
            return None
        try:
            return await asyncio.wait_for(self._receive_body(receive, send), self.body_timeout_s)
        except asyncio.TimeoutError:
            message = f"Request body not received within {self.body_timeout_s:g} s"
            body = {"error": {"code": 408, "message": message, "type": "invalid_request_error"}}
            await _send_json(send, 408, body, {"Connection": "close"})
            return None

    async def _receive_body(self, receive: Receive, send: Send) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await self._too_large(send, size)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send: Send, size: int) -> None:
        # llama-server's error shape; 413 is not in its table, the type is the closest one
        body = {
            "error": {
                "code": 413,
                "message": f"Request body too large: {size} bytes, the limit is {self.max_body}",
                "type": "invalid_request_error",
            }
        }
        await _send_json(send, 413, body, {"Connection": "close"})

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode("latin-1") or None
        x_key = headers.get(b"x-api-key", b"").decode("latin-1") or None
        assert self.api_key is not None
        return key_matches(presented_key(auth, x_key), self.api_key)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the real channel (the routes watch it for a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


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
