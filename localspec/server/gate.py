"""The ASGI front door: every request passes the gate, then the editor's routes go straight to
their handlers.

The gate (``Gate``) starts the clock, refuses while loading, checks the key, bounds the body,
names the server (``Server: localspec/<version>``, even on a 503 while loading, so a client or
``localspec up`` can tell a loading localspec from another program on the port), and when the
answer is out, logs one line and counts it.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware: it adds no task or
stream wrapping around the routes (which would hide the client's disconnect from them) and
costs microseconds per request; only the body is read under a timeout (``asyncio.wait_for``,
~20 us).

The editor's routes then skip FastAPI's own way to an endpoint (``LeanRoute``, ``Direct``):
an editor sends a request per keystroke, and FastAPI's generic route handler (content-type
sniffing, ``json.loads``, dependency solving, exit stacks) plus its router's walk through
nested route contexts cost about 0.3 ms of every request, on the path whose latency the user
feels (docs/server.md). ``LeanRoute`` keeps FastAPI's routing table and OpenAPI document but
serves a route with a handler that validates the body straight from the raw bytes (the same
pydantic models, the same 400s); ``Direct`` sends a request for such a route's exact method
and path straight to that handler. Everything else (404, 405, /docs, preflights) still takes
FastAPI's router, and an exception still reaches the app's error handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localspec import __version__
from localspec.server import logs
from localspec.server.dispatch import LOG_KEY, T0_KEY, error_response
from localspec.server.errors import ApiError, error_body
from localspec.server.requests import parse_body
from localspec.server.results import dumps

# What the gate needs to know of the daemon's state: None when ready, else the error to answer.
StateProbe = Callable[[], ApiError | None]
# Called once per finished request (metrics); the log line is written by the gate itself.
Observer = Callable[[logs.RequestLog], None]

SERVER_HEADER = (b"server", f"localspec/{__version__}".encode())
CLIENT_GONE = 499  # nginx's code for "the client closed the connection"
# answered without the API key: the health check, and the chat page (an iframe sends no
# header; the page asks for the key and sends it with its own requests, as llama-server's UI)
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/", "/index.html", "/stats"})
# answered while the daemon cannot serve (loading, or a team server down with no local model):
# monitoring reads the counters of exactly that time (llama-server answers it 503 while loading)
ANSWERED_UNREADY = frozenset({"/metrics"})
# A body refused for its size is still read (and dropped) up to this much, so a client that
# sends all of it before reading (Python's http.client, urllib, requests) reads the 413
# instead of a broken pipe; past it the connection is closed.
DRAIN_MAX = 256 * 1024 * 1024


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
            err = None if scope["path"] in ANSWERED_UNREADY else self.not_ready()
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
            await self._drain(receive, int(declared))
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
                if message.get("more_body", False):
                    size += await self._drain(receive, DRAIN_MAX)
                await self._too_large(send, size)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _drain(self, receive: Receive, declared: int) -> int:
        """Read and drop the rest of a refused body (see DRAIN_MAX) within the body timeout;
        the bytes read."""
        if declared > DRAIN_MAX:
            return 0
        read = 0

        async def drain() -> None:
            nonlocal read
            while read <= DRAIN_MAX:
                message = await receive()
                read += len(message.get("body", b""))
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(drain(), self.body_timeout_s)
        return read

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


# --- the API key: llama-server's rules (Bearer or X-Api-Key), compared in constant time -------


def presented_key(authorization: str | None, x_api_key: str | None) -> str:
    value = authorization or x_api_key or ""
    return value[7:] if value.startswith("Bearer ") else value


def key_matches(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


# --- the editor's routes, straight to their handlers ----------------------------------------------

Endpoint = Callable[..., Coroutine[Any, Any, Response]]


class LeanRoute(APIRoute):
    """A route FastAPI documents from the endpoint's signature (the body's model in OpenAPI)
    but does not serve: FastAPI's generic handler (content-type sniffing, ``json.loads``,
    dependency solving, exit stacks, validating the dicts) cost ≈0.2 ms of every request.

    Here the body is validated straight from the raw bytes (``requests.parse_body``: same
    models, same 400s) and the endpoint gets ``body`` and ``request`` by name, and each of its
    FastAPI dependencies (``Depends``: the app's Service, ``app.Svc``) from the dependency's own
    function, called with the request: the routes declare what they need the FastAPI way, and
    this handler solves those declarations without FastAPI's machinery. Every endpoint returns a
    ready ``Response``, so there is no response model to apply either.
    """

    PARAMS = frozenset({"body", "request"})

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint: Endpoint = self.endpoint
        names = set(inspect.signature(endpoint).parameters)
        deps = {d.name: d for d in self.dependant.dependencies if d.name is not None}
        unsupported = names - self.PARAMS - set(deps)
        if unsupported:  # a new parameter would silently never be filled in
            raise TypeError(f"{endpoint.__name__}: parameters {unsupported} unsupported")
        solvers: dict[str, Callable[[Request], Awaitable[Any]]] = {}
        for name, dep in deps.items():
            # a dependency of the request alone, async: anything more takes FastAPI's solver
            only_request = dep.request_param_name is not None and not (
                dep.dependencies or dep.query_params or dep.header_params or dep.body_params
            )
            if not (only_request and inspect.iscoroutinefunction(dep.call)):
                raise TypeError(f"{endpoint.__name__}: dependency {name} must be async(request)")
            solvers[name] = dep.call  # type: ignore[assignment]
        model = self.body_field.field_info.annotation if self.body_field is not None else None
        if ("body" in names) != (model is not None):
            raise TypeError(f"{endpoint.__name__}: the body must be a pydantic model named body")
        wants_request = "request" in names

        async def handler(request: Request) -> Response:
            kwargs: dict[str, Any] = {}
            if model is not None:
                try:
                    kwargs["body"] = parse_body(model, await request.body())
                except ApiError as exc:
                    return error_response(exc, request)
            if wants_request:
                kwargs["request"] = request
            for name, solve in solvers.items():
                kwargs[name] = await solve(request)
            return await endpoint(**kwargs)

        self.handler = handler  # for Direct
        return handler


class Direct:
    """ASGI, inside the gate: a request for a LeanRoute's exact method and path goes straight to
    its handler; anything else (404, 405, /docs, /openapi.json, preflights) takes FastAPI's
    router. The router walks nested route contexts, behind two more middlewares, on every
    request (≈0.1 ms). An exception a handler raises still reaches the app's error handler
    (500 in llama-server's format)."""

    def __init__(self, app: ASGIApp, routes: Iterable[Any]) -> None:
        self.app = app
        self.handlers: dict[tuple[str, str], Callable[[Request], Awaitable[Response]]] = {
            (method, route.path): route.handler
            for route in _flat_routes(routes)
            if isinstance(route, LeanRoute)
            for method in route.methods
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = self.handlers.get((scope["method"], scope["path"]))
            if handler is not None:
                response = await handler(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _flat_routes(routes: Iterable[Any]) -> Iterator[Any]:
    """Every route (FastAPI nests an included router instead of copying its routes)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _flat_routes(inner.routes)
        else:
            yield route


def body_models(routes: Iterable[Any]) -> dict[tuple[str, str], type[Any]]:
    """Each LeanRoute's body model by (method, path): what a request to it must parse as."""
    return {
        (method, route.path): route.body_field.field_info.annotation
        for route in _flat_routes(routes)
        if isinstance(route, LeanRoute) and route.body_field is not None
        for method in route.methods
    }


def route_paths(routes: Any) -> frozenset[str]:
    """Every path the app serves."""
    paths = (getattr(route, "path", None) for route in _flat_routes(routes))
    return frozenset(path for path in paths if isinstance(path, str))
