"""The ASGI layer that sends the editor's requests upstream and, when the upstream cannot
answer, to the local model.

It sits inside the gate (which has read the body, checked the key and started the request's
log line) and in front of the local routes. Per request:

- the upstream is known down (or skipped for answering late): the local model answers;
- otherwise the request goes upstream, and the local model answers instead when the upstream
  fails before its answer is committed (unreachable, TLS refused, closed, 429/502/503/504, a
  200 that is not an answer) or has not committed within ``fallback_ms`` (then the upstream
  request is closed);
- the editor leaving closes the upstream request at once (the upstream stops generating);
- a streamed answer that breaks after its first chunk ends with an error event in
  llama-server's shape (the text already shown cannot be taken back);
- a generation request whose body the local route would refuse gets that route's 400 here,
  without going upstream: llama-server answers a body that is not JSON, or an /infill
  without ``input_suffix``, with a 500 (its JSON library's exception), and the editor should
  get the same clear 400 whichever backend would have answered.

Who answered goes into the request's log line (``backend=upstream|local``, ``fallback=``
reason), the metrics and /props. Without a local model (``backend.fallback = none``), or while
it loads, a request the upstream cannot take gets a 503 that says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import pydantic_core
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localspec.server.dispatch import LOG_KEY
from localspec.server.errors import ApiError, NotSupported, Unavailable
from localspec.server.gate import replay_body
from localspec.server.requests import parse_body
from localspec.server.results import dumps, sse
from localspec.server.upstream.answer import Answer, error_answer, json_answer
from localspec.server.upstream.backend import Plan, Upstream
from localspec.server.upstream.client import UpstreamFailure
from localspec.server.upstream.relay import GENERATION

log = logging.getLogger("localspec.upstream")

LocalState = Callable[[], ApiError | None]  # None: the local model answers; else why not
LocalProps = Callable[[], dict[str, Any]]
_END: Any = object()
BACKEND_HEADER = b"x-localspec-backend"  # who answered: upstream, local or none


def local_probe(local_state: LocalState, has_local: bool) -> LocalState:
    """Whether the local model can answer now (None) or why not."""
    if not has_local:
        return lambda: Unavailable("no local model (backend.fallback = none)")
    return local_state


def ready_probe(upstream: Upstream, local: LocalState) -> LocalState:
    """The gate's probe (and /health): ready while the upstream or the local model answers."""

    def not_ready() -> ApiError | None:
        if upstream.health.usable:
            return None
        why = local()
        if why is None:
            return None
        return Unavailable(upstream.unavailable(_lower(why.message)))

    return not_ready


class Failover:
    def __init__(
        self,
        app: ASGIApp,
        *,
        upstream: Upstream,
        local: LocalState,
        local_props: LocalProps,
        local_model: str | None,
        bodies: dict[tuple[str, str], type[Any]] | None = None,
    ) -> None:
        """``bodies``: the local routes' body models by (method, path), checked before a
        request goes upstream."""
        self.app = app
        self.bodies = bodies or {}
        self.upstream = upstream
        self.local_error = local  # None: the local model answers now; else why not
        self.local_props = local_props
        self.local_model = local_model  # None: no local model at all (fallback none)

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        plan = None
        if scope["type"] == "http":
            plan = self.upstream.plan(scope["method"], scope["path"])
        if plan is None:
            await self.app(scope, receive, send)
            return
        raw = await _body(receive) if scope["method"] == "POST" else b""
        if raw is None:
            return  # the client left while sending
        if plan == "local":
            await self._local(scope, raw, receive, send, plan, reason="")
            return
        if not self.upstream.health.usable:
            reason = self.upstream.health.why_not()
            await self._local(scope, raw, receive, send, plan, reason=reason)
            return
        model = self.bodies.get((scope["method"], scope["path"]))
        if model is not None and scope["path"] in GENERATION:
            try:
                parse_body(model, raw)
            except ApiError as exc:
                _note(scope, backend="none", error=exc.message)
                await _send(error_answer(exc), send, None, scope, self.upstream, b"none")
                return
        await self._upstream(scope, raw, receive, send, plan)

    async def _upstream(
        self, scope: Scope, raw: bytes, receive: Receive, send: Send, plan: Plan
    ) -> None:
        up = self.upstream
        t0 = time.monotonic()
        gone = asyncio.ensure_future(_disconnect(receive))
        task = asyncio.ensure_future(
            up.open(
                plan,
                scope["method"],
                scope["path"],
                scope.get("query_string", b"").decode("latin-1"),
                raw,
            )
        )
        wait = up.cfg.fallback_ms / 1e3 if self._can_fall_back() and up.cfg.fallback_ms else None
        try:
            done, _ = await asyncio.wait(
                {task, gone}, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
            if task not in done:
                await _cancel(task)
                if gone in done:
                    _note(scope, backend="upstream", outcome="client left")
                    return
                up.health.mark_late()
                gone.cancel()
                await self._local(scope, _spent(raw, scope, t0), receive, send, plan, reason="slow")
                return
            try:
                answer = task.result()
            except UpstreamFailure as exc:
                up.failed(exc, started=False)
                gone.cancel()
                log.warning("upstream request failed: %s", exc.message)
                await self._local(
                    scope, _spent(raw, scope, t0), receive, send, plan, reason=exc.reason
                )
                return
            except Exception:  # a bug here: this request goes local (or gets a clean 500)
                log.exception("relaying a request upstream failed")
                gone.cancel()
                await self._local(
                    scope, _spent(raw, scope, t0), receive, send, plan, reason="error"
                )
                return
            if answer.status < 500 and not answer.streamed:
                up.health.mark_answered(completion=scope["path"] in GENERATION)
            up.record(
                "upstream", scope["path"], upstream_s=answer.upstream_ms / 1e3, status=answer.status
            )
            _note(scope, backend="upstream", upstream_ms=round(answer.upstream_ms, 2))
            await _send(answer, send, gone, scope, up)
        finally:
            gone.cancel()
            if not task.done():
                await _cancel(task)

    def _can_fall_back(self) -> bool:
        return self.local_model is not None and self.local_error() is None

    async def _local(
        self,
        scope: Scope,
        raw: bytes,
        receive: Receive,
        send: Send,
        plan: Plan,
        *,
        reason: str,
    ) -> None:
        """The local model answers, or a 503 (501 for a route only it can serve) says why
        nobody does."""
        local = self.local_error()
        if local is not None:
            if plan == "local":
                err: ApiError = NotSupported(
                    f"{scope['path']} needs the model's tokenizer: with backend.kind = openai "
                    "only a local model serves it, and there is none"
                    if self.local_model is None
                    else f"{scope['path']} is served by the local model: {_lower(local.message)}"
                )
            else:  # the upstream's state already holds a request's failure (mark_failed)
                err = Unavailable(self.upstream.unavailable(_lower(local.message)))
            _note(scope, backend="none", fallback=reason or None, error=err.message)
            self.upstream.record("none", scope["path"], status=err.status)
            await _send(error_answer(err), send, None, scope, self.upstream, b"none")
            return
        self.upstream.record("local", scope["path"], reason=reason)
        _note(scope, backend="local", fallback=reason or None)
        if plan == "props":
            body = {**self.local_props(), "backend": self.upstream.info("local")}
            await _send(json_answer(body), send, None, scope, self.upstream, b"local")
            return
        await self.app(scope, replay_body(raw, receive), _tagged(send, b"local"))


def _spent(raw: bytes, scope: Scope, t0: float) -> bytes:
    """A generation body with the time already spent on the upstream (since ``t0``) taken
    off its ``t_max_predict_ms``: the editor's deadline is the request's, so the local model
    answering after the upstream failed or came late gets what is left of it (at least 1 ms:
    0 would mean no limit), not the whole budget again."""
    if scope["path"] not in GENERATION:
        return raw
    try:
        body = pydantic_core.from_json(raw)
    except ValueError:
        return raw
    budget = body.get("t_max_predict_ms") if isinstance(body, dict) else None
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        return raw
    spent_ms = int((time.monotonic() - t0) * 1e3)
    body["t_max_predict_ms"] = max(1, budget - spent_ms)
    return dumps(body)


def _lower(message: str) -> str:
    return message[:1].lower() + message[1:] if message else message


def _note(scope: Scope, **fields: Any) -> None:
    entry = scope.get(LOG_KEY)
    if entry is None:
        return
    for key, value in fields.items():
        if value is None:
            continue
        if key in ("outcome", "error"):
            setattr(entry, key, value)
        else:
            entry.extra[key] = value


async def _body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


async def _send(
    answer: Answer,
    send: Send,
    gone: asyncio.Future[None] | None,
    scope: Scope,
    upstream: Upstream,
    backend: bytes = b"upstream",
) -> None:
    """Write the answer; a stream chunk by chunk, stopped (and the upstream request closed)
    the moment the editor leaves."""
    headers = [
        (b"content-type", answer.content_type),
        (b"server-timing", _timing(answer).encode("latin-1")),
        (BACKEND_HEADER, backend),
        *answer.headers,
    ]
    if answer.chunks is None:
        headers.append((b"content-length", str(len(answer.body)).encode()))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})
        return
    headers.append((b"cache-control", b"no-cache"))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    chunks = answer.chunks.__aiter__()
    try:
        while True:
            step = asyncio.ensure_future(anext(chunks, _END))
            waiting: set[asyncio.Future[Any]] = {step} if gone is None else {step, gone}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if step not in done:
                await _cancel(step)
                _note(scope, outcome="client left")
                return
            try:
                chunk = step.result()
            except UpstreamFailure as exc:  # committed: the editor gets an error event
                upstream.failed(exc, started=True)
                _note(scope, outcome="upstream failed", error=exc.message)
                await _body_part(send, sse(Unavailable(exc.message).body()))
                break
            if chunk is _END:
                if answer.status < 500:
                    upstream.health.mark_answered()
                break
            await _body_part(send, chunk)
        await send({"type": "http.response.body", "body": b""})
    finally:
        await answer.close()


def _timing(answer: Answer) -> str:
    """``upstream;dur=`` (sent to answered, as seen here) and the upstream's own entries
    renamed ``upstream-<name>``: together they split off what the hop itself costs."""
    parts = [f"upstream;dur={answer.upstream_ms:.3f}"]
    for entry in answer.upstream_timing.split(","):
        entry = entry.strip()
        if entry and entry[0].isalpha():
            parts.append(f"upstream-{entry}")
    return ", ".join(parts)


def _tagged(send: Send, backend: bytes) -> Send:
    """``send`` with the header that says who answered (the local routes write their own)."""

    async def tagged(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), (BACKEND_HEADER, backend)]
        await send(message)

    return tagged


async def _body_part(send: Send, chunk: bytes) -> None:
    message: Message = {"type": "http.response.body", "body": chunk, "more_body": True}
    await send(message)
