"""Bridge one HTTP request to the worker: submit, watch for the client leaving, await or stream.

The editor aborts its previous request on every keystroke, so every generation request runs
with a watcher on the ASGI receive channel: the moment the connection closes, the job is
dropped (queued) or cancelled (running; the engine stops within one step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from localspec.engine.types import TokenEvent
from localspec.server.errors import ApiError, InvalidRequest, Unavailable
from localspec.server.results import CompactJSONResponse, FinishedCompletion, dumps, sse
from localspec.server.worker import Job, JobResult, Worker

log = logging.getLogger("localspec.server")

T0_KEY = "localspec.t0"  # set in the ASGI scope by the gate
LOG_KEY = "localspec.log"  # the request's logs.RequestLog, set by the gate

_DONE = object()
_TIMEOUT = object()


def request_t0(request: Request) -> float:
    return request.scope.get(T0_KEY) or time.perf_counter()


def note(request: Request, **fields: Any) -> None:
    """Add to the request's log line (a no-op when the app runs without the gate)."""
    entry = request.scope.get(LOG_KEY)
    if entry is not None:
        for key, value in fields.items():
            setattr(entry, key, value)


def server_timing(
    request: Request, job: Job, result: JobResult | None, t_resumed: float = 0.0
) -> dict[str, str]:
    """A ``Server-Timing`` header splitting the request's wall time inside the process.

    ``parse`` (first byte to queued: body, validation, parameters), ``queue``, ``prep`` (prompt
    assembly), ``engine``, ``post`` (slot bookkeeping, prompt text), ``wake`` (worker to event
    loop), ``render`` (JSON), and ``app``: everything but the engine, the server's overhead.
    """
    t0 = request_t0(request)
    now = time.perf_counter()
    total_ms = (now - t0) * 1e3
    if result is None:
        return {"Server-Timing": f"total;dur={total_ms:.3f}"}
    parts = {
        "parse": (job.t_submit - t0) * 1e3,
        "queue": result.t_queue_ms,
        "prep": result.t_prep_ms,
        "engine": result.t_engine_ms,
        "post": result.t_post_ms,
        "wake": max(0.0, (t_resumed - result.t_done) * 1e3) if t_resumed else 0.0,
        "render": (now - t_resumed) * 1e3 if t_resumed else 0.0,
        "app": total_ms - result.t_engine_ms,
        "total": total_ms,
    }
    return {"Server-Timing": ", ".join(f"{k};dur={v:.3f}" for k, v in parts.items())}


def as_api_error(exc: BaseException) -> ApiError:
    """Any failure of one request, in llama-server's error format (bad input: 400, else 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValueError):
        return InvalidRequest(str(exc))
    log.error("request failed: %s: %s", type(exc).__name__, exc)
    return ApiError(f"{type(exc).__name__}: {exc}")


def error_response(exc: BaseException, request: Request | None = None) -> CompactJSONResponse:
    err = as_api_error(exc)
    if request is not None:
        note(request, error=err.message)
    return CompactJSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _watch_disconnect(request: Request, on_gone: Callable[[], None]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_gone()
            return


class Pending:
    """A job for a request as the event loop sees it: the worker it runs on within
    ``timeout_s``, its future, its token queue, its watcher, and ``on_result`` (log fields,
    metrics) to run with its result."""

    def __init__(
        self,
        request: Request,
        worker: Worker,
        job: Job,
        timeout_s: float,
        on_result: Callable[[JobResult], None] | None = None,
    ) -> None:
        self.request = request
        self.worker = worker
        self.job = job
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.on_result = on_result
        self.client_gone = False
        self.tokens: asyncio.Queue[Any] | None = None
        self.future: asyncio.Future[JobResult] | None = None  # streaming only
        self.watcher: asyncio.Task[None] | None = None

    def enable_streaming(self) -> None:
        """Route the worker's tokens into an asyncio queue (thread-safe hop onto the loop)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.tokens = queue
        self.future = asyncio.wrap_future(self.job.future)

        def sink(index: int, event: TokenEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (index, event))

        self.job.on_token = sink
        self.future.add_done_callback(lambda _f: queue.put_nowait(_DONE))

    def submit(self) -> None:
        # the watcher first: once the job is queued, the less this thread does before the
        # loop goes back to waiting (and releases the GIL), the sooner the worker starts
        self.watcher = asyncio.create_task(_watch_disconnect(self.request, self._gone))
        self.worker.submit(self.job)  # raises Unavailable (503) when full or loading

    def _gone(self) -> None:
        self.client_gone = True
        self.worker.abandon(self.job)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        if not self.job.future.done():
            self.worker.abandon(self.job, "client left")
        if self.future is not None and self.future.done() and not self.future.cancelled():
            self.future.exception()  # retrieved: no "never retrieved" warning

    def _timed_out(self) -> Unavailable:
        self.worker.abandon(self.job, "timed out")
        return Unavailable(f"Request timed out after {self.timeout_s:g} s")

    async def result(self) -> JobResult | None:
        """The job's result, or None when the client left first; raises the job's error.

        One loop future, settled by whichever comes first: the worker (one thread-safe call),
        the disconnect watcher, or the timeout. ``asyncio.wait`` over a wrapped future took
        two more trips through the event loop and a few allocations per request.
        """
        assert self.watcher is not None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Any] = loop.create_future()

        def settle(outcome: Any) -> None:
            if not waiter.done():
                waiter.set_result(outcome)

        def from_worker(future: Future[JobResult]) -> None:  # on the worker thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
                loop.call_soon_threadsafe(settle, future)

        self.watcher.add_done_callback(lambda _task: settle(None))
        timer = loop.call_later(max(0.0, self.deadline - time.monotonic()), settle, _TIMEOUT)
        self.job.future.add_done_callback(from_worker)
        try:
            outcome = await waiter
        finally:
            timer.cancel()
        if outcome is None or self.client_gone:  # (a queued job the client left is settled
            return None  # by the worker's future first: it is still a 499, not its 503)
        if outcome is _TIMEOUT:
            raise self._timed_out()
        return outcome.result()

    async def next_item(self) -> Any:
        """The next streamed (index, event), or _DONE; None when the client left."""
        assert self.tokens is not None and self.watcher is not None
        remaining = max(0.0, self.deadline - time.monotonic())
        getter = asyncio.ensure_future(self.tokens.get())
        done, _ = await asyncio.wait(
            {getter, self.watcher}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
        )
        if getter in done:
            return getter.result()
        getter.cancel()
        if self.watcher in done:
            return None
        raise self._timed_out()


def answered(result: JobResult) -> list[FinishedCompletion]:
    """The job's completions; a 503 when it was dropped before any (superseded, shut down)."""
    if result.cancelled and not result.completions:
        raise Unavailable(f"Request dropped: {result.cancelled}")
    return result.completions


async def respond(pending: Pending, render: Callable[[JobResult], Any]) -> Response:
    """Run a job and answer with ``render(result)`` as compact JSON.

    ``pending.on_result`` runs once the answer is written: the client does not wait for the
    bookkeeping, and it still ends before the gate writes the request's log line.
    """
    request, job, on_result = pending.request, pending.job, pending.on_result
    result: JobResult | None = None
    try:
        pending.submit()
        result = await pending.result()
        t_resumed = time.perf_counter()
        if result is None:
            return Response(status_code=499)  # nobody is listening any more
        body = dumps(render(result))
    except Exception as exc:  # one request's failure never takes the daemon down
        if result is not None and on_result is not None:
            _after(on_result, result)
        return error_response(exc, request)
    finally:
        pending.close()
    return Response(
        body,
        media_type=CompactJSONResponse.media_type,
        headers=server_timing(request, job, result, t_resumed),
        background=None if on_result is None else BackgroundTask(_after_async, on_result, result),
    )


def _after(on_result: Callable[[JobResult], None], result: JobResult) -> None:
    try:
        on_result(result)
    except Exception:  # the answer is out (or an error is): report, never fail the request
        log.exception("recording a finished request failed")


async def _after_async(on_result: Callable[[JobResult], None], result: JobResult) -> None:
    # async: Starlette runs a plain function given as a background task in a thread pool
    _after(on_result, result)


async def respond_stream(
    pending: Pending,
    partial: Callable[[int, TokenEvent], Any],
    final: Callable[[JobResult], list[Any]],
    done_marker: bytes = b"",
) -> Response:
    """``respond`` for ``stream: true``: ``data: {...}`` events, one per token from ``partial``
    (or a list of them, possibly empty), then ``final``'s; an error before the first event is a
    plain error answer."""
    request = pending.request
    pending.enable_streaming()

    def finish() -> list[bytes]:
        assert pending.future is not None
        result = pending.future.result()
        if pending.on_result is not None:
            pending.on_result(result)
        return [sse(obj) for obj in final(result)]

    early_tail: list[bytes] = []
    try:
        pending.submit()
        first = await pending.next_item()
        if first is _DONE:  # nothing streamed: an error here is a plain error answer
            early_tail = finish()
    except Exception as exc:  # one request's failure never takes the daemon down
        pending.close()
        if pending.client_gone:  # dropped from the queue because it left: not a 503
            return Response(status_code=499)
        return error_response(exc, request)
    if first is None:
        pending.close()
        return Response(status_code=499)

    async def events() -> AsyncIterator[bytes]:
        item = first
        ended = False  # still False in ``finally``: the client left (or Starlette cancelled us)
        try:
            while item is not _DONE:
                if item is None:
                    return
                out = partial(*item)  # one event, or a list of them (chat: none, or several)
                for obj in out if isinstance(out, list) else (out,):
                    yield sse(obj)
                item = await pending.next_item()
            try:
                tail = early_tail if first is _DONE else finish()
            except Exception as exc:  # the stream is open: report, do not crash
                ended = True
                err = as_api_error(exc)
                note(request, outcome="error", error=err.message)
                yield sse(err.body())
                return
            for chunk in tail:
                yield chunk
            if done_marker:
                yield done_marker
            ended = True
        except ApiError as exc:  # timed out mid-stream
            ended = True
            note(request, outcome="timed out", error=exc.message)
            yield sse(exc.body())
        finally:
            if not ended:
                note(request, outcome="client left")
            pending.close()

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
