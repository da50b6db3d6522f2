"""A shorter way from the socket to an endpoint than FastAPI's own, for the editor's requests.

Why it exists: an editor sends a request per keystroke, and FastAPI's generic route handler
(content-type sniffing, ``json.loads``, dependency solving, exit stacks) plus its router's walk
through nested route contexts cost about 0.3 ms of every request, on the path whose latency the
user feels (docs/server.md). ``LeanRoute`` keeps FastAPI's routing table and OpenAPI document
but serves a route with a handler that validates the body straight from the raw bytes (the same
pydantic models, the same 400s); ``Direct`` sends a request for such a route's exact method and
path straight to that handler. Everything else (404, 405, /docs, preflights) still takes
FastAPI's router, and an exception still reaches the app's error handler.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from localspec.server.dispatch import error_response
from localspec.server.errors import ApiError
from localspec.server.schemas import parse_body

Endpoint = Callable[..., Coroutine[Any, Any, Response]]


class LeanRoute(APIRoute):
    """A route FastAPI documents from the endpoint's signature (the body's model in OpenAPI)
    but does not serve: FastAPI's generic handler (content-type sniffing, ``json.loads``,
    dependency solving, exit stacks, validating the dicts) cost ≈0.2 ms of every request.

    Here the body is validated straight from the raw bytes (``schemas.parse_body``: same
    models, same 400s) and the endpoint gets ``body``, ``request`` and ``svc`` by name; every
    endpoint returns a ready ``Response``, so there is no response model to apply either.
    """

    PARAMS = frozenset({"body", "request", "svc"})

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint: Endpoint = self.endpoint
        names = set(inspect.signature(endpoint).parameters)
        if not names <= self.PARAMS:  # a new parameter would silently never be filled in
            raise TypeError(f"{endpoint.__name__}: parameters {names - self.PARAMS} unsupported")
        model = self.body_field.field_info.annotation if self.body_field is not None else None
        if ("body" in names) != (model is not None):
            raise TypeError(f"{endpoint.__name__}: the body must be a pydantic model named body")
        wants_request, wants_svc = "request" in names, "svc" in names

        async def handler(request: Request) -> Response:
            kwargs: dict[str, Any] = {}
            if model is not None:
                try:
                    kwargs["body"] = parse_body(model, await request.body())
                except ApiError as exc:
                    return error_response(exc, request)
            if wants_request:
                kwargs["request"] = request
            if wants_svc:
                kwargs["svc"] = request.app.state.service
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


def route_paths(routes: Any) -> frozenset[str]:
    """Every path the app serves."""
    paths = (getattr(route, "path", None) for route in _flat_routes(routes))
    return frozenset(path for path in paths if isinstance(path, str))
